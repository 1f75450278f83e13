#!/usr/bin/env bash
# timeout: 150
# The compose files and the Dockerfile in deploy/ (this machine has no container engine, so
# nothing is built or started; Debian's docker-compose 1.29 validates and normalises files).
#  1. `docker-compose config -q` passes for box-a.yml and box-b.yml with the example env files
#     and with their GPU and RDMA override files, box-a.yml also with no env file; any stderr
#     output fails the check.
#  2. The normalised config has what a box needs: host networking, unlimited memlock, the
#     gateway healthcheck on /health, scalable owners (no container_name, no ports, a slot
#     dir), GPU reservations and /dev/infiniband in the overrides.
#  3. The check fails on broken input: an unknown key, and box-b.yml without MM_ROUTER.
#  4. The Dockerfile's build stage installs every -dev package of the Makefile's DEB_PKGS, and
#     its runtime stage every package that owns a shared library the built binaries load.
set -u
BIN=${BIN:-build/bin}
fail=0
bad() { echo "FAIL: $*"; fail=1; }
here=$(pwd)
dir=$here/deploy/compose

command -v docker-compose >/dev/null || { echo "SKIP: docker-compose not installed (make deps installs it)"; exit 77; }
command -v python3 >/dev/null || { echo "SKIP: python3 not installed"; exit 77; }
python3 -c 'import yaml' 2>/dev/null || { echo "SKIP: python3-yaml not installed"; exit 77; }

tmp=$(mktemp -d /tmp/mm-compose.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# dc NAME ARGS...: docker-compose ARGS, in the background and in a clean environment (the
# caller's MM_* variables must not leak into the substitution); stdout, stderr and status go to
# $tmp/NAME.out, .err, .rc. The runs are independent, so they overlap (python start-up is most
# of their cost).
dc() {
    local n=$1; shift
    (cd "$tmp" && env -i PATH="$PATH" HOME="$tmp" docker-compose --project-directory "$dir" "$@" \
        >"$tmp/$n.out" 2>"$tmp/$n.err"; echo $? >"$tmp/$n.rc") &
}
# dc_ok NAME: status 0 and nothing at all on stderr (warnings count as failures).
dc_ok() { [ "$(cat "$tmp/$1.rc")" = 0 ] && [ ! -s "$tmp/$1.err" ]; }
dc_show() { echo "    docker-compose ($1): rc=$(cat "$tmp/$1.rc")"; sed 's/^/    | /' "$tmp/$1.err"; }

files=$(cd "$dir" && ls *.yml | sort | tr '\n' ' ')
[ "$files" = "box-a.gpu.yml box-a.rdma.yml box-a.yml box-b.gpu.yml box-b.rdma.yml box-b.yml " ] ||
    bad "unexpected compose files in deploy/compose: $files"
sed 's/^  gateway:$/  gateway:\n    bogus_key: 1/' "$dir/box-a.yml" >"$tmp/broken.yml"
grep -q bogus_key "$tmp/broken.yml" || bad "could not build the broken compose file"
for box in box-a box-b; do
    dc "$box-q" --env-file "$dir/$box.env.example" -f "$dir/$box.yml" config -q
    dc "$box-full" --env-file "$dir/$box.env.example" -f "$dir/$box.yml" -f "$dir/$box.gpu.yml" -f "$dir/$box.rdma.yml" config
done
dc box-a-bare -f "$dir/box-a.yml" config -q           # one box, no env file at all
dc broken -f "$tmp/broken.yml" config -q              # must fail: unknown key
dc no-router -f "$dir/box-b.yml" config -q            # must fail: MM_ROUTER unset
wait

# 1. Every compose file passes: the bases alone (config -q, as the issue asks) and with their
# GPU and RDMA overrides; box A also with no env file.
for n in box-a-q box-b-q box-a-full box-b-full box-a-bare; do
    if dc_ok $n; then echo "ok: docker-compose config ($n)"; else dc_show $n; bad "docker-compose config ($n)"; fi
done
for box in box-a box-b; do
    cp "$tmp/$box-full.out" "$tmp/$box.full.json"
    grep -qE '^ *(devices|deploy):' "$dir/$box.yml" && bad "$box.yml has devices/GPUs in the base file (they belong in the overrides)"
done

# 2. What the normalised configs must contain.
python3 - "$tmp" <<'EOF' || fail=1
import sys, yaml
tmp = sys.argv[1]
errors = []
def load(name):
    with open(f"{tmp}/{name}.json") as f:
        return yaml.safe_load(f)
want_services = {"box-a": {"router", "gateway", "attention", "expert", "drafter"}, "box-b": {"expert", "drafter"}}
for box, want in want_services.items():
    for variant in (".full",):
        cfg = load(box + variant)
        svcs = cfg.get("services", {})
        if set(svcs) != want:
            errors.append(f"{box}{variant}: services {sorted(svcs)}, expected {sorted(want)}")
        for name, s in svcs.items():
            where = f"{box}{variant} {name}"
            if s.get("network_mode") != "host":
                errors.append(f"{where}: network_mode is {s.get('network_mode')!r}, not host")
            ml = s.get("ulimits", {}).get("memlock", {})
            if not (isinstance(ml, dict) and ml.get("soft") == -1 and ml.get("hard") == -1) and ml != -1:
                errors.append(f"{where}: memlock ulimit is {ml!r}, not -1")
            if s.get("command", [None])[0] != name:
                errors.append(f"{where}: command {s.get('command')!r} does not start role {name}")
            if "container_name" in s or "ports" in s:
                errors.append(f"{where}: container_name/ports prevent --scale")
            if s.get("restart") != "on-failure":
                errors.append(f"{where}: restart is {s.get('restart')!r}")
            env = s.get("environment", {})
            if name in ("attention", "expert") and env.get("MM_SLOT_DIR") != "/run/moemesh/slots":
                errors.append(f"{where}: no MM_SLOT_DIR, so scaled containers cannot claim instance numbers")
            vols = [v if isinstance(v, str) else f"{v.get('source')}:{v.get('target')}" for v in s.get("volumes", [])]
            if not any(v.startswith("run:/run/moemesh") for v in vols):
                errors.append(f"{where}: the shared run volume is not mounted at /run/moemesh: {vols}")
            if variant == ".full" and name != "gateway":   # the gateway needs no GPU or RDMA
                devs = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
                if not any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devs):
                    errors.append(f"{where}: no nvidia GPU reservation with the gpu override")
                if not any(str(d).startswith("/dev/infiniband") for d in s.get("devices", [])):
                    errors.append(f"{where}: no /dev/infiniband with the rdma override")
        # box A's drafter is for one box only; on two boxes it runs on box B
        if box == "box-a" and svcs.get("drafter", {}).get("profiles") != ["onebox"]:
            errors.append(f"{box}{variant} drafter: not limited to the onebox profile")
        gw = svcs.get("gateway")
        if gw is not None:
            test = " ".join(gw.get("healthcheck", {}).get("test", []))
            if "/health" not in test or "curl" not in test:
                errors.append(f"{box}{variant} gateway: healthcheck {test!r} does not GET /health")
cfg = load("box-b.full")
env = cfg["services"]["expert"]["environment"]
if env.get("MM_ROUTER") != "tcp://10.0.0.1:7100" or env.get("MM_DATA") != "tcp://10.0.0.2:{i+7400}" \
        or env.get("MM_INSTANCE_BASE") != "4":
    errors.append(f"box-b expert: example env not applied as documented: {env}")
for e in errors:
    print("FAIL:", e)
if not errors:
    print("ok: normalised compose configs have host networking, memlock, healthcheck, slots, overrides")
sys.exit(1 if errors else 0)
EOF

# 3. Negative checks: the validation must be able to fail.
if dc_ok broken || [ "$(cat "$tmp/broken.rc")" = 0 ]; then bad "docker-compose config accepted an unknown key"
elif grep -q bogus_key "$tmp/broken.err"; then echo "ok: a compose file with an unknown key is rejected"
else dc_show broken; bad "the unknown key was rejected without naming it"; fi
if [ "$(cat "$tmp/no-router.rc")" = 0 ]; then bad "box-b.yml accepted a missing MM_ROUTER"
elif grep -q "set MM_ROUTER" "$tmp/no-router.err"; then echo "ok: box-b.yml without MM_ROUTER fails naming it"
else dc_show no-router; bad "box-b.yml without MM_ROUTER failed without naming MM_ROUTER"; fi

# 4. Dockerfile package lists against the Makefile and the built binaries.
df=$here/deploy/Dockerfile
[ "$(grep -c '^FROM ' "$df")" = 2 ] || bad "Dockerfile is not two-stage"
grep -q '^FROM debian:12 AS build$' "$df" || bad "Dockerfile build stage is not debian:12"
grep -q '^FROM debian:12-slim$' "$df" || bad "Dockerfile runtime stage is not debian:12-slim"
# Package names of stage N (1 or 2): the words of its apt-get install line(s).
stage_pkgs() {
    awk -v n="$1" '/^FROM /{s++} s==n' "$df" |
        sed -n '/apt-get install/,/rm -rf/p' | tr ' \\' '\n\n' |
        grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vE '^(apt-get|install|rm|update|y|DEBIAN_FRONTEND)$' | sort -u
}
build_pkgs=$(stage_pkgs 1)
run_pkgs=$(stage_pkgs 2)
deb_pkgs=$(sed -n '/^DEB_PKGS :=/,/^$/p' Makefile | tr ' \\' '\n\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -v DEB_PKGS)
[ -n "$deb_pkgs" ] || bad "could not read DEB_PKGS from the Makefile"
for p in $deb_pkgs; do
    case $p in
        *-dev|build-essential|pkg-config|protobuf-c-compiler)
            grep -qx "$p" <<<"$build_pkgs" || bad "Makefile DEB_PKGS has $p but the Dockerfile build stage does not install it" ;;
    esac
done
for b in "$BIN"/moemesh "$BIN"/moemesh-*; do
    [ -x "$b" ] || continue
    ldd "$b" | awk '/=> \//{print $3}'
done | sort -u >"$tmp/libs"
[ -s "$tmp/libs" ] || bad "ldd found no shared libraries in $BIN (not built?)"
# What apt installs for the runtime list: the listed packages and, recursively, their
# dependencies as this machine's dpkg knows them (the same Debian 12 packages as the image).
# Which package owns each library: one `dpkg -S` over all of them.
echo "$run_pkgs" >"$tmp/run_pkgs"
dpkg-query -W -f='${Package}\t${Depends}, ${Pre-Depends}\n' >"$tmp/depends" 2>/dev/null
dpkg -S $(sed 's#.*/#*/#' "$tmp/libs") >"$tmp/owners" 2>/dev/null
python3 - "$tmp" <<'PYEOF' || fail=1
import re, sys
tmp = sys.argv[1]
deps = {}
for line in open(f"{tmp}/depends"):
    pkg, _, rest = line.rstrip("\n").partition("\t")
    names = set()
    for alt in re.split(r"[,|]", rest):
        name = re.sub(r"\(.*?\)|:any", "", alt).strip()
        if name:
            names.add(name)
    deps[pkg] = names
closure = set(open(f"{tmp}/run_pkgs").read().split())
frontier = list(closure)
while frontier:
    p = frontier.pop()
    for d in deps.get(p, ()):
        if d not in closure:
            closure.add(d)
            frontier.append(d)
owners = {}
for line in open(f"{tmp}/owners"):
    pkgs, _, path = line.rstrip("\n").partition(": ")
    base = path.rsplit("/", 1)[-1]
    for p in pkgs.split(", "):
        owners.setdefault(base, set()).add(p.split(":")[0])
bad = 0
for lib in open(f"{tmp}/libs").read().split():
    base = lib.rsplit("/", 1)[-1]
    pkgs = owners.get(base, set())
    if not pkgs:
        print(f"FAIL: no Debian package owns {lib} (linked by the binaries)"); bad = 1; continue
    if pkgs & {"libc6", "libgcc-s1", "libstdc++6"}:
        continue  # in debian:12-slim already
    if any(re.fullmatch(r"lib(a|ub|l|t|hwa)san[0-9]*", p) for p in pkgs):
        continue  # sanitizer runtime of `make asan`/`make ubsan` builds; the image has none
    if pkgs & closure:
        print(f"ok: runtime stage provides {'/'.join(sorted(pkgs & closure))} ({lib})")
    else:
        print(f"FAIL: the binaries load {lib} from package {'/'.join(sorted(pkgs))}, which the Dockerfile runtime stage does not install")
        bad = 1
sys.exit(bad)
PYEOF

[ $fail -eq 0 ] && echo "compose: all checks passed"
exit $fail

#!/usr/bin/env bash
# timeout: 150
# The compose files and the Dockerfile in deploy/ (this machine has no container engine, so
# nothing is built or started; Debian's docker-compose 1.29 validates and normalises files).
#  1. `docker-compose config -q` passes for box-a.yml and box-b.yml, alone and with their GPU
#     and RDMA override files, with the example env files; any stderr output fails the check.
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

# compose_ok OUT ARGS...: docker-compose ARGS config, rc 0 and empty stderr; config to OUT.
compose_ok() {
    local out=$1; shift
    local rc=0
    (cd "$tmp" && docker-compose --project-directory "$dir" "$@" config) >"$out" 2>"$tmp/err" || rc=$?
    if [ $rc -ne 0 ] || [ -s "$tmp/err" ]; then
        echo "docker-compose $*: rc=$rc"; sed 's/^/    /' "$tmp/err"
        return 1
    fi
    return 0
}

# 1. Every compose file, with and without overrides; config -q as the issue asks, too.
files=$(cd "$dir" && ls *.yml | sort | tr '\n' ' ')
[ "$files" = "box-a.gpu.yml box-a.rdma.yml box-a.yml box-b.gpu.yml box-b.rdma.yml box-b.yml " ] ||
    bad "unexpected compose files in deploy/compose: $files"
for box in box-a box-b; do
    env=(--env-file "$dir/$box.env.example")
    if (cd "$tmp" && docker-compose --project-directory "$dir" "${env[@]}" -f "$dir/$box.yml" config -q) 2>"$tmp/err" && [ ! -s "$tmp/err" ]; then
        echo "ok: docker-compose config -q $box.yml"
    else
        sed 's/^/    /' "$tmp/err"; bad "docker-compose config -q $box.yml"
    fi
    compose_ok "$tmp/$box.json" "${env[@]}" -f "$dir/$box.yml" || bad "$box.yml"
    compose_ok "$tmp/$box.full.json" "${env[@]}" -f "$dir/$box.yml" -f "$dir/$box.gpu.yml" -f "$dir/$box.rdma.yml" ||
        bad "$box.yml with $box.gpu.yml and $box.rdma.yml"
done
# Box A also works with no env file at all (one box, defaults).
compose_ok "$tmp/box-a.bare.json" -f "$dir/box-a.yml" || bad "box-a.yml without an env file"

# 2. What the normalised configs must contain.
python3 - "$tmp" <<'EOF' || fail=1
import sys, yaml
tmp = sys.argv[1]
errors = []
def load(name):
    with open(f"{tmp}/{name}.json") as f:
        return yaml.safe_load(f)
want_services = {"box-a": {"router", "gateway", "attention", "expert"}, "box-b": {"expert", "drafter"}}
for box, want in want_services.items():
    for variant in ("", ".full"):
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
            elif variant != ".full" and ("devices" in s or "deploy" in s):
                errors.append(f"{where}: devices/GPUs in the base file (they belong in the overrides)")
        gw = svcs.get("gateway")
        if gw is not None:
            test = " ".join(gw.get("healthcheck", {}).get("test", []))
            if "/health" not in test or "curl" not in test:
                errors.append(f"{box}{variant} gateway: healthcheck {test!r} does not GET /health")
cfg = load("box-b")
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
sed 's/^  gateway:$/  gateway:\n    bogus_key: 1/' "$dir/box-a.yml" >"$tmp/broken.yml"
grep -q bogus_key "$tmp/broken.yml" || bad "could not build the broken compose file"
if compose_ok "$tmp/x" -f "$tmp/broken.yml" >/dev/null; then
    bad "docker-compose config accepted an unknown key"
else echo "ok: a compose file with an unknown key is rejected"; fi
if (cd "$tmp" && env -u MM_ROUTER docker-compose --project-directory "$dir" -f "$dir/box-b.yml" config -q) >/dev/null 2>"$tmp/err"; then
    bad "box-b.yml accepted a missing MM_ROUTER"
elif grep -q "set MM_ROUTER" "$tmp/err"; then echo "ok: box-b.yml without MM_ROUTER fails naming it"
else sed 's/^/    /' "$tmp/err"; bad "box-b.yml without MM_ROUTER failed without naming MM_ROUTER"; fi

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
# dependencies as this machine's dpkg knows them (same Debian 12 packages as the image).
run_closure=$run_pkgs
frontier=$run_pkgs
for _ in 1 2 3 4 5 6; do
    next=$(for p in $frontier; do dpkg-query -W -f='${Depends},${Pre-Depends}\n' "$p" 2>/dev/null; done |
        tr ',|' '\n\n' | sed 's/([^)]*)//g; s/:any//; s/^ *//; s/ *$//' | grep -E '^[a-z0-9]' | sort -u |
        grep -vxF -f <(echo "$run_closure") || true)
    [ -n "$next" ] || break
    run_closure=$(printf '%s\n%s\n' "$run_closure" "$next" | sort -u)
    frontier=$next
done
while read -r lib; do
    real=$(readlink -f "$lib")
    pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || dpkg -S "*/$(basename "$lib")" 2>/dev/null || true)
    pkg=$(head -n1 <<<"$pkg" | cut -d: -f1)
    if [ -z "$pkg" ]; then bad "no Debian package owns $lib (linked by the binaries)"; continue; fi
    case $pkg in libc6|libgcc-s1|libstdc++6) continue ;; esac   # in debian:12-slim already
    if grep -qx "$pkg" <<<"$run_closure"; then echo "ok: runtime stage provides $pkg ($lib)"
    else bad "the binaries load $lib from package $pkg, which the Dockerfile runtime stage does not install"; fi
done <"$tmp/libs"

[ $fail -eq 0 ] && echo "compose: all checks passed"
exit $fail

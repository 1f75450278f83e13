#!/usr/bin/env bash
# timeout: 120
# The systemd units in deploy/systemd: installed with deploy/install.sh into a temporary
# prefix (so ExecStart= names real, built binaries), then `systemd-analyze verify` on every
# unit, failing on a non-zero status AND on any output to stderr (an unknown key or a bad
# value only warns, with status 0). The check itself is tested: a unit with a bogus key, one
# with a bad Restart= value and one whose binary is missing must each fail it. Also: every
# service carries the hardening and restart settings, the sysusers entry parses, and the
# installed launcher really starts the installed daemons.
set -u
BIN=${BIN:-build/bin}
fail=0
bad() { echo "FAIL: $*"; fail=1; }

command -v systemd-analyze >/dev/null || { echo "SKIP: systemd-analyze not installed (make deps installs systemd)"; exit 77; }
for d in gateway router attention expert drafter; do
    [ -x "$BIN/moemesh-$d" ] || { echo "FAIL: $BIN/moemesh-$d is missing (run make)"; exit 1; }
done

tmp=$(mktemp -d /tmp/mm-units.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# verify_unit FILE: 0 only when systemd-analyze verify exits 0 and prints nothing on stderr.
# Templates are checked as an instance (NAME@0.service), which is how they are started.
verify_unit() {
    local f=$1 dir base arg
    dir=$(dirname "$f") base=$(basename "$f")
    arg=$dir/${base/@./@0.}
    local rc=0
    (cd "$tmp" && SYSTEMD_LOG_COLOR=0 systemd-analyze verify "$arg") >"$tmp/out" 2>"$tmp/err" || rc=$?
    if [ $rc -ne 0 ] || [ -s "$tmp/err" ]; then
        echo "verify $base: rc=$rc"
        sed 's/^/    /' "$tmp/err"
        return 1
    fi
    return 0
}

# 1. Install into a throwaway prefix: the units get ExecStart=$tmp/prefix/bin/moemesh-launch.
prefix=$tmp/prefix
if ! BIN=$BIN PREFIX=$prefix UNITDIR=$tmp/units SYSUSERSDIR=$tmp/sysusers CONFDIR=$tmp/etc \
        bash deploy/install.sh >"$tmp/install.log" 2>&1; then
    cat "$tmp/install.log"; bad "deploy/install.sh failed"
    exit 1
fi
units=("$tmp"/units/*.service "$tmp"/units/*.target)
want="moemesh-attention@.service moemesh-drafter.service moemesh-expert@.service moemesh-gateway.service moemesh-router.service moemesh.target"
got=$(for u in "${units[@]}"; do basename "$u"; done | sort | tr '\n' ' ' | sed 's/ $//')
[ "$got" = "$want" ] || bad "installed units are '$got', expected '$want'"
for u in "${units[@]}"; do
    grep -q "/usr/local" "$u" && bad "$(basename "$u") still names /usr/local after install with PREFIX=$prefix"
    if verify_unit "$u"; then echo "ok: verify $(basename "$u")"; else bad "systemd-analyze verify $(basename "$u")"; fi
done
for b in moemesh moemesh-launch moemesh-gateway moemesh-router moemesh-attention moemesh-expert moemesh-drafter; do
    [ -x "$prefix/bin/$b" ] || bad "install did not put an executable $prefix/bin/$b"
done
[ -f "$prefix/share/doc/moemesh/OPERATIONS.md" ] || bad "install did not put OPERATIONS.md into share/doc"
[ -f "$prefix/share/moemesh/templates/deepseek-v3-tools.jinja" ] ||
    bad "install did not put the chat templates into share/moemesh/templates"
[ -f "$tmp/etc/moemesh.env.example" ] || bad "install did not put moemesh.env.example into CONFDIR"

# 2. Settings every service must carry (the issue's hardening list, restart, memlock, env files).
for u in "$tmp"/units/*.service; do
    n=$(basename "$u")
    for kv in User=moemesh Group=moemesh NoNewPrivileges=yes ProtectSystem=strict ProtectHome=yes \
              PrivateTmp=yes RuntimeDirectory=moemesh RuntimeDirectoryPreserve=yes \
              LimitMEMLOCK=infinity Restart=on-failure PartOf=moemesh.target \
              WantedBy=moemesh.target ReadOnlyPaths=-/srv/moemesh \
              EnvironmentFile=/etc/moemesh/moemesh.env StandardOutput=journal \
              "RestartPreventExitStatus=2 3"; do
        grep -qx "$kv" "$u" || bad "$n lacks $kv"
    done
    grep -q '^RestartSec=' "$u" || bad "$n lacks RestartSec="
    grep -q "^ExecStart=$prefix/bin/moemesh-launch " "$u" || bad "$n: ExecStart does not run $prefix/bin/moemesh-launch"
    case $n in
        moemesh-router.service) grep -q '^After=moemesh-router' "$u" && bad "$n orders itself after the router" ;;
        *) grep -qx 'After=moemesh-router.service' "$u" || bad "$n is not ordered after the router" ;;
    esac
    case $n in
        *@.service)
            role=${n#moemesh-}; role=${role%@.service}
            grep -qx "ExecStart=$prefix/bin/moemesh-launch $role@%i" "$u" || bad "$n does not pass $role@%i to the launcher"
            grep -qx "EnvironmentFile=-/etc/moemesh/$role-%i.env" "$u" || bad "$n lacks its per-instance env file" ;;
    esac
done

# 3. The check must fail on broken units (else it proves nothing).
base=$tmp/units/moemesh-expert@.service
mkdir -p "$tmp/broken"
sed 's/^Type=exec$/Type=exec\nBogusKey=1/' "$base" >"$tmp/broken/moemesh-expert@.service"
grep -q '^BogusKey=1' "$tmp/broken/moemesh-expert@.service" || bad "could not build the bogus-key unit"
if verify_unit "$tmp/broken/moemesh-expert@.service" >/dev/null; then
    bad "verify_unit accepted a unit with an unknown key"
else echo "ok: a unit with an unknown key is rejected"; fi
sed 's/^Restart=on-failure$/Restart=sometimes/' "$tmp/units/moemesh-router.service" >"$tmp/broken/moemesh-router.service"
if verify_unit "$tmp/broken/moemesh-router.service" >/dev/null; then
    bad "verify_unit accepted Restart=sometimes"
else echo "ok: a unit with a bad Restart= value is rejected"; fi
sed "s#$prefix/bin/moemesh-launch#$tmp/nonexistent/moemesh-launch#" "$tmp/units/moemesh-gateway.service" >"$tmp/broken/moemesh-gateway.service"
if verify_unit "$tmp/broken/moemesh-gateway.service" >/dev/null; then
    bad "verify_unit accepted a unit whose ExecStart binary is missing"
else echo "ok: a unit with a missing binary is rejected"; fi

# 4. The sysusers entry parses and creates the moemesh user (dry run into a scratch root).
if command -v systemd-sysusers >/dev/null; then
    mkdir -p "$tmp/root/etc"
    if out=$(systemd-sysusers --root="$tmp/root" "$tmp/sysusers/moemesh.conf" 2>&1); then
        grep -q '^moemesh:' "$tmp/root/etc/passwd" 2>/dev/null || bad "systemd-sysusers did not create moemesh: $out"
        [ -z "$out" ] || echo "note: systemd-sysusers said: $out"
    else
        bad "systemd-sysusers rejected moemesh.conf: $out"
    fi
fi

# 5. The installed launcher starts the installed daemons (--help exits 0 for each role).
for spec in gateway router attention@1 expert@3 drafter; do
    if ! env -i PATH=/usr/bin:/bin "$prefix/bin/moemesh-launch" "$spec" --help >"$tmp/help" 2>&1; then
        sed 's/^/    /' "$tmp/help"; bad "moemesh-launch $spec --help failed"
    fi
done

[ $fail -eq 0 ] && echo "units: all checks passed"
exit $fail

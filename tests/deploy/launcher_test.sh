#!/usr/bin/env bash
# timeout: 60
# deploy/moemesh-launch (the ExecStart of every unit and the image's entrypoint), run with
# stand-in daemons that print their environment and arguments: instance numbers from ROLE@N,
# MM_INSTANCE and flock'ed slots (two live claimants never share a number; a freed number is
# reused), {i}/{i+K}/{i%K} placeholders, the one-box defaults, and clear errors (status 2)
# for every kind of bad input. Runs under dash when present, as the units and image do.
set -u
fail=0
bad() { echo "FAIL: $*"; fail=1; }
launch=$(pwd)/deploy/moemesh-launch
sh=$(command -v dash || command -v sh)

tmp=$(mktemp -d /tmp/mm-launch.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

mkdir -p "$tmp/bin" "$tmp/slots"
for r in gateway router attention expert drafter; do
    cat >"$tmp/bin/moemesh-$r" <<'EOF'
#!/bin/sh
# stand-in daemon: report, then optionally stay alive until $STAY_FILE disappears
env | grep '^MM_' | sort
echo "ARGS=$*"
if [ -n "${STAY_FILE:-}" ]; then
    while [ -e "$STAY_FILE" ]; do sleep 0.05; done
fi
EOF
    chmod +x "$tmp/bin/moemesh-$r"
done

# run OUTFILE ENV... -- ARGS...: the launcher in a clean environment; returns its status.
run() {
    local out=$1; shift
    local envs=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    env -i PATH=/usr/bin:/bin MM_BIN_DIR="$tmp/bin" "${envs[@]}" "$sh" "$launch" "$@" >"$out" 2>&1
}
has() { grep -qxF "$2" "$1" || { bad "$3: expected line '$2' in: $(tr '\n' ' ' <"$1")"; return 1; }; }

# 1. ROLE@N, placeholders, defaults, arguments passed through.
if run "$tmp/o" MM_DATA='tcp://10.0.0.2:{i+7400}' MM_DEVICE='cuda:{i%4}' MM_X='a{i}b{i}c' -- expert@7 --foo 'bar baz'; then
    has "$tmp/o" "MM_INSTANCE=7" "expert@7"
    has "$tmp/o" "MM_DATA=tcp://10.0.0.2:7407" "{i+K}"
    has "$tmp/o" "MM_DEVICE=cuda:3" "{i%K}"
    has "$tmp/o" "MM_X=a7b7c" "two {i} in one value"
    has "$tmp/o" "MM_LISTEN=ipc:///run/moemesh/expert-7.ctl" "default MM_LISTEN"
    has "$tmp/o" "MM_ROUTER=ipc:///run/moemesh/router.ctl" "default MM_ROUTER"
    has "$tmp/o" "ARGS=--foo bar baz" "arguments"
else bad "expert@7 failed: $(cat "$tmp/o")"; fi

# Role defaults: the router gets no MM_LISTEN (it listens on MM_ROUTER), the gateway no MM_DATA,
# an empty value counts as unset, and set values are kept.
run "$tmp/o" MM_ROUTER=tcp://10.0.0.1:7100 -- router || bad "router failed: $(cat "$tmp/o")"
grep -q '^MM_LISTEN=' "$tmp/o" && bad "router got a default MM_LISTEN (it must listen on MM_ROUTER)"
has "$tmp/o" "MM_ROUTER=tcp://10.0.0.1:7100" "router keeps MM_ROUTER"
grep -q '^MM_INSTANCE=' "$tmp/o" && bad "router got an MM_INSTANCE"
run "$tmp/o" MM_DATA= MM_LISTEN=tcp://1.2.3.4:7101 -- gateway || bad "gateway failed: $(cat "$tmp/o")"
grep -q '^MM_DATA=' "$tmp/o" && bad "gateway got an MM_DATA"
has "$tmp/o" "MM_LISTEN=tcp://1.2.3.4:7101" "gateway keeps MM_LISTEN"
run "$tmp/o" MM_DATA= -- drafter || bad "drafter failed: $(cat "$tmp/o")"
has "$tmp/o" "MM_DATA=shm://moemesh-drafter-0" "empty MM_DATA gets the default"
run "$tmp/o" MM_INSTANCE=12 -- attention || bad "attention with MM_INSTANCE failed: $(cat "$tmp/o")"
has "$tmp/o" "MM_INSTANCE=12" "MM_INSTANCE"
run "$tmp/o" MM_INSTANCE=12 -- attention@2 || bad "attention@2 failed"
has "$tmp/o" "MM_INSTANCE=2" "ROLE@N wins over MM_INSTANCE"

# 2. Errors: status 2 and a message naming the problem.
expect_err() { # message-substring ENV... -- ARGS...
    local want=$1; shift
    local rc=0
    run "$tmp/e" "$@" || rc=$?
    if [ $rc -ne 2 ]; then bad "expected status 2 for [$*], got $rc: $(cat "$tmp/e")"
    elif ! grep -qF -- "$want" "$tmp/e"; then bad "error for [$*] does not say '$want': $(cat "$tmp/e")"
    else echo "ok: [$*] -> $(head -n1 "$tmp/e")"; fi
}
expect_err "unknown role 'bogus'" -- bogus
expect_err "usage:" --
expect_err "takes no instance number" -- router@1
expect_err "not a non-negative decimal" -- expert@x
expect_err "not a non-negative decimal" -- expert@-1
expect_err "not a non-negative decimal" -- expert@07
expect_err "MM_INSTANCE='abc'" MM_INSTANCE=abc -- expert
expect_err "needs an instance number" -- expert
expect_err "MM_DATA='tcp://h:{i-1}': malformed placeholder" 'MM_DATA=tcp://h:{i-1}' -- expert@1
expect_err "MM_DATA: '{i+x}'" 'MM_DATA=tcp://h:{i+x}' -- expert@1
expect_err "positive decimal K" 'MM_DEVICE=cuda:{i%0}' -- expert@1
expect_err "MM_LISTEN uses a {i} placeholder but role 'router'" 'MM_LISTEN=tcp://h:{i+1}' -- router
expect_err "is missing or not executable" MM_BIN_DIR="$tmp/nowhere" -- router
expect_err "MM_SLOT_DIR=$tmp/absent is not a directory" MM_SLOT_DIR="$tmp/absent" -- expert
expect_err "is below MM_INSTANCE_BASE" MM_SLOT_DIR="$tmp/slots" MM_INSTANCE_BASE=5 MM_INSTANCE_MAX=4 -- expert

# 3. Slots: live claimants get distinct numbers from the base up; when the range is full the
# next one fails clearly; a number whose daemon ended is handed out again.
stay=$tmp/stay
touch "$stay"
for k in 0 1 2; do
    run "$tmp/claim$k" MM_SLOT_DIR="$tmp/slots" MM_INSTANCE_BASE=4 MM_INSTANCE_MAX=6 STAY_FILE="$stay" -- expert &
    pids+=($!)
done
# wait until all three report their instance (bounded: 10 s)
for _ in $(seq 200); do
    n=$(cat "$tmp"/claim[0-9] 2>/dev/null | grep -c '^MM_INSTANCE=')
    [ "$n" -ge 3 ] && break
    sleep 0.05
done
got=$(cat "$tmp"/claim[0-9] | sed -n 's/^MM_INSTANCE=//p' | sort -n | tr '\n' ' ')
[ "$got" = "4 5 6 " ] && echo "ok: three concurrent owners got slots $got" || bad "three concurrent claims got '$got', expected '4 5 6 '"
expect_err "no free expert slot in $tmp/slots between 4 and 6" MM_SLOT_DIR="$tmp/slots" MM_INSTANCE_BASE=4 MM_INSTANCE_MAX=6 -- expert
rm -f "$stay"
for p in "${pids[@]}"; do wait "$p" || bad "a slot holder exited with $?"; done
pids=()
if run "$tmp/o" MM_SLOT_DIR="$tmp/slots" MM_INSTANCE_BASE=4 MM_INSTANCE_MAX=6 -- expert; then
    has "$tmp/o" "MM_INSTANCE=4" "freed slot reused" && echo "ok: a freed slot is claimed again"
else bad "claim after release failed: $(cat "$tmp/o")"; fi
# The slot is kept by the daemon itself (fd inherited across exec), not by the shell.
touch "$stay"
run "$tmp/hold" MM_SLOT_DIR="$tmp/slots" STAY_FILE="$stay" -- attention &
pids+=($!)
for _ in $(seq 200); do grep -q '^MM_INSTANCE=' "$tmp/hold" 2>/dev/null && break; sleep 0.05; done
if flock -n "$tmp/slots/attention-0.lock" true; then bad "attention-0.lock is not held while the daemon runs"
else echo "ok: the running daemon holds its slot lock"; fi
rm -f "$stay"
wait "${pids[@]}" 2>/dev/null
pids=()
flock -n "$tmp/slots/attention-0.lock" true || bad "attention-0.lock still held after the daemon exited"

[ $fail -eq 0 ] && echo "launcher: all checks passed"
exit $fail

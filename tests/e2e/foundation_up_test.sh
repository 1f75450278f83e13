#!/usr/bin/env bash
# timeout: 120
# `moemesh up` on a private run dir and port: /health 200 with five roles, `moemesh status`,
# a killed daemon is restarted by the supervisor, SIGTERM to up leaves no process behind, and
# kill -9 of up takes its children with it (PR_SET_PDEATHSIG).
set -u
source tests/e2e/foundation_lib.sh

leftovers() { pgrep -f -- "$RUN/" | grep -v "^$$\$" || true; }

start up "$BIN/moemesh" up --model "$MODEL" --owners 2 --port "$PORT" --run-dir "$RUN"
t=$(wait_health 200 30) || fail "/health never 200 ($t)"
echo "ok mesh up, /health 200 after ${t} ms"
snap
# /health is 200 once the serving path is up; the drafter (not on that path) and the second
# owner may still be joining then, later on a loaded machine: up to 10 s for every role
all_up() {
    for r in gateway router attention expert drafter; do [ "$(fact up.$r)" -ge 1 ] 2>/dev/null || return 1; done
    [ "$(fact up.expert)" = 2 ]
}
for _ in $(seq 1 50); do all_up && break; sleep 0.2; http_code >/dev/null; snap; done
for r in gateway router attention expert drafter; do
    [ "$(fact up.$r)" -ge 1 ] || fail "role $r not up"
done
[ "$(fact up.expert)" = 2 ] || fail "expected two expert owners"

"$BIN/moemesh" status --router "$ROUTER" >"$RUN/status.out" || fail "moemesh status exited $?"
for r in gateway router attention expert drafter; do
    grep -q "^$r " "$RUN/status.out" || fail "status lacks $r"
done
grep -q "model sha256:" "$RUN/status.out" || fail "status lacks the identity"
echo "ok moemesh status lists every daemon"
"$BIN/moemesh" status --router "ipc://$RUN/nobody.ctl" --timeout-ms 300 >/dev/null 2>&1
[ $? -eq 2 ] || fail "status of a missing router should exit 2"

# A second `up` on the same run dir refuses to start a second mesh.
"$BIN/moemesh" up --model "$MODEL" --port $((PORT + 1)) --run-dir "$RUN" 2>"$RUN/up2.log"
[ $? -ne 0 ] && grep -q "already running" "$RUN/up2.log" || fail "second up did not refuse"

# The supervisor restarts a daemon that dies.
old=$(fact pid.expert.1)
kill -KILL "$old"
deadline=$(( $(date +%s) + 30 ))
while [ "$(date +%s)" -lt $deadline ]; do
    http_code >/dev/null
    snap 2>/dev/null
    new=$(fact pid.expert.1)
    [ "$(fact status)" = ok ] && [ -n "$new" ] && [ "$new" != "$old" ] && break
    sleep 0.1
done
[ -n "$new" ] && [ "$new" != "$old" ] && [ "$(fact status)" = ok ] || fail "expert/1 was not restarted"
grep -q "expert/1 (pid $old) killed by signal 9" "$RUN/up.log" || fail "up did not log the death"
echo "ok killed expert/1 (pid $old) restarted as pid $new"

# SIGTERM to up: every daemon stops, up exits 0, nothing is left.
kill -TERM "$PID_up"
for _ in $(seq 1 100); do alive "$PID_up" || break; sleep 0.1; done
alive "$PID_up" && fail "up still running 10 s after SIGTERM"
wait "$PID_up"; rc=$?
[ $rc -eq 0 ] || fail "up exited $rc"
[ -z "$(leftovers)" ] || fail "processes left behind: $(leftovers)"
echo "ok SIGTERM to up: exit 0, no process left"

# kill -9 of up: the children die with it.
start up2 "$BIN/moemesh" up --model "$MODEL" --owners 1 --port "$PORT" --run-dir "$RUN"
t=$(wait_health 200 30) || fail "second mesh never 200 ($t)"
kill -KILL "$PID_up2"
for _ in $(seq 1 100); do [ -z "$(leftovers)" ] && break; sleep 0.1; done
[ -z "$(leftovers)" ] || fail "children outlived a kill -9 of up: $(leftovers)"
echo "ok kill -9 of up: children gone"

#!/usr/bin/env bash
# timeout: 120
# Five real daemons on a private run dir and port: /health lists the five roles (200); a
# daemon with another model is refused and both sides log both fingerprints; killing the
# expert turns /health to 503, restarting it turns it back to 200 with nothing else restarted;
# SIGTERM stops every daemon with exit 0.
set -u
source tests/e2e/foundation_lib.sh
COMMON=(--router "$ROUTER" --model "$MODEL" --owners 1)

start router "$BIN/moemesh-router" "${COMMON[@]}"
start gateway "$BIN/moemesh-gateway" "${COMMON[@]}" --port "$PORT"
start attention "$BIN/moemesh-attention" "${COMMON[@]}"
start expert "$BIN/moemesh-expert" "${COMMON[@]}"
start drafter "$BIN/moemesh-drafter" "${COMMON[@]}"

t=$(wait_health 200 30) || fail "/health never answered 200 ($t)"
echo "ok /health 200 after ${t} ms"
snap
# the drafter is not on the serving path: it can join after the first 200 on a loaded machine
for _ in $(seq 1 50); do [ "$(fact up.drafter)" -ge 1 ] 2>/dev/null && break; sleep 0.2; http_code >/dev/null; snap; done
[ "$(fact status)" = ok ] || fail "status is not ok"
for r in gateway router attention expert drafter; do
    [ "$(fact up.$r)" -ge 1 ] || fail "role $r not up"
    [ -n "$(fact build.$r.0)" ] || fail "no identity for $r"
done
[ "$(fact control.expert.0)" = "ipc://$RUN/expert-0.ctl" ] || fail "expert address"
echo "ok five roles listed with addresses and identities"
for n in router gateway attention expert drafter; do
    grep -q "config model=$MODEL" "$RUN/$n.log" || fail "$n did not log its effective config"
done

# A drafter serving another model is refused; both sides name both fingerprints.
fp_ok=$(fact model_fp.router.0)
"$BIN/moemesh-drafter" --router "$ROUTER" --model tests/fixtures/models/mixtral-tiny --owners 1 \
    --instance 1 2>"$RUN/bad.log" &
bad=$!
PIDS+=($bad)
for _ in $(seq 1 100); do alive $bad || break; sleep 0.1; done
alive $bad && fail "the mismatched daemon is still running"
wait $bad; rc=$?
[ $rc -ne 0 ] || fail "the refused daemon exited 0"
fp_bad=$(grep -o 'identity drafter/1: .* model sha256:[0-9a-f]*' "$RUN/bad.log" | grep -o 'sha256:[0-9a-f]*$')
[ -n "$fp_bad" ] && [ "$fp_bad" != "$fp_ok" ] || fail "fingerprints: ok=$fp_ok bad=$fp_bad"
grep "refused" "$RUN/bad.log" | grep "model fingerprint mismatch" | grep -q "$fp_ok.*$fp_bad" ||
    fail "the refused daemon's log does not name both fingerprints"
grep "refused drafter/1" "$RUN/router.log" | grep "model fingerprint mismatch" | grep -q "$fp_ok.*$fp_bad" ||
    fail "the router's log does not name both fingerprints"
echo "ok mismatched model refused (exit $rc): router has $fp_ok, daemon has $fp_bad"

# Kill the expert: 503 with the expert down.
others="$PID_router $PID_gateway $PID_attention $PID_drafter"
kill -KILL "$PID_expert"
t=$(wait_health 503 10) || fail "/health still 200 after the expert died ($t)"
echo "ok /health 503 ${t} ms after the expert was killed (design bound 2000 ms)"
snap
[ "$(fact missing)" = expert ] || fail "missing roles: $(fact missing)"
[ "$(fact health.expert.0)" = down ] || fail "expert not down"

# Restart it: 200 again, nothing else restarted.
start expert "$BIN/moemesh-expert" "${COMMON[@]}"
t=$(wait_health 200 30) || fail "/health not 200 after the expert restarted ($t)"
echo "ok /health 200 ${t} ms after the expert restarted"
for p in $others; do alive "$p" || fail "pid $p died"; done
snap
[ "$(fact pid.expert.0)" = "$PID_expert" ] || fail "new expert not listed"
for r in router gateway attention drafter; do
    [ "$(fact joins.$r.0)" = 1 ] || fail "$r rejoined: it was restarted"
done
grep -q "expert/0 rejoined" "$RUN/router.log" || fail "router did not log the rejoin"
echo "ok nothing else restarted"

# SIGTERM: each stops cleanly with exit 0.
for n in expert drafter attention gateway router; do
    eval "p=\$PID_$n"
    kill -TERM "$p"
    for _ in $(seq 1 50); do alive "$p" || break; sleep 0.1; done
    alive "$p" && fail "$n ignored SIGTERM"
    wait "$p"; rc=$?
    [ $rc -eq 0 ] || fail "$n exited $rc on SIGTERM"
    grep -q "stopped" "$RUN/$n.log" || fail "$n did not log its stop"
done
echo "ok every daemon stopped with exit 0"

#!/usr/bin/env bash
# timeout: 120
# An expert owner or attention shard that dies mid-request: the request ends with a clear error
# naming the daemon within 2 s; the router keeps serving (requests on the other shard succeed);
# when the daemon is restarted (nothing else is) serving resumes, bit for bit as before.
set -u
source tests/e2e/mesh_lib.sh
HB=400 # a frozen daemon is marked down after 1.6 s: the kill below comes first
MODEL=tests/fixtures/models/qwen3moe-tiny
IDS=4,8,15,16,23,42
N=6

OWNERS=2; SHARDS=2
mesh_start
expect_same "before failures" $IDS $N --concurrent 2

# --- an owner dies mid-request: freeze it so the request is surely waiting on it, then kill.
kill_mid_request "$PID_e1" owner "expert owner 1" request "$RUN/out1.txt" "$RUN/err1.txt" 2000
echo "ok owner killed mid-request: error in $dt ms: $(grep -m1 error: "$RUN/out1.txt")"

# The router keeps serving: a new request fails fast and clearly while owner 1 is down...
t0=$(ms)
through_mesh $IDS 2 >"$RUN/out2.txt" 2>&1 && fail "request succeeded with an owner down"
dt=$(( $(ms) - t0 ))
grep -q "expert owner 1" "$RUN/out2.txt" || fail "unclear error: $(cat "$RUN/out2.txt")"
# (this one includes starting the client process and its first connect on a loaded VM)
[ $dt -lt 3000 ] || fail "request with an owner down took $dt ms"
echo "ok with the owner down a request fails in $dt ms: $(grep -m1 error: "$RUN/out2.txt")"
# ...and resumes when the owner alone is restarted.
start_owner 1
wait_ready 2 2 || fail "owner 1 did not rejoin"
expect_same "after owner 1 restarted" $IDS $N --concurrent 2

# --- a shard dies mid-request: only its sequences fail; the other shard's go on.
kill_mid_request "$PID_a1" shard "attention shard 1" request "$RUN/out3.txt" "$RUN/err3.txt" 2000
echo "ok shard killed mid-request: error in $dt ms: $(grep -m1 error: "$RUN/out3.txt")"
# While shard 1 is down, the sequence on shard 0 is served, the one on shard 1 fails clearly.
through_mesh $IDS $N --concurrent 2 --all >"$RUN/out4.txt" 2>&1
[ "$(grep -c '^error: .*attention shard 1' "$RUN/out4.txt")" = 1 ] || fail "expected one seq failing on shard 1: $(cat "$RUN/out4.txt")"
[ "$(grep -c '^[0-9]* -[0-9.e-]* top=' "$RUN/out4.txt")" = $N ] || fail "the seq on shard 0 was not served: $(cat "$RUN/out4.txt")"
echo "ok with shard 1 down, shard 0's sequence is served and shard 1's fails clearly"
start_shard 1
wait_ready 2 2 || fail "shard 1 did not rejoin"
expect_same "after shard 1 restarted" $IDS $N --concurrent 2
alive() { kill -0 "$1" 2>/dev/null; }
alive "$PID_router" || fail "router died"
alive "$PID_a0" && alive "$PID_e0" || fail "a daemon that was not killed died"
echo "ok router, shard 0 and owner 0 served throughout without a restart"
mesh_stop

# --- replicated experts: an owner dying mid-request costs nothing; its rows go to the replica.
python3 -c "
import json; c = json.load(open('$MODEL/config.json'))
L, E = c['num_hidden_layers'], c['num_experts']
print(json.dumps({'version': 1, 'n_layers': L, 'n_experts': E, 'n_owners': 2,
                  'experts': [[[e % 2, 1 - e % 2] for e in range(E)] for _ in range(L)]}))" > "$RUN/replicated.json"
OWNERS=2; SHARDS=1; PLACEMENT="$RUN/replicated.json"
mesh_start
expect_same "every expert on both owners" $IDS $N
kill -STOP "$PID_e0"
want=$(reference $IDS $N)
through_mesh $IDS $N --concurrent 2 >"$RUN/out5.txt" 2>"$RUN/err5.txt" &
client=$!
sleep 0.4
kill -0 $client 2>/dev/null || fail "the request did not wait for the frozen owner"
kill -KILL "$PID_e0"
wait $client || fail "request failed although every expert has a live replica: $(cat "$RUN/err5.txt")"
[ "$(cat "$RUN/out5.txt")" = "$want" ] || fail "after failover the output differs from generate"
grep -q "go to replicas" "$RUN/router.log" || fail "the router did not log the failover"
echo "ok owner 0 killed mid-request with replicas: the request completed, bit for bit"
expect_same "owner 0 still down, replicas serve" $IDS $N
start_owner 0
wait_ready 1 2 || fail "owner 0 did not rejoin"
expect_same "owner 0 back" $IDS $N
echo "PASS"

#!/usr/bin/env bash
# timeout: 120
# Pipelined plans (StepPlan.after_step, SeqStep.follow; `mesh-generate --pipeline`: the next
# plan goes out before the previous result is in, its decode seqs fed the router's own picks):
# the tokens and logprobs equal `moemesh generate`'s bit for bit, alone, among 9 concurrent
# seqs that end at different steps, with chunked prompts, with 1 and 2 new tokens, and seeded
# sampling equals the unpipelined client's; a daemon that dies mid-request fails it with an
# error naming the daemon (no hang), the other shard's seq goes on unchanged, and the mesh
# serves again once the daemon is back.
set -u
source tests/e2e/mesh_lib.sh
HB=400 # a frozen daemon is marked down after 1.6 s: the kill below comes first
MODEL=tests/fixtures/models/qwen3moe-tiny
IDS=4,8,15,16,23,42

OWNERS=3; SHARDS=2
mesh_start
expect_same "pipelined, batch 1" $IDS 12 --pipeline
expect_same "pipelined, among 9 concurrent" $IDS 12 --pipeline --concurrent 9
expect_same "pipelined, chunked prompt among 5" $IDS 10 --pipeline --concurrent 5 --chunk 2
expect_same "pipelined, 1 new token" $IDS 1 --pipeline --concurrent 3
expect_same "pipelined, 2 new tokens" $IDS 2 --pipeline --concurrent 3

# every seq of a concurrent, seeded run: the same with and without pipelining
mg() { "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids $IDS --max-tokens 14 --concurrent 7 \
    --all --logprobs --temperature 0.8 --seed 5 "$@"; }
want=$(mg 2>"$RUN/client.err") || fail "unpipelined seeded run: $(cat "$RUN/client.err")"
got=$(mg --pipeline 2>"$RUN/client.err") || fail "pipelined seeded run: $(cat "$RUN/client.err")"
[ "$(echo "$want" | grep -c '^# seq')" -eq 7 ] || fail "seeded run printed the wrong seqs"
if [ "$want" != "$got" ]; then
    diff <(echo "$want") <(echo "$got") | head -10
    fail "pipelined seeded run differs from the unpipelined one"
fi
echo "ok pipelined seeded sampling, 7 seqs: equal to the unpipelined client's, every seq"

# --- an owner dies mid-request (frozen first, so the request surely waits on it)
kill_mid_request "$PID_e1" owner "expert owner 1" "pipelined request" "$RUN/out1.txt" \
    "$RUN/err1.txt" 3000 --pipeline
echo "ok owner killed mid-request (pipelined): error in $dt ms: $(grep -m1 error: "$RUN/out1.txt")"
start_owner 1
wait_ready 2 3 || fail "owner 1 did not rejoin"
expect_same "pipelined, after owner 1 restarted" $IDS 8 --pipeline --concurrent 3

# --- a shard dies mid-request: the step fails its seqs (docs/MESH.md), naming the shard, fast
kill_mid_request "$PID_a1" shard "attention shard 1" "pipelined request" "$RUN/out3.txt" \
    "$RUN/err3.txt" 3000 --pipeline
echo "ok shard killed mid-request (pipelined): error in $dt ms"
# While shard 1 is down, seq 1 (its id lands there) fails at its first step and its entry in
# the plan already sent after it is dropped; seq 0 on shard 0 goes on, bit for bit.
ref=$(reference $IDS 12) || fail "reference failed"
through_mesh $IDS 12 --pipeline --concurrent 2 --all >"$RUN/out4.txt" 2>&1
[ "$(grep -c '^error: .*attention shard 1' "$RUN/out4.txt")" = 1 ] || fail "expected one seq failing on shard 1: $(cat "$RUN/out4.txt")"
s0=$(sed -n '/^# seq 0/,/^# seq 1/p' "$RUN/out4.txt" | grep -v '^#')
[ "$s0" == "$ref" ] || fail "seq 0 on the live shard differs from moemesh generate: $(cat "$RUN/out4.txt")"
echo "ok with shard 1 down (pipelined), shard 0's seq equals generate's and shard 1's fails clearly"
start_shard 1
wait_ready 2 3 || fail "shard 1 did not rejoin"
expect_same "pipelined, after shard 1 restarted" $IDS 8 --pipeline --concurrent 4
grep -q " refused: " "$RUN/router.log" && fail "the router refused a plan: $(grep -m3 " refused: " "$RUN/router.log")"
echo "PASS"

#!/usr/bin/env bash
# timeout: 120
# The router's device path without a GPU: the router on the "cpu-dev" backend (the CPU kernels
# with a device backend's contract: argmax, fetch, device routing ops), shards and owners on the
# CPU. Greedy requests without logprobs are picked on the router's device; with pipelined plans
# each plan is begun by the step before it, before that step's picks reach the router's host
# (MM_ROUTER_EARLY; docs/MESH.md "Steps begun early"). The ids equal `moemesh generate`'s, alone
# and among concurrent seqs that are admitted and end at different steps, pipelined or not, with
# the early begin on or off; logprob requests (host picks) equal it bit for bit too; the router's
# trace shows plans begun early (and none with MM_ROUTER_EARLY=0); an owner killed mid-request
# fails it naming the owner, and the mesh serves again once the owner is back. Also the
# in-process engine on cpu-dev against the CPU engine.
set -u
source tests/e2e/mesh_lib.sh
HB=400
MODEL=tests/fixtures/models/qwen3moe-tiny
IDS=4,8,15,16,23,42
export MM_MESH_TRACE="$RUN/tr"
ROUTER_ARGS="--device cpu-dev"
OWNERS=2; SHARDS=2

# ids IDS N [ARGS...]: greedy ids (no logprobs) of the mesh, sequence 0
ids_mesh() { local i=$1 n=$2; shift 2
    "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids "$i" --max-tokens "$n" "$@"; }
ids_ref() { "$BIN/moemesh" generate --model "$MODEL" --ids "$1" --max-tokens "$2" --threads 1; }
expect_ids() { # WHAT IDS N [ARGS...]
    local what=$1 i=$2 n=$3 want got; shift 3
    want=$(ids_ref "$i" "$n") || fail "$what: generate failed"
    got=$(ids_mesh "$i" "$n" "$@" 2>"$RUN/client.err") || fail "$what: $(cat "$RUN/client.err")"
    [ "$got" = "$want" ] || fail "$what: ids $got, generate's $want"
    echo "ok $what: $n ids equal generate's"
}
taken() { cat "$RUN"/tr.router.* 2>/dev/null | grep -c " taken "; }

# the in-process engine on cpu-dev (the model's device path, greedy steps overlapped with their
# picks' fetch; logprobs read back) equals the CPU engine on every fixture
for m in tests/fixtures/models/*/; do
    a=$("$BIN/moemesh" generate --model "$m" --ids 4,8,15,16 --max-tokens 8 --threads 1) || fail "generate $m"
    b=$("$BIN/moemesh" generate --model "$m" --ids 4,8,15,16 --max-tokens 8 --threads 1 --device cpu-dev) ||
        fail "generate --device cpu-dev $m"
    [ "$a" = "$b" ] || fail "$m: cpu-dev engine ids $b, cpu $a"
done
a=$("$BIN/moemesh" generate --model "$MODEL" --ids $IDS --max-tokens 6 --threads 1 --logprobs --top-logprobs 2)
b=$("$BIN/moemesh" generate --model "$MODEL" --ids $IDS --max-tokens 6 --threads 1 --logprobs --top-logprobs 2 \
    --device cpu-dev)
[ "$a" = "$b" ] || fail "cpu-dev engine logprobs differ from the cpu engine's"
echo "ok the engine on cpu-dev equals the cpu engine (every fixture's ids; logprobs bit for bit)"

mesh_start
grep -q "rows device to device" "$RUN/router.log" && fail "host links expected on the CPU"
t0=$(taken)
expect_ids "pipelined, alone" $IDS 16 --pipeline
expect_ids "pipelined, among 5 (admitted and ending at different steps)" $IDS 16 --pipeline --concurrent 5
expect_ids "pipelined, prompt in chunks of 2, among 3" $IDS 12 --pipeline --concurrent 3 --chunk 2
expect_ids "pipelined, among 6 admitted at once" $IDS 12 --pipeline --concurrent 6 --stagger false
expect_ids "unpipelined" $IDS 12
t1=$(taken)
[ "$t1" -gt "$t0" ] || fail "no plan was begun early (router trace: $t0 -> $t1 'taken' events)"
echo "ok $((t1 - t0)) plans begun early by the step before them"
expect_same "logprobs (host picks), pipelined, among 4" $IDS 10 --pipeline --concurrent 4
mesh_stop

# the same with the early begin off: the same ids, no plan begun early
MM_ROUTER_EARLY=0 mesh_start
t0=$(taken)
expect_ids "MM_ROUTER_EARLY=0, pipelined, among 5" $IDS 16 --pipeline --concurrent 5
[ "$(taken)" -eq "$t0" ] || fail "a plan was begun early with MM_ROUTER_EARLY=0"
echo "ok MM_ROUTER_EARLY=0: no plan begun early"
mesh_stop

# an owner dies mid-request (frozen first, so the request surely waits on it)
mesh_start
kill -STOP "$PID_e1"
ids_mesh $IDS 40 --pipeline --concurrent 2 --all >"$RUN/out.txt" 2>"$RUN/err.txt" &
client=$!
sleep 0.4
kill -0 $client 2>/dev/null || fail "the request did not wait for the frozen owner"
kill -KILL "$PID_e1"
t0=$(ms)
wait $client && fail "the request survived its owner's death"
dt=$(( $(ms) - t0 ))
grep -q "expert owner 1" "$RUN/out.txt" "$RUN/err.txt" || fail "error does not name the owner: $(cat "$RUN/out.txt" "$RUN/err.txt")"
[ $dt -lt 4000 ] || fail "the request took $dt ms to fail after the owner died"
echo "ok owner killed mid-request (pipelined, device picks): failed in $dt ms naming it"
start_owner 1
# (the dead owner may still count as ready until its heartbeat lapses: wait for the new one)
for _ in $(seq 1 100); do grep -q "expert/1 rejoined as a new process" "$RUN/router.log" && break; sleep 0.1; done
grep -q "expert/1 rejoined as a new process" "$RUN/router.log" || fail "owner 1 did not rejoin"
sleep 0.5 # (a dial that failed while it was down is retried after 300 ms)
expect_ids "pipelined among 3 after the owner's restart" $IDS 12 --pipeline --concurrent 3
mesh_stop

#!/usr/bin/env bash
# timeout: 150
# Speculative decoding through the mesh: with a drafter (self-draft: the target as its own
# draft model; the tiny dense drafter; n-gram prompt lookup) every greedy and seeded output is
# bit for bit the output without drafting (tokens and logprobs), alone and among concurrent
# seqs; the self-draft's drafts are all accepted (and there were some: the fast path ran);
# killing the drafter mid-request changes no output, and drafting resumes when it is back.
set -u
source tests/e2e/mesh_lib.sh
cp "${BUILD:-build}/bin/moemesh-drafter" "$BIN/" || exit 1
MODEL=tests/fixtures/models/qwen3moe-tiny
TINY=tests/fixtures/models/qwen3-tiny-drafter
IDS=4,8,15,16,23,42
REP=1,2,3,1,2,3,1,2,3

GEN=1
start router "$BIN/moemesh-router" $(common) --listen "$ROUTER" --attention-shards 1 \
    --step-timeout-ms 5000 --draft-max 4 --draft-adapt false --draft-timeout-ms 1500
start_shard 0
start_owner 0
wait_ready 1 1 || fail "mesh not ready"

mg() { "$BIN/moemesh" mesh-generate --router "$ROUTER" --logprobs "$@"; }
start_drafter() { # KIND: a draft model directory or ngram; waits until the router lists it ready
    start d "$BIN/moemesh-drafter" $(common) --draft-model "$1" --threads 1 --max-ctx 512
    for _ in $(seq 1 100); do
        "$BIN/moemesh" status --router "$ROUTER" 2>/dev/null | grep -q "drafter: 1 ready" && return 0
        sleep 0.1
    done
    fail "drafter ($1) not ready"
}
stop_drafter() { kill -TERM "$PID_d" 2>/dev/null; wait "$PID_d" 2>/dev/null; }

# The references: no drafter in the mesh (the router asks no one; plans say --draft 0).
declare -A WANT
CASES=(g1 gc s1 rep longc)
args() {
    case $1 in
    g1) echo --ids $IDS --max-tokens 24 ;;
    gc) echo --ids $IDS --max-tokens 16 --concurrent 6 --all ;;
    s1) echo --ids $IDS --max-tokens 16 --concurrent 4 --all --temperature 0.9 --seed 7 ;;
    rep) echo --ids $REP --max-tokens 24 --concurrent 3 --all ;;
    # the freeze's request, near the fixture's 512 positions, 3 seqs per step: still running
    # when the first draft shows in the router's status (one seq's steps could end first)
    longc) echo --ids $IDS --max-tokens 480 --concurrent 3 --all ;;
    esac
}
for c in "${CASES[@]}"; do
    WANT[$c]=$(mg $(args $c) 2>"$RUN/client.err") || fail "reference $c: $(cat "$RUN/client.err")"
done
# The mesh without drafting equals the in-process engine (so drafting is held to plain decoding).
eng=$("$BIN/moemesh" generate --model "$MODEL" --ids $IDS --max-tokens 24 --logprobs --threads 1) \
    || fail "moemesh generate failed"
[ "$eng" == "${WANT[g1]}" ] || fail "mesh without drafting differs from moemesh generate"

# check CASE WHAT [ARGS]: output with --draft 4 equals the reference; sets DRAFTED and ACCEPTED
# and adds DRAFTED to SUM_DRAFTED.
SUM_DRAFTED=0
check() {
    local c=$1 what=$2 got
    shift 2
    got=$(mg $(args $c) --draft 4 "$@" 2>"$RUN/client.err") || fail "$what $c: $(cat "$RUN/client.err")"
    if [ "$got" != "${WANT[$c]}" ]; then
        diff <(echo "${WANT[$c]}") <(echo "$got") | head -10
        fail "$what $c: output with drafting differs from the output without"
    fi
    read -r DRAFTED ACCEPTED < <(sed -n 's/^drafting: drafted \([0-9]*\) accepted \([0-9]*\).*/\1 \2/p' "$RUN/client.err")
    [ -n "${DRAFTED:-}" ] || fail "$what $c: no drafting counts from mesh-generate"
    SUM_DRAFTED=$((SUM_DRAFTED + DRAFTED))
    echo "ok $what $c: equal bit for bit (drafted $DRAFTED, accepted $ACCEPTED)"
}

# --- self-draft: the target drafts for itself, so every greedy draft must be accepted.
start_drafter "$MODEL"
for c in g1 gc; do
    check $c self-draft
    [ "$DRAFTED" -gt 0 ] || fail "self-draft $c: nothing was drafted (the fast path did not run)"
    [ "$DRAFTED" -eq "$ACCEPTED" ] || fail "self-draft $c: $ACCEPTED of $DRAFTED drafts accepted (all must be)"
done
check s1 self-draft
[ "$DRAFTED" -gt 0 ] || fail "self-draft s1: nothing was drafted"
"$BIN/moemesh" status --router "$ROUTER" | grep -q "drafting: drafted=[1-9]" \
    || fail "router status has no drafting metrics"
# pipelined plans (mesh-generate --pipeline): a seq's next entry follows the router's pick and
# its accepted drafts (the router knows the next position), sent before the result is in
for c in g1 gc s1; do
    check $c "self-draft, pipelined plans" --pipeline
    [ "$DRAFTED" -gt 0 ] || fail "self-draft pipelined $c: nothing was drafted"
done
# The router's status counts every draft of every run so far (its detail line is rebuilt at
# most every 50 ms during steps; a status request on the idle router publishes the rest).
st=$("$BIN/moemesh" status --router "$ROUTER" | sed -n 's/.*drafting: drafted=\([0-9]*\).*/\1/p')
[ "$st" = "$SUM_DRAFTED" ] || fail "router status says drafted=$st, the clients counted $SUM_DRAFTED"
echo "ok router status drafted=$st: every draft of the runs so far"

# --- a drafter that stops answering (frozen: late past --draft-timeout-ms), then dies, mid-
# request: the request goes on without drafts and its output does not change.
drafted() { "$BIN/moemesh" status --router "$ROUTER" | sed -n 's/.*drafting: drafted=\([0-9]*\).*/\1/p'; }
before=$(drafted)
mg $(args longc) --draft 4 >"$RUN/long.out" 2>"$RUN/long.err" &
client=$!
for _ in $(seq 1 400); do
    [ "$(drafted)" -gt "$before" ] && break
    sleep 0.01
done
kill -STOP "$PID_d"
kill -0 $client 2>/dev/null || fail "the long request ended before the drafter could be frozen"
for _ in $(seq 1 100); do
    grep -q "without drafts" "$RUN/router.log" && break
    sleep 0.05
done
grep -q "without drafts" "$RUN/router.log" || fail "the router did not give up on the frozen drafter"
kill -KILL "$PID_d"
wait $client || fail "the request failed after the drafter died: $(cat "$RUN/long.err")"
[ "$(cat "$RUN/long.out")" == "${WANT[longc]}" ] || fail "losing the drafter changed the output"
echo "ok drafter frozen then killed mid-request: output unchanged ($(cat "$RUN/long.err"))"
wait "$PID_d" 2>/dev/null

# --- it rejoins: drafting resumes with the tiny dense drafter.
start_drafter "$TINY"
for c in g1 gc s1; do
    check $c tiny-drafter
    [ "$DRAFTED" -gt 0 ] || fail "tiny drafter $c: nothing was drafted after the drafter rejoined"
done
stop_drafter

# --- n-gram prompt lookup.
start_drafter ngram
for c in rep gc s1; do check $c ngram; done
check rep ngram
[ "$DRAFTED" -gt 0 ] || fail "ngram: nothing was drafted for a repetitive prompt"
stop_drafter
echo "PASS"

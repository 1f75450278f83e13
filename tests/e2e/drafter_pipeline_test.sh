#!/usr/bin/env bash
# timeout: 150
# Draft-ahead (router --draft-pipeline true, and the ahead steps of auto; docs/MESH.md,
# Drafting): with a self-draft
# the drafter's ahead proposals are used (ahead hits > 0 in the router's metrics: drafts made
# while the step before ran) and every output equals the output without drafting, greedy and
# seeded, alone and among concurrent seqs; killing the drafter while an ahead request is in
# flight changes no output and stalls nothing (the request times out, the drafter is backed off),
# and drafting resumes from ahead proposals when a drafter is back; with --draft-pipeline auto
# steps of both modes run (ahead and waited drafts); with --draft-pipeline false no ahead
# request is sent; outputs are equal in every mode.
set -u
source tests/e2e/mesh_lib.sh
cp "${BUILD:-build}/bin/moemesh-drafter" "$BIN/" || exit 1
IDS=4,8,15,16,23,42

# router_start PIPELINE: a fresh mesh (router, 1 shard, 1 owner); width fixed at 4 (no cost
# model: every seq step drafts, so the ahead path runs every step).
router_start() {
    GEN=$((GEN + 1))
    start router "$BIN/moemesh-router" $(common) --listen "$ROUTER" --attention-shards 1 \
        --step-timeout-ms 5000 --draft-max 4 --draft-adapt false --draft-timeout-ms 1500 \
        --draft-pipeline "$1"
    start_shard 0
    start_owner 0
    wait_ready 1 1 || fail "mesh not ready"
}
mg() { "$BIN/moemesh" mesh-generate --router "$ROUTER" --logprobs "$@"; }
start_drafter() {
    start d "$BIN/moemesh-drafter" $(common) --draft-model "$MODEL" --threads 1 --max-ctx 512
    for _ in $(seq 1 100); do
        "$BIN/moemesh" status --router "$ROUTER" 2>/dev/null | grep -q "drafter: 1 ready" && return 0
        sleep 0.1
    done
    fail "drafter not ready"
}
# metric NAME: the router's drafting counter NAME (its status detail)
metric() { "$BIN/moemesh" status --router "$ROUTER" | grep -o "drafting:.*" | grep -o " $1=[0-9]*" | cut -d= -f2; }

declare -A WANT
CASES=(g1 gc s1 long longc)
args() {
    case $1 in
    g1) echo --ids $IDS --max-tokens 24 ;;
    gc) echo --ids $IDS --max-tokens 16 --concurrent 6 --all ;;
    s1) echo --ids $IDS --max-tokens 16 --concurrent 4 --all --temperature 0.9 --seed 7 ;;
    long) echo --ids $IDS --max-tokens 480 ;; # near the fixture's 512 positions
    # the freeze's request: 3 seqs per step, so that it is still running when the first ahead
    # hit shows in the router's metrics (~0.5 s of polling; one seq's 96 steps took ~0.6 s)
    longc) echo --ids $IDS --max-tokens 480 --concurrent 3 --all ;;
    esac
}
check() { # CASE WHAT: output with --draft 4 equals the reference
    local got
    got=$(mg $(args $1) --draft 4 2>"$RUN/client.err") || fail "$2 $1: $(cat "$RUN/client.err")"
    if [ "$got" != "${WANT[$1]}" ]; then
        diff <(echo "${WANT[$1]}") <(echo "$got") | head -10
        fail "$2 $1: output with drafting differs from the output without"
    fi
    echo "ok $2 $1: equal bit for bit ($(cat "$RUN/client.err"))"
}

router_start true
for c in "${CASES[@]}"; do # references: no drafter in the mesh
    WANT[$c]=$(mg $(args $c) 2>"$RUN/client.err") || fail "reference $c: $(cat "$RUN/client.err")"
done

start_drafter
for c in g1 gc s1; do check $c "pipeline self-draft"; done
hits=$(metric ahead_hits)
[ -n "$hits" ] || fail "the router's metrics have no ahead_hits: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafting:.*')"
[ "$hits" -gt 0 ] || fail "no ahead hits with a self-draft: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafting:.*')"
[ "$(metric ahead)" -gt 0 ] || fail "no ahead requests"
# a self-draft's greedy drafts are all accepted, the ahead ones too
mg $(args g1) --draft 4 >/dev/null 2>"$RUN/g1.err" || fail "g1: $(cat "$RUN/g1.err")"
read -r DR AC < <(sed -n 's/^drafting: drafted \([0-9]*\) accepted \([0-9]*\).*/\1 \2/p' "$RUN/g1.err")
[ "${DR:-0}" -gt 0 ] && [ "$DR" -eq "$AC" ] || fail "self-draft g1: $AC of $DR drafts accepted (all must be)"
echo "ok ahead proposals used: ahead_hits=$(metric ahead_hits) ahead_misses=$(metric ahead_misses) sync=$(metric sync) ahead=$(metric ahead)"

# --- the drafter stops answering (frozen) and is killed while an ahead request is in flight:
# the step waiting for it gives up at its deadline, the request goes on without drafts.
before=$(metric ahead_hits)
mg $(args longc) --draft 4 >"$RUN/long.out" 2>"$RUN/long.err" &
client=$!
for _ in $(seq 1 300); do
    [ "$(metric ahead_hits)" -gt "$before" ] && break
    sleep 0.01
done
[ "$(metric ahead_hits)" -gt "$before" ] || fail "no ahead hits in the long request before the freeze"
kill -STOP "$PID_d"
sleep 0.3
kill -0 $client 2>/dev/null || fail "the long request ended before the drafter could be killed"
kill -KILL "$PID_d"
wait $client || fail "the request failed after the drafter died: $(cat "$RUN/long.err")"
[ "$(cat "$RUN/long.out")" == "${WANT[longc]}" ] || fail "losing the drafter changed the output"
grep -q "ahead request: no answer within" "$RUN/router.log" ||
    fail "the router did not time out the ahead request in flight: $(grep drafter "$RUN/router.log" | tail -3)"
echo "ok drafter frozen then killed with an ahead request in flight: output unchanged ($(cat "$RUN/long.err"))"
wait "$PID_d" 2>/dev/null

# --- a drafter back: drafting resumes from ahead proposals
before=$(metric ahead_hits)
start_drafter
check g1 "pipeline self-draft after the drafter came back"
[ "$(metric ahead_hits)" -gt "$before" ] || fail "no ahead hits after the drafter came back"
echo "ok ahead hits again after the drafter came back ($before -> $(metric ahead_hits))"

# --- a --draft-pipeline that is none of auto/true/false: exit 2, naming the flag
"$BIN/moemesh-router" --draft-pipeline sometimes --listen "ipc://$RUN/bad.ctl" >/dev/null 2>"$RUN/bad.err"
rc=$?
[ $rc -eq 2 ] && grep -q "draft-pipeline: 'sometimes'" "$RUN/bad.err" ||
    fail "--draft-pipeline sometimes: exit $rc, $(tail -2 "$RUN/bad.err")"
echo "ok --draft-pipeline sometimes: exit 2 ($(grep draft-pipeline "$RUN/bad.err"))"
# a limit the step engine would truncate to int: exit 2, naming the flag
"$BIN/moemesh-router" --max-batch-tokens 4294967297 --listen "ipc://$RUN/bad2.ctl" >/dev/null 2>"$RUN/bad2.err"
rc=$?
[ $rc -eq 2 ] && grep -q "max-batch-tokens 4294967297: out of range" "$RUN/bad2.err" ||
    fail "--max-batch-tokens 2^32+1: exit $rc, $(tail -2 "$RUN/bad2.err")"
echo "ok --max-batch-tokens 2^32+1: exit 2"

# --- --draft-pipeline auto (the router's default): steps of both modes (each unmeasured mode
# is measured first, one window; the long request has ~100 steps), same outputs
mesh_stop
router_start auto
start_drafter
for c in g1 gc s1 long; do check $c "auto self-draft"; done
[ "$(metric ahead_steps)" -gt 0 ] || fail "--draft-pipeline auto ran no ahead step: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafting:.*')"
[ "$(metric sync_steps)" -gt 0 ] || fail "--draft-pipeline auto ran no synchronous step: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafting:.*')"
[ "$(metric ahead)" -gt 0 ] && [ "$(metric sync)" -gt 0 ] || fail "--draft-pipeline auto: ahead=$(metric ahead) sync=$(metric sync) requests"
echo "ok --draft-pipeline auto: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'ahead_steps=.*')"

# --- --draft-pipeline false: synchronous requests only, same outputs
mesh_stop
router_start false
start_drafter
for c in g1 gc s1; do check $c "no pipeline self-draft"; done
[ "$(metric ahead)" -eq 0 ] || fail "--draft-pipeline false sent $(metric ahead) ahead requests"
[ "$(metric sync)" -gt 0 ] || fail "--draft-pipeline false sent no synchronous request"
echo "ok --draft-pipeline false: ahead=0 sync=$(metric sync)"
echo "PASS"

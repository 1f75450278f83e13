#!/usr/bin/env bash
# Drafting benchmark: decode tok/s with and without drafting through a local mesh (CPU).
# usage: tools/bench_drafting.sh ADAPT(true|false)   (after make; private run dir, cleaned on exit)
# Prints tokens/s of 3 runs per case (mesh-generate --timing: 128 tokens per seq, prefill
# included) and "acc A/D": drafts accepted of drafted; then the router's drafting metrics.
set -u
cd "$(dirname "$0")/.."
B=build/bin; M=tests/fixtures/models/qwen3moe-tiny; T=tests/fixtures/models/qwen3-tiny-drafter
R=$(mktemp -d /tmp/mm-drb.XXXX); RT=ipc://$R/r.ctl; TAG=drb$$
C="--router $RT --model $M --owners 1 --heartbeat-ms 100 --threads 1"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill $p 2>/dev/null; done; sleep 0.5; rm -rf $R' EXIT
$B/moemesh-router $C --listen $RT --attention-shards 1 --draft-adapt $1 --draft-max 4 > $R/router.log 2>&1 & PIDS+=($!)
$B/moemesh-attention $C --instance 0 --shards 1 --data shm://$TAG-a0 --kv-mb 32 > $R/a.log 2>&1 & PIDS+=($!)
$B/moemesh-expert $C --instance 0 --data shm://$TAG-e0 > $R/e.log 2>&1 & PIDS+=($!)
sleep 1.5
run() { # label args...
    local label=$1; shift
    for rep in 1 2 3; do
        $B/moemesh mesh-generate --router $RT --ids 4,8,15,16,23,42 --max-tokens 128 --timing "$@" 2>&1 >/dev/null \
          | sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p; s/^drafting: drafted \([0-9]*\) accepted \([0-9]*\).*/acc \2\/\1/p' | tr '\n' ' '
        echo
    done | awk -v l="$label" '{print l": "$0}'
}
for c in 1 16; do run "c=$c no-draft" --concurrent $c; done
for d in self tiny; do
    [ $d = self ] && DM=$M || DM=$T
    $B/moemesh-drafter $C --draft-model $DM --threads 1 --max-ctx 512 > $R/d.log 2>&1 & DP=$!; PIDS+=($DP)
    sleep 1.5
    for c in 1 16; do run "c=$c draft=$d adapt=$1" --concurrent $c --draft 4; done
    $B/moemesh status --router $RT | grep -o "drafting:.*"
    kill $DP; sleep 0.8
done

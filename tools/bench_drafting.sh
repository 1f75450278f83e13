#!/usr/bin/env bash
# Drafting benchmark: decode tok/s with and without drafting through a local mesh (CPU).
# usage: tools/bench_drafting.sh ADAPT(true|false) [PIPELINE(auto|true|false)]   (after make;
# private run dir, cleaned on exit). PIPELINE: the router's --draft-pipeline (auto, the default:
# draft-ahead or waited drafts by measurement; true: draft-ahead; false: waited drafts).
# For each drafter (self-draft: the target itself; the tiny dense drafter) and concurrency
# (1, 16): 4 rounds of [no drafting, drafting] back to back (the VM's load drifts: only
# neighbouring runs compare), each mesh-generate --timing (128 tokens per seq, prefill
# included) printing tokens/s and "acc A/D" (drafts accepted of drafted); then the router's
# drafting metrics.
set -u
cd "$(dirname "$0")/.."
B=build/bin; M=tests/fixtures/models/qwen3moe-tiny; T=tests/fixtures/models/qwen3-tiny-drafter
R=$(mktemp -d /tmp/mm-drb.XXXX); RT=ipc://$R/r.ctl; TAG=drb$$
C="--router $RT --model $M --owners 1 --heartbeat-ms 100 --threads 1"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill $p 2>/dev/null; done; sleep 0.5; rm -rf $R' EXIT
$B/moemesh-router $C --listen $RT --attention-shards 1 --draft-adapt $1 --draft-max 4 \
    --draft-pipeline ${2:-auto} > $R/router.log 2>&1 & PIDS+=($!)
$B/moemesh-attention $C --instance 0 --shards 1 --data shm://$TAG-a0 --kv-mb 32 > $R/a.log 2>&1 & PIDS+=($!)
$B/moemesh-expert $C --instance 0 --data shm://$TAG-e0 > $R/e.log 2>&1 & PIDS+=($!)
sleep 1.5
one() {
    $B/moemesh mesh-generate --router $RT --ids 4,8,15,16,23,42 --max-tokens 128 --timing "$@" 2>&1 >/dev/null \
      | sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p; s/^drafting: drafted \([0-9]*\) accepted \([0-9]*\).*/acc \2\/\1/p' | tr '\n' ' '
}
# warm up the daemons (first touches of the weights)
one --concurrent 16 >/dev/null; one >/dev/null
for d in self tiny; do
    [ $d = self ] && DM=$M || DM=$T
    $B/moemesh-drafter $C --draft-model $DM --threads 1 --max-ctx 512 > $R/d.log 2>&1 & DP=$!; PIDS+=($DP)
    sleep 1.5
    for c in 1 16; do
        for rep in 1 2 3 4; do
            echo "c=$c draft=$d adapt=$1 pipeline=${2:-auto}: off $(one --concurrent $c) | on $(one --concurrent $c --draft 4)"
        done
    done
    $B/moemesh status --router $RT | grep -o "drafting:.*"
    kill $DP; sleep 0.8
done

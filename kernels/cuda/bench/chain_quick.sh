#!/usr/bin/env bash
# A short device run (about 20 s) for one A/B switch of the decode step, when little device
# time is left: the chain and attention bit tests, `moemesh synth --layers ${LAYERS:-1}` into
# /tmp (fewer layers: a shorter synth; attention and the per-layer chain are per layer, so
# the A/B holds, the tok/s is not the 4-layer figure), then bench-model batch 1 (graph and op
# by op) with the default and with "$AB" (default MM_GPU_ATT_WIDE=1), in turn, twice.
#     bash kernels/cuda/bench/chain_quick.sh .dev/gpu-dec
set -u
D=${1:-.dev/gpu-dec}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
L=${LAYERS:-1}
AB=${AB:-MM_GPU_ATT_WIDE=1}
M=/tmp/q3-L$L
( "$D/moemesh" synth --out "$M" --layers "$L" > "$OUT/synth.txt" 2>&1; echo "rc=$?" >> "$OUT/synth.txt" ) &
SP=$!
for c in "decode attention wide loads == earlier grouping bits" \
         "route_with_plan == route then route_plan bits" \
         "combine_rmsnorm == combine then rmsnorm bits"; do
    timeout 20 "$D/cuda_chain_ops_test" "$c" > "$OUT/t.txt" 2>&1 && echo "ok    $c" ||
        { echo "FAIL  $c"; tail -3 "$OUT/t.txt"; }
done
timeout 30 "$D/model_devpath_test" "cuda: chain fusions == MM_GPU_OLD_CHAIN bits (4 models)" > "$OUT/t2.txt" 2>&1 &&
    echo "ok    devpath chain (4 models)" || { echo "FAIL  devpath chain"; tail -3 "$OUT/t2.txt"; }
wait "$SP"; tail -1 "$OUT/synth.txt"
B="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64 --prompt-tokens 128 --decode-tokens 32 --rounds 2"
for i in 1 2; do
    for v in def ab; do
        e=X=0; [ $v = ab ] && e=$AB
        env $e timeout 20 $B > "$OUT/b-$v$i.txt" 2>&1
        echo "$v$i ($e): $(grep -E "decode: best|op by op" "$OUT/b-$v$i.txt" | sed -E 's/ms\/token/ms/g' | tr '\n' ' ')"
    done
done
echo "done at t+$SECONDS s"

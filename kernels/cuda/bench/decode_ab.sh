#!/usr/bin/env bash
# Decode A/B on the GPU machine, all in one process run: batch 1 and 64 with the earlier decode
# kernels (MM_GPU_OLD_DECODE=1) and with the fused ops off (MM_GPU_OLD_FUSIONS=1), per-op
# profiles (MM_GPU_OPTIME=2: each step held until issued, GPU time only; =1: host gaps
# included, as earlier tables), the GEMV kernel bench (v2 beside v1) and the layer graph.
# Needs the synthetic checkpoint in /tmp: run after
#     SKIP="invariance meshstep parity gateway" KEEP_MODEL=1 bash kernels/cuda/device_run.sh DIR
# as   bash kernels/cuda/bench/decode_ab.sh DIR   (DIR: the staged binaries, as device_run.sh).
# Output: stdout, and the raw files in $OUT.
set -u
D=${1:-.dev/gpu-dec}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
M=/tmp/q3-30b-a3b-L4
B="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 128 --bw-mb 64"
s() { echo; echo "== $1 (t+$SECONDS s)"; }
best() { grep -E "decode: best|op by op|batch 64 decode" "$OUT/$1.txt" | sed "s/^/$1: /"; }
prof() { sed -n "/steps of $2 row/,/^gpu optime\|^[a-z]/p" "$OUT/$1.txt" | head -34; }
s "batch 1 and 64, old kernels (MM_GPU_OLD_DECODE=1); new without fusions"
MM_GPU_OLD_DECODE=1 timeout 50 $B --decode-tokens 32 --rounds 2 --batch 64 > $OUT/b-old.txt 2>&1; best b-old
MM_GPU_OLD_FUSIONS=1 timeout 50 $B --decode-tokens 32 --rounds 2 > $OUT/b-nofuse.txt 2>&1; best b-nofuse
s "per-op profiles, GPU time only (MM_GPU_OPTIME=2), new then old, batch 1 and 64"
MM_GPU_OPTIME=2 timeout 60 $B --decode-tokens 16 --rounds 1 --batch 64 > $OUT/ot2-new.txt 2>&1
MM_GPU_OPTIME=2 MM_GPU_OLD_DECODE=1 timeout 60 $B --decode-tokens 16 --rounds 1 --batch 64 > $OUT/ot2-old.txt 2>&1
for f in ot2-new ot2-old; do echo "-- $f, 1 row"; prof $f 1; done
for f in ot2-new ot2-old; do echo "-- $f, 64 rows"; prof $f 64; done
s "per-op profile as before (MM_GPU_OPTIME=1, host gaps included), new"
MM_GPU_OPTIME=1 timeout 50 $B --decode-tokens 16 --rounds 1 > $OUT/ot1-new.txt 2>&1; prof ot1-new 1
s "kernel bench: gemv (v2 beside v1), layer graph"
timeout 40 $D/moemesh-gpu-bench --only gemv --quick > $OUT/gemv.txt 2>&1; grep -vE "^$" $OUT/gemv.txt | head -20
timeout 40 $D/moemesh-gpu-bench --only layer --quick > $OUT/layer.txt 2>&1; grep "layer" $OUT/layer.txt | head -8
s "again: new, old (batch 1)"
timeout 50 $B --decode-tokens 32 --rounds 2 > $OUT/b-new2.txt 2>&1; best b-new2
MM_GPU_OLD_DECODE=1 timeout 50 $B --decode-tokens 32 --rounds 2 > $OUT/b-old2.txt 2>&1; best b-old2
s done

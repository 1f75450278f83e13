#!/usr/bin/env bash
# Where the batch-1 decode step goes, on the GPU machine: per-layer op times with and without
# PDL and with fewer GEMV blocks, ncu durations of every kernel of a decode step (summed, to
# set against the graph step), and ncu sections of the model's GEMVs beside the kernel
# bench's q/k/v GEMV. Needs the synthetic checkpoint in /tmp: run after
#     SKIP="ops invariance meshstep parity gateway" KEEP_MODEL=1 bash kernels/cuda/device_run.sh DIR
# as   bash kernels/cuda/bench/decode_diag.sh DIR   (DIR: the staged binaries, as device_run.sh).
# Output: stdout (summaries); the raw files in /tmp/diag, packed into $OUT/diag.tgz at the end
# (the run tool brings back few files).
set -u
D=${1:-.dev/gpu-dd}
OUT=${OUT:-/tmp/out}
R=/tmp/diag
mkdir -p "$OUT" "$R"
trap 'tar czf "$OUT/diag.tgz" -C /tmp diag' EXIT
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
M=/tmp/q3-30b-a3b-L4
B="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64"
s() { echo; echo "== $1 (t+$SECONDS s)"; }
prof() { sed -n "/steps of 1 row/,/^gpu optime\|^[a-z]/p" "$1" | grep -E "optime|matmul|attention|rmsnorm|route|combine|kv_store|head_norm" | head -${2:-40}; }
best() { grep -E "decode: best|op by op" "$1" | tr '\n' ' '; echo; }
if command -v ncu > /dev/null; then
    s "ncu: every kernel of the decode steps (op by op, one metric pass, L2 left as it is)"
    NB="$B --prompt-tokens 8 --warmup-tokens 1 --decode-tokens 3 --rounds 1"
    MM_GPU_GRAPHS=0 timeout 80 ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
        --export /tmp/steps --force-overwrite $NB > $R/ncu-run.txt 2>&1 || echo "ncu rc=$?"
    ncu --import /tmp/steps.ncu-rep --csv --page raw > $R/ncu_steps.csv 2> /dev/null
    python3 kernels/cuda/bench/ncu_step.py $R/ncu_steps.csv 2 2>&1 | tee $R/ncu_sum.txt | head -90
fi
s "per-call op times (MM_GPU_OPTIME=2, split per call), default / PDL=0 / WPT=4 / separate q,k,v"
MM_GPU_OPTIME=2 MM_GPU_OPTIME_SPLIT=1 timeout 40 $B --prompt-tokens 8 --decode-tokens 16 --rounds 1 > $R/ot-def.txt 2>&1; prof $R/ot-def.txt 40
s "graph decode A/B, batch 1 (32 tokens x 2 rounds) and 64, in turn: default (small ops as PDL dependents), MM_GPU_PDL_ALL=0, MM_GPU_GEMV_WPT=4, both, MM_GPU_PDL=0"
ab() { # name, env...
    local n=$1; shift
    env "$@" timeout 40 $B --prompt-tokens 128 --decode-tokens 32 --rounds 2 --batch 64 > $R/g-$n.txt 2>&1
    echo "$n: $(grep -E "decode: best|op by op|batch 64 decode" $R/g-$n.txt | sed -E 's/ \(prompts.*//; s/ms\/token/ms/g' | tr '\n' ' ')"
}
for i in 1 2; do
    ab def$i X=0; ab plain$i MM_GPU_PDL_ALL=0; ab wpt$i MM_GPU_GEMV_WPT=4; ab plainwpt$i MM_GPU_PDL_ALL=0 MM_GPU_GEMV_WPT=4
done
ab nopdl MM_GPU_PDL=0
if command -v ncu > /dev/null; then
    s "ncu sections: the model's GEMVs of one decode step (21 launches) and the bench's q/k/v"
    SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"
    MM_GPU_GRAPHS=0 timeout 60 ncu --clock-control none -k regex:gemv_x --launch-skip 63 --launch-count 21 $SEC \
        $NB > $R/ncu_model_gemv.txt 2>&1 || echo "ncu rc=$?"
    timeout 40 ncu --clock-control none -k regex:gemv_x --launch-skip 3 --launch-count 1 $SEC \
        $D/moemesh-gpu-bench --only gemv --quick > $R/ncu_bench_gemv.txt 2>&1 || echo "ncu rc=$?"
    for f in ncu_bench_gemv ncu_model_gemv; do
        echo "-- $f"
        grep -E "gemv_x_kernel|^ +(Duration|DRAM Throughput|Memory Throughput|Grid Size|Registers Per Thread|Achieved Occupancy|Waves Per SM|L2 Hit Rate|Dynamic Shared)" $R/$f.txt |
            awk '/gemv_x_kernel/ {if (l) print l; l=""; next} {gsub(/  +/," "); l = l "|" $0} END {print l}' | head -24
    done
else
    echo "ncu not on PATH"
fi
echo "-- more op-time variants"
MM_GPU_OPTIME=2 MM_GPU_OPTIME_SPLIT=1 MM_GPU_PDL_ALL=0 timeout 40 $B --prompt-tokens 8 --decode-tokens 16 --rounds 1 > $R/ot-plain.txt 2>&1; echo "-- PDL_ALL=0"; prof $R/ot-plain.txt 40 | grep -E "optime|5120|4096|2048x|151936"
MM_GPU_OPTIME=2 MM_GPU_OPTIME_SPLIT=1 MM_GPU_PDL=0 timeout 40 $B --prompt-tokens 8 --decode-tokens 16 --rounds 1 > $R/ot-nopdl.txt 2>&1; echo "-- PDL=0"; prof $R/ot-nopdl.txt 40 | grep -E "optime|5120|4096|2048x|151936"
MM_GPU_OPTIME=2 MM_GPU_GEMV_WPT=4 timeout 40 $B --prompt-tokens 8 --decode-tokens 16 --rounds 1 > $R/ot-wpt4.txt 2>&1; echo "-- WPT=4"; prof $R/ot-wpt4.txt 12
MM_GPU_OPTIME=2 MM_FUSED_QKV=0 timeout 40 $B --prompt-tokens 8 --decode-tokens 16 --rounds 1 > $R/ot-sep.txt 2>&1; echo "-- separate q, k, v"; prof $R/ot-sep.txt 12
s done

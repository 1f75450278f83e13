#!/usr/bin/env bash
# One device run for the prefill attention kernel (ops.cu attention_pf_kernel), with binaries
# staged by `BUILD_CUDA=build/cuda-att bash kernels/cuda/device_run.sh --stage .dev/gpu-att`:
#   bash kernels/cuda/bench/attn_prefill_run.sh .dev/gpu-att
# In order: moemesh synth of the 4-layer Qwen3-30B-A3B shape (background, CPU and disk), the
# bf16 peak (torch.matmul 8192^3 as bench/device_run.sh measures it), every GPU op test case
# (device_run.sh's ops section), then `moemesh bench-model --prompt-tokens 4096 --prefill-rows
# 4096 --prompt-rounds 3` with the prefill attention kernel (default) and without it
# (MM_GPU_ATT_PREFILL=0), and the same under MM_GPU_OPTIME=1 for the attention op's time per
# 4096-row call. Logs: $OUT/log (all), $OUT/optime_{new,old}.txt, $OUT/ops.log.
set -u
D=${1:-.dev/gpu-att}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
M=/tmp/q3-att-L4
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv
( timeout 200 "$D/moemesh" synth --out "$M" --layers 4 > "$OUT/synth.txt" 2>&1
  echo "synth rc=$?" >> "$OUT/synth.txt" ) &
SYNTH_PID=$!
echo "== bf16 peak (torch.matmul 8192^3, random data, mean of 20 after 5 warm-ups)"
PEAK=$(timeout 40 python3 kernels/cuda/bench/bf16_peak.py)
echo "peak ${PEAK:-unmeasured} TFLOP/s"
echo "== attention prefill bit test first (it matters most)"
timeout 60 "$D/cuda_decode_ops_test" "attention prefill kernel: decode kernel bits" 2>&1 | tail -12
echo "== GPU op tests (device_run.sh ops section)"
OUT="$OUT/ops" SKIP="synth copy bench invariance meshstep parity gateway" timeout 70 \
    bash kernels/cuda/device_run.sh "$D" > /dev/null 2>&1
grep -E "^(ok|FAIL|skip)|GPU tests:|bits|differ" "$OUT/ops/log" | head -80
echo "== whole-model prefill, 4096 tokens in one forward (synth 4 layers)"
wait "$SYNTH_PID"; tail -2 "$OUT/synth.txt"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 3"
for p in new old; do
    e=1; [ $p = old ] && e=0
    echo "-- attention: $p (MM_GPU_ATT_PREFILL=$e)"
    MM_GPU_ATT_PREFILL=$e timeout 30 $BM 2>&1 | grep -E "^model|^prompt|failed|error|bench-model" || echo "bench-model failed"
done
for p in new old; do
    e=1; [ $p = old ] && e=0
    echo "-- per-op GPU times (MM_GPU_OPTIME=1), attention $p"
    MM_GPU_OPTIME=1 MM_GPU_ATT_PREFILL=$e timeout 30 $BM > "$OUT/optime_$p.txt" 2>&1 || echo "optime run failed rc=$?"
    grep -E "^prompt" "$OUT/optime_$p.txt"; sed -n "/steps of 4096 row/,+10p" "$OUT/optime_$p.txt"
done
date -u

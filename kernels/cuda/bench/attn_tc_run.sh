#!/usr/bin/env bash
# One device run for the tensor-core attention contract (kernels/cuda/attention_tc.cu,
# MM_GPU_ATT_TC=1) against ops.cu's f32 kernels (MM_GPU_ATT_TC=0), with binaries staged by
#   BUILD_CUDA=build/cuda-att bash kernels/cuda/device_run.sh --stage .dev/gpu-att2
#   strip -o .dev/gpu-att2/cuda_attention_tc_test build/cuda-att/tests/kernels/cuda_attention_tc_test
# then, on the GPU machine: bash kernels/cuda/bench/attn_tc_run.sh .dev/gpu-att2
# In order (each step with its own limit; the first ones matter most): moemesh synth of the
# 4-layer Qwen3-30B-A3B shape (background), the bf16 peak (torch.matmul 8192^3), the contract's
# tests (cuda_attention_tc_test) and the f32 prefill kernel's bit test, the 4K prefill in one
# forward (bench-model --prefill-rows 4096) with the f32 kernels (old) and the contract with two
# key buffers (tc8, the default) and one (tc8one) (CONFS="name:TC:WARPS:DB ..." to change), decode
# batch 1 old vs tc8 (twice, alternating), the per-op GPU times of each (MM_GPU_OPTIME=1:
# attention per 4096-row call), ncu on the contract's kernel, fixture parity with the contract
# on, decode batch 64 old vs tc8. Logs: $OUT/log (all), $OUT/*.txt.
set -u
D=${1:-.dev/gpu-att2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
M=/tmp/q3-tc-L4
T0=$(date +%s)
t() { echo "[t+$(( $(date +%s) - T0 )) s]"; }
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv
( timeout 150 "$D/moemesh" synth --out "$M" --layers 4 > "$OUT/synth.txt" 2>&1
  echo "synth rc=$?" >> "$OUT/synth.txt" ) &
SYNTH_PID=$!
echo "== bf16 peak (torch.matmul 8192^3, mean of 20 after 5 warm-ups) $(t)"
PEAK=$(timeout 40 python3 kernels/cuda/bench/bf16_peak.py)
echo "peak ${PEAK:-unmeasured} TFLOP/s"
echo "== contract tests (cuda_attention_tc_test) $(t)"
timeout 60 "$D/cuda_attention_tc_test" > "$OUT/tc_test.txt" 2>&1
echo "rc=$?"; cat "$OUT/tc_test.txt" | tail -20
echo "== f32 prefill kernel: decode kernel bits (contract off) $(t)"
timeout 30 "$D/cuda_decode_ops_test" "attention prefill kernel: decode kernel bits" 2>&1 | tail -9
echo "== whole-model prefill, 4096 tokens in one forward (synth 4 layers) $(t)"
wait "$SYNTH_PID"; tail -2 "$OUT/synth.txt"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 3"
# configurations: name, MM_GPU_ATT_TC, MM_GPU_ATT_TC_WARPS, MM_GPU_ATT_TC_DB
CONFS=${CONFS:-"old:0:8:1 tc8:1:8:1 tc8one:1:8:0"}
for c in $CONFS; do
    IFS=: read -r p e w b <<< "$c"
    echo "-- $p (MM_GPU_ATT_TC=$e MM_GPU_ATT_TC_WARPS=$w MM_GPU_ATT_TC_DB=$b) $(t)"
    MM_GPU_ATT_TC=$e MM_GPU_ATT_TC_WARPS=$w MM_GPU_ATT_TC_DB=$b timeout 30 $BM > "$OUT/prefill_$p.txt" 2>&1 || echo "bench-model failed rc=$?"
    grep -E "^prompt|failed|error" "$OUT/prefill_$p.txt"
done
echo "== decode batch 1 (prompt 128, 32 tokens, 2 rounds), alternating $(t)"
for i in 1 2; do
for c in old:0 tc8:1; do
    IFS=: read -r p e <<< "$c"
    echo "-- $p run $i $(t)"
    MM_GPU_ATT_TC=$e timeout 30 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
        --decode-tokens 32 --rounds 2 --bw-mb 64 > "$OUT/decode_${p}_$i.txt" 2>&1 || echo "bench-model failed rc=$?"
    grep -E "^decode: best|^decode op by op|failed|error" "$OUT/decode_${p}_$i.txt"
done
done
echo "== per-op GPU times (MM_GPU_OPTIME=1) $(t)"
for c in $CONFS; do
    IFS=: read -r p e w b <<< "$c"
    echo "-- $p $(t)"
    MM_GPU_OPTIME=1 MM_GPU_ATT_TC=$e MM_GPU_ATT_TC_WARPS=$w MM_GPU_ATT_TC_DB=$b timeout 30 $BM > "$OUT/optime_$p.txt" 2>&1 || echo "optime run failed rc=$?"
    grep -E "^prompt:" "$OUT/optime_$p.txt"; sed -n "/steps of 4096 row/,+4p" "$OUT/optime_$p.txt"
done
if command -v ncu >/dev/null; then
    # the NCU_SKIP-th call of the kernel (0: the first, which in the 02:01 UTC run was a one-row
    # call of bench-model's warm-up, not a 4096-row one; how many precede those is not checked)
    echo "== ncu on the contract's kernel, call ${NCU_SKIP:-0} (clocks left alone) $(t)"
    MM_GPU_ATT_TC=1 timeout 90 ncu --clock-control none -k regex:attention_tc_kernel --launch-skip "${NCU_SKIP:-0}" --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section LaunchStats $D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 \
        --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 > "$OUT/ncu_tc.txt" 2>&1
    grep -E "attention_tc|Duration|Throughput|Occupancy|Registers|Stall|Warp Cycles|Block Limit|Issued|Pipe|Tensor|Executed Ipc|SM Busy|Eligible" "$OUT/ncu_tc.txt" | head -50
fi
echo "== fixture parity with the contract on (moemesh logits --device cuda:0) $(t)"
for d in tests/fixtures/models/*/; do
    [ -f "$d/reference.json" ] || continue
    MM_GPU_ATT_TC=1 timeout 30 python3 kernels/cuda/parity.py "$d" "$D/moemesh" --strict || echo "PARITY FAIL $d"
done
echo "== decode batch 64 (prompt 128, 32 tokens) $(t)"
for c in old:0 tc8:1; do
    IFS=: read -r p e <<< "$c"
    echo "-- $p $(t)"
    MM_GPU_ATT_TC=$e timeout 40 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
        --decode-tokens 32 --rounds 1 --bw-mb 64 --batch 64 > "$OUT/batch64_$p.txt" 2>&1 || echo "bench-model failed rc=$?"
    grep -E "^batch 64|failed|error" "$OUT/batch64_$p.txt"
done
echo "== every GPU op test case with the contract on: which tests assume the f32 kernels $(t)"
if [ $(( $(date +%s) - T0 )) -lt 130 ]; then
    for tb in cuda_ops_test cuda_decode_ops_test model_devpath_test; do
        [ -x "$D/$tb" ] || continue
        while IFS= read -r c; do
            MM_GPU_ATT_TC=1 timeout 60 "$D/$tb" "$c" > "$OUT/case.txt" 2>&1; rc=$?
            echo "rc=$rc $tb: $c"
            [ $rc = 0 ] || [ $rc = 77 ] || grep -E "FAIL|expected|nmse|differ" "$OUT/case.txt" | head -3 | sed 's/^/      /'
        done < <(timeout 20 "$D/$tb" --list)
    done
else
    echo "skipped: past 130 s"
fi
echo "done $(t)"
date -u

#!/usr/bin/env bash
# One device run: GPU facts, the bf16 peak through PyTorch (cuBLAS), the op tests (every case,
# then memcheck on a few), and moemesh-gpu-bench. Binaries come prebuilt (make cuda) in $1
# (default .dev/gpu) with any shared libraries they need under $1/lib. Output: $OUT/log.
# Switches (env): TESTS=0 MEMCHECK=0 BENCH=0 NOPEAK=1 skip parts; NCU=1 profiles the GEMM and
# GEMV once (NCU_GEMM: the GEMM kernel's name regex, default gemm_wg_kernel; gemm_wp_kernel for
# the warp-specialised one, gemm_ws_kernel for the bulk-copy one; NCU_COUNT launches of it, e.g.
# 3 with NCU_GEMM='gemm_ws_kernel|wg_convert' for both conversions and the kernel, after
# NCU_SKIP matching launches (54 per bench variant: the bench's 13, 14, 15 at 0, 54, 108); NCU_GEMV=0
# skips the GEMV profile); CASE="name" runs that op test case only; MEMCHECK_CASES="a;b"
# replaces the memcheck cases; BENCH_ONLY=prefill runs that bench section only; PARITY=1 runs `moemesh logits --device cuda:0` on every fixture model against
# the transformers logits; MODEL=1 synthesizes a Qwen3-30B-A3B-shaped checkpoint with
# MODEL_LAYERS (4) layers and runs `moemesh bench-model --device cuda:0` on it. CASES="a;b"
# runs those op test cases only. PREFILL_MODEL=1 synthesizes the same checkpoint (in the
# background from the start) and times a PF_TOKENS (4096) prompt in forwards of PF_ROWS (4096)
# rows, 3 prompt rounds, then again with MM_GPU_OPTIME=1 for the per-op split (stderr table).
set -u
D=${1:-.dev/gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
date -u
PM=/tmp/q3-30b-a3b-L${MODEL_LAYERS:-4}
if [ "${PREFILL_MODEL:-0}" = 1 ] && [ -x "$D/moemesh" ]; then # CPU and disk only: alongside
    ( timeout 300 "$D/moemesh" synth --out "$PM" --layers "${MODEL_LAYERS:-4}" > "$OUT/synth.log" 2>&1;
      echo "synth rc=$?" >> "$OUT/synth.log" ) &
    SYNTH_PID=$!
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
PEAK=
[ "${NOPEAK:-0}" = 1 ] || echo "== bf16 peak (torch.matmul 8192^3, random data, mean of 20 after 5 warm-ups)"
[ "${NOPEAK:-0}" = 1 ] || PEAK=$(timeout 120 python3 kernels/cuda/bench/bf16_peak.py)
[ "${NOPEAK:-0}" = 1 ] || echo "peak ${PEAK:-unmeasured} TFLOP/s"
[ "${TESTS:-1}" = 1 ] && echo "== op tests"
T=$D/cuda_ops_test
pass=0; fail=0
[ "${TESTS:-1}" = 1 ] && while IFS= read -r c; do
    [ -n "${CASE:-}" ] && [ "$c" != "$CASE" ] && continue
    [ -n "${CASES:-}" ] && [[ ";$CASES;" != *";$c;"* ]] && continue
    if timeout 300 "$T" "$c" > "$OUT/case.log" 2>&1; then pass=$((pass+1)); echo "ok    $c"; else
        rc=$?; fail=$((fail+1)); echo "FAIL  $c (rc=$rc)"; fi
    sed 's/^/      /' "$OUT/case.log"
done < <("$T" --list)
[ "${TESTS:-1}" = 1 ] && echo "op tests: $pass passed, $fail failed"
[ "${MEMCHECK:-1}" = 1 ] && echo "== memcheck (compute-sanitizer)"
MC=${MEMCHECK_CASES:-matmul bf16 vs cpu;grouped expert matmul equals per-expert;kv_store and attention vs cpu}
[ "${MEMCHECK:-1}" = 1 ] && IFS=';' read -r -a MCA <<< "$MC" && for c in "${MCA[@]}"; do
    echo "-- $c"
    timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "$T" "$c" 2>&1 | grep -E "ERROR SUMMARY|Invalid|error" | head -8
done
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    echo "== ncu (hardware counters; clocks left alone)"
    timeout 150 ncu --clock-control none -k "regex:${NCU_GEMM:-gemm_wg_kernel}" --launch-count "${NCU_COUNT:-1}" --launch-skip "${NCU_SKIP:-0}" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        "$D/moemesh-gpu-bench" --only prefill --quick > "$OUT/ncu_gemm.txt" 2>&1
    [ "${NCU_GEMV:-1}" = 1 ] && timeout 150 ncu --clock-control none -k regex:gemv_mma --launch-skip 40 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        "$D/moemesh-gpu-bench" --only gemv --quick > "$OUT/ncu_gemv.txt" 2>&1
    grep -hE "gemm_|wg_convert|gemv_mma|Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Stall|Warp Cycles|Block Limit|Issued" "$OUT"/ncu_*.txt | head -60
fi
if [ "${PARITY:-0}" = 1 ] && [ -x "$D/moemesh" ]; then
    echo "== whole model on cuda:0 vs the transformers fixtures (moemesh logits --device cuda:0)"
    for d in tests/fixtures/models/*/; do
        [ -f "$d/reference.json" ] || continue
        timeout 120 python3 kernels/cuda/parity.py "$d" "$D/moemesh"
    done
fi
if [ "${MODEL:-0}" = 1 ] && [ -x "$D/moemesh" ]; then
    L=${MODEL_LAYERS:-4}
    M=/tmp/q3-30b-a3b-L$L
    echo "== whole-model decode: moemesh synth (Qwen3-30B-A3B shape, $L layers) + bench-model --device cuda:0"
    timeout 240 "$D/moemesh" synth --out "$M" --layers "$L" || echo "synth failed rc=$?"
    timeout 240 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
        --decode-tokens 32 --rounds 2 --bw-mb 256 || echo "bench-model failed rc=$?"
fi
if [ "${BENCH:-1}" = 1 ]; then
    echo "== bench"
    for b in ${BENCH_ONLY:-all}; do # BENCH_ONLY="moe prefill": each section in turn
        timeout 400 "$D/moemesh-gpu-bench" ${PEAK:+--peak-tflops $PEAK} $([ "$b" = all ] || echo --only "$b")
    done
fi
if [ "${PREFILL_MODEL:-0}" = 1 ] && [ -n "${SYNTH_PID:-}" ]; then
    echo "== whole-model prefill: ${PF_TOKENS:-4096} tokens in forwards of ${PF_ROWS:-4096} rows (synth ${MODEL_LAYERS:-4} layers)"
    wait "$SYNTH_PID"; tail -2 "$OUT/synth.log"
    BM="$D/moemesh bench-model --model $PM --device cuda:0 --prompt-tokens ${PF_TOKENS:-4096} --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64"
    timeout 120 $BM --prefill-rows "${PF_ROWS:-4096}" --prompt-rounds 3 2>&1 | grep -E "^model|^prompt|paged|failed|error|bench-model" || echo "bench-model failed"
    # per-op GPU times averaged over the prompt rounds (the first builds the permuted-W cache
    # and grows the workspace pool): 1 round and 3 rounds, so steady = (3 * avg3 - avg1) / 2
    for r in 1 3; do
        echo "-- the same op by op with per-op GPU times (MM_GPU_OPTIME=1), $r prompt round(s)"
        MM_GPU_OPTIME=1 timeout 120 $BM --prefill-rows "${PF_ROWS:-4096}" --prompt-rounds $r > "$OUT/optime$r.txt" 2>&1 || echo "optime run failed rc=$?"
        grep -E "^prompt" "$OUT/optime$r.txt"; sed -n "/steps of ${PF_ROWS:-4096} row/,/^[a-z]/p" "$OUT/optime$r.txt" | head -24
    done
fi
date -u

#!/usr/bin/env bash
# One device run: GPU facts, the bf16 peak through PyTorch (cuBLAS), the op tests (every case,
# then memcheck on a few), and moemesh-gpu-bench. Binaries come prebuilt (make cuda) in $1
# (default .dev/gpu) with any shared libraries they need under $1/lib. Output: $OUT/log.
set -u
D=${1:-.dev/gpu}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
echo "== bf16 peak (torch.matmul 8192^3, random data, mean of 20 after 5 warm-ups)"
PEAK=$(timeout 120 python3 - <<'PY'
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(5): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(20): a @ b
e.record(); torch.cuda.synchronize()
print("%.1f" % (2 * 8192**3 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12))
PY
)
echo "peak ${PEAK:-unmeasured} TFLOP/s"
echo "== op tests"
T=$D/cuda_ops_test
pass=0; fail=0
while IFS= read -r c; do
    if timeout 300 "$T" "$c" > "$OUT/case.log" 2>&1; then pass=$((pass+1)); echo "ok    $c"; else
        rc=$?; fail=$((fail+1)); echo "FAIL  $c (rc=$rc)"; fi
    sed 's/^/      /' "$OUT/case.log"
done < <("$T" --list)
echo "op tests: $pass passed, $fail failed"
echo "== memcheck (compute-sanitizer) on three cases"
for c in "matmul bf16 vs cpu" "grouped expert matmul equals per-expert" "kv_store and attention vs cpu"; do
    timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "$T" "$c" 2>&1 | grep -E "ERROR SUMMARY|Invalid|error" | head -8
done
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    echo "== ncu (hardware counters; clocks left alone)"
    timeout 150 ncu --clock-control none -k regex:gemm_mma_async --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        "$D/moemesh-gpu-bench" --only prefill --quick > "$OUT/ncu_gemm.txt" 2>&1
    timeout 150 ncu --clock-control none -k regex:gemv_mma --launch-skip 40 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        "$D/moemesh-gpu-bench" --only gemv --quick > "$OUT/ncu_gemv.txt" 2>&1
    grep -hE "gemm_mma|gemv_mma|Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Stall|Warp Cycles|Block Limit|Issued" "$OUT"/ncu_*.txt | head -60
fi
echo "== bench"
timeout 400 "$D/moemesh-gpu-bench" ${PEAK:+--peak-tflops $PEAK}
date -u

#!/usr/bin/env bash
# One device run for the whole-model 4K prefill (issue 7; kernels/cuda/bench/NOTES.md versions
# 13+): old and new side by side in one process image, switched by environment:
#   MM_GPU_PF_FUSE=0     the earlier gemm_ws x conversion and the MoE layer's gather / SwiGLU /
#                        scatter as ops of their own (default: inside the grouped gemm_ws product)
#   MM_GPU_ATT_TC_MT=1   prefill attention with one m16 tile per warp (default: two, tc2)
#   $CONFS               "name:ENV=VAL,ENV=VAL ..." configurations to time (default: old, fuse,
#                        new; "new:" is every default)
# Binaries: built with `make CUDA=1 BUILD=build/cuda-pf3 -j2 all test-bins
# build/cuda-pf3/bin/moemesh-gpu-bench`, staged with `BUILD_CUDA=build/cuda-pf3 bash
# kernels/cuda/device_run.sh --stage .dev/gpu-pf3` plus `strip -o .dev/gpu-pf3/cuda_prefill_rows_test
# build/cuda-pf3/tests/kernels/cuda_prefill_rows_test`, carried as .dev/gpu-pf3.tar.xz (the
# folder is over the 64 MiB carry limit) and unpacked here when the folder is missing.
# In order: moemesh synth (background), the bf16 peak, the op tests of the products and the
# attention contract, a model-level bit check (moemesh logits, fixture mixtral-tiny, 512 ids:
# 128 rows per expert, MM_GPU_PF_FUSE=0 vs 1), bench-model's 4K prefill in one forward (each
# configuration, twice, in turn), decode batch 1 (old, new), the per-kernel GPU times of one
# forward (nsys, else ncu's gpu__time_duration; BREAKDOWN=0 skips), ncu on the attention kernel
# (NCU_ATT=0 skips). Logs: $OUT/log and $OUT/*.txt.
set -u
D=${1:-.dev/gpu-pf3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$D" ] && [ -f "$D.tar.xz" ]; then
    python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$D.tar.xz" "$(dirname "$D")"
fi
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
M=/tmp/q3-pf3-L4
T0=$(date +%s)
t() { echo "[t+$(( $(date +%s) - T0 )) s]"; }
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
( timeout 150 "$D/moemesh" synth --out "$M" --layers 4 > "$OUT/synth.txt" 2>&1
  echo "synth rc=$?" >> "$OUT/synth.txt" ) &
SYNTH_PID=$!
echo "== bf16 peak (torch.matmul 8192^3) $(t)"
PEAK=$(timeout 40 python3 kernels/cuda/bench/bf16_peak.py)
echo "peak ${PEAK:-unmeasured} TFLOP/s"
echo "== op tests $(t)"
pass=0; fail=0
for tb in cuda_prefill_rows_test cuda_attention_tc_test cuda_ops_test cuda_decode_ops_test model_devpath_test; do
    [ -x "$D/$tb" ] || { echo "MISSING $tb"; fail=$((fail+1)); continue; }
    while IFS= read -r c; do
        case "$tb:$c" in # the products, the contract, the model's device path
            cuda_ops_test:*matmul*|cuda_ops_test:*grouped*|cuda_ops_test:*permuted*) ;;
            cuda_decode_ops_test:*gemv*|cuda_decode_ops_test:*timer*) ;;
            cuda_prefill_rows_test:*|cuda_attention_tc_test:*|model_devpath_test:*) ;;
            *) continue ;;
        esac
        timeout 90 "$D/$tb" "$c" > "$OUT/case.txt" 2>&1; rc=$?
        if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $tb: $c"
        elif [ $rc = 77 ]; then echo "skip  $tb: $c"
        else fail=$((fail+1)); echo "FAIL  $tb: $c (rc=$rc)"; fi
        grep -E "differ|bit-identical|FAIL|expected|SKIP" "$OUT/case.txt" | head -8 | sed 's/^/      /'
    done < <(timeout 20 "$D/$tb" --list)
done
echo "op tests: $pass passed, $fail failed $(t)"
if command -v compute-sanitizer >/dev/null && [ "${MEMCHECK:-1}" = 1 ]; then
    echo "== compute-sanitizer memcheck: the new products' and the two-tile attention's cases $(t)"
    for tc in "cuda_prefill_rows_test:grouped prefill rows on gemm_ws: gathered GEMV bits" \
              "cuda_attention_tc_test:tc attention GQA 8: cpu tolerance, decode == chunks == whole bits"; do
        timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/${tc%%:*}" "${tc#*:}" > "$OUT/memcheck.txt" 2>&1
        echo "rc=$? ${tc#*:}: $(grep -E "ERROR SUMMARY" "$OUT/memcheck.txt" | tail -1)"
    done
fi
echo "== model-level bits: moemesh logits, mixtral-tiny, 512 ids, MM_GPU_PF_FUSE=0 vs 1 $(t)"
IDS=$(python3 -c "print(','.join(str((i*37+11)%500) for i in range(512)))")
for f in 0 1; do
    MM_GPU_PF_FUSE=$f timeout 30 "$D/moemesh" logits --model tests/fixtures/models/mixtral-tiny \
        --ids "$IDS" --out "$OUT/logits_$f.f32" --device cuda:0 > "$OUT/logits_$f.txt" 2>&1 || { echo "logits rc=$?"; tail -3 "$OUT/logits_$f.txt"; }
done
cmp "$OUT/logits_0.f32" "$OUT/logits_1.f32" && echo "logits: identical ($(stat -c %s "$OUT/logits_1.f32") bytes)"
rm -f "$OUT"/logits_*.f32
echo "== whole-model prefill, 4096 tokens in one forward (synth 4 layers) $(t)"
wait "$SYNTH_PID"; tail -1 "$OUT/synth.txt"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 3"
CONFS=${CONFS:-"old:MM_GPU_PF_FUSE=0,MM_GPU_ATT_TC_MT=1 fuse:MM_GPU_ATT_TC_MT=1 new:"}
for i in 1 2; do
    for c in $CONFS; do
        n=${c%%:*}; e=${c#*:}
        echo "-- $n ($e) run $i $(t)"
        env ${e//,/ } timeout 40 $BM > "$OUT/prefill_${n}_$i.txt" 2>&1 || echo "bench-model failed rc=$?"
        grep -E "^prompt|failed|error" "$OUT/prefill_${n}_$i.txt"
    done
done
echo "== decode batch 1 (prompt 128, 32 tokens, 2 rounds): old, new $(t)"
for c in "old:MM_GPU_PF_FUSE=0,MM_GPU_ATT_TC_MT=1" "new:"; do
    n=${c%%:*}; e=${c#*:}
    env ${e//,/ } timeout 30 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
        --decode-tokens 32 --rounds 2 --bw-mb 64 > "$OUT/decode_$n.txt" 2>&1 || echo "bench-model failed rc=$?"
    echo "-- $n: $(grep -E "^decode: best|failed|error" "$OUT/decode_$n.txt" | tr '\n' ' ')"
done
if [ "${BREAKDOWN:-1}" = 1 ]; then
    # every kernel's GPU time in a bench-model run with two 4096-row forwards; the second is
    # the steady one (the first also builds the permuted-W caches): kernels/cuda/bench/pf3_kernels.py
    for c in "new:" "old:MM_GPU_PF_FUSE=0,MM_GPU_ATT_TC_MT=1"; do
        n=${c%%:*}; e=${c#*:}
        [ $(( $(date +%s) - T0 )) -lt ${BREAKDOWN_BEFORE:-200} ] || { echo "breakdown $n skipped: past ${BREAKDOWN_BEFORE:-200} s"; continue; }
        echo "== per-kernel GPU times, $n $(t)"
        BMK="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 1 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 2"
        if command -v nsys >/dev/null; then
            env ${e//,/ } timeout 90 nsys profile -t cuda --cuda-graph-trace=node -o "$OUT/nsys_$n" -f true $BMK > "$OUT/nsys_$n.txt" 2>&1
            timeout 60 nsys stats -q -r cuda_gpu_trace -f csv -o "$OUT/trace_$n" "$OUT/nsys_$n.nsys-rep" > /dev/null 2>&1
            rm -f "$OUT/nsys_$n.nsys-rep" "$OUT/nsys_$n.sqlite"
            f=$(ls "$OUT"/trace_${n}*.csv 2>/dev/null | head -1)
        else
            # (ncu locks the clocks at base and flushes caches per kernel: shares, not the forward's times)
            env ${e//,/ } timeout 120 ncu --csv --metrics gpu__time_duration.sum $BMK > "$OUT/ncu_all_$n.csv" 2>&1
            f="$OUT/ncu_all_$n.csv"
        fi
        [ -n "${f:-}" ] && [ -f "$f" ] && python3 kernels/cuda/bench/pf3_kernels.py "$f" | tee "$OUT/kernels_$n.txt" | head -40
    done
fi
if [ "${NCU_ATT:-1}" = 1 ] && command -v ncu >/dev/null && [ $(( $(date +%s) - T0 )) -lt ${NCU_BEFORE:-240} ]; then
    echo "== ncu on attention_tc2_kernel (4096 rows) $(t)"
    timeout 50 ncu --clock-control none -k "regex:^attention_tc2_kernel" --launch-skip 0 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
        $BM --prompt-rounds 1 > "$OUT/ncu_tc2.txt" 2>&1
    grep -E "attention_tc|Duration|Registers Per|Issued Ipc|No Eligible|Warp Cycles Per Issued|Issued Instructions  |stalled_(wait|short|long)|pipe_tensor\.avg" "$OUT/ncu_tc2.txt" | head -24
fi
echo "done $(t)"
date -u

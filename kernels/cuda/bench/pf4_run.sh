#!/usr/bin/env bash
# One device run for the grouped expert products of the 4K prefill (issue 7; kernels/cuda/bench/
# NOTES.md prefill version 16): the gemm_ws grouped variants side by side in one process image,
# switched by environment:
#   MM_GPU_WS_GROUPED=20  the earlier grouped kernel (the y_idx scatter loads each row index
#                         next to its store; every tile on m64n128 wgmmas)
#   MM_GPU_WS_GROUPED=21  the thread's y rows loaded once per tile, before its first store
#   MM_GPU_WS_GROUPED=22  21 + m64n32 / m64n64 wgmmas for tiles of <= 32 / <= 64 rows
#   MM_GPU_WS_GROUPED=23  22 + each tile published by the producer warp in shared memory (the
#                         consumer warps no longer look it up over the offsets)
#   MM_GPU_WS_GROUPED=25  23 + the outputs through shared memory by bulk row copies (4 stages)
#                         (24, 23 + warpgroup 1 lagging, and 26, 23 with 4 stages: removed)
#   $CONFS                "name:ENV=VAL,ENV=VAL ..." configurations to time ("new:" = defaults)
# Binaries: built in a clean worktree of HEAD + these changes with `make CUDA=1
# BUILD=build/cuda-pf4 -j2 all test-bins build/cuda-pf4/bin/moemesh-gpu-bench`, staged with
# `BUILD_CUDA=build/cuda-pf4 bash kernels/cuda/device_run.sh --stage .dev/gpu-pf4` plus `strip -o
# .dev/gpu-pf4/cuda_prefill_rows_test build/cuda-pf4/tests/kernels/cuda_prefill_rows_test`, carried
# as .dev/gpu-pf4.tar.xz (unpacked here when the folder is missing).
# In order: moemesh synth (background), the bf16 peak, every case of the GPU tests (ALL=0: only
# the products' and the model's; cuda_prefill_rows_test: variants 19-27 == the gathered grouped
# GEMV bit for bit), memcheck on the grouped rows cases, moemesh logits bits (mixtral-tiny, 512
# ids, 128 rows per expert) with variants 20, 23, 25, bench-model's 4K prefill in one forward
# (each configuration, twice, in turn), decode batch 1 (the default), moemesh-gpu-bench --only
# moe (the grouped variants alone, with bits), the per-kernel GPU times of one forward (ncu
# gpu__time_duration) for $BREAKDOWN_CONFS, ncu sections of two grouped gemm_ws launches ([gate;
# up] and down) of each of $NCU_CONFS. Logs: $OUT/log and the rest in $OUT/all.tgz.
set -u
D=${1:-.dev/gpu-pf4}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$D" ] && [ -f "$D.tar.xz" ]; then
    python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$D.tar.xz" "$(dirname "$D")"
fi
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
M=/tmp/q3-pf4-L4
T0=$(date +%s)
t() { echo "[t+$(( $(date +%s) - T0 )) s]"; }
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
( timeout 150 "$D/moemesh" synth --out "$M" --layers 4 > "$OUT/synth.txt" 2>&1
  echo "synth rc=$?" >> "$OUT/synth.txt" ) &
SYNTH_PID=$!
echo "== bf16 peak (torch.matmul 8192^3) $(t)"
PEAK=$(timeout 40 python3 kernels/cuda/bench/bf16_peak.py)
echo "peak ${PEAK:-unmeasured} TFLOP/s"
echo "== op tests $(t)"
pass=0; fail=0
for tb in cuda_prefill_rows_test cuda_ops_test cuda_decode_ops_test cuda_chain_ops_test cuda_attention_tc_test model_devpath_test; do
    [ -x "$D/$tb" ] || { echo "MISSING $tb"; fail=$((fail+1)); continue; }
    while IFS= read -r c; do
        case "$tb:$c" in # ALL=0: the products and the model's device path
            cuda_ops_test:*matmul*|cuda_ops_test:*grouped*|cuda_ops_test:*permuted*) ;;
            cuda_decode_ops_test:*gemv*|cuda_decode_ops_test:*grouped*) ;;
            cuda_prefill_rows_test:*|model_devpath_test:*) ;;
            *) [ "${ALL:-1}" = 1 ] || continue ;;
        esac
        timeout 90 "$D/$tb" "$c" > "$OUT/case.txt" 2>&1; rc=$?
        if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $tb: $c"
        elif [ $rc = 77 ]; then echo "skip  $tb: $c"
        else fail=$((fail+1)); echo "FAIL  $tb: $c (rc=$rc)"; tail -4 "$OUT/case.txt" | sed 's/^/      /'; fi
        [ $tb = cuda_prefill_rows_test ] && grep -E "differ|FAIL|expected|SKIP" "$OUT/case.txt" | head -24 | sed 's/^/      /'
    done < <(timeout 20 "$D/$tb" --list)
done
echo "op tests: $pass passed, $fail failed $(t)"
if command -v compute-sanitizer >/dev/null && [ "${MEMCHECK:-1}" = 1 ]; then
    echo "== compute-sanitizer memcheck: the grouped rows cases (variants 19-26) $(t)"
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/cuda_prefill_rows_test" \
        "grouped prefill rows on gemm_ws: gathered GEMV bits" > "$OUT/memcheck.txt" 2>&1
    echo "rc=$? $(grep -E "ERROR SUMMARY" "$OUT/memcheck.txt" | tail -1)"
fi
echo "== model-level bits: moemesh logits, mixtral-tiny, 512 ids, MM_GPU_WS_GROUPED=20 vs 23 vs 25 $(t)"
IDS=$(python3 -c "print(','.join(str((i*37+11)%500) for i in range(512)))")
for f in 20 23 25; do
    MM_GPU_WS_GROUPED=$f timeout 30 "$D/moemesh" logits --model tests/fixtures/models/mixtral-tiny \
        --ids "$IDS" --out "$OUT/logits_$f.f32" --device cuda:0 > "$OUT/logits_$f.txt" 2>&1 || { echo "logits rc=$?"; tail -3 "$OUT/logits_$f.txt"; }
done
cmp "$OUT/logits_20.f32" "$OUT/logits_23.f32" && cmp "$OUT/logits_20.f32" "$OUT/logits_25.f32" &&
    echo "logits: identical ($(stat -c %s "$OUT/logits_23.f32") bytes)"
rm -f "$OUT"/logits_*.f32
echo "== whole-model prefill, 4096 tokens in one forward (synth 4 layers) $(t)"
wait "$SYNTH_PID"; tail -1 "$OUT/synth.txt"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 3"
CONFS=${CONFS:-"g20:MM_GPU_WS_GROUPED=20 g23:MM_GPU_WS_GROUPED=23 g25:MM_GPU_WS_GROUPED=25"}
for i in 1 2; do
    for c in $CONFS; do
        n=${c%%:*}; e=${c#*:}
        echo "-- $n ($e) run $i $(t)"
        env ${e//,/ } timeout 40 $BM > "$OUT/prefill_${n}_$i.txt" 2>&1 || echo "bench-model failed rc=$?"
        grep -E "^prompt|failed|error" "$OUT/prefill_${n}_$i.txt"
    done
done
echo "== decode batch 1 (prompt 128, 32 tokens, 2 rounds), defaults $(t)"
timeout 30 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
    --decode-tokens 32 --rounds 2 --bw-mb 64 > "$OUT/decode_new.txt" 2>&1 || echo "bench-model failed rc=$?"
grep -E "^decode: best|failed|error" "$OUT/decode_new.txt"
echo "== grouped products alone: moemesh-gpu-bench --only moe $(t)"
timeout 60 "$D/moemesh-gpu-bench" --peak-tflops "${PEAK:-800}" --only moe > "$OUT/bench_moe.txt" 2>&1 || echo "bench rc=$?"
grep -E "variant|prefill|tokens" "$OUT/bench_moe.txt" | head -30
if [ "${BREAKDOWN:-1}" = 1 ] && command -v ncu >/dev/null; then
    # every kernel's GPU time in a bench-model run with two 4096-row forwards
    # (ncu locks the clocks at base and flushes caches per kernel: shares, not the forward's times)
    BREAKDOWN_CONFS=${BREAKDOWN_CONFS:-"new: g23:MM_GPU_WS_GROUPED=23"}
    for c in $BREAKDOWN_CONFS; do
        n=${c%%:*}; e=${c#*:}
        [ $(( $(date +%s) - T0 )) -lt ${BREAKDOWN_BEFORE:-190} ] || { echo "breakdown $n skipped: past ${BREAKDOWN_BEFORE:-170} s"; continue; }
        echo "== per-kernel GPU times, $n $(t)"
        BMK="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 1 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 2"
        env ${e//,/ } timeout 80 ncu --csv --metrics gpu__time_duration.sum $BMK > "$OUT/ncu_all_$n.csv" 2>&1
        python3 kernels/cuda/bench/pf3_kernels.py "$OUT/ncu_all_$n.csv" | tee "$OUT/kernels_$n.txt" | head -24
    done
fi
if [ "${NCU_WS:-1}" = 1 ] && command -v ncu >/dev/null; then
    # one [gate; up] and one down launch of the grouped kernel (the 3rd and 4th grouped launches:
    # layer 1 of the first forward, past layer 0's permuted-W builds)
    NCU_CONFS=${NCU_CONFS:-"g25:MM_GPU_WS_GROUPED=25 g23:MM_GPU_WS_GROUPED=23"}
    for c in $NCU_CONFS; do
        n=${c%%:*}; e=${c#*:}
        [ $(( $(date +%s) - T0 )) -lt ${NCU_BEFORE:-245} ] || { echo "ncu $n skipped"; continue; }
        echo "== ncu on the grouped gemm_ws kernel, $n $(t)"
        env $e timeout 40 ncu --clock-control none --kernel-name-base demangled -k "regex:gemm_ws_kernel<.*\(bool\)1, \(int\)" --launch-skip 2 --launch-count 2 \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_(tensor|lsu|alu|fma).*\.avg\.pct_of_peak_sustained_active" \
            $BM --prompt-rounds 1 > "$OUT/ncu_ws_$n.txt" 2>&1
        grep -E "gemm_ws_kernel|Duration|Issued Ipc|No Eligible|Warp Cycles Per Issued|Issued Instructions  |stalled_(wait|short|long|barrier|lg|mio|math|membar|drain)[a-z_]*_per|pipe_(tensor|lsu)[a-z_.]*pct|Memory Throughput|L2 Cache Throughput" "$OUT/ncu_ws_$n.txt" | head -40
    done
fi
echo "done $(t)"
date -u
# the run tool brings back only a few files: everything but the log in one archive
( cd "$OUT" && tar -czf /tmp/pf4_all.tgz --exclude=./log . ) && find "$OUT" -type f ! -name log -delete &&
    mv /tmp/pf4_all.tgz "$OUT/all.tgz"

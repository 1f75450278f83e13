#!/usr/bin/env bash
# One device run for the prefill MoE layer's SwiGLU epilogue (issue 7; kernels/cuda/bench/NOTES.md
# prefill version 17), configurations switched by environment, in turn twice:
#   new   the defaults: [gate; up] on gemm_ws with WS_OPT_SWIGLU (SwiGLU in the epilogue, down's
#         bf16 x workspace written directly) and the row conversion with batched loads
#   old   MM_GPU_PF_SWIGLU_EPI=0 MM_GPU_CONV_BATCH=0 (f32 [gate; up] output, down's conversion
#         pass with x_up, the piecewise row conversion: the form before)
#   epi   MM_GPU_CONV_BATCH=0 (the SwiGLU epilogue alone)
# Binaries: `make CUDA=1 BUILD=build/cuda -j2 all test-bins`, staged with `BUILD_CUDA=build/cuda
# bash kernels/cuda/device_run.sh --stage .dev/gpu` (then only moemesh, cuda_prefill_rows_test,
# cuda_ops_test, model_devpath_test, cuda_decode_ops_test and lib/ are needed), carried as
# DIR.tar.xz and unpacked here when DIR is missing. In order: the GPU tests of the products and
# the model's device path, moemesh logits --prefill-rows 512 (128 rows per expert) on four
# fixtures per configuration (bytes compared; MM_GPU_OPTIME=1 names the ops that ran), the bf16
# peak, bench-model's 4K prefill per configuration twice in turn, compute-sanitizer on the new
# cases, ncu of layer 1's two grouped gemm_ws launches and of its row conversions (new and
# piecewise). Logs: $OUT/log.
set -u
D=${1:-.dev/gpu}
O=${OUT:-/tmp/out}
mkdir -p "$O"
if [ ! -d "$D" ] && [ -f "$D.tar.xz" ]; then
    python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$D.tar.xz" "$(dirname "$D")"
fi
export LD_LIBRARY_PATH=$PWD/$D/lib
exec > >(tee "$O/log") 2>&1
T0=$(date +%s); t() { echo "[t+$(( $(date +%s) - T0 )) s]"; }
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
M=/tmp/q3-30b-a3b-L4
( timeout 120 $D/moemesh synth --out $M --layers 4 > $O/synth.txt 2>&1; echo "synth rc=$?" >> $O/synth.txt ) &
SP=$!
echo "== GPU tests $(t)"
pass=0; fail=0
for tb in cuda_prefill_rows_test cuda_ops_test model_devpath_test cuda_decode_ops_test; do
  while IFS= read -r c; do
    case "$tb:$c" in
      cuda_ops_test:*matmul*|cuda_ops_test:*grouped*|cuda_ops_test:*permuted*|cuda_prefill_rows_test:*|model_devpath_test:*) ;;
      cuda_decode_ops_test:*gemv*) ;;
      *) continue ;;
    esac
    timeout 60 $D/$tb "$c" > $O/case.txt 2>&1; rc=$?
    if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $tb: $c"; elif [ $rc = 77 ]; then echo "skip  $tb: $c"; else fail=$((fail+1)); echo "FAIL  $tb: $c (rc=$rc)"; tail -4 $O/case.txt | sed 's/^/      /'; fi
    [ $tb = cuda_prefill_rows_test ] && grep -E "differ|FAIL|expected|SKIP" $O/case.txt | grep -E "ffn|FAIL|expected|SKIP|piece" | head -12 | sed 's/^/      /'
    cat $O/case.txt >> $O/tests_all.txt
  done < <(timeout 20 $D/$tb --list)
done
echo "GPU tests: $pass passed, $fail failed $(t)"
echo "== model bits: moemesh logits --device cuda:0 --prefill-rows 512 (128 rows per expert) $(t)"
IDS=$(python3 -c "print(','.join(str((i*37+11)%500) for i in range(512)))")
for m in mixtral-tiny qwen3moe-tiny deepseekv3-tiny glm4moe-tiny; do
  for s in new old epi; do
    case $s in new) E="";; old) E="MM_GPU_PF_SWIGLU_EPI=0 MM_GPU_CONV_BATCH=0";; epi) E="MM_GPU_CONV_BATCH=0";; esac
    env MM_GPU_OPTIME=1 $E timeout 30 $D/moemesh logits --model tests/fixtures/models/$m --ids "$IDS" --prefill-rows 512 \
      --out /tmp/lg_${m}_$s.f32 --device cuda:0 > $O/logits_${m}_$s.txt 2>&1 || { echo "logits $m $s rc=$?"; tail -3 $O/logits_${m}_$s.txt; }
    echo "  $m $s ($E): $(grep -E 'steps of' $O/logits_${m}_$s.txt | head -1 | grep -oE '[0-9]+ steps? of [0-9]+ row') ops: $(grep -oE '^ +(moe_ffn_rows|moe_matmul_rows|moe_matmul_dev|swiglu|copy_rows)[^ ]*' $O/logits_${m}_$s.txt | tr -s ' \n' ' ')"
  done
  cmp /tmp/lg_${m}_new.f32 /tmp/lg_${m}_old.f32 && cmp /tmp/lg_${m}_new.f32 /tmp/lg_${m}_epi.f32 && echo "$m: logits identical new/old/epi ($(stat -c %s /tmp/lg_${m}_new.f32) bytes)"
done
echo "== bf16 peak $(t)"
PEAK=$(timeout 40 python3 kernels/cuda/bench/bf16_peak.py 2>&1 | tail -1); echo "peak $PEAK TFLOP/s"
wait $SP; tail -2 $O/synth.txt
echo "== 4K prefill, 4 layers, configurations in turn $(t)"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --prefill-rows 4096 --prompt-rounds 3"
for i in 1 2; do for s in new old epi; do
  case $s in new) E="";; old) E="MM_GPU_PF_SWIGLU_EPI=0 MM_GPU_CONV_BATCH=0";; epi) E="MM_GPU_CONV_BATCH=0";; esac
  echo "-- $s ($E) run $i $(t)"
  env $E timeout 40 $BM > $O/prefill_${s}_$i.txt 2>&1 || echo "bench-model rc=$?"
  grep -E "^prompt:|failed|error" $O/prefill_${s}_$i.txt
done; done
echo "== compute-sanitizer memcheck $(t)"
for c in "moe_ffn_rows: SwiGLU in [gate; up]'s epilogue == the two products' bits" "row conversion piece by piece: the same bits" "grouped prefill rows on gemm_ws: gathered GEMV bits"; do
  timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 $D/cuda_prefill_rows_test "$c" > $O/memcheck.txt 2>&1
  echo "rc=$? $(grep -E 'ERROR SUMMARY' $O/memcheck.txt | tail -1)  ($c)"
done
if [ $(( $(date +%s) - T0 )) -lt 150 ]; then
  echo "== ncu: grouped gemm_ws, layer 1 ([gate; up] fused, down), defaults $(t)"
  timeout 40 ncu --clock-control none --kernel-name-base demangled -k "regex:gemm_ws_kernel<.*\(bool\)1, \(int\)" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,dram__bytes.sum" \
    $BM --prompt-rounds 1 > $O/ncu_ws.txt 2>&1
  grep -E "gemm_ws_kernel|Duration|Memory Throughput|Compute \(SM\)|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Issued Ipc|No Eligible|Warp Cycles Per Issued|gmma|lts__t_bytes|dram__bytes|stalled_(wait|short_scoreboard|long_scoreboard|barrier|lg_throttle|mio_throttle|math_pipe|membar|sleeping|dispatch|branch|no_inst|selected)[a-z_]*_per" $O/ncu_ws.txt | head -60
fi
for s in new old; do
  [ $(( $(date +%s) - T0 )) -lt 175 ] || { echo "ncu conv $s skipped $(t)"; continue; }
  case $s in new) E="";; old) E="MM_GPU_CONV_BATCH=0";; esac
  echo "== ncu: row conversions of layer 1 (q/k/v, o, router, [gate; up] gather), $s $(t)"
  env $E timeout 25 ncu --clock-control none --kernel-name-base demangled -k "regex:wg_convert_rows" --launch-skip 4 --launch-count 4 \
    --section SpeedOfLight $BM --prompt-rounds 1 > $O/ncu_conv_$s.txt 2>&1
  grep -E "wg_convert_rows|Duration|DRAM Throughput|Memory Throughput" $O/ncu_conv_$s.txt | head -16
done
echo "done $(t)"; date -u

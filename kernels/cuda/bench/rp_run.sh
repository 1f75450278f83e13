#!/usr/bin/env bash
# One device run for the routing plan by many blocks (route_plan.cu, NOTES.md prefill version 15):
# MM_GPU_ROUTE_PLAN_PAR=0 (the one-block plan at every size) against the default (many blocks
# from 2048 slots) and =2 (many blocks at every size, decode included), in one process image.
# Binaries: `make CUDA=1 BUILD=build/cuda-rp -j2 all test-bins build/cuda-rp/bin/moemesh-gpu-bench`,
# staged with `BUILD_CUDA=build/cuda-rp bash kernels/cuda/device_run.sh --stage .dev/gpu-rp` plus
# `strip -o .dev/gpu-rp/cuda_route_plan_test build/cuda-rp/tests/kernels/cuda_route_plan_test`,
# carried as .dev/gpu-rp.tar.xz (unpacked here when the folder is missing).
# In order: moemesh synth (background), the bf16 peak, GPU tests (the plan test; route and
# route_with_plan cases; model_devpath_test's cuda cases with the default and with
# MM_GPU_ROUTE_PLAN_PAR=2), memcheck on route_with_plan's parallel cases, moemesh logits bits
# (mixtral-tiny, 512 ids) PAR=0 vs 2, the 4K forward PAR=0 / 1 in turn twice, decode batch 1 and
# 64 with PAR=0 and 2, the per-op timer's steps of one 4K forward (route_with_plan's time per
# call, PAR=0 and 1), ncu of the plan kernels. Logs: $OUT/log and $OUT/*.txt.
set -u
D=${1:-.dev/gpu-rp}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$D" ] && [ -f "$D.tar.xz" ]; then
    python3 -c "import tarfile,sys;tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$D.tar.xz" "$(dirname "$D")"
fi
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
M=/tmp/q3-rp-L4
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
echo "== GPU tests $(t)"
pass=0; fail=0
run_case() { # env-prefix label, binary, case
    local ev=$1 tb=$2 c=$3 rc
    env $ev timeout 90 "$D/$tb" "$c" > "$OUT/case.txt" 2>&1; rc=$?
    if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $ev $tb: $c"
    elif [ $rc = 77 ]; then echo "skip  $ev $tb: $c"
    else fail=$((fail+1)); echo "FAIL  $ev $tb: $c (rc=$rc)"; tail -6 "$OUT/case.txt" | sed 's/^/      /'; fi
    grep -E "shapes|parallel plan same|differs|FAIL" "$OUT/case.txt" | head -8 | sed 's/^/      /'
}
for tb in cuda_route_plan_test cuda_chain_ops_test cuda_ops_test cuda_decode_ops_test model_devpath_test; do
    [ -x "$D/$tb" ] || { echo "MISSING $tb"; fail=$((fail+1)); continue; }
    while IFS= read -r c; do
        case "$tb:$c" in
            cuda_route_plan_test:*|cuda_chain_ops_test:route*|cuda_ops_test:route*) run_case X=0 "$tb" "$c" ;;
            cuda_decode_ops_test:*timer*) run_case X=0 "$tb" "$c" ;;
            model_devpath_test:cuda*)
                run_case X=0 "$tb" "$c"
                run_case MM_GPU_ROUTE_PLAN_PAR=2 "$tb" "$c" ;;
        esac
    done < <(timeout 20 "$D/$tb" --list)
done
echo "GPU tests: $pass passed, $fail failed $(t)"
if command -v compute-sanitizer >/dev/null; then
    echo "== compute-sanitizer memcheck: route_with_plan with the parallel plan $(t)"
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 "$D/cuda_route_plan_test" \
        "route_with_plan with the parallel plan == one launch bits" > "$OUT/memcheck.txt" 2>&1
    echo "rc=$? $(grep -E "ERROR SUMMARY" "$OUT/memcheck.txt" | tail -1)"
fi
echo "== model-level bits: moemesh logits, mixtral-tiny, 512 ids, MM_GPU_ROUTE_PLAN_PAR=0 vs 2 $(t)"
IDS=$(python3 -c "print(','.join(str((i*37+11)%500) for i in range(512)))")
for f in 0 2; do
    MM_GPU_ROUTE_PLAN_PAR=$f timeout 30 "$D/moemesh" logits --model tests/fixtures/models/mixtral-tiny \
        --ids "$IDS" --out "$OUT/logits_$f.f32" --device cuda:0 > "$OUT/logits_$f.txt" 2>&1 || { echo "logits rc=$?"; tail -3 "$OUT/logits_$f.txt"; }
done
cmp "$OUT/logits_0.f32" "$OUT/logits_2.f32" && echo "logits: identical ($(stat -c %s "$OUT/logits_2.f32") bytes)"
rm -f "$OUT"/logits_*.f32
echo "== 4K prefill, one forward (synth 4 layers), PAR=0 / 1 in turn $(t)"
wait "$SYNTH_PID"; tail -1 "$OUT/synth.txt"
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 --prompt-rounds 3"
for i in 1 2; do
    for p in 0 1; do
        MM_GPU_ROUTE_PLAN_PAR=$p timeout 40 $BM > "$OUT/prefill_${p}_$i.txt" 2>&1 || echo "bench-model failed rc=$?"
        echo "-- PAR=$p run $i: $(grep -E "^prompt|failed|error" "$OUT/prefill_${p}_$i.txt" | tr '\n' ' ') $(t)"
    done
done
echo "== decode batch 1 and 64 (prompt 128, 32 tokens, 2 rounds), PAR=0 / 2 $(t)"
for b in 1 64; do
    for p in 0 2; do
        MM_GPU_ROUTE_PLAN_PAR=$p timeout 40 "$D/moemesh" bench-model --model "$M" --device cuda:0 \
            --prompt-tokens 128 --decode-tokens 32 --rounds 2 --bw-mb 64 --batch $b > "$OUT/decode_${b}_$p.txt" 2>&1 || echo "bench-model failed rc=$?"
        echo "-- batch $b PAR=$p: $(grep -E "decode: best|batch $b decode|failed|error" "$OUT/decode_${b}_$p.txt" | sed -E 's/ \(prompts.*//' | tr '\n' ' ')"
    done
done
echo "== per-op timer, one 4K forward, PAR=0 / 1 (MM_GPU_OPTIME=2: steps split at embed_rmsnorm) $(t)"
for p in 0 1; do
    [ $(( $(date +%s) - T0 )) -lt 230 ] || { echo "optime $p skipped: past 230 s"; continue; }
    MM_GPU_ROUTE_PLAN_PAR=$p MM_GPU_OPTIME=2 timeout 40 "$D/moemesh" bench-model --model "$M" --device cuda:0 \
        --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --bw-mb 64 --prefill-rows 4096 \
        --prompt-rounds 1 > "$OUT/optime_$p.txt" 2>&1 || echo "optime rc=$?"
    echo "-- PAR=$p"; grep -E "gpu optime|route_with_plan|route_plan " "$OUT/optime_$p.txt" | head -12
done
if command -v ncu >/dev/null && [ $(( $(date +%s) - T0 )) -lt 250 ]; then
    echo "== ncu: route_plan kernels of one 4K forward, PAR=1 then 0 $(t)"
    for p in 1 0; do
        [ $(( $(date +%s) - T0 )) -lt 270 ] || { echo "ncu $p skipped"; continue; }
        MM_GPU_ROUTE_PLAN_PAR=$p timeout 25 ncu --csv --metrics gpu__time_duration.sum -k "regex:route_plan" \
            $BM --prompt-rounds 1 --decode-tokens 1 > "$OUT/ncu_rp_$p.csv" 2>&1
        echo "-- PAR=$p (kernel, grid, calls, us per call: ncu base clocks, caches flushed)"
        python3 - "$OUT/ncu_rp_$p.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if not rows:
    sys.exit("no ncu rows")
h = rows[0]
k, g, v = h.index("Kernel Name"), h.index("Grid Size"), h.index("Metric Value")
agg = collections.defaultdict(list)
for r in rows[1:]:
    agg[(r[k].split("(")[0], r[g])].append(float(r[v].replace(",", "")))
unit = [r for r in rows[1:]][0][h.index("Metric Unit")] if len(rows) > 1 else ""
for (name, grid), xs in sorted(agg.items(), key=lambda x: -sum(x[1])):
    print("  %-28s grid %-16s %3d calls  %9.1f %s per call" % (name, grid, len(xs), sum(xs) / len(xs), unit))
PY
    done
fi
echo "done $(t)"
date -u

#!/usr/bin/env bash
# Decode-step variants on the GPU machine in one run (one `run` call, < 300 s): the GPU tests
# that cover them, the copy bandwidth, then bench-model batch 1 (graph replay and op by op)
# over the variants in turn, ROUNDS times (default: the build's defaults against GEMV v2,
# MM_GPU_GEMV_BULK=0; the L2 prefetch hints it was written for were removed after they lost, see
# NOTES.md), batch 64 for the first two variants, and ncu durations of every kernel of a decode
# step for the first two variants.
# Prepare here:
#     make CUDA=1 BUILD=build/cuda-dec3 -j2 all test-bins build/cuda-dec3/bin/moemesh-gpu-bench
#     BUILD_CUDA=build/cuda-dec3 bash kernels/cuda/device_run.sh --stage .dev/gpu-dec3
#     (cd .dev && tar cJf gpu-dec3.tar.xz gpu-dec3)
# then on the GPU machine, from the repo root, carrying .dev/gpu-dec3.tar.xz:
#     python3 -c "import tarfile;tarfile.open('.dev/gpu-dec3.tar.xz').extractall('.dev')"
#     bash kernels/cuda/bench/decode_l2pf.sh .dev/gpu-dec3
# Output: stdout (the test list, then the figures); raw files in $OUT/l2pf.tgz.
# VARIANTS="name=ENV ..." overrides the batch-1 variants; SKIP="tests ncu" leaves sections out.
set -u
D=${1:-.dev/gpu-dec3}
OUT=${OUT:-/tmp/out}
R=/tmp/l2pf
mkdir -p "$OUT" "$R"
trap 'tar czf "$OUT/l2pf.tgz" -C /tmp l2pf' EXIT
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
SKIP=${SKIP:-}
skip() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
M=/tmp/q3-30b-a3b-L4
B="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64 --prompt-tokens 128"
s() { echo; echo "== $1 (t+$SECONDS s)"; }
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f "$M/config.json" ] || {
    ( timeout 150 "$D/moemesh" synth --out "$M" --layers 4 > "$R/synth.txt" 2>&1
      echo "rc=$?" >> "$R/synth.txt" ) &
    SP=$!
}
if ! skip tests; then
    s "GPU tests: cuda_decode_ops_test, cuda_chain_ops_test, model_devpath_test (cuda cases), cuda_ops_test (products)"
    pass=0; fail=0
    for t in cuda_decode_ops_test cuda_chain_ops_test model_devpath_test cuda_ops_test; do
        while IFS= read -r c; do
            case "$t:$c" in model_devpath_test:cuda*) ;; model_devpath_test:*) continue ;;
                cuda_ops_test:matmul*|cuda_ops_test:grouped*) ;; cuda_ops_test:*) continue ;; esac
            timeout 60 "$D/$t" "$c" > "$R/case.txt" 2>&1; rc=$?
            if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $t: $c"
            elif [ $rc = 77 ]; then echo "skip  $t: $c"
            else fail=$((fail+1)); echo "FAIL  $t: $c (rc=$rc)"; tail -6 "$R/case.txt" | sed 's/^/      /'; fi
            grep -E "L2 hints|prefetch|first difference" "$R/case.txt" | sort -u | head -4 | sed 's/^/      /'
            cat "$R/case.txt" >> "$R/tests-all.txt"
        done < <(timeout 20 "$D/$t" --list)
    done
    echo "GPU tests: $pass passed, $fail failed"
fi 2>&1 | tee "$R/tests.txt"
s "copy bandwidth"
timeout 60 "$D/moemesh-gpu-bench" --only none > "$R/copy.txt" 2>&1
COPY=$(grep -oE '[0-9.]+ GB/s' "$R/copy.txt" | head -1 | cut -d' ' -f1)
echo "copy bandwidth: ${COPY:-unmeasured} GB/s"
[ -n "${SP:-}" ] && { wait "$SP"; tail -1 "$R/synth.txt"; }
ab() { # name, extra bench flags (quoted), env...
    local n=$1 fl=$2; shift 2
    env "$@" timeout 60 $B $fl > "$R/b-$n.txt" 2>&1 || echo "$n: rc=$?"
    local t mb
    t=$(grep -oE 'decode: best [0-9.]+' "$R/b-$n.txt" | grep -oE '[0-9.]+$')
    mb=$(grep -oE 'weights read per decode token: [0-9.]+' "$R/b-$n.txt" | grep -oE '[0-9.]+$')
    local pct=""
    [ -n "$COPY" ] && [ -n "$t" ] && [ -n "$mb" ] &&
        pct=$(awk -v c="$COPY" -v mb="$mb" -v t="$t" 'BEGIN { printf "= %.1f%% of copy", 100 * t * mb / 1000 / c }')
    echo "$n: $(grep -E "decode: best|op by op|batch 64 decode" "$R/b-$n.txt" |
        sed -E 's/ \(prompts.*//; s/ms\/token/ms/g' | tr '\n' ' ') $pct" | tee -a "$R/ab.txt"
}
VARIANTS=${VARIANTS:-"def=X=0 v2=MM_GPU_GEMV_BULK=0"}
s "bench-model batch 1, variants in turn (graph = paired 'decode: best'; op by op)"
for i in $(seq 1 "${ROUNDS:-2}"); do
    for v in $VARIANTS; do
        n=${v%%=*}; e=${v#*=}
        ab "$n$i" "--decode-tokens 32 --rounds 3" $(echo "$e" | tr ',' ' ')
    done
done
set -- $VARIANTS
V1=$1 V2=$2
s "batch 64: ${V1%%=*} / ${V2%%=*}"
for v in "$V1" "$V2"; do
    ab "${v%%=*}64" "--decode-tokens 32 --rounds 2 --batch 64" $(echo "${v#*=}" | tr ',' ' ')
done
if ! skip ncu && command -v ncu > /dev/null && [ $SECONDS -lt 210 ]; then
    s "ncu: every kernel of the decode steps, ${V1%%=*} then ${V2%%=*} (op by op)"
    NB="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64 --prompt-tokens 8 --warmup-tokens 1 --decode-tokens 3 --rounds 1"
    for vv in "$V1" "$V2"; do
        v=${vv%%=*}; e=$(echo "${vv#*=}" | tr ',' ' ')
        [ $SECONDS -lt 250 ] || { echo "ncu $v: no time left"; continue; }
        env $e MM_GPU_GRAPHS=0 timeout 40 ncu --clock-control none --cache-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size \
            --export /tmp/steps-$v --force-overwrite $NB > "$R/ncu-run-$v.txt" 2>&1 || echo "ncu rc=$?"
        ncu --import /tmp/steps-$v.ncu-rep --csv --page raw > "$R/ncu-$v.csv" 2> /dev/null
        echo "-- $v"
        python3 kernels/cuda/bench/ncu_step.py "$R/ncu-$v.csv" 2 > "$R/ncu-sum-$v.txt" 2>&1
        grep -E "last decode step|sum of kernel" "$R/ncu-sum-$v.txt"
        sed -n '/per kind over/,$p' "$R/ncu-sum-$v.txt" | head -22
    done
fi
s "summary"
grep -E "^FAIL|GPU tests:" "$R/tests.txt" | head -20
echo "copy bandwidth: ${COPY:-unmeasured} GB/s"
cat "$R/ab.txt"
s done

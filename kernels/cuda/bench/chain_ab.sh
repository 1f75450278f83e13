#!/usr/bin/env bash
# The decode chain fusions on the GPU machine in one run (one `run` call): the GPU tests they
# touch, the copy bandwidth, then bench-model batch 1 (graph and op by op) and batch 64 with
# the fusions (default) and without them (MM_GPU_OLD_CHAIN=1), in turn and repeated, the
# earlier kernels (MM_GPU_OLD_DECODE=1), the same with unpaired rounds (--paired false: no
# host read pass between decode tokens, so graph replay and op by op are timed alike), per-op
# GPU times (MM_GPU_OPTIME=2) and ncu durations of every kernel of a decode step, both ways.
# Prepare here:
#     make CUDA=1 BUILD=build/cuda-dec -j2 all test-bins build/cuda-dec/bin/moemesh-gpu-bench
#     BUILD_CUDA=build/cuda-dec bash kernels/cuda/device_run.sh --stage .dev/gpu-dec
# then on the GPU machine, from the repo root, carrying .dev/gpu-dec:
#     bash kernels/cuda/bench/chain_ab.sh .dev/gpu-dec
# Output: stdout (summaries; the test list first, the figures last), every raw file in
# $OUT/chain.tgz (the run tool brings back few files). SKIP="tests ncu" leaves sections out.
set -u
D=${1:-.dev/gpu-dec}
OUT=${OUT:-/tmp/out}
R=/tmp/chain
mkdir -p "$OUT" "$R"
trap 'tar czf "$OUT/chain.tgz" -C /tmp chain' EXIT
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
SKIP=${SKIP:-}
skip() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
M=/tmp/q3-30b-a3b-L4
B="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64 --prompt-tokens 128"
s() { echo; echo "== $1 (t+$SECONDS s)"; }
date -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -f "$M/config.json" ] || {
    ( timeout 120 "$D/moemesh" synth --out "$M" --layers 4 > "$R/synth.txt" 2>&1
      echo "rc=$?" >> "$R/synth.txt" ) &
    SP=$!
}
if ! skip tests; then
    s "GPU tests: cuda_chain_ops_test, model_devpath_test, cuda_decode_ops_test, cuda_ops_test"
    pass=0; fail=0
    for t in cuda_chain_ops_test model_devpath_test cuda_decode_ops_test cuda_ops_test; do
        while IFS= read -r c; do
            timeout 60 "$D/$t" "$c" > "$R/case.txt" 2>&1; rc=$?
            if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $t: $c"
            elif [ $rc = 77 ]; then echo "skip  $t: $c"
            else fail=$((fail+1)); echo "FAIL  $t: $c (rc=$rc)"; tail -5 "$R/case.txt" | sed 's/^/      /'; fi
            [ $t = cuda_chain_ops_test ] && grep -E "same bits|differs" "$R/case.txt" | sed 's/^/      /'
            grep -E "chain fusions ==|first difference|first recorded graph" "$R/case.txt" | sort -u | sed 's/^/      /'
            cat "$R/case.txt" >> "$R/tests-all.txt"
        done < <(timeout 20 "$D/$t" --list)
    done
    echo "GPU tests: $pass passed, $fail failed"
fi 2>&1 | tee "$R/tests.txt"
s "copy bandwidth"
timeout 60 "$D/moemesh-gpu-bench" --only none > "$R/copy.txt" 2>&1
COPY=$(grep -oE '[0-9.]+ GB/s' "$R/copy.txt" | head -1 | cut -d' ' -f1)
echo "copy bandwidth: ${COPY:-unmeasured} GB/s"
[ -n "${SP:-}" ] && { wait "$SP"; tail -2 "$R/synth.txt"; }
ab() { # name, extra bench flags (quoted), env...
    local n=$1 fl=$2; shift 2
    env "$@" timeout 60 $B $fl > "$R/b-$n.txt" 2>&1 || echo "$n: rc=$?"
    echo "$n: $(grep -E "decode: best|op by op|batch 64 decode|first recorded graph" "$R/b-$n.txt" |
        sed -E 's/ \(prompts.*//; s/ms\/token/ms/g; s/.*gpu: //' | tr '\n' ' ')" | tee -a "$R/ab.txt"
}
s "bench-model: chain fusions on (new) / MM_GPU_OLD_CHAIN=1 (old), batch 1 (graph, op by op) and 64"
for i in 1 2 3; do
    ab new$i "--decode-tokens 32 --rounds 3 --batch 64" X=0
    ab old$i "--decode-tokens 32 --rounds 3 --batch 64" MM_GPU_OLD_CHAIN=1
done
ab olddecode "--decode-tokens 32 --rounds 3" MM_GPU_OLD_DECODE=1
s "unpaired rounds (no host read pass between tokens): graph vs op by op"
for i in 1 2; do
    ab unp-new$i "--decode-tokens 64 --rounds 3 --paired false --bw-seconds 0.2" X=0
    ab unp-old$i "--decode-tokens 64 --rounds 3 --paired false --bw-seconds 0.2" MM_GPU_OLD_CHAIN=1
done
if [ -n "$COPY" ]; then
    MB=$(grep -oE 'weights read per decode token: [0-9.]+' "$R/b-new1.txt" | grep -oE '[0-9.]+$')
    for n in new1 new2 new3 old1 old2 old3 olddecode; do
        T=$(grep -oE 'decode: best [0-9.]+' "$R/b-$n.txt" | grep -oE '[0-9.]+$')
        [ -n "$MB" ] && [ -n "$T" ] && awk -v c="$COPY" -v mb="$MB" -v t="$T" -v n="$n" \
            'BEGIN { printf "%s: %.1f tok/s x %.1f MB = %.0f GB/s = %.1f%% of copy (%s GB/s)\n", n, t, mb, t * mb / 1000, 100 * t * mb / 1000 / c, c }' | tee -a "$R/pct.txt"
    done
fi
s "per-op GPU time (MM_GPU_OPTIME=2), batch 1: new, old"
prof() { sed -n "/steps of 1 row/,/^gpu optime\|^[a-z]/p" "$1" | head -24; }
MM_GPU_OPTIME=2 timeout 40 $B --decode-tokens 16 --rounds 1 > "$R/ot-new.txt" 2>&1; prof "$R/ot-new.txt"
MM_GPU_OPTIME=2 MM_GPU_OLD_CHAIN=1 timeout 40 $B --decode-tokens 16 --rounds 1 > "$R/ot-old.txt" 2>&1; prof "$R/ot-old.txt"
if ! skip ncu && command -v ncu > /dev/null; then
    s "ncu: every kernel of the decode steps, new then old (op by op)"
    NB="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64 --prompt-tokens 8 --warmup-tokens 1 --decode-tokens 3 --rounds 1"
    for v in new old; do
        e=X=0; [ $v = old ] && e=MM_GPU_OLD_CHAIN=1
        env $e MM_GPU_GRAPHS=0 timeout 60 ncu --clock-control none --cache-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
            --export /tmp/steps-$v --force-overwrite $NB > "$R/ncu-run-$v.txt" 2>&1 || echo "ncu rc=$?"
        ncu --import /tmp/steps-$v.ncu-rep --csv --page raw > "$R/ncu-$v.csv" 2> /dev/null
        echo "-- $v"
        python3 kernels/cuda/bench/ncu_step.py "$R/ncu-$v.csv" 2 > "$R/ncu-sum-$v.txt" 2>&1
        grep -E "last decode step|sum of kernel" "$R/ncu-sum-$v.txt"
        sed -n '/per kind over/,$p' "$R/ncu-sum-$v.txt" | head -24
    done
fi
s "summary"
grep -E "^FAIL|GPU tests:|first recorded graph|differs" "$R/tests.txt" | sort | uniq -c | head -20
grep -E "^(new|old|olddecode|unp-)" "$R/ab.txt"
grep -E "% of copy" "$R/pct.txt"
s done

#!/usr/bin/env bash
# Decode attention forms on the GPU machine in one run (one `run` call, under 240 s): the bit
# tests of the new forms, copy bandwidth, then bench-model decode (4-layer synthetic
# Qwen3-30B-A3B) over the attention forms in turn, decode after a 4096-token prompt, and ncu
# durations of the decode attention kernels at ~200 tokens of context.
# Forms (env): def = the defaults (attention_tcd_kernel, every warp computing, one key block in
# flight, for decode calls of <= 8 rows; attention_tc_kernel above), old = MM_GPU_ATT_TCD=0
# (attention_tc_kernel, warp 0 computes, for every decode call), all = MM_GPU_ATT_TCD=1 (the
# new kernel for every decode call, <= 64 rows), tcd2 = all with two key blocks in flight
# (MM_GPU_ATT_TCD_STAGES=2), f32 = MM_GPU_ATT_TC=0 (ops.cu's f32 kernel), wide = f32 with
# MM_GPU_ATT_WIDE=1. (The run of 06:47 UTC named them differently, when the new kernel was off
# by default and took two blocks in flight: its def is old here, its tcd is tcd2, its tcd1 is
# all; its tcdpf, tcd2 with the keys' L2 prefetch, was removed after it lost.)
# Prepare here (a clean worktree of HEAD + these changes, so others' half-done files stay out):
#     make CUDA=1 BUILD=build/cuda-sm -j2 all test-bins build/cuda-sm/bin/moemesh-gpu-bench
#     BUILD_CUDA=build/cuda-sm bash kernels/cuda/device_run.sh --stage .dev/gpu-sm
#     strip -o .dev/gpu-sm/cuda_attention_tcd_test build/cuda-sm/tests/kernels/cuda_attention_tcd_test
#     tar cJf .dev/gpu-sm.tar.xz .dev/gpu-sm
# then on the GPU machine, from the repo root, carrying .dev/gpu-sm.tar.xz:
#     tar xJf .dev/gpu-sm.tar.xz && bash kernels/cuda/bench/tcd_run.sh .dev/gpu-sm
# SKIP="tests long ncu b64 step" leaves sections out; FORMS="old def" picks the forms; REPS rounds.
# Output: stdout (summaries), raw files packed into $OUT/tcd.tgz.
set -u
D=${1:-.dev/gpu-sm}
OUT=${OUT:-/tmp/out}
R=/tmp/tcd
mkdir -p "$OUT" "$R"
trap 'tar czf "$OUT/tcd.tgz" -C /tmp tcd' EXIT
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
SKIP=${SKIP:-}
FORMS=${FORMS:-old def tcd2}
REPS=${REPS:-3}
skip() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
M=/tmp/q3-30b-a3b-L4
B="$D/moemesh bench-model --model $M --device cuda:0 --bw-mb 64"
s() { echo; echo "== $1 (t+$SECONDS s)"; }
fenv() { case $1 in def) echo X=0 ;; old) echo MM_GPU_ATT_TCD=0 ;; all) echo MM_GPU_ATT_TCD=1 ;;
         f32) echo MM_GPU_ATT_TC=0 ;; tcd2) echo "MM_GPU_ATT_TCD=1 MM_GPU_ATT_TCD_STAGES=2" ;;
         wide) echo "MM_GPU_ATT_TC=0 MM_GPU_ATT_WIDE=1" ;; esac; }
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
( timeout 150 "$D/moemesh" synth --out "$M" --layers 4 > "$R/synth.txt" 2>&1; echo "rc=$?" >> "$R/synth.txt" ) &
SP=$!
if ! skip tests; then
    s "GPU tests"
    pass=0; fail=0
    run_t() { # label, env, binary, case
        env $2 timeout 60 "$D/$3" "$4" > "$R/case.txt" 2>&1; local rc=$?
        if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $1 $3: $4"
        elif [ $rc = 77 ]; then echo "skip  $1 $3: $4"
        else fail=$((fail+1)); echo "FAIL  $1 $3: $4 (rc=$rc)"; tail -6 "$R/case.txt" | sed 's/^/      /'; fi
        grep -E "differ|same bits" "$R/case.txt" | sed 's/^/      /' | head -20
        cat "$R/case.txt" >> "$R/tests-all.txt"
    }
    while IFS= read -r c; do run_t "" X=0 cuda_attention_tcd_test "$c"; done < <(timeout 20 "$D/cuda_attention_tcd_test" --list)
    while IFS= read -r c; do run_t "[TCD=1]" MM_GPU_ATT_TCD=1 cuda_attention_tc_test "$c"; done < <(timeout 20 "$D/cuda_attention_tc_test" --list)
    while IFS= read -r c; do run_t "[TCD=1 STAGES=2]" "MM_GPU_ATT_TCD=1 MM_GPU_ATT_TCD_STAGES=2" cuda_attention_tc_test "$c"; done < <(timeout 20 "$D/cuda_attention_tc_test" --list)
    while IFS= read -r c; do run_t "[TCD=1]" "MM_GPU_ATT_TCD=1" model_devpath_test "$c"; done < <(timeout 20 "$D/model_devpath_test" --list)
    echo "GPU tests: $pass passed, $fail failed"
fi 2>&1 | tee "$R/tests.txt"
s "copy bandwidth"
timeout 30 "$D/moemesh-gpu-bench" --only none > "$R/copy.txt" 2>&1
COPY=$(grep -oE '[0-9.]+ GB/s' "$R/copy.txt" | head -1 | cut -d' ' -f1)
echo "copy bandwidth: ${COPY:-unmeasured} GB/s"
wait "$SP"; tail -1 "$R/synth.txt"
ab() { # name, bench flags, env...
    local n=$1 fl=$2; shift 2
    env "$@" timeout 40 $B $fl > "$R/b-$n.txt" 2>&1 || echo "$n: rc=$?"
    local t mb
    t=$(grep -oE 'decode: best [0-9.]+' "$R/b-$n.txt" | grep -oE '[0-9.]+$')
    mb=$(grep -oE 'weights read per decode token: [0-9.]+' "$R/b-$n.txt" | grep -oE '[0-9.]+$')
    local pct=""
    [ -n "$COPY" ] && [ -n "$t" ] && [ -n "$mb" ] && pct=$(awk -v c="$COPY" -v mb="$mb" -v t="$t" 'BEGIN { printf "= %.1f%% of copy", 100 * t * mb / 1000 / c }')
    echo "$n: $(grep -E "decode: best|op by op|batch 64 decode" "$R/b-$n.txt" |
        sed -E 's/ \(prompts.*//; s/ms\/token/ms/g; s/.*gpu: //' | tr '\n' ' ') $pct" | tee -a "$R/ab.txt"
}
s "bench-model batch 1 (128-token prompt, 3 rounds of 32 tokens), forms in turn: $FORMS"
for i in $(seq 1 "$REPS"); do
    for f in $FORMS; do ab "$f$i" "--prompt-tokens 128 --decode-tokens 32 --rounds 3" $(fenv $f); done
done
if ! skip b64; then
    s "batch 64 (the decode forms take calls of <= 64 rows)"
    for f in old def all; do ab "${f}-b64" "--prompt-tokens 128 --decode-tokens 16 --rounds 2 --batch 64" $(fenv $f); done
fi
if ! skip long; then
    s "decode after a 4096-token prompt (one forward), batch 1"
    for f in old def tcd2; do ab "${f}-4k" "--prompt-tokens 4096 --prefill-rows 4096 --decode-tokens 32 --rounds 2" $(fenv $f); done
fi
if ! skip ncu && command -v ncu > /dev/null; then
    s "ncu: decode attention kernels at 192..196 tokens of context (op by op)"
    for f in old def tcd2; do
        env $(fenv $f) MM_GPU_GRAPHS=0 timeout 40 ncu --clock-control none --cache-control none \
            -k regex:attention --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread \
            --csv $B --prompt-tokens 192 --warmup-tokens 1 --decode-tokens 4 --rounds 1 > "$R/ncu-$f.csv" 2> "$R/ncu-$f.err" ||
            echo "ncu $f: rc=$?"
        python3 - "$R/ncu-$f.csv" "$f" <<'EOF'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    print(sys.argv[2], "no ncu rows"); sys.exit(0)
h = rows[0]; ix = {k: h.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
k = collections.OrderedDict()
scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
for r in rows[1:]:
    d = k.setdefault(r[ix["ID"]], {"name": r[ix["Kernel Name"]].split("(")[0]})
    v = r[ix["Metric Value"]].replace(",", "")
    if r[ix["Metric Name"]] == "gpu__time_duration.sum":
        v = str(float(v) * scale.get(r[ix["Metric Unit"]], 1.0))
    d[r[ix["Metric Name"]]] = v
ks = list(k.values())
dec = [d for d in ks if d.get("launch__grid_size") and int(float(d["launch__grid_size"].replace(",", ""))) <= 64]
last = dec[-8:]
us = [float(d["gpu__time_duration.sum"].replace(",", "")) / 1000 for d in last]
print("%s: %d attention launches, decode ones (grid <= 64 blocks): %d; last %d: %s us, mean %.2f us (%s, grid %s, %s regs)" % (
    sys.argv[2], len(ks), len(dec), len(last), " ".join("%.2f" % u for u in us), sum(us) / max(1, len(us)),
    last[-1]["name"] if last else "-", last[-1].get("launch__grid_size") if last else "-",
    last[-1].get("launch__registers_per_thread") if last else "-"))
EOF
    done
fi
if ! skip ncu && command -v ncu > /dev/null; then
    s "ncu sections of one decode attention launch (the 21st: a decode step at ~194 tokens): old, def"
    SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
    for f in old def; do
        env $(fenv $f) MM_GPU_GRAPHS=0 timeout 40 ncu --clock-control none -k regex:attention_tc --launch-skip 20 --launch-count 1 $SEC \
            $B --prompt-tokens 192 --warmup-tokens 1 --decode-tokens 4 --rounds 1 > "$R/ncu-sec-$f.txt" 2>&1 || echo "ncu $f: rc=$?"
        echo "-- $f"
        grep -E "attention_tc|^ +(Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued Instruction|Avg. Active Threads Per Warp|Issued Warp Per Scheduler|Dynamic Shared Memory Per Block)" "$R/ncu-sec-$f.txt" | sed -E 's/  +/ /g' | head -16
        grep -iE "stall|cycles .* waiting|On average" "$R/ncu-sec-$f.txt" | sed -E 's/  +/ /g' | head -4
    done
fi
if ! skip step && command -v ncu > /dev/null; then
    s "ncu: every kernel of the decode steps at ~194 tokens of context (op by op): old, def"
    for f in old def; do
        env $(fenv $f) MM_GPU_GRAPHS=0 timeout 50 ncu --clock-control none --cache-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
            --export /tmp/steps-$f --force-overwrite $B --prompt-tokens 192 --warmup-tokens 1 --decode-tokens 3 --rounds 1 \
            > "$R/ncu-step-$f.txt" 2>&1 || echo "ncu $f: rc=$?"
        ncu --import /tmp/steps-$f.ncu-rep --csv --page raw > "$R/ncu_steps-$f.csv" 2> /dev/null
        echo "-- $f"
        python3 kernels/cuda/bench/ncu_step.py "$R/ncu_steps-$f.csv" 2 2>&1 | tee "$R/ncu_sum-$f.txt" | tail -25
    done
fi
echo "done at t+$SECONDS s"

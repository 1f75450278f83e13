#!/bin/bash
# The bf16 KV cache under the tensor-core contract (docs/BENCHMARKS.md "A bf16 KV cache under the
# tensor-core contract"): bit tests of the GPU cases (attention contract, device path with the
# bf16 == f32 cache case, chains, decode ops, the kv_store op test), moemesh synth --layers 4,
# then bench-model with the cache in bf16 (default) and f32 (MM_GPU_KV_BF16=0) in turn: 4K
# prefill, decode after a 4K prompt (also the decode switches MM_GPU_ATT_TCD_KB_BUFS/_GSUB), batch
# 1, and the bf16 peak. Binaries staged by device_run.sh --stage DIR; run from the repo root on
# the GPU machine: bash kernels/cuda/bench/kv_bf16_run.sh DIR (logs in $OUT: tests.txt, bench.txt).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
D=${1:-.dev/gpu}; O=${OUT:-/tmp/out}; M=/tmp/q3-30b-a3b-L4; mkdir -p "$O"
export LD_LIBRARY_PATH=$PWD/$D/lib
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( timeout 150 $D/moemesh synth --out $M --layers 4 > $O/synth.log 2>&1; echo "rc=$?" >> $O/synth.log ) &
SP=$!
echo "== bit tests (t+$(el))"
pass=0; fail=0
for t in cuda_attention_tc_test cuda_attention_tcd_test model_devpath_test cuda_chain_ops_test cuda_ops_test cuda_decode_ops_test; do
  while IFS= read -r c; do
    case "$t:$c" in model_devpath_test:cuda*|cuda_attention_t*|cuda_chain*|cuda_decode*|cuda_ops_test:*kv_store*|cuda_ops_test:*attention*) ;; *) continue ;; esac
    timeout 60 $D/$t "$c" > $O/case.log 2>&1; rc=$?
    [ $rc = 0 ] && pass=$((pass+1)) || fail=$((fail+1))
    echo "rc=$rc $t: $c"; echo "### rc=$rc $t: $c" >> $O/tests.txt; cat $O/case.log >> $O/tests.txt
    case $t in cuda_attention_tc_test|model_devpath_test) grep -E "bf16|tc attention|FAIL|rror" $O/case.log | grep -v "index out of range" | cut -c1-330 | sed 's/^/    /' ;; *) grep -E "FAIL|rror" $O/case.log | head -3 | sed 's/^/    /' ;; esac
  done < <(timeout 10 $D/$t --list)
  [ $(el) -gt 80 ] && { echo "tests cut at t+$(el)"; break; }
done
echo "bit tests: $pass passed, $fail failed (t+$(el))"
wait $SP; tail -1 $O/synth.log
BM="$D/moemesh bench-model --model $M --device cuda:0"
run() { # name env... -- args
  local n=$1; shift; local e=(); while [ "$1" != "--" ]; do e+=("$1"); shift; done; shift
  [ $(el) -gt 185 ] && { echo "-- $n skipped (t+$(el))"; return; }
  echo "-- $n ${e[*]} (t+$(el))"; echo "### $n ${e[*]}" >> $O/bench.txt
  env "${e[@]}" timeout 40 $BM "$@" > $O/b.log 2>&1 || echo "   rc=$?"
  cat $O/b.log >> $O/bench.txt
  grep -E "^prompt:|^prompt round 3|decode: best|kv cache|failed|error" $O/b.log | head -6 | sed 's/^/   /'
}
PF="--prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --prefill-rows 4096 --prompt-rounds 3"
LG="--prompt-tokens 4096 --prefill-rows 4096 --decode-tokens 64 --rounds 2"
B1="--prompt-tokens 128 --decode-tokens 32 --rounds 2 --bw-mb 64"
run pf_bf16 MM_X=1 -- $PF
run pf_f32 MM_GPU_KV_BF16=0 -- $PF
echo "-- peak (t+$(el))"; timeout 40 python3 kernels/cuda/bench/bf16_peak.py 2>&1 | tail -1
run long_bf16 MM_X=1 -- $LG
run long_f32 MM_GPU_KV_BF16=0 -- $LG
run long_bf16_nb6 MM_GPU_ATT_TCD_KB_BUFS=6 -- $LG
run long_bf16_g1_nb6 MM_GPU_ATT_TCD_KB_BUFS=6 MM_GPU_ATT_TCD_GSUB=1 -- $LG
run long_bf16_g2 MM_GPU_ATT_TCD_GSUB=2 -- $LG
run long_bf16_nb4 MM_GPU_ATT_TCD_KB_BUFS=4 -- $LG
run b1_bf16 MM_X=1 -- $B1
run b1_f32 MM_GPU_KV_BF16=0 -- $B1
run b1_bf16_nb6 MM_GPU_ATT_TCD_KB_BUFS=6 -- $B1
run pf_bf16_2 MM_X=1 -- $PF
run pf_f32_2 MM_GPU_KV_BF16=0 -- $PF
run long_bf16_2 MM_X=1 -- $LG
date -u

#!/bin/bash
# One device run for the prefill forms of the row ops (NOTES.md prefill version 18): ops.cu's
# MM_GPU_ROWOPS_PF (add_rmsnorm, combine_rmsnorm, embed_rmsnorm, head_norm_rope_kv; route_plan.cu's
# warp-per-row routing) and backend.cu's MM_GPU_GET_PINNED, old (both 0) against the defaults.
# Binaries: `make CUDA=1 BUILD=build/cuda -j2 all test-bins build/cuda/bin/moemesh-gpu-bench`,
# staged with `BUILD_CUDA=build/cuda bash kernels/cuda/device_run.sh --stage .dev/h7/gpu`, then
# `cd .dev/h7 && tar cJf gpu.tar.xz gpu`, carried as .dev/h7/gpu.tar.xz (unpacked here).
# In order: moemesh synth (background), cuda_chain_ops_test (prefill form == decode form bits),
# cuda_route_plan_test, moemesh logits of 300 ids with the forms off/on (cmp), bench-model's 4K
# prefill old/new in turn three times, MM_GPU_OPTIME=1 old/new (the 4096-row ops), decode batch
# 1 old/new in turn twice, ncu of the row-op kernels and products old/new, model_devpath_test.
# Logs: $OUT/*.txt (at most 8 files come back).
python3 -c "import tarfile;tarfile.open('.dev/h7/gpu.tar.xz').extractall('.dev/h7')"
D=.dev/h7/gpu; O=$OUT; T0=$(date +%s); L=/tmp/h7; mkdir -p $L
el() { echo "[t+$(( $(date +%s) - T0 )) s]"; }
export LD_LIBRARY_PATH=$PWD/$D/lib
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/tmp/m
( timeout 70 $D/moemesh synth --out $M --layers 4 > $L/synth.txt 2>&1; echo "rc=$?" >> $L/synth.txt ) &
SP=$!
echo "== chain ops test (incl. prefill forms)"
timeout 60 $D/cuda_chain_ops_test > $O/chain.txt 2>&1; echo "rc=$?" >> $O/chain.txt
grep -cE "prefill form same bits" $O/chain.txt; grep -E "FAIL|differs|rc=|SKIP" $O/chain.txt | tail -8; el
echo "== route plan test"; timeout 40 $D/cuda_route_plan_test > $L/rp.txt 2>&1; echo "rc=$?" >> $L/rp.txt
grep -E "FAIL|differs|rc=" $L/rp.txt | tail -4; el
wait $SP; tail -1 $L/synth.txt; el
OLD="MM_GPU_ROWOPS_PF=0 MM_GPU_GET_PINNED=0"
IDS=$(python3 -c "print(','.join(str((i*7919+13)%151936) for i in range(300)))")
for v in 0 1; do
  env MM_GPU_ROWOPS_PF=$v timeout 25 $D/moemesh logits --model $M --device cuda:0 --ids "$IDS" --prefill-rows 300 --out /tmp/lg_$v.f32 > $L/lg_$v.txt 2>&1
done
cmp /tmp/lg_0.f32 /tmp/lg_1.f32 && echo "logits 300 ids ROWOPS_PF 0 vs 1: identical ($(stat -c %s /tmp/lg_1.f32) bytes)"; el
BM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 2 --rounds 1 --warmup-tokens 1 --prefill-rows 4096 --prompt-rounds 5"
for v in old new old new old new; do
  E=""; [ $v = old ] && E="$OLD"
  echo "-- 4K prefill $v" >> $O/bm_all.txt; env $E timeout 25 $BM >> $O/bm_all.txt 2>&1; echo "rc=$?" >> $O/bm_all.txt
  echo "$v: $(grep -E '^prompt round' $O/bm_all.txt | tail -5 | awk '{print $7}' | tr '\n' ' ')"
done; el
for v in old new; do
  E=""; [ $v = old ] && E="$OLD"
  echo "-- optime $v" >> $O/opt_all.txt; env $E MM_GPU_OPTIME=1 timeout 25 $BM >> $O/opt_all.txt 2>&1; echo "rc=$?" >> $O/opt_all.txt
done
awk '/^-- optime/{print; next} /^gpu optime/{on = /steps of 4096/; if (on) print; next} on && /head_norm_rope_kv|combine_rmsnorm|add_rmsnorm|embed_rmsnorm|route_with_plan|matmul 128x2048|  get /' $O/opt_all.txt; el
DM="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 128 --decode-tokens 32 --rounds 2 --bw-mb 64"
for v in old new old new; do
  [ $(( $(date +%s) - T0 )) -lt 140 ] || break
  E=""; [ $v = old ] && E="$OLD"
  echo "-- decode b1 $v" >> $O/dec_all.txt; env $E timeout 20 $DM >> $O/dec_all.txt 2>&1; echo "rc=$?" >> $O/dec_all.txt
  echo "decode $v: $(grep -E '^decode: best|^decode op by op' $O/dec_all.txt | tail -2 | tr '\n' ' ')"
done; el
if [ $(( $(date +%s) - T0 )) -lt 150 ] && command -v ncu > /dev/null; then
  BM1="$D/moemesh bench-model --model $M --device cuda:0 --prompt-tokens 4096 --decode-tokens 1 --rounds 1 --warmup-tokens 1 --prefill-rows 4096 --prompt-rounds 2"
  for v in old new; do
    E=""; [ $v = old ] && E="$OLD"
    env $E timeout 25 ncu --clock-control none --print-units base --csv --metrics gpu__time_duration.sum --kernel-name regex:"rmsnorm|head_norm_rope|route_rows|route_plan_fused|route_plan_par|wg_convert_rows|gemm_ws" $BM1 > $L/ncu_$v.csv 2>/dev/null
  done
  python3 - "$L" > $O/ncu.txt <<'PY' || true
import csv, sys, collections
for v in ("old", "new"):
    try: rows = list(csv.reader(open(f"{sys.argv[1]}/ncu_{v}.csv")))
    except Exception as e: print(v, e); continue
    h = None; agg = collections.defaultdict(list)
    for r in rows:
        if "Kernel Name" in r: h = {k: i for i, k in enumerate(r)}; continue
        if h is None or len(r) < len(h): continue
        g = r[h["Grid Size"]]; n = r[h["Kernel Name"]].split("(")[0][:48]
        agg[(n, g)].append(float(r[h["Metric Value"]].replace(",", "")))
    print(f"ncu {v} (us, per call: count, median)")
    for (n, g), t in sorted(agg.items()):
        t.sort(); print(f"  {n:48s} grid {g:>16s} x{len(t):3d} {t[len(t)//2]/1000:9.1f}")
PY
  cat $O/ncu.txt; el
fi
if [ $(( $(date +%s) - T0 )) -lt 170 ]; then
  echo "== model_devpath_test"; timeout 25 $D/model_devpath_test > $L/md.txt 2>&1; echo "rc=$?" >> $L/md.txt; grep -E "FAIL|rc=|passed" $L/md.txt | tail -3; el
fi
date -u

#!/usr/bin/env bash
# GEMV v3 against v2 on the H200, one command (< 240 s): unpack the staged binaries; the
# v3 bits case alone, also with MM_GPU_GEMV_BULK_TPB=1; every GPU test case (device_run.sh's
# ops section, with the build's default MM_GPU_GEMV_BULK=1; the synthetic 4-layer Qwen3-30B-A3B
# checkpoint is written meanwhile); decode_l2pf.sh: copy bandwidth, bench-model batch 1 (graph,
# op by op) over old (v2) / new (v3) / tpb1 (v3, 16-row blocks) in turn, twice, batch 64 and
# ncu of a decode step for old and new, then batch 64 and ncu for tpb1. (The 07:03 UTC run also
# had ring, GEMV v4: removed after it lost.)
# Prepare here (clean tree HEAD + the change, built with BUILD=build/cuda-gv):
#     BUILD_CUDA=build/cuda-gv bash kernels/cuda/device_run.sh --stage .dev/gpu-gv
#     (cd .dev && tar cJf gpu-gv.tar.xz gpu-gv)
# run carrying .dev/gpu-gv.tar.xz:  bash kernels/cuda/bench/gemv_bulk_ab.sh (the 07:03 UTC run, as .dev/gv_run.sh)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gvo
D=.dev/gpu-gv
exec > >(tee "$OUT/gv.log") 2>&1
date -u
python3 -c "import tarfile;tarfile.open('.dev/gpu-gv.tar.xz').extractall('.dev')" || exit 2
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
C="gemv v3 (W by bulk copies into shared memory) == v2 == v1 bits"
for e in X=0 MM_GPU_GEMV_BULK_TPB=1; do
    echo "== the v3/v4 bits case, $e (t+$SECONDS s)"
    env $e timeout 60 "$D/cuda_decode_ops_test" "$C" > /tmp/gvo/v3case-$e.txt 2>&1; RC=$?
    grep -E "dense GEMV|first difference|taken [0-9]|FAIL|error" /tmp/gvo/v3case-$e.txt | head -8
    grep -c "bulk mode 3 taken, bit-identical" /tmp/gvo/v3case-$e.txt | sed 's/^/grouped shapes v3+v4 bit-identical: /'
    echo "rc=$RC"
done
echo "== GPU tests (t+$SECONDS s)"
OUT=/tmp/gvo SKIP="copy bench invariance meshstep parity gateway" KEEP_MODEL=1 \
    timeout 200 bash kernels/cuda/device_run.sh "$D" > /dev/null 2>&1
grep -E "^(FAIL|skip) |GPU tests:|first difference|rc=" /tmp/gvo/log | head -30
cp /tmp/gvo/log "$OUT/ops.log"
echo "== decode A/B (t+$SECONDS s)"
VARIANTS="old=MM_GPU_GEMV_BULK=0 new=MM_GPU_GEMV_BULK=1 tpb1=MM_GPU_GEMV_BULK=1,MM_GPU_GEMV_BULK_TPB=1" \
    ROUNDS=2 SKIP=tests bash kernels/cuda/bench/decode_l2pf.sh "$D"
cp /tmp/l2pf/ab.txt /tmp/gvo/ab1.txt 2>/dev/null; tar czf "$OUT/l2pf1.tgz" -C /tmp l2pf
if [ $SECONDS -lt 170 ]; then
    echo "== batch 64 and ncu: tpb1 (t+$SECONDS s)"
    rm -f /tmp/l2pf/ab.txt
    VARIANTS="tpb1=MM_GPU_GEMV_BULK=1,MM_GPU_GEMV_BULK_TPB=1 old=MM_GPU_GEMV_BULK=0" ROUNDS=0 SKIP=tests \
        bash kernels/cuda/bench/decode_l2pf.sh "$D" 2>&1 | sed -n '/== batch 64/,$p'
fi
tar czf "$OUT/gvo.tgz" -C /tmp gvo
echo "== end (t+$SECONDS s)"

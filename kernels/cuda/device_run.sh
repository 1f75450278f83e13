#!/usr/bin/env bash
# One device run of everything issue 7 asks to show, side by side, with prebuilt binaries (this
# script builds nothing). Prepare here:
#     make cuda && bash kernels/cuda/device_run.sh --stage .dev/gpu-mesh
# (copies build/cuda's binaries and the non-glibc .so files they need into that folder,
# which .git/info/exclude ignores), then on the GPU machine, from the repo root, carrying it:
#     bash kernels/cuda/device_run.sh .dev/gpu-mesh
# Sections, each with its own time limit, in this order (SKIP="ops parity ..." leaves some out):
#   ops       every case of the GPU tests: cuda_ops_test, cuda_decode_ops_test,
#             cuda_chain_ops_test, cuda_attention_tc_test, cuda_attention_tcd_test,
#             cuda_prefill_rows_test, cuda_route_plan_test, model_devpath_test, cudaipc_test
#   synth     moemesh synth (Qwen3-30B-A3B shape, MODEL_LAYERS=4 layers) into /tmp, started in
#             the background at once so that it overlaps the op tests
#   copy      device-to-device copy bandwidth (moemesh-gpu-bench --only none): the ceiling
#   bench     moemesh bench-model --device cuda:0, batch 1 and batch BATCH (64)
#   invariance the mesh on the GPU (router, shards, owners all --device cuda:0) vs moemesh
#             generate --device cuda:0: greedy tokens and logprobs bit for bit, 1, 2, 3 owners,
#             for each data plane in INV_SCHEMES (default "shm": device to device)
#   meshstep  the mesh on the synthetic checkpoint: decode step time (mesh-generate --timing),
#             batch 1 with 1 and 3 owners, and BATCH concurrent sequences with 1 owner (admitted
#             one per step, and all at once: --stagger false), for each
#             of MESH_PIPELINE (default "0"; "0 1" also times mesh-generate --pipeline), once per
#             data plane in MESH_SCHEMES (default "host shm": host = shm://NAME?gpu=0, rows through
#             host memory; shm = shm://NAME, rows device to device through CUDA IPC, as GPU
#             daemons get by default; cudaipc = the explicit cudaipc://NAME)
#   parity    moemesh logits --device cuda:0 on every fixture vs the transformers logits
#   gateway   moemesh up on cuda:0 (qwen3moe-tiny): greedy completions without logprobs (picked
#             on the device) equal those with logprobs (picked on the host), alone and batched
# MPS=1 runs the mesh sections under the CUDA Multi-Process Service (nvidia-cuda-mps-control -d,
# pipe and log directories in /tmp; quit at the end), so that the daemons' contexts share the
# GPU without time-slicing; the engine sections run without it.
# KEEP_MODEL=1 leaves the synthetic checkpoint in /tmp for a later script (e.g.
# TARGET=/tmp/q3-30b-a3b-L4 bash services/drafter/device_bench.sh DIR).
# Output: $OUT/log (also stdout). Exit 0 when every section that ran passed; 1 otherwise;
# 2 when the binaries are missing. Without a GPU every section fails with its reason.
set -u
if [ "${1:-}" = "--stage" ]; then
    D=${2:-.dev/gpu-mesh}
    B=${BUILD_CUDA:-build/cuda}
    mkdir -p "$D/lib" || exit 2
    for f in bin/moemesh bin/moemesh-router bin/moemesh-attention bin/moemesh-expert \
             bin/moemesh-drafter bin/moemesh-gateway \
             bin/moemesh-gpu-bench tests/kernels/cuda_ops_test tests/kernels/cuda_decode_ops_test \
             tests/kernels/cuda_chain_ops_test tests/kernels/cuda_attention_tc_test \
             tests/kernels/cuda_attention_tcd_test tests/kernels/cuda_prefill_rows_test \
             tests/kernels/cuda_route_plan_test tests/unit/model_devpath_test tests/transport/cudaipc_test; do
        [ -x "$B/$f" ] || { echo "stage: $B/$f missing (make cuda first)"; exit 2; }
        strip -o "$D/$(basename "$f")" "$B/$f" || exit 2
    done
    # every shared library of the binaries except glibc's own and the dynamic loader
    ldd "$D"/moemesh* "$D"/cuda_ops_test | awk '/=> \// {print $3}' | sort -u |
        grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libresolv|libgcc_s|libstdc\+\+)\.so' |
        while read -r so; do cp -L "$so" "$D/lib/"; done
    du -sh "$D"
    exit 0
fi

D=${1:-.dev/gpu-mesh}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
exec > >(tee "$OUT/log") 2>&1
SKIP=${SKIP:-}
L=${MODEL_LAYERS:-4}
BATCH=${BATCH:-64}
M=/tmp/q3-30b-a3b-L$L
FAILED=()
T0=$(date +%s)
for b in moemesh moemesh-router moemesh-attention moemesh-expert cuda_ops_test moemesh-gpu-bench; do
    [ -x "$D/$b" ] || { echo "missing $D/$b: stage the binaries first (--stage)"; exit 2; }
done
# ldd must resolve everything, or every section below would fail the same way
if ldd "$D/moemesh" | grep -q "not found"; then
    ldd "$D/moemesh" | grep "not found"; echo "libraries missing"; exit 2
fi
skip() { case " $SKIP " in *" $1 "*) return 0 ;; esac; return 1; }
section() { echo; echo "== $1 (t+$(( $(date +%s) - T0 )) s)"; }
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -3

if ! skip synth; then
    # background: CPU and disk work while the GPU runs the op tests
    ( timeout 200 "$D/moemesh" synth --out "$M" --layers "$L" > "$OUT/synth.txt" 2>&1
      echo "rc=$?" >> "$OUT/synth.txt" ) &
    SYNTH_PID=$!
fi

if ! skip ops; then
    GPU_TESTS="cuda_ops_test cuda_decode_ops_test cuda_chain_ops_test cuda_attention_tc_test cuda_attention_tcd_test cuda_prefill_rows_test cuda_route_plan_test model_devpath_test cudaipc_test"
    section "GPU tests (${GPU_TESTS// /, })"
    pass=0; fail=0
    for t in $GPU_TESTS; do
        [ -x "$D/$t" ] || { echo "MISSING $t (stage again)"; fail=$((fail+1)); continue; }
        while IFS= read -r c; do
            timeout 90 "$D/$t" "$c" > "$OUT/case.txt" 2>&1; rc=$?
            if [ $rc = 0 ]; then pass=$((pass+1)); echo "ok    $t: $c"
            elif [ $rc = 77 ]; then echo "skip  $t: $c"
            else fail=$((fail+1)); echo "FAIL  $t: $c (rc=$rc)"; fi
            grep -E "bit-identical|nmse|NMSE|differs|FAIL|error|SKIP" "$OUT/case.txt" | head -6 | sed 's/^/      /'
        done < <(timeout 20 "$D/$t" --list)
    done
    echo "GPU tests: $pass passed, $fail failed"
    [ $fail -eq 0 ] && [ $pass -gt 0 ] || FAILED+=(ops)
fi

COPY=
if ! skip copy; then
    section "copy bandwidth (moemesh-gpu-bench --only none)"
    timeout 60 "$D/moemesh-gpu-bench" --only none 2>&1 | tee "$OUT/copy.txt" | head -8
    COPY=$(grep -oE '[0-9.]+ GB/s' "$OUT/copy.txt" | head -1 | cut -d' ' -f1)
    echo "copy bandwidth: ${COPY:-unmeasured} GB/s"
fi

if ! skip synth; then
    wait "$SYNTH_PID"
    cat "$OUT/synth.txt"
    grep -q "^rc=0" "$OUT/synth.txt" || FAILED+=(synth)
fi

if ! skip bench && [ -f "$M/config.json" ]; then
    section "bench-model --device cuda:0 (batch 1, then batch $BATCH)"
    timeout 150 "$D/moemesh" bench-model --model "$M" --device cuda:0 --prompt-tokens 128 \
        --decode-tokens 32 --rounds 2 --bw-mb 64 --bw-seconds 0.2 --batch "$BATCH" > "$OUT/bench.txt" 2>&1 ||
        { echo "bench-model failed rc=$?"; FAILED+=(bench); }
    grep -vE "^round|roofline|memory read" "$OUT/bench.txt"
    MB=$(grep -oE 'weights read per decode token: [0-9.]+' "$OUT/bench.txt" | grep -oE '[0-9.]+$')
    TPS=$(grep -oE 'decode: best [0-9.]+' "$OUT/bench.txt" | grep -oE '[0-9.]+$')
    if [ -n "$COPY" ] && [ -n "$MB" ] && [ -n "$TPS" ]; then
        awk -v c="$COPY" -v mb="$MB" -v t="$TPS" 'BEGIN { printf "batch 1 decode: %.1f tok/s x %.1f MB = %.0f GB/s = %.1f%% of the copy bandwidth (%s GB/s)\n", t, mb, t * mb / 1000, 100 * t * mb / 1000 / c, c }'
    fi
fi

# ---- the mesh on the GPU: router, shards and owners all on cuda:0 ---------------------------
if ! skip invariance || ! skip meshstep; then
    BIN=$D
    source tests/e2e/mesh_lib.sh
    # (and MPS's daemon, when this script is ended before its quit at the end)
    trap 'mesh_stop; rm -rf "$RUN"; [ "${KEEP_MODEL:-0}" = 1 ] || rm -rf "$M"
          [ "${MPS_ON:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
    # the data plane of shards and owners (SCHEME): host (shm://NAME?gpu=0: rows through host
    # memory), shm (shm://NAME: device to device between GPU daemons), cudaipc (explicit)
    SCHEME=shm
    KV_MB=16
    data_url() { case $SCHEME in host) echo "shm://$1?gpu=0" ;; *) echo "$SCHEME://$1" ;; esac; }
    start_shard() { start "a$1" "$BIN/moemesh-attention" $(common) --instance "$1" --shards "$SHARDS" \
        --data "$(data_url "$TAG-$GEN-a$1")" --kv-mb "$KV_MB" --max-seqs 256; }
    start_owner() { start "e$1" "$BIN/moemesh-expert" $(common) --instance "$1" \
        --data "$(data_url "$TAG-$GEN-e$1")" --load-csv "$RUN/load-$1.csv" --load-interval-ms 200; }
    common() {
        echo --router "$ROUTER" --model "$MODEL" --owners "$OWNERS" --heartbeat-ms $HB --threads 1 \
            --device cuda:0 ${PLACEMENT:+--placement "$PLACEMENT"}
    }
    # expect_same_ids WHAT IDS N [ARGS...]: greedy ids without logprobs (picked on the device by
    # both) through the mesh equal generate's (sequence 0's with --concurrent)
    expect_same_ids() {
        local what=$1 ids=$2 n=$3 want got; shift 3
        want=$("$BIN/moemesh" generate --model "$MODEL" --ids "$ids" --max-tokens "$n" --threads 1 \
            --device cuda:0) || fail "$what: generate failed"
        got=$("$BIN/moemesh" mesh-generate --router "$ROUTER" --ids "$ids" --max-tokens "$n" "$@" \
            2>"$RUN/client.err") || fail "$what: mesh-generate failed: $(cat "$RUN/client.err")"
        [ "$got" = "$want" ] || { echo "want $want"; echo "got  $got"; fail "$what: mesh ids differ from moemesh generate"; }
        echo "ok $what: $n ids equal generate's"
    }
    reference() { "$BIN/moemesh" generate --model "$MODEL" --ids "$1" --max-tokens "$2" --logprobs \
        --top-logprobs 3 --threads 1 --device cuda:0; }
    wait_ready() { # GPU daemons load the model onto the device first: up to 90 s
        for _ in $(seq 1 900); do
            for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || return 1; done # one died
            "$BIN/moemesh" status --router "$ROUTER" 2>/dev/null | grep -q "attention: $1 ready, expert: $2 ready" && return 0
            sleep 0.1
        done
        return 1
    }
    # mesh_lib's fail exits; here a failed check fails its section only: checks run in a
    # subshell (exit ends it), mesh_start in this shell (return)
    fail() {
        echo "FAIL: $*"
        for f in "$RUN"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 8 "$f"; }; done
        [ "$BASH_SUBSHELL" -gt 0 ] && exit 1
        return 1
    }
fi

MPS_ON=0
if [ "${MPS:-0}" = 1 ] && { ! skip invariance || ! skip meshstep; }; then
    section "CUDA MPS for the mesh sections"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # a daemon left by an earlier run that was killed before its quit (2026-12-02: the next
    # run's mesh steps took twice their time beside it): stopped first
    if command -v nvidia-cuda-mps-control >/dev/null &&
        ps -eo args | grep -qE '^(/[^ ]*/)?nvidia-cuda-mps-control'; then
        echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
        for _ in 1 2 3 4 5 6 7 8 9 10; do
            ps -eo args | grep -qE '^(/[^ ]*/)?nvidia-cuda-mps-control' || break
            sleep 0.5
        done
        echo "an MPS control daemon left by an earlier run was stopped"
    fi
    if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
        MPS_ON=1; echo "MPS control daemon started"
    else
        echo "MPS not available: the mesh sections run without it"
    fi
fi

if ! skip invariance; then
    section "mesh invariance on cuda:0 (qwen3moe-tiny): mesh-generate vs generate --device cuda:0"
    MODEL=tests/fixtures/models/qwen3moe-tiny
    ok=1
    for SCHEME in ${INV_SCHEMES:-shm}; do
    echo "data plane $(data_url NAME)"
    for o in 1 2 3; do
        s=1; [ $o = 3 ] && s=2
        OWNERS=$o SHARDS=$s mesh_start || { ok=0; mesh_stop; break; }
        ( expect_same "$o owners, $s shards" 11,42,7,300,5,99,18 8 ) || ok=0
        if [ $o = 2 ]; then ( expect_same "$o owners, prompt in chunks of 3" 11,42,7,300,5,99,18 8 --chunk 3 ) || ok=0; fi
        if [ $o = 2 ]; then ( expect_same "$o owners, pipelined plans" 11,42,7,300,5,99,18 8 --pipeline ) || ok=0; fi
        # greedy without logprobs: picked on the device; pipelined, each step begun by the one
        # before it (MM_ROUTER_EARLY) before its picks reach the router's host
        if [ $o != 3 ]; then ( expect_same_ids "$o owners, device picks, pipelined plans" 11,42,7,300,5,99,18 24 --pipeline ) || ok=0; fi
        if [ $o = 2 ]; then ( expect_same_ids "$o owners, device picks, among 5 concurrent, pipelined" 11,42,7,300,5,99,18 24 --pipeline --concurrent 5 ) || ok=0; fi
        if [ $o = 3 ]; then ( expect_same "$o owners, among 8 concurrent" 11,42,7,300,5,99,18 8 --concurrent 9 ) || ok=0; fi
        grep -h "joined\|linked" "$RUN"/router.log 2>/dev/null | sed 's/^/    /' | head -6
        mesh_stop
    done
    done
    [ $ok = 1 ] && echo "mesh invariance on cuda:0: PASS" || { echo "mesh invariance on cuda:0: FAIL"; FAILED+=(invariance); }
fi

if ! skip meshstep && [ -f "$M/config.json" ]; then
    section "mesh decode step vs the engine, synthetic Qwen3-30B-A3B shape ($L layers), one GPU"
    MODEL=$M
    KV_MB=1024
    for SCHEME in ${MESH_SCHEMES:-host shm}; do
    for o in 1 3; do
        OWNERS=$o SHARDS=1 mesh_start || { FAILED+=(meshstep); mesh_stop; break; }
        ids=$(seq -s, 11 1 42)
        for pp in ${MESH_PIPELINE:-0}; do
        pa=(); pn=""; [ "$pp" = 1 ] && { pa=(--pipeline); pn=", pipelined plans"; }
        timeout 60 "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids "$ids" --max-tokens 40 \
            --timing "${pa[@]}" > /dev/null 2> "$RUN/timing.txt" || { cat "$RUN/timing.txt"; FAILED+=(meshstep); }
        echo "mesh $(data_url NAME), $o owner(s), 1 shard, batch 1$pn: $(grep -E 'decode steps|decode period|decode step max' "$RUN/timing.txt" | tr '\n' ' ')"
        if [ $o = 1 ]; then # BATCH sequences (admitted one per step; decode-only steps timed)
            timeout 90 "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids 11,12,13,14 \
                --max-tokens 96 --concurrent "$BATCH" --timing "${pa[@]}" > /dev/null 2> "$RUN/timing.txt" ||
                { cat "$RUN/timing.txt"; FAILED+=(meshstep); }
            echo "mesh $(data_url NAME), $o owner(s), 1 shard, $BATCH concurrent$pn: $(grep -E 'decode steps|decode period|decode step max|generated' "$RUN/timing.txt" | tr '\n' ' ')"
            # the same BATCH sequences admitted at once: ~95 decode steps of all BATCH, the shape
            # of bench-model's greedy batch decode
            timeout 90 "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids 11,12,13,14 \
                --max-tokens 96 --concurrent "$BATCH" --stagger false --timing "${pa[@]}" > /dev/null 2> "$RUN/timing.txt" ||
                { cat "$RUN/timing.txt"; FAILED+=(meshstep); }
            echo "mesh $(data_url NAME), $o owner(s), 1 shard, $BATCH admitted at once$pn: $(grep -E 'decode steps|decode period|decode step max|generated' "$RUN/timing.txt" | tr '\n' ' ')"
        fi
        done
        grep -h "linked" "$RUN"/router.log 2>/dev/null | sed 's/^/    /' | head -4
        mesh_stop
    done
    done
    grep -E "decode: best|batch .* decode" "$OUT/bench.txt" 2>/dev/null | sed 's/^/engine (same run): /'
fi

if ! skip parity; then
    section "whole model on cuda:0 vs the transformers fixtures (moemesh logits --device cuda:0)"
    for d in tests/fixtures/models/*/; do
        [ -f "$d/reference.json" ] || continue
        timeout 60 python3 kernels/cuda/parity.py "$d" "$D/moemesh" --strict || FAILED+=(parity)
    done
fi

# ---- the gateway on the GPU: greedy requests without logprobs are picked on the device ---------
if ! skip gateway; then
    section "gateway on cuda:0 (moemesh up, qwen3moe-tiny): device picks == host picks"
    GW_RUN=$(mktemp -d /tmp/mm-gw.XXXX); GW_PORT=18431
    "$D/moemesh" up --model tests/fixtures/models/qwen3moe-tiny --device cuda:0 --owners 2 \
        --port $GW_PORT --run-dir "$GW_RUN" > "$OUT/gw-up.log" 2>&1 &
    GW_UP=$!
    timeout 150 python3 - $GW_PORT <<'PY' || FAILED+=(gateway)
import json, sys, time, urllib.request, concurrent.futures as cf
port = sys.argv[1]
def post(body):
    rq = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(rq, timeout=60))
for _ in range(600):
    try:
        h = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2))
        if h.get("status") in ("ok", "degraded"): break
    except Exception: pass
    time.sleep(0.2)
else:
    sys.exit("gateway never healthy")
prompts = [[4, 8, 15, 16, 23, 42], [100, 200, 300], [7] * 20, [1, 2, 3, 4, 5, 6, 7, 8]]
base = {"model": "qwen3moe-tiny", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
host = [post(dict(base, prompt=p, logprobs=1))["choices"][0]["text"] for p in prompts]  # host picks
dev1 = [post(dict(base, prompt=p))["choices"][0]["text"] for p in prompts]              # device picks
with cf.ThreadPoolExecutor(8) as ex:                                                      # batched
    devn = list(ex.map(lambda p: post(dict(base, prompt=p))["choices"][0]["text"], prompts * 2))
bad = [i for i in range(len(prompts)) if not (host[i] == dev1[i] == devn[i] == devn[i + len(prompts)])]
print("gateway greedy: %d prompts, logprobs (host picks) == no logprobs (device picks), alone and 8 concurrent: %s"
      % (len(prompts), "equal" if not bad else "DIFFER at %s" % bad))
sys.exit(1 if bad else 0)
PY
    kill -TERM $GW_UP 2>/dev/null; wait $GW_UP 2>/dev/null; rm -rf "$GW_RUN"
fi

if [ $MPS_ON = 1 ]; then
    echo quit | nvidia-cuda-mps-control && echo "MPS control daemon stopped"
    MPS_ON=0
fi
[ "${KEEP_MODEL:-0}" = 1 ] || rm -rf "$M" # KEEP_MODEL=1: left for a later script (drafting bench)
echo
date -u
echo "total $(( $(date +%s) - T0 )) s"
if [ ${#FAILED[@]} -gt 0 ]; then echo "FAILED sections: ${FAILED[*]}"; exit 1; fi
echo "all sections passed"

#!/usr/bin/env bash
# Drafting benchmark (issue 10): decode tokens/s through the gateway (`moemesh bench`) with and
# without speculative decoding, at concurrency 1 and 16, for each drafter kind:
#   none   moemesh up without --drafter (no drafting)
#   self   the target as its own draft model (every greedy draft accepted: the upper bound)
#   small  a small dense draft model (--drafter DRAFT)
#   ngram  prompt lookup (--drafter ngram)
#   skip   (only when CASES names it) the target's first SKIP_LAYERS (1) layers as the draft
#          model: layer-skip self-speculation, sharing the target's embedding and LM head
# A drafting case X runs with the router's draft-ahead on (MM_DRAFT_PIPELINE=true); X-sync with
# it off (false: each step waits for its drafts); X-auto with the router's default, auto (per
# step shape, whichever of the two measures more tokens per second). PIPELINE="auto 1 0" runs
# every drafting case all three ways (next to each other in each round).
# Each case is its own `moemesh up` (router, gateway, 1 attention shard, OWNERS owners, drafter,
# all on DEVICE); ROUNDS rounds of all cases, interleaved (a shared machine's load drifts: only
# neighbouring runs compare). Greedy requests (--temperature 0, ignore_eos), random prompt ids.
# After each case the router's drafting metrics (drafted/accepted, by position, widths chosen).
#
# On the GPU machine (prebuilt binaries; this script builds nothing). Prepare here:
#     make CUDA=1 BUILD=build/cuda-x -j2 all && BUILD_CUDA=build/cuda-x bash kernels/cuda/device_run.sh --stage .dev/gpu-x
# then there, from the repo root, carrying .dev/gpu-x:
#     bash services/drafter/device_bench.sh .dev/gpu-x
# which synthesizes the target (moemesh synth, Qwen3-30B-A3B shape, LAYERS=4 layers) and a small
# dense drafter (Qwen3 dense, DRAFT_SHAPE=qwen3-0.6b, DRAFT_LAYERS=4, same vocabulary) into /tmp.
# On this CPU VM:
#     DEVICE=cpu TARGET=tests/fixtures/models/qwen3moe-tiny \
#       DRAFT=tests/fixtures/models/qwen3-tiny-drafter bash services/drafter/device_bench.sh build/bin
# Env: DEVICE (cuda:0), TARGET / DRAFT (model dirs; unset: synthesized, shapes TARGET_SHAPE /
# DRAFT_SHAPE, LAYERS / DRAFT_LAYERS; "tiny" for both tries the script on a CPU), CASES ("none self small
# ngram"), CONCS ("1 16"), ROUNDS (2 on the CPU, 1 on a GPU: each case loads the model anew),
# MAX_TOKENS (128), PROMPT (32), REQS1 (8) / REQS16 (64), RESIDUAL_SCALE (unset; e.g. 0.1: the
# synthesized target's layers from SKIP_LAYERS on are scaled down so the skip drafter agrees),
# requests at concurrency 1 / 16, OWNERS (1), THREADS (1: CPU threads per daemon), VOCAB (256:
# prompt ids drawn below it), PIPELINE ("1": draft-ahead on; "0": off; "auto": the router's
# default; "auto 1 0": all three), OUT (/tmp/out: logs). Output: a table on stdout (and $OUT/table).
set -u
D=${1:-.dev/gpu-drafter}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/out}
CASES=${CASES:-none self small ngram}
# PIPELINE: each drafting case X as X (draft-ahead on) and/or X-sync (off)
RUNCASES=
for c in $CASES; do
    if [ "$c" = none ] || [[ "$c" == *-sync ]] || [[ "$c" == *-auto ]]; then
        RUNCASES="$RUNCASES $c"
        continue
    fi
    for pl in ${PIPELINE:-1}; do
        case $pl in
        1) RUNCASES="$RUNCASES $c" ;;
        0) RUNCASES="$RUNCASES $c-sync" ;;
        auto) RUNCASES="$RUNCASES $c-auto" ;;
        *) echo "PIPELINE: '$pl' is not 1, 0 or auto"; exit 2 ;;
        esac
    done
done
BASES=" $(for c in $RUNCASES; do c=${c%-sync}; printf '%s ' "${c%-auto}"; done)" # drafters needed
CONCS=${CONCS:-1 16}
ROUNDS=${ROUNDS:-$([ "$DEVICE" = cpu ] && echo 2 || echo 1)}
MAX_TOKENS=${MAX_TOKENS:-128}
PROMPT=${PROMPT:-32}
OWNERS=${OWNERS:-1}
LAYERS=${LAYERS:-4}
mkdir -p "$OUT" || exit 2
[ -d "$D/lib" ] && export LD_LIBRARY_PATH="$PWD/$D/lib:${LD_LIBRARY_PATH:-}"
for b in moemesh moemesh-router moemesh-gateway moemesh-attention moemesh-expert moemesh-drafter; do
    [ -x "$D/$b" ] || { echo "missing $D/$b (stage the binaries first: device_run.sh --stage)"; exit 2; }
done
export MM_THREADS=${THREADS:-1} # every daemon's --threads
RUN=$(mktemp -d /tmp/mm-dbench.XXXX)
UP=
cleanup() {
    [ -n "$UP" ] && kill -TERM "$UP" 2>/dev/null && wait "$UP" 2>/dev/null
    rm -rf "$RUN" ${SYNTH_DIRS:-}
}
trap cleanup EXIT
date -u
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

SYNTH_DIRS=
if [ -z "${TARGET:-}" ]; then
    TARGET=/tmp/mm-dbench-target-L$LAYERS
    SYNTH_DIRS="$SYNTH_DIRS $TARGET"
    # RESIDUAL_SCALE: the target's layers from SKIP_LAYERS on add little to the residual stream,
    # so the skip drafter agrees with it often (moemesh synth --residual-scale)
    res=()
    [ -n "${RESIDUAL_SCALE:-}" ] && res=(--residual-scale "$RESIDUAL_SCALE" --residual-from "${SKIP_LAYERS:-1}")
    timeout 300 "$D/moemesh" synth --out "$TARGET" --shape "${TARGET_SHAPE:-qwen3-30b-a3b}" --layers "$LAYERS" "${res[@]}" ||
        { echo "synth of the target failed"; exit 1; }
fi
if [ -z "${DRAFT:-}" ] && [[ "$BASES" == *" small "* ]]; then
    DRAFT=/tmp/mm-dbench-draft
    SYNTH_DIRS="$SYNTH_DIRS $DRAFT"
    timeout 300 "$D/moemesh" synth --out "$DRAFT" --family qwen3 --shape "${DRAFT_SHAPE:-qwen3-0.6b}" \
        --layers "${DRAFT_LAYERS:-4}" --seed 2 --tokenizer-from "$TARGET" ||
        { echo "synth of the drafter failed"; exit 1; }
fi
# skip: a layer-skip self-draft (self-speculative decoding): the target's own checkpoint read
# with only its first SKIP_LAYERS decoder layers (config.json changed, the weight files linked:
# the loader binds the layers the config names), so it shares the embedding and LM head.
if [[ "$BASES" == *" skip "* ]]; then
    SKIPD=/tmp/mm-dbench-skip
    SYNTH_DIRS="$SYNTH_DIRS $SKIPD"
    rm -rf "$SKIPD" && mkdir -p "$SKIPD" || exit 1
    for f in "$TARGET"/*; do
        [ "$(basename "$f")" = config.json ] || ln -s "$(readlink -f "$f")" "$SKIPD/"
    done
    python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = int(sys.argv[3]); json.dump(c, open(sys.argv[2], "w"), indent=1)' \
        "$TARGET/config.json" "$SKIPD/config.json" "${SKIP_LAYERS:-1}" || { echo "skip drafter config failed"; exit 1; }
fi
VOCAB=${VOCAB:-256}

port=$((20000 + ($$ * 7) % 20000))
# mesh_up CASE: starts moemesh up for CASE and waits until the gateway's /health says ok.
# CASE X-sync: drafter X with the router's draft-ahead off; X-auto: auto.
mesh_up() {
    local dr=() pipe=true base=${1%-sync}
    [[ "$1" == *-sync ]] && pipe=false
    [[ "$1" == *-auto ]] && pipe=auto
    case ${base%-auto} in
    self) dr=(--drafter "$TARGET") ;;
    small) dr=(--drafter "$DRAFT") ;;
    skip) dr=(--drafter "$SKIPD") ;;
    ngram) dr=(--drafter ngram) ;;
    esac
    rm -rf "$RUN/up"
    MM_DRAFT_PIPELINE=$pipe "$D/moemesh" up --model "$TARGET" --owners "$OWNERS" --device "$DEVICE" \
        --run-dir "$RUN/up" --port $port "${dr[@]}" > "$OUT/up-$1.log" 2>&1 &
    UP=$!
    for _ in $(seq 1 3000); do # 300 s: a GPU mesh loads the checkpoint in every daemon
        curl -s "http://127.0.0.1:$port/health" 2>/dev/null | grep -q '"status":"ok"' && return 0
        kill -0 $UP 2>/dev/null || break
        sleep 0.1
    done
    echo "mesh for $1 not ready: $(tail -3 "$OUT/up-$1.log")"
    return 1
}
mesh_down() {
    kill -TERM "$UP" 2>/dev/null
    wait "$UP" 2>/dev/null
    UP=
}
# bench C: prints tokens/s of `moemesh bench` at concurrency C (empty on failure)
bench() {
    local n=${REQS1:-8}
    [ "$1" -ge 16 ] && n=${REQS16:-64}
    [ "$1" -gt 1 ] && [ "$1" -lt 16 ] && n=$(( $1 * 2 ))
    "$D/moemesh" bench --url "http://127.0.0.1:$port" --concurrency "$1" --requests "$n" \
        --prompt-tokens "$PROMPT" --max-tokens "$MAX_TOKENS" --temperature 0 --vocab "$VOCAB" \
        --quiet > "$OUT/bench.txt" 2>&1
    sed -n 's/^output tokens\/s: *\([0-9.]*\).*/\1/p' "$OUT/bench.txt"
}
declare -A TPS ACC
for r in $(seq 1 "$ROUNDS"); do
    for c in $RUNCASES; do
        mesh_up "$c" || continue
        bench 4 > /dev/null # warm-up: first touches of the weights, the width costs
        for n in $CONCS; do
            t=$(bench "$n")
            TPS[$c,$n]="${TPS[$c,$n]:-}${TPS[$c,$n]:+ }${t:-fail}"
            echo "round $r $c c=$n: ${t:-failed: $(tail -2 "$OUT/bench.txt")} tok/s"
        done
        [ -n "${SHOW:-}" ] && cat "$OUT/bench.txt"
        m=$("$D/moemesh" status --router "ipc://$RUN/up/router.ctl" 2>/dev/null | grep -o "drafting:.*")
        [ -n "$m" ] && echo "   $m"
        ACC[$c]=$(echo "$m" | grep -o "rate=[0-9.]* mean_accepted=[0-9.]*")
        ah=$(echo "$m" | grep -o "ahead=[0-9]* ahead_hits=[0-9]* ahead_misses=[0-9]* sync=[0-9]*")
        [ -n "$ah" ] && ACC[$c]="${ACC[$c]} $ah"
        mo=$(echo "$m" | grep -o "ahead_steps=[0-9]* sync_steps=[0-9]* mode_explored=[0-9]* mode_switches=[0-9]*")
        [ -n "$mo" ] && [[ "$c" == *-auto ]] && ACC[$c]="${ACC[$c]} $mo"
        mesh_down
    done
done
{
    echo
    echo "device $DEVICE, target $TARGET, drafter ${DRAFT:-}, prompt $PROMPT, $MAX_TOKENS tokens per request, greedy"
    printf "| %-6s |" drafter
    for n in $CONCS; do printf " c=%-3s tok/s (rounds) | vs none |" "$n"; done
    printf " acceptance (last round) |\n|---|"
    for n in $CONCS; do printf -- "---|---|"; done
    printf -- "---|\n"
    for c in $RUNCASES; do
        printf "| %-6s |" "$c"
        for n in $CONCS; do
            v=${TPS[$c,$n]:-}
            base=${TPS[none,$n]:-}
            ratio=$(awk -v a="$v" -v b="$base" 'BEGIN { n = split(a, x, " "); m = split(b, y, " ");
                s = 0; k = 0; for (i = 1; i <= n && i <= m; i++) if (x[i] > 0 && y[i] > 0) { s += x[i] / y[i]; k++ }
                if (k) printf "%.2fx", s / k; else printf "-" }')
            printf " %s | %s |" "${v:--}" "$ratio"
        done
        printf " %s |\n" "${ACC[$c]:--}"
    done
} | tee "$OUT/table"

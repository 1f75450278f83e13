#!/usr/bin/env bash
# timeout: 120
# Plans from the gateway are begun early (docs/MESH.md "Steps begun early"): `moemesh up` on the
# cpu-dev backend (the router's device path without a GPU) starts a drafter without a draft
# model, which answers DraftReply.off; the router then stops asking it and begins each pipelined
# plan from the step before it, although the gateway lets every decode seq draft. Greedy
# completions without logprobs (picks read on the device) have the text of the same requests
# with logprobs (host picks), alone and 4 at once; the router's trace shows plans begun early
# ("taken"). With a drafter that drafts (--drafter ngram) the plans that allow drafts are not
# begun early ("early_no_draft") and the texts are the same.
set -u
source tests/e2e/mesh_lib.sh
MODEL=tests/fixtures/models/qwen3moe-tiny
cp "${BUILD:-build}"/bin/moemesh-{gateway,drafter} "$BIN/" || fail "no gateway/drafter binaries"
ROUTER="ipc://$RUN/up/router.ctl"
port=$((30000 + ($$ * 13) % 20000))

# up NAME [ARGS...]: moemesh up on cpu-dev with a trace at $RUN/NAME.tr, healthy ("ok": the
# drafter joined too)
up() {
    local name=$1; shift
    MM_MESH_TRACE="$RUN/$name.tr" "$BIN/moemesh" up --model $MODEL --owners 1 --device cpu-dev \
        --run-dir "$RUN/up" --port $port --heartbeat-ms 100 "$@" >"$RUN/$name.log" 2>&1 &
    UP=$!
    PIDS+=($UP)
    wait_ready 1 1 || fail "moemesh up ($name): mesh not ready: $(tail -5 "$RUN/$name.log")"
    for _ in $(seq 1 $((300 * ${MM_TEST_TIMEOUT_SCALE:-1}))); do
        curl -s "http://127.0.0.1:$port/health" | grep -q '"status":"ok"' && return 0
        sleep 0.1
    done
    fail "gateway /health never ok ($name): $(curl -s "http://127.0.0.1:$port/health" | head -c 400)"
}
down() {
    kill -TERM $UP
    for _ in $(seq 1 100); do kill -0 $UP 2>/dev/null || break; sleep 0.1; done
    wait $UP || fail "moemesh up exited $?"
}
# texts PROMPT_IDS EXTRA: the completion's text
text() {
    curl -s "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"qwen3moe-tiny\",\"prompt\":[$1],\"max_tokens\":20,\"temperature\":0$2}" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])'
}
# same NAME: each prompt's text without logprobs equals it with them, alone and 4 at once
same() {
    local p i want got
    for p in "4,8,15,16" "23,42,7" "9,9,9,9,9,9"; do
        want=$(text "$p" ',"logprobs":1') || fail "$1: completion with logprobs failed"
        got=$(text "$p" '') || fail "$1: completion without logprobs failed"
        [ -n "$want" ] && [ "$want" == "$got" ] || fail "$1: [$p] '$got', with logprobs '$want'"
        local cs=()
        for i in 1 2 3 4; do text "$p" '' >"$RUN/c$i.txt" & cs+=($!); done
        wait "${cs[@]}"
        for i in 1 2 3 4; do
            [ "$(cat "$RUN/c$i.txt")" == "$want" ] || fail "$1: [$p] 4 at once: '$(cat "$RUN/c$i.txt")'"
        done
    done
}
count() { cat "$RUN/$1".tr.router.* 2>/dev/null | grep -c " $2 "; }

up plain
same "no draft model"
grep -q "the drafter has no draft model" "$RUN/plain.log" || fail "the router did not note the drafter's DraftReply.off"
n=$(count plain taken)
[ "$n" -gt 20 ] || fail "only $n plans begun early ($(count plain early_no_draft) refused for drafts)"
echo "ok a drafter without a model: greedy texts equal with device and host picks, $n plans begun early"
down

up ngram --drafter ngram
same "--drafter ngram"
r=$(count ngram early_no_draft)
[ "$r" -gt 0 ] || fail "with a drafter, no plan was refused the early begin for its drafts"
echo "ok --drafter ngram: the same texts; $r plans that may draft not begun early ($(count ngram taken) begun early)"
down
echo "PASS"

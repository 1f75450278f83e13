#!/usr/bin/env bash
# timeout: 90
# `moemesh up --drafter DIR` starts a mesh that drafts: a greedy completion through the gateway
# (which lets decode seqs draft) has the text of the same request with logprobs (which does not
# draft), the router's metrics show the drafts, and mesh-generate with --draft equals it
# without; `--drafter` naming a directory without a model is refused (exit 2).
set -u
source tests/e2e/mesh_lib.sh
MODEL=tests/fixtures/models/qwen3moe-tiny
cp "${BUILD:-build}"/bin/moemesh-{gateway,drafter} "$BIN/" || fail "no gateway/drafter binaries"

"$BIN/moemesh" up --model $MODEL --drafter "$RUN/nothing" --run-dir "$RUN/bad" >"$RUN/bad.log" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "up --drafter with no model there exited $rc, expected 2"
grep -q "no config.json" "$RUN/bad.log" || fail "up --drafter error does not say why: $(cat "$RUN/bad.log")"
echo "ok up --drafter DIR without a model: refused (exit 2)"

port=$((30000 + ($$ * 11) % 20000))
ROUTER="ipc://$RUN/up/router.ctl"
"$BIN/moemesh" up --model $MODEL --owners 1 --drafter $MODEL --run-dir "$RUN/up" --port $port \
    --heartbeat-ms 100 >"$RUN/up.log" 2>&1 &
UP=$!
PIDS+=($UP)
wait_ready 1 1 || fail "moemesh up: mesh not ready"
healthy=0 # sanitizer builds start slower: MM_TEST_TIMEOUT_SCALE stretches the wait
for _ in $(seq 1 $((300 * ${MM_TEST_TIMEOUT_SCALE:-1}))); do
    # "ok", not "degraded": the drafter itself must have joined before the drafted request
    curl -s "http://127.0.0.1:$port/health" | grep -q '"status":"ok"' &&
        { healthy=1; break; }
    sleep 0.1
done
[ $healthy = 1 ] || fail "gateway /health never ok: $(curl -s "http://127.0.0.1:$port/health" | head -c 400)"
req() { curl -s "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"qwen3moe-tiny\",\"prompt\":[4,8,15,16,23,42],\"max_tokens\":24,\"temperature\":0$1}"; }
text() { python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])'; }
body=$(req ',"logprobs":1')
plain=$(echo "$body" | text) || fail "completion with logprobs failed: $body"
body=$(req '')
drafted=$(echo "$body" | text) || fail "completion without logprobs failed: $body"
[ -n "$plain" ] || fail "empty completion"
[ "$plain" == "$drafted" ] || fail "drafted completion differs: '$drafted' vs '$plain'"
"$BIN/moemesh" status --router "$ROUTER" | grep -q "drafting: drafted=[1-9][0-9]* accepted=[1-9]" \
    || fail "no drafts in the router's metrics: $("$BIN/moemesh" status --router "$ROUTER" | grep -o 'hub.*')"
echo "ok up --drafter: gateway completion with drafting equals it without ($("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafted=[0-9]* accepted=[0-9]*'))"
# The gateway's /metrics has the router's drafting counters (as of its last status answer: a
# GET /health refreshes it), as moemesh:spec_decode_* families that agree with the router's.
curl -s "http://127.0.0.1:$port/health" >/dev/null
st=$("$BIN/moemesh" status --router "$ROUTER" | grep -o 'drafting:.*')
met=$(curl -s "http://127.0.0.1:$port/metrics")
mval() { echo "$met" | grep "^moemesh:$1{" | grep "${2:-}" | head -1 | awk '{print $2}'; }
sval() { echo "$st" | grep -o " $1=[0-9]*" | cut -d= -f2; }
[ -n "$(mval spec_decode_num_accepted_tokens_total)" ] || fail "/metrics has no drafting counters: $(echo "$met" | grep -c spec_decode) spec_decode lines"
for f in drafted:num_draft_tokens_total accepted:num_accepted_tokens_total \
         emitted:num_emitted_tokens_total drafts:num_drafts_total ahead:ahead_requests_total \
         ahead_hits:ahead_hits_total ahead_misses:ahead_misses_total sync:sync_requests_total \
         ahead_steps:ahead_mode_steps_total sync_steps:sync_mode_steps_total \
         mode_switches:mode_switches_total; do
    [ "$(sval ${f%%:*})" == "$(mval spec_decode_${f#*:})" ] ||
        fail "/metrics spec_decode_${f#*:} = '$(mval spec_decode_${f#*:})', router ${f%%:*} = '$(sval ${f%%:*})'"
done
[ "$(mval spec_decode_num_accepted_tokens_total)" -gt 0 ] || fail "/metrics: no accepted drafts"
p0=$(mval spec_decode_num_accepted_tokens_per_pos_total 'position="0"')
[ -n "$p0" ] && [ "$p0" -gt 0 ] || fail "/metrics: no accepted drafts at position 0: '$p0'"
# every seq step is counted once by its chosen width: their sum is emitted - accepted
wsum=$(echo "$met" | grep '^moemesh:spec_decode_width_chosen_total{' | awk '{s += $2} END {print s}')
[ "$wsum" == "$(( $(sval emitted) - $(sval accepted) ))" ] ||
    fail "/metrics widths chosen sum to $wsum, expected emitted - accepted = $(( $(sval emitted) - $(sval accepted) ))"
# (router --draft-pipeline auto, the default: an unmeasured mode's first window is ahead)
[ "$(mval spec_decode_ahead_requests_total)" -gt 0 ] || fail "/metrics: no ahead draft requests"
[ "$(mval spec_decode_ahead_mode_steps_total)" -gt 0 ] || fail "/metrics: no draft-ahead steps"
echo "ok /metrics: moemesh:spec_decode_* agree with the router (accepted $(sval accepted), widths sum $wsum, ahead $(sval ahead), ahead hits $(sval ahead_hits))"
off=$("$BIN/moemesh" mesh-generate --router "$ROUTER" --ids 21,22,23,24 --max-tokens 20 --logprobs --concurrent 3 --all) \
    || fail "mesh-generate failed"
on=$("$BIN/moemesh" mesh-generate --router "$ROUTER" --ids 21,22,23,24 --max-tokens 20 --logprobs --concurrent 3 --all --draft 4 2>"$RUN/on.err") \
    || fail "mesh-generate --draft failed"
[ "$off" == "$on" ] || fail "mesh-generate with drafting differs from without"
echo "ok up --drafter: mesh-generate with drafting equals without ($(cat "$RUN/on.err"))"
kill -TERM $UP
for _ in $(seq 1 100); do kill -0 $UP 2>/dev/null || break; sleep 0.1; done
wait $UP; rc=$?
[ $rc -eq 0 ] || fail "moemesh up exited $rc"
echo "PASS"

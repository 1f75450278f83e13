#!/bin/bash
# timeout: 120
# --chat-template FILE: the gateway renders chat requests with that file instead of the
# checkpoint's template, keeping the checkpoint's special tokens (eos_token); a file that is
# missing or does not compile stops the gateway at start with an error naming it.
. tests/e2e/gateway_lib.sh

cat > "$RUN/mine.jinja" <<'JINJA'
{%- for m in messages %}{{- '[' + m['role'] + '] ' + m['content'] + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '[assistant] ' }}{%- endif %}{{- eos_token }}
JINJA
mesh_start --chat-template "$RUN/mine.jinja"

post /tokenize '{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi there"}]}'
expect 200 "tokenize a chat with the file's template"
ids=$(jq_out 'json.dumps(j["tokens"])')
post /detokenize "{\"tokens\":$ids}"
expect 200 "detokenize"
p=$(jq_out 'json.dumps(j["prompt"])')
[ "$p" = '"[system] be brief\n[user] hi there\n[assistant] <|im_end|>"' ] ||
    fail "the prompt is not the file's rendering with the checkpoint's eos_token: $p"
echo "ok the chat prompt is the file's rendering, with the checkpoint's eos_token"

post /v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"temperature":0,"ignore_eos":true}'
expect 200 "a chat completion with the file's template"
[ "$(jq_out 'j["usage"]["completion_tokens"]')" = 3 ] || fail "chat completion: $(cat "$RUN/out.json")"
echo "ok a chat completion is served"

# a file that cannot be read, then one that does not compile: the gateway does not start
for case in missing bad; do
    f="$RUN/$case.jinja"
    [ $case = bad ] && printf 'x\n{%% for m in messages %%}' > "$f"
    timeout 20 "$BIN/moemesh-gateway" --router "$ROUTER" --model "$MODEL" \
        --listen "ipc://$RUN/gateway-$case.ctl" --port "$(free_port)" --chat-template "$f" \
        > "$RUN/gw-$case.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "$case template: the gateway did not stop with an error (rc $rc)"
    line=$(grep -m1 "cannot start: .*$case\.jinja: " "$RUN/gw-$case.log") ||
        fail "$case template: no start error naming the file: $(tail -3 "$RUN/gw-$case.log")"
    echo "ok $case template: the gateway stops at start: ${line#*cannot start: }"
done
echo "PASS: --chat-template"

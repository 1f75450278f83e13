#!/bin/bash
# timeout: 120
# tool_choice with a template that writes Qwen3's (Hermes) <tool_call> blocks: a named function
# makes the prompt open that call ("<tool_call>\n{"name": "get_weather", "arguments": "), so the
# model can only write its arguments; "required" opens a call and leaves the name to the model;
# "auto" changes nothing; a name not in the tools is a 400 naming tool_choice. The tiny model
# does not close the call within max_tokens, so the answer is the call's text with its head
# (finish_reason length), the same streamed and whole; /tokenize counts the head too.
. tests/e2e/gateway_lib.sh

# the test model: qwen3moe-tiny with a chat template that offers tools the Qwen3 way
T="$RUN/model"
mkdir -p "$T"
for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
    ln -s "$PWD/$MODEL/$f" "$T/$f"
done
cat > "$T/chat_template.jinja" <<'JINJA'
{%- if tools %}{{- '<|im_start|>system\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
JINJA
MODEL="$T"
mesh_start

TOOLS='[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}},{"type":"function","function":{"name":"now","parameters":{"type":"object"}}}]'
MSG='[{"role":"user","content":"weather in Paris?"}]'
HEAD='<tool_call>\n{"name": "get_weather", "arguments": '

p=$(prompt_text '{"type":"function","function":{"name":"get_weather"}}')
case "$p" in *'assistant\n'"$(printf '%s' "$HEAD" | sed 's/"/\\"/g')\"") ;; *) fail "named: the prompt does not end with the call's head: $p" ;; esac
p=$(prompt_text '"required"')
case "$p" in *'assistant\n<tool_call>\n{\"name\": \""') ;; *) fail "required: the prompt does not end with an open call: $p" ;; esac
p=$(prompt_text '"auto"')
case "$p" in *'<|im_start|>assistant\n"') ;; *) fail "auto: the prompt changed: $p" ;; esac
echo "ok the prompt opens the call for a named function and for required, not for auto"

body() { echo "{\"messages\":$MSG,\"tools\":$TOOLS,\"tool_choice\":$1,\"max_tokens\":6,\"temperature\":0$2}"; }
post /v1/chat/completions "$(body '{"type":"function","function":{"name":"get_weather"}}' '')"
expect 200 "chat with a named tool_choice"
[ "$(jq_out 'j["choices"][0]["finish_reason"]')" = length ] || fail "finish_reason: $(cat "$RUN/out.json")"
whole=$(jq_out 'json.dumps(j["choices"][0]["message"]["content"])')
case "$whole" in "\"$(printf '%s' "$HEAD" | sed 's/"/\\"/g')"*) ;; *) fail "the unterminated call's text lacks its head: $whole" ;; esac
# streamed: the same text
curl -s -N --max-time 30 "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "$(body '{"type":"function","function":{"name":"get_weather"}}' ',"stream":true')" > "$RUN/sse.txt"
streamed=$(sse_content "$RUN/sse.txt")
[ "$streamed" = "$whole" ] || fail "streamed text $streamed differs from the whole answer $whole"
echo "ok named tool_choice: the answer is the call's text with its head, streamed and whole"

post /v1/chat/completions "$(body '{"type":"function","function":{"name":"delete_all"}}' '')"
expect 400 "a tool_choice naming a function not in tools"
[ "$(jq_out 'j["error"]["param"]')" = tool_choice ] || fail "400 param: $(cat "$RUN/out.json")"
grep -q "delete_all" "$RUN/out.json" || fail "the 400 does not name the function: $(cat "$RUN/out.json")"
echo "ok a function not in tools: 400 naming tool_choice"
echo "PASS: tool_choice opens the call in the prompt"

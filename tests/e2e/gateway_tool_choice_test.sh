#!/bin/bash
# timeout: 120
# tool_choice with a template that writes Qwen3's (Hermes) <tool_call> blocks: a named function
# makes the prompt open that call ("<tool_call>\n{"name": "get_weather", "arguments": "), so the
# model can only write its arguments; "required" opens a call and leaves the name to the model;
# "auto" changes nothing; a name not in the tools is a 400 naming tool_choice. The tiny model
# does not close the call within max_tokens, so the answer is the call's text with its head
# (finish_reason length), the same streamed and whole; /tokenize counts the head too.
. tests/e2e/gateway_lib.sh

# qwen3moe-tiny with a chat template (--chat-template) that offers tools the Qwen3 way
cat > "$RUN/tools.jinja" <<'JINJA'
{%- if tools %}{{- '<|im_start|>system\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
JINJA
mesh_start --chat-template "$RUN/tools.jinja"

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

forced_answer '{"type":"function","function":{"name":"get_weather"}}' # (streamed: the same text)
case "$WHOLE" in "\"$(printf '%s' "$HEAD" | sed 's/"/\\"/g')"*) ;; *) fail "the unterminated call's text lacks its head: $WHOLE" ;; esac
echo "ok named tool_choice: the answer is the call's text with its head, streamed and whole"

post /v1/chat/completions "{\"messages\":$MSG,\"tools\":$TOOLS,\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"delete_all\"}}}"
expect 400 "a tool_choice naming a function not in tools"
[ "$(jq_out 'j["error"]["param"]')" = tool_choice ] || fail "400 param: $(cat "$RUN/out.json")"
grep -q "delete_all" "$RUN/out.json" || fail "the 400 does not name the function: $(cat "$RUN/out.json")"
echo "ok a function not in tools: 400 naming tool_choice"
echo "PASS: tool_choice opens the call in the prompt"

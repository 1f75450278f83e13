#!/bin/bash
# timeout: 120
# tool_choice with a template that writes GLM-4.5/4.6's <tool_call>NAME\n<arg_key>... blocks: a
# named function makes the prompt open that call ("<tool_call>get_weather"), so the model can
# only write its arguments; "required" opens a call and leaves the name to the model; "auto"
# changes nothing; a name GLM's block cannot hold is not forced. The tiny model does not close
# the call within max_tokens, so the answer is the call's text with its head (finish_reason
# length), the same streamed and whole.
. tests/e2e/gateway_lib.sh

# qwen3moe-tiny with a chat template (--chat-template) that offers tools the GLM way
cat > "$RUN/tools.jinja" <<'JINJA'
{%- if tools %}{{- '<|system|>\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}{{- '\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>' }}{%- endif %}{%- for message in messages %}{{- '<|' + message['role'] + '|>\n' + message['content'] }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}
JINJA
mesh_start --chat-template "$RUN/tools.jinja"

TOOLS='[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}},{"type":"function","function":{"name":"now","parameters":{"type":"object"}}},{"type":"function","function":{"name":"a b","parameters":{"type":"object"}}}]'
MSG='[{"role":"user","content":"weather in Paris?"}]'

p=$(prompt_text '{"type":"function","function":{"name":"get_weather"}}')
case "$p" in *'<|assistant|>\n<tool_call>get_weather"') ;; *) fail "named: the prompt does not end with the call's head: $p" ;; esac
p=$(prompt_text '"required"')
case "$p" in *'<|assistant|>\n<tool_call>"') ;; *) fail "required: the prompt does not end with an open call: $p" ;; esac
p=$(prompt_text '"auto"')
case "$p" in *'<|assistant|>\n"') ;; *) fail "auto: the prompt changed: $p" ;; esac
p=$(prompt_text '{"type":"function","function":{"name":"a b"}}')
case "$p" in *'<|assistant|>\n"') ;; *) fail "a name with a space: the prompt was changed: $p" ;; esac
echo "ok the prompt opens the call for a named function and for required, not for auto or an odd name"

forced_answer '{"type":"function","function":{"name":"get_weather"}}'
case "$WHOLE" in '"<tool_call>get_weather'*) ;; *) fail "the unterminated call's text lacks its head: $WHOLE" ;; esac
echo "ok named tool_choice: the answer is the call's text with its head, streamed and whole"
echo "PASS: tool_choice opens GLM's call in the prompt"

#!/bin/bash
# timeout: 150
# tool_choice with a template that writes DeepSeek's tool call blocks, given by --chat-template
# (DeepSeek's shipped V3 template renders no tool list): V3's form makes the prompt of a named
# function open "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n",
# "required" stop after "function<｜tool▁sep｜>", "auto" change nothing, a name the block
# cannot hold not be forced; V3.1's form (a second gateway on the same mesh) opens
# "NAME<｜tool▁sep｜>" or, for "required", the call's tag alone. The tiny model does not close the
# call within max_tokens, so the answer is the call's text with its head (finish_reason
# length), the same streamed and whole.
. tests/e2e/gateway_lib.sh

cat > "$RUN/v3.jinja" <<'JINJA'
{%- if tools %}{{- '<｜System｜>Tools:' }}{%- for t in tools %}{{- ' ' + (t | tojson) }}{%- endfor %}{{- '\nCall as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n' }}{%- endif %}{%- for m in messages %}{{- '<｜' + m['role'] + '｜>' + m['content'] }}{%- endfor %}{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
JINJA
sed 's/function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```/NAME<｜tool▁sep｜>ARGS/' "$RUN/v3.jinja" > "$RUN/v31.jinja"
grep -q 'NAME<｜tool▁sep｜>ARGS' "$RUN/v31.jinja" || fail "the V3.1 template was not made"
mesh_start --chat-template "$RUN/v3.jinja"

TOOLS='[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}},{"type":"function","function":{"name":"now","parameters":{"type":"object"}}},{"type":"function","function":{"name":"a b","parameters":{"type":"object"}}}]'
MSG='[{"role":"user","content":"weather in Paris?"}]'

# ends_with CHOICE TAIL: the rendered prompt of a request with that tool_choice ends with TAIL
ends_with() {
    post /tokenize "{\"messages\":$MSG,\"tools\":$TOOLS,\"tool_choice\":$1}"
    expect 200 "tokenize with tool_choice $1"
    local ids; ids=$(jq_out 'json.dumps(j["tokens"])')
    post /detokenize "{\"tokens\":$ids}"
    expect 200 "detokenize"
    python3 - "$RUN/out.json" "$2" <<'PY' || fail "tool_choice $1: the prompt does not end with the expected text"
import json, sys
p = json.load(open(sys.argv[1]))["prompt"]
tail = sys.argv[2].replace("\\n", "\n")
if not p.endswith(tail):
    sys.exit("prompt ends %r, want %r" % (p[-80:], tail))
PY
}

A='<｜Assistant｜>'; CALL='<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'
ends_with '{"type":"function","function":{"name":"get_weather"}}' "$A${CALL}function<｜tool▁sep｜>get_weather\\n\`\`\`json\\n"
ends_with '"required"' "$A${CALL}function<｜tool▁sep｜>"
ends_with '"auto"' "$A"
ends_with '{"type":"function","function":{"name":"a b"}}' "$A"
echo "ok V3: the prompt opens the call for a named function and for required, not for auto or an odd name"

forced_answer '{"type":"function","function":{"name":"get_weather"}}'
case "$WHOLE" in '"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'*) ;;
    *) fail "the unterminated call's text lacks its head: $WHOLE" ;; esac
echo "ok V3 named tool_choice: the answer is the call's text with its head, streamed and whole"

# V3.1's form: a second gateway with that template, on the same mesh
PORT2=$(free_port)
start gateway31 "$BIN/moemesh-gateway" --router "$ROUTER" --model "$MODEL" --owners "$OWNERS" \
    --heartbeat-ms 100 --listen "ipc://$RUN/gateway-31.ctl" --port "$PORT2" \
    --chat-template "$RUN/v31.jinja"
for _ in $(seq 1 100); do
    curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$PORT2/v1/models" && break
    sleep 0.1
done
BASE="http://127.0.0.1:$PORT2"
ends_with '{"type":"function","function":{"name":"get_weather"}}' "$A${CALL}get_weather<｜tool▁sep｜>"
ends_with '"required"' "$A${CALL}"
ends_with '"auto"' "$A"
echo "ok V3.1: the prompt opens NAME<｜tool▁sep｜> for a named function, the call's tag for required"
echo "PASS: tool_choice opens DeepSeek's call in the prompt"

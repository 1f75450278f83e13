# Shared helpers of the gateway e2e tests (sourced, not run): a real mesh (router with the step
# engine, attention shard, expert owners, gateway) on private sockets, data ports and HTTP port,
# cleaned up by foundation_lib.sh's trap.
SRC_BIN=${BIN:-build/bin}
. tests/e2e/foundation_lib.sh
# The snapshot can catch a binary that another build on the shared tree is relinking (not yet
# executable, or half written): copy again until every copy is executable and equal to its
# source.
for _ in 1 2 3 4 5 6 7 8 9 10; do
    ok=1
    for b in moemesh moemesh-gateway moemesh-router moemesh-attention moemesh-expert; do
        if ! [ -x "$SRC_BIN/$b" ] || ! [ -x "$BIN/$b" ] || ! cmp -s "$SRC_BIN/$b" "$BIN/$b"; then
            ok=0
            cp "$SRC_BIN/$b" "$BIN/$b" 2>/dev/null
        fi
    done
    [ $ok = 1 ] && break
    sleep 1
done

# A second free port range for the data plane (tcp://), away from the HTTP port.
free_port() {
    python3 -c 'import socket,sys
while True:
    s=socket.socket(); s.bind(("127.0.0.1",0)); p=s.getsockname()[1]; s.close()
    if p != int(sys.argv[1]): print(p); break' "$PORT"
}

BASE="http://127.0.0.1:$PORT"
OWNERS=${OWNERS:-2}

SHARDS=${SHARDS:-1}

# mesh_start [gateway flags...]: router (extra flags in $ROUTER_FLAGS), $SHARDS attention shards
# (extra flags in $ATTN_FLAGS), $OWNERS expert owners and the gateway; waits until the gateway
# can serve a completion. Sets DATA_A (shard 0's data address; shard i: DATA_A<i>) and DATA_E<i>.
mesh_start() {
    local common=(--router "$ROUTER" --model "$MODEL" --owners "$OWNERS" --heartbeat-ms 100
                  --log-level info)
    # shellcheck disable=SC2086  # ROUTER_FLAGS: extra router flags, word-split on purpose
    start router "$BIN/moemesh-router" "${common[@]}" --down-after-ms 600 --threads 1 \
        --attention-shards "$SHARDS" ${ROUTER_FLAGS:-}
    for _ in $(seq 1 50); do [ -S "$RUN/router.ctl" ] && break; sleep 0.1; done
    for i in $(seq 0 $((SHARDS - 1))); do
        local d="tcp://127.0.0.1:$(free_port)" name=attention
        eval "DATA_A$i=$d"
        [ "$i" -gt 0 ] && name="attention$i"
        # shellcheck disable=SC2086  # ATTN_FLAGS: extra shard flags, word-split on purpose
        start "$name" "$BIN/moemesh-attention" "${common[@]}" --listen "ipc://$RUN/attention-$i.ctl" \
            --instance "$i" --shards "$SHARDS" --data "$d" --threads 1 ${ATTN_FLAGS:-}
    done
    DATA_A=$DATA_A0
    for i in $(seq 0 $((OWNERS - 1))); do
        local d="tcp://127.0.0.1:$(free_port)"
        eval "DATA_E$i=$d"
        start "expert$i" "$BIN/moemesh-expert" "${common[@]}" --listen "ipc://$RUN/expert-$i.ctl" \
            --instance "$i" --data "$d" --threads 1
    done
    start gateway "$BIN/moemesh-gateway" "${common[@]}" --listen "ipc://$RUN/gateway-0.ctl" \
        --port "$PORT" "$@"
    # Ready when a one-token completion goes through the whole mesh.
    for _ in $(seq 1 100); do
        code=$(curl -s -o "$RUN/ready.json" -w '%{http_code}' --max-time 5 "$BASE/v1/completions" \
            -H 'Content-Type: application/json' -d '{"prompt":[1,2,3],"max_tokens":1}')
        [ "$code" = 200 ] && return 0
        sleep 0.2
    done
    fail "mesh did not serve a completion (last status $code: $(cat "$RUN/ready.json" 2>/dev/null))"
}

# post PATH JSON [curl args...]: body in $RUN/out.json, status in $CODE.
post() {
    local path=$1 body=$2; shift 2
    CODE=$(curl -s -o "$RUN/out.json" -w '%{http_code}' --max-time 30 "$BASE$path" \
        -H 'Content-Type: application/json' -d "$body" "$@")
}

# jq_out EXPR: a python expression over the last body (bound to j).
jq_out() { python3 -c "import json,sys; j=json.load(open('$RUN/out.json')); print($1)"; }

expect() { # expect STATUS WHAT
    [ "$CODE" = "$1" ] || fail "$2: status $CODE, want $1: $(head -c 400 "$RUN/out.json")"
}

# prompt_text CHOICE: the rendered prompt of chat $MSG with tools $TOOLS and tool_choice CHOICE,
# as /tokenize then /detokenize see it (a JSON string).
prompt_text() {
    post /tokenize "{\"messages\":$MSG,\"tools\":$TOOLS,\"tool_choice\":$1}"
    expect 200 "tokenize with tool_choice $1"
    local ids; ids=$(jq_out 'json.dumps(j["tokens"])')
    post /detokenize "{\"tokens\":$ids}"
    expect 200 "detokenize"
    jq_out 'json.dumps(j["prompt"])'
}

# sse_content FILE: the content deltas of a chat stream saved in FILE, joined (a JSON string,
# characters beyond ASCII as they are).
sse_content() {
    python3 - "$1" <<'PY'
import json, sys
out = ""
for line in open(sys.argv[1], encoding="utf-8"):
    if line.startswith("data: ") and line.strip() != "data: [DONE]":
        for c in json.loads(line[6:]).get("choices", []):
            out += c.get("delta", {}).get("content") or ""
print(json.dumps(out, ensure_ascii=False))
PY
}

# forced_answer TOOL_CHOICE: a chat of $MSG offering $TOOLS with that tool_choice, 6 tokens
# greedy, whole then streamed: the call the prompt opened is cut by max_tokens (finish_reason
# length) and the streamed text is the whole one. Sets WHOLE: the content as a JSON string
# (characters beyond ASCII as they are).
forced_answer() {
    local body="{\"messages\":$MSG,\"tools\":$TOOLS,\"tool_choice\":$1,\"max_tokens\":6,\"temperature\":0"
    post /v1/chat/completions "$body}"
    expect 200 "chat with tool_choice $1"
    [ "$(jq_out 'j["choices"][0]["finish_reason"]')" = length ] || fail "finish_reason: $(cat "$RUN/out.json")"
    WHOLE=$(jq_out 'json.dumps(j["choices"][0]["message"]["content"], ensure_ascii=False)')
    curl -s -N --max-time 30 "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "$body,\"stream\":true}" > "$RUN/sse.txt"
    local streamed; streamed=$(sse_content "$RUN/sse.txt")
    [ "$streamed" = "$WHOLE" ] || fail "streamed text $streamed differs from the whole answer $WHOLE"
}

# hjson EXPR: a python expression over the last /health body (bound to h).
hjson() { python3 -c "import json,sys; h=json.load(open('$RUN/health.json')); print($1)"; }

# load N PROMPT_TOKEN MAX_TOKENS: N concurrent completions; prints "codes=... waiting=W
# running=R" (the largest num_requests_waiting / running /metrics showed meanwhile).
load() {
    python3 - "$BASE" "$@" <<'PY'
import http.client, json, sys, threading, time, urllib.parse
base, n, tok, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
u = urllib.parse.urlparse(base)
codes = [None] * n
errs = [""] * n
gate = threading.Barrier(n)
def one(i):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"prompt": [tok + i % 7], "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True})
    gate.wait()
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    codes[i] = r.status
    errs[i] = r.read().decode()[:200]
ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in ts:
    t.start()
seen = {"waiting": 0, "running": 0}
while any(t.is_alive() for t in ts):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        for k in ("waiting", "running"):
            if line.startswith("moemesh:num_requests_%s{" % k):
                seen[k] = max(seen[k], int(float(line.rsplit(" ", 1)[1])))
    time.sleep(0.005)
for t in ts:
    t.join()
bad = [e for c, e in zip(codes, errs) if c != 200]
print("codes=%s waiting=%d running=%d %s" % (",".join(sorted(set(str(c) for c in codes))),
      seen["waiting"], seen["running"], bad[0] if bad else ""))
PY
}

# wait_log FILE TEXT: up to 10 s for TEXT in FILE.
wait_log() {
    for _ in $(seq 1 100); do grep -q -- "$2" "$1" && return 0; sleep 0.1; done
    return 1
}

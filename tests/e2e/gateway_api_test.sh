#!/bin/bash
# timeout: 170
# The gateway's OpenAI API through a real mesh (router, attention shard, 2 expert owners):
# every endpoint, the greedy completion equal to `moemesh generate`, seeded and greedy streams
# equal alone and among 64 concurrent ones, cancellation freeing KV, and every error status
# provoked for real (400 per bad field, 401, 404, 405, 413, 429, 503, a stream failing midway).
# The checks run in one python process (tests/e2e/gateway_api.py).
. tests/e2e/gateway_lib.sh

mesh_start --max-body-bytes 65536
BASE=$BASE BIN=$BIN MODEL=$MODEL RUN=$RUN ROUTER=$ROUTER OWNERS=$OWNERS DATA_E1=$DATA_E1 \
    PID_EXPERT1=$PID_expert1 python3 tests/e2e/gateway_api.py >"$RUN/api_py.out" 2>&1
rc=$?
cat "$RUN/api_py.out" # (a file: gateways the script starts keep their output open)
[ $rc = 0 ] ||
    fail "gateway_api.py: $(grep -m1 '^FAIL' "$RUN/api_py.out" || tail -n 3 "$RUN/api_py.out")"

# The same endpoints with curl, as operators call them (status codes and a word of each body).
curl_is() { # curl_is STATUS PATTERN METHOD PATH [BODY]
    local want=$1 pat=$2 method=$3 path=$4 body=${5:-}
    local args=(-s -o "$RUN/curl.out" -w '%{http_code}' --max-time 20 -X "$method" "$BASE$path")
    [ -n "$body" ] && args+=(-H 'Content-Type: application/json' -d "$body")
    local code; code=$(curl "${args[@]}")
    [ "$code" = "$want" ] || fail "curl $method $path: status $code, want $want: $(head -c 300 "$RUN/curl.out")"
    grep -q -- "$pat" "$RUN/curl.out" || fail "curl $method $path: no '$pat' in $(head -c 300 "$RUN/curl.out")"
}
curl_is 200 '"text_completion"' POST /v1/completions '{"prompt":"Hello","max_tokens":3}'
curl_is 200 '"chat.completion"' POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":3}'
curl_is 200 'data: \[DONE\]' POST /v1/chat/completions '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"stream":true}'
curl_is 200 '"object":"list"' GET /v1/models
curl_is 200 '"tokens"' POST /tokenize '{"prompt":"Hello"}'
curl_is 200 '"prompt"' POST /detokenize '{"tokens":[42,71]}'
curl_is 200 '^moemesh:generation_tokens_total' GET /metrics
curl_is 200 '"status":"degraded","router":"[^"]*","missing":\["drafter"\]' GET /health
curl_is 400 '"param":"temperature"' POST /v1/completions '{"prompt":"x","temperature":9}'
curl_is 404 '"model_not_found"' POST /v1/completions '{"prompt":"x","model":"nope"}'
curl_is 413 '"body_too_large"' POST /v1/completions "{\"prompt\":\"$(head -c 70000 /dev/zero | tr '\0' a)\"}"
echo "PASS (curl)"

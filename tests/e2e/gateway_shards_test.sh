#!/bin/bash
# timeout: 120
# The gateway takes the attention shard count from the router (no --attention-shards flag): with
# two shards that each hold one sequence (--max-seqs 1), two requests run side by side, one on
# each shard (a gateway counting one shard would run them one after the other), and both give
# the same greedy text as one request alone.
. tests/e2e/gateway_lib.sh

SHARDS=2 ATTN_FLAGS="--kv-mb 0.25 --max-seqs 1" mesh_start
wait_log "$RUN/gateway.log" "attention shards: 2, the router's" ||
    fail "the gateway did not take the router's shard count: $(grep -i 'shard' "$RUN/gateway.log" | tail -3)"
for i in 0 1; do
    wait_log "$RUN/gateway.log" "attention/$i: admitting 256 KV tokens" ||
        fail "the gateway did not take shard $i's capacity: $(grep "attention/$i" "$RUN/gateway.log" | tail -2)"
done
grep -q "attention-shards=0" "$RUN/gateway.log" || fail "the gateway was meant to run without --attention-shards"

post /v1/completions '{"prompt":[5],"max_tokens":100,"temperature":0,"ignore_eos":true}'
expect 200 "one request alone"
alone=$(jq_out 'j["choices"][0]["text"]')
out=$(load 2 5 100)
case "$out" in
"codes=200 waiting="[01]" running=2"*) ;;
*) fail "two requests on two one-seq shards: $out (want both 200 and running at once)" ;;
esac
# the same prompt twice at once: the same text as alone, whichever shard each ran on
python3 - "$BASE" "$alone" <<'PY' || fail "two concurrent requests gave another text than one alone"
import http.client, json, sys, threading, urllib.parse
u = urllib.parse.urlparse(sys.argv[1])
out = [None, None]
def one(i):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": [5], "max_tokens": 100,
              "temperature": 0, "ignore_eos": True}), headers={"Content-Type": "application/json"})
    out[i] = json.loads(c.getresponse().read())["choices"][0]["text"]
ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
sys.exit(0 if out[0] == out[1] == sys.argv[2] else 1)
PY
echo "ok two shards of one seq each, taken from the router: two requests ran at once, same text as alone"
echo "PASS: the gateway follows the router's attention shard count"

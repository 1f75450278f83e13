#!/bin/bash
# timeout: 90
# A gateway configured with larger step limits than its router (--max-step-seqs 64 /
# --max-batch-tokens 256 against the router's 2 / 16) plans within the router's limits, which
# it learns from the router's StatusReply, and says so in its log: 6 concurrent completions of
# 12-token prompts all succeed (a plan above the router's limits would be refused whole and
# fail every seq in it).
. tests/e2e/gateway_lib.sh

ROUTER_FLAGS="--max-step-seqs 2 --max-batch-tokens 16" mesh_start --max-step-seqs 64 --max-batch-tokens 256
for _ in $(seq 1 50); do # the gateway's mesh check runs at start and every health interval
    grep -q "above the router's 2" "$RUN/gateway.log" && break
    sleep 0.1
done
grep -q "gateway --max-step-seqs 64 is above the router's 2" "$RUN/gateway.log" ||
    fail "the gateway did not adopt the router's --max-step-seqs: $(grep -i router "$RUN/gateway.log" | tail -3)"
grep -q "gateway --max-batch-tokens 256 is above the router's 16" "$RUN/gateway.log" ||
    fail "the gateway did not adopt the router's --max-batch-tokens"
pids=()
for i in 1 2 3 4 5 6; do
    curl -s -o "$RUN/c$i.json" -w '%{http_code}' --max-time 60 "$BASE/v1/completions" \
        -H 'Content-Type: application/json' \
        -d "{\"prompt\":[$i,2,3,4,5,6,7,8,9,10,11,12],\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}" \
        > "$RUN/c$i.code" &
    pids+=($!)
done
wait "${pids[@]}"
for i in 1 2 3 4 5 6; do
    [ "$(cat "$RUN/c$i.code")" = 200 ] || fail "completion $i: HTTP $(cat "$RUN/c$i.code"): $(head -c 300 "$RUN/c$i.json")"
    grep -q '"completion_tokens":8' "$RUN/c$i.json" || fail "completion $i: $(head -c 300 "$RUN/c$i.json")"
done
grep -q "refused\|(--max-batch-tokens)\|more seqs" "$RUN/router.log" &&
    fail "the router refused a plan: $(grep -m1 "refused\|max-batch-tokens\|more seqs" "$RUN/router.log")"
echo "PASS: gateway planned within the router's 2 seqs / 16 tokens per step; 6 concurrent completions ok"

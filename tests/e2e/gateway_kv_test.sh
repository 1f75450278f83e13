#!/bin/bash
# timeout: 150
# The gateway admits by the KV capacity the attention shard states in its hello, without being
# told the shard's --kv-mb or --max-seqs (the gateway runs with no KV flags at all):
# 1. a shard with a small cache (--kv-mb 0.25: 256 tokens of qwen3moe-tiny): a request needing
#    more is refused with a 400 naming the KV, and two that do not fit together run one after
#    the other (one waits), both ending well. A gateway sizing the shard from its own default
#    (64 MiB) would admit both at once, and the shard would fail the second.
# 2. the shard restarts with a larger cache and more sequence slots (--kv-mb 4 --max-seqs 80):
#    the gateway picks the new capacity up when the shard rejoins; the two requests now run side
#    by side, and 70 short ones run at once, more than the 64 sequences a gateway at its old
#    default --shard-max-seqs admitted: that default would have under-admitted this shard.
. tests/e2e/gateway_lib.sh

# (96 seqs per step at the router and the gateway, so that the shard's slots are what bounds the
# sequences running at once in part 2)
ATTN_FLAGS="--kv-mb 0.25" ROUTER_FLAGS="--max-step-seqs 96" mesh_start --max-step-seqs 96
wait_log "$RUN/gateway.log" "attention/0: admitting 256 KV tokens" ||
    fail "the gateway did not take the shard's stated capacity: $(grep -i 'attention/0' "$RUN/gateway.log" | tail -3)"
grep -q "kv-mb=0" "$RUN/gateway.log" || fail "the gateway was meant to run without --kv-mb"
grep -q "attention/0 KV capacity: 256 tokens" "$RUN/router.log" ||
    fail "the router did not log the shard's capacity"
http_code >/dev/null
kv=$(hjson 'h["roles"]["attention"]["instances"][0].get("kv_capacity")')
case "$kv" in
*"'tokens': 256"*"'token_bytes': 1024"*) ;;
*) fail "/health does not show the shard's stated KV capacity: $kv" ;;
esac

# 1a. more than the shard holds: 400 naming the KV (not a 503 from the shard)
post /v1/completions '{"prompt":[5],"max_tokens":300}'
expect 400 "a request needing 301 tokens of a 256-token shard"
grep -q "KV cache; one attention shard holds 256" "$RUN/out.json" || fail "400 body: $(cat "$RUN/out.json")"

# 1b. two requests of 151 tokens (10 blocks each, 16 held): one waits for the other
out=$(load 2 5 150)
case "$out" in
"codes=200 waiting="[12]" running=1"*) ;;
*) fail "two 10-block requests on a 16-block shard: $out (want both 200, one waiting, one running at a time)" ;;
esac
echo "ok small shard (--kv-mb 0.25): 400 over 256 tokens; two 151-token requests queued one behind the other"

# 2. the shard restarts larger; the gateway follows when it rejoins
kill -TERM "$PID_attention"
wait "$PID_attention" 2>/dev/null
start attention2 "$BIN/moemesh-attention" --router "$ROUTER" --model "$MODEL" --owners "$OWNERS" \
    --heartbeat-ms 100 --log-level info --listen "ipc://$RUN/attention-0.ctl" --data "$DATA_A" \
    --threads 1 --kv-mb 4 --max-seqs 80
wait_log "$RUN/gateway.log" "attention/0 states a new capacity: admitting 4096 KV tokens" ||
    fail "the gateway did not pick up the restarted shard's capacity: $(grep 'attention/0' "$RUN/gateway.log" | tail -3)"
grep -q "80 seqs of up to 512 tokens" "$RUN/gateway.log" || fail "the gateway did not take --max-seqs 80"
for _ in $(seq 1 100); do # serving again once the router sees the shard ready
    post /v1/completions '{"prompt":[1,2,3],"max_tokens":1}'
    [ "$CODE" = 200 ] && break
    sleep 0.2
done
expect 200 "a completion after the shard rejoined"
post /v1/completions '{"prompt":[5],"max_tokens":300}'
expect 200 "301 tokens on the 4096-token shard"
out=$(load 2 5 150)
case "$out" in # (a request may wait a moment for the next plan: waiting is not checked here)
"codes=200 waiting="[01]" running=2"*) ;;
*) fail "two 10-block requests on a 256-block shard: $out (want both running at once)" ;;
esac
out=$(load 70 9 40) # 41 tokens: 3 blocks each, 210 of 256
run=$(echo "$out" | sed -n 's/.*running=\([0-9]*\).*/\1/p')
case "$out" in codes=200\ *) ;; *) fail "70 short requests: $out" ;; esac
[ "${run:-0}" -gt 64 ] || fail "70 short requests on an 80-seq shard: at most $run ran at once (want > 64): $out"
echo "ok restarted shard (--kv-mb 4 --max-seqs 80) picked up: two 151-token requests side by side; $run of 70 requests ran at once (> the old default 64)"
echo "PASS: KV admission by the shard's stated capacity, without gateway KV flags"

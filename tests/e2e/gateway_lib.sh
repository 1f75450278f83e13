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

# mesh_start [gateway flags...]: router (extra flags in $ROUTER_FLAGS), one attention shard
# (extra flags in $ATTN_FLAGS),
# $OWNERS expert owners and the gateway; waits until the gateway can serve a completion. Sets DATA_A and DATA_E<i>.
mesh_start() {
    local common=(--router "$ROUTER" --model "$MODEL" --owners "$OWNERS" --heartbeat-ms 100
                  --log-level info)
    # shellcheck disable=SC2086  # ROUTER_FLAGS: extra router flags, word-split on purpose
    start router "$BIN/moemesh-router" "${common[@]}" --down-after-ms 600 --threads 1 ${ROUTER_FLAGS:-}
    for _ in $(seq 1 50); do [ -S "$RUN/router.ctl" ] && break; sleep 0.1; done
    DATA_A="tcp://127.0.0.1:$(free_port)"
    # shellcheck disable=SC2086  # ATTN_FLAGS: extra shard flags, word-split on purpose
    start attention "$BIN/moemesh-attention" "${common[@]}" --listen "ipc://$RUN/attention-0.ctl" \
        --data "$DATA_A" --threads 1 ${ATTN_FLAGS:-}
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

# hjson EXPR: a python expression over the last /health body (bound to h).
hjson() { python3 -c "import json,sys; h=json.load(open('$RUN/health.json')); print($1)"; }

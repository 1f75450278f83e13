# Shared helpers of the mesh e2e tests (sourced, not run): a private run dir, snapshot binaries,
# shm:// names unique to this test process, daemons started with --threads 1 (the VM has 2
# cores), and a trap that kills every process the test started (by pid), even on failure.
BIN=${BIN:-build/bin}
RUN=$(mktemp -d /tmp/mm-mesh.XXXXXX)
TAG="mm$$"
PIDS=()
mkdir -p "$RUN/bin"
cp "$BIN"/moemesh "$BIN"/moemesh-{router,attention,expert} "$RUN/bin/" || exit 1
BIN="$RUN/bin"
ROUTER="ipc://$RUN/router.ctl"
HB=100 # heartbeat ms: a dead daemon is marked down after 4 x HB

fail() {
    echo "FAIL: $*"
    for f in "$RUN"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 15 "$f"; }; done
    echo "FAIL: $*" # again after the logs: the test runner shows only a failure's last lines
    exit 1
}

mesh_stop() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    PIDS=()
}
cleanup() { mesh_stop; rm -rf "$RUN"; }
trap cleanup EXIT

# start NAME ARGS...: a daemon in the background, logging to $RUN/NAME.log; PID_NAME holds its pid.
start() {
    local name=$1; shift
    "$@" >"$RUN/$name.log" 2>&1 &
    PIDS+=($!)
    eval "PID_$name=$!"
}

# Mesh settings (set before mesh_start): MODEL, OWNERS, SHARDS, PLACEMENT (file or empty),
# ROUTER_ARGS (more router options, e.g. --device cpu-dev).
ROUTER_ARGS=""
MODEL=${MODEL:-tests/fixtures/models/qwen3moe-tiny}
OWNERS=1; SHARDS=1; PLACEMENT=""
common() {
    echo --router "$ROUTER" --model "$MODEL" --owners "$OWNERS" --heartbeat-ms $HB --threads 1 \
        ${PLACEMENT:+--placement "$PLACEMENT"}
}
start_shard() { start "a$1" "$BIN/moemesh-attention" $(common) --instance "$1" --shards "$SHARDS" \
    --data "shm://$TAG-$GEN-a$1" --kv-mb 16; }
start_owner() { start "e$1" "$BIN/moemesh-expert" $(common) --instance "$1" \
    --data "shm://$TAG-$GEN-e$1" --load-csv "$RUN/load-$1.csv" --load-interval-ms 200; }
GEN=0
# mesh_start: router, SHARDS shards and OWNERS owners; waits until all are ready.
mesh_start() {
    GEN=$((GEN + 1))
    start router "$BIN/moemesh-router" $(common) --listen "$ROUTER" --attention-shards "$SHARDS" \
        --step-timeout-ms 5000 $ROUTER_ARGS
    for ((i = 0; i < SHARDS; i++)); do start_shard $i; done
    for ((i = 0; i < OWNERS; i++)); do start_owner $i; done
    wait_ready "$SHARDS" "$OWNERS" || fail "mesh (shards $SHARDS, owners $OWNERS) not ready"
}
# wait_ready M N: until the router lists M ready shards and N ready owners (10 s at most).
wait_ready() {
    for _ in $(seq 1 100); do
        "$BIN/moemesh" status --router "$ROUTER" 2>/dev/null | grep -q "attention: $1 ready, expert: $2 ready" && return 0
        sleep 0.1
    done
    return 1
}

# reference IDS N: `moemesh generate --logprobs --top-logprobs 3` of the in-process engine.
reference() { "$BIN/moemesh" generate --model "$MODEL" --ids "$1" --max-tokens "$2" --logprobs \
    --top-logprobs 3 --threads 1; }
# through_mesh IDS N [ARGS...]: the same through the mesh.
through_mesh() {
    local ids=$1 n=$2; shift 2
    "$BIN/moemesh" mesh-generate --router "$ROUTER" --ids "$ids" --max-tokens "$n" --logprobs \
        --top-logprobs 3 "$@"
}
# ms: the time in ms (for how fast a request fails).
ms() { echo $(( $(date +%s%N) / 1000000 )); }
# kill_mid_request PID WHO NAME LABEL OUT ERR LIMIT_MS [ARGS...]: a daemon dies mid-request. The
# daemon PID is frozen first, so the request (`through_mesh $IDS 40 ARGS --concurrent 2 --all`,
# output in OUT and ERR) surely waits on it, then killed; the request must fail within LIMIT_MS
# with an error naming NAME. WHO ("owner", "shard") and LABEL ("request") word the failures.
# Sets dt: ms from the kill to the failure.
kill_mid_request() {
    local pid=$1 who=$2 name=$3 label=$4 out=$5 err=$6 limit=$7 client rc t0; shift 7
    kill -STOP "$pid"
    through_mesh $IDS 40 "$@" --concurrent 2 --all >"$out" 2>"$err" &
    client=$!
    sleep 0.4
    kill -0 $client 2>/dev/null || fail "the $label did not wait for the frozen $who"
    t0=$(ms)
    kill -KILL "$pid"
    wait $client; rc=$?
    dt=$(( $(ms) - t0 ))
    [ $rc -ne 0 ] || fail "$label survived its $who's death"
    grep -q "$name" "$out" || fail "error does not name $name: $(cat "$out" "$err")"
    [ $dt -lt "$limit" ] || fail "$label took $dt ms to fail after the $who died"
}
# expect_same WHAT IDS N [ARGS...]: the mesh's lines equal the engine's, bit for bit (%.9g).
expect_same() {
    local what=$1 ids=$2 n=$3; shift 3
    local want got
    want=$(reference "$ids" "$n") || fail "$what: generate failed"
    got=$(through_mesh "$ids" "$n" "$@" 2>"$RUN/client.err") || fail "$what: mesh-generate failed: $(cat "$RUN/client.err")"
    [ "$(echo "$want" | wc -l)" -eq "$n" ] || fail "$what: reference has the wrong line count"
    if [ "$want" != "$got" ]; then
        diff <(echo "$want") <(echo "$got") | head -10
        fail "$what: mesh output differs from moemesh generate"
    fi
    echo "ok $what: $n tokens and logprobs equal generate's bit for bit"
}

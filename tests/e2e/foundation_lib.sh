# Shared helpers of the foundation e2e tests (sourced, not run). Every test gets a private run
# directory and HTTP port, and a trap that kills whatever it started, even on failure.
BIN=${BIN:-build/bin}
MODEL=${MODEL:-tests/fixtures/models/qwen3moe-tiny}
RUN=$(mktemp -d /tmp/mm-e2e.XXXXXX)
PIDS=()
# Snapshot the binaries: the build id is part of the identity, and on a shared work tree a
# rebuild in the middle of a test would otherwise start a daemon of another build.
mkdir -p "$RUN/bin"
cp "$BIN"/moemesh "$BIN"/moemesh-{gateway,router,attention,expert,drafter} "$RUN/bin/" || exit 1
BIN="$RUN/bin"

# fail MSG: the message, each log's tail, then the message again (the test runner shows only a
# failure's last lines)
fail() {
    echo "FAIL: $*"
    for f in "$RUN"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 25 "$f"; }; done
    echo "FAIL: $*"
    exit 1
}

cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    # Let them exit on their own (3 s at most): a sanitizer build checks for leaks at exit.
    local alive
    for _ in $(seq 1 60); do
        alive=0
        for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.05
    done
    for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
    # Anything left that names our run directory (children of `moemesh up`) goes too.
    local left; left=$(pgrep -f -- "$RUN/"); [ -n "$left" ] && kill -KILL $left 2>/dev/null
    rm -rf "$RUN"
}
trap cleanup EXIT

# A free loopback port derived from our pid, so parallel runs do not collide. Below the
# kernel's ephemeral range (ip_local_port_range, 32768 up on Debian): a port from that range can
# be taken between this probe and the daemon's bind by any socket bound to port 0 (the data
# planes' free_port, outgoing connections), as a gateway's "address already in use" once showed.
pick_port() {
    local p=$((20000 + ($$ * 13) % 12000))
    for _ in $(seq 1 50); do
        (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo $p; return; }
        p=$((p + 1))
    done
    echo $p
}
PORT=$(pick_port)
ROUTER="ipc://$RUN/router.ctl"

http_code() { curl -s -o "$RUN/health.json" -w '%{http_code}' --max-time 3 "127.0.0.1:$PORT/health"; }

# wait_health CODE SECONDS: poll /health until it answers CODE; prints the seconds it took.
wait_health() {
    local want=$1 limit=$2 start=$(date +%s%N) code
    while :; do
        code=$(http_code)
        [ "$code" = "$want" ] && { echo $(( ($(date +%s%N) - start) / 1000000 )); return 0; }
        [ $(( ($(date +%s%N) - start) / 1000000000 )) -ge "$limit" ] && { echo "last=$code"; return 1; }
        sleep 0.1
    done
}

# snap: flattens the last /health body into $RUN/facts, one "key=value" line each (one python
# start per snapshot: on a loaded 2-core machine each start costs seconds), e.g.
#   status=ok  missing=expert  up.expert=1  pid.expert.0=123  health.expert.0=down
#   joins.router.0=1  control.expert.0=ipc://...  model_fp.router.0=sha256:...
snap() {
    python3 - "$RUN/health.json" >"$RUN/facts" <<'PY'
import json, sys
h = json.load(open(sys.argv[1]))
print("status=%s" % h["status"])
print("missing=%s" % ",".join(h["missing"]))
for role, v in h["roles"].items():
    print("up.%s=%d" % (role, v["up"]))
    for k, i in enumerate(v["instances"]):
        for key in ("pid", "health", "joins", "detail", "instance"):
            print("%s.%s.%d=%s" % (key, role, k, i[key]))
        print("control.%s.%d=%s" % (role, k, i["control_addr"]))
        print("model_fp.%s.%d=%s" % (role, k, i["identity"]["model_fingerprint"]))
        print("build.%s.%d=%s" % (role, k, i["identity"]["build_id"]))
PY
}
# fact KEY: a value from the last snap.
fact() { sed -n "s|^$1=||p" "$RUN/facts"; }

# start NAME ARGS...: starts a daemon in the background, logging to $RUN/NAME.log.
start() {
    local name=$1; shift
    "$@" 2>"$RUN/$name.log" &
    PIDS+=($!)
    eval "PID_$name=$!"
}

alive() { kill -0 "$1" 2>/dev/null; }

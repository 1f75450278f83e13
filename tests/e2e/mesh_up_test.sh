#!/usr/bin/env bash
# timeout: 90
# `moemesh up --model DIR --owners 3 --attention-shards 2` starts a mesh that serves steps: the
# tokens and logprobs through it equal `moemesh generate`'s bit for bit; SIGTERM stops it all.
set -u
source tests/e2e/mesh_lib.sh
MODEL=tests/fixtures/models/qwen3moe-tiny
cp "${BUILD:-build}"/bin/moemesh-{gateway,drafter} "$BIN/" || fail "no gateway/drafter binaries"
port=$((30000 + ($$ * 7) % 20000))
ROUTER="ipc://$RUN/up/router.ctl"
"$BIN/moemesh" up --model $MODEL --owners 3 --attention-shards 2 --run-dir "$RUN/up" \
    --port $port --heartbeat-ms 100 >"$RUN/up.log" 2>&1 &
UP=$!
PIDS+=($UP)
wait_ready 2 3 || fail "moemesh up: mesh not ready"
expect_same "moemesh up, 3 owners, 2 shards" 21,22,23,24 6
expect_same "moemesh up, among 8 concurrent" 21,22,23,24 6 --concurrent 9
kill -TERM $UP
for _ in $(seq 1 100); do kill -0 $UP 2>/dev/null || break; sleep 0.1; done
kill -0 $UP 2>/dev/null && fail "moemesh up did not stop on SIGTERM"
wait $UP; rc=$?
[ $rc -eq 0 ] || fail "moemesh up exited $rc"
pgrep -f -- "$RUN/up" >/dev/null && fail "daemons left running after up stopped"
echo "ok SIGTERM stopped the whole mesh (exit 0)"
echo "PASS"

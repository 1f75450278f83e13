#!/usr/bin/env bash
# timeout: 60
# SPDX-License-Identifier: MIT
# A daemon configured for rdma:// on a host without an RDMA device says so at start and exits
# non-zero (no silent fallback to another transport).
set -u
BIN=${BIN:-build/bin}
if [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    echo "SKIP: this host has an RDMA device"; exit 77
fi
dir=$(mktemp -d /tmp/mm-rdma-nodev.XXXXXX)
trap 'rm -rf "$dir"' EXIT
port=$((27000 + $$ % 2000))
timeout 30 "$BIN/moemesh-expert" --model tests/fixtures/models/qwen3moe-tiny \
    --router "ipc://$dir/router.ctl" --data "rdma://127.0.0.1:$port" >"$dir/out" 2>&1
rc=$?
cat "$dir/out"
[ $rc -ne 0 ] && [ $rc -ne 124 ] || { echo "FAIL: exit status $rc, expected a start-up failure"; exit 1; }
grep -q "no RDMA device" "$dir/out" || { echo "FAIL: the log does not say that no RDMA device exists"; exit 1; }
grep -q "use tcp://" "$dir/out" || { echo "FAIL: the log does not say what to use instead"; exit 1; }
echo "ok: exit status $rc with the reason logged"

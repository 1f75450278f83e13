#!/usr/bin/env bash
# timeout: 60
# Every binary answers --help (exit 0) and rejects an unknown flag with exit 2.
set -u
BIN=${BIN:-build/bin}
for b in moemesh-gateway moemesh-router moemesh-attention moemesh-expert moemesh-drafter; do
    out=$("$BIN/$b" --help) || { echo "FAIL: $b --help exited $?"; exit 1; }
    echo "$out" | grep -q "^usage: $b" || { echo "FAIL: $b --help: no usage line"; exit 1; }
    for flag in --router --listen --data --model --placement --instance --device --log-level --heartbeat-ms; do
        echo "$out" | grep -q -- "$flag" || { echo "FAIL: $b --help lacks $flag"; exit 1; }
    done
    "$BIN/$b" --no-such-flag >/dev/null 2>&1; rc=$?
    [ $rc -eq 2 ] || { echo "FAIL: $b --no-such-flag exited $rc, expected 2"; exit 1; }
    "$BIN/$b" --device tpu:0 >/dev/null 2>&1; rc=$?
    [ $rc -eq 2 ] || { echo "FAIL: $b --device tpu:0 exited $rc, expected 2"; exit 1; }
    echo "ok $b"
done
"$BIN/moemesh-gateway" --help | grep -q -- "--port" || { echo "FAIL: gateway --help lacks --port"; exit 1; }
"$BIN/moemesh-gateway" --help | grep -q -- "--host" || { echo "FAIL: gateway --help lacks --host"; exit 1; }
"$BIN/moemesh" --help >/dev/null || { echo "FAIL: moemesh --help"; exit 1; }
for c in up status version; do
    "$BIN/moemesh" $c --help >/dev/null || { echo "FAIL: moemesh $c --help exited $?"; exit 1; }
done
"$BIN/moemesh" up --help | grep -q -- "--attention-shards" || { echo "FAIL: up --help"; exit 1; }
echo "all binaries answer --help"

# SPDX-License-Identifier: MIT
# POSIX sh (busybox in the VM). The whole mesh serving a request with every data-plane link
# (router -> attention shard, router -> 2 expert owners) over SCHEME, for SCHEME in the
# arguments: router + 1 shard + 2 owners of the tiny Qwen3-MoE fixture, `moemesh
# mesh-generate` of 8 tokens with logprobs. The outputs must be identical across schemes and
# equal to the in-process engine's (`moemesh generate`).
#   sh mesh_guest.sh BINDIR MODEL SCHEME...      e.g. sh mesh_guest.sh /t /t/model tcp rdma
B=$1; M=$2; shift 2
RUN=$(mktemp -d /tmp/mm-rdma-mesh.XXXXXX)
R="ipc://$RUN/router.ctl"
IDS=3,14,15,92,65
N=8
pids=""
stop_all() {
    for p in $pids; do kill -TERM "$p" 2>/dev/null; done
    for p in $pids; do
        i=0; while kill -0 "$p" 2>/dev/null && [ $i -lt 30 ]; do sleep 0.1; i=$((i+1)); done
        kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
    done
    pids=""
}
die() { echo "MESH-FAIL: $*"; for f in "$RUN"/*.log; do echo "--- $f"; tail -n 12 "$f"; done; stop_all; exit 1; }
# Heartbeats of 1 s: under qemu TCG every process runs ~100x slower than on a real CPU.
com="--router $R --model $M --owners 2 --heartbeat-ms ${MESH_HB_MS:-1000} --threads 1"
say() { echo "$(date +%T) $*"; }
say "reference: moemesh generate"
"$B/moemesh" generate --model "$M" --ids $IDS --max-tokens $N --logprobs --top-logprobs 3 \
    --threads 1 >"$RUN/ref.out" 2>"$RUN/ref.log" || die "moemesh generate failed"
port=25100
# Small rings (8 x 64 KiB): the tiny model's rows are a few KiB, and the router dials a member
# with a 500 ms deadline, which rdma setup of the default 4 MiB rings can exceed under TCG.
q() { [ "$1" = rdma ] && echo "?slots=8&slot_kb=64"; }
for s in "$@"; do
    say "$s: starting router, shard, 2 owners"
    port=$((port + 10))
    "$B/moemesh-router" $com --listen "$R" --attention-shards 1 --step-timeout-ms 120000 \
        >"$RUN/router-$s.log" 2>&1 & pids="$pids $!"
    "$B/moemesh-attention" $com --instance 0 --shards 1 --data "$s://127.0.0.1:$((port + 1))$(q $s)" --kv-mb 16 \
        >"$RUN/a0-$s.log" 2>&1 & pids="$pids $!"
    "$B/moemesh-expert" $com --instance 0 --data "$s://127.0.0.1:$((port + 2))$(q $s)" >"$RUN/e0-$s.log" 2>&1 & pids="$pids $!"
    "$B/moemesh-expert" $com --instance 1 --data "$s://127.0.0.1:$((port + 3))$(q $s)" >"$RUN/e1-$s.log" 2>&1 & pids="$pids $!"
    i=0
    until "$B/moemesh" status --router "$R" 2>/dev/null | grep -q "attention: 1 ready, expert: 2 ready"; do
        i=$((i + 1)); [ $i -lt 600 ] || die "$s mesh not ready in 120 s"; sleep 0.2
    done
    say "$s: mesh ready; mesh-generate"
    # The router dials a member's data URL at its first step with a 500 ms deadline; under TCG
    # an rdma:// setup can take longer, the step fails and the router redials at the next one.
    # So one retry, and the first failure is shown.
    ok=0
    for try in 1 2; do
        if "$B/moemesh" mesh-generate --router "$R" --ids $IDS --max-tokens $N --logprobs \
            --top-logprobs 3 --timeout-ms 300000 >"$RUN/$s.out" 2>"$RUN/client-$s.log"; then
            ok=1; break
        fi
        say "$s: attempt $try failed: $(tail -n 1 "$RUN/client-$s.log")"
        sleep 2
    done
    [ $ok = 1 ] || die "mesh-generate over $s:// failed: $(cat "$RUN/client-$s.log")"
    grep -h "rdma: \|data .*connected\|serving on" "$RUN"/*-"$s".log | sed "s/^/  [$s] /" | head -8
    stop_all
    [ "$(wc -l <"$RUN/$s.out")" -eq $N ] || die "$s: $(wc -l <"$RUN/$s.out") lines, want $N"
    cmp -s "$RUN/ref.out" "$RUN/$s.out" || { diff "$RUN/ref.out" "$RUN/$s.out" | head; die "$s:// mesh output differs from moemesh generate"; }
    echo "MESH-OK $s: $N tokens + logprobs through router/shard/2 owners over $s:// equal the engine's bit for bit: $(cut -d' ' -f1 "$RUN/$s.out" | tr '\n' ' ')"
done
rm -rf "$RUN"

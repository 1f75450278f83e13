#!/usr/bin/env bash
# The time between the mesh's decode steps, unpipelined and with pipelined plans
# (docs/MESH.md "Pipelined plans"; docs/BENCHMARKS.md):
#     tools/bench/mesh_pipeline.sh [MODEL] [ROUNDS] [TOKENS]
# starts a router, 1 attention shard and 1 expert owner (--threads 1 each, shm://) on MODEL
# (default tests/fixtures/models/qwen3moe-tiny) and, ROUNDS times (default 3), runs
# `moemesh mesh-generate --timing` for TOKENS new tokens (default 200) at 1 and 8 concurrent
# seqs, without and with --pipeline, printing the p50 call time (plan sent -> result in) and
# period (result -> next result). With TRACE=1 the daemons and the client also write
# MM_MESH_TRACE stamps and each run's router-side split is printed: the step (start -> picked),
# the time between steps (picked -> next start), and, unpipelined, where that goes (client
# send -> router receive, unpack, the router's checks, results and pack, reply -> client).
# BIN (default build/bin) picks the binaries.
set -u
MODEL=${1:-tests/fixtures/models/qwen3moe-tiny}
ROUNDS=${2:-3}
NTOK=${3:-200}
BIN=${BIN:-build/bin}
RUN=$(mktemp -d /tmp/mm-pipe.XXXXXX)
ROUTER="ipc://$RUN/router.ctl"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    wait 2>/dev/null
    rm -rf "$RUN"
}
trap cleanup EXIT
C=(--router "$ROUTER" --model "$MODEL" --owners 1 --heartbeat-ms 100 --threads 1)
[ "${TRACE:-0}" = 1 ] && export MM_MESH_TRACE="$RUN/tr"
"$BIN/moemesh-router" "${C[@]}" --listen "$ROUTER" --attention-shards 1 >"$RUN/router.log" 2>&1 &
PIDS+=($!)
"$BIN/moemesh-attention" "${C[@]}" --instance 0 --shards 1 --data "shm://mmpipe$$-a0" \
    --kv-mb 64 >"$RUN/a0.log" 2>&1 &
PIDS+=($!)
"$BIN/moemesh-expert" "${C[@]}" --instance 0 --data "shm://mmpipe$$-e0" >"$RUN/e0.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do
    "$BIN/moemesh" status --router "$ROUTER" 2>/dev/null |
        grep -q "attention: 1 ready, expert: 1 ready" && break
    sleep 0.1
done
echo "# $(date -u +%FT%TZ) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $MODEL, $NTOK tokens"
for r in $(seq 1 "$ROUNDS"); do
    for c in 1 8; do
        for pl in off on; do
            o=$("$BIN/moemesh" mesh-generate --router "$ROUTER" --ids 21,22,23,24 \
                --max-tokens "$NTOK" --concurrent $c --timing $([ $pl = on ] && echo --pipeline) \
                2>&1 >/dev/null)
            call=$(echo "$o" | sed -n 's/^decode steps.* p50 \([0-9.]*\) ms.*/\1/p')
            per=$(echo "$o" | sed -n 's/^decode period.* p50 \([0-9.]*\) ms.*/\1/p')
            tps=$(echo "$o" | sed -n 's/.*: \([0-9.]*\) tokens\/s.*/\1/p')
            printf "round %d  concurrent %d  pipeline %-3s  call p50 %s ms  period p50 %s ms  %s tok/s\n" \
                "$r" $c $pl "$call" "$per" "$tps"
        done
    done
done
[ "${TRACE:-0}" = 1 ] || exit 0
python3 - "$RUN/tr" <<'EOF'
import collections, glob, sys
ev = collections.defaultdict(dict)
for f in glob.glob(sys.argv[1] + ".*"):
    for line in open(f):
        p = line.split()
        if len(p) == 6 and p[0] == "T" and int(p[3]) < 0:
            ev[int(p[2])][p[1] + "." + p[4]] = float(p[5])
runs, cur = [], []
for s in sorted(ev):
    if cur and s != cur[-1] + 1:
        runs.append(cur)
        cur = []
    cur.append(s)
runs.append(cur)
md = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
order = ["client.send", "ctl.rx", "ctl.unpacked", "router.run", "router.start", "router.picked",
         "router.reply", "client.recv"]
for run in (r[5:] for r in runs if len(r) > 20):
    comp, gap, per = [], [], []
    seg = collections.defaultdict(list)
    for a, b in zip(run, run[1:]):
        ea, eb = ev[a], ev[b]
        if "router.start" in ea and "router.picked" in ea:
            comp.append(ea["router.picked"] - ea["router.start"])
        if "router.picked" in ea and "router.start" in eb:
            gap.append(eb["router.start"] - ea["router.picked"])
        if "router.start" in ea and "router.start" in eb:
            per.append(eb["router.start"] - ea["router.start"])
        if all(k in ea for k in order):
            for x, y in zip(order, order[1:]):
                seg[x + " -> " + y].append(ea[y] - ea[x])
            if "client.send" in eb:
                seg["client.recv -> next client.send"].append(eb["client.send"] - ea["client.recv"])
    piped = md(seg["client.recv -> next client.send"]) < 0  # next plan sent before this result
    print("%d steps%s: router start->picked p50 %.0f us, picked->next start p50 %.0f us, "
          "start->start p50 %.0f us" % (len(run), " (pipelined)" if piped else "", md(comp),
                                        md(gap), md(per)))
    for k, v in ([] if piped else seg.items()):
        if k.startswith("router.start"):
            continue
        print("    %-36s p50 %7.1f us" % (k, md(v)))
EOF

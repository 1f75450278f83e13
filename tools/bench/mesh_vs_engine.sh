#!/usr/bin/env bash
# Decode cost of the mesh vs the in-process engine on the same model and cores (docs/BENCHMARKS.md).
# CPU seconds per decode token, engine vs mesh (all daemons + client), from the difference
# between runs of A and B new tokens (prefill, load and page-in cancel out).
# usage: tools/bench/mesh_vs_engine.sh MODEL OWNERS SHARDS A B TAG   (every daemon --threads 1)
set -u
M=$1; O=$2; S=$3; A=$4; Bn=$5; TAG=$6
B=${BIN:-build/bin}; D=$(mktemp -d /tmp/mm-bench.XXXXXX); R=ipc://$D/router.ctl
IDS=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
tck=$(getconf CLK_TCK)
cpu_of() { local s=0; for p in "$@"; do set -- $(cut -d' ' -f14,15 /proc/$p/stat); s=$((s + $1 + $2)); done; echo $s; }
eng() { /usr/bin/time -f "%U %S %e" $B/moemesh generate --model $M --ids $IDS --max-tokens $1 --threads 1 2>&1 >/dev/null | tail -1 | awk '{print $1+$2, $3}'; }
ea=$(eng $A); eb=$(eng $Bn)
ea2=$(eng $A); eb2=$(eng $Bn)
P=()
C="--router $R --model $M --owners $O --heartbeat-ms 1000 --threads 1"
$B/moemesh-router $C --listen $R --attention-shards $S > $D/router.log 2>&1 & P+=($!)
for ((i=0;i<S;i++)); do $B/moemesh-attention $C --instance $i --shards $S --data shm://cpu-$TAG-a$i --kv-mb 256 > $D/a$i.log 2>&1 & P+=($!); done
for ((i=0;i<O;i++)); do $B/moemesh-expert $C --instance $i --data shm://cpu-$TAG-e$i > $D/e$i.log 2>&1 & P+=($!); done
for _ in $(seq 1 300); do $B/moemesh status --router $R 2>/dev/null | grep -q "attention: $S ready, expert: $O ready" && break; sleep 0.1; done
$B/moemesh mesh-generate --router $R --ids $IDS --max-tokens 4 --timeout-ms 120000 > /dev/null
mesh() { local c0=$(cpu_of "${P[@]}"); local t0=$(date +%s%N)
  local cl=$(/usr/bin/time -f "%U %S" $B/moemesh mesh-generate --router $R --ids $IDS --max-tokens $1 --timeout-ms 120000 2>&1 >/dev/null | tail -1 | awk '{print $1+$2}')
  local c1=$(cpu_of "${P[@]}"); local t1=$(date +%s%N)
  echo "$(echo "($c1 - $c0) / $tck + $cl" | bc -l) $(echo "($t1 - $t0)/1000000000" | bc -l)"; }
ma=$(mesh $A); mb=$(mesh $Bn); ma2=$(mesh $A); mb2=$(mesh $Bn)
# the decode step time as the client sees it (StepPlan sent -> StepResult back)
$B/moemesh mesh-generate --router $R --ids $IDS --max-tokens $Bn --timing --timeout-ms 120000 2>&1 >/dev/null | sed "s/^/$TAG mesh /"
for p in "${P[@]}"; do kill -TERM $p; done; sleep 1.5; for p in "${P[@]}"; do kill -KILL $p 2>/dev/null; done; wait; rm -rf $D
python3 - "$TAG" "$A" "$Bn" "$ea" "$eb" "$ea2" "$eb2" "$ma" "$mb" "$ma2" "$mb2" <<'PY'
import sys
tag, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
v = [tuple(map(float, x.split())) for x in sys.argv[4:]]
n = b - a
def per(x, y, i): return (y[i] - x[i]) / n * 1000
e = [per(v[0], v[1], 0), per(v[2], v[3], 0)]; ew = [per(v[0], v[1], 1), per(v[2], v[3], 1)]
m = [per(v[4], v[5], 0), per(v[6], v[7], 0)]; mw = [per(v[4], v[5], 1), per(v[6], v[7], 1)]
print(f"{tag}: CPU ms per decode token: engine {e[0]:.2f} / {e[1]:.2f}, mesh {m[0]:.2f} / {m[1]:.2f}; "
      f"wall ms per token: engine {ew[0]:.2f} / {ew[1]:.2f}, mesh {mw[0]:.2f} / {mw[1]:.2f}")
PY

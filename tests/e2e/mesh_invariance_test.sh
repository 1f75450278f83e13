#!/usr/bin/env bash
# timeout: 150
# Through the mesh (router + attention shards + expert owners on shm://), greedy tokens and
# their logprobs (with the top 3, %.9g) equal `moemesh generate --logprobs`, bit for bit, on
# qwen3moe-tiny: 1, 2 and 3 owners; 1 and 2 shards; prompt in chunks; the request among 8
# concurrent others; a balanced (non-uniform) placement with replicated hot experts, built by
# `moemesh placement` from the owners' exported load CSVs.
set -u
source tests/e2e/mesh_lib.sh
MODEL=tests/fixtures/models/qwen3moe-tiny
IDS=11,42,7,300,5,99,18
N=8

OWNERS=1 SHARDS=1 mesh_start
expect_same "1 owner, 1 shard" $IDS $N
mesh_stop

OWNERS=2 SHARDS=1 mesh_start
expect_same "2 owners, 1 shard" $IDS $N
expect_same "2 owners, prompt in chunks of 3" $IDS $N --chunk 3
mesh_stop

OWNERS=3 SHARDS=2 mesh_start
expect_same "3 owners, 2 shards" $IDS $N
expect_same "3 owners, 2 shards, among 8 concurrent requests" $IDS $N --concurrent 9
expect_same "3 owners, 2 shards, 9 concurrent in chunks of 2" 3,1,4,1,5,9,2,6 $N --concurrent 9 --chunk 2
# The concurrent requests themselves: each equals its own run alone.
through_mesh 7,5,99,18,11,42 $N --concurrent 5 --all > "$RUN/all.txt" 2>"$RUN/client.err" ||
    fail "concurrent --all: $(cat "$RUN/client.err")"
alone=$(through_mesh 99,18,11,42,7 $N) || fail "alone"
# seq 2 is the prompt rotated by 2 and 2 tokens shorter: 99,18,11,42 ... see mesh-generate
seq2=$(awk '/^# seq 2$/{f=1;next} /^# seq/{f=0} f' "$RUN/all.txt" | head -n $N)
alone2=$(through_mesh 99,18,11,42 $((N + 1)) | head -n $N)
[ "$seq2" = "$alone2" ] || fail "seq 2 among 5 differs from its run alone"
echo "ok a concurrent neighbour's tokens equal its run alone"
mesh_stop # owners write their load CSVs at exit

for i in 0 1 2; do [ -s "$RUN/load-$i.csv" ] || fail "owner $i wrote no load CSV"; done
grep -q '^layer,expert,tokens$' "$RUN/load-0.csv" || fail "load CSV header"
total=$(cat "$RUN"/load-*.csv | grep -v layer | awk -F, '{s+=$3} END {print s}')
[ "$total" -gt 0 ] || fail "load CSVs count no tokens"
echo "ok owners exported load CSVs ($total routed rows)"
cat "$RUN"/load-*.csv > "$RUN/load.csv"
"$BIN/moemesh" placement --model $MODEL --owners 3 --balanced "$RUN/load.csv" --replicate-hot 2 \
    --out "$RUN/balanced.json" || fail "moemesh placement --balanced"
"$BIN/moemesh" placement --model $MODEL --owners 3 --uniform --out "$RUN/uniform.json" || fail "uniform"
cmp -s "$RUN/balanced.json" "$RUN/uniform.json" && fail "balanced placement equals the uniform one"
grep -q '\[[0-9],[0-9]\]' "$RUN/balanced.json" || fail "no replicated expert in the placement"
echo "ok balanced placement differs from uniform and replicates hot experts"

OWNERS=3 SHARDS=1 PLACEMENT="$RUN/balanced.json" mesh_start
expect_same "balanced placement with replicas, 3 owners" $IDS $N
expect_same "balanced placement, among 8 concurrent" $IDS $N --concurrent 9
mesh_stop
echo "PASS"

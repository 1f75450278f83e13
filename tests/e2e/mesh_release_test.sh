#!/usr/bin/env bash
# timeout: 60
# A plan that carries only releases (mesh-generate's last plan, unpipelined and pipelined) frees
# those seqs' KV on the shards: with --max-seqs 2 on each shard, many runs in a row all succeed.
# Before the router sent a releases-only plan's CTRL frames, the shard kept every finished seq
# and the third run failed with "no free sequence slot (--max-seqs 2)".
set -u
source tests/e2e/mesh_lib.sh
start_shard() { start "a$1" "$BIN/moemesh-attention" $(common) --instance "$1" --shards "$SHARDS" \
    --data "shm://$TAG-$GEN-a$1" --kv-mb 16 --max-seqs 2; }
OWNERS=1 SHARDS=1 mesh_start
for i in 1 2 3 4 5; do
    through_mesh 11,42,7 3 >/dev/null 2>"$RUN/client.err" ||
        fail "run $i of 5 (--max-seqs 2): $(cat "$RUN/client.err")"
done
echo "ok 5 runs in a row on a shard with --max-seqs 2 (releases-only plans free the KV)"
for i in 1 2 3 4; do
    through_mesh 11,42,7 3 --pipeline >/dev/null 2>"$RUN/client.err" ||
        fail "pipelined run $i of 4 (--max-seqs 2): $(cat "$RUN/client.err")"
done
echo "ok 4 pipelined runs in a row"
for i in 1 2 3; do
    through_mesh 11,42,7 3 --concurrent 2 >/dev/null 2>"$RUN/client.err" ||
        fail "2-seq run $i of 3 (--max-seqs 2): $(cat "$RUN/client.err")"
done
echo "ok 3 runs of 2 concurrent seqs in a row"
mesh_stop
# two shards: seq -> shard by id, each shard's releases reach it
SHARDS=2 OWNERS=1 mesh_start
for i in 1 2 3 4 5; do
    through_mesh 11,42,7 3 --concurrent 2 >/dev/null 2>"$RUN/client.err" ||
        fail "2 shards, run $i of 5: $(cat "$RUN/client.err")"
done
echo "ok 2 shards: 5 runs of 2 concurrent seqs in a row"
echo "PASS"

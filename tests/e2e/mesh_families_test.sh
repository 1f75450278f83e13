#!/usr/bin/env bash
# timeout: 120
# The mesh equals the in-process engine bit for bit on other families (deepseekv3-tiny: shared
# experts, a dense first layer, MLA; mixtral-tiny; glm4moe-tiny; qwen2moe-tiny: gated shared
# expert) and on checkpoints no other invariance test uses (the *-var fixtures: other shapes,
# expert counts and routing settings), each with 2 owners and 2 shards, alone and among
# concurrent requests; and two checkpoints synthesised with a fresh seed by this very run.
set -u
source tests/e2e/mesh_lib.sh
for m in deepseekv3-tiny mixtral-tiny glm4moe-tiny qwen2moe-tiny qwen3moe-var mixtral-var deepseekv3-var; do
    MODEL=tests/fixtures/models/$m
    OWNERS=2 SHARDS=2 mesh_start
    expect_same "$m, 2 owners, 2 shards" 17,3,250,8,64 6
    expect_same "$m, among 4 concurrent, chunks of 2" 17,3,250,8,64 6 --concurrent 5 --chunk 2
    mesh_stop
done
MODEL=tests/fixtures/models/mixtral-var
OWNERS=3 SHARDS=1 mesh_start
expect_same "mixtral-var, 3 owners" 9,8,7,6 6
mesh_stop
# Checkpoints no run has seen before: fresh random weights (seed from this run) of both
# synthesised families, 4 shards' worth of safetensors files each.
seed=$(( ($$ * 7919 + $(date +%s)) % 1000000 ))
for fam in qwen3_moe mixtral; do
    MODEL="$RUN/synth-$fam"
    "$BIN/moemesh" synth --shape tiny --family $fam --layers 3 --seed $seed --out "$MODEL" >/dev/null 2>&1 ||
        fail "moemesh synth $fam"
    OWNERS=3 SHARDS=2 mesh_start
    expect_same "fresh $fam (seed $seed), 3 owners, 2 shards" 5,17,301,44,2 6 --concurrent 4
    mesh_stop
done
echo "PASS"

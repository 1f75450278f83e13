#!/usr/bin/env bash
# timeout: 120
# The mesh equals the in-process engine bit for bit on other families (deepseekv3-tiny: shared
# experts, a dense first layer, MLA; mixtral-tiny; glm4moe-tiny; qwen2moe-tiny: gated shared
# expert) and on checkpoints no other invariance test uses (the *-var fixtures: other shapes,
# expert counts and routing settings), each with 2 owners and 2 shards, alone and among
# concurrent requests.
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
echo "PASS"

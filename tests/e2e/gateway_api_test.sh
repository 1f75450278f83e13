#!/bin/bash
# timeout: 170
# The gateway's OpenAI API through a real mesh (router, attention shard, 2 expert owners):
# every endpoint, the greedy completion equal to `moemesh generate`, seeded and greedy streams
# equal alone and among 64 concurrent ones, cancellation freeing KV, and every error status
# provoked for real (400 per bad field, 401, 404, 405, 413, 429, 503, a stream failing midway).
# The checks run in one python process (tests/e2e/gateway_api.py).
. tests/e2e/gateway_lib.sh

mesh_start --max-body-bytes 65536
BASE=$BASE BIN=$BIN MODEL=$MODEL RUN=$RUN ROUTER=$ROUTER OWNERS=$OWNERS DATA_E1=$DATA_E1 \
    PID_EXPERT1=$PID_expert1 PORT2=$(free_port) python3 tests/e2e/gateway_api.py \
    || fail "gateway_api.py"

#!/bin/bash
# timeout: 170
# The gateway with --pipeline-plans false (one plan in flight: each plan waits for the previous
# result): the whole OpenAI API suite (tests/e2e/gateway_api.py) passes, and no plan went out
# pipelined. gateway_pipeline_test runs the same suite with the default (pipelined plans).
. tests/e2e/gateway_lib.sh

mesh_start --max-body-bytes 65536 --pipeline-plans false --log-level debug
grep -q "config pipeline-plans=false" "$RUN/gateway.log" || fail "gateway did not take --pipeline-plans false"
BASE=$BASE BIN=$BIN MODEL=$MODEL RUN=$RUN ROUTER=$ROUTER OWNERS=$OWNERS DATA_E1=$DATA_E1 \
    PID_EXPERT1=$PID_expert1 python3 tests/e2e/gateway_api.py \
    || fail "gateway_api.py with --pipeline-plans false"
n=$(grep -c "releases (pipelined)" "$RUN/gateway.log")
[ "$n" = 0 ] || fail "$n plans went out pipelined with --pipeline-plans false"
echo "PASS"

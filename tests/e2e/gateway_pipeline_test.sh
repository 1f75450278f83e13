#!/bin/bash
# timeout: 170
# The gateway with --pipeline-plans, its default (the next plan goes out before the previous result
# is in; decode seqs follow the router's picks): the whole OpenAI API suite (tests/e2e/gateway_api.py:
# greedy completion equal to `moemesh generate`, seeded and greedy streams equal alone and among
# 64 concurrent ones, stop strings, cancellation freeing KV, a stream failing midway, every
# error status) passes as without it (gateway_unpipelined_test), and plans really went out
# pipelined.
. tests/e2e/gateway_lib.sh

mesh_start --max-body-bytes 65536 --log-level debug
grep -q "config pipeline-plans=true" "$RUN/gateway.log" || fail "the gateway's default is not --pipeline-plans true"
BASE=$BASE BIN=$BIN MODEL=$MODEL RUN=$RUN ROUTER=$ROUTER OWNERS=$OWNERS DATA_E1=$DATA_E1 \
    PID_EXPERT1=$PID_expert1 python3 tests/e2e/gateway_api.py \
    || fail "gateway_api.py with --pipeline-plans"
n=$(grep -c "releases (pipelined)" "$RUN/gateway.log")
[ "$n" -gt 50 ] || fail "only $n plans went out pipelined"
echo "ok $n plans went out before the previous result was in"
echo "PASS"

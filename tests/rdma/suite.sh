#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The rdma:// suite on soft-RoCE, as `make test-rdma` and tests/rdma/softroce_test.sh run it:
# boots the VM (tests/rdma/vm.sh) with the test binaries, moemesh (benchmarks, generate,
# mesh-generate), the router/attention/expert daemons and the tiny model fixture (owner_test,
# mesh_guest.sh), and runs tests/rdma/guest.sh there.
#   tests/rdma/suite.sh BUILD [CASE_FILTER] [bench|nobench] [mesh|nomesh]
set -u
BUILD=${1:-build}
FILTER=${2:-}
BENCH=${3:-nobench}
MESH=${4:-mesh}
model=tests/fixtures/models/qwen3moe-tiny
args=()
for b in "$BUILD/tests/rdma/rdma_test" "$BUILD/tests/transport/conformance_test" \
         "$BUILD/tests/rdma/owner_test" "$BUILD/bin/moemesh-expert" "$BUILD/bin/moemesh" \
         "$BUILD/bin/moemesh-router" "$BUILD/bin/moemesh-attention"; do
    [ -x "$b" ] || { echo "suite.sh: $b is not built (make all test-bins)" >&2; exit 2; }
    args+=(--bin "$b")
done
for f in config.json model.safetensors; do args+=(--file "$model/$f=/t/model/$f"); done
args+=(--file tests/rdma/mesh_guest.sh=/t/mesh_guest.sh)
# TCG speed follows the host's load: at load average 10 the suite alone took ~6 min.
[ "$BENCH" = bench ] && def_timeout=1500 || def_timeout=900
exec tests/rdma/vm.sh --timeout "${MM_RDMA_VM_TIMEOUT:-$def_timeout}" "${args[@]}" tests/rdma/guest.sh "$FILTER" "$BENCH" "$MESH"

#!/usr/bin/env bash
# timeout: 720
# SPDX-License-Identifier: MIT
# The rdma:// conformance suite and rdma_test on soft-RoCE: boots Debian's 6.1 kernel under
# qemu (TCG) with rdma_rxe (tests/rdma/vm.sh) and runs tests/rdma/guest.sh there without the
# benchmarks and without the whole-mesh run (mesh_guest.sh, which `make test-rdma` adds).
# About a minute on a 2-vCPU box (several when the host is loaded: qemu TCG). Skips (77) only
# when qemu/busybox-static cannot be installed or the kernel package cannot be downloaded.
set -u
BUILD=${BUILD:-build}
MM_RDMA_VM_TIMEOUT=660 tests/rdma/suite.sh "$BUILD" "" nobench nomesh
rc=$?
if [ $rc -eq 3 ]; then
    echo "SKIP: soft-RoCE VM prerequisites unavailable (see vm.sh message above)"
    exit 77
fi
exit $rc

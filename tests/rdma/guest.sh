# SPDX-License-Identifier: MIT
# Runs inside the soft-RoCE VM (tests/rdma/vm.sh), cwd /t, rxe0 up on eth0 (10.0.2.15).
# Each test case runs in its own process with a time limit, like tests/run.sh; then the
# benchmark rows (rdma://, shm://, tcp:// in the same VM). Prints "MMVM-RESULT: ..." and
# exits non-zero when a case failed.
#   sh guest.sh [CASE_FILTER] [bench|nobench] [mesh|nomesh]
FILTER=${1:-}
BENCH=${2:-bench}
MESH=${3:-mesh}
export MM_TEST_RDMA_HOST=127.0.0.1
pass=0; fail=0; skip=0
run_case() { # bin case timeout
    case "$2" in *"$FILTER"*) ;; *) return ;; esac
    t0=$(date +%s)
    timeout "$3" "./$1" "$2" >/tmp/case.log 2>&1
    rc=$?
    dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then pass=$((pass+1)); echo "ok    $1: $2 (${dt}s)"
    elif [ $rc -eq 77 ]; then skip=$((skip+1)); echo "skip  $1: $2 ($(grep -m1 '^SKIP' /tmp/case.log))"
    else fail=$((fail+1)); echo "FAIL  $1: $2 rc=$rc (${dt}s)"; tail -n 30 /tmp/case.log | sed 's/^/      | /'; fi
}
./rdma_test --list > /tmp/cases
while IFS= read -r c; do run_case rdma_test "$c" 120; done < /tmp/cases
./conformance_test --list | grep '^rdma: ' > /tmp/cases
while IFS= read -r c; do run_case conformance_test "$c" 180; done < /tmp/cases
if [ -x ./owner_test ]; then # an expert owner over rdma:// vs tcp://, bit for bit
    export MM_TEST_EXPERT_BIN=/t/moemesh-expert MM_TEST_MODEL=/t/model
    ./owner_test --list > /tmp/cases
    while IFS= read -r c; do run_case owner_test "$c" 300; done < /tmp/cases
    grep '^layer' /tmp/case.log 2>/dev/null
fi
if [ "$MESH" = mesh ] && [ -f ./mesh_guest.sh ] && [ -x ./moemesh-router ]; then # the whole mesh over rdma:// vs tcp://
    case "mesh over rdma" in *"$FILTER"*)
        t0=$(date +%s)
        timeout 500 sh ./mesh_guest.sh /t /t/model ${MESH_SCHEMES:-rdma tcp} >/tmp/mesh.log 2>&1
        rc=$?; dt=$(( $(date +%s) - t0 ))
        if [ $rc -eq 0 ]; then pass=$((pass+1)); echo "ok    mesh over rdma:// = tcp:// = engine (${dt}s)"
        else fail=$((fail+1)); echo "FAIL  mesh over rdma:// rc=$rc (${dt}s)"; fi
        sed 's/^/      | /' /tmp/mesh.log | tail -n 40 ;;
    esac
fi
echo "MMVM-RESULT: $pass passed, $fail failed, $skip skipped"
if [ "$BENCH" = bench ] && [ -x ./moemesh ]; then
    # Same VM, same run: rdma:// (soft-RoCE, rxe0 on eth0), shm://, tcp:// over loopback.
    # TCG emulates every instruction: absolute figures are ~100x a real CPU's; compare rows.
    echo "MMVM-BENCH-BEGIN"
    for u in rdma://127.0.0.1:24600 shm://bh tcp://127.0.0.1:24700; do
        ./moemesh bench-hop --url "$u" --iters 400 --warmup 40 --bytes 16384 --bw-mb 32 2>&1
        ./moemesh bench-hop --url "$u" --iters 40 --warmup 5 --bytes 1048576 --bw-mb 32 2>&1
    done
    echo "MMVM-BENCH-END"
fi
[ $fail -eq 0 ]

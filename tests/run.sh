#!/usr/bin/env bash
# Runs every test case in its own process with a timeout and prints one line per case, then
# "N passed, N failed[, N skipped]". Exit status is non-zero when any case failed.
#   C tests:     $BUILD/tests/**/<name>_test  (cases listed by --list, run one by one)
#   shell tests: tests/**/*_test.sh           (one case each; exit 77 means skipped)
# TESTS=substring limits the run to matching case names; MM_TEST_TIMEOUT sets the per-case
# limit in seconds (default 120; a shell test may declare "# timeout: N" in its first lines).
set -u
BUILD=${BUILD:-build}
export BUILD BIN="$BUILD/bin"
TIMEOUT=${MM_TEST_TIMEOUT:-120}
FILTER=${TESTS:-}
pass=0 fail=0 skip=0
failed_names=()
logdir=$(mktemp -d /tmp/mm-test.XXXXXX)

run_case() { # name, timeout, command...
    local name=$1 t=$2; shift 2
    if [ -n "$FILTER" ] && [[ "$name" != *"$FILTER"* ]]; then return; fi
    local log="$logdir/$(echo "$name" | tr -c 'A-Za-z0-9._-' '_').log"
    local start=$(date +%s%N)
    timeout -k 5 "$t" "$@" >"$log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    local secs=$(printf '%d.%02d' $((ms / 1000)) $(((ms % 1000) / 10)))
    if [ $rc -eq 0 ]; then
        pass=$((pass + 1)); printf 'ok    %-60s %6ss\n' "$name" "$secs"
    elif [ $rc -eq 77 ]; then
        skip=$((skip + 1)); printf 'skip  %-60s (%s)\n' "$name" "$(grep -m1 '^SKIP' "$log" | sed 's/^SKIP: //')"
    else
        fail=$((fail + 1)); failed_names+=("$name")
        [ $rc -eq 124 ] && echo "(timed out after ${t}s)" >>"$log"
        printf 'FAIL  %-60s rc=%d\n' "$name" "$rc"
        tail -n 40 "$log" | sed 's/^/      | /'
    fi
}

while IFS= read -r bin; do
    [ -x "$bin" ] || continue
    rel=${bin#"$BUILD/tests/"}
    while IFS= read -r c; do
        [ -n "$c" ] && run_case "$rel: $c" "$TIMEOUT" "$bin" "$c"
    done < <("$bin" --list)
done < <(find "$BUILD/tests" -type f -name '*_test' 2>/dev/null | sort)

while IFS= read -r sh; do
    t=$(grep -m1 -o '^# timeout: [0-9]*' "$sh" | awk '{print $3}')
    run_case "${sh#tests/}" "${t:-$TIMEOUT}" bash "$sh"
done < <(find tests -type f -name '*_test.sh' 2>/dev/null | sort)

rm -rf "$logdir"
if [ $fail -gt 0 ]; then
    echo "failed:"; printf '  %s\n' "${failed_names[@]}"
fi
line="$pass passed, $fail failed"
[ $skip -gt 0 ] && line="$line, $skip skipped"
echo "$line"
[ $fail -eq 0 ]

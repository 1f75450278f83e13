#!/usr/bin/env bash
# Runs every test case in its own process with a timeout and prints one line per case, then
# "N passed, N failed[, N skipped]". Exit status is non-zero when any case failed.
#   C tests:     $BUILD/tests/**/<name>_test  (cases listed by --list, run one by one)
#   shell tests: tests/**/*_test.sh           (one case each; exit 77 means skipped)
# TESTS=substring limits the run to matching case names; MM_TEST_TIMEOUT sets the per-case
# limit in seconds (default 120; a shell test may declare "# timeout: N" in its first lines).
# MM_TEST_TIMEOUT_SCALE (integer, default 1) multiplies every case's limit: `make asan` and
# `make ubsan` set it, since instrumented binaries run several times slower. It is exported, so
# a test may scale its own waits on peers with it.
# MM_TEST_SANITIZER=1 (set by `make asan`/`make ubsan`): every process of a case writes its
# sanitizer reports to a per-case directory (log_path in ASAN_OPTIONS/UBSAN_OPTIONS), and a case
# is failed when any report appears there — also one from a daemon whose exit status the test
# never sees (killed by SIGTERM at the end of an e2e test, LeakSanitizer runs at its exit).
set -u
BUILD=${BUILD:-build}
export BUILD BIN="$BUILD/bin"
SCALE=${MM_TEST_TIMEOUT_SCALE:-1}
[[ "$SCALE" =~ ^[1-9][0-9]*$ ]] || { echo "run.sh: MM_TEST_TIMEOUT_SCALE must be a positive integer, not '$SCALE'" >&2; exit 2; }
export MM_TEST_TIMEOUT_SCALE=$SCALE
TIMEOUT=${MM_TEST_TIMEOUT:-120}
FILTER=${TESTS:-}
SANITIZER=${MM_TEST_SANITIZER:-}
pass=0 fail=0 skip=0
failed_names=()
logdir=$(mktemp -d /tmp/mm-test.XXXXXX)

run_case() { # name, timeout, command...
    local name=$1 t=$2; shift 2
    if [ -n "$FILTER" ] && [[ "$name" != *"$FILTER"* ]]; then return; fi
    local log="$logdir/$(echo "$name" | tr -c 'A-Za-z0-9._-' '_').log"
    t=$((t * SCALE))
    local start=$(date +%s%N) san="" rc
    if [ -n "$SANITIZER" ]; then
        san="$log.san"; mkdir -p "$san"
        # (the braces keep bash's "Aborted" job message, abort_on_error, out of the summary)
        { ASAN_OPTIONS="${ASAN_OPTIONS:-}${ASAN_OPTIONS:+:}log_path=$san/asan" \
          UBSAN_OPTIONS="${UBSAN_OPTIONS:-}${UBSAN_OPTIONS:+:}log_path=$san/ubsan" \
              timeout -k 5 "$t" "$@" >"$log" 2>&1; } 2>/dev/null
        rc=$?
        if [ -n "$(ls -A "$san")" ]; then # a report from any process of the case
            for f in "$san"/*; do echo "--- sanitizer report $f"; cat "$f"; done >>"$log"
            [ $rc -eq 0 ] || [ $rc -eq 77 ] && rc=99
            [ $rc -eq 99 ] && echo "(sanitizer report from a process of this case; exit status was 0/77)" >>"$log"
        fi
    else
        timeout -k 5 "$t" "$@" >"$log" 2>&1
        rc=$?
    fi
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
        tail -n "$([ -n "$san" ] && echo 80 || echo 40)" "$log" | sed 's/^/      | /'
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

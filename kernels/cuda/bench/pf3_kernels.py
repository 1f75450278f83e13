#!/usr/bin/env python3
"""Per-kernel GPU time of one steady 4096-row forward, from a bench-model run with two prompt
rounds (kernels/cuda/bench/pf3_run.sh).

Input: nsys's cuda_gpu_trace CSV (start, duration, grid, name per kernel) or ncu's CSV of
gpu__time_duration.sum (one row per kernel launch, in launch order, no timestamps).
nsys: the run is split into segments at GPU idle gaps over 300 us (the host's work between
forwards); the segment holding the 5th..8th 4096-row attention calls is the second forward;
its span (first start to last end) is the forward's GPU time, and its kernels are summed by
name. ncu: the launches after the 4th large attention call up to the 8th are taken: one
forward's worth of kernels (the first forward's last layer after its attention, with that
layer's permuted-W cache builds, wg_convert_w_kernel, which a steady forward does not have;
then the second forward up to its last attention). ncu runs each kernel alone at locked base
clocks with flushed caches, so its times are longer than the forward's: read the shares.
"""
import csv
import re
import sys
from collections import OrderedDict


def short(name):
    name = re.sub(r"\(.*", "", name)  # drop argument lists
    name = re.sub(r"^void ", "", name)
    return name.strip()


def big_attention(name, grid_x):
    return "attention_tc" in name and grid_x >= 64


def report(kernels, span_us=None):
    tot = OrderedDict()
    for name, us in kernels:
        t = tot.setdefault(short(name), [0, 0.0])
        t[0] += 1
        t[1] += us
    s = sum(v[1] for v in tot.values())
    if span_us is not None:
        print(f"forward span on the GPU: {span_us:.1f} us; kernels {s:.1f} us "
              f"({len(kernels)} launches); gaps {span_us - s:.1f} us")
    else:
        print(f"kernels {s:.1f} us ({len(kernels)} launches)")
    for k, (n, us) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:10.1f} us {100 * us / s:5.1f}%  {n:3d}x  {k[:110]}")


def from_nsys(rows):
    ks = []
    for r in rows:
        try:
            start = float(r["Start (ns)"])
            dur = float(r["Duration (ns)"])
        except (KeyError, ValueError):
            continue
        name = r.get("Name", "")
        if "[CUDA mem" in name or name.startswith("[CUDA"):
            continue
        gx = int(float(r.get("GrdX", "0") or 0))
        ks.append((start, dur, gx, name))
    ks.sort()
    segs, cur, end = [], [], None
    for k in ks:
        if end is not None and k[0] - end > 300e3:
            segs.append(cur)
            cur = []
        cur.append(k)
        end = max(end or 0, k[0] + k[1])
    if cur:
        segs.append(cur)
    nbig = 0
    for seg in segs:
        b = sum(1 for k in seg if big_attention(k[3], k[2]))
        if b and nbig >= 4:
            span = (max(k[0] + k[1] for k in seg) - seg[0][0]) / 1e3
            report([(k[3], k[1] / 1e3) for k in seg], span)
            return
        nbig += b
    print("no second 4096-row forward found; segments:", [len(s) for s in segs])


def from_ncu(rows):
    ks = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        us = v / 1e3 if unit in ("nsecond", "ns") else v * 1e3 if unit in ("msecond", "ms") else v
        g = re.findall(r"\d+", r.get("Grid Size", "0"))
        ks.append((r["Kernel Name"], us, int(g[0]) if g else 0))
    big = [i for i, k in enumerate(ks) if big_attention(k[0], k[2])]
    if len(big) < 8:
        print("fewer than 8 large attention calls:", len(big))
        report([(k[0], k[1]) for k in ks])
        return
    # one forward's worth of kernels, shifted by the part of a layer before its attention
    report([(k[0], k[1]) for k in ks[big[3] + 1:big[7] + 1]])


def main():
    path = sys.argv[1]
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    # ncu prints its own lines before the CSV header
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"') or l.startswith("Start")
                  or l.startswith('"Start')), 0)
    rows = list(csv.DictReader(lines[start:]))
    if rows and "Metric Name" in rows[0]:
        from_ncu(rows)
    else:
        from_nsys(rows)


if __name__ == "__main__":
    main()

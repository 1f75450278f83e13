#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
# Reads kernel_trace.c's time lines (plain or .gz) and prints the recorded decode step as a
# chain: the steps are cut at each embed_rmsnorm launch, the last N steps of the most common
# length kept, and per kernel of the step (summed over its calls) its median duration (start to
# end, the part before its wait included) and its median marginal time (its end minus the latest
# end before it: what it adds to the step).
#     python3 kernels/cuda/bench/kernel_trace.py k.tsv [more.tsv ...] [--steps N]
import gzip
import statistics
import sys

NAMES = [('embed_rmsnorm', 'embed_rmsnorm'), ('attention_tcd_prep', 'attention_prep'),
         ('add_rmsnorm', 'add_rmsnorm'), ('route_plan', 'route_plan'),
         ('combine_rmsnorm', 'combine_rmsnorm'), ('argmax', 'argmax'), ('fetch', 'fetch'),
         ('gemv_bulk', 'gemv_bulk'), ('head_norm_rope', 'head_norm_rope_kv')]


def short(name):
    for key, value in NAMES:
        if key in name:
            return value
    return name[:40]


def load(path):
    opener = gzip.open if path.endswith('.gz') else open
    rows = []
    with opener(path, 'rt') as f:
        for line in f:
            a, b, name, gx, gy = line.rstrip('\n').split('\t')[:5]
            rows.append((int(a), int(b), name, int(gx), int(gy)))
    rows.sort()
    steps, cur = [], None
    for r in rows:
        if 'embed_rmsnorm' in r[2]:
            cur = []
            steps.append(cur)
        if cur is not None:
            cur.append(r)
    if not steps:
        return []
    lengths = [len(s) for s in steps]
    common = max(set(lengths), key=lengths.count)
    return [s for s in steps if len(s) == common]


def main(argv):
    n_steps = 30
    paths = []
    i = 0
    while i < len(argv):
        if argv[i] == '--steps':
            n_steps = int(argv[i + 1])
            i += 2
            continue
        paths.append(argv[i])
        i += 1
    for path in paths:
        steps = load(path)[-n_steps:]
        if not steps:
            print(f'{path}: no steps found')
            continue
        n = len(steps[0])
        marg = [[] for _ in range(n)]
        dur = [[] for _ in range(n)]
        spans = []
        for st in steps:
            t0 = st[0][0]
            last_end = t0
            for j, r in enumerate(st):
                marg[j].append((r[1] - last_end) / 1e3)
                dur[j].append((r[1] - r[0]) / 1e3)
                last_end = max(last_end, r[1])
            spans.append((st[-1][1] - t0) / 1e3)
        print(f'{path}: {len(steps)} steps of {n} kernels, step span median '
              f'{statistics.median(spans):.1f} us')
        agg = {}
        for j, r in enumerate(steps[0]):
            key = f'{short(r[2])} {r[3]}x{r[4]}'
            a = agg.setdefault(key, [0.0, 0.0, 0])
            a[0] += statistics.median(marg[j])
            a[1] += statistics.median(dur[j])
            a[2] += 1
        for key, (m, d, calls) in agg.items():
            print(f'  {key:34s} calls {calls:2d}  adds {m:7.2f} us  runs {d:7.2f} us')


if __name__ == '__main__':
    main(sys.argv[1:])

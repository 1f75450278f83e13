#!/usr/bin/env python3
# Summarises an ncu raw CSV of a decode run (ncu --metrics gpu__time_duration.sum,... then
# ncu --import REP --csv --page raw): every kernel of the last decode step (from its embed
# kernel through argmax) with its duration, grid and DRAM bytes, their sum, and the same per
# kernel kind averaged over the steps from the SKIP-th embed on. Usage: ncu_step.py FILE.csv [SKIP]
import csv
import sys


def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return 0.0


def main(path, skip):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    hi = next(i for i, r in enumerate(rows) if "ID" in r and "Kernel Name" in r)
    head = rows[hi]
    col = {n: head.index(n) for n in head}
    data = [r for r in rows[hi + 1:] if r[col["ID"]].strip().isdigit()]
    units = rows[hi + 1] if not rows[hi + 1][col["ID"]].strip() else [""] * len(head)
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}

    def get(r, name, default=""):
        return r[col[name]] if name in col else default

    def val(r, name, default_unit):  # in us or MB, from the units row
        if name not in col:
            return 0.0
        return num(r[col[name]]) * scale.get(units[col[name]] or default_unit, 1.0)

    ks = []
    for r in data:
        name = get(r, "Kernel Name").split("(")[0]
        if name.startswith("void "):
            name = name[5:]
        ks.append({"name": name[:44], "grid": get(r, "launch__grid_size", get(r, "Grid Size")),
                   "regs": get(r, "launch__registers_per_thread"),
                   "us": val(r, "gpu__time_duration.sum", "ns"),
                   "mb": val(r, "dram__bytes_read.sum", "byte")})
    starts = [i for i, k in enumerate(ks) if k["name"].startswith("embed")]
    if not starts:
        print("no embed kernel found")
        return 1
    last = ks[starts[-1]:]
    print("last decode step: %d kernels" % len(last))
    print("  %-44s %8s %5s %9s %9s %8s" % ("kernel", "grid", "regs", "us", "DRAM MB", "GB/s"))
    tot = 0.0
    mb = 0.0
    for k in last:
        tot += k["us"]
        mb += k["mb"]
        gbs = k["mb"] / k["us"] * 1e3 if k["us"] > 0 else 0
        print("  %-44s %8s %5s %9.2f %9.2f %8.0f" % (k["name"], k["grid"], k["regs"], k["us"],
                                                      k["mb"], gbs))
    print("sum of kernel durations: %.1f us, DRAM read %.1f MB (%.0f GB/s over the sum)" %
          (tot, mb, mb / tot * 1e3 if tot else 0))
    # kinds (name, grid) over the steps from embed number `skip` on (the decode steps)
    agg = {}
    n_steps = 0
    for a, b in zip(starts[skip:], starts[skip + 1:] + [len(ks)]):
        n_steps += 1
        for k in ks[a:b]:
            e = agg.setdefault((k["name"], k["grid"]), [0, 0.0, 0.0])
            e[0] += 1
            e[1] += k["us"]
            e[2] += k["mb"]
    print("per kind over %d steps (calls/step, us/call, us/step, MB/call):" % n_steps)
    for (name, grid), (n, us, m) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print("  %-44s %8s %6.2f %8.2f %8.1f %8.2f" % (name, grid, n / n_steps, us / n,
                                                     us / n_steps, m / n))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))

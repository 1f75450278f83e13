#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
# Where a mesh step's time goes, from MM_MESH_TRACE files (common/include/mm/mesh_trace.h):
#     python3 kernels/cuda/bench/mesh_trace.py PREFIX [--skip N]
# reads PREFIX.<role>.<pid> of every daemon, groups the daemons of one mesh by time (each router
# file and the shard/owner files whose events fall inside its span), and for each mesh prints
# the mean time between consecutive events of a step, in time order over all its daemons
# (e.g. "L1 router.a_send -> attention.rx" is the hop of layer 1's rows to the shard: the
# receiver's wake-up and the descriptor), over the steps whose event sequence is the most
# common one (decode steps of one shape), skipping the first N steps (default 3: prefill).
# With MM_MESH_TRACE_GPU=1 (PREFIX.g-<role>.<pid>: GPU stamps) it also prints the GPU time line:
# each stage's time on the GPU and the GPU's time between the daemons' stages. With a gateway's
# file (PREFIX.gateway.<pid>: its step calls) it prints the gateway's cycle: its hops around each
# step call and the period between results, beside the control server's and router's stamps.
import collections
import glob
import os
import sys


def load(path):
    ev = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) != 6 or p[0] != "T":
                continue
            ev.append((float(p[5]), p[1], int(p[2]), int(p[3]), p[4]))
    return ev


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__ if __doc__ else "usage: mesh_trace.py PREFIX [--skip N]")
    prefix = sys.argv[1]
    skip = int(sys.argv[sys.argv.index("--skip") + 1]) if "--skip" in sys.argv else 3
    files = {f: load(f) for f in sorted(glob.glob(prefix + ".*"))}
    files = {f: e for f, e in files.items() if e}
    routers = sorted((f for f in files if ".router." in f), key=lambda f: files[f][0][0])
    for rf in routers:
        rev = files[rf]
        t0, t1 = rev[0][0], rev[-1][0]
        ev = list(rev)
        peers = []
        for f, e in files.items():
            if f == rf or ".router." in f:
                continue
            inside = [x for x in e if t0 <= x[0] <= t1]
            if inside:
                peers.append(f.rsplit(".", 2)[-2])
                ev += inside
        ev.sort()
        steps = collections.OrderedDict()
        for x in ev:
            steps.setdefault(x[2], []).append(x)
        rsteps = [s for s in steps if any(x[1] == "router" and x[4] == "start" for x in steps[s])]
        rsteps = rsteps[skip:]
        seqs = {}
        for s in rsteps:
            xs = steps[s]
            a = [i for i, x in enumerate(xs) if x[1] == "router" and x[4] == "start"]
            b = [i for i, x in enumerate(xs) if x[1] == "router" and x[4] == "picked"]
            if not a or not b:
                continue
            xs = xs[a[0]:b[-1] + 1]
            seqs[s] = xs
        if not seqs:
            continue
        # the step's rows ("rows" event, its layer field) and the router's work around the
        # layers: plan in -> start (checks, links, drafting), picked -> reply (results)
        rows, pre, post = {}, {}, {}
        for st, xs in steps.items():
            d = {x[4]: x for x in xs if x[1] == "router" and x[3] < 0 or x[4] == "rows"}
            if "rows" in d:
                rows[st] = d["rows"][3]
            if "run" in d and "start" in d:
                pre[st] = d["start"][0] - d["run"][0]
            if "picked" in d and "reply" in d:
                post[st] = d["reply"][0] - d["picked"][0]
        shapes = sorted({rows.get(st, 0) for st in seqs})
        if len(shapes) > 1:
            big = {st: xs for st, xs in seqs.items() if rows.get(st, 0) > 1}
            one = {st: xs for st, xs in seqs.items() if rows.get(st, 0) <= 1}
            groups = [("1 row", one), ("more rows", big)]
        else:
            groups = [("%s rows" % (shapes[0] if shapes else "?"), seqs)]
        for gname, gseqs in groups:
            if gseqs:
                report(rf, peers, gname, gseqs, pre, post)


def report(rf, peers, gname, seqs, pre, post):
    if True:
        # per layer, the chain's points in order (several shards/owners: the last of them)
        chain = [("router", "prev"), ("router", "a_send"), ("attention", "rx"),
                 ("attention", "enq"), ("attention", "tx"), ("router", "a_back"),
                 ("router", "gate"), ("router", "o_send"), ("expert", "crx"), ("expert", "rx"),
                 ("expert", "enq"), ("expert", "tx"), ("router", "o_back"), ("router", "comb")]
        seg = collections.defaultdict(list)
        per_layer = collections.defaultdict(list)
        tot, tail, head, tail_enq = [], [], [], []
        for s, xs in seqs.items():
            pts = collections.defaultdict(float)
            for t, role, _, layer, tag in xs:
                k = (role, layer, tag)
                pts[k] = max(pts[k], t)
            first = xs[0][0]
            tot.append(xs[-1][0] - first)
            prev = pts.get(("router", -1, "embed"), first)
            head.append(prev - first)
            layers = sorted({x[3] for x in xs if x[3] >= 0})
            for L in layers:
                last = prev
                for role, tag in chain[1:]:
                    t = pts.get((role, L, tag))
                    if t is None:
                        continue
                    seg[(role, tag)].append(t - last)
                    last = t
                per_layer[L].append(last - prev)
                prev = last
            tail.append(xs[-1][0] - prev)
            hd = pts.get(("router", -1, "head"))
            if hd is not None:
                tail_enq.append(hd - prev)
        n = len(tot)
        mean = lambda v: sum(v) / len(v) if v else 0.0
        print("== %s (+ %s), steps of %s: %d steps; router start -> picked %.1f us (mean)" %
              (rf, ", ".join(sorted(peers)), gname, n, mean(tot)))
        pv = [pre[st] for st in seqs if st in pre]
        qv = [post[st] for st in seqs if st in post]
        if pv and qv:
            print("   router before the layers (plan in -> start) %.1f us, after (picked -> reply) "
                  "%.1f us" % (mean(pv), mean(qv)))
        starts = {s: xs[0][0] for s, xs in seqs.items()}
        picks = {s: xs[-1][0] for s, xs in seqs.items()}
        ks = sorted(starts)
        gaps = sorted(starts[b] - picks[a] for a, b in zip(ks, ks[1:]) if b == a + 1)
        if gaps:
            print("   between steps (reply, client, next plan): median %.1f us" % gaps[len(gaps) // 2])
        print("   %8.1f us  start -> embed" % mean(head))
        nl = max(len(per_layer), 1)
        for role, tag in chain[1:]:
            v = seg.get((role, tag))
            if v:
                print("   %8.1f us  per layer, up to %s.%s (sum over layers %.1f)" %
                      (sum(v) / n / nl, role, tag, sum(v) / n))
        for L in sorted(per_layer):
            print("   %8.1f us  layer %d in all" % (mean(per_layer[L]), L))
        print("   %8.1f us  last layer -> picked (h drain or LM head, argmax, read-back)" % mean(tail))
        if tail_enq:
            print("   %8.1f us  of it: last layer -> LM head enqueued (the rest: waiting for the "
                  "GPU to finish the step, argmax, picks)" % mean(tail_enq))


def load_g(path):
    ev = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) != 6 or p[0] != "G":
                continue
            ev.append((float(p[5]), p[1], int(p[2]), int(p[3]), p[4]))
    return ev


def gpu_report(prefix, skip):
    """The GPU time line (MM_MESH_TRACE_GPU=1: PREFIX.g-<role>.<pid>, the device's global timer
    when each daemon's stream reached a stamp): per layer, how long each stage ran on the GPU and
    how long the GPU took from one daemon's stage to the next's (the hop on the GPU: the copy
    into the peer's ring, the event, the peer's stream wait, and any wait for the peer's host to
    enqueue), then the tail (last combine -> LM head done) and the gap between steps."""
    files = {f: load_g(f) for f in sorted(glob.glob(prefix + ".g-*"))}
    files = {f: e for f, e in files.items() if e}
    routers = [f for f in files if ".g-router." in f]
    peers_ev = [x for f, e in files.items() if f not in routers for x in e]
    chain = [("router", "a_send"), ("attention", "rx"), ("attention", "enq"),
             ("router", "a_back"), ("router", "o_send"), ("expert", "rx"), ("expert", "enq"),
             ("router", "o_back"), ("router", "comb")]
    names = {("router", "a_send"): "router: rows copied to the shard's ring",
             ("attention", "rx"): "hop to the shard (its stream passes the wait)",
             ("attention", "enq"): "shard: attention on the GPU",
             ("router", "a_back"): "hop back (reply copy, router's wait)",
             ("router", "o_send"): "router: norm, gate, plan, split, copy to owners",
             ("expert", "rx"): "hop to the owner",
             ("expert", "enq"): "owner: grouped products on the GPU",
             ("router", "o_back"): "hop back (reply copy, router's wait)",
             ("router", "comb"): "router: pick, combine"}
    for rf in sorted(routers, key=lambda f: files[f][0][0]):
        rev = files[rf]
        t0, t1 = rev[0][0], rev[-1][0]
        rsteps = {x[2] for x in rev}
        ev = list(rev) + [x for x in peers_ev if x[2] in rsteps and t0 - 1e5 <= x[0] <= t1 + 1e5]
        steps = collections.defaultdict(dict)
        for t, role, st, layer, tag in ev:
            k = (role, layer, tag)
            steps[st][k] = max(steps[st].get(k, 0.0), t)
        order = sorted(steps)
        # the step's rows from the router's host trace (same pid): 1 row vs more, reported apart
        rows = {}
        tf = rf.replace(".g-router.", ".router.")
        for x in (load(tf) if os.path.exists(tf) else []):
            if x[4] == "rows":
                rows[x[2]] = x[3]
        ok = [st for st in order[skip:] if ("router", -1, "head") in steps[st] and
              ("router", -1, "embed") in steps[st]]
        for gname, full in (("1 row", [st for st in ok if rows.get(st, 1) <= 1]),
                            ("more rows", [st for st in ok if rows.get(st, 1) > 1])):
            if full:
                gpu_group(rf, gname, steps, order, set(full), chain, names)


def gpu_group(rf, gname, steps, order, full, chain, names):
    seg = collections.defaultdict(list)
    tail, span, gap = [], [], []
    prev_head = None
    for st in order:
        pts = steps[st]
        if st not in full:
            prev_head = pts.get(("router", -1, "head"), prev_head)
            continue
        emb, head = pts[("router", -1, "embed")], pts[("router", -1, "head")]
        if prev_head is not None and st - 1 in full:
            gap.append(emb - prev_head)
        prev_head = head
        span.append(head - emb)
        layers = sorted({k[1] for k in pts if k[1] >= 0})
        last = emb
        for L in layers:
            for k in chain:
                t = pts.get((k[0], L, k[1]))
                if t is None:
                    continue
                seg[k].append(t - last)
                last = t
        tail.append(head - last)
    n = len(full)
    mean = lambda v: sum(v) / len(v) if v else 0.0
    nl = max(len({k[1] for st in full for k in steps[st] if k[1] >= 0}), 1)
    print("== GPU time line (%s), steps of %s: %d steps, embed done -> LM head done "
          "%.1f us (mean)" % (rf, gname, n, mean(span)))
    if gap:
        gs = sorted(gap)
        print("   %8.1f us  between steps: LM head done -> next step's embed done (median; "
              "argmax, read-back, picks, reply, next plan, embed)" % gs[len(gs) // 2])
    for k in chain:
        v = seg.get(k)
        if v:
            print("   %8.1f us  per layer  %-8s %-4s %s" % (sum(v) / n / nl, k[0], k[1],
                                                          names[k]))
    print("   %8.1f us  last combine -> LM head done (copy_rows, final norm, head)" %
          mean(tail))


def med(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def gateway_report(prefix, skip):
    files = {f: load(f) for f in sorted(glob.glob(prefix + ".*"))
             if not os.path.basename(f).startswith(os.path.basename(prefix) + ".g-")}
    gws = [f for f in files if ".gateway." in f and files[f]]
    for gf in gws:
        ev = files[gf]
        t0, t1 = ev[0][0], ev[-1][0]
        for f, e in files.items():
            if f != gf and (".ctl." in f or ".router." in f):
                ev = ev + [x for x in e if t0 <= x[0] <= t1]
        st = collections.defaultdict(dict)
        for t, role, step, layer, tag in ev:
            if layer < 0:
                k = (role, tag)
                st[step][k] = max(st[step].get(k, t), t) if tag != "queue" else t
        steps = sorted((s for s in st if ("gateway", "recv") in st[s]),
                       key=lambda s: st[s][("gateway", "recv")])[skip:]
        if len(steps) < 2:
            continue
        hops = [("gateway", "queue"), ("gateway", "send"), ("gateway", "sent"), ("ctl", "rx"),
                ("ctl", "unpacked"), ("router", "run"), ("router", "taken"), ("router", "start"),
                ("router", "picked"), ("router", "reply"), ("ctl", "sent"), ("gateway", "recv"),
                ("gateway", "done")]
        print("== %s: %d step calls (the first %d skipped); medians over the calls" %
              (gf, len(steps), skip))
        seg = collections.defaultdict(list)
        for s in steps:
            d = st[s]
            pts = [(k, d[k]) for k in hops if k in d]
            for (ka, ta), (kb, tb) in zip(pts, pts[1:]):
                seg[(ka, kb)].append(tb - ta)
        for (ka, kb), v in sorted(seg.items(), key=lambda kv: hops.index(kv[0][0])):
            if len(v) * 2 >= len(steps):
                print("   %8.1f us  %s.%s -> %s.%s" % (med(v), ka[0], ka[1], kb[0], kb[1]))
        rec = [st[s][("gateway", "recv")] for s in steps]
        print("   %8.1f us  between results (the gateway's period)" %
              med([b - a for a, b in zip(rec, rec[1:])]))


if __name__ == "__main__":
    main()
    gateway_report(sys.argv[1], int(sys.argv[sys.argv.index("--skip") + 1])
                   if "--skip" in sys.argv else 3)
    if glob.glob(sys.argv[1] + ".g-*"):
        gpu_report(sys.argv[1], int(sys.argv[sys.argv.index("--skip") + 1])
                   if "--skip" in sys.argv else 3)

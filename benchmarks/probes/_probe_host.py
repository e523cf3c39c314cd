#!/usr/bin/env python3
"""Host time per call of the held-views loops, with the GPU held busy (a long sleep first, so no
call waits for it): replay alone, 5 graphs in turn + the user's view, gt same / held / views, each
with the fast path's direct C replay and without. CUDA only.

    python benchmarks/probes/_probe_host.py rl        # or ensemble, any bench.py row name

See benchmarks/NOTES.md, "Held views: host time per call" (2026-11-24).
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
import torch
from benchmarks.workloads import make_workloads
import gtransform as gt
import gtransform._fastpath as FP
from _gputime import capture_graphs
dev = torch.device("cuda")
w = next(x for x in make_workloads(dev) if x.name == sys.argv[1])
args = w.make_args(dev)
fn = w.fn
graphs, outs = capture_graphs(fn, args, 5)
fs = {m: gt.graphify(fn) for m in ("same", "held", "views")}
saved = FP._GRAPH_REPLAY
FP._GRAPH_REPLAY = None
fs.update({m + "_old": gt.graphify(fn) for m in ("same", "held", "views")})
def first(o):
    while not isinstance(o, torch.Tensor):
        o = o[0] if isinstance(o, (tuple, list)) else next(iter(o.values()))
    return o
def run(mode, n):
    hist, out = [], None
    if mode.startswith("torch"):
        K = 1 if mode == "torch1" else 5
        for i in range(n):
            graphs[i % K].replay()
            if mode == "torch5v":
                hist.append(first(outs[i % K]).unsqueeze(0))
                if len(hist) > 4: del hist[0]
        return None
    f = fs[mode]
    base = mode.split("_")[0]
    for _ in range(n):
        out = f(*args)
        if base == "same":
            out = None
        elif base == "views":
            hist.append(first(out).unsqueeze(0))
            if len(hist) > 4: del hist[0]
    return out
modes = ["torch1", "torch5v", "same", "held", "views", "same_old", "held_old", "views_old"]
for m in modes:
    if m.endswith("_old"): FP._GRAPH_REPLAY = None
    else: FP._GRAPH_REPLAY = saved
    run(m, 30); torch.cuda.synchronize()
T = {m: [] for m in modes}
N = 150
for r in range(15):
    k = r % len(modes)
    for m in modes[k:] + modes[:k]:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1.5e8))  # ~80 ms of GPU: the host never waits
        t0 = time.perf_counter(); o = run(m, N); t = time.perf_counter() - t0
        torch.cuda.synchronize(); del o
        T[m].append(t / N * 1e6)
for m in modes:
    print(f"{sys.argv[1]} host {m:10s} median {statistics.median(T[m]):5.1f} min {min(T[m]):5.1f} us/call")

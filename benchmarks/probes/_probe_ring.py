#!/usr/bin/env python3
"""Does replaying several CUDA graphs in turn cost GPU or host time? Pure torch (1, 2, 5, 6 graphs of
one function, each in its own pool, or all in one pool so that their intermediates share memory)
and graphify same / held / views, on the RL, MLP-gradient and ensemble rows (or those named).
"host" is wall time per call with one synchronisation at the end.
CUDA only: `python benchmarks/probes/_probe_ring.py [row ...]`. See benchmarks/NOTES.md (2026-11-24).
"""
import os, sys, time, statistics
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
import torch
from benchmarks.timing import a_view
from benchmarks.workloads import make_workloads
import gtransform as gt
from _gputime import capture_graphs

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
wl = {w.name: w for w in make_workloads(dev)}

def gpu_and_host(step, n=200):
    """(host us per call with one sync at the end, GPU us per call with the host ahead)"""
    for _ in range(20): step()
    torch.cuda.synchronize()
    hs, gs = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): step()
        torch.cuda.synchronize()
        hs.append((time.perf_counter() - t0) / n * 1e6)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e8))
        e0.record()
        for _ in range(n): step()
        e1.record(); e1.synchronize()
        gs.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(hs), statistics.median(gs)

names = sys.argv[1:] or ["rl", "mlp_grad", "ensemble"]
for name in names:
    w = wl[name]
    args = w.make_args(dev)
    fn = w.fn
    # pure torch: K graphs, each in a private pool (or all in one pool), replayed in turn
    for shared in (False, True):
        graphs, _ = capture_graphs(fn, args, 6, shared=shared)
        where = "one pool" if shared else "private pools"
        for K in ((1, 2, 5, 6) if not shared else (2, 5)):
            it = [0]
            def step():
                graphs[it[0] % K].replay(); it[0] += 1
            h, gg = gpu_and_host(step)
            print(f"{name} torch {K} graphs in turn ({where}): host {h:.1f} us/call, GPU {gg:.1f} us/call", flush=True)
        del graphs
    f = gt.graphify(fn)
    for mode in ("same", "held", "views"):
        st = {"out": None, "hist": []}
        def step():
            out = f(*args)
            if mode == "same":
                return
            st["out"] = out
            if mode == "views":
                st["hist"].append(a_view(out))
                if len(st["hist"]) > 4: del st["hist"][0]
        h, gg = gpu_and_host(step)
        print(f"{name} graphify {mode}: host {h:.1f} us/call, GPU {gg:.1f} us/call", flush=True)
        st.clear()
    del f

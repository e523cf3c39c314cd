#!/usr/bin/env python3
"""Is the host's speed steady? The RL row's views loop (host-bound within ~10%), per-call wall time
in blocks of 100 calls over 3 s, idle and right after jax.jit, torch.compile and fuse=True work.
CUDA only: `python benchmarks/probes/_probe_noise.py`. See benchmarks/NOTES.md (2026-11-24, host bursts).
"""
import sys, time, statistics, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
import torch
from benchmarks.workloads import make_workloads
import gtransform as gt
dev = torch.device("cuda")
w = {w.name: w for w in make_workloads(dev)}["rl"]
args = w.make_args(dev)
f = gt.graphify(w.fn)
hist = []
def block(n=100):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
        hist.append(out[0].unsqueeze(0))
        if len(hist) > 4: del hist[0]
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6
def trace(tag, secs=3.0):
    t_start = time.perf_counter(); pts = []
    while time.perf_counter() - t_start < secs:
        t = time.perf_counter() - t_start
        pts.append((t, block()))
    buckets = [(0, .25), (.25, .5), (.5, 1), (1, 1.5), (1.5, 2), (2, 3)]
    print(tag, " ".join(f"[{a}-{b}s] {statistics.median([v for t, v in pts if a <= t < b] or [0]):.1f}" for a, b in buckets), flush=True)
for _ in range(100): block()
trace("idle        ")
import jax, jax.numpy as jnp
a = jax.device_put(jnp.ones((64, 64)))
for i in range(2):
    jf = jax.jit(lambda a, i=i: (a @ a) + i)
    for _ in range(300): jax.block_until_ready(jf(a))
    trace(f"after jax {i}  ")
for i in range(2):
    c = torch.compile(lambda a, i=i: (a @ a).relu() + i, mode="reduce-overhead")
    x = torch.randn(64, 64, device=dev)
    for _ in range(300): c(x)
    torch.cuda.synchronize()
    trace(f"after comp {i} ")
for i in range(2):
    gf = gt.graphify(lambda a, i=i: (a @ a).relu() * (2 + i), fuse=True)
    x = torch.randn(64, 64, device=dev)
    for _ in range(300): gf(x)
    torch.cuda.synchronize()
    trace(f"after fuse {i} ")
trace("idle again  ")

#!/usr/bin/env python3
"""Llama decode step: fuse=True against torch.compile(mode="reduce-overhead"), kernel by kernel.

Both built from the same fresh model and cache (llama_factory, benchmarks/workloads/language.py), warmed up, then: per-call
time in interleaved blocks (10 rounds of 300 calls each, median), and one torch.profiler
trace of 20 calls each: kernels per call, GPU time per call, the kernels by total time.
CUDA only: `python benchmarks/probes/_probe_llama.py`. See benchmarks/NOTES.md (thirteenth session).
"""
import os, sys, time, statistics, tempfile, collections
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="probe-llama-"))
import torch
from benchmarks.workloads.language import llama_args_factory, llama_factory
import gtransform as gt

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
make = llama_args_factory()
args = make(dev)
cols = {}
with torch.no_grad():
    inst = llama_factory(dev)
    cols["compile"] = torch.compile(inst.fn, mode="reduce-overhead")
    inst2 = llama_factory(dev)
    cols["fused"] = gt.graphify(inst2.fn, fuse=True)
    inst3 = llama_factory(dev)
    cols["gt"] = gt.graphify(inst3.fn)
    for f in cols.values():
        for _ in range(8):
            f(*args)
    torch.cuda.synchronize()

    def block(f, n=300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f(*args)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    res = collections.defaultdict(list)
    for _ in range(10):
        for k, f in cols.items():
            res[k].append(block(f))
    for k, v in res.items():
        print(f"{k:8s} median {statistics.median(v):7.1f} us  min {min(v):7.1f}  max {max(v):7.1f}")

    from torch.profiler import profile, ProfilerActivity
    for k in ("compile", "fused"):
        f = cols[k]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f(*args)
            torch.cuda.synchronize()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tot = sum(e.device_time for e in kern) if kern and hasattr(kern[0], "device_time") else sum(e.cuda_time for e in kern)
        print(f"\n{k}: {len(kern) / 20:.1f} kernels per call, {tot / 20:.1f} us GPU per call")
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in kern:
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            by[e.name][0] += 1
            by[e.name][1] += t
        for name, (n, t) in sorted(by.items(), key=lambda x: -x[1][1])[:25]:
            print(f"  {n / 20:5.1f}x {t / 20:7.2f} us  {name[:110]}")

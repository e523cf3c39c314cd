"""Probe: GPU time of copying each workload's input leaves, torch._foreach_copy_ vs one
copy_ per leaf (each captured in a CUDA graph, timed by replay with CUDA events).
Run on the GPU machine: python3 benchmarks/_probe_copy.py (see NOTES.md, "First runs")."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def gpu_time(fn, n=200):
    """Median µs per replay of a graph that captured fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        for _ in range(n):
            g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return sorted(ts)[2]


def main():
    dev = torch.device("cuda")
    for name in ("mlp", "transformer", "dict32", "rl"):
        w = next(x for x in bench.make_workloads(dev) if x.name == name)
        src = bench.tree_tensors(w.make_args(dev))
        dst = [t.clone() for t in src]
        mb = sum(t.numel() * t.element_size() for t in src) / 2**20
        f = gpu_time(lambda d=dst, s=src: torch._foreach_copy_(d, s))
        p = gpu_time(lambda d=dst, s=src: [a.copy_(b) for a, b in zip(d, s)])
        print(f"{name:12s} {len(src):3d} leaves {mb:6.2f} MiB  GPU us: _foreach_copy_ {f:6.1f}  per-leaf copy_ {p:6.1f}")


if __name__ == "__main__":
    main()

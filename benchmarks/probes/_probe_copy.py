"""Probe: GPU time of copying each workload's input leaves, torch._foreach_copy_ vs one
copy_ per leaf (each captured in a CUDA graph, timed by replay with CUDA events).
Run on the GPU machine: python3 benchmarks/probes/_probe_copy.py (see NOTES.md, "First runs")."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from _gputime import gpu_time  # noqa: E402

from benchmarks.trees import tree_tensors  # noqa: E402
from benchmarks.workloads import make_workloads  # noqa: E402


def main():
    dev = torch.device("cuda")
    for name in ("mlp", "transformer", "dict32", "rl"):
        w = next(x for x in make_workloads(dev) if x.name == name)
        src = tree_tensors(w.make_args(dev))
        dst = [t.clone() for t in src]
        mb = sum(t.numel() * t.element_size() for t in src) / 2**20
        f = gpu_time(lambda d=dst, s=src: torch._foreach_copy_(d, s))
        p = gpu_time(lambda d=dst, s=src: [a.copy_(b) for a, b in zip(d, s)])
        print(f"{name:12s} {len(src):3d} leaves {mb:6.2f} MiB  GPU us: _foreach_copy_ {f:6.1f}  per-leaf copy_ {p:6.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""First three calls of the torchvision resnet18 functional training step (the floor probe's `train` row:
`torch.func.grad` through `functional_call`, SGD, new parameters fed back, batch 8), cold compile caches:
`python benchmarks/probes/_probe_train_first.py fused|compile|default`. Run each in its own process.
Issue #36 item 4: fused first calls no slower than torch.compile's. See benchmarks/NOTES.md.
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
d = tempfile.mkdtemp()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
os.environ["TRITON_CACHE_DIR"] = d + "/triton"

import torch  # noqa: E402

import gtransform as gt  # noqa: E402
from benchmarks.probes._probe_floor import resnet18_step  # noqa: E402

which = sys.argv[1]
dev = "cuda" if len(sys.argv) < 3 else sys.argv[2]
step, params, buffers, x, y = resnet18_step(dev)

f = {"fused": lambda: gt.graphify(step, fuse=True), "default": lambda: gt.graphify(step),
     "compile": lambda: torch.compile(step, mode="reduce-overhead")}[which]()
ps = {k: v.clone() for k, v in params.items()}
ref = {k: v.clone() for k, v in params.items()}
times = []
for _ in range(3):
    t = time.perf_counter()
    ps = f(ps, buffers, x, y)
    if dev == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
    if which == "compile":
        ps = {k: v.clone() for k, v in ps.items()}
    ref = step(ref, buffers, x, y)
err = max((ps[k] - ref[k]).abs().max().item() for k in ps)
print(f"resnet18 functional train step, {which}: first 3 calls " + " / ".join(f"{t:.2f}" for t in times)
      + f" s (total {sum(times):.2f}); max |difference| from eager after 3 steps {err:.1e}", flush=True)

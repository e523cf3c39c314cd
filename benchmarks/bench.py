#!/usr/bin/env python3
"""gtransform benchmark: per-call latency of gt.graphify next to its peers.

One process, one device. For every workload of DESIGN.md ("Performance
targets") plus two realistic ones, each method (column) is built, checked
against eager (relative error), warmed up and timed:

    eager                         the plain function
    graph_copy                    hand-written torch.cuda.CUDAGraph: copy_ each input into its
                                  static buffer, then replay (new input tensors every call)
    graph_replay                  the same graph, replay alone: the floor
    mgc                           torch.cuda.make_graphed_callables (same sample tensors each call)
    compile                       torch.compile(mode="reduce-overhead") (same tensors each call)
    jax                           jax.jit of the same function written with jax.numpy
    gt_same                       gt.graphify, the same input tensor objects every call
    gt_new                        gt.graphify, fresh input tensors every call (pre-made, rotating)
    gt_held                       gt_same, but the loop keeps `out = f(...)` alive across calls
                                  (what a user's loop does; exercises the poison-and-alias path)
    gt_views                      gt_held, and the loop also keeps a view of an output of each of
                                  the last 4 calls (`history.append(out[0])`, 4 kept)
    gt_fused                      gt.graphify(fn, fuse=True): inductor-fused kernels, recorded

Rows: the seven synthetic workloads, then seven real programs (resnet18,
a training step with Adam, GPT-2, GPT-2 as a module, a Llama decode step
with a StaticCache, per-sample gradients, an ensemble). Stateful rows build
a fresh copy of their program per column (Workload.factory).

Per-call time is the median over repeats of (wall time of N calls followed
by a device synchronisation) / N. Also recorded: the first call's time
(trace + record, or compile; every column compiles with cold caches, and the
fuse=True first call again with warm caches in a second process), memory,
and every variant's error against eager. float32 precision is the same for
every column (no TF32 unless --tf32).

Outputs in --out: results.json (every figure), results.md (tables),
results.png (per-call time per workload and method). The per-call table is
printed last on stdout.

Run `python benchmarks/bench.py --help` for the flags; benchmarks/README.md
for the exact commands. The code is the package `benchmarks` (its
__init__.py has the map); this file is only the command line's entry point.
"""

from __future__ import annotations

import os

# Before jax or torch are imported: keep jax from grabbing the GPU's memory,
# and make a fresh root for the compile caches (removed at exit): every cell
# then gets its own empty TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR under it
# (benchmarks.caches), so every column's first call is a cold compile.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile as _tempfile

    _INDUCTOR_DIR = _tempfile.mkdtemp(prefix="gt-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_DIR
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_INDUCTOR_DIR, "triton"))
else:
    _INDUCTOR_DIR = None

import atexit
import shutil
import sys

# The package and gtransform from this checkout, the checkout's gtransform before an installed one,
# so the numbers are this tree's. Run as a script, Python puts benchmarks/ itself on the path: its
# modules (core, timing, report...) are the package's, not top-level names, so that entry goes.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
# an A/B run measures another tree's gtransform with this harness: GT_BENCH_GTRANSFORM=DIR, the
# folder holding that gtransform/ (e.g. a `git worktree` of the commit before a change)
if os.environ.get("GT_BENCH_GTRANSFORM"):
    sys.path.insert(0, os.path.abspath(os.environ["GT_BENCH_GTRANSFORM"]))

from benchmarks.cli import main  # noqa: E402

if _INDUCTOR_DIR is not None:
    atexit.register(shutil.rmtree, _INDUCTOR_DIR, True)

if __name__ == "__main__":
    sys.exit(main(cache_root=_INDUCTOR_DIR))

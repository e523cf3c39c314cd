"""gtransform benchmark: per-call latency of gt.graphify next to its peers.

The command line of bench.py: parse the flags, set the precision, run the rows, measure
the warm-cache first calls in a second process, write and print the report.
"""

from __future__ import annotations

import argparse
import os
import sys
from time import perf_counter
from typing import Any, Dict, List, Optional

import torch

from . import caches
from .caches import compile_caches
from .core import METHODS
from .environment import environment, precision_text, set_precision
from .report import markdown, write_results
from .runner import HOST_ROWS, REAL_ROWS, run_row, select_workloads, warm_up_process
from .warm import measure_warm, warm_child


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="output directory (default: benchmarks/results)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter repeats")
    ap.add_argument("--only", default=None,
                    help="comma-separated workloads: chain, mlp, mlp_grad, dict32, transformer, rl, matmul, "
                         + ", ".join(REAL_ROWS + HOST_ROWS) + "; or 'synthetic' for the first seven, 'real' for the "
                         "next seven, 'host' for the programs that read values on the host (issue #35)")
    ap.add_argument("--methods", default=None, help="comma-separated methods (columns): " + ", ".join(METHODS))
    ap.add_argument("--cpu-compile", action="store_true", help="on the CPU, also run torch.compile (slow)")
    ap.add_argument("--tf32", action="store_true",
                    help="TF32 for float32 matmuls and convolutions in every column (default: off everywhere)")
    ap.add_argument("--warm-methods", default="gt_fused",
                    help="columns whose first call is measured again with warm compile caches, in a second "
                         "process reusing each cell's cache directory (default: gt_fused; '' for none)")
    ap.add_argument("--warm-child", default=None, help=argparse.SUPPRESS)  # internal: the second process
    opts = ap.parse_args(argv)
    opts.repeats = 3 if opts.quick else 9
    opts.target_s = 0.01 if opts.quick else 0.05  # wall time per repeat
    opts.min_calls = 3
    opts.max_calls = 200 if opts.quick else 5000
    return opts


def select_methods(spec: Optional[str]) -> Optional[List[str]]:
    """The columns to run, in METHODS' order; None (after saying why) for an unknown name."""
    methods = list(METHODS)
    if spec:
        want = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [s for s in want if s not in METHODS]
        if bad:
            print(f"unknown method(s) {bad}; choose from {list(METHODS)}", file=sys.stderr)
            return None
        methods = [m for m in METHODS if m in want]
    return methods


def main(argv: Optional[List[str]] = None, cache_root: Optional[str] = None) -> int:
    """Run the benchmark (bench.py's command line); ``cache_root``: see caches.use_root."""
    opts = parse_args(argv)
    opts.warm_timeout = 300
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("CUDA is not available: use --device cpu", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    precision = set_precision(opts.tf32)
    caches.use_root(cache_root)
    if opts.warm_child:
        return warm_child(opts, device)
    workloads = select_workloads(device, opts.only)
    methods = select_methods(opts.methods)
    if methods is None:
        return 2
    # columns no selected row runs (e.g. `--only host`: five columns) are left out of the run and its tables
    methods = [m for m in methods if any(w.only_methods is None or m in w.only_methods for w in workloads)]
    os.makedirs(opts.out, exist_ok=True)

    t_start = perf_counter()
    results: Dict[str, Any] = {"meta": environment(device, opts), "methods": METHODS, "methods_run": methods,
                               "workloads": {}}
    results["meta"]["precision"] = precision
    results["meta"]["compile_caches"] = (
        "cold per column: a new TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR for every cell, and dynamo's and "
        "inductor's in-memory caches cleared before it" if caches.root() is not None else
        f"shared, as set by the user: TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR')}")
    print(f"gtransform benchmark on {results['meta']['device_name']} (torch {torch.__version__}, "
          f"jax {results['meta']['jax']}), {'quick' if opts.quick else 'full'} run\n{precision_text(precision)}",
          flush=True)
    with compile_caches("process-warm-up"):
        results["process_warmup_s"] = warm_up_process(device, methods, opts)

    for w in workloads:
        results["workloads"][w.name] = run_row(w, device, methods, opts)

    results["meta"]["main_s"] = perf_counter() - t_start
    measure_warm(results, device, opts)
    results["meta"]["total_s"] = perf_counter() - t_start
    tables = markdown(results)
    json_path, md_path, png_path = write_results(results, tables, opts.out)
    print(f"\nwrote {json_path}, {md_path}, {png_path} in {results['meta']['total_s']:.0f} s\n", flush=True)
    print(tables["targets"] + "\n", flush=True)
    print(tables["first_call"] + "\n", flush=True)
    print(tables["per_call"], flush=True)
    return 0

"""Running the rows: each cell (row x column) built, checked and timed, one after another.

A cell never stops the run: an exception is recorded in the cell (its message and
traceback), the device synchronised, and the next cell runs. Every cell compiles with cold
caches (`benchmarks.caches`). The target columns (`timing.INTERLEAVED`) are only built and
checked here, then timed in turn once the row's other columns are done. One-time process
costs (loading inductor, jax, gtransform's tracer) are paid first by a tiny function and
reported apart.
"""

from __future__ import annotations

import argparse
import gc
import traceback
from time import perf_counter
from typing import Any, Dict, List, Optional

import numpy as np
import torch

import gtransform as gt

from .caches import compile_caches
from .context import Ctx, grad_mode
from .core import CUDA_ONLY, NotApplicable, Skipped, Workload, short_error
from .methods import METHOD_FNS, STATEFUL_METHOD_FNS
from .methods.jax_jit import import_jax, jax_device
from .timing import INTERLEAVED, calls_per_repeat, time_interleaved, time_method
from .workloads import HOST_ROWS, REAL_ROWS, make_workloads


def run_cell(method: str, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Build, check and time one method on one workload; never raises."""
    w = ctx.w
    if w.only_methods is not None and method not in w.only_methods:
        return {"status": "n/a", "reason": w.note or "not run on this row"}
    if not ctx.cuda and method in CUDA_ONLY:
        return {"status": "skipped", "reason": "CUDA only"}
    cell: Dict[str, Any] = {"tol": w.tol}
    if w.factory is not None and w.state_tol is not None:
        cell["state_tol"] = w.state_tol
    try:
        fns = STATEFUL_METHOD_FNS if w.factory is not None else METHOD_FNS
        # every column compiles with cold caches: its own new TorchInductor/Triton cache directory
        with compile_caches(f"{w.name}.{method}") as cache_dir, grad_mode(w):
            cell["cache_dir"] = cache_dir
            p = fns[method](ctx)
            cell["rel_err"] = max(p.errors) if p.errors else None
            cell["rel_errs"] = p.errors
            cell["check_ok"] = bool(p.errors) and all(e <= w.tol for e in p.errors)
            if p.state_error is not None:
                cell["state_rel_err"] = p.state_error
                cell["check_ok"] = cell["check_ok"] and p.state_error <= w.state_tol
            cell["first_call_s"] = p.first_call_s
            cell.update(p.extra)
            if method in INTERLEAVED:  # timed with the row's other such columns (time_interleaved)
                ctx.kept[method] = (p, calls_per_repeat(p, ctx, opts))
                cell["status"] = "pending"
            else:
                cell.update(time_method(p, ctx, opts))
                if p.after is not None:
                    cell.update(p.after())
                cell["status"] = "ok"
            del p
    except NotApplicable as e:
        return {"status": "n/a", "reason": str(e)}
    except Skipped as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:
        cell.update(status="error", error=short_error(e), traceback=traceback.format_exc(limit=8))
        try:
            ctx.sync()
        except Exception as e2:  # the device may be unusable now
            cell["sync_error"] = short_error(e2)
    return cell


def warm_up_process(device: torch.device, methods: List[str], opts: argparse.Namespace) -> Dict[str, float]:
    """One-time costs (library loading, first compile) kept out of the per-workload figures."""
    out: Dict[str, float] = {}
    x = torch.randn(64, 64, device=device)

    def timed(name, fn):
        try:
            t0 = perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[name] = perf_counter() - t0
        except Exception as e:
            out[name] = float("nan")
            print(f"[warm-up] {name}: {short_error(e)}", flush=True)

    timed("eager", lambda: [(x @ x).relu().sum() for _ in range(3)])
    if any(m.startswith("gt_") for m in methods):
        g = gt.graphify(lambda a: (a @ a).relu() + 1)
        timed("gtransform", lambda: [g(x) for _ in range(3)])
    if "gt_fused" in methods:  # loads inductor (and its compile workers) for the fused path
        gf = gt.graphify(lambda a: (a @ a).relu() * 2, fuse=True)
        timed("gtransform fuse=True", lambda: [gf(x) for _ in range(3)])
    if "compile" in methods and (device.type == "cuda" or opts.cpu_compile):
        c = torch.compile(lambda a: (a @ a).relu() + 1, mode="reduce-overhead")
        timed("torch.compile", lambda: [c(x) for _ in range(4)])
    if "jax" in methods:
        try:
            jax, jnp = import_jax()
            jd = jax_device(jax, device.type == "cuda")
            a = jax.device_put(np.ones((64, 64), np.float32), jd)
            timed("jax", lambda: jax.block_until_ready(jax.jit(lambda a: (a @ a) + 1)(a)))
        except Skipped:
            pass
    return out


def select_workloads(device: torch.device, only: Optional[str]) -> List[Workload]:
    workloads = make_workloads(device)
    names = [w.name for w in workloads]
    if not only:
        return workloads
    want: List[str] = []
    for s in only.split(","):
        s = s.strip()
        if s == "real":
            want += list(REAL_ROWS)
        elif s == "host":
            want += list(HOST_ROWS)
        elif s == "synthetic":
            want += [n for n in names if n not in REAL_ROWS and n not in HOST_ROWS]
        elif s:
            want.append(s)
    bad = [s for s in want if s not in names]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {names}")
    return [w for w in workloads if w.name in want]


def build_ctx(w: Workload, device: torch.device, opts: argparse.Namespace) -> tuple:
    """(Ctx, None), or (None, cell) where every cell of the row is that cell."""
    try:
        return Ctx(w, device, opts), None
    except Skipped as e:
        return None, {"status": "skipped", "reason": str(e)}
    except Exception as e:  # eager itself fails: every cell reports it
        return None, {"status": "error", "error": "eager reference failed: " + short_error(e),
                      "traceback": traceback.format_exc(limit=8)}


def print_cell(row: str, m: str, cell: Dict[str, Any]) -> None:
    if cell["status"] == "ok":
        st = f" state {cell['state_rel_err']:.1e}" if cell.get("state_rel_err") is not None else ""
        msg = (f"{cell['us_median']:9.1f} us/call (±{100 * cell['spread']:.0f}%, n={cell['calls_per_repeat']})  "
               f"first {cell['first_call_s'] if cell['first_call_s'] is not None else float('nan'):.3f} s  "
               f"err {cell['rel_err']:.1e}{st}{'' if cell['check_ok'] else ' CHECK FAILED'}"
               f"{'  (timed in turn)' if 'timed' in cell else ''}")
    else:
        msg = cell["status"] + ": " + str(cell.get("reason") or cell.get("error"))
    print(f"[{row:11s}] {m:12s} {msg}", flush=True)


def run_row(w: Workload, device: torch.device, methods: List[str], opts: argparse.Namespace) -> Dict[str, Any]:
    """Every column of one row: built, checked and timed (the target columns in turn, last)."""
    t_w = perf_counter()
    wr: Dict[str, Any] = {"title": w.title, "bf16": w.bf16, "cells": {}, "note": w.note}
    ctx, row_cell = build_ctx(w, device, opts)
    if ctx is None:
        wr["cells"] = {m: dict(row_cell) for m in methods}
        print(f"[{w.name}] {row_cell['status']}: {row_cell.get('reason') or row_cell.get('error')}", flush=True)
        return wr
    pending = []
    for m in methods:
        cell = run_cell(m, ctx, opts)
        wr["cells"][m] = cell
        if cell["status"] == "pending":
            pending.append(m)
        else:
            print_cell(w.name, m, cell)
    time_interleaved(ctx, wr, opts)
    for m in pending:
        print_cell(w.name, m, wr["cells"][m])
    wr["seconds"] = perf_counter() - t_w
    del ctx
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return wr

"""Timing: the per-call figure of every cell, and the columns timed in turn.

A repeat is `perf_counter` around N calls followed by one device synchronisation (jax:
`block_until_ready` on the last output), N chosen so that a repeat lasts about
`opts.target_s`; the figure is the median over repeats, in microseconds per call. The CPU
is never made to wait for the GPU inside a repeat, so a call costs about max(host time, GPU
time). Outputs are dropped as soon as a call returns, except where the column holds them
(`Prepared.hold`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import traceback
from time import perf_counter
from typing import Any, Callable, Dict, List, Optional

import torch

from .context import Ctx, Prepared, grad_mode
from .core import short_error


def a_view(out: Any) -> Optional[torch.Tensor]:
    """A view of the first tensor output (what `history.append(out[0])` keeps).

    Reached by indexing, as the user's loop would (`out[0]`, `out["k"]`): a generic pytree
    walk here would cost several us per call (32 leaves: ~10 us) and be charged to the
    "views" column.
    """
    while not isinstance(out, torch.Tensor):
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        elif isinstance(out, dict) and out:
            out = next(iter(out.values()))
        else:
            for leaf in torch.utils._pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    return leaf.unsqueeze(0)
            return None
    return out.unsqueeze(0)


def run_calls(call: Callable[[], Any], n: int, hold: Any) -> Any:
    if hold == "views":
        history: List[Any] = []
        out = None
        for _ in range(n):
            out = call()
            history.append(a_view(out))
            if len(history) > 4:
                del history[0]
        return out
    if hold:
        out = None
        for _ in range(n):
            out = call()
        return out
    for _ in range(n):
        call()
    return None


def calls_per_repeat(p: Prepared, ctx: Ctx, opts: argparse.Namespace) -> int:
    """Warm ``p`` up and choose N, the calls per timed repeat (about opts.target_s of wall time)."""
    sync = p.sync or ctx.sync
    for _ in range(3):  # warm-up
        sync(run_calls(p.call, 1, True))
    if p.hold == "views":  # the output generations the held views need, made before timing
        sync(run_calls(p.call, 8, p.hold))
    t0 = perf_counter()
    sync(run_calls(p.call, 3, p.hold))
    est = max((perf_counter() - t0) / 3, 1e-7)
    return int(min(max(opts.target_s / est, opts.min_calls), opts.max_calls))


def time_block(p: Prepared, ctx: Ctx, n: int) -> float:
    """Seconds per call of one repeat: N calls and one synchronisation."""
    sync = p.sync or ctx.sync
    sync(None)
    t0 = perf_counter()
    out = run_calls(p.call, n, p.hold)
    sync(out)
    return (perf_counter() - t0) / n


def timing_summary(times: List[float], n: int) -> Dict[str, Any]:
    med = statistics.median(times)
    return {
        "us_median": med * 1e6,
        "us_min": min(times) * 1e6,
        "us_max": max(times) * 1e6,
        "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
        "calls_per_repeat": n,
        "repeats": len(times),
        "times_us": [t * 1e6 for t in times],
    }


def time_method(p: Prepared, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Median seconds per call over repeats of N calls + one synchronisation."""
    n = calls_per_repeat(p, ctx, opts)
    gc.collect()
    return timing_summary([time_block(p, ctx, n) for _ in range(opts.repeats)], n)


INTERLEAVED = ("graph_replay", "gt_same", "gt_held", "gt_views")
"""Columns whose ratios are targets (gt ÷ floor, views ÷ held): timed in turn, repeat by repeat.

On the lent GPU hosts the host's speed drifts within a process: the same torch call
(`fill_`, `cudaLaunchKernel`) was seen to cost 2.5x more from one second to the next
(benchmarks/NOTES.md). Host-bound rows timed column after column then compare different
moments of the host, not the columns; timed in turn, each drift falls on all of them.

torch.compile's column is not among them: timed in turn with CUDA graphs replayed between
its calls, its CUDA graph trees left the process with an illegal memory access by the next
row (torch 2.11, H100; jax.jit and fuse=True in turn were fine; NOTES, thirteenth session).
Its ratio to fuse=True is timed one column after the other; `benchmarks/_probe_llama.py`
times the two in turn on the row where they are closest.
"""


def time_interleaved(ctx: Ctx, wr: Dict[str, Any], opts: argparse.Namespace) -> None:
    """Time the kept INTERLEAVED columns of one row in turn (see INTERLEAVED); fill their cells."""
    kept = ctx.kept
    if not kept:
        return
    names = [m for m in INTERLEAVED if m in kept]
    times: Dict[str, List[float]] = {m: [] for m in names}
    gc.collect()
    rounds = opts.repeats if opts.quick else max(opts.repeats, 15)
    with grad_mode(ctx.w):
        for r in range(rounds):
            k = r % len(names)
            for m in names[k:] + names[:k]:  # each column first in turn
                if m not in kept:
                    continue
                p, n = kept[m]
                try:
                    times[m].append(time_block(p, ctx, n))
                except Exception as e:
                    cell = wr["cells"][m]
                    cell.update(status="error", error=short_error(e), traceback=traceback.format_exc(limit=8))
                    del kept[m]
        for m in names:
            if m not in kept:
                continue
            p, n = kept.pop(m)
            cell = wr["cells"][m]
            cell.update(timing_summary(times[m], n))
            cell["timed"] = "in turn with " + ", ".join(x for x in names if x != m)
            if p.after is not None:
                cell.update(p.after())
            cell["status"] = "ok"
    kept.clear()

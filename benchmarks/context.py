"""One row's shared state (`Ctx`) and what a column hands the timer (`Prepared`).

`Ctx` makes the row's input sets and eager's reference results once (for a stateful row,
eager's results of `steps` calls in order and its state after them); every column is
checked against those before it is timed. A method builds its column from the `Ctx`,
checks it and returns a `Prepared`: the call to time, its errors, its first call's time and
its other figures (memory, what the first call included).

Stateful rows (Workload.factory): every column gets its own Instance, built from the same
initial state, and its check is the row's `steps` calls in order (input set k at call k),
each call's outputs against eager's call k, then the state against eager's. The timed calls
that follow go on updating that column's own state (training goes on; the decode step
rewrites its slot).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Dict, List, Optional

import torch

from .core import Instance, Workload
from .trees import f64_leaves, rel_err


def error_vs(w: Workload, out: Any, ref: List[torch.Tensor], args: tuple, device: torch.device) -> float:
    """The error of one call's result against eager's (converted at once:
    graphified outputs are valid only until the next call)."""
    leaves = f64_leaves(out, device)
    del out
    if w.check is not None:
        return w.check(leaves, ref, args)
    if len(leaves) != len(ref):
        return math.inf
    return max((rel_err(a, b) for a, b in zip(leaves, ref)), default=0.0)


class Ctx:
    """What every method of one workload shares."""

    def __init__(self, w: Workload, device: torch.device, opts: argparse.Namespace):
        self.w = w
        self.device = device
        self.opts = opts
        self.cuda = device.type == "cuda"
        self.ref_state: Optional[List[torch.Tensor]] = None
        self.init_state: Optional[List[torch.Tensor]] = None
        self.kept: Dict[str, Any] = {}  # method -> (Prepared, calls per repeat), see time_interleaved
        with grad_mode(w):
            if w.factory is None:
                torch.manual_seed(1234)
                self.sets = [w.make_args(device) for _ in range(max(3, w.n_sets))]
                self.sync()
                self.refs = [f64_leaves(w.fn(*s), device) for s in self.sets[:3]]
                self.sync()
            else:  # eager reference: `steps` calls of a fresh instance, in order
                torch.manual_seed(1234)
                self.sets = [w.make_args(device) for _ in range(max(3, w.steps))]
                inst = self.instance()
                if inst.state is not None:
                    self.init_state = f64_leaves(inst.state(), device)
                self.refs = [f64_leaves(inst.fn(*s), device) for s in self.sets]
                if inst.state is not None:
                    self.ref_state = f64_leaves(inst.state(), device)
                del inst
                self.sync()

    def instance(self) -> Instance:
        """A fresh copy of the workload's program, from the same initial state."""
        inst = self.w.factory(self.device)
        self.sync()
        return inst

    def state_err(self, inst: Instance) -> Optional[float]:
        """Eager vs this instance after the check steps: the relative error of
        the state's updates (or values), max over tensors."""
        if self.ref_state is None or inst.state is None:
            return None
        cur = f64_leaves(inst.state(), self.device)
        if len(cur) != len(self.ref_state):
            return math.inf
        if self.w.state_delta:
            return max(rel_err(c - i, r - i) for c, r, i in zip(cur, self.ref_state, self.init_state))
        return max(rel_err(c, r) for c, r in zip(cur, self.ref_state))

    def sync(self, _out: Any = None) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def err(self, out: Any, k: int, args: Optional[tuple] = None) -> float:
        return error_vs(self.w, out, self.refs[k], self.sets[k] if args is None else args, self.device)

    def mem(self) -> Optional[Dict[str, int]]:
        """Device memory in use now: garbage collected and unused cached blocks
        released first, so that "reserved" is what is really held (private
        graph pools of live recordings are never released by empty_cache)."""
        if not self.cuda:
            return None
        gc.collect()
        self.sync()
        torch.cuda.empty_cache()
        try:  # segments of private pools (CUDA graph pools), by address
            private = {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()
                       if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)}
        except Exception:
            private = None
        # the most allocated since the last mem() (the window a mem_delta spans), then a new window
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "private": private, "peak": peak}

    @staticmethod
    def mem_delta(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> Optional[Dict[str, int]]:
        """From ``a`` to ``b``: allocated and reserved change, new pool segments, and the peak between them above ``a``."""
        if a is None or b is None:
            return None
        out = {f"{k}_delta_bytes": b[k] - a[k] for k in ("allocated", "reserved")}
        if b.get("peak") is not None:
            out["peak_bytes"] = b["peak"] - a["allocated"]
        if a["private"] is not None and b["private"] is not None:
            out["new_pool_bytes"] = sum(v for addr, v in b["private"].items() if addr not in a["private"])
        return out


@dataclass
class Prepared:
    """A method, built, checked and warmed up: ready to time."""

    call: Callable[[], Any]
    errors: List[float]
    first_call_s: Optional[float] = None
    hold: Any = False  # True: keep each call's output alive until the next call; "views": and views of 4 calls
    sync: Optional[Callable[[Any], None]] = None  # default: the device synchronisation
    extra: Dict[str, Any] = field(default_factory=dict)
    after: Optional[Callable[[], Dict[str, Any]]] = None  # more figures, read after timing
    state_error: Optional[float] = None  # stateful rows: the state after the check steps vs eager's


def timed_first_call(ctx: Ctx, fn: Callable[[], Any]) -> tuple:
    ctx.sync()
    t0 = perf_counter()
    out = fn()
    ctx.sync(out)
    return out, perf_counter() - t0


def run_steps(ctx: Ctx, step: Callable[[int], Any], ks: Any, times_out: Optional[List[float]] = None) -> tuple:
    """Call step(k) for k in ks, comparing each output with eager's call k.
    Returns (errors, first call's seconds, second call's seconds); ``times_out``, if given,
    gets every call's seconds."""
    errors: List[float] = []
    times: List[float] = [] if times_out is None else times_out
    for k in ks:
        out, t = timed_first_call(ctx, lambda k=k: step(k))
        times.append(t)
        errors.append(ctx.err(out, k))
        del out
    return errors, (times[0] if times else None), (times[1] if len(times) > 1 else None)


def grad_mode(w: Workload) -> Any:
    return torch.no_grad() if w.no_grad else contextlib.nullcontext()

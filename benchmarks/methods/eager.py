"""The eager column: the plain function, and the reference every other column is checked
against (made once per row by `Ctx`). On CUDA it also measures eager's transient memory."""

from __future__ import annotations

import gc
from typing import Any, Dict

import torch

from ..context import Ctx, Prepared, run_steps, timed_first_call


def method_eager(ctx: Ctx) -> Prepared:
    w, args = ctx.w, ctx.sets[0]
    extra: Dict[str, Any] = {}
    out, first = timed_first_call(ctx, lambda: w.fn(*args))
    errors = [ctx.err(out, 0)]
    del out
    errors.append(ctx.err(w.fn(*ctx.sets[1]), 1))
    if ctx.cuda:  # transient memory of one call, beyond its inputs
        ctx.sync()
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = w.fn(*args)
        ctx.sync()
        extra["memory"] = {"peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
                           "output_bytes": torch.cuda.memory_allocated() - base}
        del out
    return Prepared(lambda: w.fn(*args), errors, first, extra=extra)


def st_eager(ctx: Ctx) -> Prepared:
    inst = ctx.instance()
    sets = ctx.sets
    errors, first, _ = run_steps(ctx, lambda k: inst.fn(*sets[k]), range(len(sets)))
    a0 = sets[0]
    return Prepared(lambda: inst.fn(*a0), errors, first, state_error=ctx.state_err(inst))

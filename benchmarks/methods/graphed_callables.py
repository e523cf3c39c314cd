"""The `torch.cuda.make_graphed_callables` column.

Called with the same sample tensors every call (it writes into them, so the column works
on its own copy). On a stateful row with a module (`Instance.mgc_module`) the module's
forward (and backward) is graphed in place and the rest of the step stays eager: torch's
partial-network recipe.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from ..context import Ctx, Prepared, run_steps, timed_first_call
from ..core import NotApplicable, Skipped
from ..trees import clone_args, copy_into


def method_mgc(ctx: Ctx) -> Prepared:
    if not ctx.w.mgc:
        raise NotApplicable("not applicable")
    if not ctx.cuda:
        raise Skipped("CUDA only")
    w = ctx.w
    own = clone_args(ctx.sets[0])  # make_graphed_callables writes into its sample inputs
    m0 = ctx.mem()
    t0 = perf_counter()
    gf = torch.cuda.make_graphed_callables(w.fn, own)
    out = gf(*own)
    ctx.sync()
    first = perf_counter() - t0
    errors = [ctx.err(out, 0)]
    del out
    mem = Ctx.mem_delta(m0, ctx.mem())
    copy_into(own, ctx.sets[1])  # the same tensors, new values
    errors.append(ctx.err(gf(*own), 1))
    return Prepared(lambda: gf(*own), errors, first,
                    extra={"memory": mem, "first_call_is": "make_graphed_callables + first call"})


def st_mgc(ctx: Ctx) -> Prepared:
    if not ctx.w.mgc:
        raise NotApplicable("not applicable")
    if not ctx.cuda:
        raise Skipped("CUDA only")
    inst = ctx.instance()
    own = clone_args(ctx.sets[0])  # make_graphed_callables writes into its sample inputs
    m0 = ctx.mem()

    def build_and_step():
        nonlocal gf
        if inst.mgc_module is not None:  # the module's forward is replaced; inst.fn calls it
            sample = inst.mgc_args(own) if inst.mgc_args else own
            torch.cuda.make_graphed_callables(inst.mgc_module, sample)
            gf = inst.fn
        else:
            gf = torch.cuda.make_graphed_callables(inst.fn, own)
        return gf(*own)

    gf: Any = None
    out, first = timed_first_call(ctx, build_and_step)
    errors = [ctx.err(out, 0)]
    del out
    mem = Ctx.mem_delta(m0, ctx.mem())

    def step(k):
        copy_into(own, ctx.sets[k])
        return gf(*own)

    more, _, _ = run_steps(ctx, step, range(1, len(ctx.sets)))
    return Prepared(lambda: gf(*own), errors + more, first, state_error=ctx.state_err(inst),
                    extra={"memory": mem, "first_call_is": "make_graphed_callables + first call"})

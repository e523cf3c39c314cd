"""gtransform's columns: `gt.graphify(fn)` called as users call it.

- `gt_same`: the same input tensor objects every call (read in place from the second call);
- `gt_new`: a new tensor for every leaf every call (all copied in, like "copy-in + replay");
- `gt_held`: as `gt_same`, but the loop keeps each call's output alive across the next
  call (the poison-and-hand-out path of held outputs);
- `gt_views`: as `gt_held`, and also a view of an output of each of the last 4 calls
  (the recording alternates between output generations);
- `gt_fused`: `gt.graphify(fn, fuse=True)`, TorchInductor's fused kernels recorded;
- `gt_split`: `gt.graphify(fn, on_break="split")` (issue #35), only on rows that read values
  on the host: reads of the call's own data split the function into recorded pieces.
- `gt_split_fused`: the same with `fuse=True` (each piece compiled by TorchInductor, as
  torch.compile's pieces are).

Held outputs and views are a property of the timing loop (`Prepared.hold`, run by
`benchmarks.timing.run_calls`); the function is built the same way for all of them.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import gtransform as gt

from ..context import Ctx, Prepared, run_steps, timed_first_call
from ..core import NotApplicable
from ..trees import clone_args, copy_into


def _gt_prepare(ctx: Ctx, new_tensors: bool, held: Any, fuse: bool = False) -> Prepared:
    w = ctx.w
    f = gt.graphify(w.fn, fuse=fuse)
    extra: Dict[str, Any] = {"first_call_is": "trace + record + first call"}
    if new_tensors:
        sets = ctx.sets
        m0 = ctx.mem()
        out, first = timed_first_call(ctx, lambda: f(*sets[0]))
        del out
        for k in range(1, len(sets)):
            f(*sets[k])
        extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
        errors = [ctx.err(f(*sets[k]), k) for k in (1, 2)]
        it = itertools.cycle(sets)

        def call():
            return f(*next(it))
    else:
        own = clone_args(ctx.sets[0])  # the same tensor objects every call
        m0 = ctx.mem()
        out, first = timed_first_call(ctx, lambda: f(*own))
        errors = [ctx.err(out, 0, own)]
        del out
        # the second call sees the same tensors again and re-records to read them in place
        out, second = timed_first_call(ctx, lambda: f(*own))
        errors.append(ctx.err(out, 0, own))
        del out
        f(*own)
        extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
        extra["second_call_s"] = second
        copy_into(own, ctx.sets[1])  # in-place update of the same tensors must be seen
        errors.append(ctx.err(f(*own), 1, own))

        def call():
            return f(*own)

    return Prepared(call, errors, first, hold=held, extra=extra,
                    after=lambda: {"cache_info": f.cache_info()._asdict()})


def method_gt_same(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=False)


def method_gt_new(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=True, held=False)


def method_gt_held(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=True)


def method_gt_views(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held="views")


def method_gt_fused(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=False, fuse=True)


def method_gt_split(ctx: Ctx) -> Prepared:
    raise NotApplicable("only on rows that read values on the host")


def st_gt(ctx: Ctx, new_tensors: bool, held: Any, fuse: bool = False, on_break: Optional[str] = None) -> Prepared:
    inst = ctx.instance()
    if on_break is not None:
        if not ctx.w.host_reads:
            raise NotApplicable("only on rows that read values on the host")
        f = gt.graphify(inst.fn, fuse=fuse, on_break=on_break)
    else:
        f = gt.graphify(inst.fn, fuse=fuse)
    m0 = ctx.mem()
    extra: Dict[str, Any] = {"first_call_is": "trace + record + first call"}
    if new_tensors:
        sets = ctx.sets
        errors, first, second = run_steps(ctx, lambda k: f(*sets[k]), range(len(sets)))
        it = itertools.cycle(sets)

        def call():
            return f(*next(it))
    else:
        own = clone_args(ctx.sets[0])

        def step(k):
            copy_into(own, ctx.sets[k])  # the same tensors, new values: gt must see them
            return f(*own)

        times: list = []
        errors, first, second = run_steps(ctx, step, range(len(ctx.sets)), times)
        extra["first_calls_s"] = times[:3]

        def call():
            return f(*own)

    extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
    extra["second_call_s"] = second
    return Prepared(call, errors, first, hold=held, extra=extra, state_error=ctx.state_err(inst),
                    after=lambda: {"cache_info": f.cache_info()._asdict()})

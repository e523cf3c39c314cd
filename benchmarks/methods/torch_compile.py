"""The `torch.compile(mode="reduce-overhead")` column (CUDA graph trees), and
`torch.compile(backend="gtransform")` (`compile_gt`: dynamo's pieces recorded by gtransform,
on rows that read values on the host).

Same tensors every call; its first call compiles (from cold caches: see
`benchmarks.caches`), later calls warm up and record before the timed ones. Skipped on the
CPU unless `--cpu-compile` (slow there). On stateful rows the cell also has
`first_calls_s`: the first three calls' seconds (compile, warm-up, record).
"""

from __future__ import annotations

from time import perf_counter

import torch

from ..context import Ctx, Prepared, run_steps, timed_first_call
from ..core import NotApplicable, Skipped
from ..trees import clone_args, copy_into


def method_compile(ctx: Ctx) -> Prepared:
    w = ctx.w
    if not w.compile_ok:
        raise NotApplicable("not applicable")
    if not ctx.cuda and not ctx.opts.cpu_compile:
        raise Skipped("slow on CPU (--cpu-compile runs it)")
    own = clone_args(ctx.sets[0])
    m0 = ctx.mem()
    cf = torch.compile(w.fn, mode="reduce-overhead")
    out, first = timed_first_call(ctx, lambda: cf(*own))
    errors = [ctx.err(out, 0)]
    del out
    t0 = perf_counter()
    for _ in range(4):  # cudagraph trees record on a later call
        cf(*own)
    ctx.sync()
    warm = perf_counter() - t0
    mem = Ctx.mem_delta(m0, ctx.mem())
    copy_into(own, ctx.sets[1])
    errors.append(ctx.err(cf(*own), 1))
    return Prepared(lambda: cf(*own), errors, first,
                    extra={"memory": mem, "next_4_calls_s": warm, "first_call_is": "compile + first call"})


def st_compile(ctx: Ctx, backend: str = "inductor") -> Prepared:
    if not ctx.w.compile_ok:
        raise NotApplicable("not applicable")
    if backend == "gtransform" and not ctx.w.host_reads:
        raise NotApplicable("only on rows that read values on the host")
    if not ctx.cuda and not ctx.opts.cpu_compile:
        raise Skipped("slow on CPU (--cpu-compile runs it)")
    inst = ctx.instance()
    own = clone_args(ctx.sets[0])
    m0 = ctx.mem()
    if backend == "gtransform":
        import gtransform  # noqa: F401  (registers the backend, where it exists)

        cf = torch.compile(inst.fn, backend="gtransform")
    else:
        cf = torch.compile(inst.fn, mode="reduce-overhead")

    def step(k):
        copy_into(own, ctx.sets[k])
        return cf(*own)

    # cudagraph trees: call 1 warms up, call 2 records, later calls replay: the steps cover all three
    times: list = []
    errors, first, second = run_steps(ctx, step, range(len(ctx.sets)), times)
    mem = Ctx.mem_delta(m0, ctx.mem())
    return Prepared(lambda: cf(*own), errors, first, state_error=ctx.state_err(inst),
                    extra={"memory": mem, "second_call_s": second, "first_calls_s": times[:3],
                           "first_call_is": "compile + first call"})


def method_compile_gt(ctx: Ctx) -> Prepared:
    raise NotApplicable("only on rows that read values on the host")


def st_compile_gt(ctx: Ctx) -> Prepared:
    return st_compile(ctx, backend="gtransform")

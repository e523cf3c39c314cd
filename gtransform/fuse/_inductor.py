"""A traced graph compiled by TorchInductor, for ``graphify(fn, fuse=True)``: the fused backend's driver.

:meth:`gtransform._trace.Plan.fused` makes one per signature (through
:func:`gtransform.fuse.compiled`); inductor itself is imported on its first call
only, so tracing and recording never load it unless asked. That call swaps the
graph's small float32 products for gtransform's own kernels (:mod:`._gemv`, then
:mod:`._gemm`), starts compiling those in threads, and hands the graph to
inductor's ``compile_fx``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from .._compat import (
    FakeTensorMode,
    aten_to_copy,
    load_compile_fx,
    load_dim_source,
    load_inductor_config,
    load_maybe_warm_pool,
    load_tracing_context,
)
from .._log import log
from . import _gemm, _gemv, _lift, _regions, _triton

# Inductor settings for fuse=True (applied where present in the installed torch).
# fallback_random: random ops follow eager's numbers. triton.cudagraphs: the
# recording is ours. One Triton configuration per kernel, no run-time autotuning
# among several: inductor compiles each candidate configuration and times them all
# at the first launch, which is most of a cold first call for kernels this small
# (launch-bound graphs: the configuration hardly changes their time).
# emulate_precision_casts: a cast to a lower precision rounds as eager's does (inductor
# otherwise keeps the value in float32 across `x.half().float()`: the cast vanished, and
# `x.to(torch.bfloat16) * 3` multiplied the unrounded value).
_CONFIG = {
    "fallback_random": True,
    "emulate_precision_casts": True,
    "triton.cudagraphs": False,
    "triton.autotune_pointwise": False,
    "test_configs.force_filter_reduction_configs": True,
}


def config() -> dict:
    """The part of :data:`_CONFIG` the installed inductor knows."""
    c = load_inductor_config()

    def known(key: str) -> bool:
        try:
            functools.reduce(getattr, key.split("."), c)
        except AttributeError:
            return False
        return True

    return {k: v for k, v in _CONFIG.items() if known(k)}


def prepare() -> None:
    """Load inductor now, when a fuse=True function is made, as ``torch.compile(fn)`` loads it when it wraps.

    Importing inductor takes seconds on a cold process (most of it Python compiling the
    modules' source): paid where the function is set up (a server's start, a training
    script's first lines), not by its first call. The compile workers still start at the
    first call (:func:`warm_pool`), as torch.compile starts them at its first compile.
    """
    load_compile_fx()
    load_inductor_config()


def warm_pool() -> None:
    """Get ready for a fuse=True compile: Triton's ptxas fixed, compile workers started.

    The ptxas as :func:`gtransform.fuse._triton.use_inductors_ptxas` says. The workers
    start now, as torch.compile starts them before it compiles: they come up while the
    function is traced; otherwise the first kernels compile one by one in this process
    while the pool starts.
    """
    _triton.use_inductors_ptxas()
    try:
        load_maybe_warm_pool()()
    except Exception:  # pragma: no cover - older or newer torch; the compile then starts them
        pass


class _Inductor:
    """A traced graph compiled by TorchInductor on its first call (that call's tensors are the examples).

    Straight to inductor's ``compile_fx``, as dynamo's inductor backend does: the
    graph is already an aten graph of flat tensors, so ``torch.compile`` would only
    trace its generated code again with dynamo and build guards nobody checks (the
    signature is gtransform's): 1-2 s of the benchmark's resnet18, GPT-2 and Llama
    first calls on an H100 (benchmarks/NOTES.md). Like dynamo, it hands inductor
    fake inputs of static shapes inside a tracing context with a shape environment:
    without one, inductor's persistent cache is bypassed; with real inputs there,
    sizes become symbolic (resnet18 took 19 s instead of 10). Inductor compiles a
    copy of the graph: its passes rewrite the graph they are given.
    """

    __slots__ = ("gm", "dims", "fn", "guards", "env", "by_size", "failed")

    def __init__(self, gm: torch.fx.GraphModule, dims: Any = None):
        self.gm = gm
        # (input, dim) compiled as symbolic sizes (a plan traced symbolically, shared by the
        # signatures of every size: see gtransform._symbolic): one compile serves every size
        # whose guards hold
        self.dims = frozenset(dims or ())
        self.fn: Any = None
        self.guards: Any = None  # the symbolic compile's guards (code over the inputs), checked per size
        self.env: Any = None
        self.by_size: dict = {}  # sizes the symbolic compile does not serve: one static compile each
        self.failed = False  # the symbolic compile raised: every size compiled on its own

    def __call__(self, *args: Any) -> Any:
        if not self.dims:  # (one signature: its sizes only)
            if self.fn is None:
                self.fn = self._compile(args, frozenset())
            return self.fn(*args)
        if self.fn is None and not self.failed:
            try:
                self.fn = self._compile(args, self.dims)
            except Exception as err:  # (inductor's dynamic shapes: each size compiled on its own instead)
                self.failed = True
                log.warning("fuse=True: compiling for every size failed (%s: %s); each size is compiled "
                            "on its own", type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
        if self.fn is not None and (self.guards is None or self.env.evaluate_guards_expression(self.guards, args)):
            return self.fn(*args)
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        fn = self.by_size.get(shapes)
        if fn is None:
            if self.fn is not None:
                log.info("fuse=True: the symbolic compile's guards (%s) refuse these sizes: compiled for them",
                         self.guards)
            fn = self.by_size[shapes] = self._compile(args, frozenset())
        return fn(*args)

    def _compile(self, args: Any, dims: Any) -> Any:
        TracingContext, tracing = load_tracing_context()
        compile_fx = load_compile_fx()

        gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        _keep_narrowing_casts(gm)
        building: list = []
        if not dims:  # (our kernels' launch plans are made for static sizes)
            groups: list = []
            small = _gemv.rewrite(gm, launches=groups)  # x @ w.t() of a few rows (_gemm leaves them alone)
            if small["gemv"]:
                log.info("fuse=True: %s", _gemv.describe(small))
                building += _gemv.precompile(groups)  # in threads, while inductor compiles
            launches: list = []
            counts = _gemm.rewrite(gm, launches=launches)
            if counts["gemm"]:
                log.info("fuse=True: %s", _gemm.describe(counts))
                building += _gemm.precompile(launches)
        # fixed-index reads of inputs (an unrolled loop over a grid) as inputs: one kernel per step's shape
        lifted = [] if dims else _lift.lift_indexed_views(gm, args)
        if lifted:
            log.info("fuse=True: %d fixed-index reads of inputs passed as inputs of their own", len(lifted))
        every = list(args) + _lift.views_of(lifted, args)
        plain = gm
        if not dims:  # repeated calls (an ODE solver's steps, a model's layers): one subgraph, compiled once
            outlined = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            if _regions.outline(outlined, every):
                gm = outlined
        try:
            fn, env, examples = _inductor(compile_fx, TracingContext, tracing, gm, every, dims)
        except Exception as err:
            if gm is plain:
                raise
            log.warning("fuse=True: compiling the repeated calls once failed (%s: %s); compiled as one graph",
                        type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            fn, env, examples = _inductor(compile_fx, TracingContext, tracing, plain, every, dims)
        if lifted:
            fn = _lift.with_lifted(fn, lifted)
        if dims:
            self.env, self.guards = env, env.produce_guards_expression(examples)
        for job in building:
            if job.exception() is not None:  # waits; the launch will compile it and report
                log.debug("fuse=True: precompiling a kernel failed: %r", job.exception())
        return fn


def _inductor(compile_fx: Any, TracingContext: Any, tracing: Any, gm: torch.fx.GraphModule, every: Any,
              dims: Any) -> Any:
    """``compile_fx`` of ``gm`` over fake examples of ``every``; and the shape environment and examples."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    fake = FakeTensorMode(shape_env=env, static_shapes=True, allow_non_fake_inputs=True)
    examples = [_example(fake, i, a, dims) if isinstance(a, torch.Tensor) else a for i, a in enumerate(every)]
    with tracing(TracingContext(fake)), load_inductor_config().patch(config()):
        return compile_fx(gm, examples), env, examples


def _example(fake: Any, i: int, a: torch.Tensor, dims: Any) -> Any:
    """Inductor's example of input ``i``: static sizes, or a symbol for each of its dimensions in ``dims``."""
    if not any((i, d) in dims for d in range(a.dim())):
        return fake.from_tensor(a, static_shapes=True)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx: Any = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if (i, d) in dims else DimDynamic.STATIC for d in range(a.dim())],
        constraint_sizes=[None] * a.dim())
    return fake.from_tensor(a, static_shapes=False, symbolic_context=ctx, source=load_dim_source()(f"t{i}"))


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _keep_narrowing_casts(gm: torch.fx.GraphModule) -> None:
    """Keep ``x.half().float()`` rounding through inductor.

    Inductor's joint-graph pattern ``pointless_convert`` folds a chain of float casts into
    its last one; before torch 2.13 it did so for a narrowing cast too, whatever
    ``emulate_precision_casts`` says: the value came back unrounded. A multiplication by 1
    in the narrow type (exact; inductor drops it after its patterns ran) stands between the
    two casts, so the chain is not one the pattern matches.
    """
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten_to_copy:
            continue
        src, dst = _float_of(n.args[0] if n.args else None), n.kwargs.get("dtype")
        if src is None or dst not in _FLOATS or dst.itemsize >= src.itemsize:
            continue
        widened = [u for u in n.users if u.op == "call_function" and u.target is aten_to_copy
                   and u.kwargs.get("dtype") in _FLOATS and u.kwargs["dtype"].itemsize > dst.itemsize]
        if not widened:
            continue
        with gm.graph.inserting_after(n):
            kept = gm.graph.call_function(torch.ops.aten.mul.Tensor, (n, 1))
        if "val" in n.meta:
            kept.meta["val"] = n.meta["val"]
        for u in widened:
            u.replace_input_with(n, kept)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _float_of(a: Any) -> Any:
    v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
    return v.dtype if isinstance(v, torch.Tensor) and v.dtype in _FLOATS else None

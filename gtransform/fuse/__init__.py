"""The fused backend of ``graphify(fn, fuse=True)``: a traced graph compiled by TorchInductor.

The core reaches this package through its three names alone, each imported where it is
used: :func:`prepare` (``_api``: inductor loaded when a fuse=True function is made),
:func:`compiled` (``_trace.Plan.fused``: the graph a recording runs)
and :func:`warm_pool` (``_lookup``: before a fuse=True function is traced). A program that
never asks for ``fuse=True`` loads neither this package nor inductor. The package
may import the core; the core imports nothing of it at module level.

Inside, each module imports only those below it::

    _inductor            the driver: the graph's small float32 products swapped for our
                         kernels, those precompiled in threads, the rest to compile_fx
    _gemm, _gemv         the two kernels: a Triton kernel, its launch plan, its op
                         (gtransform::gemm / ::gemv) and its graph pass
    _operands, _triton   what both share: the operands their passes match (and
                         GTRANSFORM_GEMM); ptxas, the launch and the precompile
    _cubin, _static      launching a compiled kernel without Triton's C launcher: by
                         hand (the default) or with torch's static launcher
                         (GTRANSFORM_FUSE_LAUNCHER, in _triton)

What it borrows that neither torch nor Triton promises to keep: inductor's
``compile_fx``, ``config``, ``maybe_warm_pool``, ``torch._guards.tracing``, fake
tensors and a shape environment (``_inductor``); ``_set_triton_ptxas_path`` and
Triton's ``JITFunction.warmup`` and ``CompiledKernel._init_handles`` (``_triton``);
Triton's compiled-kernel fields and driver utilities (``_cubin``); inductor's
``StaticallyLaunchedCudaKernel`` (``_static``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._inductor import _Inductor, prepare, warm_pool

__all__ = ["compiled", "prepare", "warm_pool"]


def compiled(gm: torch.fx.GraphModule, dims: Any = None) -> Callable[..., Any]:
    """``gm`` as a callable that TorchInductor compiles on its first call.

    That call's tensors are the examples inductor compiles for; the graph is not
    touched (inductor compiles a copy). Made once per signature by
    ``_trace.Plan.fused``, or once per family of sizes for a plan traced with symbolic
    sizes: ``dims``, the ``(input, dim)`` compiled as symbols (inductor's dynamic shapes).
    """
    return _Inductor(gm, dims)

"""The fused backend of ``graphify(fn, fuse=True)``: a traced graph compiled by TorchInductor.

The core reaches this package through its two names alone, each imported where it is
used: :func:`compiled` (``_trace.Plan.fused``: the graph a recording runs) and
:func:`warm_pool` (``_api``: before a fuse=True function is traced). A program that
never asks for ``fuse=True`` loads neither this package nor inductor. The package
may import the core; the core imports nothing of it at module level.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._inductor import _Inductor, warm_pool

__all__ = ["compiled", "warm_pool"]


def compiled(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``gm`` as a callable that TorchInductor compiles on its first call.

    That call's tensors are the examples inductor compiles for; the graph is not
    touched (inductor compiles a copy). Made once per signature by
    ``_trace.Plan.fused``.
    """
    return _Inductor(gm)

"""What fuse=True's two graph passes match alike: float32 matrix products and their operands.

:mod:`._gemm` and :mod:`._gemv` each swap some ``mm`` / ``addmm`` nodes of a traced
graph for one of their kernels. Both read a node's fake value (``meta["val"]``), take
float32 operands on the device they swap for and only those their kernels can index
in int32, recognise the same two products (``a @ b`` and ``bias + a @ b``), and are
switched off together (TF32, or ``GTRANSFORM_GEMM=0``). This module holds that much;
what each kernel takes beyond it stays with the kernel.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import torch

__all__ = ["enabled", "f32_on", "product_operands", "reach", "val"]

_aten = torch.ops.aten


def val(node: Any) -> Any:
    """A graph node's fake value (``meta["val"]``), None where it has none (or is no node)."""
    return node.meta.get("val") if hasattr(node, "meta") else None


def f32_on(t: Any, device: str) -> bool:
    """Whether ``t`` is a float32 tensor on a device of type ``device``."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == device


def reach(t: torch.Tensor) -> int:
    """How many elements past its first one a tensor reaches (the kernels index in int32)."""
    return sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride()) if int(n) > 0)


def product_operands(node: Any) -> Optional[Tuple[Any, Any, Any]]:
    """``(bias, a, b)`` of a node ``a @ b`` (``mm``, bias None) or ``bias + a @ b`` (unscaled ``addmm``), else None."""
    if node.target is _aten.mm.default and len(node.args) == 2 and not node.kwargs:
        return (None, *node.args)
    if node.target is _aten.addmm.default and len(node.args) == 3 \
            and all(node.kwargs.get(k, 1) == 1 for k in ("beta", "alpha")) and set(node.kwargs) <= {"beta", "alpha"}:
        return tuple(node.args)  # type: ignore[return-value]
    return None


def enabled() -> bool:
    """Whether to swap now.

    Float32 products must run in full precision (the kernels' only mode), and
    ``GTRANSFORM_GEMM=0`` in the environment switches the swaps off.
    """
    return not torch.backends.cuda.matmul.allow_tf32 and os.environ.get("GTRANSFORM_GEMM", "1") != "0"

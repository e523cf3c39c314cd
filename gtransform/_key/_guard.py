"""The tensors' part of a signature, checked in one C++ call.

dynamo's ``TensorGuards`` compare each tensor's type, dispatch keys (the conjugate,
negative and inference bits among them), dtype, device, ``requires_grad``, sizes and
strides, and refuse a call whose tensors are not distinct objects. Where torch lacks it,
or the signature's own tensors are not distinct, the tensors' metadata are compared in
Python instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._compat import TensorGuards as _TensorGuards
from .._tree import tensor_meta

__all__ = ["Guard"]


class Guard:
    """Fast check that a call's tensors match a signature."""

    __slots__ = ("impl", "metas")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.metas = [tensor_meta(t) for t in tensors]
        self.impl: Any = None
        if _TensorGuards is not None and tensors:
            try:
                self.impl = _TensorGuards(
                    *tensors,
                    dynamic_dims_sizes=[list(t.size()) for t in tensors],  # type: ignore[misc]
                    dynamic_dims_strides=[list(t.stride()) for t in tensors],  # type: ignore[misc]
                )
                if not self.impl.check(*tensors):  # pragma: no cover - defensive
                    self.impl = None
            except Exception:  # pragma: no cover
                self.impl = None

    def check(self, tensors: Sequence[torch.Tensor]) -> bool:
        impl = self.impl
        try:
            if impl is not None:
                return bool(impl.check(*tensors))
            if not self.metas:
                return True
            return [tensor_meta(t) for t in tensors] == self.metas
        except Exception:
            return False

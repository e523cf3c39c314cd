"""CUDA jiterator kernels (``torch.cuda.jiterator._create_jit_fn``) inside a graphified function.

A jitted function launches its kernel through a C function of torch, not through the
dispatcher: a trace calling it on fake tensors launched the kernel on placeholders
without memory (an illegal memory access: the process's CUDA context was lost). While
a trace runs, ``_patches`` routes the code of the jitted functions' ``__call__``
(``torch.cuda.jiterator._JittedFunction``), in the tracing thread, to :func:`caller`
(torch._C's launch function itself is left alone: other threads see it unchanged):
called on the trace's tensors, it records the op
``gtransform::jiterator`` instead, whose kernel is the same launch on the recording's
tensors (compiled by NVRTC at the warm-up, before the capture) and whose fake computes
the broadcast shape and promoted dtype, as the jiterator's TensorIterator does. Calls
on real tensors, and calls from any other thread, go straight to torch's function.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List, Tuple

import torch

from ._compat import FakeTensor, JittedFunction, jiterator_launch, load_elementwise_dtypes

__all__ = ["OWNER", "available", "caller"]

OWNER = JittedFunction  # (its __call__ is routed)
# what each recorded launch compiles: handle -> (code, kernel name, return_by_ref, outputs, scalars)
_KERNELS: Dict[int, Tuple[str, str, bool, int, Dict[str, Any]]] = {}
_HANDLES: Dict[Any, int] = {}
_LOCK = threading.Lock()


def _handle(code: str, name: str, by_ref: bool, n_out: int, kwargs: Dict[str, Any]) -> int:
    """The handle of a kernel (one per distinct code, name and scalar arguments)."""
    key = (code, name, by_ref, n_out, tuple(sorted((k, type(v).__name__, v) for k, v in kwargs.items())))
    with _LOCK:
        h = _HANDLES.get(key)
        if h is None:
            h = _HANDLES[key] = len(_KERNELS)
            _KERNELS[h] = (code, name, by_ref, n_out, dict(kwargs))
        return h


@functools.cache
def _op() -> Any:
    launch = _LAUNCH

    @torch.library.custom_op("gtransform::jiterator", mutates_args=())
    def jiterator(handle: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        code, name, by_ref, n_out, kwargs = _KERNELS[handle]
        out = launch(code, name, by_ref, n_out, tuple(tensors), kwargs)
        return list(out) if n_out > 1 else [out]

    @jiterator.register_fake
    def _(handle: int, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        elementwise_dtypes, ELEMENTWISE_TYPE_PROMOTION_KIND = load_elementwise_dtypes()
        n_out = _KERNELS[handle][3]
        shape = torch.broadcast_shapes(*[t.shape for t in tensors])
        _, dtype = elementwise_dtypes(*tensors, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        return [tensors[0].new_empty(shape, dtype=dtype) for _ in range(n_out)]

    return torch.ops.gtransform.jiterator.default


def caller(orig: Any) -> Any:
    """What a jitted function's ``__call__`` (``orig``) does in a tracing thread."""
    def call(self: Any, *tensors: Any, **kwargs: Any) -> Any:
        if not any(isinstance(t, FakeTensor) for t in tensors):
            return orig(self, *tensors, **kwargs)
        unknown = [k for k in kwargs if k not in self.kwargs_dict]
        if unknown:
            raise KeyError(f"{unknown[0]} is not declared in function definition")  # (torch's text)
        scalars = {**self.kwargs_dict, **kwargs}
        n_out = self.num_outputs
        outs = _op()(_handle(self.code_string, self.kernel_name, self.return_by_ref, n_out, scalars), list(tensors))
        return outs[0] if n_out == 1 else tuple(outs)

    return call


def available() -> bool:
    """Whether this build of torch has the jiterator (CUDA builds) and its jitted functions' class."""
    return _LAUNCH is not None and OWNER is not None


_LAUNCH: Any = jiterator_launch  # torch's own function (the recorded op calls it, never a routed one)

"""Pytrees of tensors as the benchmark walks them, and the error measure of every check.

The walk is the benchmark's own (dicts with keys sorted, lists, tuples), not gtransform's
optree, so that the checks do not lean on the code under test. `f64_leaves` also reads jax
arrays: every column's result is compared with eager's in float64 the same way.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List

import numpy as np
import torch


def tree_tensors(obj: Any) -> List[torch.Tensor]:
    """Tensor leaves in a fixed order (dict keys sorted)."""
    out: List[torch.Tensor] = []

    def rec(o):
        if isinstance(o, dict):
            for k in sorted(o):
                rec(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                rec(v)
        elif isinstance(o, torch.Tensor):
            out.append(o)

    rec(obj)
    return out


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: tree_map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map_tensors(fn, v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return obj


def clone_args(args: tuple) -> tuple:
    return tree_map_tensors(lambda t: t.clone(), args)


def copy_into(dst_args: tuple, src_args: tuple) -> None:
    """Copy one input set's values into another's tensors, in place."""
    for d, s in zip(tree_tensors(dst_args), tree_tensors(src_args)):
        d.copy_(s)


try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except Exception:  # pragma: no cover
    class _FakeTensor:  # type: ignore[no-redef]
        pass


def f64_leaves(obj: Any, device: torch.device) -> List[torch.Tensor]:
    """Every array leaf (torch or jax; dict keys sorted) as a float64 torch tensor."""
    out: List[torch.Tensor] = []

    def rec(o):
        if isinstance(o, dict):
            for k in sorted(o):
                rec(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                rec(v)
        elif isinstance(o, torch.Tensor):
            if isinstance(o, _FakeTensor):  # would fail later with a baffling DataDependentOutputException
                raise RuntimeError("an output leaf is a FakeTensor: a trace-time value came back instead of a real "
                                   f"tensor (output container {type(obj).__name__})")
            out.append(o.detach().to(torch.float64))
        elif o is None or isinstance(o, (bool, int, float, str)):
            pass
        else:  # a jax array
            out.append(torch.from_numpy(np.asarray(o).astype(np.float64)).to(device))

    rec(obj)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (inf for NaN or a shape mismatch)."""
    if a.shape != b.shape:
        return math.inf
    d = (a - b).norm().item()
    r = b.norm().item()
    if not (math.isfinite(d) and math.isfinite(r)):
        return math.inf
    return d / r if r > 0 else d

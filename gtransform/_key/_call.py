"""A call's hashable key: the index of the signature cache, made while its leaves are checked.

The key is ``(structure, parts, (aliasing, same objects, tensor bits), static arguments,
global settings, dict key orders)``, where ``parts`` holds each tensor leaf's metadata
and each other leaf's static value. Equal keys are candidates; :mod:`._checks` decides.
Leaves a recording cannot take (a sparse, nested, meta or quantized tensor, a tensor
subclass, a stale output, tensors on several devices, an unhashable static value) are
refused here, with the leaf's path.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._errors import GraphifyError, OverwrittenOutputError
from .._liveness import StaleOutput, stale_message
from .._tree import leaf_paths, static_leaf_key, tensor_meta
from ._parts import alias_pattern, dict_orders, same_objects, tensor_bits

__all__ = ["CallKey", "call_key"]

_Parameter = torch.nn.Parameter
_strided = torch.strided


class CallKey(NamedTuple):
    """A call's key and what was computed on the way: the parts, where the tensors are, the device, the paths."""

    key: Tuple[Any, ...]
    parts: List[Any]
    tpos: List[int]
    device: Optional[torch.device]
    paths: List[str]


def call_key(desc: str, leaves: Sequence[Any], spec: Any, tree: Any, statics: Tuple[Any, ...], glob: Any) -> CallKey:
    """The cache key of a call of ``desc`` (the function, for messages), validating its leaves.

    ``tree`` is ``(args, kwargs)``: its leaf paths name a refused leaf, and its dicts' key
    orders are part of the key.
    """
    tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    ts = [leaves[i] for i in tpos]
    device = ts[0].device if ts else None
    for i, t in zip(tpos, ts):
        if not _plain(t) or t.device != device:
            _refuse(desc, leaves, tree, i, statics)
    alias = (alias_pattern(ts), same_objects(ts), tensor_bits(ts))
    parts: List[Any] = []
    try:
        for x in leaves:
            parts.append(tensor_meta(x) if isinstance(x, torch.Tensor) else static_leaf_key(x))
    except TypeError:
        _refuse(desc, leaves, tree, len(parts), statics)
    return CallKey((spec, tuple(parts), alias, statics, glob, dict_orders(tree)), parts, tpos, device, [])


def _plain(t: torch.Tensor) -> bool:
    """Whether a recording takes the tensor: dense, strided, with data, a torch.Tensor or nn.Parameter."""
    return ((type(t) is torch.Tensor or type(t) is _Parameter) and t.layout == _strided and not t.is_nested
            and t.device.type != "meta" and not t.is_quantized)


def _refuse(desc: str, leaves: Sequence[Any], tree: Any, i: int, statics: Sequence[Any] = ()) -> None:
    """Raise the error of the leaf at ``i``, which a recording cannot take, with its path and the fix."""
    x = leaves[i]
    if isinstance(x, StaleOutput):
        msg = stale_message(x)
        raise OverwrittenOutputError(f"{msg}\n(passed as input {leaf_paths(tree, statics=statics)[i]} to {desc})")
    paths = leaf_paths(tree, statics=statics)
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{desc}: the non-tensor leaf {paths[i]} of type {type(x).__name__} is not "
            "hashable. Non-tensor leaves are static: their values are part of the cache key. "
            "Fix: pass it as a tensor, make it hashable (e.g. a tuple instead of a list), or "
            "register its type as a pytree node with optree (namespace='gtransform')."
        ) from None
    if _plain(x):
        _mixed_devices(desc, leaves, paths)
    _bad_tensor(desc, paths[i], x)


def _bad_tensor(desc: str, path: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        what, fix = f"a {t.layout} tensor", "pass a dense tensor (t.to_dense())"
    elif t.is_nested:
        what, fix = "a nested tensor", "pass padded dense tensors instead"
    elif t.device.type == "meta":
        what, fix = "a meta tensor (it has no data)", "pass a tensor on the CPU or a GPU"
    elif t.is_quantized:
        what, fix = f"a quantized tensor ({t.dtype})", "pass t.dequantize() (or t.int_repr() and its scale)"
    else:
        what, fix = (
            f"a tensor subclass ({type(t).__name__})",
            "pass a plain tensor (t.as_subclass(torch.Tensor)), or call the function eagerly",
        )
    raise GraphifyError(
        f"{desc}: input {path} is {what}.\nWhy: graphify records dense strided tensors "
        f"(torch.Tensor or nn.Parameter) only.\nFix: {fix}."
    )


def _mixed_devices(desc: str, leaves: Sequence[Any], paths: Sequence[str]) -> None:
    by: Dict[str, List[str]] = {}
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            by.setdefault(str(x.device), []).append(p)
    listing = "; ".join(f"{d}: {', '.join(ps[:4])}{' ...' if len(ps) > 4 else ''}" for d, ps in by.items())
    raise GraphifyError(
        f"{desc}: tensor inputs are on different devices ({listing}).\n"
        "Why: one recording runs on one device; a CPU tensor read by a CUDA graph would be "
        "frozen at recording time.\n"
        "Fix: move every tensor input to one device (x.to(device)); pass CPU scalars as Python numbers."
    )

"""The parts of a call that its signature is made of, each computed from the call alone.

The tree structure and dict key orders of ``(args, kwargs)``, the global settings
(:func:`global_key`), which tensors are the same object or share memory, and the Python
attributes set on tensor arguments. :mod:`._call` puts them into a call's hashable key;
:mod:`._checks` compares them with a signature's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._compat import get_deterministic_algorithms as _deterministic
from .._compat import is_any_autocast_enabled as _any_autocast
from .._tree import has_grad, static_leaf_key
from .._watch import FOR_GRAD

__all__ = ["global_key", "dict_orders", "alias_pattern", "same_objects", "tensor_bits", "has_grad", "attrs_key"]

_is_grad_enabled = torch.is_grad_enabled
_get_default_dtype = torch.get_default_dtype
_inference_mode = torch.is_inference_mode_enabled


def global_key(grad_mode: Optional[bool] = None) -> Tuple[Any, ...]:
    """The global settings that change what a function computes, like dynamo's global guards.

    Grad mode, the default dtype, the autocast state (per device type),
    ``torch.use_deterministic_algorithms`` (which picks kernels, and which code may branch on),
    and whether the call is differentiated by ``torch.func.grad``/``vjp`` (``FOR_GRAD``): such a
    trace sees the tensors under the transform's wrappers, whose ``requires_grad`` is not what the
    transform differentiates, so it keeps every output differentiable (``Plan.rg_traced``
    False), while a plain call's trace marks outputs of inputs that do not require grad (and
    detached ones) as not; one trace serving the other gave a plain call outputs that require
    grad where eager's do not, and torch.func.grad zero gradients.
    """
    gm = _is_grad_enabled() if grad_mode is None else grad_mode
    ac = None
    if _any_autocast is None or _any_autocast():
        ac = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    # inference mode: the tensors' dispatch keys differ (the guards' view), so a function called
    # in turn under inference_mode() and no_grad() keeps a recording for each
    return (gm, _get_default_dtype(), ac, _deterministic(), _inference_mode(), bool(getattr(FOR_GRAD, "on", False)))


def dict_orders(tree: Any) -> Tuple[Tuple[Any, ...], ...]:
    """Insertion order of every dict with several keys in ``tree`` (optree sorts keys; a function may not)."""
    out: List[Tuple[Any, ...]] = []

    def walk(x: Any) -> None:
        t = type(x)
        if t is dict:
            if len(x) > 1:
                out.append(tuple(x))
            for v in x.values():
                walk(v)
        elif t is list or t is tuple:
            for v in x:
                walk(v)

    walk(tree)
    return tuple(out)


def alias_pattern(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """Which tensor inputs share storage: a group id per input, -1 if alone."""
    cds = [t.untyped_storage()._cdata for t in tensors]
    if len(set(cds)) == len(cds):  # (the usual case, in C: a split piece's 66 tensors per call)
        return ()
    seen: Dict[int, int] = {}
    ids = [seen.setdefault(c, len(seen)) for c in cds]
    counts: Dict[int, int] = {}
    for g in ids:
        counts[g] = counts.get(g, 0) + 1
    if all(c == 1 for c in counts.values()):
        return ()
    return tuple(g if counts[g] > 1 else -1 for g in ids)


def same_objects(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """Which tensor inputs are the very same object.

    Per input, the first position of its object; ``()`` when all are distinct (the
    usual case, one C-level pass).

    Part of the signature: a function may branch on ``a is b`` (a kernel k(X, X) adding
    jitter to its diagonal, attention's ``query is key``), and the trace then takes the
    branch eager takes.
    """
    ids = list(map(id, tensors))
    if len(set(ids)) == len(ids):
        return ()
    first: Dict[int, int] = {}
    return tuple(first.setdefault(x, k) for k, x in enumerate(ids))


def tensor_bits(tensors: Sequence[torch.Tensor]) -> Tuple[Tuple[int, bool, bool, bool], ...]:
    """The tensors with the conjugate or negative bit, or inference tensors: ``(index, conj, neg, inference)``.

    They change the tensors' dispatch keys, which the guards check: a key of their own (an
    input alternating between ``z.conj()`` and ``z`` traced again on every switch).
    """
    return tuple((k, t.is_conj(), t.is_neg(), t.is_inference()) for k, t in enumerate(tensors)
                 if t.is_conj() or t.is_neg() or t.is_inference())


def attrs_key(t: torch.Tensor) -> Any:
    """Key of a tensor input's Python attributes (``()``: none)."""
    d = t.__dict__
    if not d:
        return ()
    out = []
    for k, v in d.items():
        try:
            out.append((k, static_leaf_key(v)))
        except TypeError:
            out.append((k, ("id", id(v))))
    return tuple(sorted(out, key=lambda kv: kv[0]))



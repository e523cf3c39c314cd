"""Calls of a function with ``record_sizes=`` or ``buckets=``: routed by their batch size.

A stage between the fast-path miss (``_calls``) and ``_run``, taken only by functions
made with one of the two options (and only outside torch.func transforms). It takes the
call as the caller passed it and either runs it eagerly (a size not selected, or above
the largest bucket: correct numbers, nothing recorded, no warning, counted by size in
``_sizes.Sizes``), or hands ``_run`` the call (``record_sizes``), or the call with the
arguments ``pad=`` names padded along dim 0 up to the next bucket (``buckets``), and
slices the outputs back to the true batch.

Padding is right only where rows do not interact. A bucket's first padded call is
checked: the traced signature must not update its inputs or state in place (padded rows
would reach them), every tensor output must have the bucket's rows along dim 0, and the
sliced outputs must equal an unpadded eager run of the same call (per-dtype tolerance);
otherwise a :class:`GraphifyError` says which bucket, which output, by how much, why and
the fix. Sliced outputs are copies (``t[:n].clone()``): they never go stale.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ._bind import Bound, bind
from ._errors import GraphifyError
from ._key import Call, global_key
from ._lookup import lookup, thread_state
from ._run import run
from ._sizes import Sizes, pad_size
from ._tree import flatten, leaf_paths, unflatten

__all__ = ["sized_call", "TOLERANCE"]

TOLERANCE = {  # (rtol, atol) of the first padded call's check, per dtype (other dtypes: exact)
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}

_FIX = ("Fix: graphify it without buckets= (each batch size its own recording; record_sizes= bounds "
        "which ones), or keep the rows independent (model.eval(), no reduction over dim 0).")


def sized_call(g: Any, sz: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A plain call (no torch.func transform) of a function made with ``record_sizes=`` or ``buckets=``."""
    if sz.buckets is not None:
        return _bucketed(g, sz, args, kwargs)
    b = bind(g, args, kwargs)
    n = sz.size_of(b.leaves, b.spec)
    if n is not None and not sz.selected(n, g._hits):
        sz.ran_eagerly(n)  # (not recorded, not traced: no signature, so no storm warning)
        return g._fn(*args, **kwargs)
    out = run(g, b, False)
    sz.went_usual_way(n, g._hits)
    return out


def _bucketed(g: Any, sz: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        n, found = pad_size(sz, args, kwargs)
    except ValueError as err:
        raise ValueError(f"{g._desc}: {err}") from None
    bucket = None if n is None else sz.bucket_for(n)
    if n is None or bucket == n:
        return run(g, bind(g, args, kwargs), False)
    if bucket is None:
        sz.ran_eagerly(n, above=True)  # (above the largest bucket: eagerly, as documented)
        return g._fn(*args, **kwargs)
    pargs, pkwargs = _padded(args, kwargs, found, n, bucket)
    pb = bind(g, pargs, pkwargs)
    first = bucket not in sz.checked
    ref = None
    if first:
        _refuse_updates(g, pb, bucket)
        with torch.no_grad():
            ref = g._fn(*args, **kwargs)
    out = _sliced(g, run(g, pb, False), n, bucket, first)
    if first:
        _compare(g, out, ref, n, bucket)
        sz.checked.add(bucket)
    return out


def _pad_tensor(x: torch.Tensor, value: Any, bucket: int) -> torch.Tensor:
    if x.dim() == 0:
        return x
    fill = x.new_full((bucket - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, fill])


def _padded(args: Tuple[Any, ...], kwargs: Dict[str, Any], found: List[Tuple[Any, Any]], n: int,
            bucket: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with the tensors of those ``pad=`` names padded along dim 0 to ``bucket`` rows."""
    pargs, pkwargs = list(args), dict(kwargs)
    for where, value in found:
        a = args[where] if isinstance(where, int) else kwargs[where]
        leaves, spec = flatten(a)
        padded = unflatten(spec, [_pad_tensor(x, value, bucket) if isinstance(x, torch.Tensor) else x
                                  for x in leaves])
        if isinstance(where, int):
            pargs[where] = padded
        else:
            pkwargs[where] = padded
    return tuple(pargs), pkwargs


def _refuse_updates(g: Any, pb: Bound, bucket: int) -> None:
    """Refuse a padded signature that updates its inputs or state in place (padded rows would reach them)."""
    misses = g._misses
    try:
        found = lookup(g, thread_state(g), Call(pb.leaves, pb.spec, pb.statics, global_key(), pb.tree), record=False)
    except Exception:  # (the call itself will say: run() meets the same trace)
        return
    finally:
        g._misses = misses  # (a look, not a call)
    if found is None:
        return
    plan = found[0].plan
    if plan.mutated:
        paths = ", ".join(plan.in_paths[i] for i in sorted(plan.mutated))
        raise GraphifyError(
            f"{g._desc}: with buckets= (bucket {bucket}), the function updates {paths} in place.\n"
            "Why: the call's arguments are padded along dim 0 up to the bucket, so the padded rows would reach "
            "what it updates (a BatchNorm in training mode updates its running statistics from every row; an "
            "input updated in place would be a padded copy, not the caller's tensor).\n" + _FIX)


def _sliced(g: Any, out: Any, n: int, bucket: int, first: bool) -> Any:
    """The outputs' first ``n`` rows, copied (a bucket's first call: outputs without the bucket's rows refused)."""
    leaves, spec = flatten(out)
    paths = leaf_paths(out, root="output") if first else []
    sliced = []
    for k, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            sliced.append(x)
            continue
        if x.dim() == 0 or x.shape[0] != bucket:
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k] if paths else 'output leaf ' + str(k)} has "
                f"shape {list(x.shape)}: its dim 0 is not the batch, so it cannot be sliced back to {n} rows.\n"
                "Why: an output without a row per input row (a scalar loss, a sum over the batch) mixes the "
                "rows, padded ones included.\n" + _FIX)
        sliced.append(x[:n].clone())
    return unflatten(spec, sliced)


def _compare(g: Any, out: Any, ref: Any, n: int, bucket: int) -> None:
    """Refuse where the padded run's sliced outputs differ from eager's (rows interact, or random ops)."""
    lo, so = flatten(out)
    lr, sr = flatten(ref)
    paths = leaf_paths(ref, root="output")
    if so != sr:
        raise GraphifyError(f"{g._desc}: with buckets= (bucket {bucket}), the padded call returned another "
                            f"structure than eager: {so} vs {sr}.\n" + _FIX)
    for k, (a, e) in enumerate(zip(lo, lr)):
        if not isinstance(e, torch.Tensor):
            continue
        worst = _max_difference(a, e)
        if worst is not None:
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k]} of the padded call "
                f"differs from an unpadded eager run of the same call (max difference {worst}).\n"
                "Why: the rows interact (a BatchNorm in training mode, a sum, mean or softmax over dim 0), so "
                "the padded rows change the true rows' results (or the function is random: dropout in "
                "training mode). Each bucket's first call is checked against eager.\n" + _FIX)


def _max_difference(a: torch.Tensor, e: torch.Tensor) -> Optional[str]:
    """The largest difference of ``a`` from ``e`` where beyond ``e``'s dtype tolerance (None: close)."""
    if a.shape != e.shape:
        return f"shape {list(a.shape)} vs eager's {list(e.shape)}"
    rtol, atol = TOLERANCE.get(e.dtype, (0.0, 0.0))
    a2, e2 = a.detach().to(e.device), e.detach()
    if not (e2.is_floating_point() or e2.is_complex()):
        a2, e2 = a2.to(torch.float64), e2.to(torch.float64)
    if torch.allclose(a2, e2, rtol=rtol, atol=atol, equal_nan=True):
        return None
    return f"{float((a2 - e2).abs().nan_to_num(float('inf')).max()):.3g}"

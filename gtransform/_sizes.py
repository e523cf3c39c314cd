"""Sizes that vary: which batch sizes get a recording (``record_sizes=``), and buckets (``buckets=``, ``pad=``).

This module checks the two options (for ``_bind``); ``_sized`` keeps one graphified
function's books on sizes and routes its calls with them (it sits before ``_run``).

The batch size of a call (the peer is inductor's ``cudagraph_capture_sizes``: sizes of
the dynamic dimension) is dim 0 of its batch leaves:

* with ``pad=``: the tensor leaves (of one dimension or more) of the arguments ``pad``
  names; they must agree on dim 0;
* otherwise: the tensor leaves of the non-static arguments whose dim 0 has varied
  between calls with the same tree structure (the first such leaf in flattening order
  when several vary); before any has varied, the last tensor leaf of one dimension or
  more (``f(params, x)``: ``x``). A call without such a leaf has no size: it takes the
  usual way (recorded per signature).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

__all__ = ["check_size_options", "RecordSizes", "PadSpec"]

RecordSizes = Union[None, int, Tuple[int, ...]]
PadSpec = Tuple[Tuple[Optional[int], Optional[str], Union[int, float, bool]], ...]  # (position, name, value)


def _positive_ints(what: str, v: Any) -> Tuple[int, ...]:
    try:
        if isinstance(v, (str, bytes, torch.Tensor)) or isinstance(v, bool):
            raise TypeError
        seq = tuple(v)
    except TypeError:
        raise TypeError(f"graphify(fn, {what}=...): expected a sequence of positive ints (batch sizes, "
                        f"e.g. (1, 2, 4, 8)), got {v!r}") from None
    if not seq or any(not isinstance(s, int) or isinstance(s, bool) for s in seq):
        raise TypeError(f"graphify(fn, {what}=...): expected a non-empty sequence of positive ints (batch "
                        f"sizes, e.g. (1, 2, 4, 8)), got {v!r}")
    if any(s < 1 for s in seq):
        raise ValueError(f"graphify(fn, {what}=...): batch sizes must be positive, got {v!r}")
    return tuple(sorted(set(seq)))


def _record_sizes(v: Any) -> RecordSizes:
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise ValueError(f"graphify(fn, record_sizes=...): an int N records the N most frequent batch sizes "
                             f"and must be positive, got {v!r}")
        return v
    return _positive_ints("record_sizes", v)


def _pad(fn: Callable[..., Any], v: Any) -> PadSpec:
    """``pad=`` as ``((position, name, value), ...)``: a name, a position, several, or a dict of them to values."""
    accepted = ("expected the argument(s) to pad: a name or position, a sequence of them (padded with 0), or a "
                "dict of them to the pad value (e.g. pad={'x': 0} or pad={0: 0.0, 'mask': False})")
    if isinstance(v, (str, int)) and not isinstance(v, bool):
        items: List[Tuple[Any, Any]] = [(v, 0)]
    elif isinstance(v, dict):
        items = list(v.items())
    else:
        try:
            if isinstance(v, (bytes, torch.Tensor)):
                raise TypeError
            items = [(w, 0) for w in v]
        except TypeError:
            raise TypeError(f"graphify(fn, pad=...): {accepted}, got {v!r}") from None
    if not items:
        raise ValueError(f"graphify(fn, pad=...): {accepted}, got an empty {type(v).__name__}")
    try:
        params = list(inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params) or not params
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params) or not params
    out = []
    for w, value in items:
        if not isinstance(value, (int, float)) or isinstance(value, complex):
            raise TypeError(f"graphify(fn, pad=...): the pad value of {w!r} must be a Python number or bool, "
                            f"got {value!r}")
        if isinstance(w, str):
            p = by_name.get(w)
            if p is None and not var_kw:
                raise ValueError(f"graphify(fn, pad=...): {w!r} names no parameter of the function (its "
                                 f"parameters: {sorted(by_name)})")
            pos = positional.index(p) if p is not None and p in positional else None
            out.append((pos, w if p is None or p.kind != p.POSITIONAL_ONLY else None, value))
        elif isinstance(w, int) and not isinstance(w, bool):
            if w < 0 or (w >= len(positional) and not var_pos):
                raise ValueError(f"graphify(fn, pad=...): argument position {w} is out of range: the function "
                                 f"takes {len(positional)} positional parameter(s)")
            p = positional[w] if w < len(positional) else None
            out.append((w, p.name if p is not None and p.kind == p.POSITIONAL_OR_KEYWORD else None, value))
        else:
            raise TypeError(f"graphify(fn, pad=...): {accepted}, got the key {w!r}")
    seen: dict = {}
    for (pos, name, _v), (w, _) in zip(out, items):
        for key in ((("pos", pos),) if pos is not None else ()) + ((("name", name),) if name is not None else ()):
            if key in seen:
                raise ValueError(f"graphify(fn, pad=...): {seen[key]!r} and {w!r} name the same argument; "
                                 "name it once (by name or by position)")
            seen[key] = w
    return tuple(out)


def check_size_options(fn: Callable[..., Any], record_sizes: Any, buckets: Any, pad: Any,
                       static_argnums: Tuple[int, ...]) -> Tuple[RecordSizes, Optional[Tuple[int, ...]], Any]:
    """Check ``record_sizes``, ``buckets`` and ``pad`` (TypeError / ValueError naming what is accepted)."""
    rs = _record_sizes(record_sizes)
    bk = None if buckets is None else _positive_ints("buckets", buckets)
    if rs is not None and bk is not None:
        raise ValueError("graphify(fn, record_sizes=..., buckets=...): pass one of them: buckets= records "
                         "exactly the buckets (and pads the calls up to the next one), record_sizes= picks "
                         "sizes without padding")
    if bk is None and pad is not None:
        raise ValueError("graphify(fn, pad=...): pad= says which arguments are padded up to a bucket; pass "
                         "buckets=(...) with it (e.g. buckets=(1, 2, 4, 8, 16, 32, 64))")
    if bk is not None and pad is None:
        raise ValueError("graphify(fn, buckets=...): name the arguments whose dim 0 is padded up to the "
                         "bucket and the pad value, e.g. pad={'x': 0} (or pad='x', pad=(0, 'mask'))")
    spec = _pad(fn, pad) if pad is not None else None
    if spec is not None and any(pos in static_argnums for pos, _n, _v in spec if pos is not None):
        raise ValueError("graphify(fn, pad=...): a static argument cannot be padded (it is not a tensor input)")
    return rs, bk, spec

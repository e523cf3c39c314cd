"""Sizes that vary: which batch sizes get a recording (``record_sizes=``), and buckets (``buckets=``, ``pad=``).

This module checks the two options and keeps one graphified function's books on sizes:
how many calls each size had, which sizes are recorded, the calls that ran eagerly
(by size) and the buckets whose padding was checked. It never binds, traces, records or
runs anything: ``_sized`` routes the calls with these books (it sits before ``_run``).

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
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

__all__ = ["check_size_options", "Sizes", "new_sizes", "describe_lines", "explain_line", "pad_size"]

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


class Sizes:
    """One graphified function's books on sizes (``record_sizes`` or ``buckets``)."""

    __slots__ = ("fixed", "top", "buckets", "pad", "counts", "eager", "above", "dims", "varying",
                 "hits_mark", "fast_size", "checked")

    def __init__(self, record_sizes: RecordSizes, buckets: Optional[Tuple[int, ...]], pad: Optional[PadSpec]):
        self.fixed = frozenset(record_sizes) if isinstance(record_sizes, tuple) else None
        self.top = record_sizes if isinstance(record_sizes, int) else None
        self.buckets, self.pad = buckets, pad
        self.counts: Dict[int, int] = {}  # calls per size (record_sizes=N)
        self.eager: Dict[int, int] = {}  # calls run eagerly, not recorded, per size
        self.above = 0  # of those, calls above the largest bucket
        self.dims: Dict[Any, List[int]] = {}  # per tree structure: dim 0 of each leaf at its first call (-1: none)
        self.varying: Dict[Any, List[int]] = {}  # per tree structure: the leaves whose dim 0 varied
        self.hits_mark = 0  # the function's hits when a call last went the usual way
        self.fast_size: Optional[int] = None  # the size of that call (its fast path's hits are that size's)
        self.checked: Set[int] = set()  # buckets whose padded first call was checked against eager

    @property
    def allowance(self) -> int:
        """New signatures the storm warning lets pass besides its threshold: the sizes asked for."""
        return len(self.fixed or ()) or self.top or len(self.buckets or ())

    def size_of(self, leaves: List[Any], spec: Any, note: bool = True) -> Optional[int]:
        """The batch size of a call without ``pad=`` (see the module docstring), or None (``note``: keep its dims)."""
        d0 = [x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else -1 for x in leaves]
        first = self.dims.get(spec, d0)
        var = list(self.varying.get(spec, ()))
        for i, (a, b) in enumerate(zip(first, d0)):
            if a != b and a >= 0 and b >= 0 and i not in var:
                var.append(i)
        if note:
            self.dims.setdefault(spec, d0)
            self.varying[spec] = var
        if var:
            return d0[min(var)]
        for s in reversed(d0):
            if s >= 0:
                return s
        return None

    def selected(self, n: int, hits: int) -> bool:
        """Count a call of size ``n`` (``hits``: the function's hits now) and say whether its size is recorded."""
        if self.fixed is not None:
            return n in self.fixed
        c = self.counts
        if self.fast_size is not None and hits > self.hits_mark:  # fast-path replays since: of that size
            c[self.fast_size] = c.get(self.fast_size, 0) + hits - self.hits_mark
        self.hits_mark = hits
        c[n] = c.get(n, 0) + 1
        if c[n] < 2:
            return False
        ahead = sum(1 for s, k in c.items() if k > c[n] or (k == c[n] and s < n))
        return ahead < (self.top or 0)

    def went_usual_way(self, n: Optional[int], hits: int) -> None:
        """A call of size ``n`` replayed or recorded: later fast-path hits are counted as that size's."""
        self.hits_mark, self.fast_size = hits, n

    def bucket_for(self, n: int) -> Optional[int]:
        """The smallest bucket that holds ``n`` rows, or None (above the largest: run eagerly)."""
        for b in self.buckets or ():
            if b >= n:
                return b
        return None

    def ran_eagerly(self, n: int, above: bool = False) -> None:
        """Count a call of size ``n`` run eagerly (not selected, or above the largest bucket)."""
        self.eager[n] = self.eager.get(n, 0) + 1
        self.above += above


def new_sizes(fn: Callable[..., Any], opts: Any) -> Optional[Sizes]:
    """The books of a function made with these (checked) options (None: neither record_sizes nor buckets)."""
    if opts.record_sizes is None and opts.buckets is None:
        return None
    return Sizes(*check_size_options(fn, opts.record_sizes, opts.buckets, opts.pad, opts.static_argnums))


def _by_size(eager: Dict[int, int]) -> str:
    return ", ".join(f"size {n}: {k}" for n, k in sorted(eager.items()))


def describe_lines(g: Any) -> List[str]:
    """What ``f.describe()`` says of sizes: the recorded ones, and the calls that ran eagerly by size."""
    sz: Optional[Sizes] = g.__dict__.get("_sizes")
    if sz is None:
        return []
    if sz.buckets is not None:
        lines = [f"buckets={sz.buckets}: calls padded up to the next bucket; checked against eager: "
                 f"{sorted(sz.checked) or 'none yet'}"]
        if sz.eager:
            lines.append(f"ran eagerly above the largest bucket, not recorded: {sz.above} call(s) ({_by_size(sz.eager)})")
        return lines
    what = (f"record_sizes={tuple(sorted(sz.fixed))}" if sz.fixed is not None
            else f"record_sizes={sz.top} (the most frequent sizes seen twice or more; calls so far: "
                 f"{_by_size(sz.counts) or 'none'})")
    n = sum(sz.eager.values())
    return [f"{what}: ran eagerly, not recorded (size not selected): {n} call(s)"
            + (f" ({_by_size(sz.eager)})" if n else "")]


def explain_line(g: Any, n: Optional[int]) -> Optional[str]:
    """What ``f.explain(...)`` says of a call of batch size ``n`` that would not be recorded (None: it would)."""
    sz: Optional[Sizes] = g.__dict__.get("_sizes")
    if sz is None or n is None:
        return None
    if sz.buckets is not None:
        b = sz.bucket_for(n)
        if b is None:
            return (f"{g._desc}: batch size {n} is above the largest bucket ({sz.buckets[-1]}): runs eagerly, "
                    "not recorded")
        return None if b == n else f"{g._desc}: batch size {n} is padded to bucket {b}, whose recording it replays"
    if sz.fixed is not None and n not in sz.fixed:
        return (f"{g._desc}: batch size {n} is not in record_sizes: runs eagerly, not recorded "
                f"({sz.eager.get(n, 0)} such call(s) so far)")
    if sz.top is not None:
        c = sz.counts.get(n, 0)
        ahead = sum(1 for s, k in sz.counts.items() if k > c + 1 or (k == c + 1 and s < n))
        if c + 1 < 2 or ahead >= sz.top:
            return (f"{g._desc}: batch size {n} is not among the {sz.top} most frequent sizes seen twice or more "
                    f"({c} call(s) so far): runs eagerly, not recorded")
    return None


def pad_size(sz: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Optional[int], List[Tuple[Any, Any]]]:
    """The batch size of a call under ``pad=`` and the padded arguments ``(where, value)`` (where: position or name)."""
    found: List[Tuple[Any, Any]] = []
    for pos, name, value in sz.pad or ():
        if pos is not None and pos < len(args):
            found.append((pos, value))
        elif name is not None and name in kwargs:
            found.append((name, value))
    n: Optional[int] = None
    for where, _v in found:
        a = args[where] if isinstance(where, int) else kwargs[where]
        for x in _tensor_leaves(a):
            if x.dim() == 0:
                continue
            if n is None:
                n = x.shape[0]
            elif x.shape[0] != n:
                label = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
                raise ValueError(f"the arguments named by pad= must agree on dim 0 (the batch): {label} has a "
                                 f"tensor of {x.shape[0]} rows, another padded tensor has {n}")
    return n, found


def _tensor_leaves(a: Any) -> List[torch.Tensor]:
    from ._tree import flatten

    return [x for x in flatten(a)[0] if isinstance(x, torch.Tensor)]

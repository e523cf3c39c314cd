"""Calls of a function with ``record_sizes=`` or ``buckets=``: routed by their batch size.

A stage between the fast-path miss (``_calls``) and ``_run``, taken only by functions
made with one of the two options (and only outside torch.func transforms). It takes the
call as the caller passed it and either runs it eagerly (a size not selected, or above
the largest bucket: correct numbers, nothing recorded, no warning, counted by size in
``_sizes.Sizes``), or hands ``_run`` the call (``record_sizes``), or the call with the
arguments ``pad=`` names padded along dim 0 up to the next bucket (``buckets``), and
slices the outputs back to the true batch.

Padding is right only where rows do not interact. Each signature's first padded call is
checked (a bucket may hold several: another static argument, ``module.train()`` after
``eval()``): the traced signature must not update its inputs or state in place (padded rows
would reach them), every tensor output must have the bucket's rows along dim 0 (and, where
the call is differentiated, finite padded rows: a gradient through them would be nan), and
the sliced outputs must equal an unpadded eager run of the same call (per-dtype tolerance);
otherwise a :class:`GraphifyError` says which bucket, which output, by how much, why and
the fix. Outputs are copies (``t[:n].clone()``; a batch of a bucket's own size too): they
never go stale.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ._bind import Bound, bind
from ._errors import GraphifyError, OverwrittenOutputError
from ._key import Call, global_key
from ._lookup import lookup, thread_state
from ._run import run
from ._sizes import PadSpec, RecordSizes, check_size_options
from ._tree import flatten, leaf_paths, unflatten

__all__ = ["sized_call", "TOLERANCE", "Sizes", "new_sizes", "describe_lines", "explain_line", "pad_size",
           "refuse_buffers"]

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
    gave_way = len(sz.dropped)
    selected = n is None or sz.selected(n, g._hits)
    if len(sz.dropped) > gave_way:
        # a size gave way: every thread's next call comes here (not its fast path) and closes its recordings
        for s in list(g._states):
            s.drop_fast()
    if len(sz.dropped) > sz.seen.n:
        _drop_sizes(g, sz)
    if not selected:
        assert n is not None
        sz.ran_eagerly(n)  # (not recorded, not traced: no signature, so no storm warning)
        return g._fn(*args, **kwargs)
    st = thread_state(g) if sz.top is not None else None
    before = st.last if st is not None else None
    out = run(g, b, False)
    sz.went_usual_way(n, g._hits)
    if st is not None and n is not None and st.last is not None and st.last is not before:
        # the signature this call recorded or replayed (a call that ran eagerly, the first of a
        # signature that touches state, left another size's as the last: not this size's)
        sz.keys.setdefault(n, set()).add(st.last.key)
    return out


def refuse_buffers(g: Any, sz: Sizes, b: Bound, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """``f.input_buffers(...)`` of a call whose size no recording of its own serves: refused, saying why."""
    if sz.buckets is not None:
        try:
            n, _ = pad_size(sz, args, kwargs)
        except ValueError as err:
            raise ValueError(f"{g._desc}.input_buffers(...): {err}") from None
        bucket = None if n is None else sz.bucket_for(n)
        if n is not None and bucket != n:
            where = f"padded to bucket {bucket}" if bucket is not None else "above the largest bucket: run eagerly"
            raise GraphifyError(
                f"{g._desc}.input_buffers(...): a call of batch {n} is {where}, so it is copied (padded) whatever "
                f"tensors it gets: no buffer of its own would skip a copy.\nFix: ask with an example of a bucket's "
                f"own size ({sz.buckets}), and write batches of that size into the buffers.")
        return
    n = sz.size_of(b.leaves, b.spec, note=False)
    if n is not None and sz.fixed is not None and n not in sz.fixed:
        raise GraphifyError(
            f"{g._desc}.input_buffers(...): size {n} is not among record_sizes={sorted(sz.fixed)}, so calls of it run "
            "eagerly and have no recording, nor buffers.\nFix: ask with an example of a recorded size, or add "
            f"{n} to record_sizes=.")


def _drop_sizes(g: Any, sz: Sizes) -> None:
    """Close this thread's recordings of the sizes that gave way since its last call (``record_sizes=N``).

    Every thread closes its own (a recording is a thread's), at its next call: N recordings at most
    per thread that calls again.
    """
    st = thread_state(g)
    chosen = sz.chosen
    for m in sz.dropped[sz.seen.n:]:
        if m in chosen:  # (chosen again since: its recordings serve again)
            continue
        for key in sz.keys.get(m, ()):
            e = st.cache.get(key)
            if e is not None:
                st.drop(e)
    sz.seen.n = len(sz.dropped)


def _bucketed(g: Any, sz: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        n, found = pad_size(sz, args, kwargs)
    except ValueError as err:
        raise ValueError(f"{g._desc}: {err}") from None
    bucket = None if n is None else sz.bucket_for(n)
    if n is not None and bucket is None:
        sz.ran_eagerly(n, above=True)  # (above the largest bucket: eagerly, as documented)
        return g._fn(*args, **kwargs)
    if n is None or bucket is None:  # (no size: nothing to pad)
        return run(g, bind(g, args, kwargs), False)
    if bucket == n:  # (a bucket's own size: no padding; copies, as a padded call's outputs are)
        return _copied(run(g, bind(g, args, kwargs), False))
    pargs, pkwargs = _padded(args, kwargs, found, lambda x, value: _pad_tensor(x, value, bucket))
    pb = bind(g, pargs, pkwargs)
    hits, misses = g._hits, g._misses
    entry = _padded_entry(g, pb)
    # each signature's first padded call of each batch size is checked (a bucket may hold several
    # signatures: another static argument, module.train() after eval(); and a function may read
    # the batch size, `if x.shape[0] > 6`, which padding changes)
    first = entry is None or n not in entry.padding_checked
    ref = None
    if first:
        if entry is not None:
            _refuse_updates(g, entry.plan, bucket)
        with torch.no_grad():
            ref = g._fn(*args, **kwargs)
    try:
        out = run(g, pb, False)
    except Exception as err:
        # (the function's own error, a shape mismatch or an index out of range: not gtransform's refusals)
        hint = None if isinstance(err, (GraphifyError, OverwrittenOutputError)) else _unpadded_batch(g, sz, args, kwargs, found, n, bucket)
        if hint is None:
            raise
        raise GraphifyError(hint) from err
    if g._misses > misses:  # (the look above and the call: one miss, not also a hit, nor a second miss)
        g._hits, g._misses = hits, misses + 1
    out = _sliced(g, out, n, bucket, first)
    if first:
        _compare(g, out, ref, n, bucket)
        _probe_rows(g, ref, args, kwargs, found, n, bucket)
        if entry is not None:
            entry.padding_checked.add(n)
        sz.checked.add(bucket)  # (for describe: the buckets a padded call was checked in)
    return out


def _probe_rows(g: Any, ref: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], found: List[Tuple[Any, Any]],
                n: int, bucket: int) -> None:
    """Refuse where the true rows' results depend on what the padded rows hold, whatever this call's data.

    The check against eager sees only this call's values: ``x - x.amax(0)`` or a sort over the batch
    passes it when the pad value is never picked (positive data, pad 0) and fails on a later call.
    So the padded rows are also filled with values above and below every true one (floating
    arguments; others with the true rows again) in two eager runs, whose true rows must match.
    """
    for sign in (1.0, -1.0):
        pargs, pkwargs = _padded(args, kwargs, found, functools.partial(_probe_fill, bucket=bucket, sign=sign))
        with torch.no_grad():
            probe = g._fn(*pargs, **pkwargs)
        leaves, spec = flatten(probe)
        cut = unflatten(spec, [x[:n] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == bucket else x
                               for x in leaves])
        _compare(g, cut, ref, n, bucket, probed=True)


def _probe_fill(x: torch.Tensor, _value: Any, bucket: int, sign: float) -> torch.Tensor:
    """``x`` padded to ``bucket`` rows with values beyond its own (floating), or with its own rows again (not the pad value)."""
    if x.dim() == 0 or x.shape[0] == 0:
        return x
    if not (x.is_floating_point() or x.is_complex()):
        return torch.cat([x] * -(-bucket // x.shape[0]))[:bucket]
    big = 1.0 + float(x.detach().abs().max()) if x.numel() else 1.0
    fill = x.new_full((bucket - x.shape[0], *x.shape[1:]), sign * 4.0 * big)
    return torch.cat([x, fill])


def _copied(out: Any) -> Any:
    """The call's tensor outputs copied (a bucketed call's outputs never go stale)."""
    leaves, spec = flatten(out)
    return unflatten(spec, [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves])


def _pad_tensor(x: torch.Tensor, value: Any, bucket: int) -> torch.Tensor:
    if x.dim() == 0:
        return x
    fill = x.new_full((bucket - x.shape[0], *x.shape[1:]), value)
    return torch.cat([x, fill])


def _padded(args: Tuple[Any, ...], kwargs: Dict[str, Any], found: List[Tuple[Any, Any]],
            pad: Callable[[torch.Tensor, Any], torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The arguments with each tensor of those ``pad=`` names replaced by ``pad(tensor, its pad value)``."""
    pargs, pkwargs = list(args), dict(kwargs)
    for where, value in found:
        a = args[where] if isinstance(where, int) else kwargs[where]
        leaves, spec = flatten(a)
        padded = unflatten(spec, [pad(x, value) if isinstance(x, torch.Tensor) else x for x in leaves])
        if isinstance(where, int):
            pargs[where] = padded
        else:
            pkwargs[where] = padded
    return tuple(pargs), pkwargs


def _padded_entry(g: Any, pb: Bound) -> Any:
    """The signature of the padded call (traced now if new; its miss counted), or None where the look cannot say."""
    st = thread_state(g)
    call = Call(pb.leaves, pb.spec, pb.statics, global_key(), pb.tree)
    e = st.last
    if e is not None and e.match(call) is not None:  # (the usual case: the signature of the last call)
        return e
    try:
        found = lookup(g, st, call, record=False)
    except Exception:  # (the call itself will say: run() meets the same trace)
        return None
    return None if found is None else found[0]


def _refuse_updates(g: Any, plan: Any, bucket: int) -> None:
    """Refuse a padded signature that updates its inputs or state in place, or stores tensors in state (padded rows would reach them)."""
    if plan.mutated:
        paths = ", ".join(plan.in_paths[i] for i in sorted(plan.mutated))
        raise GraphifyError(
            f"{g._desc}: with buckets= (bucket {bucket}), the function updates {paths} in place.\n"
            "Why: the call's arguments are padded along dim 0 up to the bucket, so the padded rows would reach "
            "what it updates (a BatchNorm in training mode updates its running statistics from every row; an "
            "input updated in place would be a padded copy, not the caller's tensor).\n" + _FIX)
    stored = [s.path for s in plan.escape_slots if s.kind != "grad"]
    if stored:
        raise GraphifyError(
            f"{g._desc}: with buckets= (bucket {bucket}), the function stores a tensor in Python state "
            f"({', '.join(stored[:4])}: self.last = h, a forward hook keeping features).\n"
            "Why: the call's arguments are padded along dim 0 up to the bucket, so what it stores holds the padded "
            "rows too, where eager's holds the call's own; only the returned outputs are sliced back.\n"
            "Fix: return the tensor instead (it is sliced back to the call's rows) and store it after the call, "
            "outside the graphified function; or graphify it without buckets= (record_sizes= bounds which sizes "
            "are recorded).")


def _unpadded_batch(g: Any, sz: Sizes, args: Tuple[Any, ...], kwargs: Dict[str, Any], found: List[Tuple[Any, Any]],
                    n: int, bucket: int) -> Optional[str]:
    """The message for a padded call that failed where an argument ``pad=`` does not name has the batch's rows."""
    padded = {where for where, _ in found}
    named = [(k, a) for k, a in enumerate(args) if k not in padded] + [
        (k, a) for k, a in kwargs.items() if k not in padded]
    keys = [k for k, a in named
            if any(isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == n for x in flatten(a)[0])]
    if not keys:
        return None
    rows = ", ".join(f"args[{k}]" if isinstance(k, int) else repr(k) for k in keys)
    one = len(keys) == 1
    return (f"{g._desc}: with buckets= (batch {n} padded to bucket {bucket}), the call failed: {rows} "
            f"also {'has' if one else 'have'} {n} rows along dim 0 but {'is' if one else 'are'} not padded.\n"
            "Why: only the arguments pad= names are padded up to the bucket; another batch argument keeps "
            f"{n} rows and no longer matches the padded ones.\nFix: name it in pad= too (pad={{..., {keys[0]!r}: "
            "<its pad value>}: a name, or a position), or graphify without buckets=.")


def _sliced(g: Any, out: Any, n: int, bucket: int, first: bool) -> Any:
    """The outputs' first ``n`` rows, copied (a bucket's first call: outputs without the bucket's rows refused)."""
    leaves, spec = flatten(out)
    paths = leaf_paths(out, root="output") if first else []
    sliced = []
    for k, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            sliced.append(x)
            continue
        if first and x.requires_grad and x.dim() > 0 and x.shape[0] == bucket and (x.is_floating_point() or x.is_complex()) \
                and not bool(torch.isfinite(x.detach()[n:]).all()):
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), the padded rows of "
                f"{paths[k] if paths else 'output leaf ' + str(k)} are not finite (inf or nan).\n"
                "Why: the call is differentiated, and a gradient through a padded row is zero times that "
                "value: nan, which reaches the parameters' gradients (lin(log(x)) with x padded with 0).\n"
                "Fix: a pad value that keeps the padded rows finite (pad={'x': 1.0} for a log), or graphify "
                "without buckets=.")
        if x.dim() == 0 or x.shape[0] != bucket:
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k] if paths else 'output leaf ' + str(k)} has "
                f"shape {list(x.shape)}: its dim 0 is not the batch, so it cannot be sliced back to {n} rows.\n"
                "Why: an output without a row per input row (a scalar loss, a sum over the batch) mixes the "
                "rows, padded ones included.\n" + _FIX)
        sliced.append(x[:n].clone())
    return unflatten(spec, sliced)


def _compare(g: Any, out: Any, ref: Any, n: int, bucket: int, probed: bool = False) -> None:
    """Refuse where the padded run's sliced outputs differ from eager's (rows interact, or random ops).

    ``probed``: ``out`` is an eager run with the padded rows filled with other values (_probe_rows).
    """
    lo, so = flatten(out)
    lr, sr = flatten(ref)
    paths = leaf_paths(ref, root="output")
    if so != sr:
        raise GraphifyError(f"{g._desc}: with buckets= (bucket {bucket}), the padded call returned another "
                            f"structure than eager: {so} vs {sr}.\n" + _FIX)
    for k, (a, e) in enumerate(zip(lo, lr)):
        if not isinstance(e, torch.Tensor):
            if type(e) in (int, float, bool, str, tuple, torch.Size) and type(a) is type(e) and a != e:
                raise GraphifyError(
                    f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k]} of the padded call is "
                    f"{a!r} where an unpadded eager run of the same call returns {e!r}.\n"
                    "Why: the function returns a Python value of the batch's size (x.shape[0]), which the "
                    "padded call sees as the bucket's.\n" + _FIX)
            continue
        if a.shape != e.shape and e.dim() > 0 and e.shape[0] != n:
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k]} has shape {list(e.shape)} in an "
                f"unpadded eager run: its dim 0 is not the batch ({n} rows), so the padded call's output "
                f"({list(a.shape)}) cannot be sliced back to it (its dim 0 happened to be the bucket's size).\n"
                "Why: an output is sliced back along dim 0; one that stacks something else there (layers, "
                "heads) keeps the batch in another dimension.\n" + _FIX)
        worst = _max_difference(a, e)
        if worst is not None:
            what = ("an eager run of the call padded with other values (above or below every true one) "
                    "differs in the true rows" if probed else "the padded call differs")
            raise GraphifyError(
                f"{g._desc}: with buckets= (bucket {bucket}, batch {n}), {paths[k]} of {what} "
                f"from an unpadded eager run of the same call (max difference {worst}).\n"
                "Why: the rows interact (a BatchNorm in training mode, a sum, mean, max, sort or softmax over dim 0), so "
                "the padded rows change the true rows' results; or the function depends on the batch size "
                "(`if x.shape[0] > 6`, a table sliced by it), which the padded call sees as the bucket's; or it "
                "is random (dropout in training mode). Each signature's first padded call of each batch size is checked against eager.\n" + _FIX)


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


class _Seen(threading.local):
    """How many of the sizes that gave way a thread has closed its recordings of (see _drop_sizes)."""

    n = 0


class Sizes:
    """One graphified function's books on sizes (``record_sizes`` or ``buckets``)."""

    __slots__ = ("fixed", "top", "buckets", "pad", "counts", "eager", "above", "dims", "varying",
                 "hits_mark", "fast_size", "checked", "chosen", "dropped", "seen", "keys")

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
        # record_sizes=N: the sizes recorded (N at most), those that just gave way (their
        # recordings are closed before the next call records), and the signatures of each size
        self.chosen: Dict[int, None] = {}
        self.dropped: List[int] = []  # every size that gave way, in order (each thread reads on from seen.n)
        self.seen = _Seen()
        self.keys: Dict[int, Set[Any]] = {}

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

    def counts_now(self, hits: int) -> Dict[int, int]:
        """The calls per size so far (``hits``: the function's hits now), fast-path replays since the last count included."""
        c = dict(self.counts)
        if self.fast_size is not None and hits > self.hits_mark:
            c[self.fast_size] = c.get(self.fast_size, 0) + hits - self.hits_mark
        return c

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
        chosen = self.chosen
        if n in chosen:
            return True
        if len(chosen) < (self.top or 0):
            chosen[n] = None
            return True
        weakest = self.weakest()
        if c[n] <= GIVE_WAY * c[weakest]:
            return False
        # (a size takes a recorded one's place only once clearly more frequent: under traffic
        # where every size is as frequent, the recordings do not churn)
        del chosen[weakest]
        chosen[n] = None
        self.dropped.append(weakest)
        return True

    def weakest(self) -> int:
        """The least frequent recorded size (the largest among equals)."""
        c = self.counts
        return min(self.chosen, key=lambda s: (c.get(s, 0), -s))

    def would_record(self, n: int) -> bool:
        """Whether the next call of size ``n`` is recorded or replayed (``record_sizes=N``), without counting it."""
        c = self.counts.get(n, 0) + 1
        if n in self.chosen:
            return True
        if c < 2:
            return False
        return len(self.chosen) < (self.top or 0) or c > GIVE_WAY * self.counts.get(self.weakest(), 0)

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


GIVE_WAY = 2
"""``record_sizes=N``: a size takes a recorded size's place once seen more than this many times as often."""


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
            else f"record_sizes={sz.top} (the most frequent sizes seen twice or more; a recorded size gives "
                 f"way only to one seen more than {GIVE_WAY} times as often; recorded: "
                 f"{sorted(sz.chosen) or 'none'}; calls so far: {_by_size(sz.counts_now(g._hits)) or 'none'})")
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
        return None if b == n else (f"{g._desc}: batch size {n} is padded to bucket {b} and runs that bucket's "
                                    "recording (made by the first such call)")
    if sz.fixed is not None and n not in sz.fixed:
        return (f"{g._desc}: batch size {n} is not in record_sizes: runs eagerly, not recorded "
                f"({sz.eager.get(n, 0)} such call(s) so far)")
    if sz.top is not None:
        c = sz.counts_now(g._hits).get(n, 0)
        if not sz.would_record(n):
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
        if a is not None and (isinstance(a, torch.nn.Module) or not _tensor_leaves(a)):
            label = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
            what = "the module itself (on a method, args[0] is self)" if isinstance(a, torch.nn.Module) \
                else f"a {type(a).__name__} with no tensor"
            raise ValueError(
                f"pad= names {label}, which is {what}: there is no batch to pad, so every batch size would "
                "be traced and recorded on its own. Fix: name the batched tensor argument, by name "
                "(pad={'x': 0}) or by its position counting self (pad=1).")
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
    return [x for x in flatten(a)[0] if isinstance(x, torch.Tensor)]

"""Recording a signature and replaying it: the third stage of a call.

It takes a signature's :class:`~gtransform._key.Entry` and the call's tensors (from
``_lookup``) and returns the recording's flat outputs (handed out by ``_liveness``'s
rules: see ``_record``). The first call of a signature records it with every input
copied into static buffers (weak references remember the caller's tensors); the second
call records it again reading in place the inputs passed as the very same tensors
(parameters, persistent state); a state tensor that moved (``.data =``, ``module.to()``)
is read in place at its new address once, then copied. Once a recording is settled, the
generated fast path of ``_fastpath`` serves the thread's next calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import Any, List

import torch

from . import _fastpath, _handed
from ._cache import ThreadState
from ._eager import eager
from ._frozen import Held
from ._key import Entry
from ._log import log
from ._lookup import entry_for
from ._record import Recording, make_recording
from ._tree import flatten_args

__all__ = ["run_flat", "call_plain", "hand_out"]

_Parameter = torch.nn.Parameter
_NO_LOCK = contextlib.nullcontext()


def run_flat(g: Any, e: Entry, st: ThreadState, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Replay ``e``'s recording on the call's tensors (recording it first where needed), under the pool's lock."""
    lock = st.pool.lock
    if lock is None:
        return _run(g, e, st, tensors)
    with lock:
        return _run(g, e, st, tensors)


def call_plain(g: Any, args: Any, kwargs: Any) -> Any:
    """A call that is never differentiated and reaches no state (a forward or backward half of ``_autograd``)."""
    leaves, spec = flatten_args(args, kwargs)
    e, st, tensors = entry_for(g, leaves, spec, ())
    if e is None:
        return eager(g, st, args, kwargs)
    return e.plan.assemble(run_flat(g, e, st, tensors))


def _run(g: Any, e: Entry, st: ThreadState, tensors: List[torch.Tensor]) -> Any:
    rec = e.rec
    if st.fast_rec is not None and st.fast_rec is not rec:
        # the fast path serves the most recently used signature only (LRU order)
        st.drop_fast()
    e.calls += 1
    if rec is None:
        rec = _first_record(g, e, st, tensors)
    elif e.first_refs is not None:
        # Second call of this signature: inputs passed again as the very
        # same tensors (parameters, persistent state) are read in place
        # (not donated ones; the buffers input_buffers handed out are kept for the others).
        refs = e.first_refs
        e.first_refs = None
        same = [i for i in rec.copy_idx if refs[i]() is tensors[i] and not (e.donated and i in e.donated)]
        if same or not rec.statics_ok(tensors):
            rec = e.rec = _rerecord(g, e, st, rec, tensors, set(same) | _kept(e, rec, tensors))
        elif e.look_again and any(refs[i]() is None and not (e.handed and i in e.handed) for i in rec.copy_idx):
            # The first call's tensor is gone, so this one cannot be compared with it: compare the
            # next call's with this one instead, once. (The output of the piece before a graph break,
            # whose own second call recorded it again: it hands out its output objects again from then on.)
            e.look_again = False
            e.first_refs = _refs(e, tensors)
    elif rec.static_idx and not rec.statics_ok(tensors):
        rec = e.rec = _rerecord(g, e, st, rec, tensors, _kept(e, rec, tensors))
    out = rec.run_flat(tensors)
    if e.first_refs is None and st.fast_rec is not rec:
        _install_fast_path(g, e, st, rec)
    return out


def _first_record(g: Any, e: Entry, st: ThreadState, tensors: List[torch.Tensor]) -> Recording:
    """Record a signature for its first time: the caller's tensors copied in, the state and parameters read in place."""
    if e.donated is None:
        e.donated = _handed.donated_inputs(g, e)
    static = set(e.must_static) | e.state_static
    static.update(i for i, t in enumerate(tensors) if type(t) is _Parameter)
    rec = e.rec = _record(g, e, st, tensors, static)
    # weak for the caller's tensors (a batch is not kept alive); the state's and
    # parameters (held by their modules anyway) directly: a weak reference would
    # forbid swapping them (torch.utils.swap_tensors, module.to() with swapping)
    e.first_refs = _refs(e, tensors)
    return rec


def _refs(e: Entry, tensors: List[torch.Tensor]) -> List[Any]:
    """References to a call's tensors, for the next call to compare its own with (see _run)."""
    return [Held(t) if i >= e.n_user or type(t) is _Parameter else weakref.ref(t) for i, t in enumerate(tensors)]


def hand_out(g: Any, e: Entry, st: ThreadState, tensors: List[torch.Tensor]) -> Recording:
    """The recording of ``e`` (recorded on ``tensors`` if there is none) with its static buffers handed out.

    From now on a call that passes a buffer itself skips its copy (see ``_handed``), and the
    signature's later recordings keep these buffers.
    """
    lock = st.pool.lock
    with lock if lock is not None else _NO_LOCK:
        if e.handed is None:
            e.handed = {}  # (buffers of its own, not over memory other signatures write: see _sharing)
        rec = e.rec if e.rec is not None else _first_record(g, e, st, tensors)
        if rec.shared_inputs:
            rec = e.rec = _rerecord(g, e, st, rec, tensors, set(rec.static_idx))
        if not rec.handed:
            rec.handed = rec.special = True
            e.handed = {i: (b, base) for i, b, base in
                        zip(rec.copy_idx, rec.full_bufs, rec.copy_base or [None] * len(rec.copy_idx))}
            rec.fast = None  # (made again, with the buffers' identity checks)
            if st.fast_rec is rec:
                st.drop_fast()
    return rec


def _install_fast_path(g: Any, e: Entry, st: ThreadState, rec: Recording) -> None:
    """Serve the thread's next calls from ``rec``'s generated fast path (made once per recording)."""
    fast = rec.fast
    if fast is None:
        try:
            fast = rec.fast = _fastpath.build_fast_path(g, e, rec, st.pool)
        except Exception:  # pragma: no cover - the generic path still works
            if _fastpath.STRICT:
                raise
            log.debug("%s: no fast path", g._desc, exc_info=True)
            fast = rec.fast = None
    st.fast, st.fast_rec = fast, rec


def _kept(e: Entry, rec: Recording, tensors: List[torch.Tensor]) -> set:
    """Inputs to keep reading in place when re-recording: those still at their address.

    A state tensor that moved (``.data =``, ``module.to()``) is read in place
    at its new address; one that moves again is copied from then on.
    """
    keep = {i for j, i in enumerate(rec.static_idx) if tensors[i].data_ptr() == rec.static_ptrs[j]}
    moved = {i for j, i in enumerate(rec.static_idx) if i not in keep and i in e.state_static}
    if moved:
        e.state_static = e.state_static - (moved & rec.moved_once)
        rec.moved_once |= moved
    return keep | e.must_static | (e.state_static & moved)


def _rerecord(g: Any, e: Entry, st: ThreadState, old: Recording, tensors: List[torch.Tensor], static: Any) -> Recording:
    """Record the signature again with other in-place inputs.

    Output objects the caller dropped keep their identity.
    """
    if log.isEnabledFor(logging.INFO):
        log.info("%s: re-recording a signature: inputs read in place now %s (were %s)",
                 g._desc, [e.plan.in_paths[i] for i in sorted(static)],
                 [e.plan.in_paths[i] for i in old.static_idx])
    new = _record(g, e, st, tensors, static)
    new.moved_once = old.moved_once
    new.adopt_outputs(old)  # old is closed after new's first replay
    if st.fast_rec is old:
        st.drop_fast()
    return new


def _record(g: Any, e: Entry, st: ThreadState, tensors: List[torch.Tensor], static: Any) -> Recording:
    t0 = time.perf_counter()
    rec = make_recording(e.plan, tensors, sorted(static), st.pool, g._desc, e.cuda, g._fuse, e.donated or (), e.handed)
    if log.isEnabledFor(logging.INFO):
        log.info(
            "%s: recorded %s (%s): %d ops, %d inputs (%d read in place, %d copied), %d outputs, %.1f ms",
            g._desc, "a CUDA graph" if e.cuda else "the traced graph", e.brief(),
            e.plan.op_count, len(tensors), len(rec.static_idx), len(rec.copy_idx),
            len(e.plan.out_entries), (time.perf_counter() - t0) * 1e3,
        )
    return rec

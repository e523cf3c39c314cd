"""Recordings: one traced signature, bound to buffers, ready to replay.

The two backends share everything (static input buffers, copy-in, copy-back
of in-place updates, the output pool and liveness) but how a replay happens:

* CPU: the traced fx graph runs over the static buffers; its results are
  copied into the recording's output memory.
* CUDA: the traced graph is captured once into a ``torch.cuda.CUDAGraph``
  whose memory comes from the function's private pool; a replay is one
  ``graph.replay()``.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _distributed, _handed, _sharing
from ._compat import (
    clear_cublas_workspaces,
    end_route_to_pool,
    foreach_copy_,
    neg_view,
    release_pool,
    route_to_pool,
)
from ._compat import increment_version as _increment_version
from ._compat import storage_use_count as _use_count
from ._errors import GraphifyError, RerecordWarning
from ._liveness import Handout, OutputGroup, Pin, PoolState, StaleOutput, live_pins, take_back
from ._rewrite import run_graph
from ._state import EscapeWriter
from ._trace import Plan

__all__ = ["Recording", "make_recording"]

# dtypes torch's foreach copy takes on every device (CUDA's has no kernel for complex32 or the
# unsigned types beyond uint8: a recording of such inputs copies them one by one)
_FOREACH_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                             torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                             torch.int64))


def _copy_each(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s)


def _copier(tensors: Sequence[torch.Tensor]) -> Any:
    """The batched copy for these tensors (the destinations', or the sources', of every call).

    ``torch._foreach_copy_`` where it has a kernel, once per dtype: over tensors of several
    dtypes it copies one tensor at a time, slower than a ``copy_`` each (H200: 21 us for a
    float32 and three float64 scalars, against 12 for one call per dtype).
    """
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    if len(by_dtype) <= 1:
        return foreach_copy_ if all(dt in _FOREACH_DTYPES for dt in by_dtype) else _copy_each
    parts = [(idx, foreach_copy_ if dt in _FOREACH_DTYPES else _copy_each) for dt, idx in by_dtype.items()]
    n = len(tensors)

    def copy_by_dtype(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if len(dsts) != n:  # (some of them: those input_buffers' callers did not pass as the buffers)
            _copier(dsts)(dsts, srcs)
            return
        for idx, copy in parts:
            copy([dsts[i] for i in idx], [srcs[i] for i in idx])

    return copy_by_dtype


def _toggle_bits(v: torch.Tensor, e: Any) -> torch.Tensor:
    """View ``v`` of the caller's tensor with the conjugate / negative bits entry ``e`` toggles.

    ``as_strided`` keeps the caller's tensor's bits; the function's output toggled them
    where it did (``z.conj()``: see ``OutEntry.conj``).
    """
    if e.conj:
        v = v.conj()
    if e.neg:
        v = neg_view(v)
    return v


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements tile a block of memory exactly once."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _buffer_like(t: torch.Tensor) -> Tuple[torch.Tensor, Optional[Tuple[int, ...]]]:
    """A static buffer with ``t``'s size, dtype, device and strides.

    The graph was traced for those strides, and kernels may depend on them: SDPA's
    attention bias is padded to an aligned row stride, sliced back and expanded over the
    batch (stride 0), and memory-efficient attention's backward checks that row stride.

    Returns:
        The buffer, and for an input with broadcast (stride-0) dimensions the size of
        the part a copy writes: those dimensions narrowed to 1 (a copy cannot write into
        memory that several elements share, and strides are part of the signature, so
        every later input repeats its values along them too). Only other self-overlapping
        layouts (a hand-made ``as_strided``) get a contiguous buffer.
    """
    if is_non_overlapping_and_dense(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device), None
    shape, stride = tuple(t.shape), t.stride()
    base = tuple(1 if st == 0 else n for n, st in zip(shape, stride))
    if t.numel() > 0 and _non_overlapping(base, stride):
        extent = 1 + sum((n - 1) * st for n, st in zip(base, stride))
        buf = torch.empty(extent, dtype=t.dtype, device=t.device).as_strided(shape, stride)
        return buf, (base if base != shape else None)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device), None


def _non_overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether no two elements of a tensor of this size and strides share memory (sufficient test)."""
    reach = 0  # the furthest offset the dimensions with smaller strides reach
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n > 1), key=lambda p: p[1]):
        if st <= reach:
            return False
        reach += (n - 1) * st
    return True


def narrowed(t: torch.Tensor, base: Tuple[int, ...]) -> torch.Tensor:
    """``t`` with its broadcast dimensions narrowed to 1 (see _buffer_like)."""
    return t.as_strided(base, t.stride(), t.storage_offset())


class Recording:
    """One signature of a function, with a fixed choice of in-place inputs.

    Args:
        plan: the traced signature.
        tensors: the flat tensor inputs of the call that records it.
        static_idx: indices of the inputs read in place (no copy).
        pool: liveness state of the memory pool this recording writes.
        desc: ``graphify(name)`` for messages.
    """

    backend = "cpu"
    BUMPS = False  # whether a replay must bump the versions of the inputs it writes in place (see bump_idx)

    def __init__(self, plan: Plan, tensors: Sequence[torch.Tensor], static_idx: Sequence[int], pool: PoolState, desc: str,
                 fuse: bool = False, donate: Any = (), reuse: Any = None):
        self.plan = plan
        self.gm: Any = plan.fused() if fuse else plan.gm
        self.pool = pool
        self.desc = desc
        n = len(tensors)
        st = sorted(set(static_idx))
        self.static_idx = tuple(st)
        self.static_ptrs = [tensors[i].data_ptr() for i in st]
        sset = set(st)
        self.copy_idx = tuple(i for i in range(n) if i not in sset)
        # (reuse: the buffers input_buffers handed out for this signature, see _handed; None:
        # none are, and the buffers may lie over memory the pool's signatures share)
        share = _sharing.input_buffers_shared(pool, reuse)
        self.shared_inputs: List[torch.Tensor] = []  # the pool's memory this recording's buffers lie over
        made = [reuse[i] if reuse and i in reuse else self._static_buffer(tensors[i], i, share) for i in self.copy_idx]
        full = self.full_bufs = [b for b, _ in made]
        # the copy-in's destinations and, per copied input, the size its source is
        # narrowed to (None: copied whole; see _buffer_like)
        self.copy_base: List[Optional[Tuple[int, ...]]] = [base for _, base in made]
        self.bufs = [b if base is None else narrowed(b, base) for b, base in made]
        if not any(self.copy_base):
            self.copy_base = []
        self.copier = _copier(self.bufs)
        if self.bufs:
            # warm-up and capture see the call's real inputs: no kernel ever reads
            # uninitialised memory (an embedding index, a cross_entropy target)
            self.copier(self.bufs, self.copy_sources(tensors))
        args: List[Any] = list(tensors)
        for i, b in zip(self.copy_idx, full):
            args[i] = b
        self.gm_args = args
        # inputs read in place that the graph writes: a CUDA replay moves no version counter, so
        # the call bumps theirs, as eager's in-place ops would (autograd's check of saved tensors,
        # another function's frozen reads of them); the CPU replay runs the ops themselves
        self.bump_idx = tuple(i for i in st if i in plan.mutated) if self.BUMPS else ()
        cb = [(i, b) for i, b in zip(self.copy_idx, full) if i in plan.mutated]
        self.cb_idx = tuple(i for i, _ in cb)
        self.cb_bufs = [b for _, b in cb]
        self.cb_copier = _copier(self.cb_bufs)
        self.groups: List[OutputGroup] = []
        self.handout = Handout([])
        self.slots: Dict[int, int] = {}  # gm output -> index in the handout's objects
        self.group_keys: List[int] = []  # a gm output index of each group
        self.replays = 0
        self.must_retire = False
        self.in_shared_pool = False  # the active generation's memory is shared (see _Slot.shared)
        self.released = False  # CUDA: its first generation's output memory was given back (see _sharing)
        self.fpool: Any = None  # CUDA: the function's pool its first generation was captured in
        # views of the active generation's outputs that were found alive (see
        # PoolState.begin_call), for _maybe_retire
        self.pins: List[Pin] = []
        # Output memory generations (see _maybe_retire): the active one is written by
        # the replays; the others keep the values of views the caller holds.
        self.ring: List[_Slot] = []
        self.active = 0
        self.cliff_warned = False
        self.fast: Any = None
        self._pending_adopt: Optional[Recording] = None
        self.moved_once: set = set()  # state inputs that moved once (see Graphified._kept)
        # tensors left in Python state (p.grad...): written back after each replay
        self.escapes: Optional[EscapeWriter] = None
        if plan.escape_slots:
            self.escapes = EscapeWriter(plan.escape_slots, desc,
                                        handed=[k for k, r in enumerate(plan.escape_returned) if r is not None])
        self.last_outs: Sequence[torch.Tensor] = ()
        # .grad the function sets to None and does not make again (see Plan.grad_cleared)
        self.grad_cleared: List[torch.Tensor] = list(plan.grad_cleared)
        # inputs the function returns, or views of (see rescue_returned)
        self.returned_inputs = sorted({e.index for e in plan.tensor_entries if e.kind == "input"})
        # donated inputs that are copied in and neither returned nor left in state (see _handed)
        kept = set(self.returned_inputs) | {e.index for e in plan.escape_entries if e.kind == "input"}
        self.donate_idx = tuple(i for i in self.copy_idx if i in donate and i not in kept)
        self.handed = bool(reuse)
        self.special = self.handed or bool(self.donate_idx)  # (copy-in and copy-back by _handed)

    def _static_buffer(self, t: torch.Tensor, i: int, share: bool) -> Tuple[torch.Tensor, Optional[Tuple[int, ...]]]:
        """A static buffer for input ``i`` (see ``_buffer_like``), over the pool's shared memory if ``share``."""
        if share and is_non_overlapping_and_dense(t):
            buf, whole = _sharing.input_buffer(self.pool, i, t)
            self.shared_inputs.append(whole)
            return buf, None
        return _buffer_like(t)

    def copy_sources(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """What the copy-in reads: the copied inputs, broadcast ones narrowed."""
        if not self.copy_base:
            return [tensors[i] for i in self.copy_idx]
        return [tensors[i] if base is None else narrowed(tensors[i], base) for i, base in zip(self.copy_idx, self.copy_base)]

    # -- recording ---------------------------------------------------------
    def _bind_outputs(self, outs: Sequence[torch.Tensor]) -> None:
        """Group the pool outputs by storage and make their liveness groups."""
        by_store: Dict[Any, List[int]] = {}
        for e in self.plan.out_entries:
            if e.kind != "pool":
                continue
            t = outs[e.index]
            if t is None:
                raise GraphifyError(self._undefined_output(e.index))
            by_store.setdefault(StorageWeakRef(t.untyped_storage()), []).append(e.index)
        start = 0
        for ks in by_store.values():
            members: List[Tuple[Any, Any, int, torch.dtype]] = []
            first: Dict[int, int] = {}
            for k in ks:
                t = outs[k]
                m = first.get(id(t))
                if m is None:
                    m = first[id(t)] = len(members)
                    members.append((tuple(t.shape), t.stride(), int(t.storage_offset()), t.dtype))
                self.slots[k] = start + m
            self.groups.append(OutputGroup(outs[ks[0]].untyped_storage(), members))
            self.group_keys.append(ks[0])
            start += len(members)
        self.handout = Handout(self.groups, owner=self)

    def _undefined_output(self, index: int) -> str:
        """The message for a graph output that ran as an undefined tensor but traced as one."""
        out = [n for n in self.plan.gm.graph.nodes if n.op == "output"][0]
        node = list(out.args[0])[index]
        while getattr(node, "target", None) is operator.getitem and node.args:
            node = node.args[0]
        op = getattr(node, "target", node)
        return (
            f"{self.desc}: operation {op} returned no tensor (an undefined one) when run, where "
            "tracing it made a tensor, so the recording has nothing to hand out or save.\n"
            "Why: some kernels decide at run time whether to make an output (e.g. from the "
            "grad mode); a recording replays without grad mode.\n"
            "Fix: call the function under torch.no_grad() if no gradient is needed, or compute "
            "that part outside the graphified function; please report the operation to gtransform."
        )

    # -- replay ------------------------------------------------------------
    def statics_ok(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the in-place inputs are at the addresses this recording reads.

        The address is what matters: a graph reads memory, so any tensor of
        the recorded layout at the recorded address is read correctly.
        """
        for i, p in zip(self.static_idx, self.static_ptrs):
            if tensors[i].data_ptr() != p:
                return False
        return True

    def _replay(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- output generations ---------------------------------------------------
    def _start_ring(self, slot: _Slot) -> None:
        """The first generation: the output groups just bound (see _bind_outputs)."""
        slot.groups = list(self.groups)
        slot.handout = self.handout
        self.ring = [slot]
        self.active = 0

    def _maybe_retire(self, statics: Sequence[torch.Tensor] = ()) -> None:
        """The caller keeps views of the active generation's outputs: write elsewhere.

        The caller's views of an earlier call then keep their values instead
        of being written over. A generation whose views were all dropped is
        used again, with its own output objects (no capture, no new objects);
        otherwise a new one is made (CUDA: captured into a private pool of its
        own), up to RING_SLOTS. Beyond that the active generation is replaced
        by new memory (its old memory stays with the views) and, where that
        costs a capture per call, a warning says so once.

        Args:
            statics: the call's in-place inputs (``static_idx`` order) where the
                caller has not bound them yet (the fast path): bound only if a
                new generation is captured (see bind_statics).
        """
        self.must_retire = False
        ring = self.ring
        a = self.active
        cur = ring[a]
        # found alive by this call's poison (PoolState.begin_call), or by an
        # earlier call of another function of the pool: checked again below
        # before anything costly
        own = cur.pins = self.pins
        self.pins = []
        # views of outputs in the pool's shared memory (this recording's or another's, see
        # PoolState.shared_pins): no generation in that memory is written while they live
        pool = self.pool
        if not own and not (cur.shared and pool.shared_pins and pool.shared_pinned()):
            return  # (called for the pool's views only, which this generation cannot write)
        n = len(ring)
        j = a
        for _ in range(n - 1):
            j = j + 1 if j + 1 < n else 0
            slot = ring[j]
            pins = slot.pins
            if pins:
                pins = slot.pins = [p for p in pins if _use_count(p[0]) > p[1]]
                if pins:
                    continue
            if slot.shared and pool.shared_pins and pool.shared_pinned():
                continue
            self._use_slot(j)
            return
        if not cur.pinned() and not (cur.shared and pool.shared_pins and pool.shared_pinned()):
            # the views went (e.g. before this call, after another's)
            if self.handout.need_fresh:
                self.handout.fresh(views_gone=True)
            return
        if statics:
            args = self.gm_args
            for i, t in zip(self.static_idx, statics):
                args[i] = t
        if n < RING_SLOTS:
            ring.append(self._new_slot())
            self._use_slot(n)
            return
        if self.CLIFF and not self.cliff_warned:
            self.cliff_warned = True
            warnings.warn(
                f"{self.desc}: the caller keeps views of the outputs of {n} earlier calls "
                f"(all {RING_SLOTS} output generations a recording alternates between are "
                "held), so every call now records the function again to keep those "
                "views' values (a CUDA graph capture per call: slow).\n"
                "Fix: keep copies instead of views (e.g. history.append(out[0].clone())), "
                f"or keep views of fewer than {RING_SLOTS} calls.",
                RerecordWarning,
                stacklevel=4,
            )
        cur.handout.detach()  # the old memory stays with the caller's views
        ring[self.active] = self._new_slot(replacing=cur)
        self._use_slot(self.active)

    CLIFF = False  # whether a new generation costs a capture

    def _new_slot(self, replacing: Optional[_Slot] = None) -> _Slot:  # pragma: no cover - overridden
        raise NotImplementedError

    def _slot_groups(self, slot: _Slot, storages: Sequence[torch.UntypedStorage]) -> None:
        """Give a new slot output groups like the active one's, over ``storages``."""
        slot.groups = [OutputGroup(st, g.members) for st, g in zip(storages, self.groups)]
        slot.handout = Handout(slot.groups, owner=self)

    def _use_slot(self, j: int) -> None:
        """Write generation ``j`` from now on: its output groups are handed out."""
        slot = self.ring[j]
        self.active = j
        self.groups = slot.groups
        h = self.handout = slot.handout
        if h.need_fresh:  # poisoned on its last call: its objects now
            h.fresh(views_gone=True)
        self._activate(slot)

    def _activate(self, slot: _Slot) -> None:
        """Backend: make ``slot`` the one replays write."""

    def run_flat(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Copy in, poison stale outputs, replay, copy back.

        Returns:
            The tensor outputs in the traced graph's order.
        """
        special = self.special
        if special:
            own, gone, freed = _handed.copy_in(self, tensors)
        elif self.copy_idx:
            self.copier(self.bufs, self.copy_sources(tensors))
        if self.static_idx:
            self.bind_statics(tensors)
        self.pool.begin_call(self.desc)
        if self.returned_inputs:
            self.rescue_returned(tensors)
        if self.must_retire or self.pool.shared_pins:
            self._maybe_retire()
        esc = self.escapes
        if esc is not None:
            esc.before_replay()
        self._replay()
        self.replays += 1
        if self.bump_idx:
            _increment_version([tensors[i] for i in self.bump_idx])
        if self._pending_adopt is not None:
            self._adopt_now()
        if special:
            if self.cb_idx:
                _handed.copy_back(self, tensors, _handed.skip_set(own, freed))
            if gone:
                _handed.invalidate(self, tensors, gone)
        elif self.cb_idx:
            try:
                self.cb_copier([tensors[i] for i in self.cb_idx], self.cb_bufs)
            except RuntimeError:  # OverwrittenOutputError, or an input with the conj / neg bit
                self.copy_back_stale([tensors[i] for i in self.cb_idx])
        if esc is not None:
            esc.write(self.escape_values(tensors))
        for t in self.grad_cleared:
            t.grad = None
        if self.groups:
            self.pool.outstanding.append(self.handout)
        res: List[torch.Tensor] = []
        slots = self.slots
        objs = self.handout.objs
        for e in self.plan.tensor_entries:
            if e.kind == "pool":
                res.append(objs[slots[e.index]])
            else:
                t = tensors[e.index]
                if e.identical:
                    res.append(t)
                else:
                    v = t.as_strided(e.size, e.stride, t.storage_offset() + e.rel_offset)
                    res.append(_toggle_bits(v, e) if e.conj or e.neg else v)
        return res

    def bind_statics(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the in-place inputs this call's tensors (at the recorded addresses, see statics_ok).

        A capture (CUDA: a new output generation) and the CPU replay run on these
        objects; the ones of an earlier call may be stale outputs since, or have
        other memory (``w.data = ...``) while this call's tensor sits at the
        recorded address: a CUDA graph reads the address, and so must they.
        """
        args = self.gm_args
        for i in self.static_idx:
            args[i] = tensors[i]

    def rescue_returned(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give inputs that this call returns (or views of them) their values in memory of their own.

        An earlier output fed back in and returned (``a, b = f(a, b)`` with
        ``return b, a + b``) was poisoned as this call began (the caller holds
        it), and this replay may write its memory. Eager returns that very
        tensor with its values: it is copied to memory of its own before the
        replay, and made a normal tensor again.
        """
        for i in self.returned_inputs:
            if type(tensors[i]) is StaleOutput:
                take_back(tensors[i], keep_values=True)

    def copy_back_stale(self, targets: Sequence[torch.Tensor]) -> None:
        """Copy back in-place updates into inputs that this call's start made stale.

        An output of an earlier call fed back into a function that updates it in
        place (``s = step(s)``, or another function of the same pool): the input
        was read into a static buffer before the pool poisoned it, and eager
        updates it in place. It gets memory of its own (the pool's may hold this
        call's outputs now), is made a normal tensor again and receives the update.

        Also the copy-back into an input with the conjugate or negative bit set
        (``f(z.conj())``), which the bulk copy refuses to write through: a copy per
        tensor does. (Anything else the bulk copy raised, it raises again here.)
        """
        for t in targets:
            if type(t) is StaleOutput:
                take_back(t, keep_values=False)
        if any(t.is_conj() or t.is_neg() for t in targets):
            for t, b in zip(targets, self.cb_bufs):
                t.copy_(b)
            return
        self.cb_copier(list(targets), self.cb_bufs)

    def escape_values(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The tensors to write back into Python state after this replay.

        A graph output the function both leaves in state and returns (``self.last = h; return h``,
        ``return p.grad`` after ``backward()``) is one tensor in eager: the slot gets the object
        handed out (see EscapeWriter.handed), whose staleness the pool's handout governs.
        """
        outs = self.last_outs
        plan = self.plan
        res = []
        for e, r in zip(plan.escape_entries, plan.escape_returned):
            if e.kind == "pool":
                res.append(outs[e.index] if r is None else self.handout.objs[self.slots[plan.out_entries[r].index]])
            else:
                t = tensors[e.index]
                if e.identical:
                    res.append(t)
                else:
                    v = t.as_strided(e.size, e.stride, t.storage_offset() + e.rel_offset)
                    res.append(_toggle_bits(v, e) if e.conj or e.neg else v)
        return res

    def adopt_outputs(self, old: Recording) -> None:
        """Hand out ``old``'s output objects from now on (see Handout.adopt).

        Done at this recording's first replay, after the pool poisoned what
        the caller still holds of ``old``'s outputs; ``old`` is closed then.
        """
        self._pending_adopt = old
        if old.escapes is not None and self.escapes is not None:
            self.escapes.last = old.escapes.last

    def _adopt_now(self) -> None:
        old = self._pending_adopt
        self._pending_adopt = None
        if old is None:
            return
        if len(old.groups) == len(self.groups):
            self.handout.adopt(old.handout)
        old.close()

    def close(self) -> None:
        """Release the recording; outputs the caller holds stay valid."""
        self.handout.detach()
        for slot in self.ring:
            if slot.handout is not None:
                slot.handout.detach()
            slot.groups = []
            slot.handout = None
        self.groups = []
        self.handout = Handout([])
        self.fast = None


class CPURecording(Recording):
    """Replays the traced fx graph over the static buffers."""

    backend = "cpu"

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.stores: List[Tuple[torch.UntypedStorage, int]] = []
        self.first = True

    def _new_slot(self, replacing: Optional[_Slot] = None) -> _Slot:
        slot = _Slot(None, [])
        self._slot_groups(slot, [torch.UntypedStorage(g.base.untyped_storage().nbytes(), device=g.device) for g in self.groups])
        return slot

    def _activate(self, slot: _Slot) -> None:
        if slot.stores is None:
            slot.stores = [(g.base.untyped_storage(), k) for g, k in zip(slot.groups, self.group_keys)]
        self.stores = slot.stores

    def _replay(self) -> None:
        with torch.no_grad():
            outs = run_graph(self.gm, *self.gm_args)
        self.last_outs = outs
        if self.first:
            self.first = False
            self._bind_outputs(outs)
            self._start_ring(_Slot(None, []))
            self._activate(self.ring[0])
            return
        for dst, k in self.stores:
            src = outs[k].untyped_storage()
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)


class CUDARecording(Recording):
    """Captures the traced graph into a CUDA graph in the function's pool."""

    backend = "cuda"
    BUMPS = True

    def __init__(self, plan: Plan, tensors: Sequence[torch.Tensor], static_idx: Sequence[int], pool: PoolState, desc: str,
                 fuse: bool = False, donate: Any = (), reuse: Any = None):
        super().__init__(plan, tensors, static_idx, pool, desc, fuse, donate, reuse)
        if self.escapes is not None:
            self.escapes.reuse = True
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        # (the first CUDA tensor's: an optimizer's step counts may be CPU scalars read first)
        self.device = next((t.device for t in tensors if t.is_cuda), torch.device("cuda", torch.cuda.current_device()))
        # Output generations (see Recording._maybe_retire): the first is captured in
        # the function's pool, later ones each in a private pool of their own,
        # so that no generation's intermediates overlap another's outputs. The
        # function's pool's memory is shared by its recordings (see _sharing): the
        # outputs of the others that nobody holds go back to it first, unless views
        # there are alive or this recording leaves state in Python, where the first
        # generation takes a private pool too.
        pool_id = None
        if _sharing.needs_private_pool(pool, self):
            with torch.cuda.device(self.device):
                pool_id = torch.cuda.graph_pool_handle()
        elif type(self) is CUDARecording:
            _sharing.give_back_idle(pool, self)
        g, outs = self._capture(warmup=True, pool_id=pool_id)
        slot = _Slot(g, outs, pool_id, shared=pool_id is None)
        if pool_id is None and type(self) is CUDARecording:
            self.fpool = pool.cuda_pool
            _sharing.join(pool, self)
        self._activate(slot)
        self._bind_outputs(outs)
        self._start_ring(slot)

    def _cuda_generators(self) -> List[Any]:
        return [gen for gen in self.plan.generators if gen.device.type == "cuda"]

    CLIFF = True

    def _new_slot(self, replacing: Optional[_Slot] = None) -> _Slot:
        # Always a private pool: in the function's pool (maybe shared with
        # other functions) new outputs could land in another recording's
        # intermediate memory, which that recording's replays write.
        with torch.cuda.device(self.device):
            pool_id = torch.cuda.graph_pool_handle()
        g, outs = self._capture(warmup=False, pool_id=pool_id)
        slot = _Slot(g, outs, pool_id)
        self._slot_groups(slot, [outs[k].untyped_storage() for k in self.group_keys])
        return slot

    def _activate(self, slot: _Slot) -> None:
        self.graph = slot.graph
        self.outs = slot.outs
        self.last_outs = slot.outs
        self.in_shared_pool = slot.shared

    def _capture(self, warmup: bool, pool_id: Any = None) -> Tuple[Any, List[torch.Tensor]]:
        """Capture the graph into ``pool_id`` (None: the function's pool), after a warm-up if ``warmup``."""
        with _CAPTURE_LOCK:
            # Destroying a CUDA graph (a dead recording in a reference cycle)
            # inside a capture on this thread is not permitted and invalidates
            # the capture: the cyclic collector must not run here. Other
            # threads may free graphs meanwhile; the driver allows that.
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                if pool_id is None:
                    pool_id = _function_pool(self.pool, self.device)
                got = self._capture_locked(warmup, pool_id)
                if warmup:
                    # the warm-up's memory (its intermediates, cached for the side stream
                    # only) goes back to the device, as torch.cuda.graph empties the cache
                    # before its captures
                    torch.cuda.empty_cache()
                return got
            finally:
                if gc_was_on:
                    gc.enable()

    def _capture_locked(self, warmup: bool, pool_id: Any) -> Tuple[Any, List[torch.Tensor]]:
        dev = self.device
        with torch.cuda.device(dev):
            cur = torch.cuda.current_stream()
            side = _capture_stream(dev)
            args = self.gm_args
            saved: List[Tuple[torch.Tensor, torch.Tensor]] = []
            if warmup:
                # Warm-up (lazy library init, inductor's first call) must have no
                # visible effect: it runs on the very tensors the capture will see
                # (a compiled graph would otherwise specialise on other ones), and
                # the in-place inputs it updates are put back from a snapshot, as
                # is the RNG state. (The snapshot is taken on the current stream
                # before the side stream waits for it: taken after, it raced with
                # the warm-up's update and could copy the updated values, so the
                # update was applied twice, by the warm-up and by the replay.)
                # Every input written in place is snapshotted (the buffers input_buffers
                # handed out are the caller's tensors too), on the host: a device copy
                # of an optimizer's parameters and moments would double the memory
                # the first call needs (measured: 197 MiB against eager's 34).
                with torch.no_grad():
                    saved = [(args[i], args[i].detach().to("cpu")) for i in sorted(self.plan.mutated)]
                _drop_replaced_grads(self.escapes, args)
                # the workspaces of the first call's eager run go before the warm-up makes its own
                _clear_workspaces()
            side.wait_stream(cur)
            if warmup:
                rng = torch.cuda.get_rng_state(dev) if self.plan.random else None
                extra = [(gen, gen.get_state()) for gen in self._cuda_generators()]
                try:
                    # its intermediates in the pool the capture then reuses, not beside it
                    # (the first call's peak memory is then about eager's)
                    with torch.cuda.stream(side), torch.no_grad(), _routed_to(dev, pool_id, self.pool):
                        run_graph(self.gm, *_host_seeds(self.plan.gm, args))
                finally:
                    side.synchronize()
                    with torch.no_grad():
                        for t, snap in saved:
                            t.copy_(snap)
                    del saved
                if rng is not None:
                    torch.cuda.set_rng_state(rng, dev)
                for gen, state in extra:
                    gen.set_state(state)
            g = torch.cuda.CUDAGraph()
            rng_states = _snapshot_generators(dev)
            extra_states = [(gen, gen.clone_state()) for gen in self._cuda_generators()]
            for gen in self._cuda_generators():
                # explicit generators passed to random ops: graph-safe too
                g.register_generator_state(gen)
            # cuBLAS's workspace for the capture stream is made inside the capture, in
            # the graph's pool (freed there afterwards, as intermediates are), not kept
            # for that stream outside every pool (torch's cudagraph trees do the same)
            _clear_workspaces()
            try:
                try:
                    with torch.cuda.stream(side), torch.no_grad():
                        g.capture_begin(pool=pool_id, capture_error_mode="thread_local")
                        try:
                            outs = run_graph(self.gm, *args)
                        finally:
                            with warnings.catch_warnings():
                                # a function that only returns (views of) its inputs
                                # records no kernel: an empty graph is fine here
                                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                                g.capture_end()
                except Exception as e:  # driver-level failure
                    _end_stale_routing(dev, pool_id)
                    _abandon_pool(self.pool, pool_id)
                    # a failed capture never ran the generators' capture
                    # epilogue: put back states that are not "capturing"
                    _restore_generators(dev, rng_states)
                    for gen_snap in extra_states:
                        _restore_generators(dev, gen_snap)
                    torch.cuda.synchronize(dev)
                    if isinstance(e, GraphifyError):
                        raise
                    raise _capture_error(self.desc, e, self.plan.gm, args, side, dev) from e
            finally:
                _clear_workspaces()
            cur.wait_stream(side)
            return g, list(outs)

    def _replay(self) -> None:
        self.graph.replay()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.released:
            _sharing.keep_held_on_close(self)
        super().close()
        # (the function's pool stays usable: its keeper holds it, see _function_pool)
        self.ring = []
        self.graph = None


RING_SLOTS = 8
"""Output generations a recording alternates between while the caller holds views."""


class _Slot:
    """One output generation of a recording: its memory, its output groups, who views it.

    CUDA: a capture of its own (graph, outputs, private pool); CPU: memory the
    replays' results are copied into.
    """

    __slots__ = ("graph", "outs", "pool_id", "shared", "groups", "handout", "pins", "stores")

    def __init__(self, graph: Any, outs: List[torch.Tensor], pool_id: Any = None, shared: bool = False):
        self.graph = graph
        self.outs = outs
        self.pool_id = pool_id  # CUDA; None: the function's pool
        # whether its memory may be written by other recordings' replays (CUDA: the function's
        # pool, where other recordings' outputs and intermediates may lie)
        self.shared = shared
        self.groups: List[OutputGroup] = []
        self.handout: Any = None
        self.pins: List[Pin] = []  # views the caller derived from its outputs
        self.stores: Any = None  # CPU: (storage, output index) of each group, made once

    def pinned(self) -> bool:
        """Whether views the caller derived from this slot's outputs are alive."""
        if self.pins:
            self.pins = live_pins(self.pins)
        return bool(self.pins)


_CAPTURE_LOCK = threading.RLock()
_STREAMS: Dict[int, Any] = {}


def _clear_workspaces() -> None:
    if clear_cublas_workspaces is not None:
        clear_cublas_workspaces()


def _drop_replaced_grads(esc: Optional[EscapeWriter], args: Sequence[Any]) -> None:
    """Empty the ``.grad`` slots the call replaces and the graph does not read, before the warm-up.

    Their old tensors (the first call's eager gradients) would otherwise stay alive
    through the warm-up and the capture beside the new ones: an optimizer step's
    first calls needed twice its gradients' memory. The call replaces them anyway,
    as eager's ``zero_grad()`` drops them first.
    """
    if esc is None:
        return
    read = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    for slot in esc.slots:
        if slot.kind != "grad":
            continue
        old = slot.get()
        if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() not in read:
            slot.set(None)


def _index(dev: torch.device) -> int:
    """The device index of ``dev`` (the current device where it names none)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _capture_stream(dev: torch.device) -> Any:
    """One side stream per device for every warm-up and capture.

    Like torch.cuda.graph's default capture stream: libraries such as cuBLAS
    keep a workspace per stream, so a new stream per recording would cost
    memory.
    """
    idx = _index(dev)
    s = _STREAMS.get(idx)
    if s is None:
        s = _STREAMS[idx] = torch.cuda.Stream(device=idx)
    return s


# Attention backwards that read a dropout seed and offset saved by their
# forward: on the host when no capture is under way, through the device
# pointer while capturing. A forward replayed from a graph saved them on the
# device, so the eager warm-up of a backward recording must see host copies
# (it read the device pointer on the host and crashed the process).
_SEED_OPS = {
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention_backward",
}


def _seed_inputs(gm: Any) -> Tuple[int, ...]:
    """Input positions of ``gm`` that feed an attention backward's dropout seed/offset."""
    cached = getattr(gm, "_gt_seed_inputs", None)
    if cached is not None:
        return cached
    pos = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or schema.name not in _SEED_OPS:
            continue
        for i, a in enumerate(schema.arguments):
            if a.name in ("philox_seed", "philox_offset"):
                v = n.kwargs.get(a.name, n.args[i] if i < len(n.args) else None)
                if v in pos:
                    found.add(pos[v])
    res = tuple(sorted(found))
    try:
        gm._gt_seed_inputs = res
    except Exception:  # pragma: no cover
        pass
    return res


def _host_seeds(gm: Any, args: Sequence[Any]) -> Sequence[Any]:
    """``args`` with device-side scalar seeds/offsets of attention backwards as host copies."""
    idx = _seed_inputs(gm)
    if not idx:
        return args
    out = list(args)
    for i in idx:
        t = out[i]
        if isinstance(t, torch.Tensor) and t.is_cuda and t.dim() == 0 and t.dtype == torch.int64:
            out[i] = t.cpu()
    return out


def _capture_error(desc: str, err: BaseException, gm: Any, args: Sequence[Any], stream: Any,
                   dev: torch.device) -> GraphifyError:
    """The error for a failed capture, naming the operation that broke it and the user's line.

    The capture is tried again op by op (:func:`_failing_node`): torch's text alone
    ("operation failed due to a previous error during capture") names neither.
    """
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    node = _failing_node(gm, args, stream, dev)
    where, known = "", None
    if node is not None:
        site = node.meta.get("gt_site") or "?"
        where = f"\n  operation {node.target} at {site}"
        name = str(node.target)
        known = next((v for k, v in _UNCAPTURABLE if k in name), None)
    why, fix = known or (
        "an operation of the function cannot be recorded into a CUDA graph (its CUDA kernel synchronises "
        "with the host, reads a value on the host, copies to or from pageable host memory, or calls a "
        "library that is not capture-safe).",
        "move that operation out of the graphified function, or use a variant that keeps its values on the "
        "device (torch.where instead of a host test; the _ex variants of torch.linalg).")
    return GraphifyError(
        f"{desc}: CUDA graph capture failed: {first}{where}\n"
        f"Why: {why}\nFix: {fix} Inspect what is recorded with {desc}.trace(...). The function, its pool "
        "and eager CUDA work stay usable."
    )


_OUTSIDE = ("call it outside the graphified function (on its result, or on the CPU), and pass what it "
            "computes in as an argument.")
# operations whose CUDA implementation no capture can hold (seen on an H100 with torch 2.11:
# tests/opinfo_sweep.py --device cuda), by a part of their name: why, and the fix
_UNCAPTURABLE = (
    ("linalg_svd", ("the singular value decomposition on CUDA (torch.linalg.svd, svdvals, pinv, cond, matrix_rank, "
                    "the nuclear norm, svd_lowrank, pca_lowrank) copies between the host and the GPU inside "
                    "cuSOLVER's driver.", _OUTSIDE)),
    ("linalg_pinv", ("torch.linalg.pinv computes a singular value decomposition, which on CUDA copies between "
                     "the host and the GPU inside cuSOLVER's driver.", _OUTSIDE)),
    ("linalg_eig", ("the eigendecompositions on CUDA (torch.linalg.eig, eigh, eigvals, eigvalsh) synchronise with "
                    "the host inside cuSOLVER or MAGMA.", _OUTSIDE)),
    ("linalg_lu", ("the LU factorizations on CUDA (torch.linalg.lu, lu_factor, lu_factor_ex) synchronise with the "
                   "host inside cuSOLVER or MAGMA for some sizes.", _OUTSIDE)),
    ("linalg_ldl", ("the LDL factorization on CUDA synchronises with the host inside cuSOLVER.", _OUTSIDE)),
    ("cholesky", ("torch.cholesky / cholesky_inverse check their factorization on the host.",
                  "use torch.linalg.cholesky_ex (it returns the check's result on the device), or " + _OUTSIDE)),
    ("histc", ("torch.histc on CUDA reads the range of its data on the host when min and max are not given "
               "(min=max=0).", "pass min= and max= (the range of the bins), or " + _OUTSIDE)),
    ("matrix_exp", ("torch.linalg.matrix_exp on CUDA chooses its series' degree from the matrix norm on the "
                    "host.", _OUTSIDE)),
    ("_segment_reduce", ("segment_reduce on CUDA reads its segment lengths on the host.", _OUTSIDE)),
)


def _failing_node(gm: Any, args: Sequence[Any], stream: Any, dev: torch.device) -> Any:
    """The first node of ``gm`` whose run fails inside a CUDA graph capture, or None.

    A throwaway capture in a private pool, run node by node; generator states are put
    back afterwards, as after the failed capture itself.
    """
    current: List[Any] = [None]

    class _Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            current[0] = n
            return super().run_node(n)

    snap = _snapshot_generators(dev)
    g = torch.cuda.CUDAGraph()
    pool_id = torch.cuda.graph_pool_handle()
    failed = None
    try:
        with torch.cuda.stream(stream), torch.no_grad():
            g.capture_begin(pool=pool_id, capture_error_mode="thread_local")
            try:
                _Run(gm).run(*args)
            except Exception:
                failed = current[0]
            finally:
                try:
                    g.capture_end()
                except Exception:
                    _end_stale_routing(dev, pool_id)
                    if failed is None:
                        failed = current[0] if current[0] is not None and current[0].op != "output" else None
    except Exception:  # pragma: no cover - the search itself failed: say what torch said
        failed = None
    finally:
        _restore_generators(dev, snap)
        try:
            torch.cuda.synchronize(dev)
        except Exception:  # pragma: no cover
            pass
    del g
    return failed


def _snapshot_generators(dev: torch.device) -> Any:
    """Copies of the device's default CUDA generator state (cheap, host side)."""
    try:
        idx = _index(dev)
        gen = torch.cuda.default_generators[idx]
        return gen, gen.clone_state()
    except Exception:  # pragma: no cover - old torch
        return None


def _restore_generators(dev: torch.device, snap: Any) -> None:
    if snap is None:  # pragma: no cover
        return
    gen, state = snap
    try:
        gen.graphsafe_set_state(state)
    except Exception:  # pragma: no cover
        pass


def _function_pool(pool: PoolState, dev: torch.device) -> Any:
    """The CUDA graph pool id of ``pool``, made on first use with an empty graph captured into it.

    The allocator frees a graph pool once no graph holds it and then refuses
    to capture into its id, or to route allocations to it, again (an assert
    that ends the process). The empty graph (``pool.keeper``) holds it for
    the function's life, as torch's cudagraph trees hold theirs, so the
    warm-up can route its allocations there before the first capture, and
    a closed recording's pool stays usable. (Called under _CAPTURE_LOCK,
    with the cyclic collector off.)
    """
    if pool.cuda_pool is None or pool.keeper is None:
        # (no keeper: a new pool, since the old id's pool may be freed already)
        with torch.cuda.device(dev), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            pid = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(_capture_stream(dev)):
                g.capture_begin(pool=pid, capture_error_mode="thread_local")
                g.capture_end()
        pool.cuda_pool, pool.keeper = pid, g
    return pool.cuda_pool


def _end_stale_routing(dev: torch.device, pool_id: Any) -> None:
    """End the allocation routing a failed capture left on for ``pool_id``.

    torch's ``capture_end`` raises before it ends the routing of the capture's
    allocations to its pool: every later capture into that pool, and the
    warm-up's routing to it, then failed with "beginAllocateToPool: already
    recording" (a function's other signatures, once one failed to capture).
    """
    if end_route_to_pool is None:
        return
    try:
        end_route_to_pool(_index(dev), pool_id)
    except RuntimeError:  # none: ended by capture_end already
        pass


_MAX_ABANDONED = 2  # new pools a function takes after failed captures (each keeps its memory)


def _abandon_pool(pool: PoolState, pool_id: Any) -> None:
    """After a failed capture into the function's pool, its next recordings take a new one.

    torch 2.11 refuses every later capture into a pool whose capture failed
    ("beginAllocateToPool: already recording to mempool_id", seen on an H200
    even with no routing left to end): the function's other signatures, and
    the same one after a fix, could never record again. Recordings already
    in the pool keep it; its keeper is kept too, with the pool's memory
    (dropping the last hold of a pool in that state is not something to try
    at a failure). So a function that keeps failing (a loop that catches the
    error) does not take a new pool per call: after _MAX_ABANDONED, its later
    captures go to the last one, and fail there as they did before.
    """
    if len(pool.abandoned) >= _MAX_ABANDONED:
        return
    if pool.cuda_pool is not None and tuple(pool.cuda_pool) == tuple(pool_id):
        pool.abandoned.append(pool.keeper)
        pool.cuda_pool = pool.keeper = None


@contextlib.contextmanager
def _routed_to(dev: torch.device, pool_id: Any, pool: PoolState) -> Any:
    """This thread's CUDA allocations go to the graph pool ``pool_id`` (the warm-up's).

    Only the function's pool, which a graph holds (its keeper, see _function_pool), is
    routed to: the routing's own use of the pool ends with it, whatever the warm-up raised.
    (A first generation captured in a private pool, see _sharing, warms up outside it.)
    """
    if (route_to_pool is None or end_route_to_pool is None or release_pool is None or pool.keeper is None
            or pool.cuda_pool is None or tuple(pool_id) != tuple(pool.cuda_pool)):
        yield
        return
    idx = _index(dev)
    route_to_pool(idx, pool_id)
    try:
        yield
    finally:
        end_route_to_pool(idx, pool_id)
        release_pool(idx, pool_id)


def make_recording(plan: Plan, tensors: Sequence[torch.Tensor], static_idx: Sequence[int], pool: PoolState, desc: str, cuda: bool,
                   fuse: bool = False, donate: Any = (), reuse: Any = None) -> Recording:
    """Build the recording of ``plan`` for the given backend (``donate``, ``reuse``: see ``_handed``)."""
    cls = CUDARecording if cuda else CPURecording
    # static buffers and outputs are normal tensors even if the first call
    # happens under torch.inference_mode (later calls may not)
    _distributed.before_record(plan, desc, cuda=cuda, fuse=fuse)
    try:
        with torch.inference_mode(False):
            rec = cls(plan, tensors, static_idx, pool, desc, fuse, donate, reuse)
    except BaseException as exc:
        _distributed.record_failed(plan, desc, exc)
        raise
    _distributed.track(rec)
    return rec

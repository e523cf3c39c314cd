"""Outputs that know when they are stale.

A recording's tensor outputs live in memory that the next replay overwrites.
Outputs that share one storage form an :class:`OutputGroup`. The caller gets
tensor objects over an *alias* storage of that memory (a second storage
object over the same bytes, which keeps the bytes alive through DLPack); the
objects of all groups of one output memory form a generation of a
:class:`Handout`, so:

* if the caller dropped every object (and every view derived from them),
  the next call hands the very same objects out again;
* if the caller still holds an object, the next call poisons it: its class
  becomes :class:`StaleOutput`, whose every operation raises
  :class:`~gtransform.OverwrittenOutputError`. The next call hands out
  another generation: an earlier one the caller has dropped meanwhile
  (revived), or new objects over fresh alias storages.
* views the caller derived from an output (which we cannot reach) pin the
  memory: the recording moves its outputs to new memory before it writes
  them again, so those views keep the values of their own call and are never
  silently changed.
"""

from __future__ import annotations

import logging
import sys
import weakref
from operator import gt, ne
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils.dlpack as _dlpack

from ._compat import DisableTorchFunctionSubclass
from ._compat import increment_version as _increment_version
from ._compat import storage_use_count as _use_count
from ._compat import tensor_use_count as _impl_uses
from ._compat import tensor_version as _version
from ._compat import unsafe_set_version_counter as _set_versions
from ._errors import OverwrittenOutputError
from ._log import log

__all__ = ["Handout", "OutputGroup", "StaleOutput", "PoolState", "Pin", "poison_tensor", "live_pins", "stale_message", "take_back", "unseal"]

_getrefcount = sys.getrefcount
_requires_grad = torch.Tensor.requires_grad.__get__  # type: ignore[attr-defined]
_is_leaf = torch.Tensor.is_leaf.__get__  # type: ignore[attr-defined]

# Reads that stay legal on a stale output: metadata, no data.
_PROPS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf", "grad_fn")
_METHODS = ("size", "dim", "stride", "numel", "nelement", "element_size", "is_contiguous", "is_floating_point",
            "is_complex", "is_signed", "new_zeros", "new_ones", "new_empty", "new_full")
# (new tensors of the same metadata, as gradcheck makes: they read no data)
_LIKE = ("zeros_like", "ones_like", "empty_like", "full_like")
_ALLOWED = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _PROPS if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n) for n in _METHODS if hasattr(torch.Tensor, n)]
    + [getattr(torch, n) for n in _LIKE]
)


def _drop_own_graphs(objs: Sequence[torch.Tensor], rcs: Sequence[int], rc_base: Sequence[int]) -> bool:
    """Detach the objects of a call about to be overwritten from the autograd graph of that call.

    A differentiated call's outputs carry its graph (``grad_fn``), which keeps aliases of
    the outputs and saved activations (``_autograd._keep_outputs``) until its backward:
    memory someone may still need. An object the caller dropped would keep that graph, and
    so its own memory, held through gtransform's reference alone, forever (its next
    hand-out, which replaces the ``grad_fn``, waits for the memory to be free). An object
    the caller holds is poisoned now (no op on it runs again, ``backward()`` included) and
    stays in its generation's books: its graph would hold that generation's memory after
    the caller dropped it too (a loop ``out = f(x)`` under grad mode, never differentiated,
    then held every generation and recorded at every call). Detached, the graph lives as
    long as the caller holds it some other way (a loss computed from the output), as in
    eager. An object an eager op saved (``loss = (out * w).sum()``: its TensorImpl has
    another owner) keeps its graph: that op's backward unpacks it.

    Returns:
        Whether any object was detached (the storages' use counts may have changed).
    """
    done = False
    for o, r, b in zip(objs, rcs, rc_base):
        if o.grad_fn is None or o._is_view():
            continue
        # (a torch without TensorImpl use counts: the dropped objects alone, as before)
        if (_impl_uses(o) != 1) if _impl_uses is not None else (r != b):
            continue
        o.detach_()
        done = True
    return done


def _autograd_changed(objs: Sequence[torch.Tensor]) -> bool:
    """Whether the caller gave an output object autograd state of its own.

    A leaf that requires grad (``requires_grad_()``, then a backward accumulating into
    its ``.grad``), a hook (``o.register_hook``: torch keeps the object's hook dict and
    registers it with a new ``grad_fn`` only when the dict is made) or ``retain_grad()``
    (a no-op on an object that already retains): handed out again, the next call's
    ``grad_fn`` would miss the hooks the caller registers then, and ``.grad`` would keep
    an old call's gradient. Such objects are not handed out again.
    """
    for o in objs:
        if _requires_grad(o) and (_is_leaf(o) or o._backward_hooks is not None or o.retains_grad):
            return True
    return False


class StaleOutput(torch.Tensor):
    """Type of an output object that a later call overwrote.

    Every operation on it raises :class:`~gtransform.OverwrittenOutputError`,
    printing included (``print``, ``str``, ``repr``, f-strings; tools that print
    objects safely, such as pytest's reports, show the error instead). Metadata
    (``shape``, ``dtype``, ``device``...) still reads.
    """

    _gt_message: Any  # see stale_message

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if func in _ALLOWED:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        msg = None
        for a in list(args) + list((kwargs or {}).values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, StaleOutput):
                    msg = stale_message(t)
                    break
            if msg is not None:
                break
        raise OverwrittenOutputError(
            f"{msg or 'stale gtransform output'}\n(operation: {name or func})"
        ) from None

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # noqa: D105
        raise OverwrittenOutputError(
            f"{stale_message(self)}\n(operation: repr)"
        )

    def as_subclass(self, cls: Any) -> Any:  # noqa: D102 - would hand out the next call's numbers
        raise OverwrittenOutputError(
            f"{stale_message(self)}\n(operation: as_subclass)"
        )

    def __str__(self) -> str:  # noqa: D105 - print(), str(), f"{t}": printing reads the numbers
        raise OverwrittenOutputError(
            f"{stale_message(self)}\n(operation: print / str)"
        )

    def __format__(self, spec: str) -> str:  # noqa: D105
        raise OverwrittenOutputError(
            f"{stale_message(self)}\n(operation: format)"
        )


def stale_message(obj: torch.Tensor) -> str:
    """The message of a stale output.

    Stored as a string, or as ``(old_desc, desc, call_no)`` of the call that
    overwrote it: formatted only when shown, off the per-call path.
    """
    msg = obj.__dict__.get("_gt_message")
    if type(msg) is tuple:
        return _overwrite_text(*msg)
    return str(msg) if msg else "stale gtransform output"


def poison_tensor(obj: torch.Tensor, message: Any) -> None:
    """Turn ``obj`` into a :class:`StaleOutput` that raises ``message``."""
    obj.__class__ = StaleOutput
    obj.__dict__["_gt_message"] = message


def _revive(objs: Any) -> None:
    """Make the poisoned objects among ``objs`` normal tensors again."""
    for o in objs:
        if type(o) is StaleOutput:
            o.__class__ = torch.Tensor  # type: ignore[assignment]
            del o._gt_message


def _normal_tensors() -> Any:
    """Make output objects normal tensors, even under inference mode.

    The same objects are handed out inside and outside inference mode.
    """
    return torch.inference_mode(False)


def _alias_base(base_u8: torch.Tensor) -> torch.UntypedStorage:
    """A new storage object over ``base_u8``'s bytes that keeps them alive."""
    return _dlpack.from_dlpack(_dlpack.to_dlpack(base_u8)).untyped_storage()


class OutputGroup:
    """Outputs of one recording that share one storage in the pool: their layout.

    Args:
        storage: the pool storage the recording writes (kept alive here).
        members: ``(size, stride, storage_offset, dtype)`` of each output.
    """

    __slots__ = ("base", "members", "device")

    def __init__(self, storage: torch.UntypedStorage, members: Sequence[Tuple[Any, Any, int, torch.dtype]]):
        self.device = storage.device
        with _normal_tensors():
            self.base = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self.members = list(members)


# An alias storage the caller derived views from: ``(cdata, ours, storage, objects)``.
# It keeps the storage object and the output objects alive, so the storage's use
# count stays exactly ``ours`` (our storage object + one per output object) once
# the views are gone; higher means some view is alive.
Pin = Tuple[int, int, torch.UntypedStorage, List[torch.Tensor]]


def live_pins(pins: List[Pin]) -> List[Pin]:
    """The pins whose views the caller still holds."""
    return [p for p in pins if _use_count(p[0]) > p[1]]


class _Generation:
    """Output objects put aside: poisoned where the caller held them, revived once dropped.

    ``poisoned`` says which objects are poisoned: None all, a list their
    positions, ``SCAN`` look at each object's class. ``sealed``: every object
    was poisoned while no view of them was alive, so no view can appear (a
    poisoned object refuses every operation): its storages' use counts need
    no check before it is revived. It holds the value of the seal epoch then
    (-1: not sealed); gtransform's own ways past the poison (see
    :func:`unseal`) end the epoch.
    """

    __slots__ = ("objs", "storages", "cdatas", "rc_base", "poisoned", "sealed", "vsum")

    def __init__(self, objs: List[torch.Tensor], storages: List[torch.UntypedStorage], cdatas: List[int],
                 rc_base: List[int], poisoned: Any, sealed: int, vsum: int):
        self.objs, self.storages, self.cdatas, self.rc_base = objs, storages, cdatas, rc_base
        self.poisoned, self.sealed = poisoned, sealed
        # the sum of the objects' version counters (exact while sealed: nothing reaches them)
        self.vsum = vsum


SCAN = "scan"

_seal_epoch = [0]


def unseal() -> None:
    """A poisoned object was made an alias of, or taken back (gtransform's own code).

    Generations sealed so far (see :class:`_Generation`) get their storages'
    use counts checked again before they are revived.
    """
    _seal_epoch[0] += 1


def _keep_version(t: torch.Tensor, v: int) -> None:
    """Set ``t``'s version counter back to ``v`` (torch's signature changed across releases)."""
    if _set_versions is None:  # pragma: no cover - older torch: the bump stays
        return
    try:
        _set_versions((t,), (v,))
    except TypeError:  # pragma: no cover - torch < 2.5 takes one tensor
        _set_versions(t, v)


def take_back(t: torch.Tensor, keep_values: bool) -> None:
    """Make a stale output a normal tensor again, over memory of its own (its values copied or not).

    The move is gtransform's, not a change of the tensor: its version counter stays as it
    was. Autograd may have saved an alias of it that shares the counter (an output saved
    for its own backward, see GraphFn.forward, fed back as the next call's input in
    backpropagation through time); ``set_`` would make that backward raise "modified by an
    inplace operation". (Where values follow, the caller's in-place update bumps it once,
    as eager's does.)
    """
    unseal()
    t.__class__ = torch.Tensor  # type: ignore[assignment]
    t.__dict__.pop("_gt_message", None)
    v = t._version
    with torch.no_grad():
        own = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        if keep_values:
            own.copy_(t)
        t.set_(own.untyped_storage(), 0, t.shape, t.stride())
    _keep_version(t, v)


class Handout:
    """The output objects of one output memory of a recording (a ring slot).

    ``poison`` checks, in two C-level passes, every object's Python reference
    count and every alias storage's use count against their values when
    nothing outside gtransform held them. If the caller holds objects, they
    are poisoned, and ``fresh`` gives their output groups other objects:
    those of a spare generation the caller has dropped meanwhile (the usual
    ``y = f(x)`` loop holds the previous output during the next call, so two
    generations alternate), or new ones. The objects of groups the caller did
    not hold are handed out again. When every group was held (the usual case)
    the whole generation is swapped at once: the work per output object is
    then its class flip and nothing else.

    Args:
        groups: the output groups (layouts over this memory).
        owner: the recording (weakly: the pool's list of outstanding handouts
            must not keep a dropped function's recordings alive).
    """

    __slots__ = ("groups", "starts", "owner", "objs", "storages", "cdatas", "uc_base", "rc_base",
                 "poisoned", "sealed", "held_groups", "spare", "need_fresh", "vsum", "tainted", "taken")

    def __init__(self, groups: List[OutputGroup], owner: Any = None):
        self.groups = groups
        starts = [0]
        for g in groups:
            starts.append(starts[-1] + len(g.members))
        self.starts = starts
        self.owner = weakref.ref(owner) if owner is not None else None
        self.spare: List[_Generation] = []
        self.need_fresh = False
        # of the generation handed out: which objects the last poison poisoned
        # and whether that sealed it (see _Generation), and which groups were
        # held (None: all)
        self.poisoned: Any = []
        self.sealed = -1
        self.held_groups: Optional[List[int]] = None
        # our storage object + one TensorImpl per member object
        self.uc_base = [1 + len(g.members) for g in groups]
        self.objs, self.storages, self.cdatas, self.rc_base = self._make()
        # the sum of the objects' version counters as handed out, and whether the caller
        # changed one (see poison)
        self.vsum = sum(map(_version, self.objs))
        self.tainted = False
        # positions of objects _keep_held took back (memory of their own now): fresh replaces them
        self.taken: List[int] = []

    def _make(self) -> Tuple[List[torch.Tensor], List[torch.UntypedStorage], List[int], List[int]]:
        """A new generation: new objects over new alias storages."""
        objs: List[torch.Tensor] = []
        storages = []
        with _normal_tensors():
            for g in self.groups:
                st = _alias_base(g.base)
                storages.append(st)
                dev = g.device
                for size, stride, offset, dtype in g.members:
                    objs.append(torch.empty(0, dtype=dtype, device=dev).set_(st, offset, size, stride))
        return objs, storages, [st._cdata for st in storages], list(map(_getrefcount, objs))

    def refresh(self) -> None:
        """Re-measure the reference counts (call when nothing is handed out)."""
        self.rc_base = list(map(_getrefcount, self.objs))
        self.vsum = sum(map(_version, self.objs))

    def poison(self, old_desc: str, desc: str, call_no: int, keep: bool = False) -> Any:
        """Poison the objects the caller still holds; the memory is about to be written.

        ``old_desc`` handed them out; call ``call_no`` of the pool (``desc``)
        is about to overwrite them.

        Views the caller derived from the objects cannot be reached. If any
        are alive, the returned :data:`Pin` list says so: the owner must move
        its outputs to new memory before it next writes them (see
        ``Recording._maybe_retire``), so those views keep the values of their own
        call. Objects handed out again over memory that is written get their
        version counters bumped: autograd may have saved one
        (``loss = (w * y).sum(); del y``), invisibly to the reference counts,
        and its backward then raises "modified by an inplace operation", as
        eager would, instead of computing with the new numbers.

        ``keep``: objects the caller holds keep their values instead (see :meth:`_keep_held`).

        Returns:
            False if nothing was held (nothing but the version bump done), a
            list of :data:`Pin` if views are alive, else None; in the last two
            cases ``fresh`` must run before the next hand-out.
        """
        objs = self.objs
        rc_base = self.rc_base
        rcs = list(map(_getrefcount, objs))
        if keep and rcs != rc_base:
            return self._keep_held(rcs)
        ucs = list(map(_use_count, self.cdatas))
        uc_base = self.uc_base
        rg = any(map(_requires_grad, objs))
        if rg and ucs != uc_base and _drop_own_graphs(objs, rcs, rc_base):
            ucs = list(map(_use_count, self.cdatas))
        # an object the caller changed in place (its shape: t_(), unsqueeze_(), resize_(); its
        # values) has a higher version; one made a leaf that requires grad (requires_grad_(),
        # then a backward accumulating into its .grad) says so: never handed out again.
        # (Outputs of a differentiated call require grad as non-leaves: they are fine.)
        if sum(map(_version, objs)) != self.vsum or (rg and _autograd_changed(objs)):
            self.tainted = True
            rcs = [-1] * len(rcs)  # treated as held: poisoned, and a new generation made
        elif ucs == uc_base:
            if rcs == rc_base:  # nothing held
                _increment_version(objs)
                self.vsum += len(objs)
                return False
            if all(map(ne, rcs, rc_base)):  # every object held, no view (the usual `y = f(x)` loop)
                return self._poison_held((old_desc, desc, call_no))
        elif all(map(gt, ucs, uc_base)) and all(map(ne, rcs, rc_base)):
            return self._poison_viewed((old_desc, desc, call_no))
        held_groups: Optional[List[int]] = None
        if rcs == rc_base:
            poisoned: Any = []
        else:
            # plain loops: an attribute store costs less than setattr through map
            message = (old_desc, desc, call_no)  # see stale_message
            if all(map(ne, rcs, rc_base)):  # every object (the usual `y = f(x)` loop)
                poisoned = None
                for o in objs:
                    o.__class__ = StaleOutput
                    o._gt_message = message  # type: ignore[attr-defined]
            else:
                poisoned = [i for i, (r, b) in enumerate(zip(rcs, rc_base)) if r != b]
                for i in poisoned:
                    o = objs[i]
                    o.__class__ = StaleOutput
                    o._gt_message = message  # type: ignore[attr-defined]
        if poisoned is not None:
            starts = self.starts
            held_groups = [
                gi for gi in range(len(ucs))
                if ucs[gi] != uc_base[gi] or rcs[starts[gi]:starts[gi + 1]] != rc_base[starts[gi]:starts[gi + 1]]
            ]
            if len(held_groups) == len(ucs):
                held_groups = None
        pins: Optional[List[Pin]] = None
        if ucs == uc_base:
            _increment_version(objs)
            self.vsum += len(objs)
        else:
            pins = []
            starts = self.starts
            written: List[torch.Tensor] = []
            for gi, (u, b) in enumerate(zip(ucs, uc_base)):
                members = objs[starts[gi]:starts[gi + 1]]
                if u > b:
                    pins.append((self.cdatas[gi], b, self.storages[gi], members))
                else:
                    written += members
            _increment_version(written)
            self.vsum += len(written)
        self.poisoned = poisoned
        # sealed (see _Generation); -2 - epoch: every object poisoned but views were
        # alive then (pins), which fresh(views_gone=True) knows are gone
        if poisoned is None:
            self.sealed = _seal_epoch[0] if pins is None else -2 - _seal_epoch[0]
        else:
            self.sealed = -1
        self.held_groups = held_groups
        # the caller (PoolState.begin_call) makes the next objects, unless the
        # owner moves to another memory before its next replay and makes
        # them there (see Recording._maybe_retire)
        self.need_fresh = True
        return pins or None

    def _poison_held(self, message: Any) -> None:
        """``poison`` where the caller holds every object and no view of them: all poisoned, the generation sealed."""
        objs = self.objs
        for o in objs:
            o.__class__ = StaleOutput
            o._gt_message = message  # type: ignore[attr-defined]
        _increment_version(objs)
        self.vsum += len(objs)
        self.poisoned = None
        self.sealed = _seal_epoch[0]
        self.held_groups = None
        self.need_fresh = True

    def _poison_viewed(self, message: Any) -> List[Pin]:
        """``poison`` where the caller keeps views of every group, through every object (a loop keeping views).

        Every object is poisoned while views of it are alive, so its generation is sealed
        against those views only (see ``fresh(views_gone=True)``); no memory is written, so no
        version changes.
        """
        for o in self.objs:
            o.__class__ = StaleOutput
            o._gt_message = message  # type: ignore[attr-defined]
        self.poisoned = None
        self.sealed = -2 - _seal_epoch[0]
        self.held_groups = None
        self.need_fresh = True
        objs = self.objs
        if len(self.cdatas) == 1:
            return [(self.cdatas[0], self.uc_base[0], self.storages[0], objs[:])]
        starts = self.starts
        return [(c, b, st, objs[starts[gi]:starts[gi + 1]])
                for gi, (c, b, st) in enumerate(zip(self.cdatas, self.uc_base, self.storages))]

    def _keep_held(self, rcs: List[int]) -> Any:
        """``poison`` for a pool that keeps held outputs (pieces of a split function, see ``_dynamo``).

        Python code between the pieces keeps their outputs across the pieces' next calls
        (a token list, an ODE solver's last step): each object the caller holds is taken
        back (its values copied to memory of its own, the object unchanged otherwise)
        instead of poisoned; views of the rest pin their memory as in ``poison``. ``fresh`` then
        puts new objects over this memory in the places of those taken back or, where views
        pin it (whose pins count the objects left), drops the generation for new objects over
        new alias storages.
        """
        objs, starts, rc_base = self.objs, self.starts, self.rc_base
        pins: List[Pin] = []
        written: List[torch.Tensor] = []
        taken = self.taken
        for gi in range(len(self.groups)):
            kept = []
            for i in range(starts[gi], starts[gi + 1]):
                if rcs[i] != rc_base[i]:
                    take_back(objs[i], keep_values=True)
                    taken.append(i)
                else:
                    kept.append(objs[i])
            base = 1 + len(kept)  # (our storage object, the objects not taken back)
            if _use_count(self.cdatas[gi]) > base:
                pins.append((self.cdatas[gi], base, self.storages[gi], kept))
            else:
                written += kept
        _increment_version(written)
        self.poisoned, self.sealed, self.held_groups = [], -1, None
        if pins:
            self.taken = []
            self.tainted = True  # (its objects left: not a generation to hand out again)
        self.need_fresh = True
        return pins or None

    def fresh(self, views_gone: bool = False) -> None:
        """Give the groups the caller held (see ``poison``) other objects.

        They come from a spare generation whose objects of those groups
        nobody holds any more (no object, no view), made normal tensors again;
        otherwise from a new generation. The objects the caller held go to
        the spare generations.

        Args:
            views_gone: the views alive when ``poison`` ran (its pins) are gone
                since (the owner coming back to this memory, see
                ``Recording._maybe_retire``): the objects handed out last, if
                the caller dropped them too, are handed out again.
        """
        if self.taken:
            self._replace_taken()
            return
        if (
            views_gone
            and self.poisoned is None
            and self.sealed == -2 - _seal_epoch[0]
            and not self.tainted
            and list(map(_getrefcount, self.objs)) == self.rc_base
        ):
            # every object was poisoned: no view appeared after the pins (which may have
            # changed the objects' versions while they lived)
            self.need_fresh = False
            for o in self.objs:
                o.__class__ = torch.Tensor
                del o._gt_message  # type: ignore[attr-defined]
            self.vsum = sum(map(_version, self.objs))
            return
        self.need_fresh = False
        spare = self.spare
        held_groups = self.held_groups
        # the caller changed an object (see poison): this generation is dropped, not kept
        tainted, self.tainted = self.tainted, False
        if held_groups is None:  # (always, when tainted)
            epoch = _seal_epoch[0]
            for gen in spare:
                sealed = gen.sealed == epoch
                if list(map(_getrefcount, gen.objs)) != gen.rc_base or (
                    not sealed and list(map(_use_count, gen.cdatas)) != self.uc_base
                ):
                    continue
                poisoned = gen.poisoned
                # (an object copy_back_stale took back has other memory now: the
                # storage's use count above keeps its generation from coming back)
                if poisoned is None:
                    for o in gen.objs:
                        o.__class__ = torch.Tensor
                        del o._gt_message  # type: ignore[attr-defined]
                elif poisoned:
                    _revive(gen.objs if poisoned is SCAN else map(gen.objs.__getitem__, poisoned))
                # (the objects handed out next: their versions as handed out, see poison)
                vsum = gen.vsum if sealed else sum(map(_version, gen.objs))
                if tainted:
                    spare.remove(gen)
                    self.objs, self.storages, self.cdatas, self.rc_base = gen.objs, gen.storages, gen.cdatas, gen.rc_base
                    self.vsum = vsum
                    return
                gen.objs, self.objs = self.objs, gen.objs
                gen.storages, self.storages = self.storages, gen.storages
                gen.cdatas, self.cdatas = self.cdatas, gen.cdatas
                gen.rc_base, self.rc_base = self.rc_base, gen.rc_base
                gen.poisoned, gen.sealed, gen.vsum = self.poisoned, self.sealed, self.vsum
                self.vsum = vsum
                return
            objs, storages, cdatas, rc_base = self._make()
            if not tainted:
                spare.append(_Generation(self.objs, self.storages, self.cdatas, self.rc_base, self.poisoned,
                                         self.sealed, self.vsum))
                if len(spare) > 2:
                    del spare[0]
            self.objs, self.storages, self.cdatas, self.rc_base = objs, storages, cdatas, rc_base
            self.vsum = sum(map(_version, objs))
            return
        # some groups held: only those change objects, one group at a time
        starts = self.starts
        for gen in spare:
            rcs = list(map(_getrefcount, gen.objs))
            for gi in held_groups:
                a, b = starts[gi], starts[gi + 1]
                if _use_count(gen.cdatas[gi]) != self.uc_base[gi] or rcs[a:b] != gen.rc_base[a:b]:
                    break
            else:
                break
        else:
            objs, storages, cdatas, rc_base = self._make()
            gen = _Generation(objs, storages, cdatas, rc_base, [], -1, 0)
            spare.append(gen)
            if len(spare) > 2:
                del spare[0]
        for gi in held_groups:
            a, b = starts[gi], starts[gi + 1]
            got = gen.objs[a:b]
            _revive(got)
            gen.objs[a:b], self.objs[a:b] = self.objs[a:b], got
            gen.rc_base[a:b], self.rc_base[a:b] = self.rc_base[a:b], gen.rc_base[a:b]
            gen.storages[gi], self.storages[gi] = self.storages[gi], gen.storages[gi]
            gen.cdatas[gi], self.cdatas[gi] = self.cdatas[gi], gen.cdatas[gi]
        gen.poisoned, gen.sealed = SCAN, -1
        self.vsum = sum(map(_version, self.objs))

    def _replace_taken(self) -> None:
        """New objects over this memory in the places of those ``_keep_held`` took back (the others stay)."""
        self.need_fresh = False
        objs, starts, groups = self.objs, self.starts, self.groups
        gi = 0
        with _normal_tensors():
            for i in self.taken:
                while i >= starts[gi + 1]:
                    gi += 1
                size, stride, offset, dtype = groups[gi].members[i - starts[gi]]
                objs[i] = torch.empty(0, dtype=dtype, device=groups[gi].device).set_(self.storages[gi], offset, size, stride)
        self.taken = []
        # (nothing outside gtransform holds any of them now: the held ones were taken back)
        self.rc_base = list(map(_getrefcount, objs))
        self.vsum = sum(map(_version, objs))

    def adopt(self, old: Handout) -> None:
        """Keep handing out ``old``'s tensor objects, now over this memory.

        Used when a signature is recorded again (e.g. when inputs start being
        read in place): objects the caller dropped keep their identity.
        """
        objs = self.objs
        if len(old.objs) != len(objs) or len(old.cdatas) != len(self.cdatas):
            return
        old_objs = old.objs
        rcs = list(map(_getrefcount, old_objs))
        ucs = list(map(_use_count, old.cdatas))
        free = [
            m
            for gi, (u, b) in enumerate(zip(ucs, old.uc_base))
            if u <= b  # no view of the group is alive
            for m in range(self.starts[gi], self.starts[gi + 1])
            if type(old_objs[m]) is torch.Tensor and rcs[m] == old.rc_base[m]
        ]
        old.detach()  # drop its references to the objects
        for m in free:
            try:
                torch.utils.swap_tensors(old_objs[m], objs[m])
            except RuntimeError:
                continue
            objs[m] = old_objs[m]
        del old_objs
        self.refresh()

    def idle(self) -> bool:
        """Whether nothing outside gtransform holds these objects, views of them, or their memory."""
        return (not self.need_fresh
                and list(map(_getrefcount, self.objs)) == self.rc_base
                and list(map(_use_count, self.cdatas)) == self.uc_base)

    def move_to(self, groups: List[OutputGroup]) -> None:
        """Hand out the same objects from now on, over ``groups``' memory (the same layouts; see ``_sharing``).

        Only while nothing outside gtransform holds them: the objects a caller dropped keep
        their identity, as after a recording again (see :meth:`adopt`). The spare
        generations, over the old memory, are dropped.
        """
        storages = []
        with _normal_tensors():
            for gi, g in enumerate(groups):
                st = _alias_base(g.base)
                storages.append(st)
                for m, (size, stride, offset, _dtype) in zip(range(self.starts[gi], self.starts[gi + 1]), g.members):
                    self.objs[m].set_(st, offset, size, stride)
        self.groups = groups
        self.storages = storages
        self.cdatas = [st._cdata for st in storages]
        self.spare = []
        self.refresh()

    def detach(self) -> None:
        """The recording goes away.

        Held objects keep their memory (nothing will overwrite it any more), so there is
        nothing to poison.
        """
        self.objs = []
        self.storages = []
        self.cdatas = []
        self.uc_base = []
        self.rc_base = []
        self.spare = []
        self.taken = []
        self.owner = None


class PoolState:
    """Liveness bookkeeping of one memory pool (in one thread, unless shared).

    ``outstanding`` holds the handouts of the last call of any function using
    this pool; the next such call poisons the objects still held.
    """

    __slots__ = ("outstanding", "calls", "lock", "cuda_pool", "keeper", "abandoned", "last_desc", "keep_held",
                 "kept_gen", "shared_pins", "members", "released", "inputs", "__weakref__")

    def __init__(self, lock: Any = None) -> None:
        # held outputs keep their values (Handout._keep_held) instead of going stale: False,
        # True, or an object whose generation() must be the same as at the last call (_breaks)
        self.keep_held: Any = False
        self.kept_gen: Any = None
        self.outstanding: List[Handout] = []
        self.calls = 0
        self.lock = lock
        self.cuda_pool: Optional[Any] = None  # the CUDA graph pool's id
        self.keeper: Optional[Any] = None
        self.abandoned: List[Any] = []  # keepers of pools a failed capture left unusable (_record._abandon_pool)
        self.last_desc = ""
        # views the caller derived from outputs in memory that any recording of this pool may
        # write (CUDA: captured in the function's pool, where one recording's outputs can lie in
        # another's intermediates): while one lives, no such memory is written (see
        # Recording._maybe_retire)
        self.shared_pins: List[Pin] = []
        # CUDA: the recordings whose first output generation is in the function's pool (weakly),
        # and whether one gave its output memory back to the pool (see _sharing)
        self.members: List[Any] = []
        self.released = False
        # the static input buffers' shared memory: (input index, dtype, device) -> a weak
        # reference to the block (see _sharing.input_buffer)
        self.inputs: Dict[Any, Any] = {}

    def shared_pinned(self) -> bool:
        """Whether views in the pool's shared memory are alive (the dead ones are dropped)."""
        self.shared_pins = live_pins(self.shared_pins)
        return bool(self.shared_pins)

    def begin_call(self, desc: str) -> None:
        """Poison what the previous call handed out and is still held."""
        self.calls += 1
        out = self.outstanding
        keep = self.keep_held
        if keep is not False:
            gen = None if keep is True else keep.generation()
            keep, self.kept_gen = gen == self.kept_gen, gen
        if out:
            for h in out:
                pins = h.poison(self.last_desc, desc, self.calls, keep)
                if pins is False:
                    continue
                ref = h.owner
                owner = ref() if ref is not None else None
                if pins is not None:
                    if owner is None or owner.in_shared_pool:  # (a dead owner's memory: unknown, kept)
                        self.shared_pins += pins
                    if owner is not None:
                        owner.pins += pins
                        owner.must_retire = True
                if owner is None or not owner.must_retire:
                    h.fresh()
                # else: the owner switches memory before it replays
                # (Recording._maybe_retire) and makes the objects there
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("%s: call #%d poisoned held outputs of %s", desc, self.calls, self.last_desc)
            self.outstanding = []
        self.last_desc = desc


def _overwrite_text(old_desc: str, new_desc: str, call_no: int) -> str:
    old_desc, new_desc = _users_name(old_desc), _users_name(new_desc)
    later = "a later call of the same function" if new_desc == old_desc else f"a call of {new_desc}"
    return (
        f"{old_desc}: this output was overwritten by {later}, which reuses the same memory pool "
        f"(the pool's call #{call_no}). An output stays valid only until the next "
        "call of the same graphified function in the same thread, or of any function "
        "sharing its pool. Fix: .clone() the output if you need it after the next call (an object "
        "the function returned holding outputs, a cache or a distribution: copy.deepcopy(obj) before "
        "the next call), or drop it before calling again."
    )


def _users_name(desc: str) -> str:
    """The user's function in the name of a half of its differentiated call (``graphify(forward of ...)``)."""
    for half in ("graphify(forward of ", "graphify(backward of "):
        if desc.startswith(half) and desc.endswith(")"):
            return desc[len(half):-1] + " (differentiated)"
    return desc

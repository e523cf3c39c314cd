"""Outputs that know when they are stale.

A recording's tensor outputs live in memory that the next replay overwrites.
Outputs that share one storage form an :class:`OutputGroup`. The caller gets
tensor objects over an *alias* storage of that memory (a second storage
object over the same bytes, which keeps the bytes alive through DLPack), so:

* if the caller dropped every object of the group (and every view derived
  from them), the next call hands the very same objects out again;
* if the caller still holds an object, the next call poisons it: its class
  becomes :class:`StaleOutput`, whose every operation raises
  :class:`~gtransform.OverwrittenOutputError`. The group then gets fresh
  objects over a fresh alias storage.
* views the caller derived from an output (which we cannot reach) pin the
  memory: the recording moves its outputs to new memory before it writes
  them again, so those views keep the values of their own call and are never
  silently changed.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.utils.dlpack as _dlpack

from ._errors import OverwrittenOutputError
from ._log import log

__all__ = ["OutputGroup", "StaleOutput", "PoolState", "Pin", "poison_tensor", "live_pins"]

_getrefcount = sys.getrefcount
_use_count = torch._C._storage_Use_Count

# Reads that stay legal on a stale output: metadata, no data.
_PROPS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf", "grad_fn")
_METHODS = ("size", "dim", "stride", "numel", "nelement", "element_size", "is_contiguous", "is_floating_point")
_ALLOWED = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _PROPS if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n) for n in _METHODS if hasattr(torch.Tensor, n)]
)


_increment_version = getattr(torch._C, "_increment_version", None) or torch.autograd.graph.increment_version


class StaleOutput(torch.Tensor):
    """Type of an output object that a later call overwrote.

    Every operation on it raises :class:`~gtransform.OverwrittenOutputError`,
    printing included (``print``, ``str``, ``repr``, f-strings; tools that print
    objects safely, such as pytest's reports, show the error instead). Metadata
    (``shape``, ``dtype``, ``device``...) still reads.
    """

    _gt_message: Any  # str() gives the message

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if func in _ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        msg = None
        for a in list(args) + list((kwargs or {}).values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, StaleOutput):
                    msg = t.__dict__.get("_gt_message")
                    break
            if msg is not None:
                break
        raise OverwrittenOutputError(
            f"{msg or 'stale gtransform output'}\n(operation: {name or func})"
        ) from None

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]  # noqa: D105
        raise OverwrittenOutputError(
            f"{self.__dict__.get('_gt_message') or 'stale gtransform output'}\n(operation: repr)"
        )

    def as_subclass(self, cls: Any) -> Any:  # noqa: D102 - would hand out the next call's numbers
        raise OverwrittenOutputError(
            f"{self.__dict__.get('_gt_message') or 'stale gtransform output'}\n(operation: as_subclass)"
        )

    def __str__(self) -> str:  # noqa: D105 - print(), str(), f"{t}": printing reads the numbers
        raise OverwrittenOutputError(
            f"{self.__dict__.get('_gt_message') or 'stale gtransform output'}\n(operation: print / str)"
        )

    def __format__(self, spec: str) -> str:  # noqa: D105
        raise OverwrittenOutputError(
            f"{self.__dict__.get('_gt_message') or 'stale gtransform output'}\n(operation: format)"
        )


def poison_tensor(obj: torch.Tensor, message: Any) -> None:
    """Turn ``obj`` into a :class:`StaleOutput` that raises ``message``."""
    obj.__class__ = StaleOutput
    obj.__dict__["_gt_message"] = message


def _normal_tensors() -> Any:
    """Make output objects normal tensors, even under inference mode.

    The same objects are handed out inside and outside inference mode.
    """
    return torch.inference_mode(False)


def _alias_base(base_u8: torch.Tensor) -> torch.UntypedStorage:
    """A new storage object over ``base_u8``'s bytes that keeps them alive."""
    return _dlpack.from_dlpack(_dlpack.to_dlpack(base_u8)).untyped_storage()


class OutputGroup:
    """Outputs of one recording that share one storage in the pool.

    Args:
        storage: the pool storage the recording writes (kept alive here).
        members: ``(size, stride, storage_offset, dtype)`` of each output.
    """

    __slots__ = ("base", "members", "device", "storage", "cdata", "objs", "limit", "owner", "spare", "need_fresh")

    def __init__(self, storage: torch.UntypedStorage, members: Sequence[Tuple[Any, Any, int, torch.dtype]], owner: Any = None):
        self.device = storage.device
        with _normal_tensors():
            self.base = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        self.members = list(members)
        # earlier generations of objects, poisoned, kept to be revived once
        # the caller has dropped them (the usual `y = f(x)` loop holds the
        # previous output during the next call)
        self.spare: List[Tuple[torch.UntypedStorage, int, List[torch.Tensor]]] = []
        # weak: the pool's list of outstanding groups must not keep a
        # dropped function's recordings alive
        self.owner = weakref.ref(owner) if owner is not None else None
        self.storage: torch.UntypedStorage
        self.cdata = 0
        self.objs: List[torch.Tensor] = []
        self.limit = 0
        self.need_fresh = False
        self.fresh()

    def fresh(self) -> None:
        """Make the tensor objects of the next hand-out.

        A spare generation that nobody holds any more is revived; otherwise
        new objects are made over a new alias storage.
        """
        self.need_fresh = False
        spare = self.spare
        for i, (st0, cd0, objs0) in enumerate(spare):
            if _use_count(cd0) != 1 + len(objs0):
                continue
            for o in objs0:
                if _getrefcount(o) > 3:  # the list, the loop variable and the argument
                    break
            else:
                for o in objs0:
                    if type(o) is StaleOutput:
                        o.__class__ = torch.Tensor  # type: ignore[assignment]
                        o.__dict__.pop("_gt_message", None)
                del spare[i]
                self.storage, self.cdata, self.objs = st0, cd0, objs0
                self.limit = 1 + len(objs0)
                return
        dev = self.device
        objs = []
        with _normal_tensors():
            st = _alias_base(self.base)
            for size, stride, offset, dtype in self.members:
                objs.append(torch.empty(0, dtype=dtype, device=dev).set_(st, offset, size, stride))
        self.storage = st
        self.cdata = st._cdata
        self.objs = objs
        # our storage object + one TensorImpl per member object
        self.limit = 1 + len(objs)

    def poison(self, message: Any) -> Any:
        """If the caller holds an object of the group, or a view of one, poison them.

        The next objects are then made by ``fresh``. Views the caller derived
        from the objects cannot be reached. If any are alive, the returned
        :data:`Pin` says so: the owner must move its outputs to new memory
        before it next writes them (see ``Recording._retire``), so those views
        keep the values of their own call.

        Returns:
            False if nothing was held (nothing done), a :data:`Pin` if views are
            alive, else None.
        """
        storage, cdata, objs = self.storage, self.cdata, self.objs
        pin = (cdata, self.limit, storage, objs) if _use_count(cdata) > self.limit else None
        held = pin is not None
        for o in objs:
            # the list, the loop variable and getrefcount's argument
            if _getrefcount(o) > 3:
                poison_tensor(o, message)
                held = True
        if not held:
            return False
        spare = self.spare
        spare.append((storage, cdata, objs))
        if len(spare) > 2:
            del spare[0]
        # the caller (PoolState.begin_call) makes the next objects, unless the
        # owner moves to another generation before its next replay and makes
        # them there (see Recording._retire)
        self.need_fresh = True
        return pin

    def adopt(self, old: OutputGroup) -> None:
        """Keep handing out ``old``'s tensor objects, now over this group's memory.

        Used when a signature is recorded again (e.g. when inputs start being
        read in place): objects the caller dropped keep their identity.
        """
        if len(old.objs) != len(self.objs) or _use_count(old.cdata) > old.limit:
            return
        free = [type(o) is torch.Tensor and _getrefcount(o) <= 3 for o in old.objs]
        for m, (o_old, o_new) in enumerate(zip(old.objs, self.objs)):
            if free[m]:
                try:
                    torch.utils.swap_tensors(o_old, o_new)
                except RuntimeError:
                    continue
                self.objs[m] = o_old
        old.objs = []
        old.limit = 1

    def detach(self) -> None:
        """The recording goes away.

        Held objects keep their memory (nothing will overwrite it any more), so there is
        nothing to poison.
        """
        self.objs = []
        self.spare = []
        self.limit = 1
        self.owner = None


# An alias storage the caller derived views from: ``(cdata, ours, storage, objects)``.
# It keeps the storage object and the output objects alive, so the storage's use
# count stays exactly ``ours`` (our storage object + one per output object) once
# the views are gone; higher means some view is alive.
Pin = Tuple[int, int, torch.UntypedStorage, List[torch.Tensor]]


def live_pins(pins: List[Pin]) -> List[Pin]:
    """The pins whose views the caller still holds."""
    return [p for p in pins if _use_count(p[0]) > p[1]]


class Handout:
    """The output groups of one recording, with a batched liveness check.

    ``held()`` compares, in two C-level passes, every output object's Python
    reference count and every group storage's use count with their values
    when nothing outside gtransform held them.
    """

    __slots__ = ("groups", "objs", "cdatas", "rc_base", "uc_base")

    def __init__(self, groups: List[OutputGroup]):
        self.groups = groups
        self.refresh()

    def refresh(self) -> None:
        """Re-measure the baselines (call when nothing is handed out)."""
        self.objs = [o for g in self.groups for o in g.objs]
        self.cdatas = [g.cdata for g in self.groups]
        self.uc_base = [g.limit for g in self.groups]
        self.rc_base = list(map(_getrefcount, self.objs))

    def held(self) -> bool:
        """Whether the caller holds any output object, or a view of one."""
        return (
            list(map(_getrefcount, self.objs)) != self.rc_base
            or list(map(_use_count, self.cdatas)) != self.uc_base
        )


class PoolState:
    """Liveness bookkeeping of one memory pool (in one thread, unless shared).

    ``outstanding`` holds the handouts of the last call of any function using
    this pool; the next such call poisons the objects still held.
    """

    __slots__ = ("outstanding", "calls", "lock", "cuda_pool", "keeper", "last_desc", "__weakref__")

    def __init__(self, lock: Any = None) -> None:
        self.outstanding: List[Handout] = []
        self.calls = 0
        self.lock = lock
        self.cuda_pool: Optional[Any] = None
        self.keeper: Optional[Any] = None
        self.last_desc = ""

    def begin_call(self, desc: str) -> None:
        """Poison what the previous call handed out and is still held."""
        self.calls += 1
        out = self.outstanding
        if out:
            for h in out:
                if h.held():
                    msg = _overwrite_message(self.last_desc, desc, self.calls)
                    n = 0
                    pins = None
                    for g in h.groups:
                        objs = g.objs
                        pin = g.poison(msg)
                        if pin is None or pin is False:
                            # its memory is written again: see below
                            _increment_version(objs)
                        if pin is not False:
                            n += 1
                            if pin is not None:
                                if pins is None:
                                    pins = [pin]
                                else:
                                    pins.append(pin)
                    owner = h.groups[0].owner
                    owner = owner() if owner is not None else None
                    if pins is not None and owner is not None:
                        owner.pins += pins
                        owner.must_retire = True
                    if owner is None or not owner.must_retire:
                        for g in h.groups:
                            if g.need_fresh:
                                g.fresh()
                        h.refresh()
                    # else: the owner switches generation before it replays
                    # (Recording._retire), makes the objects there and refreshes
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("%s: call #%d poisoned %d held output group(s) of %s",
                                  desc, self.calls, n, self.last_desc)
                else:
                    # the objects are handed out again over memory this call writes: autograd
                    # may have saved one of them (`loss = (w * y).sum(); del y`), invisibly to
                    # the reference counts; bumping their version counters makes its backward
                    # raise "modified by an inplace operation", as eager would, instead of
                    # computing with the new numbers
                    _increment_version(h.objs)
            self.outstanding = []
        self.last_desc = desc


class _OverwriteMessage:
    """The message of a stale output, formatted only if it is ever shown (off the per-call path)."""

    __slots__ = ("old_desc", "new_desc", "call_no")

    def __init__(self, old_desc: str, new_desc: str, call_no: int):
        self.old_desc, self.new_desc, self.call_no = old_desc, new_desc, call_no

    def __str__(self) -> str:
        return (
            f"{self.old_desc}: this output of pool call #{self.call_no - 1} was overwritten by call "
            f"#{self.call_no} ({self.new_desc}), "
            "which reuses the same memory pool. An output stays valid only until the next "
            "call of the same graphified function in the same thread, or of any function "
            "sharing its pool. Fix: .clone() the output if you need it after the next call, "
            "or drop it before calling again."
        )

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


_overwrite_message = _OverwriteMessage

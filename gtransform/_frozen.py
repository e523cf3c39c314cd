"""Host reads of unchanged tensors, frozen into the trace as guarded constants (DESIGN semantics 12).

A value read on the host while tracing (``.item()``, ``bool(t)``, an ``assert`` on a tensor)
or an output whose shape depends on the data (``nonzero``, ``x[mask]``, ``torch.unique``)
cannot be traced with fake tensors. Where it depends only on tensors that are the same
objects on every call and unwritten since the recording, its real value is the same on
every call: it is computed once and recorded with, and each later call checks that those
tensors are still the very objects, at the same version counter (the ``frozen reads`` check
of ``_key._checks``: no device sync), else the call traces again.

The model, per trace (:class:`Frozen`, owned by ``_watch._Watch``):

* every fake tensor the trace makes carries its *source* in ``__dict__["_gt_src"]``: a leaf
  (an input or a state tensor: its real tensor, or None where it may not be frozen) or the
  operation that made it from other sourced tensors (random ops and ops on unsourced tensors
  make unsourced ones). The sources hold fakes, never real memory;
* every storage an operation writes is *written*: a read that reaches a written fake is not
  frozen (its value while tracing is not its value at call time);
* at a host read, the source graph of its arguments is evaluated on the real tensors (memoized
  per trace, under no_grad, outside every mode): a scalar becomes a Python constant of the
  trace, a tensor a constant of the graph (``lift_fresh_copy``);
* a leaf read that is an argument passed for the first time is a *candidate*: the trace fails
  as before, and ``_lookup`` runs that call eagerly; where the next call passes the very same
  tensor it is frozen (an argument passed anew on that call is the call's own data: the
  read is a GraphifyError, as before);
* a leaf the function writes anywhere in the trace, after the read too, is not unchanged:
  the trace is made again without freezing it (:class:`Refreeze`), where the read fails.

It never changes a real tensor, and a read it cannot freeze goes on to the error path of
``_trace._data_dependent`` unchanged.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._compat import FakeTensor, tensor_version, written_arguments
from ._compat import disable_current_modes as _disable_current_modes
from ._errors import is_library_file

__all__ = ["Frozen", "FrozenRead", "Held", "Refreeze", "NO_VALUE", "guard_refs"]

NO_VALUE = object()
"""What :meth:`Frozen.read` returns where the read is not frozen."""

_SRC = "_gt_src"
_LIFT = torch.ops.aten.lift_fresh_copy.default
_OP_NAMES = {
    "aten._local_scalar_dense.default": ".item() (a value read on the host)",
    "aten.nonzero.default": "nonzero",
    "aten.masked_select.default": "masked_select",
    "aten._unique2.default": "torch.unique",
    "aten.unique_dim.default": "torch.unique",
    "aten.unique_consecutive.default": "torch.unique_consecutive",
    "aten.index.Tensor": "indexing with a boolean mask",
    "aten.equal.default": "torch.equal",
    "aten.bincount.default": "torch.bincount",
    "aten.repeat_interleave.Tensor": "repeat_interleave",
    "aten.alias.default": "a boolean mask's indices (x[mask])",
    "aten.expand.default": "a boolean mask's indices (masked_select)",
}


class Refreeze(Exception):
    """The trace froze a read of tensors the function writes: trace again without freezing them."""

    def __init__(self, leaves: Set[int]):
        super().__init__(sorted(leaves))
        self.leaves = leaves


@dataclass(frozen=True)
class FrozenRead:
    """One host read frozen into a trace: the op, the user's line, the inputs it hangs on, the value."""

    op: str
    site: str
    deps: Tuple[int, ...]  # the recording's input indices (the caller's tensors, then the state)
    value: str


def _user_site() -> str:
    f: Any = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not is_library_file(fn) and not fn.startswith("<"):
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return "?"


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {v.dtype} {list(v.shape)}"
    r = repr(v)
    return r if len(r) < 40 else r[:37] + "..."


class Frozen:
    """The sources of a trace's fakes, the storages it writes, and the reads it froze."""

    def __init__(self, n_in: int, stable: Dict[int, torch.Tensor], no_freeze: FrozenSet[int],
                 in_storages: Sequence[Any] = ()):
        self.n_in = n_in
        # input index -> the real tensor's storage (the caller's arguments', then state's): an
        # argument that is also closed over (or its view) has a fake of its own in the trace,
        # but a write through one is a write of the other
        self.real_storage: Dict[int, Any] = dict(enumerate(in_storages))
        self.written_real: Set[Any] = set()  # real storages of inputs written in place
        self._leaves_of: Dict[Any, List[int]] = {}  # a fake storage -> the inputs over it
        self.stable = stable  # argument index -> the caller's tensor, where it may be frozen
        self.no_freeze = no_freeze  # input indices whose reads stay errors (written by the function)
        self.written: Set[Any] = set()  # storages of fakes written in place
        self.reads: List[FrozenRead] = []
        self.versions: Dict[int, int] = {}  # input index -> version counter of the frozen leaf
        self.ptrs: Dict[int, int] = {}  # input index -> its data pointer then
        self.leaf_storage: Dict[int, Any] = {}  # input index -> its fake's storage
        self.candidates: Set[int] = set()  # arguments whose reads would freeze if passed again
        self.trained: Set[int] = set()  # inputs requiring grad whose reads were not frozen (see read)
        self.training = torch.is_grad_enabled()  # the call's grad mode (a read may sit in a no_grad block)
        self.inference: Set[int] = set()  # inputs made under inference_mode whose reads were not frozen
        self.rewritten: Set[int] = set()  # inputs the function writes whose reads were not frozen
        # inputs read unchanged, but through a tensor the function made and then wrote in place
        # (`grid[-1] = t[-1]`): the sources replayed for a read hold no writes, so not frozen
        self.through_written: Set[int] = set()
        self.leaf_reals: Dict[int, torch.Tensor] = {}  # input index -> its real tensor
        self._memo: Dict[int, Tuple[Any, Any]] = {}  # id(fake) -> (fake, real)

    # -- sources ------------------------------------------------------------------------------
    def leaf(self, fake: torch.Tensor, idx: int, real: Optional[torch.Tensor]) -> None:
        """Mark ``fake`` as input ``idx`` of the trace (``real``: the caller's or the state's tensor)."""
        if idx in self.no_freeze or (idx < self.n_in and idx not in self.stable):
            real = None
        if idx >= self.n_in and real is not None:
            self.real_storage[idx] = StorageWeakRef(real.untyped_storage())
        fake.__dict__[_SRC] = ("leaf", real, frozenset((idx,)))
        key = StorageWeakRef(fake.untyped_storage())
        self.leaf_storage[idx] = key
        self._leaves_of.setdefault(key, []).append(idx)
        if real is not None:
            self.leaf_reals[idx] = real

    def note(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any, seeded: bool) -> None:
        """After an op: the storages it wrote, and the source of each new output."""
        written_args = written_arguments(func)
        if written_args:
            schema_args = func._schema.arguments
            for i in written_args:
                a = schema_args[i]
                v = args[i] if (i < len(args) and not a.kwarg_only) else kwargs.get(a.name)
                for t in _tensors(v):
                    key = StorageWeakRef(t.untyped_storage())
                    self.written.add(key)
                    for idx in self._leaves_of.get(key, ()):
                        rs = self.real_storage.get(idx)
                        if rs is not None:
                            self.written_real.add(rs)
        outs = _tensors(out)
        if not outs or seeded or kwargs.get("generator") is not None:
            return
        deps = self._deps(args, kwargs)
        if deps is None:
            return
        single = isinstance(out, torch.Tensor)
        for k, o in enumerate(outs):
            if isinstance(o, FakeTensor) and _SRC not in o.__dict__:
                o.__dict__[_SRC] = ("op", func, args, kwargs, None if single else k, deps)

    # -- reads ----------------------------------------------------------------------------------
    def _deps(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[FrozenSet[int]]:
        deps: FrozenSet[int] = frozenset()
        for t in _tensors(list(args) + list(kwargs.values())):
            if not isinstance(t, FakeTensor):
                continue  # (a constant made from Python data: torch.tensor([...]))
            src = t.__dict__.get(_SRC)
            if src is None:
                return None
            deps = deps | src[-1]
        return deps

    def read(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], lift: bool) -> Any:
        """The real result of ``func`` on the real tensors behind its arguments, or :data:`NO_VALUE`.

        ``lift``: tensors of the result become constants of the graph (fakes the trace holds).
        """
        deps = self._deps(args, kwargs)
        if deps is None:
            return NO_VALUE
        if any(d in self.no_freeze for d in deps):
            self.rewritten |= deps & self.no_freeze
            return NO_VALUE
        trained = {d for d in deps if d in self.leaf_reals and self.leaf_reals[d].requires_grad}
        if trained and (self.training or torch.is_grad_enabled()):
            # a value of tensors being trained (parameters of a call under grad mode, read there or in
            # a no_grad block of it): an optimizer changes them every step (through .data too, which
            # no version counter shows), and a constant would carry no gradient. (Checked before
            # the arguments: a gradient norm of a step over token ids never freezes, and its
            # arguments are no candidates to run eagerly for.)
            self.trained |= trained
            return NO_VALUE
        new = {d for d in deps if d < self.n_in and d not in self.stable}
        if new:
            self.candidates |= new
            return NO_VALUE
        made_in_inference = {d for d in deps if d in self.leaf_reals and self.leaf_reals[d].is_inference()}
        if made_in_inference:
            # (no version counter: an in-place change under inference_mode could not be seen)
            self.inference |= made_in_inference
            return NO_VALUE
        try:
            real_args = [self._real(a) for a in args]
            real_kwargs = {k: self._real(v) for k, v in kwargs.items()}
        except _NotFrozen:
            written = {d for d in deps if self._was_written(d)}
            self.rewritten |= written
            if not written:  # (unchanged tensors, through one the function made and wrote in place)
                self.through_written |= deps
            return NO_VALUE
        with _disable_current_modes(), torch.no_grad():
            value = func(*real_args, **real_kwargs)
        if any(t.layout != torch.strided for t in _tensors(value)):
            return NO_VALUE  # (a sparse tensor made from a dense one: not a constant a graph holds)
        for d in deps:
            if d not in self.versions:
                self.versions[d] = tensor_version(self.leaf_reals[d])
                self.ptrs[d] = self.leaf_reals[d].data_ptr()  # (`.data =` keeps the object and its version)
        self.reads.append(FrozenRead(_OP_NAMES.get(str(func), str(func)), _user_site(), tuple(sorted(deps)),
                                     _short(value)))
        if not lift:
            return value
        return _map_tensors(value, lambda r: self._lift(r, deps))

    def by_index(self, func: Any, args: Sequence[Any]) -> Any:
        """``x[mask]`` / ``masked_select(x, mask)`` with an unchanged mask and the call's ``x``.

        The mask's nonzero indices are frozen (constants of the graph); the op becomes
        an index by them, traced as usual. :data:`NO_VALUE` where the mask is not frozen.
        """
        aten = torch.ops.aten
        if func is aten.masked_select.default and len(args) == 2:
            x, mask = args
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            real = self.read(aten.expand.default, [mask, list(shape)], {}, lift=False)
            if real is NO_VALUE:
                return NO_VALUE
            idx = self._indices(real, mask)
            return aten.index.Tensor(aten.expand.default(x, list(shape)), idx)
        if func is aten.index.Tensor and len(args) == 2:
            x, indices = args
            new: List[Any] = []
            for b in indices:
                if isinstance(b, torch.Tensor) and b.dtype in (torch.bool, torch.uint8):
                    real = self.read(aten.alias.default, [b], {}, lift=False)
                    if real is NO_VALUE:
                        return NO_VALUE
                    new += self._indices(real, b)
                else:
                    new.append(b)
            return aten.index.Tensor(x, new)
        return NO_VALUE

    def _indices(self, real_mask: torch.Tensor, mask: torch.Tensor) -> List[torch.Tensor]:
        deps = self._deps([mask], {}) or frozenset()
        with _disable_current_modes():
            cols = real_mask.nonzero().unbind(1)
        return [self._lift(c.contiguous(), deps) for c in cols]

    def _lift(self, real: torch.Tensor, deps: FrozenSet[int]) -> torch.Tensor:
        fake = _LIFT(real)
        fake.__dict__[_SRC] = ("leaf", real, deps)
        return fake  # type: ignore[no-any-return]

    def _real(self, v: Any) -> Any:
        """``v`` with each fake replaced by its real value (raises :class:`_NotFrozen` where it has none)."""
        if isinstance(v, (list, tuple)):
            return type(v)(self._real(x) for x in v)
        if not isinstance(v, FakeTensor):
            return v
        hit = self._memo.get(id(v))
        if hit is not None:
            return hit[1]
        if StorageWeakRef(v.untyped_storage()) in self.written:
            raise _NotFrozen
        src = v.__dict__.get(_SRC)
        if src is None:
            raise _NotFrozen
        if src[0] == "leaf":
            real = src[1]
            if real is None or (len(src[2]) == 1 and self._was_written(next(iter(src[2])))):
                raise _NotFrozen  # (an input written through another one over its memory)
        else:
            _, func, args, kwargs, k, _deps = src
            ra = [self._real(a) for a in args]
            rk = {n: self._real(x) for n, x in kwargs.items()}
            with _disable_current_modes(), torch.no_grad():
                out = func(*ra, **rk)
            real = out if k is None else _tensors(out)[k]
        self._memo[id(v)] = (v, real)
        return real

    def _was_written(self, idx: int) -> bool:
        """Whether input ``idx``'s memory was written so far: through its fake, or another input's over it."""
        return self.leaf_storage.get(idx) in self.written or self.real_storage.get(idx) in self.written_real

    def written_leaves(self) -> Set[int]:
        """Frozen inputs the function wrote (before or after the read)."""
        return {d for d in self.versions if self._was_written(d)}


class Held:
    """A strong reference with the call interface of a weak one (state, parameters; also ``_replay``'s first call)."""

    __slots__ = ("t",)

    def __init__(self, t: Any) -> None:
        self.t = t

    def __call__(self) -> Any:
        return self.t


def guard_refs(frozen: Frozen) -> Dict[int, Tuple[Any, int, int]]:
    """Input index -> (reference to the real tensor, its version counter, its data pointer) for each frozen leaf.

    Weak for the caller's plain tensors (a guard keeps no batch alive), strong for state and
    parameters (held by their modules anyway; a weak reference forbids swapping them).
    """
    out: Dict[int, Tuple[Any, int, int]] = {}
    for d, v in sorted(frozen.versions.items()):
        t = frozen.leaf_reals[d]
        weak = d < frozen.n_in and type(t) is not torch.nn.Parameter
        out[d] = (weakref.ref(t) if weak else Held(t), v, frozen.ptrs[d])
    return out


class _NotFrozen(Exception):
    pass


def _tensors(v: Any) -> List[torch.Tensor]:
    """The tensors of ``v``, in nested lists too (``x[mask]``'s indices: ``(x, [mask])``)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _map_tensors(v: Any, fn: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_map_tensors(x, fn) for x in v)
    return v

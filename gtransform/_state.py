"""State: the tensors a function reaches without taking them as arguments.

Module parameters and buffers, optimizer state, caches, closed-over tensors.
The rule (DESIGN semantics 10):

* The trace never touches state: every real tensor an operation meets while
  tracing is swapped for a fake (see ``_watch``), and becomes an input of the
  recorded graph. Each call resolves the state again, through the slot
  :class:`StateIndex` found for it, and hands it to the recording like an
  argument, so reads see current values, in-place updates happen once per call,
  and a state tensor that was replaced (``.data =``, ``module.to()``,
  ``load_state_dict(assign=True)``, a new ``nn.Parameter``) is seen: a new layout
  is a new signature, a new address a new recording.
* Tensors made while tracing that were left in state (``p.grad`` set by
  ``backward()``, ``self.cache = ...``, ``optimizer.state``) are *escapes*: the
  recording returns them as extra outputs and :class:`EscapeWriter` writes them
  back after every replay, as eager would have left them. Escapes a replay cannot
  reproduce (an ``append`` to a list, a new object holding a traced tensor:
  ``memo["b"] = Box(t)``, a Hugging Face ``DynamicCache`` grown) are errors.
* What else decides what a module computes is part of the signature
  (``_key._environment``): the attributes the function read (:class:`AttrReads`)
  and the gradient hooks on state tensors (:class:`GradHooks`).

The Python objects holding the state are found by ``_roots``; ``_snapshot`` puts
them back after a trace; ``_host_effects`` refuses what a replay cannot repeat.
"""

from __future__ import annotations

import enum
import functools
import re
import sys
import types
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ._compat import get_unwrapped as _get_unwrapped
from ._compat import is_functorch_wrapped_tensor as _is_wrapped
from ._errors import GraphifyError
from ._patches import READING as _READING
from ._patches import track_reads, untrack_reads, watch_module_calls
from ._roots import (
    _PLAIN_TYPES,
    _SEQUENCES,
    _TORCH_STATE,
    Root,
    Slot,
    _Module,
    _Optimizer,
    plain_object_roots,
    root_modules,
)

__all__ = ["StateIndex", "EscapeWriter", "AttrReads", "GradHooks", "functorch_base", "leaf_grad"]


def functorch_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor under torch.func's wrappers (``t`` itself when it has none).

    Under ``torch.func.grad``, ``functional_call(model, params, ...)`` puts the
    transform's wrappers of ``params`` in the module's slots, while a trace (run
    outside the transform's levels) reaches the tensors under them.
    """
    if _is_wrapped is not None:
        while _is_wrapped(t):
            t = _get_unwrapped(t)
    return t


def leaf_grad(t: torch.Tensor) -> Any:
    """``t.grad`` where torch keeps one (a leaf, or ``retains_grad``), else None.

    A non-leaf tensor's ``.grad`` is not read: reading it warns.
    """
    return t.grad if t.is_leaf or t.retains_grad else None


def _opt_params(opt: _Optimizer) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


# -- where each state tensor lives --------------------------------------------------------


class StateIndex:
    """Maps state tensors to the slot the function reaches them through.

    A tensor found as a module's parameter or buffer, an optimizer's state, or an
    entry of a reachable dict or object is re-read from that slot on every call,
    so replacing it (``lin.weight = nn.Parameter(...)``) is seen. Others are held
    as they are.
    """

    def __init__(self, roots: Sequence[Root]):
        self.by_id: Dict[int, Slot] = {}
        self.names: Dict[int, str] = {}
        for path, m in root_modules(roots):
            for n, mp in m._parameters.items():
                if mp is not None:
                    self._add(mp, Slot("item", m._parameters, n, f"{path}.{n}"))
                    g = leaf_grad(mp)
                    if g is not None:
                        self._add(g, Slot("grad", mp, "grad", f"{path}.{n}.grad"))
            for n, b in m._buffers.items():
                if b is not None:
                    self._add(b, Slot("item", m._buffers, n, f"{path}.{n}"))
            for n, v in vars(m).items():  # plain tensor attributes (self.h = ..., an RNN's carried state)
                if isinstance(v, torch.Tensor):
                    self._add(v, Slot("item", vars(m), n, f"{path}.{n}"))
        for r in roots:
            obj = r.obj
            if isinstance(obj, _Optimizer):
                pnames = {id(p): self.names.get(id(p), f"param {i}") for i, p in enumerate(_opt_params(obj))}
                for sp, s in obj.state.items():
                    for k, v in s.items():
                        if isinstance(v, torch.Tensor):
                            self._add(v, Slot("item", s, k, f"{r.name}.state[{pnames.get(id(sp), '?')}][{k!r}]"))
                for i, g in enumerate(obj.param_groups):
                    for k, v in g.items():
                        if k != "params" and isinstance(v, torch.Tensor):
                            self._add(v, Slot("item", g, k, f"{r.name}.param_groups[{i}][{k!r}]"))
                for op in _opt_params(obj):
                    if op.grad is not None:
                        self._add(op.grad, Slot("grad", op, "grad", f"{pnames.get(id(op), '?')}.grad"))
            elif isinstance(obj, torch.Tensor):
                if r.slot is not None:
                    self._add(obj, r.slot)
                self.names.setdefault(id(obj), r.name)
                g = leaf_grad(obj)
                if g is not None:
                    self._add(g, Slot("grad", obj, "grad", f"{r.name}.grad"))
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    if isinstance(v, torch.Tensor):
                        self._add(v, Slot("item", obj, k, f"{r.name}[{k!r}]"))
            elif isinstance(obj, _SEQUENCES):
                for i, v in enumerate(obj):
                    if isinstance(v, torch.Tensor):
                        self._add(v, Slot("item", obj, i, f"{r.name}[{i}]"))
            elif not isinstance(obj, _Module) and hasattr(obj, "__dict__"):
                for k, v in vars(obj).items():
                    if isinstance(v, torch.Tensor):
                        self._add(v, Slot("item", vars(obj), k, f"{r.name}.{k}"))

    def _add(self, t: torch.Tensor, slot: Slot) -> None:
        if id(t) not in self.by_id:
            self.by_id[id(t)] = slot
            self.names[id(t)] = slot.path
        base = functorch_base(t)
        if base is not t:
            # a torch.func wrapper (functional_call under torch.func.grad): the trace reaches
            # the tensor under it, which is read from this slot too (unwrapped, see
            # Entry.resolve_state), not held as a constant of the signature
            self._add(base, slot)

    def slot_of(self, t: torch.Tensor) -> Optional[Slot]:
        return self.by_id.get(id(t))

    def name_of(self, t: torch.Tensor, k: int) -> str:
        n = self.names.get(id(t))
        return n if n is not None else f"<closed-over tensor {k}: {t.dtype} {list(t.shape)}>"


class AttrReads:
    """Which attributes of the root modules the function reads while it is traced.

    Within the ``with`` block each root module's class is a subclass of its own that
    records attribute reads (``self.momentum``, ``getattr(self, "p")``) made in the tracing
    thread; the classes are put back on exit (see ``_patches.track_reads``, which says what
    another thread can see meanwhile). A module whose class cannot be swapped is listed in
    ``untracked``: all its plain attributes are then watched (see :func:`env_key_fn`).
    """

    def __init__(self, roots: Sequence[Root]):
        self.mods = [m for _, m in root_modules(roots)]
        self.roots = roots
        # plain objects (a config, `self` of a user's class passed as an argument): their
        # Python attributes the trace reads are keyed the same way (see env_key_fn)
        self.objs = plain_object_roots(roots)
        self.names: Dict[int, Set[str]] = {}
        # (id of the object's __dict__, name) -> where the function first set it (see _patches._tracker)
        self.set_at: Dict[Tuple[int, str], str] = {}
        self.untracked: Set[int] = set()
        self._swapped: List[Tuple[Any, type, type]] = []
        # modules called while tracing that the roots do not lead to (held by a
        # functools.partial, three containers deep, in a set...): their training flags,
        # hooks and attributes are part of the signature all the same
        self.called: List[Any] = []
        self._calls = watch_module_calls(self._seen_call)

    def _seen_call(self, m: Any, args: Any) -> None:
        if getattr(_READING, "reads", None) is not self:  # a module called in another thread
            return
        if id(m) not in self._known:
            self._known.add(id(m))
            self.called.append(m)
            self.untracked.add(id(m))  # its attribute reads are not tracked: all are watched

    def __enter__(self) -> AttrReads:
        self._known = {id(m) for m in self.mods}
        self._calls.__enter__()
        # (torch's own Python state too, an LR scheduler, a GradScaler: which of their tensor lists
        # the function reads, see _key._environment._tensor_containers)
        torch_state = [r.obj for r in self.roots if isinstance(r.obj, _TORCH_STATE)]
        self._swapped, untracked = track_reads(self.mods + [o for _, o in self.objs] + torch_state)
        self.tracked_ids = {id(m) for m, _, _ in self._swapped}
        self.untracked |= untracked
        self._outer = getattr(_READING, "reads", None)
        _READING.reads = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._calls.__exit__()
        _READING.reads = self._outer
        untrack_reads(self._swapped)
        self._swapped = []

    def tracks(self, m: Any) -> bool:
        """Whether the attribute reads of ``m`` were recorded (its class swapped for the trace)."""
        return id(m) in getattr(self, "tracked_ids", ())

    def read(self, m: Any) -> Optional[Set[str]]:
        """The attribute names read on ``m`` (None: not tracked, assume all)."""
        if id(m) in self.untracked:
            return None
        return self.names.get(id(m), set())


_VALUE_TYPES = (enum.Enum, torch.dtype, torch.device, torch.layout, torch.memory_format,
                types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, type)


def _plain_scalar(v: Any) -> bool:
    """A value compared by ``==`` in the signature.

    A number (numpy's, complex), string, None, an enum member, a dtype or device,
    a function or class (compared by identity).
    """
    t = type(v)
    if t in _PLAIN_TYPES or isinstance(v, _VALUE_TYPES):
        return True
    return t.__module__ == "numpy" and getattr(v, "ndim", None) == 0 and t.__name__ not in ("ndarray", "matrix")


def _plain_attr(v: Any) -> bool:
    """A module attribute the trace can only have read as a constant.

    A number (numpy's included), string, None, or a short tuple of them.
    """
    if _plain_scalar(v):
        return True
    return type(v) in (tuple, frozenset) and len(v) <= 64 and all(_plain_scalar(x) for x in v)


# -- gradient hooks on state tensors ---------------------------------------------------------
# A hook on a parameter (p.register_hook, p.register_post_accumulate_grad_hook) runs in the
# backward: a backward inside the function traces it into the recording. Adding or removing
# one afterwards must record again. torch keeps them in a dict per tensor, which the
# environment key compares (GradHooks); reading every parameter's dicts on every call would
# cost microseconds, so they are read again only when one may have changed.
_RemovableHandle = torch.utils.hooks.RemovableHandle


class GradHooks:
    """The gradient hooks on a signature's parameters, as part of its environment key.

    ``value`` is the ids of the hooks (their handles' ids, unique in the process) on the
    parameters of the root modules and optimizers that require grad, in order. It is read
    again (:meth:`refresh`) only when the per-call check of :func:`_compile_env` fails:
    torch numbers every hook handle it makes from one counter
    (``RemovableHandle.next_id``), so an added hook moves it; a removed one shrinks a dict
    that held hooks (``watched``, whose lengths ``lens`` keeps).
    """

    __slots__ = ("mods", "groups", "seen", "value", "watched", "lens")

    def __init__(self, mods: Sequence[Any], groups: Sequence[Dict[str, Any]]):
        self.mods = list(mods)
        self.groups = list(groups)
        self.seen = -1
        self.value: Any = None
        self.watched: List[Dict[Any, Any]] = []
        self.lens: List[int] = []
        self.refresh()
        self.watched = [d for d in self._dicts() if d]
        self.lens = [len(d) for d in self.watched]

    def _dicts(self) -> List[Any]:
        ps = ([p for m in self.mods for p in m._parameters.values() if p is not None and p.requires_grad]
              + [p for g in self.groups for p in g["params"] if isinstance(p, torch.Tensor) and p.requires_grad])
        return [d for p in ps for d in (getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None))]

    def refresh(self) -> Any:
        """Read the hooks again; the new value."""
        seen = _RemovableHandle.next_id
        self.value = tuple(k for d in self._dicts() if d for k in d)
        self.lens[:] = [len(d) for d in self.watched]
        self.seen = seen
        return self.value


# -- writing escapes back -------------------------------------------------------------------


_getrefcount = sys.getrefcount


class EscapeWriter:
    """After each replay, puts the recording's escape outputs where eager left them.

    The objects written are tensors over the recording's memory, which every
    replay overwrites (as ``p.grad`` in torch's own whole-network capture). If
    the caller keeps one of them elsewhere (``g = p.grad``) when the next call
    begins, that object is poisoned and the slot gets a fresh object over the
    same memory.
    """

    def __init__(self, slots: Sequence[Slot], desc: str, handed: Sequence[int] = ()):
        self.slots = list(slots)
        self.desc = desc
        self.last: List[Any] = [None] * len(self.slots)
        self.ptrs: List[int] = [0] * len(self.slots)
        self.reuse = False  # True where replays write the same memory again (CUDA)
        # slots given the very object the call returns (Recording.escape_values): the output
        # rule's handout poisons it when the next call overwrites it, not this writer
        self.handed = frozenset(handed)

    def before_replay(self) -> None:
        """Poison objects of the last call that the caller still holds elsewhere."""
        if not self.reuse:
            return
        from ._liveness import poison_tensor

        last = self.last
        for i in range(len(last)):
            obj = last[i]
            if obj is None or i in self.handed:
                continue
            slot = self.slots[i]
            # the list, this local, getrefcount's argument (+ the slot, if it still holds it)
            held_by_slot = slot.get() is obj
            if _getrefcount(obj) > 3 + held_by_slot:
                fresh = _alias(obj)
                poison_tensor(obj, (
                    f"{self.desc}: this tensor ({slot.path}) was written by an earlier call and is "
                    "overwritten by the next one. Fix: .clone() it if you need it after the next call."))
                if held_by_slot:
                    slot.set(fresh)
                last[i] = fresh

    def write(self, outs: Sequence[torch.Tensor]) -> None:
        """Put this replay's tensors into their slots (the same objects while the memory is the same)."""
        last, ptrs = self.last, self.ptrs
        for i, t in enumerate(outs):
            obj = last[i]
            if i in self.handed:
                obj = last[i] = t
            elif self.reuse:
                ptr = t.data_ptr()
                if obj is None or ptrs[i] != ptr or obj.shape != t.shape:
                    obj = last[i] = _alias(t)  # never hand out the recording's own tensor
                    ptrs[i] = ptr
            else:
                obj = last[i] = t  # fresh memory on every replay
            slot = self.slots[i]
            if slot.get() is not obj:
                slot.set(obj)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``t``'s memory (a normal tensor, even under inference mode)."""
    with torch.inference_mode(False):
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def escape_error(desc: str, where: List[str], site: str, grown: Sequence[str] = ()) -> GraphifyError:
    """A tensor made while tracing was left where no replay can put it.

    ``grown``: the containers appended to; one inside an argument is a cache that grows.
    """
    listing = "; ".join(where[:4]) + (" ..." if len(where) > 4 else "")
    arg = next((p for p in grown if p.startswith(("args[", "kwargs["))), None)
    if arg is not None:
        m = re.match(r"(?:args|kwargs)\[[^\]]*\]", arg)
        owner = m.group(0) if m else arg
        return GraphifyError(
            f"{desc}: a tensor made inside the function escapes into Python state: {listing}.{site}\n"
            f"Why: {arg} belongs to {owner}, an object passed in, and the function appends to it: a "
            "cache that grows on every call (new tensors appended, or made longer with torch.cat). A "
            "recording reads and writes the same memory, of the same shapes, on every replay; an append "
            "happens once, while tracing, and would leave a traced placeholder instead of a real tensor.\n"
            "Fix: preallocate the cache at its full size and write each step into it in place "
            "(cache.k[:, pos] = k, or index_copy_; transformers.StaticCache for Hugging Face models), "
            "or keep the cache outside the graphified function and pass its tensors in. "
            f"{owner} was left as it was before the call."
        )
    return GraphifyError(
        f"{desc}: a tensor made inside the function escapes into Python state: {listing}.{site}\n"
        "Why: a recording replays tensor work only; Python-side effects (appending to a list, "
        "making a new nn.Parameter) happen once, while tracing, and would leave a traced "
        "placeholder instead of a real tensor.\n"
        "Fix: return the tensor from the function and store it outside (e.g. log.append(f(x).clone())), "
        "or write into a preallocated tensor in place (buf.copy_(y))."
    )


def stored_error(desc: str, stored: Sequence[Tuple[str, str, str]], site: str) -> GraphifyError:
    """A new object holding a tensor made while tracing was stored in Python state (``memo["b"] = Box(t)``)."""
    path, inner, kind = stored[0]
    more = (f" (also: {', '.join(p for p, _, _ in stored[1:4])}{' ...' if len(stored) > 4 else ''})"
            if len(stored) > 1 else "")
    if "._per_optimizer_states[" in path:  # (torch.amp.GradScaler's, made in step() and reset by update())
        return GraphifyError(
            f"{desc}: torch.amp.GradScaler stores a new {kind} of per-optimizer state in {path} "
            f"(made in scaler.step(), reset by scaler.update()).{site}\n"
            "Why: a recording replays tensor work only: the dict would be made once, while tracing, around a "
            "placeholder without data, and no replay makes another.\n"
            "Fix: keep scaler.step(optimizer) and scaler.update() outside the graphified function: graphify "
            "the forward, the loss and scaler.scale(loss).backward(), then step and update after the call. "
            f"{path} was left as it was before the call."
        )
    if path.endswith("._last_lr") or "._last_lr[" in path or "._last_lr " in path:
        # (torch.optim.lr_scheduler: step() sets _last_lr to a new list of the groups' lrs, tensors
        # where the lrs are: a scheduler stepped inside the function)
        return GraphifyError(
            f"{desc}: a learning-rate scheduler's step() stores a new {kind} of the groups' learning rates "
            f"in {path}.{site}\n"
            "Why: with tensor learning rates (as capturable optimizers want) the list holds tensors made "
            "while tracing; a recording replays tensor work only, so no replay makes another list, and "
            "the scheduler's own Python (its epoch count, its schedule) would not run either.\n"
            "Fix: call scheduler.step() outside the graphified function, after the call (the learning "
            "rates are tensors read in place by the recording, so the next call uses the new ones). "
            f"{path} was left as it was before the call."
        )
    return GraphifyError(
        f"{desc}: the function stores a new {kind} holding a tensor made inside it in {path} "
        f"(the tensor: {inner}){more}.{site}\n"
        f"Why: a recording replays tensor work only: the {kind} would be made once, while tracing, around "
        "a placeholder without data, and no replay makes another (eager makes a new one, holding new "
        "values, on every call). A tensor stored by itself is fine: it is written back after every call.\n"
        f"Fix: store the tensor itself in the slot ({path} = t, written back after each call), or make "
        f"the {kind} once, outside the function, and set its tensor inside ({inner} = t), or return the "
        f"tensor from the function and build the {kind} outside. {path} was left as it was before the call."
    )


def is_dynamic_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face ``DynamicCache`` (or a subclass): it grows on every call."""
    return any(c.__name__ == "DynamicCache" and (c.__module__ or "").startswith("transformers")
               for c in type(obj).__mro__)


def dynamic_cache_error(desc: str, name: str, obj: Any, changed: Sequence[str], site: str) -> GraphifyError:
    """The trace grew a Hugging Face ``DynamicCache`` (appended layers, or longer keys and values)."""
    listing = "; ".join(changed[:3]) + (" ..." if len(changed) > 3 else "")
    return GraphifyError(
        f"{desc}: {name} is a transformers {type(obj).__name__}, which grows by one step on every call: "
        f"each call makes its keys and values anew, one step longer (torch.cat), and the trace left "
        f"such tensors in it ({listing}).{site}\n"
        "Why: a recording reads and writes fixed memory, the same tensors of the same shapes on every "
        "replay; a cache whose tensors are new, and longer, after every call cannot be replayed (every "
        "call would be a new signature, traced and run eagerly).\n"
        "Fix: use a fixed-size cache written in place: transformers.StaticCache(config=model.config, "
        "max_cache_len=N) as past_key_values, with cache_position (the transformers recipe for CUDA "
        "graphs); or keep the DynamicCache outside the graphified function (run the steps that use it "
        f"eagerly). {name} was left as it was before the call."
    )

"""Signatures: what makes two calls the same recording, and the per-thread cache of them.

A signature is the tree structure of ``(args, kwargs)``, each tensor leaf's
type, shape, strides, dtype, device and ``requires_grad``, the values of the
non-tensor leaves and static arguments, the aliasing pattern among tensors
that are updated in place, and, for functions that touch state (see
``_state.py``), the layout of every state tensor and the environment key
(module ``training`` flags and hooks, optimizer hyperparameters).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from typing import Any, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from ._errors import RerecordWarning
from ._liveness import PoolState
from ._record import Recording
from ._state import functorch_base
from ._trace import Plan, plain_layout
from ._tree import static_leaf_key, tensor_meta
from ._watch import FOR_GRAD, TENSOR_ATTR

__all__ = [
    "Guard", "Entry", "ThreadState", "alias_pattern", "same_objects", "global_key", "dict_orders", "diff_leaves", "sig_brief",
    "RerecordWarning", "StormDetector", "STORM_THRESHOLD",
]

_TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover
    _TensorGuards = None

_Parameter = torch.nn.Parameter
_is_grad_enabled = torch.is_grad_enabled
_get_default_dtype = torch.get_default_dtype
_deterministic = getattr(torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled)
_inference_mode = torch.is_inference_mode_enabled
_any_autocast: Any = getattr(torch._C, "_is_any_autocast_enabled", None)


def global_key(grad_mode: Optional[bool] = None) -> Tuple[Any, ...]:
    """The global settings that change what a function computes, like dynamo's global guards.

    Grad mode, the default dtype, the autocast state (per device type),
    ``torch.use_deterministic_algorithms`` (which picks kernels, and which code may branch on),
    and whether the call is differentiated by ``torch.func.grad``/``vjp`` (``FOR_GRAD``): such a
    trace sees the tensors under the transform's wrappers, whose ``requires_grad`` is not what the
    transform differentiates, so it keeps every output differentiable (``Plan.rg_traced``
    False), while a plain call's trace marks outputs of inputs that do not require grad (and
    detached ones) as not; one trace serving the other gave a plain call outputs that require
    grad where eager's do not, and torch.func.grad zero gradients.
    """
    gm = _is_grad_enabled() if grad_mode is None else grad_mode
    ac = None
    if _any_autocast is None or _any_autocast():
        ac = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    # inference mode: the tensors' dispatch keys differ (the guards' view), so a function called
    # in turn under inference_mode() and no_grad() keeps a recording for each
    return (gm, _get_default_dtype(), ac, _deterministic(), _inference_mode(), bool(getattr(FOR_GRAD, "on", False)))


def dict_orders(tree: Any) -> Tuple[Tuple[Any, ...], ...]:
    """Insertion order of every dict with several keys in ``tree`` (optree sorts keys; a function may not)."""
    out: List[Tuple[Any, ...]] = []

    def walk(x: Any) -> None:
        t = type(x)
        if t is dict:
            if len(x) > 1:
                out.append(tuple(x))
            for v in x.values():
                walk(v)
        elif t is list or t is tuple:
            for v in x:
                walk(v)

    walk(tree)
    return tuple(out)


class Guard:
    """Fast check that a call's tensors match a signature."""

    __slots__ = ("impl", "metas")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.metas = [tensor_meta(t) for t in tensors]
        self.impl: Any = None
        if _TensorGuards is not None and tensors:
            try:
                self.impl = _TensorGuards(
                    *tensors,
                    dynamic_dims_sizes=[list(t.size()) for t in tensors],  # type: ignore[misc]
                    dynamic_dims_strides=[list(t.stride()) for t in tensors],  # type: ignore[misc]
                )
                if not self.impl.check(*tensors):  # pragma: no cover - defensive
                    self.impl = None
            except Exception:  # pragma: no cover
                self.impl = None

    def check(self, tensors: Sequence[torch.Tensor]) -> bool:
        impl = self.impl
        try:
            if impl is not None:
                return bool(impl.check(*tensors))
            if not self.metas:
                return True
            return [tensor_meta(t) for t in tensors] == self.metas
        except Exception:
            return False


def alias_pattern(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """Which tensor inputs share storage: a group id per input, -1 if alone."""
    seen: Dict[int, int] = {}
    ids = []
    for t in tensors:
        c = t.untyped_storage()._cdata
        ids.append(seen.setdefault(c, len(seen)))
    counts: Dict[int, int] = {}
    for g in ids:
        counts[g] = counts.get(g, 0) + 1
    if all(c == 1 for c in counts.values()):
        return ()
    return tuple(g if counts[g] > 1 else -1 for g in ids)


def same_objects(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
    """Which tensor inputs are the very same object.

    Per input, the first position of its object; ``()`` when all are distinct (the
    usual case, one C-level pass).

    Part of the signature: a function may branch on ``a is b`` (a kernel k(X, X) adding
    jitter to its diagonal, attention's ``query is key``), and the trace then takes the
    branch eager takes.
    """
    ids = list(map(id, tensors))
    if len(set(ids)) == len(ids):
        return ()
    first: Dict[int, int] = {}
    return tuple(first.setdefault(x, k) for k, x in enumerate(ids))


def has_grad(t: torch.Tensor) -> bool:
    """Whether ``t`` has a ``.grad`` (read without the non-leaf warning)."""
    return (t.is_leaf or t.retains_grad) and t.grad is not None


def tensor_attrs(t: torch.Tensor) -> Optional[Dict[str, Any]]:
    """The Python attributes of a tensor input that the trace's stand-in gets.

    Tensor-valued ones are given as :data:`TENSOR_ATTR`: the trace sets a
    stand-in whose use is refused (see ``_watch._TensorAttr``).
    """
    d = t.__dict__
    if not d:
        return None
    return {k: (TENSOR_ATTR if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def attrs_key(t: torch.Tensor) -> Any:
    """Key of a tensor input's Python attributes (``()``: none)."""
    d = t.__dict__
    if not d:
        return ()
    out = []
    for k, v in d.items():
        try:
            out.append((k, static_leaf_key(v)))
        except TypeError:
            out.append((k, ("id", id(v))))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _place(slot: Any) -> Tuple[int, Any]:
    """Where a slot points, the same for ``obj.k`` and ``vars(obj)["k"]``."""
    if slot.kind == "attr":
        return id(vars(slot.obj)) if hasattr(slot.obj, "__dict__") else id(slot.obj), slot.key
    return id(slot.obj), slot.key


class Entry:
    """One signature: its trace, its state binding and its current recording."""

    __slots__ = (
        "key", "spec", "tpos", "consts", "statics", "guard", "plan", "rec", "first_refs",
        "calls", "cuda", "any_rg", "must_static", "alias", "same", "n_leaves", "bwd", "const_vals", "parts",
        "state_src", "env", "env_val", "n_user", "state_static", "glob", "orders", "attrs", "grad_none",
    )

    def __init__(self, key: Hashable, spec: Any, leaves: Sequence[Any], tpos: List[int], statics: Any, plan: Plan, cuda: bool):
        self.key = key
        self.glob = key[4]  # type: ignore[index]
        self.orders = key[5]  # type: ignore[index]
        self.spec = spec
        self.tpos = tpos
        self.n_leaves = len(leaves)
        self.n_user = len(tpos)
        tset = set(tpos)
        self.consts = [(i, static_leaf_key(leaves[i])) for i in range(len(leaves)) if i not in tset]
        self.const_vals = {i: leaves[i] for i, _ in self.consts}
        self.statics = statics
        # state: where each state tensor is read from on every call, and the object it must
        # still be there (a parameter replaced by a new nn.Parameter is traced again: the
        # optimizer, hooks and .grad write-backs of the recording are bound to the old
        # object); not for .grad slots (replaced every step) nor for state the function
        # itself writes back (carried state)
        written = {_place(s) for s in plan.escape_slots}
        self.state_src: List[Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]] = [
            (slot, None if slot is not None else t,
             t if slot is not None and slot.kind != "grad" and _place(slot) not in written else None)
            for slot, t in zip(plan.state_slots, plan.state)
        ]
        state = list(plan.state)
        tensors = [leaves[i] for i in tpos] + state
        self.guard = Guard(tensors)
        # Python attributes of the caller's tensors (read by the trace): None when none has any
        attrs = tuple(attrs_key(t) for t in tensors[: len(tpos)])
        self.attrs = attrs if any(attrs) else None
        self.alias = alias_pattern(tensors) if plan.mutated else ()
        self.same = same_objects(tensors[: len(tpos)])
        self.plan = plan
        self.rec: Optional[Recording] = None
        self.first_refs: Optional[List[Any]] = None
        self.calls = 0
        self.cuda = cuda
        self.env: Any = None
        self.env_val: Any = None
        # tensors whose .grad the function's backward creates (written back after each call)
        # and that had none when traced: eager accumulates into a .grad that is there (one
        # the last call left, unless something set it to None in between), so a .grad being
        # there at call time is another signature
        self.grad_none = [s.obj for s in plan.escape_slots if s.kind == "grad" and s.get() is None]
        # state read in place (a .grad that is replaced every step is copied instead)
        self.state_static = {self.n_user + k for k, s in enumerate(plan.state_slots) if s is None or s.kind != "grad"}
        rg = [t.requires_grad for t in tensors]
        user_rg = any(rg[: self.n_user])
        state_rg = any(rg[self.n_user:])
        # a call is differentiated through the recording when an argument needs
        # grad, or when it reads parameters without updating them (a forward);
        # a whole training step (backward and optimizer inside) is a plain call
        # (an update of a parameter whose .grad the function reads: an optimizer step; an
        # update of one whose .grad it does not read, such as Embedding(max_norm=...)'s
        # renorm under no_grad in a forward, leaves the call differentiable, as in eager)
        # (and a call none of whose outputs needs grad, e.g. an EMA update that returns
        # nothing, stays a plain call)
        updated = [tensors[i] for i in plan.mutated if i >= self.n_user and rg[i]]
        # (a backward the function ran itself, then an update: a training step, also when it
        # ends with opt.zero_grad(), which leaves no .grad behind)
        # (a backward that only returns gradients, torch.autograd.grad(..., create_graph=True) for
        # a gradient penalty, writes no .grad and updates nothing: its outputs that require grad
        # in the trace do so in eager, and the call is differentiated)
        touches_grads = any(s.kind == "grad" for s in plan.escape_slots) or any(
            s is not None and s.kind == "grad" for s in plan.state_slots)
        updates_params = touches_grads or (plan.ran_backward and (bool(updated) or not any(
            e.requires_grad for e in plan.tensor_entries)))
        if updated and not updates_params:
            graded = {id(s.obj) for s in plan.state_slots if s is not None and s.kind == "grad"}
            updates_params = any(id(t) in graded for t in updated) or not any(
                e.requires_grad for e in plan.tensor_entries)
        self.any_rg = user_rg or (state_rg and not updates_params)
        must = set()
        if plan.mutated and self.alias:
            groups: Dict[int, List[int]] = {}
            for i, gid in enumerate(self.alias):
                if gid >= 0:
                    groups.setdefault(gid, []).append(i)
            for members in groups.values():
                if any(i in plan.mutated for i in members):
                    must.update(members)
        self.must_static = must
        self.bwd: Dict[Tuple[bool, ...], Any] = {}
        self.parts: Dict[Tuple[bool, ...], Any] = {}

    def grads_came_or_went(self, leaves: Sequence[Any] = ()) -> bool:
        """Whether a ``.grad`` the recording reads is gone, or one it expects absent is there.

        Gradient accumulation alternates between both (the first micro-batch after
        ``zero_grad()`` makes the ``.grad``s, the next ones add to them): each kind keeps
        its recording as an alternate of the key (see ``ThreadState.alts``) instead of
        tracing again on every switch. So does an input whose leafness the function reads
        (``x.is_leaf``) and that comes with and without autograd history.
        """
        if any(t.grad is not None for t in self.grad_none):
            return True
        if self.plan.leaf_idx and leaves:
            ts = [leaves[i] for i in self.tpos]
            if any((ts[i].grad_fn is not None) != h for i, h in self.plan.leaf_idx.items() if i < len(ts)):
                return True
        return any(slot is not None and slot.kind == "grad" and slot.get() is None for slot, _c, _s in self.state_src)

    def resolve_state(self) -> Optional[List[torch.Tensor]]:
        """The state tensors as the function reaches them now (``None``: one is gone or replaced).

        For a call under ``torch.func.grad`` (looked up with ``FOR_GRAD`` on), the tensors
        under the transform's wrappers that slots may hold (``functional_call``'s
        parameters), as the trace reaches them: see :meth:`held_state`.
        """
        base = functorch_base if getattr(FOR_GRAD, "on", False) else None
        out: List[torch.Tensor] = []
        for slot, const, same in self.state_src:
            if slot is None:
                out.append(const)  # type: ignore[arg-type]
                continue
            v = slot.get()
            if base is not None and isinstance(v, torch.Tensor):
                v = base(v)
            if not isinstance(v, torch.Tensor) or (same is not None and v is not same):
                return None
            out.append(v)
        return out

    def held_state(self, state: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The objects the slots hold for ``state`` (:meth:`resolve_state`'s, just resolved).

        Under ``torch.func.grad`` those are the transform's wrappers where a slot holds
        one: the autograd wrapper of the recording must take them, not the tensors under
        them, for the transform to see its output depend on them.
        """
        return [t if slot is None else slot.get() for (slot, _c, _s), t in zip(self.state_src, state)]

    def matching_state(self, leaves: Sequence[Any], statics: Any) -> Optional[List[torch.Tensor]]:
        """The call's state tensors if the call replays this signature, else ``None``."""
        state = self.resolve_state() if self.state_src else []
        return state if state is not None and self.match(leaves, statics, state) else None

    def env_only_mismatch(self, leaves: Sequence[Any], statics: Any) -> bool:
        """Whether a call differs from this signature in its environment only.

        (Training flags, attributes read, hyperparameters: see ``_state.env_key_fn``.)
        Such a signature is kept as an alternate of its key (see ``ThreadState.alts``):
        a model switched between train() and eval() replays both recordings.
        """
        if self.env is None or self.env() == self.env_val:
            return False
        state = self.resolve_state() if self.state_src else []
        return state is not None and self.match(leaves, statics, state, check_env=False)

    def env_keeps_lazy_state(self) -> bool:
        """Whether what changed in the environment leaves lazily made state as it was.

        A training flag, an attribute, a hook or a hyperparameter: yes; the optimizers'
        state or parameter groups, or the module tree (``optimizer.state.clear()``,
        a submodule replaced): no, the next call then runs eagerly first.
        """
        part = getattr(self.env, "lazy_part", None)
        return part is not None and part(self.env()) == part(self.env_val)

    def match(self, leaves: Sequence[Any], statics: Any, state: Sequence[torch.Tensor] = (), check_env: bool = True) -> bool:
        """Whether a call with these leaves (and state) replays this signature."""
        if len(leaves) != self.n_leaves or statics != self.statics:
            return False
        for t in self.grad_none:
            if t.grad is not None:
                return False
        for i, k in self.consts:
            try:
                if static_leaf_key(leaves[i]) != k:
                    return False
            except TypeError:
                return False
        tensors = [leaves[i] for i in self.tpos]
        if len(tensors) > 1 and same_objects(tensors) != self.same:
            return False
        tensors.extend(state)
        if not self.guard.check(tensors):
            return False
        if check_env and self.env is not None and self.env() != self.env_val:
            return False
        if self.attrs is None:
            for i in self.tpos:
                if leaves[i].__dict__:
                    return False
        elif tuple(attrs_key(leaves[i]) for i in self.tpos) != self.attrs:
            return False
        if self.plan.grad_idx and any(has_grad(tensors[i]) for i in self.plan.grad_idx):
            return False  # the function read these inputs' .grad as None
        if self.plan.layout_idx and not all(plain_layout(tensors[i]) for i in self.plan.layout_idx):
            return False  # the function reads these inputs' storage offset or layout
        if self.plan.leaf_idx and any((tensors[i].grad_fn is not None) != h for i, h in self.plan.leaf_idx.items()):
            return False  # the function reads whether these inputs are leaves
        if self.plan.mutated:
            # which inputs share memory decides what an in-place update changes: a call
            # whose inputs overlap where the recording's did not (or the other way) is
            # another signature (the fast path checks the same)
            return alias_pattern(tensors) == self.alias
        return True


def reusable_after_eager(plan: Plan) -> bool:
    """Whether the trace made by the eager first call of a signature can serve its second.

    The second call must still match it as any cached signature must (its guards, the
    state it reads, the Python attributes it keys on).

    Only when the trace left Python state as it found it: it changed no Python value and
    wrote tensors back only where it read state tensors. Then the eager call, which runs the
    same operations, creates nothing the trace did not see (no optimizer moment, no cache
    allocated on first use, no attribute set): those make a second trace.
    """
    if plan.py_changes:
        return False
    read = {_place(s) for s in plan.state_slots if s is not None}
    return all(_place(s) in read for s in plan.escape_slots)


class _Marks:
    """A set of signature keys, the oldest forgotten beyond a bound (see ThreadState.bound).

    The keys hold the calls' static values (objects passed as arguments: a KV cache, a
    config): unbounded, a server called with new lengths or new cache objects kept every
    one alive. Forgetting a mark costs at most an extra eager call.
    """

    __slots__ = ("d", "limit")

    def __init__(self) -> None:
        self.d: Dict[Hashable, None] = OrderedDict()
        self.limit: Optional[int] = None

    def add(self, key: Hashable) -> None:
        d = self.d
        d[key] = None
        if self.limit is not None:
            while len(d) > self.limit:
                del d[next(iter(d))]

    def discard(self, key: Hashable) -> None:
        self.d.pop(key, None)

    def clear(self) -> None:
        self.d.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.d

    def __len__(self) -> int:
        return len(self.d)


class ThreadState:
    """One thread's signature cache of one graphified function."""

    __slots__ = ("cache", "last", "pool", "fast", "fast_rec", "fast_statics", "warmed", "eager_only", "pending",
                 "clear_requested", "alts", "pending_limit", "raised", "raised_what", "eager_now",
                 "__weakref__")

    ALTS = 3  # alternates kept per key (see alts)

    def __init__(self, pool: PoolState):
        self.cache: OrderedDict[Hashable, Entry] = OrderedDict()
        self.last: Optional[Entry] = None
        self.pool = pool
        self.fast: Any = None  # generated fast call of the last settled recording
        self.fast_rec: Any = None
        self.fast_statics: Any = None
        # signatures that touch state and had their eager first call
        self.warmed: _Marks = _Marks()
        # signatures whose trace failed inside torch's fake kernels while eager ran fine
        self.eager_only: _Marks = _Marks()
        # the key of the call being made whose trace raised the function's own exception, and
        # that exception in words: the call runs eagerly (see Graphified._eager)
        self.raised: Optional[Hashable] = None
        self.raised_what = ""
        self.eager_now = False  # the call being made is of a signature that runs eagerly (eager_only)
        # the first call's trace of a signature that touches state, kept for its second call
        # (see reusable_after_eager); checked there as any cached signature is
        self.pending: Dict[Hashable, Entry] = OrderedDict()
        self.pending_limit: Optional[int] = None
        self.clear_requested = False  # by cache_clear() in another thread
        # signatures of a key that differ from its cached one in their environment only (a
        # model in eval() mode while the cached one is train(); see Entry.env_only_mismatch),
        # most recent first: a switch back replays them instead of recording again
        self.alts: Dict[Hashable, List[Entry]] = {}

    def clear(self) -> None:
        self.clear_requested = False
        for e in self.cache.values():
            if e.rec is not None:
                e.rec.close()
        self.cache.clear()
        for alts in self.alts.values():
            for e in alts:
                if e.rec is not None:
                    e.rec.close()
        self.alts.clear()
        self.warmed.clear()
        self.eager_only.clear()
        self.pending.clear()
        self.last = None
        self.drop_fast()

    def drop(self, e: Entry, keep_alts: bool = False) -> None:
        """Forget one signature (its recording is closed), and its key's alternates unless ``keep_alts``."""
        if self.cache.get(e.key) is e:
            del self.cache[e.key]
            if not keep_alts:
                for a in self.alts.pop(e.key, ()):
                    self.drop(a, keep_alts=True)
        if e.rec is not None:
            if self.fast_rec is e.rec:
                self.drop_fast()
            e.rec.close()
        if self.last is e:
            self.last = None

    def set_aside(self, e: Entry) -> None:
        """Keep ``e`` as an alternate of its key (the cache's entry is being replaced)."""
        if self.cache.get(e.key) is e:
            del self.cache[e.key]
        if self.last is e:
            self.last = None
        alts = self.alts.setdefault(e.key, [])
        alts.insert(0, e)
        while len(alts) > self.ALTS:
            self.drop(alts.pop(), keep_alts=True)

    def take_alt(self, key: Hashable, leaves: Sequence[Any], statics: Any) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
        """An alternate of ``key`` this call replays, with its state, made the key's entry again."""
        for a in self.alts.get(key, ()):
            state = a.matching_state(leaves, statics)
            if state is not None:
                self.alts[key].remove(a)
                return a, state
        return None

    def drop_fast(self) -> None:
        self.fast = self.fast_rec = self.fast_statics = None

    def bound(self, maxsize: Optional[int]) -> None:
        """Bound the bookkeeping besides the cache by ``maxsize`` (its first-call traces, marks)."""
        limit = None if maxsize is None else max(2 * maxsize, 8)
        self.warmed.limit = self.eager_only.limit = limit
        self.pending_limit = None if maxsize is None else max(maxsize, 4)

    def keep_pending(self, key: Hashable, e: Entry) -> None:
        """Keep the first call's trace of a signature for its second call (bounded)."""
        p = self.pending
        p[key] = e
        if self.pending_limit is not None:
            while len(p) > self.pending_limit:
                del p[next(iter(p))]


def sig_brief(e: Entry) -> str:
    """The first few inputs of a signature, for log lines."""
    parts = [f"{p}: {m[3]}{list(m[1])}" for p, m in zip(e.plan.in_paths, e.guard.metas)]
    s = ", ".join(parts[:4])
    return s + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "")


def diff_leaves(e: Entry, leaves: Sequence[Any], paths: Sequence[str]) -> List[str]:
    """How a call's leaves differ from a signature's, leaf by leaf."""
    out: List[str] = []
    tpos = {p: k for k, p in enumerate(e.tpos)}
    for i, x in enumerate(leaves):
        if i in tpos:
            old = e.guard.metas[tpos[i]]
            if not isinstance(x, torch.Tensor):
                out.append(f"{paths[i]}: tensor -> {type(x).__name__}")
                continue
            new = tensor_meta(x)
            for j, name in ((1, "shape"), (3, "dtype"), (2, "strides"), (5, "requires_grad"), (4, "device"), (0, "type")):
                if old[j] != new[j]:
                    out.append(f"{paths[i]}: {name} {old[j]} -> {new[j]}")
        else:
            old_v = e.const_vals.get(i)
            if isinstance(x, torch.Tensor):
                out.append(f"{paths[i]}: static {type(old_v).__name__} -> tensor")
            else:
                try:
                    same = static_leaf_key(x) == static_leaf_key(old_v)
                except TypeError:
                    same = False
                if not same:
                    out.append(f"{paths[i]}: static value {old_v!r} -> {x!r}")
    if e.attrs is not None or any(isinstance(leaves[i], torch.Tensor) and leaves[i].__dict__ for i in e.tpos):
        olds = e.attrs or ((),) * len(e.tpos)
        for i, old_a in zip(e.tpos, olds):
            x = leaves[i]
            if isinstance(x, torch.Tensor) and attrs_key(x) != old_a:
                out.append(f"{paths[i]}: its Python attributes changed ({', '.join(sorted(x.__dict__)) or 'none now'})")
    state = e.resolve_state() if e.state_src else []
    if state is None:
        gone: List[str] = []
        for k, (slot, _const, traced) in enumerate(e.state_src):
            if slot is None:
                continue
            v = slot.get()
            name = e.plan.state_names[k] if k < len(e.plan.state_names) else slot.path
            if not isinstance(v, torch.Tensor):
                gone.append(f"state {name} is gone (its slot holds {type(v).__name__} now)")
            elif traced is not None and v is not traced:
                gone.append(f"state {name} is another tensor now (rebound between calls)")
        out.extend(gone or ["a state tensor the function reads is gone or was replaced"])
    else:
        for k, t in enumerate(state):
            old = e.guard.metas[e.n_user + k]
            new = tensor_meta(t)
            if old != new:
                out.append(f"state {e.plan.state_names[k]}: {old[3]}{list(old[1])} -> {new[3]}{list(new[1])}")
    if e.env is not None and e.env() != e.env_val:
        diff = getattr(e.env, "diff", None)
        out.extend((diff(e.env_val) if diff is not None else None) or
                   ["module training flags, attributes, hooks or optimizer hyperparameters changed"])
    glob = global_key()
    for name, old, new in zip(("grad mode (torch.is_grad_enabled())", "the default dtype", "autocast",
                               "torch.use_deterministic_algorithms", "inference mode",
                               "differentiated by torch.func.grad / vjp"), e.glob, glob):
        if old != new:
            out.append(f"{name}: {old} -> {new}")
    return out


STORM_THRESHOLD = 16


def _leaf_kind(values: Set[Any]) -> str:
    """The types of a leaf's static values, the most frequent first, with counts where several.

    ("int (8 values), float (8) and bool (1)": a lone bool among numbers is not what changed.)
    """
    counts: Dict[str, int] = {}
    for v in values:
        if isinstance(v, tuple) and v and isinstance(v[0], type):
            counts[v[0].__name__] = counts.get(v[0].__name__, 0) + 1
    if not counts:
        return "value"
    order = sorted(counts, key=lambda k: (-counts[k], k))
    if len(order) == 1:
        return order[0]
    parts = [f"{order[0]} ({counts[order[0]]} values)"] + [f"{k} ({counts[k]})" for k in order[1:]]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


_VALUE_TYPES = (int, float, bool, str, bytes, complex, type(None), tuple, frozenset, torch.dtype, torch.device)


def _objects(values: Set[Any]) -> bool:
    """Whether the static keys ``values`` are objects keyed by identity, not values."""
    for v in values:
        if not (isinstance(v, tuple) and v and isinstance(v[0], type)):
            return False
        t = v[0]
        if issubclass(t, _VALUE_TYPES) or dataclasses.is_dataclass(t) or t.__module__ in ("numpy", "enum"):
            return False
    return True


def explain_storm(desc: str, log: List[Any]) -> str:
    """The warning text: which part of the signature keeps changing, and the fix."""
    n = len(log)
    specs = {id(x[0]): x[0] for x in log}
    lines = [f"{desc} has recorded {n} new signatures (more than {STORM_THRESHOLD}); each costs a trace and a recording."]
    same = [x for x in log if x[0] == log[-1][0]]
    if len({str(s) for s in specs.values()}) > 1 and len(same) < n // 2:
        lines.append("The structure of the arguments keeps changing (different containers, keys or lengths). "
                     "Fix: keep the argument tree fixed; pass varying collections as tensors.")
    parts = [x[1] for x in same]
    paths = same[-1][2]
    for i in range(len(parts[-1])):
        values = {p[i] for p in parts if i < len(p)}
        if len(values) <= 1:
            continue
        sample = parts[-1][i]
        path = paths[i] if i < len(paths) else f"leaf {i}"
        if isinstance(sample, tuple) and len(sample) == 6 and isinstance(sample[3], torch.dtype):
            what = []
            for j, name in ((1, "shape"), (3, "dtype"), (2, "strides"), (5, "requires_grad"), (4, "device")):
                if len({p[i][j] for p in parts}) > 1:
                    what.append(name)
            lines.append(f"{path} (a tensor) changed {', '.join(what) or 'layout'} {len(values)} times. "
                         "Fix: pad or bucket inputs to a few fixed shapes, and keep dtypes and layouts fixed.")
        elif _objects(values):
            lines.append(f"{path} (a {_leaf_kind(values)} object) was {len(values)} different objects: an object "
                         "argument is part of the signature by identity (the recording reads its tensors), so "
                         "each new object is a new signature. Fix: pass the same object on every call (e.g. "
                         "one transformers StaticCache, .reset() between requests), or close over it.")
        else:
            lines.append(f"{path} (a Python {_leaf_kind(values)}) took {len(values)} values: non-tensor leaves are "
                         "static, so each value is a new signature. Fix: pass it as a tensor "
                         "(torch.tensor(v, device=...)).")
    stat = {x[3] for x in same}
    if len(stat) > 1:
        lines.append(f"the static arguments took {len(stat)} values. Fix: do not mark changing arguments static.")
    return "\n".join(lines)


ENV_STORM_CALLS = (8, 32)
"""Warn when 8 recordings caused by environment changes fall within 32 calls."""
STATE_STORM_CALLS = (4, 16)
"""Warn when a signature is traced again 4 times within 16 calls because its state changed
(each costs an eager call, a trace and a recording)."""


def _env_fix(whats: List[str]) -> str:
    """The fix for what keeps changing in the environment (see explain_env_storm)."""
    fixes = []
    if any("optimizer hyperparameter" in w and "['lr']" in w for w in whats):
        fixes.append(
            "A learning-rate scheduler sets a new Python-float lr after every step, and each value is "
            "a new recording. Give the optimizer a tensor learning rate, e.g. "
            "torch.optim.SGD(params, lr=torch.tensor(0.01, device=dev), fused=True), in an "
            "implementation that keeps it on the device: fused=True (SGD, Adam, AdamW, Adagrad), "
            "foreach=True (SGD, Adagrad, Rprop; SGD's default on the GPU) or capturable=True (Adam, "
            "AdamW on the GPU). The scheduler then updates it in place and every replay reads it. "
            "Or keep opt.step() outside the graphified function.")
    if any("optimizer hyperparameter" in w and "['lr']" not in w for w in whats):
        fixes.append(
            "An optimizer hyperparameter other than lr keeps changing (OneCycleLR and CyclicLR cycle "
            "momentum or betas by default): keep it fixed (cycle_momentum=False), or keep opt.step() "
            "outside the graphified function.")
    if any(w.startswith(("module attribute", "attribute", "class attribute")) for w in whats):
        fixes.append(
            "A Python attribute the function reads keeps changing: each value is a constant of its "
            "recording. Hold the value in a tensor the function reads instead (a buffer: "
            "module.register_buffer('scale', torch.tensor(v)), updated in place with .fill_(v)).")
    if any(w.endswith((": True -> False", ": False -> True")) and ".training" in w for w in whats):
        fixes.append(
            "Modules switch between train() and eval() with more than a few other changes in between; "
            "gtransform keeps 3 earlier environments per signature. Switch less often, or graphify the "
            "training and the evaluation step as two functions.")
    if not fixes:
        fixes.append("Keep module attributes, hooks and optimizer settings fixed between calls, or keep "
                     "the part that changes outside the graphified function.")
    return "\n".join("Fix: " + f for f in fixes)


def _tally(log: List[List[str]]) -> Tuple[List[str], Dict[str, int], Dict[str, str]]:
    """What changed in ``log`` (lines "what: old -> new" or "what is ..."), most often first."""
    counts: Dict[str, int] = {}
    last: Dict[str, str] = {}
    for changes in log:
        for c in changes:
            what = c.split(": ", 1)[0] if ": " in c else c.split(" is ", 1)[0]
            counts[what] = counts.get(what, 0) + 1
            last[what] = c
    return sorted(counts, key=lambda w: -counts[w]), counts, last


def explain_state_storm(desc: str, log: List[List[str]], calls: int) -> str:
    """The warning text for signatures traced again because their state changed (note_retrace)."""
    whats, counts, last = _tally(log)
    state = any(c.startswith("state ") for changes in log for c in changes)
    lines = [f"{desc} has traced and recorded the same signature again {len(log)} times in its last "
             f"{calls} calls because " + ("the state it reads changed between calls (the arguments did not)"
                                          if state else "something the recording depends on changed between calls")
             + "; each time costs a trace and a recording (and an eager call where it reads state), far "
             "more than an eager call."]
    lines += [f"  {last[w]}" + (f" ({counts[w]} times)" if counts[w] > 1 else "") for w in whats[:6]]
    texts = list(last.values())
    fixes = []
    if any(" -> " in t and t.startswith("state ") for t in texts):
        fixes.append("A state tensor changes shape between calls (a KV cache that grows, such as "
                     "transformers' DynamicCache): keep it at a fixed size and write into it in place "
                     "(transformers' StaticCache with cache_position; a preallocated buffer and a mask), "
                     "or keep the growing part outside the graphified function.")
    if any("rebound between calls" in t for t in texts):
        fixes.append("A state tensor is bound to a new tensor before every call (model.h = h.detach()): "
                     "keep one tensor there and write the new values into it in place "
                     "(model.h.copy_(h.detach()), with h a buffer).")
    if any("is gone" in t for t in texts):
        fixes.append("A state tensor's slot is emptied between calls: keep a tensor there.")
    if any("Python attributes changed" in t for t in texts):
        fixes.append("Python attributes set on an input tensor (t.scale = v) change between calls, and "
                     "the trace read them: pass the value as an argument of its own (a tensor) instead.")
    if not fixes:
        fixes.append("Keep the tensors the function reads (parameters, buffers, optimizer state, "
                     "caches) the same objects with the same shapes between calls, and change their "
                     "values in place.")
    lines += ["Fix: " + f for f in fixes]
    return "\n".join(lines)


def explain_env_storm(desc: str, log: List[List[str]], calls: int) -> str:
    """The warning text for recordings caused by environment changes (see StormDetector.note_env)."""
    whats, counts, last = _tally(log)
    lines = [f"{desc} has recorded again {len(log)} times in its last {calls} calls because what else "
             "decides its computation changed between calls (the arguments did not); each change costs "
             "a trace and a recording, more than an eager call."]
    for w in whats[:6]:
        lines.append(f"  {w} changed {counts[w]} times (last: {last[w].split(': ', 1)[-1]})")
    if not whats:
        lines.append("  module hooks, or an optimizer's parameter groups or state")
    lines.append(_env_fix([last[w] for w in whats]))
    return "\n".join(lines)


def _burst(calls: List[int], log: Optional[List[Any]], limits: Tuple[int, int]) -> bool:
    """Whether the last ``n`` events (their call numbers in ``calls``) fell within ``window`` calls.

    ``calls`` (and ``log``, kept beside it) are trimmed to the last ``ENV_STORM_CALLS[0]``
    events, and, when the answer is yes, to the last ``n``: what the warning reports.
    """
    n, window = limits
    keep = max(n, ENV_STORM_CALLS[0])
    del calls[:-keep]
    if log is not None:
        del log[:-keep]
    if len(calls) < n or calls[-1] - calls[-n] >= window:
        return False
    del calls[:-n]
    if log is not None:
        del log[:-n]
    return True


class StormDetector:
    """Warns once when a function keeps recording new signatures, or recording again.

    ``note`` counts new signatures (argument keys), and recordings of signatures the
    cache evicted (``note_evicted``); ``note_env`` counts recordings of a known key made
    again because its environment changed (a Python-float lr set by a scheduler, a module
    attribute the function reads), and ``note_retrace`` those made again because the state
    it reads changed (a growing KV cache, a rebound tensor), which ``note`` cannot see.
    """

    __slots__ = ("desc", "log", "keys", "warned", "env_log", "env_calls", "env_warned", "again", "again_warned",
                 "evicted", "st_log", "st_calls", "st_warned")

    def __init__(self, desc: str):
        self.desc = desc
        self.log: List[Any] = []
        self.keys: Set[Any] = set()
        self.warned = False
        self.env_log: List[List[str]] = []
        self.env_calls: List[int] = []
        self.env_warned = False
        self.again: List[int] = []  # call numbers of recordings of keys the cache evicted before
        self.again_warned = False
        self.evicted: Set[Any] = set()
        self.st_log: List[List[str]] = []
        self.st_calls: List[int] = []
        self.st_warned = False

    def note_evicted(self, e: Any) -> None:
        """The cache evicted ``e``'s signature (least recently used, beyond maxsize)."""
        k = hash((e.spec, e.key[1], e.statics))
        if not self.again_warned and k in self.keys:  # (only those ``note`` can see again)
            self.evicted.add(k)

    def _again(self, calls: int, maxsize: Any, stacklevel: int) -> None:
        """A signature recorded before is recorded again: the cache keeps evicting what the calls use."""
        if self.again_warned or maxsize is None:
            return
        self.again.append(calls)
        if not _burst(self.again, None, ENV_STORM_CALLS):
            return
        n = ENV_STORM_CALLS[0]
        self.again_warned = True
        self._warn(
            f"{self.desc} has recorded again {n} signatures it had recorded before, in its last "
            f"{calls - self.again[0] + 1} calls: the calls cycle through more signatures "
            f"({len(self.keys)} seen) than its cache keeps (maxsize={maxsize}), so each one is evicted "
            "before it is used again, and every call traces and records.\n"
            f"Fix: raise maxsize (gt.graphify(fn, maxsize={max(2 * len(self.keys), 8)})), or "
            "keep fewer signatures (pad inputs to a few shapes, pass changing numbers as tensors).",
            stacklevel + 1)

    def note_retrace(self, changes: List[str], calls: int, stacklevel: int) -> None:
        """A known signature traced again because the state it reads changed (``diff_leaves``)."""
        if self.st_warned:
            return
        self.st_log.append(changes)
        self.st_calls.append(calls)
        # (state that keeps changing costs an eager call, a trace and a recording each time:
        # warned sooner than other changes, such as Python attributes set on an input)
        state = all(any(c.startswith("state ") for c in ch) for ch in self.st_log[-STATE_STORM_CALLS[0]:])
        if not _burst(self.st_calls, self.st_log, STATE_STORM_CALLS if state else ENV_STORM_CALLS):
            return
        self.st_warned = True
        self._warn(explain_state_storm(self.desc, self.st_log, calls - self.st_calls[0] + 1), stacklevel + 1)

    def note_env(self, changes: List[str], calls: int, stacklevel: int) -> None:
        """A known signature recorded again: ``changes`` (env.diff) at call number ``calls``."""
        if self.env_warned:
            return
        self.env_log.append(changes)
        self.env_calls.append(calls)
        if not _burst(self.env_calls, self.env_log, ENV_STORM_CALLS):
            return
        self.env_warned = True
        self._warn(explain_env_storm(self.desc, self.env_log, calls - self.env_calls[0] + 1), stacklevel + 1)

    def _warn(self, text: str, stacklevel: int) -> None:
        # at the user's call, whatever the path through gtransform (autograd, torch.func, threads)
        import traceback

        from ._errors import user_frame

        fr = user_frame(traceback.extract_stack())
        if fr is not None and getattr(fr, "filename", None):
            warnings.warn_explicit(RerecordWarning(text), RerecordWarning, fr.filename, fr.lineno or 0)
        else:
            warnings.warn(RerecordWarning(text), stacklevel=stacklevel)

    def note(self, spec: Any, parts: List[Any], paths: List[str], statics: Any, stacklevel: int,
             calls: int = 0, maxsize: Any = None) -> None:
        # hashes, not the keys: a key holds the call's static values (objects passed as
        # arguments, such as a KV cache), which must not stay alive for a warning's sake
        key = hash((spec, tuple(parts), statics))
        if key in self.keys:  # the same signature after eviction, or in another thread
            if key in self.evicted:
                self.evicted.discard(key)
                self._again(calls, maxsize, stacklevel + 1)
            return
        if self.warned:
            return
        self.keys.add(key)
        self.log.append((spec, tuple(parts), tuple(paths), statics))
        if len(self.log) <= STORM_THRESHOLD:
            return
        self.warned = True
        self._warn(explain_storm(self.desc, self.log), stacklevel + 1)
        self.log = []  # (it holds the calls' static values)

"""The front door: ``graphify`` and the callable it returns."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Hashable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    overload,
)

import torch

from ._autograd import call_with_autograd, make_backward
from ._errors import GraphifyError, OverwrittenOutputError, describe_fn
from ._fastpath import MISS, build_fast_path
from ._liveness import PoolState, StaleOutput
from ._log import log
from ._partition import build_partition

try:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear_functorch
except ImportError:  # pragma: no cover
    import contextlib

    _clear_functorch = contextlib.nullcontext  # type: ignore[assignment]
from ._pool import GraphPool
from ._record import Recording, make_recording
from ._trace import Plan, trace
from ._tree import flatten, leaf_paths, static_leaf_key, tensor_meta, unflatten

try:
    from typing import ParamSpec
except ImportError:  # pragma: no cover
    from typing_extensions import ParamSpec  # type: ignore[assignment]

__all__ = ["graphify", "Graphified", "CacheInfo", "RerecordWarning"]

P = ParamSpec("P")
R = TypeVar("R")

_TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover
    _TensorGuards = None

try:
    _peek_functorch = torch._C._functorch.peek_interpreter_stack
except AttributeError:  # pragma: no cover
    def _peek_functorch() -> Any:
        return None

_is_grad_enabled = torch.is_grad_enabled
_GRAD: Any
try:
    _GRAD = torch._C._functorch.TransformType.Grad
except AttributeError:  # pragma: no cover
    _GRAD = None
_Parameter = torch.nn.Parameter


class CacheInfo(NamedTuple):
    """Cache statistics, shaped like ``functools.lru_cache``'s.

    Attributes:
        hits: calls that replayed an existing recording.
        misses: calls (or ``trace`` calls) that traced a new signature.
        maxsize: the bound on signatures kept per thread.
        currsize: signatures kept now, over all threads.

    Examples:
        >>> import torch, gtransform as gt
        >>> f = gt.graphify(lambda x: x + 1)
        >>> _ = f(torch.ones(2)); _ = f(torch.ones(3))
        >>> f.cache_info().misses
        2
    """

    hits: int
    misses: int
    maxsize: Optional[int]
    currsize: int


class _Guard:
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
        if impl is not None:
            return bool(impl.check(*tensors))
        if not self.metas:
            return True
        try:
            return [tensor_meta(t) for t in tensors] == self.metas
        except Exception:
            return False


class _Entry:
    """One signature: its trace and its current recording."""

    __slots__ = (
        "key", "spec", "tpos", "consts", "statics", "guard", "plan", "rec", "first_refs",
        "calls", "cuda", "any_rg", "must_static", "alias", "n_leaves", "bwd", "const_vals", "parts",
    )

    def __init__(self, key: Hashable, spec: Any, leaves: Sequence[Any], tpos: List[int], statics: Any, plan: Plan, cuda: bool, alias: Tuple[int, ...]):
        self.key = key
        self.spec = spec
        self.tpos = tpos
        self.n_leaves = len(leaves)
        tset = set(tpos)
        self.consts = [(i, static_leaf_key(leaves[i])) for i in range(len(leaves)) if i not in tset]
        self.const_vals = {i: leaves[i] for i, _ in self.consts}
        self.statics = statics
        tensors = [leaves[i] for i in tpos]
        self.guard = _Guard(tensors)
        self.plan = plan
        self.rec: Optional[Recording] = None
        self.first_refs: Optional[List[Any]] = None
        self.calls = 0
        self.cuda = cuda
        self.any_rg = any(t.requires_grad for t in tensors)
        self.alias = alias
        must = set()
        if plan.mutated and alias:
            groups: Dict[int, List[int]] = {}
            for i, gid in enumerate(alias):
                if gid >= 0:
                    groups.setdefault(gid, []).append(i)
            for members in groups.values():
                if any(i in plan.mutated for i in members):
                    must.update(members)
        self.must_static = must
        self.bwd: Dict[Tuple[bool, ...], Graphified[Any, Any]] = {}
        self.parts: Dict[Tuple[bool, ...], Any] = {}

    def partition_for(self, need: Tuple[bool, ...], owner: Graphified[Any, Any]) -> Any:
        """The partitioned forward/backward for these inputs (``None``: recompute instead)."""
        if need in self.parts:
            return self.parts[need]
        part = None
        if any(need):
            try:
                with torch.enable_grad(), _clear_functorch():
                    part = build_partition(self.plan, self.guard.metas, need, owner)
            except Exception as exc:  # the recompute path is always available
                log.info("%s: partitioning failed (%s); the backward recomputes the forward", owner._desc, exc)
                part = None
        self.parts[need] = part
        return part

    def backward_for(self, need: Tuple[bool, ...], owner: Graphified[Any, Any]) -> Graphified[Any, Any]:
        """The graphified backward of this signature for these needed inputs."""
        g = self.bwd.get(need)
        if g is None:
            fn = make_backward(self.plan, need)
            fn.__qualname__ = fn.__name__ = f"backward of {owner._desc}"
            g = self.bwd[need] = Graphified(fn, maxsize=8, fuse=owner._fuse)
        return g

    def match(self, leaves: Sequence[Any], statics: Any) -> bool:
        if len(leaves) != self.n_leaves or statics != self.statics:
            return False
        for i, k in self.consts:
            try:
                if static_leaf_key(leaves[i]) != k:
                    return False
            except TypeError:
                return False
        tensors = [leaves[i] for i in self.tpos]
        if not self.guard.check(tensors):
            return False
        if self.must_static or (self.plan.mutated and self.alias):
            return _alias_pattern(tensors) == self.alias
        return True


def _sig_brief(e: _Entry, tensors: Sequence[torch.Tensor]) -> str:
    parts = [f"{p}: {m[3]}{list(m[1])}" for p, m in zip(e.plan.in_paths, e.guard.metas)]
    s = ", ".join(parts[:4])
    return s + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "")


def _diff_leaves(e: _Entry, leaves: Sequence[Any], paths: Sequence[str]) -> List[str]:
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
    return out


def _only_grad_transforms() -> bool:
    """Whether every active torch.func transform is grad/vjp (no vmap, jvp)."""
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        return all(i.key() == _GRAD for i in retrieve_all_functorch_interpreters())
    except Exception:  # pragma: no cover
        return False


def _alias_pattern(tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
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


class _ThreadState:
    __slots__ = ("cache", "last", "pool", "fast", "fast_rec", "fast_statics", "__weakref__")

    def __init__(self, pool: PoolState):
        self.cache: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.last: Optional[_Entry] = None
        self.pool = pool
        self.fast: Any = None  # generated fast call of the last settled recording
        self.fast_rec: Any = None
        self.fast_statics: Any = None

    def clear(self) -> None:
        for e in self.cache.values():
            if e.rec is not None:
                e.rec.close()
        self.cache.clear()
        self.last = None
        self.drop_fast()

    def drop_fast(self) -> None:
        self.fast = self.fast_rec = self.fast_statics = None


class Graphified(Generic[P, R]):
    """A function that records itself into a graph per input signature.

    Made by :func:`graphify`; see there for the semantics. Besides calling it,
    use :meth:`trace`, :meth:`cache_info`, :meth:`cache_clear`,
    :meth:`describe` and :meth:`explain`. It keeps ``__wrapped__``,
    ``__name__`` and ``__doc__`` of the function, and binds as a method.

    Examples:
        >>> import torch, gtransform as gt
        >>> class Scaler:
        ...     def __init__(self):
        ...         self.k = 3.0
        ...     @gt.graphify
        ...     def __call__(self, x):
        ...         return x * self.k
        >>> Scaler()(torch.ones(2))
        tensor([3., 3.])
    """

    def __init__(self, fn: Callable[P, R], *, static_argnums: Union[int, Sequence[int]] = (), static_argnames: Union[str, Sequence[str]] = (), pool: Optional[GraphPool] = None, maxsize: Optional[int] = 64, fuse: bool = False):
        if not callable(fn):
            raise TypeError(f"graphify(fn): fn must be callable, got {type(fn).__name__}")
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        try:
            nums = tuple(int(i) for i in static_argnums)
        except (TypeError, ValueError):
            raise TypeError(f"graphify(fn, static_argnums=...): expected ints, got {static_argnums!r}") from None
        names = tuple(static_argnames)
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"graphify(fn, static_argnames=...): expected strings, got {static_argnames!r}")
        if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 1):
            raise ValueError(f"graphify(fn, maxsize=...): expected a positive int or None, got {maxsize!r}")
        if not isinstance(fuse, bool):
            raise TypeError(f"graphify(fn, fuse=...): expected a bool, got {fuse!r}")
        self._fuse = fuse
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"graphify(fn, pool=...): expected gt.graph_pool(), got {type(pool).__name__}")
        self._fn = fn
        self._desc = describe_fn(fn)
        nums, names = _resolve_static(fn, nums, names, self._desc)
        self._static_argnums = frozenset(nums)
        self._static_argnames = frozenset(names)
        self._has_static = bool(nums or names)
        self._pool = pool
        self._maxsize = maxsize
        self._tls = threading.local()
        self._states: weakref.WeakSet[_ThreadState] = weakref.WeakSet()
        self._hits = 0
        self._misses = 0
        self._miss_log: List[Any] = []
        self._miss_keys: set = set()
        self._warned_consts = False
        self._warned = False
        # __wrapped__, __name__, __qualname__, __doc__, __module__ (not __dict__:
        # fn may be an nn.Module)
        try:
            functools.update_wrapper(self, fn, updated=())
        except AttributeError:  # pragma: no cover
            self.__wrapped__ = fn

    # -- public ------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._has_static:
            args, kwargs, statics = self._split(args, kwargs)  # type: ignore[assignment]
        else:
            statics = ()
        interp = _peek_functorch()
        if interp is None:
            st = self._tls.__dict__.get("state")
            if st is not None and st.fast is not None and st.fast_statics == statics:
                out = st.fast((args, kwargs))
                if out is not MISS:
                    return out  # type: ignore[no-any-return]
        if interp is not None:
            return self._call_transformed(interp, args, kwargs, statics)
        leaves, spec = flatten((args, kwargs))
        e, st = self._entry_for(leaves, spec, statics, (args, kwargs))
        if e.any_rg and _is_grad_enabled():
            self._hits -= 1  # counted again inside the autograd wrapper
            return call_with_autograd(self, leaves, spec, e.tpos, statics)
        if e.plan.grad_consts and _is_grad_enabled() and not self._warned_consts:
            self._warned_consts = True
            warnings.warn(
                f"{self._desc} reads tensors that require grad but are not among its inputs "
                "(closed over, e.g. an nn.Module's parameters): its outputs do not require grad and no "
                "gradient will reach those tensors. For inference, call it under torch.no_grad(); to "
                "train, pass the parameters as inputs (torch.func.functional_call).",
                UserWarning,
                stacklevel=2,
            )
        return e.plan.assemble(self._run_flat(e, st, [leaves[i] for i in e.tpos]))

    def _call_plain(self, args: Any, kwargs: Any, statics: Any) -> Any:
        """A call that is never differentiated (used for backward passes)."""
        leaves, spec = flatten((args, kwargs))
        e, st = self._entry_for(leaves, spec, statics)
        return e.plan.assemble(self._run_flat(e, st, [leaves[i] for i in e.tpos]))

    def _entry_for(self, leaves: List[Any], spec: Any, statics: Any, tree: Any = None) -> Tuple[_Entry, _ThreadState]:
        """The entry of these leaves' signature (looked up or traced), and the thread's state."""
        try:
            st = self._tls.state
        except AttributeError:
            st = self._new_state()
        e = st.last
        if e is None or e.spec != spec or not e.match(leaves, statics):
            args, kwargs = tree if tree is not None else unflatten(spec, leaves)
            e = self._lookup(st, leaves, spec, args, kwargs, statics, record=True)
        else:
            self._hits += 1
        return e, st

    def _run_flat(self, e: _Entry, st: _ThreadState, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        lock = st.pool.lock
        if lock is None:
            return self._run(e, tensors)
        with lock:
            return self._run(e, tensors)

    def _call_transformed(self, interp: Any, args: Any, kwargs: Any, statics: Any) -> Any:
        """A call under torch.func transforms.

        grad/vjp go through the autograd wrapper; vmap and jvp run the function eagerly
        (correct, not recorded).
        """
        if interp.key() == _GRAD and _only_grad_transforms():
            leaves, spec = flatten((args, kwargs))
            tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            return call_with_autograd(self, leaves, spec, tpos, statics)
        return self._fallback(args, kwargs, statics)

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> torch.fx.GraphModule:
        """Trace ``fn`` for these inputs and return what would be recorded.

        Like ``jax.make_jaxpr``: nothing is recorded or run. The graph takes
        the flat tensor leaves of ``(args, kwargs)`` in order and returns the
        tensor leaves of the output.

        Returns:
            A ``torch.fx.GraphModule`` of aten operations.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x.sin() + 1)
            >>> print(f.trace(torch.ones(3)).code.strip().splitlines()[0])
            def forward(self, arg0_1):
        """
        if self._has_static:
            args, kwargs, statics = self._split(args, kwargs)  # type: ignore[assignment]
        else:
            statics = ()
        leaves, spec = flatten((args, kwargs))
        try:
            st = self._tls.state
        except AttributeError:
            st = self._new_state()
        e = self._lookup(st, leaves, spec, args, kwargs, statics, record=False)
        return e.plan.gm

    def cache_info(self) -> CacheInfo:
        """Hits, misses, maxsize and current size of the signature cache.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> _ = f(torch.ones(2)); _ = f(torch.ones(2))
            >>> f.cache_info()
            CacheInfo(hits=1, misses=1, maxsize=64, currsize=1)
        """
        size = sum(len(s.cache) for s in list(self._states))
        return CacheInfo(self._hits, self._misses, self._maxsize, size)

    def cache_clear(self) -> None:
        """Drop every recording of this function, in every thread.

        Outputs already handed out stay valid (nothing will overwrite them).

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> y = f(torch.ones(2))
            >>> f.cache_clear()
            >>> f.cache_info().currsize, y
            (0, tensor([2., 2.]))
        """
        for s in list(self._states):
            s.clear()
        self._hits = 0
        self._misses = 0

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return _BoundGraphified(self, obj)

    def __repr__(self) -> str:
        return f"<{self._desc}>"

    # -- internals -----------------------------------------------------------
    def _new_state(self) -> _ThreadState:
        pool = self._pool._state if self._pool is not None else PoolState()
        st = _ThreadState(pool)
        self._tls.state = st
        self._states.add(st)
        return st

    def _split(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any], Tuple[Any, ...]]:
        statics: List[Tuple[Any, Any]] = []
        dyn = []
        nums = self._static_argnums
        for i, a in enumerate(args):
            if i in nums:
                statics.append((i, a))
            else:
                dyn.append(a)
        if self._static_argnames and kwargs:
            kw = {}
            for k, v in kwargs.items():
                if k in self._static_argnames:
                    statics.append((k, v))
                else:
                    kw[k] = v
            kwargs = kw
        for where, v in statics:
            try:
                hash(v)
            except TypeError:
                label = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
                raise TypeError(
                    f"{self._desc}: static argument {label} of type {type(v).__name__} is not hashable. "
                    "Static arguments are part of the cache key. Fix: pass a hashable value "
                    "(e.g. a tuple instead of a list), or do not mark it static."
                ) from None
        return tuple(dyn), kwargs, tuple(statics)

    def _rebuild_args(self, args: Tuple[Any, ...], statics: Tuple[Any, ...]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        pos = [(w, v) for w, v in statics if isinstance(w, int)]
        kw = {w: v for w, v in statics if not isinstance(w, int)}
        if not pos:
            return args, kw
        out = list(args)
        for w, v in sorted(pos):
            out.insert(w, v)
        return tuple(out), kw

    def _fallback(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], statics: Tuple[Any, ...]) -> Any:
        a, kw = self._rebuild_args(args, statics)
        kw.update(kwargs)
        return self._fn(*a, **kw)

    def _lookup(self, st: _ThreadState, leaves: List[Any], spec: Any, args: Any, kwargs: Any, statics: Tuple[Any, ...], record: bool) -> _Entry:
        parts: List[Any] = []
        tpos: List[int] = []
        paths: Optional[List[str]] = None
        device = None
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if type(x) is not torch.Tensor and type(x) is not _Parameter:
                    if paths is None:
                        paths = leaf_paths((args, kwargs))
                    _bad_tensor(self._desc, paths[i], x)
                if x.layout != torch.strided or x.is_nested or x.device.type == "meta":
                    if paths is None:
                        paths = leaf_paths((args, kwargs))
                    _bad_tensor(self._desc, paths[i], x)
                if device is None:
                    device = x.device
                elif x.device != device:
                    if paths is None:
                        paths = leaf_paths((args, kwargs))
                    _mixed_devices(self._desc, leaves, paths)
                parts.append(tensor_meta(x))
                tpos.append(i)
            else:
                try:
                    parts.append(static_leaf_key(x))
                except TypeError:
                    if paths is None:
                        paths = leaf_paths((args, kwargs))
                    raise TypeError(
                        f"{self._desc}: the non-tensor leaf {paths[i]} of type {type(x).__name__} is not "
                        "hashable. Non-tensor leaves are static: their values are part of the cache key. "
                        "Fix: pass it as a tensor, make it hashable (e.g. a tuple instead of a list), or "
                        "register its type as a pytree node with optree (namespace='gtransform')."
                    ) from None
        tensors = [leaves[i] for i in tpos]
        alias = _alias_pattern(tensors)
        key = (spec, tuple(parts), alias, statics)
        e = st.cache.get(key)
        if e is not None:
            st.cache.move_to_end(key)
            if record:
                self._hits += 1
            st.last = e
            return e
        self._misses += 1
        if paths is None:
            paths = leaf_paths((args, kwargs))
        self._note_miss(spec, parts, paths, statics)
        in_paths = [paths[i] for i in tpos]
        cuda = device is not None and device.type == "cuda"
        template = list(leaves)

        def rebuild(ts: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
            ls = list(template)
            for p, t in zip(tpos, ts):
                ls[p] = t
            a, kw = unflatten(spec, ls)
            a, skw = self._rebuild_args(a, statics)
            if skw:
                kw = dict(kw)
                kw.update(skw)
            return a, kw

        specs = [(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors]
        plan = trace(self._fn, rebuild, specs, in_paths, self._desc, cuda)
        if device is None and plan.uses_cuda and torch.cuda.is_available():
            cuda = True
        e = _Entry(key, spec, leaves, tpos, statics, plan, cuda, alias)
        st.cache[key] = e
        if self._maxsize is not None:
            while len(st.cache) > self._maxsize:
                _, old = st.cache.popitem(last=False)
                if old.rec is not None:
                    if st.fast_rec is old.rec:
                        st.drop_fast()
                    old.rec.close()
                if st.last is old:
                    st.last = None
        st.last = e
        return e

    def _note_miss(self, spec: Any, parts: List[Any], paths: List[str], statics: Any) -> None:
        """Warn once when the function keeps recording new signatures."""
        if self._warned:
            return
        key = (spec, tuple(parts), statics)
        if key in self._miss_keys:  # the same signature in another thread, or after eviction
            return
        self._miss_keys.add(key)
        log = self._miss_log
        log.append((spec, tuple(parts), tuple(paths), statics))
        if len(log) <= STORM_THRESHOLD:
            return
        self._warned = True
        warnings.warn(RerecordWarning(_explain_storm(self._desc, log)), stacklevel=4)

    def _run(self, e: _Entry, tensors: List[torch.Tensor]) -> Any:
        rec = e.rec
        st = self._tls.state
        if st.fast_rec is not None and st.fast_rec is not rec:
            # the fast path serves the most recently used signature only (LRU order)
            st.drop_fast()
        e.calls += 1
        if rec is None:
            static = set(e.must_static)
            static.update(i for i, t in enumerate(tensors) if type(t) is _Parameter)
            rec = e.rec = self._record(e, tensors, static)
            e.first_refs = [weakref.ref(t) for t in tensors]
        elif e.first_refs is not None:
            # Second call of this signature: inputs passed again as the very
            # same tensors (parameters, persistent state) are read in place.
            refs = e.first_refs
            e.first_refs = None
            same = [i for i in rec.copy_idx if refs[i]() is tensors[i]]
            if same or not rec.statics_ok(tensors):
                keep = [i for j, i in enumerate(rec.static_idx) if tensors[i].data_ptr() == rec.static_ptrs[j]]
                rec = e.rec = self._rerecord(e, rec, tensors, set(same) | set(keep) | e.must_static)
        elif rec.static_idx and not rec.statics_ok(tensors):
            keep = [i for j, i in enumerate(rec.static_idx) if tensors[i].data_ptr() == rec.static_ptrs[j]]
            rec = e.rec = self._rerecord(e, rec, tensors, set(keep) | e.must_static)
        out = rec.run_flat(tensors)
        if e.first_refs is None:
            if st.fast_rec is not rec:
                fast = rec.fast
                if fast is None:
                    try:
                        fast = rec.fast = build_fast_path(self, e, rec, st.pool)
                    except Exception:  # pragma: no cover - the generic path still works
                        fast = rec.fast = None
                st.fast, st.fast_rec, st.fast_statics = fast, rec, e.statics
        return out

    def _rerecord(self, e: _Entry, old: Recording, tensors: List[torch.Tensor], static: Any) -> Recording:
        """Record the signature again with other in-place inputs.

        Output objects the caller dropped keep their identity.
        """
        if log.isEnabledFor(logging.INFO):
            log.info("%s: re-recording a signature: inputs read in place now %s (were %s)",
                     self._desc, [e.plan.in_paths[i] for i in sorted(static)],
                     [e.plan.in_paths[i] for i in old.static_idx])
        new = self._record(e, tensors, static)
        new.adopt_outputs(old)  # old is closed after new's first replay
        st = self._tls.state
        if st.fast_rec is old:
            st.drop_fast()
        return new

    def _record(self, e: _Entry, tensors: List[torch.Tensor], static: Any) -> Recording:
        st = self._tls.state
        t0 = time.perf_counter()
        rec = make_recording(e.plan, tensors, sorted(static), st.pool, self._desc, e.cuda, self._fuse)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s: recorded %s (%s): %d ops, %d inputs (%d read in place, %d copied), %d outputs, %.1f ms",
                self._desc, "a CUDA graph" if e.cuda else "the traced graph", _sig_brief(e, tensors),
                e.plan.op_count, len(tensors), len(rec.static_idx), len(rec.copy_idx),
                len(e.plan.out_entries), (time.perf_counter() - t0) * 1e3,
            )
        return rec

    # -- introspection -----------------------------------------------------
    def describe(self) -> str:
        """A readable account of what this function has recorded (this thread).

        For each signature: the inputs by leaf path with shape and dtype,
        whether each is read in place or copied into a static buffer, the
        outputs, the number of recorded ops and the bytes held (static
        buffers and pool outputs).

        Returns:
            str: the report (also fine to ``print``).

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x * 2)
            >>> _ = f(torch.ones(3))
            >>> print(f.describe().splitlines()[0])
            graphify(<lambda>): 1 signature(s) in this thread; cache CacheInfo(hits=0, misses=1, maxsize=64, currsize=1)
        """
        st = self._tls.__dict__.get("state")
        entries = list(st.cache.values()) if st is not None else []
        lines = [f"{self._desc}: {len(entries)} signature(s) in this thread; cache {self.cache_info()}"]
        for n, e in enumerate(entries):
            rec = e.rec
            backend = "cuda" if e.cuda else "cpu"
            lines.append(f"signature {n} ({backend}, {e.plan.op_count} ops traced, "
                         f"{'recorded' if rec else 'traced only'}, {rec.replays if rec else 0} replays):")
            static = set(rec.static_idx) if rec else set()
            for i, path in enumerate(e.plan.in_paths):
                meta = e.guard.metas[i]
                how = "read in place" if i in static else ("copied" if rec else "-")
                if i in e.plan.mutated:
                    how += ", updated in place"
                lines.append(f"  in  {path}: {meta[3]} {list(meta[1])} ({how})")
            for i, v in e.const_vals.items():
                lines.append(f"  static leaf {i}: {v!r}")
            for k, oe in enumerate(e.plan.out_entries):
                if oe.kind == "const":
                    lines.append(f"  out {k}: constant {oe.value!r}")
                elif oe.kind == "input":
                    lines.append(f"  out {k}: {'the' if oe.identical else 'a view of the'} caller's input {e.plan.in_paths[oe.index]}")
                else:
                    lines.append(f"  out {k}: pool tensor")
            if rec:
                buf = sum(b.numel() * b.element_size() for b in rec.bufs)
                pool = sum(g.base.untyped_storage().nbytes() for g in rec.groups)
                lines.append(f"  bytes: static input buffers {buf}, pool outputs {pool}")
        return "\n".join(lines)

    def explain(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Say whether a call with these arguments would replay, and if not, why.

        Like JAX's ``jax_explain_cache_misses``: compares the call's signature
        with the closest recorded one and names each leaf that differs and how
        (shape, dtype, strides, requires_grad, device, or a static value).
        Nothing is traced or run.

        Returns:
            str: the explanation.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x, n: x * n)
            >>> _ = f(torch.ones(3), 2)
            >>> print(f.explain(torch.ones(3), 3))
            graphify(<lambda>): a new signature (miss): args[1]: static value 2 -> 3
        """
        if self._has_static:
            args, kwargs, statics = self._split(args, kwargs)  # type: ignore[assignment]
        else:
            statics = ()
        leaves, spec = flatten((args, kwargs))
        st = self._tls.__dict__.get("state")
        entries = list(st.cache.values()) if st is not None else []
        for e in entries:
            if e.spec == spec and e.match(leaves, statics):
                return f"{self._desc}: replays a recorded signature (hit)"
        if not entries:
            return f"{self._desc}: nothing recorded yet in this thread (miss)"
        paths = leaf_paths((args, kwargs))
        best, best_diff = None, None
        for e in entries:
            if e.spec != spec:
                continue
            diff = _diff_leaves(e, leaves, paths)
            if best_diff is None or len(diff) < len(best_diff):
                best, best_diff = e, diff
        if best is None:
            return (f"{self._desc}: a new signature (miss): the structure of the arguments differs "
                    f"from every recorded one: {spec} vs {entries[-1].spec}")
        if not best_diff and best.statics != statics:
            best_diff = [f"static arguments {best.statics!r} -> {statics!r}"]
        return f"{self._desc}: a new signature (miss): " + "; ".join(best_diff or ["aliasing between inputs"])


class _BoundGraphified:
    """A graphified function bound to an object (``obj.method``)."""

    def __init__(self, g: Graphified, obj: Any):
        self._g = g
        self._obj = obj
        self.__wrapped__ = g._fn.__get__(obj) if hasattr(g._fn, "__get__") else g._fn
        self.__name__ = getattr(g, "__name__", "graphified")
        self.__doc__ = g.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._g(self._obj, *args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        return self._g.trace(self._obj, *args, **kwargs)

    def cache_info(self) -> CacheInfo:
        return self._g.cache_info()

    def cache_clear(self) -> None:
        self._g.cache_clear()


STORM_THRESHOLD = 16


class RerecordWarning(UserWarning):
    """A graphified function keeps recording new signatures.

    Each new signature (tree structure, tensor shapes/dtypes/strides, values
    of non-tensor leaves) costs a trace and a recording. The warning names the
    part of the signature that keeps changing and how to keep it stable:
    pass changing Python numbers as tensors, pad inputs to a few fixed
    shapes, or keep the structure of the arguments fixed.

    Examples:
        >>> import warnings, torch, gtransform as gt
        >>> f = gt.graphify(lambda x, s: x * s)
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     for i in range(20):
        ...         _ = f(torch.ones(2), float(i))
        >>> issubclass(w[0].category, gt.RerecordWarning)
        True
    """


def _explain_storm(desc: str, log: List[Any]) -> str:
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
        else:
            typ = sample[0].__name__ if isinstance(sample, tuple) and sample and isinstance(sample[0], type) else "value"
            lines.append(f"{path} (a Python {typ}) took {len(values)} values: non-tensor leaves are static, so "
                         "each value is a new signature. Fix: pass it as a tensor (torch.tensor(v, device=...)).")
    stat = {x[3] for x in same}
    if len(stat) > 1:
        lines.append(f"the static arguments took {len(stat)} values. Fix: do not mark changing arguments static.")
    return "\n".join(lines)


def _resolve_static(fn: Callable[..., Any], nums: Tuple[int, ...], names: Tuple[str, ...], desc: str) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """Map static_argnums and static_argnames onto each other, like jax.jit."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    nums_out = set()
    for i in nums:
        j = i + len(positional) if i < 0 else i
        if j < 0:
            raise ValueError(f"{desc}: static_argnums={i} is out of range for {len(positional)} positional parameters")
        nums_out.add(j)
    names_out = set(names)
    for j in list(nums_out):
        if j < len(positional) and positional[j].kind == positional[j].POSITIONAL_OR_KEYWORD:
            names_out.add(positional[j].name)
    for n in names:
        for j, p in enumerate(positional):
            if p.name == n and p.kind == p.POSITIONAL_OR_KEYWORD:
                nums_out.add(j)
    return tuple(sorted(nums_out)), tuple(sorted(names_out))


def _bad_tensor(desc: str, path: str, t: torch.Tensor) -> None:
    if isinstance(t, StaleOutput):
        msg = t.__dict__.get("_gt_message", "stale output")
        raise OverwrittenOutputError(f"{msg}\n(passed as input {path} to {desc})")
    if t.layout != torch.strided:
        what, fix = f"a {t.layout} tensor", "pass a dense tensor (t.to_dense())"
    elif t.is_nested:
        what, fix = "a nested tensor", "pass padded dense tensors instead"
    elif t.device.type == "meta":
        what, fix = "a meta tensor (it has no data)", "pass a tensor on the CPU or a GPU"
    else:
        what, fix = (
            f"a tensor subclass ({type(t).__name__})",
            "pass a plain tensor (t.as_subclass(torch.Tensor)), or call the function eagerly",
        )
    raise GraphifyError(
        f"{desc}: input {path} is {what}.\nWhy: graphify records dense strided tensors "
        f"(torch.Tensor or nn.Parameter) only.\nFix: {fix}."
    )


def _mixed_devices(desc: str, leaves: Sequence[Any], paths: Sequence[str]) -> None:
    by: Dict[str, List[str]] = {}
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            by.setdefault(str(x.device), []).append(p)
    listing = "; ".join(f"{d}: {', '.join(ps[:4])}{' ...' if len(ps) > 4 else ''}" for d, ps in by.items())
    raise GraphifyError(
        f"{desc}: tensor inputs are on different devices ({listing}).\n"
        "Why: one recording runs on one device; a CPU tensor read by a CUDA graph would be "
        "frozen at recording time.\n"
        "Fix: move every tensor input to one device (x.to(device)); pass CPU scalars as Python numbers."
    )


@overload
def graphify(fn: Callable[P, R], *, static_argnums: Union[int, Sequence[int]] = ..., static_argnames: Union[str, Sequence[str]] = ..., pool: Optional[GraphPool] = ..., maxsize: Optional[int] = ..., fuse: bool = ...) -> Graphified[P, R]: ...


@overload
def graphify(fn: None = ..., *, static_argnums: Union[int, Sequence[int]] = ..., static_argnames: Union[str, Sequence[str]] = ..., pool: Optional[GraphPool] = ..., maxsize: Optional[int] = ..., fuse: bool = ...) -> Callable[[Callable[P, R]], Graphified[P, R]]: ...


def graphify(fn: Optional[Callable[P, R]] = None, *, static_argnums: Union[int, Sequence[int]] = (), static_argnames: Union[str, Sequence[str]] = (), pool: Optional[GraphPool] = None, maxsize: Optional[int] = 64, fuse: bool = False) -> Any:
    """Record ``fn`` into a graph per input signature and replay it.

    ``graphify`` is ``jax.jit`` for PyTorch with CUDA graph capture as the
    compiler. On each new signature (tree structure, each tensor's shape,
    dtype, device, strides and ``requires_grad``, and the values of non-tensor
    leaves), ``fn`` is traced with fake tensors into an aten graph, bound to
    static input buffers, and recorded (a CUDA graph on the GPU; the traced
    graph on the CPU). Later calls with the same signature replay it.

    Rules:
        * ``fn`` must be pure apart from in-place updates of its inputs, which
          are applied to the caller's tensors exactly as eager would.
        * Python control flow is resolved at trace time; reading a tensor's
          value (``.item()``, ``if t > 0``) raises :class:`GraphifyError`.
        * Non-tensor leaves (Python numbers, strings, ``None``...) are static:
          a new value records a new graph.
        * Tensors passed again as the same objects (parameters, state) are read
          in place, so their in-place updates between calls are seen; others
          are copied into static buffers in one batched copy.
        * An output stays valid until the next call of the same function in
          the same thread (or of any function sharing its pool); touching it
          after that raises :class:`OverwrittenOutputError`. ``.clone()`` what
          you keep.

    Args:
        fn: the function; its arguments are pytrees of tensors and other leaves.
        static_argnums: positional arguments passed whole as static values
            (hashable; not flattened).
        static_argnames: keyword arguments passed whole as static values.
        pool: a :func:`graph_pool` to share memory with other functions.
        maxsize: how many signatures to keep per thread (least recently used
            evicted), or ``None`` for no bound.
        fuse: compile each traced graph with TorchInductor before recording
            it, so the recording replays fused kernels (fewer launches: the
            way to beat the kernel count of eager PyTorch). The first call of
            each signature then takes seconds instead of milliseconds. Random
            ops still follow eager's random numbers (``fallback_random``).

    Returns:
        A :class:`Graphified` callable (or a decorator, if ``fn`` is omitted).

    Raises:
        GraphifyError: ``fn`` cannot be recorded (at call time).
        TypeError: an argument of ``graphify`` is of the wrong type.

    Examples:
        >>> import torch, gtransform as gt
        >>> @gt.graphify
        ... def step(params, x):
        ...     return (x @ params["w"]).relu().sum()
        >>> params = {"w": torch.randn(4, 3)}
        >>> loss = step(params, torch.randn(8, 4))
        >>> @gt.graphify(static_argnums=1)
        ... def scale(x, k):
        ...     return x * k
        >>> scale(torch.ones(2), 3)
        tensor([3., 3.])
    """
    if fn is None:
        return functools.partial(
            graphify, static_argnums=static_argnums, static_argnames=static_argnames, pool=pool, maxsize=maxsize,
            fuse=fuse,
        )
    return Graphified(fn, static_argnums=static_argnums, static_argnames=static_argnames, pool=pool, maxsize=maxsize, fuse=fuse)

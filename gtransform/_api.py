"""The front door: ``graphify`` and the callable it returns.

A call goes: the generated fast path of the last recording (``_fastpath``), or
the generic path: flatten, find the signature (``_signature``) or trace a new
one (``_trace``, with state from ``_state``), record it (``_record``), replay,
hand out outputs (``_liveness``); calls that need gradients go through
``_autograd``. A call that is not recorded runs eagerly: the first call of a
signature that touches state, and a call whose trace raised the function's own
exception (eager raises it again, after eager's side effects: ``_eager``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
import os
import threading
import time
import warnings
import weakref
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
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

from . import _fastpath
from ._autograd import call_with_autograd, no_functorch
from ._autograd import unwrap as unwrap_functorch
from ._batching import NOT_HANDLED, call_vmapped
from ._errors import EagerWarning, GraphifyError, OverwrittenOutputError, describe_fn, user_frame
from ._fastpath import MISS, build_fast_path
from ._liveness import PoolState, StaleOutput, stale_message
from ._log import log
from ._objects import register_containers_in
from ._pool import GraphPool
from ._record import Recording, make_recording
from ._signature import (
    Entry,
    RerecordWarning,
    StormDetector,
    ThreadState,
    alias_pattern,
    dict_orders,
    diff_leaves,
    global_key,
    has_grad,
    reusable_after_eager,
    same_objects,
    sig_brief,
    tensor_attrs,
)
from ._state import GeneratorGuard, change_error, env_key_fn, find_roots, lazy_error, uninitialized_modules
from ._switch import OFF
from ._trace import plain_layout, trace, tracing
from ._tree import flatten, holds_tensor, leaf_paths, static_leaf_key, tensor_meta, unflatten
from ._watch import FOR_GRAD

try:
    from typing import ParamSpec
except ImportError:  # pragma: no cover
    from typing_extensions import ParamSpec  # type: ignore[assignment]

__all__ = ["graphify", "Graphified", "CacheInfo", "RerecordWarning"]

P = ParamSpec("P")
R = TypeVar("R")

try:
    _peek_functorch = torch._C._functorch.peek_interpreter_stack
except AttributeError:  # pragma: no cover
    def _peek_functorch() -> Any:
        return None

_is_grad_enabled = torch.is_grad_enabled
_fwad = torch.autograd.forward_ad  # its _current_level: -1 unless a dual level is open
_GRAD: Any
_VMAP: Any
try:
    _GRAD = torch._C._functorch.TransformType.Grad
    _VMAP = torch._C._functorch.TransformType.Vmap
except AttributeError:  # pragma: no cover
    _GRAD = _VMAP = None
_Parameter = torch.nn.Parameter




class _Static(tuple):
    """``(where, value, key)`` of a static argument, compared by where and key only.

    ``2 == 2.0 == True`` and ``nan != nan`` in Python; the key tells the first apart and
    makes every NaN one signature.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self[0] == other[0] and self[2] == other[2]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((self[0], self[2]))

class _Strong:
    """A reference with the call interface of a weak one."""

    __slots__ = ("t",)

    def __init__(self, t: Any) -> None:
        self.t = t

    def __call__(self) -> Any:
        return self.t

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


def _only_grad_transforms() -> bool:
    """Whether every active torch.func transform is grad/vjp (no vmap, jvp)."""
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        return all(i.key() == _GRAD for i in retrieve_all_functorch_interpreters())
    except Exception:  # pragma: no cover
        return False


@functools.cache
def _opaque_to_dynamo() -> None:
    """Make torch.compile call graphified functions instead of tracing into them.

    Inside ``torch.compile`` a call of a graphified function is then a graph break
    that runs it as it is (record once, replay): dynamo cannot trace gtransform's
    own machinery (weak references, a CUDA graph's replay). Tracing imports dynamo
    anyway, so this costs nothing the first call would not.
    """
    try:
        from torch._dynamo import trace_rules
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        # a call from compiled code is a graph break, not inlined ...
        trace_rules.add(__name__.rsplit(".", 1)[0])
        # ... and dynamo leaves the call and everything it runs alone (the generated
        # fast path, the traced graph's code): no wrapper, so no per-call cost
        set_code_exec_strategy(Graphified.__call__.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # pragma: no cover - a torch without these
        pass


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
        if static_argnums is None:  # as jax.jit
            static_argnums = ()
        if static_argnames is None:
            static_argnames = ()
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        try:
            if isinstance(static_argnums, (str, bytes, torch.Tensor)):
                raise TypeError
            seq = tuple(static_argnums)
            # operator.index, as jax.jit: "1", 1.7 and True are not argument positions
            if any(isinstance(i, (bool, torch.Tensor)) for i in seq):
                raise TypeError
            nums = tuple(map(operator.index, seq))
        except (TypeError, ValueError):
            raise TypeError(f"graphify(fn, static_argnums=...): expected an int or a sequence of ints "
                            f"(argument positions), got {static_argnums!r}") from None
        try:
            names = tuple(static_argnames)
        except TypeError:
            names = (None,)  # type: ignore[assignment]
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"graphify(fn, static_argnames=...): expected a string or strings, got {static_argnames!r}")
        if maxsize is not None and (not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1):
            raise ValueError(f"graphify(fn, maxsize=...): expected a positive int or None, got {maxsize!r}")
        if not isinstance(fuse, bool):
            raise TypeError(f"graphify(fn, fuse=...): expected a bool, got {fuse!r}")
        self._fuse = fuse
        _opaque_to_dynamo()
        if pool is not None and not isinstance(pool, GraphPool):
            raise TypeError(f"graphify(fn, pool=...): expected gt.graph_pool(), got {type(pool).__name__}")
        self._fn = fn
        self._desc = describe_fn(fn)
        nums, names = _resolve_static(fn, nums, names, self._desc)
        self._static_argnums = frozenset(nums)
        self._static_argnames = frozenset(names)
        # (what copies are made with: see __deepcopy__)
        self._options: Dict[str, Any] = {"static_argnums": nums, "static_argnames": names, "pool": pool, "maxsize": maxsize,
                         "fuse": fuse}
        self._has_static = bool(nums or names)
        self._pool = pool
        self._maxsize = maxsize
        self._tls = threading.local()
        self._states: weakref.WeakSet[ThreadState] = weakref.WeakSet()
        self._hits = 0
        self._misses = 0
        self._lazy_calls = 0  # calls run eagerly because a reachable lazy module is not initialised
        self._eager_calls: Dict[str, int] = {}  # calls run eagerly (see _run_eagerly), by reason
        self._vmapped: Dict[Any, Graphified[Any, Any]] = {}  # graphify(vmap(fn)) per batching (see _batching)
        self._storm = StormDetector(self._desc)
        # __wrapped__, __name__, __qualname__, __doc__, __module__ (not __dict__:
        # fn may be an nn.Module)
        try:
            functools.update_wrapper(self, fn, updated=())
        except AttributeError:  # pragma: no cover
            self.__wrapped__ = fn

    # -- public ------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if OFF.on:  # gt.disable(), GTRANSFORM_DISABLE=1
            return self._fn(*args, **kwargs)
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
            return self._call_generic(args, kwargs, statics)  # type: ignore[no-any-return]
        return self._call_transformed(interp, args, kwargs, statics)  # type: ignore[no-any-return]

    def _call_generic(self, args: Any, kwargs: Any, statics: Any) -> Any:
        if tracing():
            # called inside another graphified function's trace (its arguments are that
            # trace's fake tensors): inline it, like jax.jit inside jax.jit
            return self._fallback(args, kwargs, statics)
        leaves, spec = _flatten_args(args, kwargs)
        if _fwad._current_level >= 0 and _any_tangent(leaves):
            return self._run_eagerly(_FORWARD_AD, args, kwargs, statics)
        e, st, tensors = self._entry_for(leaves, spec, statics, (args, kwargs))
        if e is None:
            return self._eager(st, args, kwargs, statics)
        if e.any_rg and _is_grad_enabled():
            return call_with_autograd(self, e, tensors)
        return e.plan.assemble(self._run_flat(e, st, tensors))

    def _call_plain(self, args: Any, kwargs: Any, statics: Any) -> Any:
        """A call that is never differentiated (used for backward passes)."""
        leaves, spec = _flatten_args(args, kwargs)
        e, st, tensors = self._entry_for(leaves, spec, statics)
        if e is None:  # pragma: no cover - backward halves touch no state
            return self._eager(st, args, kwargs, statics)
        return e.plan.assemble(self._run_flat(e, st, tensors))

    def _entry_for(self, leaves: List[Any], spec: Any, statics: Any, tree: Any = None) -> Tuple[Optional[Entry], ThreadState, List[torch.Tensor]]:
        """The entry of this call's signature (looked up or traced), the thread's state, and the call's tensors.

        The tensors are the caller's tensor leaves followed by the state the
        function reads. The entry is ``None`` when this call must run eagerly
        (the first call of a signature that touches state).
        """
        try:
            st = self._tls.state
        except AttributeError:
            st = self._new_state()
        if st.clear_requested:  # cache_clear() in another thread (see there)
            st.clear()
        glob = global_key()
        if tree is None:
            tree = unflatten(spec, leaves)
        e = st.last
        if e is not None and e.spec == spec and e.glob == glob and (not e.orders or dict_orders(tree) == e.orders):
            state = e.resolve_state() if e.state_src else []
            if state is not None and e.match(leaves, statics, state):
                self._hits += 1
                return e, st, [leaves[i] for i in e.tpos] + state
        args, kwargs = tree
        found = self._lookup(st, leaves, spec, args, kwargs, statics, record=True, glob=glob)
        if found is None:
            return None, st, []
        e, state = found
        return e, st, [leaves[i] for i in e.tpos] + state

    def _run_flat(self, e: Entry, st: ThreadState, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        lock = st.pool.lock
        if lock is None:
            return self._run(e, tensors)
        with lock:
            return self._run(e, tensors)

    def _call_transformed(self, interp: Any, args: Any, kwargs: Any, statics: Any) -> Any:
        """A call under torch.func transforms.

        grad/vjp go through the autograd wrapper; vmap and jvp run the function eagerly
        (correct, not recorded), with one :class:`EagerWarning` per function that says how
        to get a recording.
        """
        if tracing():
            return self._fallback(args, kwargs, statics)
        if interp.key() == _GRAD and _only_grad_transforms():
            leaves, spec = _flatten_args(args, kwargs)
            # the signature is looked up on the tensors under torch.func's wrappers,
            # as the autograd wrapper's forward will see them
            plain = [unwrap_functorch(x)[0] if isinstance(x, torch.Tensor) else x for x in leaves]
            FOR_GRAD.on = True
            try:
                with no_functorch():
                    e, _st, tensors = self._entry_for(plain, spec, statics)
            finally:
                FOR_GRAD.on = False
            if e is None:
                return self._eager(_st, args, kwargs, statics)
            tensors = [leaves[i] for i in e.tpos] + e.held_state(tensors[e.n_user:])
            return call_with_autograd(self, e, tensors)
        if interp.key() == _VMAP:
            out = call_vmapped(self, interp, args, kwargs, self._spawn_like)
            if out is not NOT_HANDLED:
                return out
        return self._run_eagerly(_transforms_reason(), args, kwargs, statics)

    def _run_eagerly(self, reason: Tuple[str, str], args: Any, kwargs: Any, statics: Any) -> Any:
        """Run a call that cannot be recorded as eager PyTorch: counted by reason, warned of once per function."""
        self._note_eager(reason)
        return self._fallback(args, kwargs, statics)

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> torch.fx.GraphModule:
        """Trace ``fn`` for these inputs and return what would be recorded.

        Like ``jax.make_jaxpr``: nothing is recorded or run. The graph takes
        the flat tensor leaves of ``(args, kwargs)`` in order, then the state
        the function reads without taking it as an argument (parameters,
        buffers, closed-over tensors: inputs named ``state_0``, ``state_1``...
        in the order ``f.describe()`` lists them), and returns the tensor
        leaves of the output.

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
        leaves, spec = _flatten_args(args, kwargs)
        try:
            st = self._tls.state
        except AttributeError:
            st = self._new_state()
        found = self._lookup(st, leaves, spec, args, kwargs, statics, record=False)
        assert found is not None
        return found[0].plan.gm

    def cache_info(self) -> CacheInfo:
        """Hits, misses, maxsize and current size of the signature cache.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> _ = f(torch.ones(2)); _ = f(torch.ones(2))
            >>> f.cache_info()
            CacheInfo(hits=1, misses=1, maxsize=64, currsize=1)
        """
        # (alternates of a signature, such as a model's eval() recording next to its train() one, count;
        # so do the recordings of its calls under vmap, made by graphified vmaps of it: see _batching)
        size = sum(len(s.cache) + sum(map(len, s.alts.values())) for s in list(self._states) if not s.clear_requested)
        hits, misses = self._hits, self._misses
        for h in list(self._vmapped.values()):
            info = h.cache_info()
            hits, misses, size = hits + info.hits, misses + info.misses, size + info.currsize
        return CacheInfo(hits, misses, self._maxsize, size)

    def cache_clear(self) -> None:
        """Drop every recording of this function, in every thread.

        Outputs already handed out stay valid (nothing will overwrite them).
        Another thread's recordings are released at that thread's next call of
        the function (one of its calls may be replaying them right now).

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> y = f(torch.ones(2))
            >>> f.cache_clear()
            >>> f.cache_info().currsize, y
            (0, tensor([2., 2.]))
        """
        mine = self._tls.__dict__.get("state")
        for s in list(self._states):
            if s is mine:
                s.clear()
            else:
                s.drop_fast()  # its next call takes the generic path, which clears it first
                s.clear_requested = True
        self._hits = 0
        self._misses = 0
        self._storm = StormDetector(self._desc)  # (its log holds static values of the calls)
        for h in list(self._vmapped.values()):
            h.cache_clear()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None or isinstance(self._fn, (staticmethod, classmethod)):
            # graphify(staticmethod(f)) in a class body: not bound to the instance, as the
            # staticmethod itself would not be (a classmethod object is not callable, refused above)
            return self
        return _BoundGraphified(self, obj)

    def __repr__(self) -> str:
        return f"<{self._desc}>"

    # -- copies: a new graphified function of a copy of ``fn``, with the same options and no
    # recordings (recordings hold memory and thread state, which are not copied). So
    # copy.deepcopy(model) after `model.forward = gt.graphify(model.forward)` (EMA,
    # swa_utils.AveragedModel) graphifies the copy's forward, and pickling keeps the options.
    def __copy__(self) -> Graphified[P, R]:
        return Graphified(self._fn, **self._options)

    def __deepcopy__(self, memo: Dict[int, Any]) -> Graphified[P, R]:
        import copy

        return Graphified(copy.deepcopy(self._fn, memo), **self._options)

    def __getstate__(self) -> Dict[str, Any]:
        return {"fn": self._fn, "options": self._options}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["fn"], **state["options"])  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # only for names ordinary lookup did not find: graphify(model) is not the module
        fn = self.__dict__.get("_fn")
        if name.startswith("_") or not isinstance(fn, torch.nn.Module) or not hasattr(fn, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"{self._desc} is a function, not an nn.Module: it has no attribute {name!r} (the module "
            f"{type(fn).__name__} has). Reach the module itself (f.__wrapped__.{name}), and for "
            "torch.func.functional_call graphify a function that calls it: "
            "gt.graphify(lambda params, x: torch.func.functional_call(model, params, (x,)))."
        )

    # -- internals -----------------------------------------------------------
    def _new_state(self) -> ThreadState:
        pool = self._pool._state if self._pool is not None else PoolState()
        st = ThreadState(pool)
        st.bound(self._maxsize)
        self._tls.state = st
        self._states.add(st)
        return st

    def _spawn_like(self, fn: Callable[..., Any]) -> Graphified[Any, Any]:
        """A graphified function of ``fn`` with this one's options (a vmapped version of it)."""
        return Graphified(fn, pool=self._pool, maxsize=self._maxsize, fuse=self._fuse)

    def _spawn(self, fn: Callable[..., Any]) -> Graphified[Any, Any]:
        """A graphified helper (a forward or backward half) with this function's options."""
        return Graphified(fn, maxsize=8, fuse=self._fuse)

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
        keyed: List[_Static] = []
        for where, v in statics:
            try:
                # the value and its key: 2 == 2.0 == True, but they are three signatures
                keyed.append(_Static((where, v, static_leaf_key(v))))
            except TypeError:
                label = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
                if holds_tensor(v):
                    raise TypeError(
                        f"{self._desc}: static argument {label} is or holds a tensor. Static arguments are "
                        "compared by value as part of the cache key, and a tensor's values are not part of "
                        "it. Fix: do not mark it static (tensors are inputs of the recording), or pass a "
                        "Python number (t.item() outside the function) if its value should pick the recording."
                    ) from None
                raise TypeError(
                    f"{self._desc}: static argument {label} of type {type(v).__name__} is not hashable. "
                    "Static arguments are part of the cache key. Fix: pass a hashable value "
                    "(e.g. a tuple instead of a list), or do not mark it static."
                ) from None
        return tuple(dyn), kwargs, tuple(keyed)

    def _rebuild_args(self, args: Tuple[Any, ...], statics: Tuple[Any, ...]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        pos = [(w, v) for w, v, _k in statics if isinstance(w, int)]
        kw = {w: v for w, v, _k in statics if not isinstance(w, int)}
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

    def _eager(self, st: ThreadState, args: Tuple[Any, ...], kwargs: Dict[str, Any], statics: Tuple[Any, ...]) -> Any:
        """A call that runs eagerly (not recorded: see :meth:`_lookup`).

        After a trace that raised the function's own exception (a shape check, an assert),
        eager raises it again, with eager's side effects before the raise (a counter or an
        input updated in place), which the trace, on placeholders, did not make. Where eager
        runs fine instead, the exception was the trace's own (code that behaves otherwise on
        fake tensors): that signature runs eagerly from now on, with a warning.
        """
        key = st.raised
        if key is None:
            if st.eager_now:  # a signature marked to run eagerly (below)
                st.eager_now = False
                self._eager_calls[_TRACE_FAILS[0]] = self._eager_calls.get(_TRACE_FAILS[0], 0) + 1
            return self._fallback(args, kwargs, statics)
        st.raised = None
        out = self._fallback(args, kwargs, statics)  # eager's exception propagates from here
        st.eager_only.add(key)
        # eager runs fine where the trace raised: code that behaves otherwise on the trace's
        # placeholders (fake tensors without data), or a fake kernel torch lacks
        self._note_eager(_TRACE_FAILS, f" (the trace raised {st.raised_what})")
        return out

    def _note_eager(self, reason: Tuple[str, str], detail: str = "") -> None:
        """Count a call that ran eagerly, and warn of the first of this function's with an EagerWarning."""
        what, fix = reason
        first = not self._eager_calls
        self._eager_calls[what] = self._eager_calls.get(what, 0) + 1
        if first:
            fr = user_frame()
            warnings.warn_explicit(
                EagerWarning(f"{self._desc}: called {what}{detail}, which gtransform does not record: the "
                             "function runs eagerly (correct, not faster; shown once per function, "
                             f"f.describe() counts such calls). Fix: {fix}"),
                EagerWarning, getattr(fr, "filename", "<unknown>") or "<unknown>", getattr(fr, "lineno", 0) or 0)

    def _key(self, leaves: List[Any], spec: Any, args: Any, kwargs: Any, statics: Tuple[Any, ...], glob: Any) -> Tuple[Any, List[Any], List[int], Optional[torch.device], List[str]]:
        """The cache key of a call (validating its leaves), its parts and tensor positions."""
        parts: List[Any] = []
        tpos: List[int] = []
        paths: List[str] = []
        device = None

        def get_paths() -> List[str]:
            if not paths:
                paths.extend(leaf_paths((args, kwargs)))
            return paths

        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if type(x) is not torch.Tensor and type(x) is not _Parameter:
                    _bad_tensor(self._desc, get_paths()[i], x)
                if x.layout != torch.strided or x.is_nested or x.device.type == "meta" or x.is_quantized:
                    _bad_tensor(self._desc, get_paths()[i], x)
                if device is None:
                    device = x.device
                elif x.device != device:
                    _mixed_devices(self._desc, leaves, get_paths())
                parts.append(tensor_meta(x))
                tpos.append(i)
            else:
                try:
                    parts.append(static_leaf_key(x))
                except TypeError:
                    raise TypeError(
                        f"{self._desc}: the non-tensor leaf {get_paths()[i]} of type {type(x).__name__} is not "
                        "hashable. Non-tensor leaves are static: their values are part of the cache key. "
                        "Fix: pass it as a tensor, make it hashable (e.g. a tuple instead of a list), or "
                        "register its type as a pytree node with optree (namespace='gtransform')."
                    ) from None
        ts = [leaves[i] for i in tpos]
        # the conjugate and negative bits and inference tensors change the tensors' dispatch keys,
        # which the guards check: a key of their own (an input alternating between z.conj() and
        # z traced again on every switch)
        bits = tuple((k, t.is_conj(), t.is_neg(), t.is_inference()) for k, t in enumerate(ts)
                     if t.is_conj() or t.is_neg() or t.is_inference())
        alias = (alias_pattern(ts), same_objects(ts), bits)
        return (spec, tuple(parts), alias, statics, glob, dict_orders((args, kwargs))), parts, tpos, device, paths

    def _lookup(self, st: ThreadState, leaves: List[Any], spec: Any, args: Any, kwargs: Any, statics: Tuple[Any, ...], record: bool, glob: Any = None) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
        """Find or trace the signature of a call.

        Returns:
            The entry and the call's state tensors, or ``None`` when the call
            must run eagerly: the first call of a signature that touches state
            (lazily created state, such as optimizer moments, then exists as
            real tensors before anything is recorded).
        """
        key, parts, tpos, device, paths = self._key(leaves, spec, args, kwargs, statics, glob if glob is not None else global_key())
        if record and key in st.eager_only:
            st.eager_now = True  # (counted as it runs: see _eager)
            return None
        e = st.cache.get(key)
        if e is not None:
            state = e.matching_state(leaves, statics)
            if state is not None:
                st.cache.move_to_end(key)
                if record:
                    self._hits += 1
                st.last = e
                return e, state
            env_only = e.env_only_mismatch(leaves, statics)
            grads_only = not env_only and e.grads_came_or_went(leaves)
        else:
            env_only = grads_only = False
        if (env_only or grads_only or e is None) and st.alts.get(key):
            alt = st.take_alt(key, leaves, statics)
            if alt is not None:
                # switched back (model.train() after model.eval()): that recording again
                if e is not None:
                    st.set_aside(e)
                a, state = alt
                st.cache[key] = a
                if record:
                    self._hits += 1
                st.last = a
                return a, state
        if e is not None:
            if log.isEnabledFor(logging.INFO):
                log.info("%s: tracing a signature again: %s", self._desc,
                         "; ".join(diff_leaves(e, leaves, paths or leaf_paths((args, kwargs)))) or "its state changed")
            if e.plan.touches_state and not (env_only and e.env_keeps_lazy_state()) and not grads_only:
                # what changed may have emptied lazily created state (optimizer.state.clear(),
                # load_state_dict): the next call runs eagerly again before anything is traced
                st.warmed.discard(key)
            if grads_only:
                st.set_aside(e)  # kept: gradient accumulation switches back (see grads_came_or_went)
            elif env_only:
                st.set_aside(e)  # kept: a switch back replays it
                if record:
                    self._storm.note_env(e.env.diff(e.env_val) if hasattr(e.env, "diff") else [],
                                         self._hits + self._misses, stacklevel=5)
            else:
                st.drop(e)
                if record:
                    self._storm.note_retrace(diff_leaves(e, leaves, paths or leaf_paths((args, kwargs))),
                                             self._hits + self._misses, stacklevel=5)
        self._misses += 1
        if not paths:
            paths = leaf_paths((args, kwargs))
        self._storm.note(spec, parts, paths, statics, stacklevel=5, calls=self._hits + self._misses,
                         maxsize=self._maxsize)
        if st.pending:
            e = st.pending.pop(key, None)
            if e is not None and record:
                # the second call of a signature that touches state: the first call's trace,
                # if this call matches it (not traced again: for a model, most of a second's
                # worth of first call on a GPU host)
                state = e.matching_state(leaves, statics)
                # (state with autograd history, such as a cache written outside no_grad by the
                # eager call, is not in the guards: traced again, where it is refused)
                if state is not None and not any(t.grad_fn is not None for t in state):
                    self._insert(st, key, e)
                    return e, state
                log.info("%s: the first call's trace no longer matches (the eager call changed what it "
                         "reads); tracing again", self._desc)
        in_paths = [paths[i] for i in tpos]
        cuda = device is not None and device.type == "cuda"
        template = list(leaves)

        same = key[2][1]  # which tensor arguments are the same object (see _key)

        def rebuild(ts: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
            ls = list(template)
            if same:  # the same tensor passed twice: one object, as in eager (`a is b`)
                ts = [ts[k] for k in same] + list(ts[len(same):])
            for p, t in zip(tpos, ts):
                ls[p] = t
            a, kw = unflatten(spec, ls)
            a, skw = self._rebuild_args(a, statics)
            if skw:
                kw = dict(kw)
                kw.update(skw)
            return a, kw

        tensors = [leaves[i] for i in tpos]
        specs = [(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors]
        extra = [(paths[i], x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
        extra += [(f"static {w}", v) for w, v, _k in statics]
        roots = find_roots(self._fn, extra)
        lazy = uninitialized_modules(roots)
        if lazy:
            # lazy modules (nn.LazyLinear) create their parameters in their first forward:
            # that call runs eagerly, and the next one traces the initialised modules
            if not record:
                raise lazy_error(self._desc, lazy)
            self._lazy_calls += 1
            if self._lazy_calls == 2:
                # a lazy module the calls never run (an unused head): never recorded, silently
                log.warning("%s: %s still not initialised after %d calls: every call runs eagerly (nothing "
                            "is recorded) until they are. Fix: run each lazy module once (a forward on an "
                            "example input) or replace it by its non-lazy form.",
                            self._desc, ", ".join(lazy[:4]), self._lazy_calls)
            else:
                log.info("%s: %s not initialised yet: this call runs eagerly, the next one is traced",
                         self._desc, ", ".join(lazy[:4]))
            return None
        if self._fuse and cuda and record:
            from .fuse import warm_pool  # the fused backend: loaded for fuse=True alone

            warm_pool()  # inductor's compile workers start while the function is traced
        gens = GeneratorGuard(self._fn, extra, roots)
        try:
            try:
                plan = trace(self._fn, rebuild, specs, in_paths, self._desc, cuda, roots, [plain_layout(t) for t in tensors],
                             [has_grad(t) for t in tensors], [tensor_attrs(t) for t in tensors],
                             [t.grad_fn for t in tensors])
            except BaseException:
                gens.check(self._desc, raise_=False)
                raise
            gens.check(self._desc, raise_=True)
        except GraphifyError as err:
            if record and key not in st.warmed and getattr(err, "gt_touched_state", False):
                # state may be created lazily by the first call (a cache allocated on first
                # use): run it eagerly, and trace again on the next call
                st.warmed.add(key)
                log.info("%s: the first trace failed after reading state (%s); this call runs "
                         "eagerly, the next one traces again", self._desc, str(err).splitlines()[0])
                return None
            raise
        except Exception as err:
            if isinstance(err, RuntimeError) and "leaf Variable that requires grad is being used in an in-place" in str(err):
                # the trace's stand-ins of inputs that require grad are leaves; the caller's may not be
                # (an eager backbone's output), where eager updates them in place
                nonleaf = [in_paths[i] for i, t in enumerate(tensors) if t.requires_grad and not t.is_leaf]
                if nonleaf:
                    raise GraphifyError(
                        f"{self._desc}: the function updates an input that requires grad in place "
                        f"({', '.join(nonleaf)}, an output of earlier differentiable work: "
                        f"{str(err).splitlines()[0]}).\nWhy: in-place updates of inputs are not supported "
                        "through the autograd wrapper of a recording.\nFix: make the update out of place "
                        "(nn.ReLU(inplace=False), x = x + 1 instead of x += 1), or call the function under "
                        "torch.no_grad() if no gradient is needed.") from None
            if not record or _raised_by_gtransform(err):
                raise
            if not _raised_by_fake_kernels(err):
                # the function's own exception (a shape check, an assert): the call runs
                # eagerly, which raises it again after eager's side effects before the raise
                # (a counter, a buffer or an input updated in place: the trace made them on
                # placeholders, and put the Python state it changed back; see _eager)
                st.raised = key
                st.raised_what = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
                log.info("%s: the trace raised the function's own exception (%s): this call runs eagerly",
                         self._desc, st.raised_what)
                return None
            # an error torch's fake or meta kernels raised (a bad view, a shape mismatch: the
            # user's own, but in their wording and sometimes another type): the call runs
            # eagerly (the trace left no trace), so eager's exception propagates unchanged; if
            # eager runs it fine, the kernels could not trace it, and this signature runs eagerly
            # (so eager's own exception propagates as eager raises it; see _eager for a call that
            # runs fine)
            st.raised = key
            st.raised_what = f"{type(err).__name__} inside torch's fake kernels: " + (
                str(err).splitlines()[0][:200] if str(err) else "")
            log.info("%s: the trace failed inside torch's fake kernels (%s): this call runs eagerly",
                     self._desc, st.raised_what)
            return None
        if device is None and plan.uses_cuda and torch.cuda.is_available():
            cuda = True
        # Python numbers the trace changed in modules or optimizers (self.calls += 1 in
        # forward), and in plain dicts and lists of a function that reaches state (a training
        # step's accumulation counter, ctr["i"] += 1; if ctr["i"] % K == 0: opt.step()):
        # undone, so that this call, run eagerly, does exactly what eager does. Changed again
        # by a trace after an eager call, they change on every call, which a replay cannot do.
        # (A function that reaches no state keeps the trace-time changes of its plain dicts,
        # as in JAX: a counter of traces.)
        model_changes = [c for c in plan.py_changes if c.model or plan.touches_state]
        if model_changes and record:
            for c in model_changes:
                c.undo()
            if key in st.warmed:
                raise change_error(self._desc, model_changes)
        warm = not (plan.touches_state or model_changes) or key in st.warmed
        if record and not warm:
            st.warmed.add(key)
            if log.isEnabledFor(logging.INFO):
                log.info("%s: this signature touches state (%d state tensors, %d written back, %d Python "
                         "values changed): its first call runs eagerly, the next one is recorded",
                         self._desc, len(plan.state), len(plan.escape_slots), len(model_changes))
            if not model_changes and reusable_after_eager(plan):
                try:
                    st.keep_pending(key, self._new_entry(key, spec, leaves, tpos, statics, plan, cuda))
                except GraphifyError:
                    pass  # raised by the second call's own trace
            return None
        e = self._new_entry(key, spec, leaves, tpos, statics, plan, cuda)
        if not warm:
            return e, list(plan.state)  # f.trace(...) before the first call: not kept
        self._insert(st, key, e)
        return e, list(plan.state)

    def _insert(self, st: ThreadState, key: Any, e: Entry) -> None:
        """Cache a new signature (the least recently used one goes beyond maxsize)."""
        st.cache[key] = e
        if self._maxsize is not None:
            while len(st.cache) > self._maxsize:
                old = next(iter(st.cache.values()))
                self._storm.note_evicted(old)
                st.drop(old)
        st.last = e

    def _new_entry(self, key: Any, spec: Any, leaves: List[Any], tpos: List[int], statics: Any, plan: Any,
                   cuda: bool) -> Entry:
        """The signature of a trace, refused when a replay could not do what eager does."""
        e = Entry(key, spec, leaves, tpos, statics, plan, cuda)
        if e.any_rg:
            kept_slots = [s for s, o in zip(plan.escape_slots, plan.escape_entries) if s.kind != "grad" and o.requires_grad]
            kept = [s.path for s in kept_slots]
            if kept:
                owner = kept_slots[0].obj
                hooks = [h for h in getattr(owner, "_forward_pre_hooks", {}).values()
                         if (type(h).__module__ or "").startswith("torch.nn.utils")]
                if hooks:
                    # torch.nn.utils.prune, the old weight_norm / spectral_norm: a forward pre-hook
                    # recomputes the weight from its parts and stores it on the module each call
                    fix = (f"Fix: {type(hooks[0]).__name__} (torch.nn.utils) recomputes {kept[0]} in a forward "
                           "pre-hook on every call. Use the parametrization API instead "
                           "(torch.nn.utils.parametrizations.weight_norm / spectral_norm, or "
                           "torch.nn.utils.parametrize.register_parametrization), make pruning permanent "
                           "(torch.nn.utils.prune.remove(module, 'weight')), or call it under torch.no_grad().")
                else:
                    fix = (f"Fix: return it as an output of the function instead, or store a detached copy "
                           f"({kept[0].rsplit('.', 1)[-1]} = h.detach()) if it is only looked at.")
                raise GraphifyError(
                    f"{self._desc}: the function stores a tensor that requires grad in {kept[0]} (Python "
                    "state), and the call is differentiated.\n"
                    "Why: a replay writes that tensor back as plain memory after each call; it cannot "
                    "carry the autograd graph eager attaches to it, so a loss built from it later would "
                    "silently miss its gradients.\n" + fix
                )
        # a module without tensors (nn.LeakyReLU) has attributes and a training flag too; so does
        # one the function called without the roots leading to it (AttrReads.called)
        if plan.roots or (plan.attr_reads is not None and plan.attr_reads.called):
            e.env = env_key_fn(plan.roots, plan.attr_reads)
            e.env_val = e.env() if e.env is not None else None
        return e

    def _run(self, e: Entry, tensors: List[torch.Tensor]) -> Any:
        rec = e.rec
        st = self._tls.state
        if st.fast_rec is not None and st.fast_rec is not rec:
            # the fast path serves the most recently used signature only (LRU order)
            st.drop_fast()
        e.calls += 1
        if rec is None:
            static = set(e.must_static) | e.state_static
            static.update(i for i, t in enumerate(tensors) if type(t) is _Parameter)
            rec = e.rec = self._record(e, tensors, static)
            # weak for the caller's tensors (a batch is not kept alive); the state's and
            # parameters (held by their modules anyway) directly: a weak reference would
            # forbid swapping them (torch.utils.swap_tensors, module.to() with swapping)
            e.first_refs = [_Strong(t) if i >= e.n_user or type(t) is _Parameter else weakref.ref(t)
                            for i, t in enumerate(tensors)]
        elif e.first_refs is not None:
            # Second call of this signature: inputs passed again as the very
            # same tensors (parameters, persistent state) are read in place.
            refs = e.first_refs
            e.first_refs = None
            same = [i for i in rec.copy_idx if refs[i]() is tensors[i]]
            if same or not rec.statics_ok(tensors):
                rec = e.rec = self._rerecord(e, rec, tensors, set(same) | self._kept(e, rec, tensors))
        elif rec.static_idx and not rec.statics_ok(tensors):
            rec = e.rec = self._rerecord(e, rec, tensors, self._kept(e, rec, tensors))
        out = rec.run_flat(tensors)
        if e.first_refs is None:
            if st.fast_rec is not rec:
                fast = rec.fast
                if fast is None:
                    try:
                        fast = rec.fast = build_fast_path(self, e, rec, st.pool)
                    except Exception:  # pragma: no cover - the generic path still works
                        if _fastpath.STRICT:
                            raise
                        log.debug("%s: no fast path", self._desc, exc_info=True)
                        fast = rec.fast = None
                st.fast, st.fast_rec, st.fast_statics = fast, rec, e.statics
        return out

    @staticmethod
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

    def _rerecord(self, e: Entry, old: Recording, tensors: List[torch.Tensor], static: Any) -> Recording:
        """Record the signature again with other in-place inputs.

        Output objects the caller dropped keep their identity.
        """
        if log.isEnabledFor(logging.INFO):
            log.info("%s: re-recording a signature: inputs read in place now %s (were %s)",
                     self._desc, [e.plan.in_paths[i] for i in sorted(static)],
                     [e.plan.in_paths[i] for i in old.static_idx])
        new = self._record(e, tensors, static)
        new.moved_once = old.moved_once
        new.adopt_outputs(old)  # old is closed after new's first replay
        st = self._tls.state
        if st.fast_rec is old:
            st.drop_fast()
        return new

    def _record(self, e: Entry, tensors: List[torch.Tensor], static: Any) -> Recording:
        st = self._tls.state
        t0 = time.perf_counter()
        rec = make_recording(e.plan, tensors, sorted(static), st.pool, self._desc, e.cuda, self._fuse)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s: recorded %s (%s): %d ops, %d inputs (%d read in place, %d copied), %d outputs, %.1f ms",
                self._desc, "a CUDA graph" if e.cuda else "the traced graph", sig_brief(e),
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
                what = "state" if i >= e.n_user else "in   "
                lines.append(f"  {what} {path}: {meta[3]} {list(meta[1])} ({how})")
            for i, v in e.const_vals.items():
                lines.append(f"  static leaf {i}: {v!r}")
            for k, oe in enumerate(e.plan.out_entries):
                if oe.kind == "const":
                    lines.append(f"  out {k}: constant {oe.value!r}")
                elif oe.kind == "input":
                    lines.append(f"  out {k}: {'the' if oe.identical else 'a view of the'} caller's input {e.plan.in_paths[oe.index]}")
                else:
                    lines.append(f"  out {k}: pool tensor")
            for slot in e.plan.escape_slots:
                lines.append(f"  written back after each call: {slot.path}")
            for c in e.plan.py_changes:
                lines.append(f"  Python value changed while tracing (not replayed): {c.path}: {c.old!r} -> {c.new!r}")
            if e.plan.touches_state:
                lines.append("  first call: ran eagerly (the signature touches state); recorded on the second call")
                if e.env is not None:
                    lines.append(f"  also keyed on: {getattr(e.env, 'describe', 'module and optimizer settings')}")
            if rec:
                buf = sum(b.numel() * b.element_size() for b in rec.bufs)
                pool = sum(g.base.untyped_storage().nbytes() for g in rec.groups)
                lines.append(f"  bytes: static input buffers {buf}, pool outputs {pool}")
        for what, n in self._eager_calls.items():
            lines.append(f"ran eagerly, not recorded: {n} call(s) {what}")
        for h in list(self._vmapped.values()):
            lines.append("calls under torch.func.vmap, recorded as " + h.describe().replace("\n", "\n  "))
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
        leaves, spec = _flatten_args(args, kwargs)
        st = self._tls.__dict__.get("state")
        entries = list(st.cache.values()) if st is not None else []
        glob, orders = global_key(), dict_orders((args, kwargs))
        for e in entries:
            if e.spec == spec and e.glob == glob and e.orders == orders:
                state = e.resolve_state() if e.state_src else []
                if state is not None and e.match(leaves, statics, state):
                    return f"{self._desc}: replays a recorded signature (hit)"
        if not entries:
            return f"{self._desc}: nothing recorded yet in this thread (miss)"
        paths = leaf_paths((args, kwargs))
        best, best_diff = None, None
        for e in entries:
            if e.spec != spec:
                continue
            diff = diff_leaves(e, leaves, paths)
            if best_diff is None or len(diff) < len(best_diff):
                best, best_diff = e, diff
        if best is None:
            return (f"{self._desc}: a new signature (miss): the structure of the arguments differs "
                    f"from every recorded one: {spec} vs {entries[-1].spec}")
        if not best_diff and best.statics != statics:
            best_diff = [f"static arguments {[(w, v) for w, v, _k in best.statics]!r} -> "
                         f"{[(w, v) for w, v, _k in statics]!r}"]
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


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_FAKE_KERNEL_DIRS = tuple(_TORCH_DIR + d
                          for d in ("_refs", "_prims", "_meta_registrations.py", "_decomp", "_subclasses",
                                    "_prims_common"))


def _raised_by_gtransform(err: BaseException) -> bool:
    """Whether an exception of the trace was raised by gtransform's own code (not the function's)."""
    import traceback as _tb

    frames = _tb.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PKG_DIR)


def _raised_by_fake_kernels(err: BaseException) -> bool:
    """Whether an exception of the trace comes from torch's fake or meta kernels."""
    import traceback as _tb

    frames = _tb.extract_tb(err.__traceback__)
    return (bool(frames) and frames[-1].filename.startswith(_TORCH_DIR)
            and any(f.filename.startswith(_FAKE_KERNEL_DIRS) for f in frames))


_FORWARD_AD = (
    "with forward-mode dual tensors (torch.func.linearize, torch.autograd.forward_ad)",
    "graphify the transformed function instead: gt.graphify(lambda x, t: torch.func.jvp(f, (x,), (t,))) "
    "records the forward and its tangent, and for linearize, out, jvp_fn = torch.func.linearize(f, x); "
    "gt.graphify(jvp_fn).",
)


_TRACE_FAILS = (
    "with a signature whose trace fails where eager runs",
    "look at the traceback of f.trace(...) with the same arguments: code that behaves otherwise on the "
    "trace's placeholders (fake tensors without data, e.g. a check of torch.compiler.is_compiling()), or an "
    "operation torch's fake kernels cannot run; move that part out of the graphified function.",
)


def _any_tangent(leaves: Sequence[Any]) -> bool:
    """Whether a tensor leaf is a forward-mode dual (has a tangent at the open dual level)."""
    return any(isinstance(x, torch.Tensor) and _fwad.unpack_dual(x).tangent is not None for x in leaves)


def _transforms_reason() -> Tuple[str, str]:
    """What the active torch.func transforms are, and how to record them instead (see _run_eagerly)."""
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        names = [i.key().name.lower() for i in retrieve_all_functorch_interpreters()]
    except Exception:  # pragma: no cover
        names = []
    listed = ", ".join(dict.fromkeys(names)) or "a transform"
    what = f"under torch.func.{names[0]}" if len(set(names)) == 1 else f"under torch.func transforms ({listed})"
    if "jvp" in names:
        fix = ("graphify the transformed function instead: gt.graphify(torch.func.jacfwd(f)), "
               "gt.graphify(torch.func.hessian(f)) or gt.graphify(lambda x, t: torch.func.jvp(f, (x,), (t,))) "
               "record the transform with the function.")
    elif set(names) == {"vmap"}:
        fix = ("graphify the batched function instead: gt.graphify(torch.func.vmap(f)) records it (as "
               "jax.jit(jax.vmap(f)) does).")
    else:
        fix = ("graphify the transformed function instead (e.g. gt.graphify(torch.func.vmap(f)), "
               "gt.graphify(torch.func.jacrev(f))): it records the transform with the function.")
    return what, fix


def _flatten_args(args: Any, kwargs: Any) -> Tuple[List[Any], Any]:
    """Flatten the call's arguments.

    Dataclasses and torch-pytree containers are taken apart (registered on first
    sight, as outputs are), nested ones too.
    """
    leaves, spec = flatten((args, kwargs))
    for _ in range(8):
        if not register_containers_in(leaves):
            break
        leaves, spec = flatten((args, kwargs))
    return leaves, spec


def _resolve_static(fn: Callable[..., Any], nums: Tuple[int, ...], names: Tuple[str, ...], desc: str) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """Map static_argnums and static_argnames onto each other, like jax.jit."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    nums_out = set()
    for i in nums:
        j = i + len(positional) if i < 0 else i
        if j < 0 or (j >= len(positional) and not var_pos):
            kw_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
            raise ValueError(
                f"{desc}: static_argnums={i} is out of range: the function takes {len(positional)} positional "
                f"parameter(s) ({', '.join(p.name for p in positional) or 'none'}). "
                + (f"Fix: name keyword-only parameters with static_argnames (e.g. static_argnames={kw_only[0]!r})."
                   if kw_only else "Fix: give the position of a positional parameter (0-based, negative from the end).")
            )
        nums_out.add(j)
    names_out = set(names)
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        known = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [n for n in names if n not in known]
        if unknown:
            # (jax.jit raises too: a misspelt name would leave the argument traced, silently)
            raise ValueError(
                f"{desc}: static_argnames {unknown} name no parameter of the function (its parameters: "
                f"{sorted(known)}). Fix: name a parameter of the function, or give its position with "
                "static_argnums.")
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
        msg = stale_message(t)
        raise OverwrittenOutputError(f"{msg}\n(passed as input {path} to {desc})")
    if t.layout != torch.strided:
        what, fix = f"a {t.layout} tensor", "pass a dense tensor (t.to_dense())"
    elif t.is_nested:
        what, fix = "a nested tensor", "pass padded dense tensors instead"
    elif t.device.type == "meta":
        what, fix = "a meta tensor (it has no data)", "pass a tensor on the CPU or a GPU"
    elif t.is_quantized:
        what, fix = f"a quantized tensor ({t.dtype})", "pass t.dequantize() (or t.int_repr() and its scale)"
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
            Each kernel is built in one Triton configuration, not autotuned
            among several at its first launch (shorter first call; the
            kernels of launch-bound graphs run alike in any of them).
            Small float32 matrix products on CUDA run as a kernel of
            gtransform's with their bias and ReLU, equal to eager's to float32
            rounding (``GTRANSFORM_GEMM=0`` in the environment: cuBLAS's).
            Before its first CUDA compile it sets ``TRITON_PTXAS_PATH`` to
            torch's own ptxas, as inductor does (unless already set), so that
            a later process finds the kernels in the compile caches.

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

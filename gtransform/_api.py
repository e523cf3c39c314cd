"""The front door: ``graphify`` and the callable it returns.

A call runs the fast path of the last recording (``_fastpath``); a miss takes the stages
of ``_calls``: bind (``_bind``) -> find or trace the signature (``_lookup``, asking ``_key``)
-> record and replay (``_replay``) -> hand out the outputs (``_liveness``). Gradients go
through ``_autograd``, vmap through ``_batching``, sizes through ``_sized``, unrecordable
calls run eagerly (``_eager``). This module holds the options and per-function state.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any, Callable, Dict, Generic, Literal, Optional, ParamSpec, Sequence, TypeVar, Union, overload

import torch

from . import _buffers, _calls, _describe
from ._bind import options
from ._cache import CacheInfo, ThreadState, cache_clear, cache_info, new_thread_state
from ._compat import peek_interpreter_stack as _peek_functorch  # (None: no torch.func transform active)
from ._errors import describe_fn, not_a_module_error
from ._fastpath import MISS
from ._key import StormDetector
from ._key._storm import RerecordWarning
from ._liveness import PoolState
from ._pool import GraphPool
from ._sized import new_sizes
from ._switch import OFF

__all__ = ["graphify", "Graphified", "CacheInfo", "RerecordWarning"]

P = ParamSpec("P")
R = TypeVar("R")
OnBreak = Literal["error", "split", "eager"]
Sizes = Union[None, int, Sequence[int]]
Nums = Union[int, Sequence[int]]
Names = Union[str, Sequence[str]]


class Graphified(Generic[P, R]):
    """A function that records itself into a graph per input signature.

    Made by :func:`graphify` (see there). Methods: :meth:`trace`, :meth:`input_buffers`,
    :meth:`cache_info`, :meth:`cache_clear`, :meth:`describe`, :meth:`explain`. It keeps
    ``__wrapped__``, ``__name__`` and ``__doc__`` of ``fn`` and binds as a method. Copies
    (``copy.copy``, ``copy.deepcopy``, pickling): same options, no recordings.

    Examples:
        >>> import torch, gtransform as gt
        >>> class Scaler:
        ...     k = 3.0
        ...     f = gt.graphify(lambda self, x: x * self.k)
        >>> Scaler().f(torch.ones(2))
        tensor([3., 3.])
    """

    def __init__(self, fn: Callable[P, R], *, static_argnums: Nums = (), static_argnames: Names = (),
                 pool: Optional[GraphPool] = None, maxsize: Optional[int] = 64, fuse: bool = False,
                 on_break: OnBreak = "error", record_sizes: Sizes = None, buckets: Optional[Sequence[int]] = None,
                 pad: Any = None, donate_argnums: Nums = (), donate_argnames: Names = ()):
        self._desc = describe_fn(fn) if callable(fn) else "graphify(fn)"
        self._options = options(fn, self._desc, static_argnums, static_argnames, pool, maxsize, fuse, on_break,
                                record_sizes, buckets, pad, (donate_argnums, donate_argnames))
        _calls.opaque_to_dynamo(Graphified.__call__.__code__)
        self._fn, self._pool, self._maxsize, self._fuse = fn, pool, maxsize, fuse
        self._static_argnums, self._static_argnames = map(frozenset, self._options[:2])
        self._has_static = bool(self._static_argnums or self._static_argnames)
        self._tls = threading.local()  # .state: the thread's ThreadState (see _cache)
        self._states: weakref.WeakSet[ThreadState] = weakref.WeakSet()
        self._hits = self._misses = self._lazy_calls = 0  # (lazy: calls eager for uninitialised lazy modules)
        self._eager_calls: Dict[str, int] = {}  # calls run eagerly (see _eager), by reason
        self._vmapped: Dict[Any, Graphified[Any, Any]] = {}  # graphify(vmap(fn)) per batching (see _batching)
        self._sizes = new_sizes(fn, self._options)  # record_sizes=, buckets= (see _sized)
        self._storm = StormDetector(self._desc, self._sizes.allowance if self._sizes is not None else 0)
        self._breaks: Any = None  # signatures that read their own data, run as on_break says (see _breaks)
        if fuse:
            from .fuse import prepare  # (inductor loaded now, as torch.compile(fn) loads it when it wraps)

            prepare()
        functools.update_wrapper(self, fn, updated=())  # (not __dict__: fn may be an nn.Module)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if OFF.on:  # gt.disable(), GTRANSFORM_DISABLE=1
            return self._fn(*args, **kwargs)
        interp = _peek_functorch()
        if interp is None:
            st = self._tls.__dict__.get("state")
            if st is not None and st.fast is not None:
                out = st.fast(args, kwargs)
                if out is not MISS:
                    return out  # type: ignore[no-any-return]
        return self._call_generic(interp, args, kwargs)  # type: ignore[no-any-return]

    def _call_generic(self, interp: Any, args: Any, kwargs: Any) -> Any:  # (a fast-path miss)
        return _calls.call(self, interp, args, kwargs)

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> torch.fx.GraphModule:
        """Trace ``fn`` for these inputs and return what would be recorded.

        Like ``jax.make_jaxpr``: nothing is recorded or run. The aten ``GraphModule`` takes the
        flat tensor leaves of the arguments, then the state read (``f.describe()``).

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x.sin() + 1)
            >>> print(f.trace(torch.ones(3)).code.strip().splitlines()[0])
            def forward(self, arg0_1):
        """
        return _describe.trace(self, args, kwargs)

    def input_buffers(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The static input buffers of this signature's recording (recorded first if needed).

        The arguments' tree (a tuple of the positional ones; with keyword arguments ``(args, kwargs)``),
        each copied tensor replaced by its buffer. Write the next inputs into them and call ``f(*bufs)``:
        no copy. Rules and examples: docs/serving-buffers.md.
        """
        return _buffers.input_buffers(self, args, kwargs)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, maxsize and current size of the signature cache (all threads).

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> _ = f(torch.ones(2)); _ = f(torch.ones(2))
            >>> f.cache_info()
            CacheInfo(hits=1, misses=1, maxsize=64, currsize=1)
        """
        return cache_info(self)

    def cache_clear(self) -> None:
        """Drop every recording of this function, in every thread.

        Outputs handed out stay valid; another thread's are released at its next call.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x + 1)
            >>> y = f(torch.ones(2))
            >>> f.cache_clear()
            >>> f.cache_info().currsize, y
            (0, tensor([2., 2.]))
        """
        cache_clear(self)

    def describe(self) -> str:
        """A readable account of what this function has recorded (this thread).

        Per signature: inputs by leaf path (in place or copied), outputs, ops, bytes; eager calls by reason.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x: x * 2)
            >>> _ = f(torch.ones(3))
            >>> print(f.describe().splitlines()[0])
            graphify(<lambda>): 1 signature(s) in this thread; cache CacheInfo(hits=0, misses=1, maxsize=64, currsize=1)
        """
        return _describe.describe(self)

    def explain(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Say whether a call with these arguments would replay, and if not, why.

        Like JAX's ``jax_explain_cache_misses``: the closest signature's checks say how the
        call differs (a leaf's layout, a static value, the state...). Nothing is run.

        Examples:
            >>> import torch, gtransform as gt
            >>> f = gt.graphify(lambda x, n: x * n)
            >>> _ = f(torch.ones(3), 2)
            >>> print(f.explain(torch.ones(3), 3))
            graphify(<lambda>): a new signature (miss): args[1]: static value 2 -> 3
        """
        if OFF.on:
            return (f"{self._desc}: runs eagerly here: gtransform is off in this thread (gt.disable()) or "
                    "process (GTRANSFORM_DISABLE=1); nothing is traced or replayed")
        return _describe.explain(self, args, kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None or isinstance(self._fn, (staticmethod, classmethod)):
            # graphify(staticmethod(f)) in a class body: not bound to the instance, as the
            # staticmethod itself would not be (a classmethod object is not callable, refused above)
            return self
        bound = _BoundGraphified(self, obj)
        bound.__wrapped__ = self._fn.__get__(obj) if hasattr(self._fn, "__get__") else self._fn  # type: ignore[attr-defined]
        bound.__name__, bound.__doc__ = getattr(self, "__name__", "graphified"), self.__doc__  # type: ignore[attr-defined]
        return bound

    def __repr__(self) -> str:
        return f"<{self._desc}>"

    # -- copies: a new graphified function with the same options and no recordings
    def __copy__(self) -> Graphified[P, R]:
        return Graphified(self._fn, **self._options.as_kwargs())

    def __deepcopy__(self, memo: Dict[int, Any]) -> Graphified[P, R]:
        return Graphified(copy.deepcopy(self._fn, memo), **self._options.as_kwargs())

    def __getstate__(self) -> Dict[str, Any]:
        return {"fn": self._fn, "options": self._options.as_kwargs()}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["fn"], **state["options"])  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # only for names ordinary lookup did not find: graphify(model) is not the module
        raise not_a_module_error(self.__dict__.get("_desc", "graphify(fn)"), self.__dict__.get("_fn"), name)

    def _new_state(self) -> ThreadState:
        return new_thread_state(self, self._pool._state if self._pool is not None else PoolState())

    def _spawn_like(self, fn: Callable[..., Any]) -> Graphified[Any, Any]:
        """A graphified function of ``fn`` with this one's options (a vmapped version of it)."""
        return Graphified(fn, pool=self._pool, maxsize=self._maxsize, fuse=self._fuse)

    def _spawn(self, fn: Callable[..., Any], every_size: bool = False) -> Graphified[Any, Any]:
        """A graphified helper (a forward or backward half) with this function's options.

        ``every_size``: a half of a symbolic partition (see ``_partition``), called at every size
        this function records: it keeps as many signatures as this function does (its
        maxsize, or the sizes ``record_sizes=``/``buckets=`` ask for), and its new sizes are
        not warned about (this function's are).
        """
        if not every_size:
            half = Graphified(fn, maxsize=8, fuse=self._fuse)
        else:
            bounds = [m for m in (self._maxsize, self._sizes.allowance if self._sizes is not None else 0) if m]
            half = Graphified(fn, maxsize=min(bounds) if bounds else None, fuse=self._fuse)
            half._storm.quiet()
        keep = self.__dict__.get("_keep_held")
        if keep is not None:  # (a piece of a split function: its halves' held outputs keep their values too)
            half._keep_held = keep  # type: ignore[attr-defined]
        return half


class _BoundGraphified(functools.partial):
    """A graphified function bound to an object (``obj.method``): its methods are the function's."""

    def __getattr__(self, name: str) -> Any:  # (trace and explain take the call's arguments: the object first)
        attr = getattr(self.func, name)
        return functools.partial(attr, *self.args) if name in ("trace", "explain") else attr

    def input_buffers(self, *args: Any, **kwargs: Any) -> Any:
        bufs = self.func.input_buffers(*self.args, *args, **kwargs)  # type: ignore[attr-defined]
        n = len(self.args)  # (the bound object is not a buffer: left out)
        return (bufs[0][n:], bufs[1]) if kwargs else bufs[n:]


@overload
def graphify(fn: Callable[P, R], *, static_argnums: Nums = ..., static_argnames: Names = ..., pool: Optional[GraphPool] = ...,
             maxsize: Optional[int] = ..., fuse: bool = ..., on_break: OnBreak = ..., record_sizes: Sizes = ...,
             buckets: Optional[Sequence[int]] = ..., pad: Any = ..., donate_argnums: Nums = ...,
             donate_argnames: Names = ...) -> Graphified[P, R]: ...


@overload
def graphify(fn: None = ..., *, static_argnums: Nums = ..., static_argnames: Names = ..., pool: Optional[GraphPool] = ...,
             maxsize: Optional[int] = ..., fuse: bool = ..., on_break: OnBreak = ..., record_sizes: Sizes = ...,
             buckets: Optional[Sequence[int]] = ..., pad: Any = ..., donate_argnums: Nums = ...,
             donate_argnames: Names = ...) -> Callable[[Callable[P, R]], Graphified[P, R]]: ...


def graphify(fn: Optional[Callable[P, R]] = None, *, static_argnums: Nums = (), static_argnames: Names = (),
             pool: Optional[GraphPool] = None, maxsize: Optional[int] = 64, fuse: bool = False,
             on_break: OnBreak = "error", record_sizes: Sizes = None, buckets: Optional[Sequence[int]] = None,
             pad: Any = None, donate_argnums: Nums = (), donate_argnames: Names = ()) -> Any:
    """Record ``fn`` into a graph per input signature and replay it.

    ``graphify`` is ``jax.jit`` for PyTorch with CUDA graph capture as the
    compiler. On each new signature (tree structure, each tensor's shape,
    dtype, device, strides and ``requires_grad``, and the values of non-tensor
    leaves), ``fn`` is traced with fake tensors into an aten graph, bound to
    static input buffers, and recorded (a CUDA graph on the GPU; the traced
    graph on the CPU). Later calls with the same signature replay it.

    Rules (docs/api.md): ``fn`` pure but for in-place updates of its inputs; control flow resolved
    at trace time; non-tensor leaves static; tensors passed again read in place, others copied;
    an output valid until the next call (then :class:`OverwrittenOutputError`).

    Args:
        fn: the function; its arguments are pytrees of tensors and other leaves.
        static_argnums: positions of arguments passed whole as static values (hashable).
        static_argnames: names of arguments passed whole as static values.
        pool: a :func:`graph_pool` to share memory with other functions.
        maxsize: signatures kept per thread (least recently used evicted), or ``None``.
        fuse: compile each traced graph with TorchInductor before recording it
            (fused kernels, a first call of seconds; see docs/api.md).
        on_break: a trace that reads the call's own data: ``"error"`` raises,
            ``"split"`` records the pieces between reads, ``"eager"`` runs eagerly.
        record_sizes: batch sizes recorded (a sequence, or N: the N most frequent);
            other sizes run eagerly, unwarned (docs/serving.md).
        buckets: batch sizes a call's dim 0 is padded up to (the next one), outputs sliced back.
        pad: with ``buckets``, the arguments padded and their value (``{"x": 0}``).
        donate_argnums: arguments the caller gives up (``jax.jit``'s): released and invalidated
            after a replay (docs/serving-buffers.md).
        donate_argnames: the same, by name.

    Returns:
        A :class:`Graphified` callable (or a decorator, if ``fn`` is omitted).

    Raises:
        GraphifyError: ``fn`` cannot be recorded (at call time).
        TypeError, ValueError: an option of the wrong type or value.

    Examples:
        >>> import torch, gtransform as gt
        >>> @gt.graphify(static_argnums=1)
        ... def scale(x, k):
        ...     return x * k
        >>> scale(torch.ones(2), 3)
        tensor([3., 3.])
    """
    opts = dict(static_argnums=static_argnums, static_argnames=static_argnames, pool=pool, maxsize=maxsize, fuse=fuse,
                on_break=on_break, record_sizes=record_sizes, buckets=buckets, pad=pad,
                donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    return functools.partial(graphify, **opts) if fn is None else Graphified(fn, **opts)  # type: ignore[arg-type]

"""Every change gtransform makes to torch, or to objects it does not own, and the rules they keep.

Importing gtransform changes nothing in torch. What a trace needs changed is changed
here and nowhere else, while a trace runs, and undone after it; in any thread that is
not tracing, every changed thing behaves exactly as stock torch (DESIGN, semantics 14).

**The thread rule.** :func:`tracing` is true in a thread inside :class:`trace_scope`
(``_trace.trace`` and ``_partition``'s joint trace enter it), and in a thread that runs
work for such a trace (autograd's device threads run a traced ``backward()`` with the
trace's dispatch modes: a mode marked ``_gt_trace`` on the thread's dispatch stack).
Every replacement below does its tracing-time work only where :func:`tracing` is true,
and is the original everywhere else.

**How a function of torch is changed: its code, not its name.** A Python function of
torch keeps its identity (``torch.get_rng_state is`` what it was, in every thread, and
so is every name bound to it, early-bound ones included); while it is patched, its
``__code__`` is a small router (``<gtransform._patches router>`` in tracebacks) that calls the replacement where
:func:`tracing` is true and a copy of the original function elsewhere. The original
code is put back when the last trace ends. Only a C function (which has no code to
swap) or a function with a closure is replaced by name on the modules that hold it.

Installed by the first :class:`trace_scope` entered, put back by the last one to exit
(counted under a lock; on errors too):

* ``torch.compiler.is_compiling``: true in a tracing thread. Library code reads it to
  take its traceable path (torch.optim keeps step counts and tensor learning rates as
  tensors instead of reading them with ``.item()``). torch has no per-thread form of
  it: ``torch.export`` and ``torch.compile`` set the module global
  ``torch.compiler._is_compiling_flag``, which every thread reads. That global is left
  alone; the function's code is routed instead. Asked by ``torch.nn.modules.transformer``
  or ``.activation`` (fast-path checks that change the numbers, not only the route), it
  answers as eager: ``nn.TransformerEncoder`` given a padding mask then takes eager's
  nested-tensor path (zeros at the padded positions), which the trace refuses.
* ``torch.overrides.has_torch_function`` (by name on ``torch.overrides``: a C function), asked
  by those two modules: eager's answer, the trace's own torch-function modes left out, so
  that ``nn.TransformerEncoderLayer`` in eval mode without grad records eager's native
  kernel (``_transformer_encoder_layer_fwd``) instead of its composite path. Every other
  caller (``torch.nn.functional`` binds the name early; ``torch.sym_*``, higher-order ops)
  gets torch's answer.
* ``torch.get_rng_state`` / ``torch.set_rng_state`` (``torch.random``'s) and
  ``torch.cuda.get_rng_state`` / ``torch.cuda.set_rng_state`` (``torch.cuda.random``'s):
  a state got and set back inside the function is followed against the trace's random
  draws (``_watch._RngLedger``); a state set is not applied while tracing. They call
  ``Generator.get_state`` / ``set_state``, C methods no mode sees.
* ``torch.manual_seed`` / ``torch.seed`` and ``torch.cuda.manual_seed``,
  ``manual_seed_all``, ``seed``, ``seed_all``: seeding inside a traced function is a
  GraphifyError naming the user's line (``_watch._no_seeding``; a reseed through the
  generator object, a C method, is found afterwards by its changed initial seed). These
  are routed in every thread: outside a trace the replacement counts the call and runs
  the original, so that the trace's check neither refuses nor undoes another thread's seed.
* ``torch.cuda.jiterator._JittedFunction.__call__`` (CUDA builds; its code is routed,
  torch._C's launch function is left alone): a jitted kernel called on the trace's
  tensors records ``gtransform::jiterator`` instead of launching on placeholders
  (``_jiterator``).
* ``torch.SymInt`` / ``SymFloat`` / ``SymBool``'s ``__repr__`` and ``__format__``: where the
  user's code turns a symbolic size into text (``str(n)``, ``f"b{n}"``, ``repr(x.shape)``), the
  number, which pins the symbolic trace's plan to that size (:func:`_as_number`), instead of the
  symbol's name; text made by torch or gtransform stays symbolic.
* a filter on the logger ``torch._subclasses.fake_tensor`` that drops the records of a
  tracing thread: torch logs every error a fake kernel raises, with a traceback, at
  ERROR level, and the error itself reaches the caller.

Made and undone by each trace (see the functions below):

* the class of the root modules and plain objects whose attribute reads the trace
  records (:func:`track_reads`, used by ``_state.AttrReads``);
* a global module forward pre-hook that sees the modules called while tracing
  (:func:`watch_module_calls`): torch's supported mechanism, with a thread check;
* ``torch.nn.utils.parametrize``'s cache: entries the trace added (its placeholders)
  are taken out again (:func:`drop_parametrize_entries`, part of :class:`trace_scope`);
  entries another thread added meanwhile stay (the whole cache used to be put back);
* the gradient hooks on state tensors while the joint trace differentiates them
  (:func:`muted_hooks`): they run where eager runs them, on the recording's gradient.

Outside traces:

* ``torch.distributed.destroy_process_group`` (code routed in every thread), from the
  first trace of a function with collectives until the whole world is destroyed:
  recordings holding the group's communicators are released before it goes
  (``_distributed``). The only change that outlives a trace; it exists only in
  processes that record collectives.

Replaced by supported mechanisms (no patch any more):

* ``Tensor.register_hook`` / ``register_post_accumulate_grad_hook``, wrapped at import
  so that an added or removed gradient hook on state records again: the environment
  key compares the state tensors' hook dicts (``_state.GradHooks``).
* ``Optimizer.zero_grad`` / ``Module.zero_grad``, wrapped while tracing to note the
  parameters whose ``.grad`` eager sets to None: ``_watch._FnWatch`` (a
  TorchFunctionMode, thread-local by nature) sees each ``.grad`` read made from their
  frames.
* ``RNNBase.flatten_parameters``, a no-op while tracing: ``_FnWatch`` / ``_RnnScope``
  answer its ``is_cuda`` question with False, so it leaves the weights unpacked.
* ``torch.compiler._is_compiling_flag``, set for the whole process while tracing: see
  ``is_compiling`` above.
* the fake-tensor logger's level, raised for the whole process: the filter above.

Not torch's, and kept where they are: the Python state the function reaches is put back
after its trace (``_snapshot.Snapshot``: the function's own changes, undone by design);
numpy's global generator is put back where the function drew from it (``_trace``: a
refused trace; numpy offers no per-thread view, so a draw another thread makes meanwhile
is taken for the function's); ``warnings.catch_warnings`` around a CUDA capture (Python's
filters are process-wide before 3.14) and ``torch._inductor.config.patch`` around a
``fuse=True`` compile (torch's config is process-wide; torch.compile does the same).

What another thread can still observe while a trace runs (its behaviour is stock):
``type(m)`` of a root module or plain object the trace reads (a subclass of its own
class, same name, same behaviour; ``m.__class__`` still answers the original class),
the ``__code__`` of the routed functions, one more entry in torch's global forward pre-hooks and in the fake-tensor
logger's filters, and the gradient hooks of a state tensor in a joint trace (wrapped:
the same hooks run).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ._compat import FakeTensor, disabled_torch_function_impl, get_current_dispatch_mode_stack
from ._compat import get_unwrapped as _get_unwrapped
from ._compat import is_functorch_wrapped_tensor as _is_wrapped
from ._compat import len_torch_dispatch_stack as _len_dispatch_stack
from ._compat import parametrize_cache as _cache

__all__ = ["tracing", "trace_scope", "track_reads", "untrack_reads", "READING", "watch_module_calls", "TRACE_HOOKS",
           "muted_hooks", "route_always", "unroute", "Route", "add_shared"]

_TLS = threading.local()  # .depth: the trace scopes this thread is inside


def tracing() -> bool:
    """Whether this thread traces (or runs a trace's autograd work): where replacements act."""
    if _TLS.__dict__.get("depth"):
        return True
    if not _len_dispatch_stack():
        return False
    return any(getattr(m, "_gt_trace", False) for m in get_current_dispatch_mode_stack())


# -- routing a function's code -----------------------------------------------------------------

_MARK = "__gtransform_route__"
# (compiled from text: the constant is replaced by the route tuple, which no literal can be)
_ROUTER: types.CodeType = next(c for c in compile(
    "def router(*args, **kwargs):\n"
    f"    route = {_MARK!r}  # (when: a predicate, replacement, original)\n"
    "    return (route[1] if route[0]() else route[2])(*args, **kwargs)\n",
    "<gtransform._patches router>", "exec",
).co_consts if isinstance(c, types.CodeType))


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """A new function object running ``fn``'s current code, with its globals and defaults."""
    c = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    c.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    c.__qualname__, c.__module__, c.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return c


class Route:
    """One function of torch routed to a replacement where ``when()`` is true.

    Args:
        owners: ``(object, name)`` pairs that hold the function; the first one names it.
        make: ``make(original) -> replacement``; ``original`` behaves as the unpatched function.
        when: the predicate (default: :func:`tracing`).
    """

    def __init__(self, owners: Sequence[Tuple[Any, str]], make: Callable[[Any], Any],
                 when: Callable[[], bool] = tracing):
        self.owners = [(o, n) for o, n in owners if o is not None]
        self.make = make
        self.when = when
        self.fn: Any = None
        self.code: Optional[types.CodeType] = None
        self.saved: List[Tuple[Any, str, Any]] = []

    def install(self) -> None:
        owner, name = self.owners[0]
        fn = getattr(owner, name, None)
        if fn is None:
            return
        if isinstance(fn, types.FunctionType) and not fn.__code__.co_freevars:
            orig = _copy(fn)
            kw: Dict[str, Any] = {"co_name": fn.__code__.co_name,
                                  "co_consts": tuple((self.when, self.make(orig), orig) if type(c) is str and c == _MARK
                                                     else c for c in _ROUTER.co_consts)}
            if hasattr(_ROUTER, "co_qualname"):
                kw["co_qualname"] = fn.__code__.co_qualname  # type: ignore[attr-defined]  # (3.11+)
            self.fn, self.saved = fn, [(fn, "__code__", fn.__code__)]
            self.code = _ROUTER.replace(**kw)
            fn.__code__ = self.code
            return
        # a C function (no code to swap) or one with a closure: replaced by name where it is held
        new, when = self.make(fn), self.when

        def routed(*args: Any, **kwargs: Any) -> Any:
            return (new if when() else fn)(*args, **kwargs)

        routed.__name__, routed.__qualname__, routed.__doc__ = name, getattr(fn, "__qualname__", name), fn.__doc__
        routed.__wrapped__ = fn  # type: ignore[attr-defined]
        for o, n in self.owners:
            if getattr(o, n, None) is fn:
                self.saved.append((o, n, fn))
                setattr(o, n, routed)

    def uninstall(self) -> None:
        for o, n, orig in reversed(self.saved):
            if n == "__code__":
                if o.__code__ is self.code:  # (unless someone changed it since)
                    o.__code__ = orig
            else:
                setattr(o, n, orig)
        self.saved, self.fn, self.code = [], None, None


_ALWAYS: Dict[int, Route] = {}


def route_always(fn: Any, make: Callable[[Any], Any], owners: Sequence[Tuple[Any, str]]) -> None:
    """Route ``fn`` (held by ``owners``) to ``make(original)`` in every thread until :func:`unroute`.

    For a change that must outlive a trace (``destroy_process_group``, see the module docstring).
    """
    with _LOCK:
        if id(fn) not in _ALWAYS:
            r = Route(owners, make, when=lambda: True)
            r.install()
            _ALWAYS[id(fn)] = r


def unroute(fn: Any) -> None:
    """Put back a function routed by :func:`route_always`."""
    with _LOCK:
        r = _ALWAYS.pop(id(fn), None)
        if r is not None:
            r.uninstall()


# -- the patches shared by traces ------------------------------------------------------------


def _compiling(orig: Any) -> Any:
    """``torch.compiler.is_compiling`` in a tracing thread: true, but where a fast-path check of torch asks."""
    def replacement() -> bool:
        # (nn.TransformerEncoder takes its nested-tensor path in eager, and skips it when compiling:
        # eager's answer there, so that the trace meets what eager does, or refuses it)
        return sys._getframe(2).f_globals.get("__name__") not in _FAST_PATH_MODULES  # (1: the router)
    return replacement


class _LogFilter(logging.Filter):
    """Drops a tracing thread's records (torch's fake-tensor errors, which reach the caller anyway)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not tracing()


class _Filter:
    def __init__(self, logger: str):
        self.logger = logger
        self.filter = _LogFilter()

    def install(self) -> None:
        logging.getLogger(self.logger).addFilter(self.filter)

    def uninstall(self) -> None:
        logging.getLogger(self.logger).removeFilter(self.filter)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OUR_DIR = os.path.dirname(__file__) + os.sep


def _as_number(to: Callable[[Any], Any], show: Callable[..., str]) -> Callable[[Any], Any]:
    """A symbolic size's ``repr`` / ``format`` where the user's code turns it into text (``f"b{n}"``, ``str(n)``).

    The number, as eager shows it: ``int(n)`` pins the symbolic trace's plan to this size (as
    any ``int()`` of a size does), where the symbol's name (``s4``) would have been text the
    plan hands every size. Text torch or gtransform make (messages, graph code) stays symbolic.
    """
    def make(orig: Any) -> Any:
        def replacement(self: Any, *spec: Any) -> str:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith((_TORCH_DIR, _OUR_DIR)):
                return orig(self, *spec)
            return show(to(self), *spec)
        return replacement
    return make


# modules whose code branches on torch.overrides.has_torch_function to pick a kernel, not to
# hand the call to a mode: nn.TransformerEncoder(Layer) and nn.MultiheadAttention's fast path
_FAST_PATH_MODULES = frozenset({"torch.nn.modules.transformer", "torch.nn.modules.activation"})
_DISABLED_TF = disabled_torch_function_impl


def _eager_has_torch_function(orig: Any) -> Any:
    """``has_torch_function`` as eager answers it, where torch's fast-path checks ask (a trace's modes left out).

    ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in eval mode without grad run
    one native kernel (``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``)
    unless ``has_torch_function(tensor_args)``; the trace's torch-function modes made it true,
    so the trace took the other path: other kernels than eager's, and for
    ``nn.TransformerEncoder`` with a padding mask no zeros at the padded positions (eager's
    nested-tensor path). Where those modules ask, the answer is eager's: whether an argument
    overrides ``__torch_function__``. Every other caller gets torch's answer.
    """
    def replacement(args: Any) -> bool:
        if sys._getframe(2).f_globals.get("__name__") not in _FAST_PATH_MODULES:
            return orig(args)  # type: ignore[no-any-return]
        for a in args:
            t = type(a)
            if t is torch.Tensor:
                continue
            f = getattr(t, "__torch_function__", None)
            if f is not None and getattr(f, "__func__", f) is not _DISABLED_TF:
                return True
        return False
    return replacement


_SHARED: List[Callable[[], List[Any]]] = []


def add_shared(factory: Callable[[], List[Any]]) -> None:
    """Add routes (made by ``factory`` when the first trace starts) to those installed while any trace runs.

    For the modules above this one that own a replacement (``_watch``'s RNG state and
    seeding routes), so that this module imports none of them.
    """
    _SHARED.append(factory)


def _shared() -> List[Any]:
    """The patches installed while any trace runs (see the module docstring)."""
    from . import _jiterator

    out: List[Any] = [Route([(torch.compiler, "is_compiling")], _compiling),
                      Route([(torch.overrides, "has_torch_function")], _eager_has_torch_function)]
    for cls, to in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
        out += [Route([(cls, "__repr__")], _as_number(to, repr)), Route([(cls, "__format__")], _as_number(to, format))]
    for factory in _SHARED:
        out += factory()
    if _jiterator.available():
        out.append(Route([(_jiterator.OWNER, "__call__")], _jiterator.caller))
    out.append(_Filter("torch._subclasses.fake_tensor"))
    return out


_LOCK = threading.RLock()
_DEPTH = [0]
_INSTALLED: List[Any] = []


def _enter() -> None:
    with _LOCK:
        if _DEPTH[0] == 0:
            try:
                for p in _shared():
                    p.install()
                    _INSTALLED.append(p)
            except BaseException:
                _leave_all()
                raise
        _DEPTH[0] += 1


def _leave_all() -> None:
    while _INSTALLED:
        _INSTALLED.pop().uninstall()


def _exit() -> None:
    with _LOCK:
        _DEPTH[0] -= 1
        if _DEPTH[0] == 0:
            _leave_all()


class trace_scope:
    """Entered by the tracing thread around a whole trace.

    Marks the thread as tracing, installs the shared patches (the first scope of the
    process does; the last one to exit puts the originals back, on errors too) and,
    on exit, takes the trace's placeholders out of torch's parametrize cache.
    """

    def __enter__(self) -> trace_scope:
        self.cache = parametrize_entries()
        _enter()
        _TLS.depth = _TLS.__dict__.get("depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            drop_parametrize_entries(self.cache)
        finally:
            _TLS.depth -= 1
            _exit()


# -- torch.nn.utils.parametrize's cache ----------------------------------------------------------


def parametrize_entries() -> Set[Any]:
    """The keys of torch's parametrize cache (``parametrize.cached()``) before a trace."""
    cache = _cache()
    return set(cache) if cache else set()


def _traced(v: Any) -> bool:
    """Whether ``v`` is a tensor made while tracing (a fake, or torch.func's wrapper of one)."""
    while isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) and _is_wrapped is not None \
            and _is_wrapped(v):
        v = _get_unwrapped(v)
    return isinstance(v, FakeTensor)


def drop_parametrize_entries(before: Set[Any]) -> None:
    """Take out the entries a trace put in torch's parametrize cache.

    Under ``parametrize.cached()`` a parametrized weight computed while tracing is put
    in the module-level cache: a placeholder that the eager first call (or any later code
    in the block) would read ("a tensor made while tracing it was used after the trace").
    Only the trace's own entries go: those another thread added meanwhile stay.
    """
    cache = _cache()
    if not cache:
        return
    for k in [k for k, v in list(cache.items()) if k not in before and _traced(v)]:
        cache.pop(k, None)


# -- attribute reads of root modules and objects (``_state.AttrReads``) --------------------------

READING = threading.local()  # .reads: the _state.AttrReads recording this thread's trace, if any
_TRACKERS: Dict[type, type] = {}
_SET_CLASS = object.__dict__["__class__"].__set__


def _user_line() -> str:
    """``file:line`` of the innermost frame outside torch and gtransform (an attribute set's)."""
    import traceback

    from ._errors import format_frame, user_frame

    return format_frame(user_frame(traceback.extract_stack()))


def _tracker(cls: type) -> type:
    """A subclass of ``cls`` that records the attributes a tracing thread reads.

    In other threads its ``__getattribute__`` is the class's own, and ``__class__``
    answers ``cls`` in every thread: only ``type(obj)`` tells the swap.
    """
    sub = _TRACKERS.get(cls)
    if sub is None:
        base_get: Any = cls.__getattribute__
        base_set: Any = cls.__setattr__

        def __getattribute__(self: Any, name: str) -> Any:
            reads = getattr(READING, "reads", None)
            if reads is not None:
                reads.names.setdefault(id(self), set()).add(name)
            return base_get(self, name)

        def __setattr__(self: Any, name: str, value: Any) -> None:
            reads = getattr(READING, "reads", None)
            if reads is not None:  # (where the function sets it: named if the change is refused)
                key = (id(base_get(self, "__dict__")), name)
                if key not in reads.set_at:
                    reads.set_at[key] = _user_line()
            base_set(self, name, value)

        def _get_class(self: Any) -> type:
            return cls

        def _set_class(self: Any, new: type) -> None:
            _SET_CLASS(self, new)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "__class__": property(_get_class, _set_class)})
        _TRACKERS[cls] = sub
    return sub


def track_reads(objs: Sequence[Any]) -> Tuple[List[Tuple[Any, type, type]], Set[int]]:
    """Give each of ``objs`` its tracking class (see :func:`_tracker`).

    Why a class swap: attribute reads of a module (``self.momentum``) go through no hook
    torch or Python offers per object; the class is the only per-object place. The swap is
    per object, so it cannot be per thread: another thread sees ``type(obj)`` changed while
    the trace runs, and nothing else (behaviour and ``obj.__class__`` are the original's).

    Returns:
        ``(swapped, untracked)``: ``(obj, class, tracking class)`` of each swapped object,
        and the ids of those whose class cannot be swapped (``__slots__``, a C type, a
        metaclass): all their plain attributes are then watched.
    """
    swapped: List[Tuple[Any, type, type]] = []
    untracked: Set[int] = set()
    for m in objs:
        cls = type(m)
        try:
            sub = _tracker(cls)
            _SET_CLASS(m, sub)
        except Exception:
            untracked.add(id(m))
            continue
        swapped.append((m, cls, sub))
    return swapped, untracked


def untrack_reads(swapped: Sequence[Tuple[Any, type, type]]) -> None:
    """Give the objects of :func:`track_reads` their classes back (unless the function gave one another)."""
    for m, cls, sub in swapped:
        if type(m) is sub:
            _SET_CLASS(m, cls)


# ids of the global forward pre-hooks that traces register while they run: not the user's,
# so not part of any signature (``_key._environment._compile_env``; another thread's trace may hold one)
TRACE_HOOKS: Set[int] = set()


class watch_module_calls:
    """While entered, ``seen(module, args)`` is called for every module called in a tracing thread.

    torch's global forward pre-hook, the supported mechanism; in other threads the hook
    returns at once (torch then takes the path it takes for any global hook: same results).
    """

    def __init__(self, seen: Callable[[Any, Any], None]):
        self.seen = seen
        self.handle: Any = None

    def _hook(self, m: Any, args: Any) -> None:
        if tracing():
            self.seen(m, args)

    def __enter__(self) -> watch_module_calls:
        try:
            self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)
            TRACE_HOOKS.add(self.handle.id)
        except Exception:  # pragma: no cover - a torch without global module hooks
            self.handle = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            TRACE_HOOKS.discard(self.handle.id)
            self.handle = None


# -- gradient hooks of state in the joint trace ----------------------------------------------------


class _Muted:
    """A gradient hook that does nothing in a tracing thread, and runs ``fn`` elsewhere."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return None
        return self.fn(*args, **kwargs)


class muted_hooks:
    """The gradient hooks on ``tensors`` do not run in tracing threads while entered.

    The joint trace differentiates state tensors that carry the caller's hooks
    (``p.register_hook``); those run where eager runs them, when the recording's gradient
    reaches the parameter, and must not be traced into the recorded backward as well. The
    hooks stay registered (another thread's backward runs them): each is wrapped, and put
    back on exit.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = tensors
        self.saved: List[Tuple[Dict[Any, Any], Any, Any, _Muted]] = []

    def __enter__(self) -> muted_hooks:
        for t in self.tensors:
            d = getattr(t, "_backward_hooks", None)
            if not d:
                continue
            for k, fn in list(d.items()):
                w = _Muted(fn)
                d[k] = w
                self.saved.append((d, k, fn, w))
        return self

    def __exit__(self, *exc: Any) -> None:
        for d, k, fn, w in reversed(self.saved):
            if d.get(k) is w:
                d[k] = fn
        self.saved = []

"""State: the tensors a function reaches without taking them as arguments.

Module parameters and buffers, optimizer state, caches, closed-over tensors.
The rule (DESIGN semantics 10):

* The trace never touches state: every real tensor an operation meets while
  tracing is swapped for a fake (see ``_watch``), and becomes an input of the
  recorded graph. Each call resolves the state again (``StateBinding``) and
  hands it to the recording like an argument, so reads see current values,
  in-place updates happen once per call, and a state tensor that was replaced
  (``.data =``, ``module.to()``, ``load_state_dict(assign=True)``, a new
  ``nn.Parameter``) is seen: a new layout is a new signature, a new address a
  new recording.
* Python state the function reaches (modules, optimizers, closed-over lists,
  dicts and objects: its *roots*) is snapshotted before each trace and put
  back after it (:class:`Snapshot`), so a trace has no visible effect.
  Tensors made while tracing that were left in that state (``p.grad`` set by
  ``backward()``, ``self.cache = ...``, ``optimizer.state``) are *escapes*:
  the recording returns them as extra outputs and writes them back after
  every replay, as eager would have left them. Escapes a replay cannot
  reproduce (an ``append`` to a list, a new object holding a traced tensor:
  ``memo["b"] = Box(t)``, a Hugging Face ``DynamicCache`` grown) and Python
  numbers changed by the function are errors. A failed trace puts the roots
  back whole, Python values included, so that the call, run eagerly or
  refused, finds them as the caller left them.
* What else decides what a module computes is part of the signature, read on every
  call by ``_key._environment.env_key_fn`` from the roots found here: every root
  module's ``training`` flag and hooks, and every root optimizer's Python
  hyperparameters (``lr``...), parameter groups and state dict (a changed one is traced
  again after an eager call, which recreates lazily made state).
"""

from __future__ import annotations

import collections
import enum
import functools
import inspect
import operator
import os
import random
import re
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ._compat import LR_SCHEDULER_LEGACY_BASE
from ._compat import get_unwrapped as _get_unwrapped
from ._compat import is_functorch_wrapped_tensor as _is_wrapped
from ._errors import GraphifyError, is_library_file
from ._patches import READING as _READING
from ._patches import track_reads, untrack_reads, watch_module_calls

__all__ = ["Root", "find_roots", "Snapshot", "Slot", "StateIndex", "EscapeWriter", "AttrReads", "functorch_base"]

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer
# torch objects that are plain Python state the function may step: an LR scheduler's
# last_epoch and _last_lr (a scheduler stepped inside the function is seen, not frozen)
_SCHEDULERS = tuple(c for c in (getattr(torch.optim.lr_scheduler, "LRScheduler", None),
                                LR_SCHEDULER_LEGACY_BASE,
                                getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None))
                    if isinstance(c, type))
# ... and a GradScaler, which makes its scale tensor lazily (on its first scale()): the
# trace's tensor is then written back, not left behind in it (a failed trace leaves no half-state)
_TORCH_STATE = _SCHEDULERS + tuple(c for c in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                                               getattr(getattr(torch.cuda, "amp", None), "GradScaler", None))
                                   if isinstance(c, type))
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# Python values whose change by a trace is seen (undone in modules and objects; a change on
# every call refused): numbers, and flags and names (`self.initialized = True`, a mode string)
_NUMBERS = (int, float, bool, str, type(None), complex, bytes)
_MAX_CONTAINER = 4096
# a module's own tables, covered as parameters, buffers and submodules
_MODULE_DICTS = frozenset(("_parameters", "_buffers", "_modules"))
# what every nn.Module has in its __dict__ (hook dicts, flags): watched apart, or not at all
_MODULE_ATTRS = frozenset(vars(torch.nn.Module()))


@dataclass
class Root:
    """An object the function reaches: a module, optimizer, container or plain object."""

    name: str
    obj: Any
    slot: Any = None  # a tensor's Slot where the function finds it (a global, a closure cell)
    # a module, optimizer, container or plain object's global or closure cell (see env_key_fn:
    # `opt = torch.optim.Adam(...)` rebinding the name between calls is seen)
    binding: Any = None


def _is_library_code(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None:
        return True
    path = os.path.abspath(code.co_filename)
    return path.startswith(_TORCH_DIR) or path.startswith(_PKG_DIR) or "site-packages" in path


def _code_names(code: types.CodeType) -> Set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _candidates(fn: Any, depth: int, out: List[Tuple[str, Any]], seen: Set[int],
                where: Optional[Dict[int, Any]] = None) -> None:
    """Objects ``fn`` reaches directly: bound self, closure cells, referenced globals, defaults."""
    if id(fn) in seen or depth > 3:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        for i, a in enumerate(fn.args):
            out.append((f"partial.args[{i}]", a))
        for k, v in (fn.keywords or {}).items():
            out.append((f"partial.{k}", v))
        _candidates(fn.func, depth + 1, out, seen, where)
        return
    if isinstance(fn, _Module):
        out.append(("module", fn))
        return
    if inspect.ismethod(fn):
        out.append(("self", fn.__self__))
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        call = next((c.__dict__["__call__"] for c in type(fn).__mro__ if "__call__" in c.__dict__), None) if callable(fn) else None
        if call is not None and not isinstance(fn, type) and hasattr(fn, "__dict__"):
            out.append(("self", fn))
            for v in list(vars(fn).values()):  # functions it keeps (self.fn = lambda x: x * W)
                if isinstance(v, types.FunctionType):
                    _candidates(v, depth + 1, out, seen, where)
            fn = call
        else:
            return
    wrapped = getattr(fn, "__wrapped__", None)  # functools.lru_cache / cache, a C-level wrapper
    if not isinstance(fn, types.FunctionType) and wrapped is not None and wrapped is not fn:
        _candidates(wrapped, depth + 1, out, seen, where)
        return
    if not isinstance(fn, types.FunctionType):  # a C slot (__call__ of a C type), a builtin
        return
    if _is_library_code(fn) and depth > 0:
        return
    code = fn.__code__
    if fn.__closure__:
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            out.append((name, v))
            if where is not None and not isinstance(v, (types.FunctionType, type, types.ModuleType)):
                where.setdefault(id(v), Slot("attr", cell, "cell_contents", name))
            if isinstance(v, types.FunctionType):
                _candidates(v, depth + 1, out, seen, where)
    g = fn.__globals__
    names = _code_names(code)
    for name in names:
        if name in g:
            v = g[name]
            if isinstance(v, (types.ModuleType, type)):
                # `mymod.W`, `Cfg.scale`: a tensor attribute of one of the user's own Python
                # modules or classes is state, re-read there on every call
                if where is not None and _users_namespace(v):
                    for attr in names:
                        x = v.__dict__.get(attr)
                        if isinstance(x, (torch.Tensor, _Module, _Optimizer, list, dict, tuple)) or _plain_object(x):
                            # (also a model and its optimizer kept on a registry class, `Holder.opt`)
                            out.append((f"{name}.{attr}", x))
                            where.setdefault(id(x), Slot("attr", v, attr, f"{name}.{attr}"))
                        elif isinstance(x, (staticmethod, classmethod)) or isinstance(x, types.FunctionType):
                            # Helper.mul(x): the function's own globals
                            _candidates(getattr(x, "__func__", x), depth + 1, out, seen, where)
                continue
            out.append((name, v))
            if where is not None and not isinstance(v, types.FunctionType):
                where.setdefault(id(v), Slot("item", g, name, name))
            if isinstance(v, types.FunctionType):
                _candidates(v, depth + 1, out, seen, where)
    for i, d in enumerate(fn.__defaults__ or ()):
        out.append((f"default[{i}]", d))
    for k, d in (fn.__kwdefaults__ or {}).items():
        out.append((k, d))


def _users_namespace(v: Any) -> bool:
    """Whether ``v`` (a Python module or a class) is the user's own, not a library's."""
    if isinstance(v, types.ModuleType):
        if v.__name__ in sys.builtin_module_names:
            return False
        path = getattr(v, "__file__", None)
        return path is None or not is_library_file(path)  # None: made at run time (types.ModuleType)
    mod = getattr(v, "__module__", "") or ""
    if mod.startswith(("torch", "gtransform", "builtins", "typing", "collections")):
        return False
    m = sys.modules.get(mod)
    path = getattr(m, "__file__", None) if m is not None else None
    return path is None or not is_library_file(path)


def _plain_object(v: Any) -> bool:
    if isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor)):
        return False
    if not hasattr(v, "__dict__"):
        return False
    if isinstance(v, _TORCH_STATE):
        return True
    mod = type(v).__module__ or ""
    return not (mod.startswith("torch") or mod.startswith("gtransform") or mod == "builtins")


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


# How deep find_roots follows containers and plain objects: a trainer's
# `self.state.nets["g"]` (a module three levels below `self`) is state like `self.net`;
# an optimizer it does not reach would keep what a trace made (its lazily made moments).
_MAX_DEPTH = 4
# attributes of torch's objects that the calls outside the function rebind: not a binding the
# signature checks (GradScaler's per-optimizer states, a new dict every scaler.update())
_EPHEMERAL: Dict[type, Tuple[str, ...]] = {c: ("_per_optimizer_states",) for c in _TORCH_STATE
                                          if c.__name__ == "GradScaler"}
# the mutable sequences of state: a list, or a deque (a replay buffer) read by position
_SEQUENCES = (list, collections.deque)


def find_roots(fn: Any, extra: Sequence[Tuple[str, Any]] = ()) -> List[Root]:
    """Modules, optimizers, containers and plain objects that ``fn`` reaches (``_MAX_DEPTH`` levels).

    Args:
        fn: the function.
        extra: more ``(name, object)`` candidates, e.g. non-tensor arguments
            (a module passed as ``self``).
    """
    cands: List[Tuple[str, Any]] = []
    where: Dict[int, Any] = {}  # what is bound to a global or a closure cell (tensors: re-read there every call)
    _candidates(fn, 0, cands, set(), where)
    cands.extend(x for x in extra if isinstance(x[1], (_Module, _Optimizer)) or _plain_object(x[1]))
    roots: List[Root] = []
    seen: Set[int] = set()

    def add(name: str, v: Any, depth: int, at: Any = None) -> None:
        """``at``: where ``v`` was found inside a container or object (a Slot): its binding there."""
        if id(v) in seen or v is None or depth > _MAX_DEPTH:
            return
        bound = where.get(id(v)) if depth == 0 else at
        if isinstance(v, _Module):
            seen.add(id(v))
            roots.append(Root(name, v, binding=bound))
        elif isinstance(v, _Optimizer):
            seen.add(id(v))
            roots.append(Root(name, v, binding=bound))
            for attr, x in list(vars(v).items()):  # (one it wraps: SAM's base_optimizer, Lookahead's)
                if isinstance(x, _Optimizer):
                    add(f"{name}.{attr}", x, depth + 1, Slot("attr", v, attr, f"{name}.{attr}"))
        elif isinstance(v, torch.Tensor):
            seen.add(id(v))
            roots.append(Root(name, v, bound))
        elif isinstance(v, _SEQUENCES + (dict,)) and len(v) <= _MAX_CONTAINER:
            seen.add(id(v))
            roots.append(Root(name, v, binding=bound))
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(x, (_Module, _Optimizer, list, dict, tuple, torch.Tensor)) or _plain_object(x):
                    # (a module or optimizer put in its place, `reg["head"] = ...`, is another binding)
                    at = None if isinstance(x, torch.Tensor) else Slot("item", v, k, f"{name}[{k!r}]")
                    add(f"{name}[{k!r}]", x, depth + 1, at)
        elif isinstance(v, tuple) and len(v) <= _MAX_CONTAINER:
            seen.add(id(v))
            for k, x in enumerate(v):
                # (read again through where the tuple is bound, a dict's entry, a global: rebinding
                # the tuple, `state["hc"] = (h, c)`, is seen; the tuple itself never changes)
                add(f"{name}[{k}]", x, depth + 1, Slot("path", bound, k, f"{name}[{k}]") if bound is not None else None)
        elif _plain_object(v):
            seen.add(id(v))
            roots.append(Root(name, v, binding=bound))
            ephemeral = _EPHEMERAL.get(type(v), ())
            for k, x in list(vars(v).items()):
                if isinstance(x, (_Module, _Optimizer, list, dict, tuple, torch.Tensor)) or _plain_object(x):
                    # (what is bound there is watched, except where the calls outside rebind it:
                    # still state, whose changes by the trace are seen and undone)
                    at = None if isinstance(x, torch.Tensor) or k in ephemeral else Slot("attr", v, k, f"{name}.{k}")
                    add(f"{name}.{k}", x, depth + 1, at)

    for name, v in cands:
        add(name, v, 0)
    # what the modules themselves reach: plain containers and objects among their
    # attributes (`self.cache = {}`, `self.masks = [...]`, a SimpleNamespace), and the
    # globals and closures of user-written forward methods (a global mask): tensors
    # there are state (re-read where they are on every call) and the trace's changes
    # there are seen (escapes written back, or refused, and undone after the trace)
    for r in list(roots):
        if not isinstance(r.obj, _Module):
            continue
        for path, m in root_modules([r]):
            for k, v in vars(m).items():
                if k in _MODULE_DICTS:
                    continue
                if type(v) in (list, dict, tuple) or _plain_object(v) or isinstance(v, _Optimizer):
                    # (an optimizer the module keeps, `self.opt` of a graphified train_step method)
                    add(f"{path}.{k}", v, 1, Slot("attr", m, k, f"{path}.{k}"))
            # hooks' closures and globals (`acts.append(o)` in a forward hook): what they
            # store there is seen like what the function stores
            for hd in (m._forward_hooks, m._forward_pre_hooks):
                for h in list(hd.values()):
                    if id(h) not in seen:
                        seen.add(id(h))
                        hmore: List[Tuple[str, Any]] = []
                        _candidates(h, 1, hmore, set(), where)
                        for name, v in hmore:
                            if type(v) in (list, dict) or _plain_object(v):
                                add(f"{path} hook: {name}", v, 1)
            # gradient hooks' closures (an optimizer stepped in backward from
            # register_post_accumulate_grad_hook): the optimizers and containers there are state
            for prm in m._parameters.values():
                if prm is None:
                    continue
                hook_dicts: List[Any] = [getattr(prm, "_post_accumulate_grad_hooks", None),
                                         getattr(prm, "_backward_hooks", None)]
                for hd in hook_dicts:
                    for h in list((hd or {}).values()):
                        if id(h) in seen:
                            continue
                        seen.add(id(h))
                        gmore: List[Tuple[str, Any]] = []
                        _candidates(h, 1, gmore, set(), where)
                        for name, v in gmore:
                            if isinstance(v, (_Module, _Optimizer)) or type(v) in (list, dict) or _plain_object(v):
                                add(f"{path} gradient hook: {name}", v, 1)
            fwd = type(m).__dict__.get("forward")
            if isinstance(fwd, types.FunctionType) and not _is_library_code(fwd) and id(type(m)) not in seen:
                seen.add(id(type(m)))
                more: List[Tuple[str, Any]] = []
                _candidates(fwd, 1, more, set(), where)
                for name, v in more:
                    if isinstance(v, torch.Tensor):
                        add(name, v, 0)  # re-read where the forward finds it (a global)
                    elif type(v) in (list, dict) or _plain_object(v):
                        add(name, v, 1)
    return roots


class GeneratorGuard:
    """The caller's own ``torch.Generator`` objects the function reaches, checked around a trace.

    A ``g.manual_seed(...)`` or ``g.set_state(...)`` inside the function happens once,
    while tracing; eager does it on every call (the same numbers every call), a replay
    never (new numbers). Such a change is undone and refused. (The default generators
    are watched by ``_watch._no_seeding``.)
    """

    def __init__(self, fn: Any, extra: Sequence[Tuple[str, Any]], roots: Sequence[Root]):
        found: List[Tuple[str, torch.Generator]] = []
        cands: List[Tuple[str, Any]] = []
        _candidates(fn, 0, cands, set())
        cands += list(extra)
        for r in roots:
            obj = r.obj
            items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list)
                     else vars(obj).items() if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor) else ())
            cands += [(f"{r.name}.{k}" if hasattr(obj, "__dict__") else f"{r.name}[{k!r}]", v) for k, v in items]
        self.defaults = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.defaults += list(torch.cuda.default_generators)
        seen: Set[int] = set()
        for name, v in cands:
            _generators_in(name, v, 0, seen, found)
        # host generators the function reaches (random.Random, numpy's Generator and RandomState):
        # their numbers would be constants of the recording (see _trace._host_rng_state)
        self.host: List[Tuple[str, Any]] = [(name, g) for name, g in found if _is_host_rng(g)]
        found = [(name, g) for name, g in found if isinstance(g, torch.Generator) and all(g is not d for d in self.defaults)]
        self.saved = [(name, g, g.initial_seed(), g.get_state()) for name, g in found]

    def refuse_unknown(self, desc: str, used: Sequence[Tuple[torch.Generator, str]]) -> None:
        """Refuse a generator the random ops drew from that is none of the caller's (made inside the function).

        ``used``: each generator the trace's random ops took, with the line of its first draw.
        (The ops see a new Python object for the caller's own generator: it is matched by a
        probe of the seed, set back at once.)
        """
        known = self.defaults + [g for _, g, _, _ in self.saved]
        for gen, line in used:
            if not any(_same_generator(gen, k) for k in known):
                raise GraphifyError(
                    f"{desc}: a random op draws from a torch.Generator that the function makes "
                    f"(torch.Generator().manual_seed(...) inside it), or reaches where graphify does not look.\n"
                    f"  at {line}\n"
                    "Why: the function runs once, while tracing; eager makes a new generator on every "
                    "call (the same numbers every call), a recording would go on drawing from the one "
                    "made while tracing (new numbers every call).\n"
                    "Fix: make the generator outside the function and pass it as an argument, seeding it "
                    "before each call where the same numbers are wanted (g.manual_seed(0); f(x, g)); or "
                    "draw the numbers outside and pass them in."
                )

    def check(self, desc: str, raise_: bool) -> None:
        """Undo a seed or state the trace set on a generator; refuse it where ``raise_``."""
        changed = []
        for name, g, seed, state in self.saved:
            if g.initial_seed() != seed or not torch.equal(g.get_state(), state):
                g.set_state(state)
                changed.append(name)
        if changed and raise_:
            raise GraphifyError(
                f"{desc}: the function seeds or sets the state of the torch.Generator {changed[0]} "
                "(g.manual_seed(...), g.set_state(...)) inside it.\n"
                "Why: a recording draws fresh numbers from the generator's current state on every "
                "replay; a seed set inside the function happens once, while tracing, so eager would "
                "draw the same numbers on every call and the recording different ones.\n"
                f"Fix: seed {changed[0]} outside the function, before each call where the same numbers "
                "are wanted (g.manual_seed(5); f(x)), or draw them outside and pass them in."
            )


def _is_host_rng(v: Any) -> bool:
    """A Python or numpy random generator object (not a module's global one)."""
    if isinstance(v, random.Random):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(v, (np.random.Generator, np.random.RandomState))


def _generators_in(name: str, v: Any, depth: int, seen: Set[int], out: List[Tuple[str, Any]]) -> None:
    """The generators in ``v`` (torch's, Python's, numpy's): itself, or in its containers, attributes and submodules (3 levels)."""
    if id(v) in seen or depth > 3:
        return
    seen.add(id(v))
    if isinstance(v, torch.Generator) or _is_host_rng(v):
        out.append((name, v))
        return
    if isinstance(v, _Module):
        for sub_name, sub in v.named_modules():
            for k, x in vars(sub).items():
                if isinstance(x, torch.Generator) or _is_host_rng(x) or (
                        k[:1] != "_" and (_plain_object(x) or type(x) in (list, tuple, dict))):
                    _generators_in(f"{name}.{sub_name}.{k}" if sub_name else f"{name}.{k}", x, depth + 1, seen, out)
        return
    if type(v) in (list, tuple):
        items: Any = enumerate(v)
    elif type(v) is dict:
        items = v.items()
    elif _plain_object(v):
        items = vars(v).items()
    else:
        return
    for k, x in list(items):
        _generators_in(f"{name}[{k!r}]" if type(v) in (list, tuple, dict) else f"{name}.{k}", x, depth + 1, seen, out)


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether ``a`` and ``b`` are one generator (two Python objects of one: a probe of ``b``'s seed)."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    state = b.get_state()
    probe = (b.initial_seed() ^ 0x5DEECE66D) & 0x7FFFFFFFFFFFFFFF or 1
    b.manual_seed(probe)
    try:
        return a.initial_seed() == probe
    finally:
        b.set_state(state)


class UnseenOptimizers:
    """While a trace runs: an optimizer the function steps that is none of the roots is refused before it steps.

    Its lazily made state (momentum, Adam's moments) would be made while tracing, left in
    ``opt.state`` as placeholders that no snapshot puts back (the optimizer broken for eager
    use too). A global step pre-hook (torch's public one) that acts in the tracing thread only.
    """

    def __init__(self, roots: Sequence[Root], desc: str):
        self.known = {id(r.obj) for r in roots if isinstance(r.obj, _Optimizer)}
        self.desc = desc
        self.handle: Any = None

    def __enter__(self) -> UnseenOptimizers:
        self.thread = threading.get_ident()
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.handle = register_optimizer_step_pre_hook(self._check)
        except ImportError:  # pragma: no cover - an older torch: not watched
            self.handle = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()

    def _check(self, opt: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self.thread or id(opt) in self.known:
            return
        raise GraphifyError(
            f"{self.desc}: the function steps a {type(opt).__name__} optimizer that gtransform does not find "
            "among the objects it reaches.\n"
            "Why: the state an optimizer makes on its first step (momentum, Adam's moments) would be made "
            "while tracing, out of gtransform's sight, and a replay would not update it.\n"
            "Fix: let the function reach it through a closure, a global name, an argument (a module or "
            "object holding it), or an attribute of a module or object it reaches, at most 4 levels deep "
            "(not through a weakref or a cached factory function); or keep opt.step() outside."
        )


def root_modules(roots: Sequence[Root]) -> List[Tuple[str, _Module]]:
    """Every module under the roots, with its dotted name (each once)."""
    out: List[Tuple[str, _Module]] = []
    seen: Set[int] = set()
    for r in roots:
        if isinstance(r.obj, _Module):
            for n, m in r.obj.named_modules(remove_duplicate=False):
                if id(m) not in seen:
                    seen.add(id(m))
                    out.append((f"{r.name}.{n}" if n else r.name, m))
    return out


# -- snapshot and escapes ---------------------------------------------------------------


@dataclass
class Slot:
    """A place in Python state that holds a tensor: ``kind`` is "grad", "attr", "item" or "path".

    "path": item ``key`` of the tuple that the Slot ``obj`` holds (a tuple is immutable: the
    place is where the tuple is bound, ``state["hc"] = (h, c)`` rebinds it).
    """

    kind: str
    obj: Any
    key: Any
    path: str

    def get(self) -> Any:
        if self.kind == "grad":
            return self.obj.grad
        if self.kind == "attr":
            return getattr(self.obj, self.key, None)
        try:
            if self.kind == "path":
                return self.obj.get()[self.key]
            return self.obj[self.key]
        except (KeyError, IndexError, TypeError):
            return None

    @property
    def value(self) -> Any:
        """What the place holds now (see ``_key._environment``: a binding inside a tuple)."""
        return self.get()

    def set(self, value: Any) -> None:
        if self.kind == "grad":
            self.obj.grad = value
        elif self.kind == "attr":
            setattr(self.obj, self.key, value)
        elif self.kind == "path":
            raise TypeError(f"{self.path} is inside a tuple: it cannot be set")
        else:
            self.obj[self.key] = value


@dataclass
class Change:
    """A Python number in reachable state that the function changed."""

    path: str
    old: Any
    new: Any
    where: Any = None  # the dict it lives in (an object's __dict__, a param group, a dict)
    key: Any = None
    model: bool = False  # a module attribute or an optimizer hyperparameter (not a plain container)
    owner: Any = None  # the module whose attribute it is

    def undo(self) -> None:
        """Put the old value back, unless something else changed it since."""
        if self.where is None:
            return
        where = self.where
        if isinstance(where, list):  # (a list's item: `cnt[0] += 1`; or all of it: a slice)
            k = self.key
            cur = where[k] if isinstance(k, slice) or -len(where) <= k < len(where) else _MISSING
        else:
            cur = where.get(self.key, _MISSING)
        if cur is self.new or (not isinstance(cur, torch.Tensor) and not isinstance(self.new, torch.Tensor)
                               and cur == self.new):
            if self.old is _MISSING:  # (made by the trace: taken away)
                del where[self.key]
            else:
                where[self.key] = self.old

    @property
    def made(self) -> bool:
        """Something the trace made where there was nothing (an attribute, hooks): set-up, not a count."""
        return self.old is _MISSING

    @property
    def rebinds(self) -> bool:
        """A tensor slot bound to another existing tensor (``self.a, self.b = self.b, self.a``)."""
        return isinstance(self.new, torch.Tensor)

    def text(self) -> str:
        if self.rebinds:
            return f"{self.path}: bound to another tensor"
        if self.old is _MISSING:
            return f"{self.path}: made ({self.new!r})"
        return f"{self.path}: {self.old!r} -> {self.new!r}"


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class HookChange(Change):
    """Hooks the trace registered on a module (a library installing its hooks on first use).

    Undone with the trace's other Python changes (Hugging Face's output capturing installs
    forward hooks and marks the model with an attribute the undo takes away: the eager
    first call installed them again, and every layer's output was captured twice).
    """

    def undo(self) -> None:
        module, added = self.owner, self.key
        for name in _HOOK_DICTS:
            d = getattr(module, name, None)
            if isinstance(d, dict):
                for k in added:
                    d.pop(k, None)

    @property
    def made(self) -> bool:
        return True

    def text(self) -> str:
        return f"{self.path}: {len(self.key)} hook(s) registered"


def _hooks_of(m: _Module) -> Dict[str, Set[Any]]:
    """The keys of a module's hook dicts (see HookChange)."""
    return {n: set(d) for n in _HOOK_DICTS if isinstance(d := getattr(m, n, None), dict)}


@dataclass
class ScanResult:
    escapes: List[Tuple[Slot, Any]] = field(default_factory=list)  # (slot, fake)
    appended: List[str] = field(default_factory=list)  # paths of containers a fake was appended to
    sites: List[str] = field(default_factory=list)  # where those tensors were made
    grown: List[str] = field(default_factory=list)  # the containers appended to (for messages)
    # new objects holding a fake stored in a slot (`memo["b"] = Box(t)`): (slot path, path of the
    # fake inside, the object's type name), and where each fake was made
    stored: List[Tuple[str, str, str]] = field(default_factory=list)
    stored_sites: List[str] = field(default_factory=list)
    changes: List[Change] = field(default_factory=list)

    def note_stored(self, path: str, now: Any, old: Any, is_fake: Callable[[Any], bool],
                    appended_to: Optional[str] = None) -> None:
        """``now`` is in ``path`` after the trace (``old`` before): a new object holding a fake?

        A bare fake is an escape (written back after every call); a new object around one
        (``Box(t)``, ``[t]``, ``(t,)``, ``SimpleNamespace(t=t)``) is made once, while tracing,
        and no replay can make another.
        """
        if now is old or is_fake(now):
            return
        found = _inside(now, is_fake)
        if found is None:
            return
        inner, fake = found
        site = fake.__dict__.get("_gt_site", "")
        if appended_to is not None:
            self.appended.append(f"{path} (appended: a new {type(now).__name__} holding a tensor made inside it, "
                                 f"{path}{inner})")
            self.sites.append(site)
            self.grown.append(appended_to)
        else:
            self.stored.append((path, f"{path}{inner}", type(now).__name__))
            self.stored_sites.append(site)


class BindingChange(Change):
    """A Python number bound to a name the function reaches.

    ``global step; step += 1``, a closure's ``nonlocal`` count, ``Trainer.global_step += 1``
    on the user's class.
    """

    def undo(self) -> None:
        where, key = self.where, self.key
        cur = where.get(key, _MISSING) if isinstance(where, dict) else getattr(where, key, _MISSING)
        if cur is self.new or cur == self.new:
            if isinstance(where, dict):
                where[key] = self.old
            else:
                setattr(where, key, self.old)


def named_values(fn: Any) -> List[Tuple[str, Any, str, Any]]:
    """``(path, where, key, value)`` of each name ``fn`` reaches: its closure cells and globals.

    And those of the functions it names (3 levels; functools caches followed to the function
    they wrap), and the attributes of the user's own classes and modules it names.
    """
    out: List[Tuple[str, Any, str, Any]] = []
    seen: Set[int] = set()

    def walk(f: Any, depth: int) -> None:
        if depth > 3 or id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            walk(f.func, depth + 1)
            return
        if inspect.ismethod(f):
            f = f.__func__
        wrapped = getattr(f, "__wrapped__", None)
        if not isinstance(f, types.FunctionType) and wrapped is not None:
            walk(wrapped, depth + 1)  # (functools.lru_cache: a C-level wrapper)
            return
        if not isinstance(f, types.FunctionType) or (depth > 0 and _is_library_code(f)):
            return
        code = f.__code__
        names = _code_names(code)
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            out.append((name, cell, "cell_contents", v))
            if callable(v):
                walk(v, depth + 1)
        g = f.__globals__
        for name in names:
            if name not in g:
                continue
            v = g[name]
            if isinstance(v, (type, types.ModuleType)):
                if _users_namespace(v):
                    out.extend((f"{name}.{a}", v, a, v.__dict__[a]) for a in names if a in v.__dict__)
                continue
            out.append((name, g, name, v))
            if callable(v):
                walk(v, depth + 1)

    walk(fn, 0)
    return out


def number_bindings(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Tuple[str, Any, str]]:
    """Names bound to Python numbers among ``named`` (:func:`named_values` of the function): ``(path, where, key)``.

    A trace that changes one (a counter: the trace's increment happens once, a replay's never)
    is seen as any other Python change the trace makes (see Snapshot.scan).
    """
    return [(path, where, key) for path, where, key, v in named if type(v) in _COUNTS]


def iterators(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Tuple[str, Any]]:
    """The iterators among ``named`` (``it = iter(loader)``, a generator): ``(path, iterator)``."""
    out: List[Tuple[str, Any]] = []
    for path, _where, _key, v in named:
        if hasattr(type(v), "__next__") and not isinstance(v, torch.Tensor) and all(v is not o for _p, o in out):
            out.append((path, v))
    return out


def iterator_position(it: Any) -> Any:
    """How far ``it`` has gone, in a form that changes when an item is taken (None: cannot say)."""
    if isinstance(it, types.GeneratorType):
        frame = it.gi_frame
        return None if frame is None else ("gen", frame.f_lasti, tuple(map(id, frame.f_locals.values())))
    n = getattr(it, "_num_yielded", None)  # (a DataLoader's iterator)
    if isinstance(n, int):
        return ("loader", n)
    try:
        red = it.__reduce__()
        if isinstance(red, tuple) and len(red) >= 3 and isinstance(red[2], int):
            return ("seq", red[2])  # (a list's, tuple's, range's iterator: its index)
    except Exception:
        pass
    try:
        return ("hint", operator.length_hint(it, -1))
    except Exception:  # pragma: no cover
        return None


def function_caches(named: Sequence[Tuple[str, Any, str, Any]]) -> List[Any]:
    """The ``functools.lru_cache`` / ``functools.cache`` functions among ``named`` (a causal mask, a RoPE table).

    A call while tracing stores a placeholder there, which the next eager call would get back:
    a cache that grew while tracing is emptied after it (see Snapshot.restore).
    """
    out: List[Any] = []
    for _path, _where, _key, v in named:
        if callable(getattr(v, "cache_clear", None)) and callable(getattr(v, "cache_info", None)) and \
                all(v is not o for o in out):
            out.append(v)
    return out


_COUNTS = (int, float, bool)


class Snapshot:
    """Shallow copies of the roots' Python state, to undo what a trace did to it.

    Args:
        roots: what the function reaches.
        bindings: names bound to Python numbers it reaches (see :func:`number_bindings`).
        caches: the functools caches it reaches (see :func:`function_caches`).
    """

    def __init__(self, roots: Sequence[Root], bindings: Sequence[Tuple[str, Any, str]] = (), caches: Sequence[Any] = ()):
        self.bindings = [(path, where, key, _bound_value(where, key)) for path, where, key in bindings]
        self.caches = [(c, _cache_size(c)) for c in caches]  # (see function_caches)
        self.flags: List[Tuple[torch.Tensor, bool]] = []  # the parameters' requires_grad
        self.items: List[Tuple[str, str, Any, Any]] = []  # (kind, path, obj, saved)
        seen: Set[int] = set()
        for r in roots:
            obj = r.obj
            if isinstance(obj, _Module):
                for path, m in root_modules([r]):
                    if id(m) in seen:
                        continue
                    seen.add(id(m))
                    grads = {n: leaf_grad(p) for n, p in m._parameters.items() if p is not None}
                    self.items.append(("module", path, m, (dict(m.__dict__), dict(m._parameters), dict(m._buffers),
                                                           dict(m._modules), grads, _hooks_of(m))))
                    # (requires_grad_ the function calls on its parameters: the eager first call makes it)
                    self.flags += [(p, p.requires_grad) for p in m._parameters.values() if p is not None]
            elif isinstance(obj, _Optimizer):
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                st = {p: (s, dict(s)) for p, s in obj.state.items()}
                groups = [(g, dict(g)) for g in obj.param_groups]
                # the parameters' .grad: a trace's zero_grad() sets them to None, and a
                # function reaching them through the optimizer only (`opt.step();
                # opt.zero_grad()`) has no module here to give them back: its eager first
                # call then stepped nothing and made no optimizer state
                pgrads = [(p, p.grad) for g in obj.param_groups for p in g["params"] if isinstance(p, torch.Tensor)]
                self.items.append(("optimizer", r.name, obj, (dict(obj.__dict__), st, groups, pgrads)))
            elif isinstance(obj, torch.Tensor):
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                self.items.append(("tensor", r.name, obj, (leaf_grad(obj), r.slot)))
            elif isinstance(obj, _SEQUENCES):
                seen.add(id(obj))
                self.items.append(("list", r.name, obj, list(obj)))
            elif isinstance(obj, dict):
                seen.add(id(obj))
                self.items.append(("dict", r.name, obj, dict(obj)))
            elif hasattr(obj, "__dict__"):
                seen.add(id(obj))
                self.items.append(("object", r.name, obj, dict(vars(obj))))

    def _values(self) -> Iterator[Tuple[Any, Any, str]]:
        """Each Python value the roots hold at their top: ``(container, key, path)``.

        Lists by index, dicts by key, modules' and objects' attributes, optimizers' attributes
        and parameter groups.
        """
        for kind, path, obj, _saved in self.items:
            if kind == "list":
                places: List[Tuple[Any, str]] = [(obj, f"{path}[{{!r}}]")]
            elif kind == "dict":
                places = [(obj, f"{path}[{{!r}}]")]
            elif kind in ("module", "object"):
                places = [(vars(obj), f"{path}.{{}}")]
            elif kind == "optimizer":
                places = [(vars(obj), f"{path}.{{}}")]
                places += [(g, f"{path}.param_groups[{i}][{{!r}}]") for i, g in enumerate(obj.param_groups)]
            else:
                continue
            for where, fmt in places:
                keys = range(len(where)) if isinstance(where, list) else list(where)
                for k in keys:
                    yield where, k, fmt.format(k)

    def concretize(self, is_symbolic: Callable[[Any], bool], concrete: Callable[[Any], Any]) -> None:
        """Replace the symbolic sizes a symbolic trace left in the roots' Python values by numbers.

        (``self.n = x.shape[0]`` in a module, ``cache["n"] = ...``, an optimizer's group:
        eager leaves the call's number there; a symbol would outlive its trace.)
        """
        for where, k, _path in list(self._values()):
            if is_symbolic(where[k]):
                where[k] = concrete(where[k])

    def find(self, pred: Callable[[Any], bool]) -> Optional[str]:
        """The path of a value ``pred`` accepts anywhere in the roots' Python values (trace-time only), or None."""
        for where, k, path in list(self._values()):
            found = _inside(where[k], pred)
            if found is not None:
                return path + found[0]
        return None

    def scan(self, is_fake: Callable[[Any], bool]) -> ScanResult:
        """What the trace left in the roots: fakes (escapes) and changed Python numbers."""
        res = ScanResult()
        for path, where, key, old_v in self.bindings:
            now = _bound_value(where, key)
            if type(now) in _COUNTS and (type(now) is not type(old_v) or now != old_v):
                res.changes.append(BindingChange(path, old_v, now, where, key))

        def attrs(path: str, obj: Any, now: Dict[str, Any], old: Dict[str, Any], skip: Set[str], model: bool) -> None:
            for k, v in now.items():
                if k in skip:
                    continue
                if is_fake(v):
                    res.escapes.append((Slot("attr", obj, k, f"{path}.{k}"), v))
                elif type(v) in _NUMBERS and k in old and type(old[k]) in _NUMBERS and old[k] != v:
                    res.changes.append(Change(f"{path}.{k}", old[k], v, now, k, model, obj))
                elif k not in old and (type(v) in _NUMBERS or (type(v) in (list, dict) and not _holds_tensor(v))):
                    # an attribute the trace made (`self.n = getattr(self, "n", 0) + 1`, `self.history = []`):
                    # taken away after the trace, as a changed one is put back (the eager call makes it)
                    res.changes.append(Change(f"{path}.{k}", _MISSING, v, now, k, model, obj))
                elif _rebound(v, old.get(k)):
                    res.changes.append(Change(f"{path}.{k}", old[k], v, now, k, True, obj))
                else:
                    res.note_stored(f"{path}.{k}", v, old.get(k, _MISSING), is_fake)

        for kind, path, obj, saved in self.items:
            if kind == "module":
                d, params, bufs, _mods, grads, hooks = saved
                attrs(path, obj, obj.__dict__, d, {"_parameters", "_buffers", "_modules"}, True)
                added = {k for n, keys in _hooks_of(obj).items() for k in keys - hooks.get(n, set())}
                if added:
                    res.changes.append(HookChange(f"{path or type(obj).__name__}", None, None, None, tuple(added),
                                                  True, obj))
                for n, p in obj._parameters.items():
                    if p is None:
                        continue
                    if is_fake(p):
                        res.appended.append(f"{path}.{n} (a new nn.Parameter made from a traced tensor)")
                        res.sites.append(p.__dict__.get("_gt_site", ""))
                    elif is_fake(leaf_grad(p)):
                        res.escapes.append((Slot("grad", p, "grad", f"{path}.{n}.grad"), p.grad))
                for n, b in obj._buffers.items():
                    if is_fake(b):
                        res.escapes.append((Slot("item", obj._buffers, n, f"{path}.{n}"), b))
                    elif _rebound(b, bufs.get(n)):
                        res.changes.append(Change(f"{path}.{n}", bufs[n], b, obj._buffers, n, True, obj))
            elif kind == "optimizer":
                d, st, groups, _pgrads = saved
                # Python numbers the step keeps on the optimizer (a Lookahead wrapper's
                # `self.counter += 1`) or in its per-parameter state (a hand-written Adam's
                # `state["step"] += 1`): a replay would never change them
                attrs(path, obj, obj.__dict__, d, {"state", "param_groups", "defaults"}, True)
                for p, s in obj.state.items():
                    old_s = st.get(p, (None, {}))[1]
                    for k, v in s.items():
                        if is_fake(v):
                            res.escapes.append((Slot("item", s, k, f"{path}.state[...][{k!r}]"), v))
                        elif type(v) in _NUMBERS and k in old_s and type(old_s[k]) in _NUMBERS and old_s[k] != v:
                            res.changes.append(Change(f"{path}.state[...][{k!r}]", old_s[k], v, s, k, True, obj))
                        else:
                            res.note_stored(f"{path}.state[...][{k!r}]", v, old_s.get(k, _MISSING), is_fake)
                for i, (g, old) in enumerate(groups):  # noqa: B007
                    for k, v in g.items():
                        if k == "params":
                            continue
                        if is_fake(v):
                            res.escapes.append((Slot("item", g, k, f"{path}.param_groups[{i}][{k!r}]"), v))
                        elif type(v) in _NUMBERS and k in old and type(old[k]) in _NUMBERS and old[k] != v:
                            res.changes.append(Change(f"{path}.param_groups[{i}][{k!r}]", old[k], v, g, k, True))
                        else:
                            res.note_stored(f"{path}.param_groups[{i}][{k!r}]", v, old.get(k, _MISSING), is_fake)
            elif kind == "tensor":
                if is_fake(leaf_grad(obj)):
                    res.escapes.append((Slot("grad", obj, "grad", f"{path}.grad"), obj.grad))
                where = saved[1]  # a global or closure cell the function rebound (global h; h = ...)
                if where is not None and is_fake(where.get()):
                    res.escapes.append((where, where.get()))
            elif kind == "list":
                old = saved
                if isinstance(obj, list) and len(obj) > len(old) and all(a is b for a, b in zip(obj, old)) and not any(
                        is_fake(v) or _holds_tensor(v) for v in obj[len(old):]):
                    # plain values appended (`self.history.append("called")`): a replay appends nothing
                    res.changes.append(Change(f"{path}", list(old), list(obj), obj, slice(None)))
                    continue
                for i, v in enumerate(obj):
                    if is_fake(v):
                        if i < len(old):
                            res.escapes.append((Slot("item", obj, i, f"{path}[{i}]"), v))
                        else:
                            res.appended.append(f"{path} (appended at index {i})")
                            res.sites.append(v.__dict__.get("_gt_site", ""))
                            res.grown.append(path)
                    elif (i < len(old) and len(obj) == len(old) and type(v) in _NUMBERS
                          and type(old[i]) in _NUMBERS and old[i] != v):
                        # a number changed in place (`cnt[0] += 1`), as a dict's (`ctr["i"] += 1`)
                        res.changes.append(Change(f"{path}[{i}]", old[i], v, obj, i))
                    elif not any(v is x for x in old):  # (an item moved along by an insert is no new one)
                        res.note_stored(f"{path}[{i}]", v, _MISSING, is_fake, appended_to=None if i < len(old) else path)
            elif kind == "dict":
                for k, v in obj.items():
                    if is_fake(v):
                        res.escapes.append((Slot("item", obj, k, f"{path}[{k!r}]"), v))
                    elif k in saved and type(v) in _NUMBERS and type(saved[k]) in _NUMBERS and saved[k] != v:
                        res.changes.append(Change(f"{path}[{k!r}]", saved[k], v, obj, k))
                    elif k in saved and _rebound(v, saved[k]):  # (a key the function added: stored, below)
                        res.changes.append(Change(f"{path}[{k!r}]", saved[k], v, obj, k, True))
                    else:
                        res.note_stored(f"{path}[{k!r}]", v, saved.get(k, _MISSING), is_fake)
            elif kind == "object":
                # a Python number in an object's attributes (a hand-written EMA's
                # `self.updates += 1`, an LR scheduler's last_epoch) is read back by later
                # calls as in a module: undone after the trace, refused if every call changes it
                attrs(path, obj, vars(obj), saved, set(), True)
        return res

    def restore(self, full: bool = False) -> None:
        """Put every root back as it was when the snapshot was taken.

        Args:
            full: put back Python values too (numbers, flags, objects holding no tensor),
                which a trace that succeeds leaves as it made them (see ``_restore_dict``).
                After a failed trace: the call then runs eagerly, or raises, and either way
                must find the state as the caller left it (DESIGN semantics 9).
        """
        for p, rg in self.flags:
            if p.requires_grad != rg and p.grad_fn is None:
                p.requires_grad_(rg)
        for c, size in self.caches:
            if _cache_size(c) > size:
                c.cache_clear()
        if full:
            for _path, where, key, old_v in self.bindings:
                if _bound_value(where, key) is not old_v:
                    BindingChange("", old_v, _bound_value(where, key), where, key).undo()
        for kind, _path, obj, saved in self.items:
            try:
                if kind == "module":
                    d, params, bufs, mods, grads, hooks = saved
                    if full:  # (hooks a failed trace registered)
                        added = tuple(k for n, keys in _hooks_of(obj).items() for k in keys - hooks.get(n, set()))
                        if added:
                            HookChange("", None, None, None, added, True, obj).undo()
                    _restore_dict(obj.__dict__, d, full)
                    _restore_dict(obj._parameters, params, full)
                    _restore_dict(obj._buffers, bufs, full)
                    _restore_dict(obj._modules, mods, full)
                    for n, g in grads.items():
                        p = params[n]
                        if leaf_grad(p) is not g:
                            p.grad = g
                elif kind == "optimizer":
                    d, st, groups, pgrads = saved
                    for p, g in pgrads:
                        if leaf_grad(p) is not g:
                            p.grad = g
                    for g, old in groups:
                        _restore_dict(g, old, full)
                    _restore_dict(obj.__dict__, d, full)
                    state = obj.state
                    for p in [p for p in state if p not in st]:
                        del state[p]
                    for p, (s, old) in st.items():
                        s.clear()
                        s.update(old)
                        state[p] = s
                elif kind == "tensor":
                    grad, where = saved
                    if leaf_grad(obj) is not grad:
                        obj.grad = grad
                    if where is not None and where.get() is not obj:
                        where.set(obj)
                elif kind == "list":
                    if _list_changed(obj, saved, full):
                        if isinstance(obj, list):
                            obj[:] = saved
                        else:  # (a deque)
                            obj.clear()
                            obj.extend(saved)
                elif kind == "dict":
                    _restore_dict(obj, saved, full)
                elif kind == "object":
                    _restore_dict(vars(obj), saved, full)
            except Exception:  # pragma: no cover - best effort, never mask the user's error
                continue


_MISSING = object()


def _cache_size(c: Any) -> int:
    try:
        return int(c.cache_info().currsize)
    except Exception:  # pragma: no cover - a cache_info of another shape
        return 0


def _bound_value(where: Any, key: str) -> Any:
    try:
        return where.get(key, _MISSING) if isinstance(where, dict) else getattr(where, key, _MISSING)
    except ValueError:  # (an emptied cell)
        return _MISSING


# how far _inside looks into a value stored in state, and into how many items per container
_INSIDE_DEPTH = 6
_INSIDE_ITEMS = 4096
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           functools.partial, enum.Enum, torch.dtype, torch.device)


def _inside(v: Any, pred: Callable[[Any], bool], depth: int = _INSIDE_DEPTH) -> Optional[Tuple[str, Any]]:
    """The first value in ``v`` that ``pred`` accepts, with its path in ``v`` (``.t``, ``[0]``), or None.

    Looks into dicts, lists, tuples (namedtuples' fields by name), sets, dataclasses and
    objects' attributes (``__dict__`` and ``__slots__``), ``depth`` levels down: what a
    value stored in state holds (``Box(t)``, ``[t]``, ``(t,)``, ``SimpleNamespace(t=t)``,
    a cache layer). Trace-time only.
    """
    seen: Set[int] = set()

    def walk(x: Any, d: int) -> Optional[Tuple[str, Any]]:
        if pred(x):
            return "", x
        if d <= 0 or isinstance(x, torch.Tensor) or type(x) in _NUMBERS or isinstance(x, _OPAQUE) or id(x) in seen:
            return None
        seen.add(id(x))
        for key, y in _members(x):
            found = walk(y, d - 1)
            if found is not None:
                return key + found[0], found[1]
        return None

    return walk(v, depth)


def contains(v: Any, pred: Callable[[Any], bool]) -> bool:
    """Whether ``pred`` accepts ``v`` or a value inside it (see :func:`_inside`; trace-time only)."""
    return _inside(v, pred) is not None


def _members(x: Any) -> List[Tuple[str, Any]]:
    """``x``'s items or attributes as ``(path suffix, value)``; none for what it cannot read plainly."""
    try:
        if isinstance(x, dict):
            return [(f"[{k!r}]", y) for k, y in x.items()] if len(x) <= _INSIDE_ITEMS else []
        if isinstance(x, (list, tuple)):
            if len(x) > _INSIDE_ITEMS:
                return []
            names = getattr(type(x), "_fields", None)  # a namedtuple
            if isinstance(names, tuple) and len(names) == len(x):
                return [(f".{n}", y) for n, y in zip(names, x)]
            return [(f"[{i}]", y) for i, y in enumerate(x)]
        if isinstance(x, (set, frozenset)):
            return [("{...}", y) for y in x] if len(x) <= _INSIDE_ITEMS else []
        out: List[Tuple[str, Any]] = []
        try:
            d = object.__getattribute__(x, "__dict__")  # (not a __getattr__ of the object's own)
        except AttributeError:
            d = None
        if type(d) is dict and len(d) <= _INSIDE_ITEMS:
            out += [(f".{k}", y) for k, y in d.items()]
        for c in type(x).__mro__:
            slots = c.__dict__.get("__slots__", ())
            for n in (slots,) if isinstance(slots, str) else slots if isinstance(slots, (tuple, list)) else ():
                if n not in ("__dict__", "__weakref__"):
                    y = getattr(x, n, _MISSING)
                    if y is not _MISSING:
                        out.append((f".{n}", y))
        return out
    except Exception:  # an object that does not let itself be read so
        return []


def _rebound(now: Any, old: Any) -> bool:
    """Whether a slot that held a tensor now holds another tensor that existed before.

    (A trace's own results are seen first, as escapes.) A replay, which runs tensor work
    only, would not bind it again.
    """
    return isinstance(now, torch.Tensor) and isinstance(old, torch.Tensor) and now is not old


def _tensors_changed(d: Dict[Any, Any], saved: Dict[Any, Any]) -> bool:
    for k, v in d.items():
        old = saved.get(k, _MISSING)
        if old is not v and (isinstance(v, torch.Tensor) or isinstance(old, torch.Tensor)):
            return True
        if old is not v and _holds_tensor(v):  # a new value holding tensors: a defaultdict's entry
            return True                       # (GradScaler's per-optimizer states), `memo["b"] = Box(t)`
    return any(k not in d and isinstance(v, torch.Tensor) for k, v in saved.items())


def _holds_tensor(v: Any) -> bool:
    return _inside(v, _is_tensor) is not None


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _list_changed(obj: List[Any], saved: List[Any], full: bool) -> bool:
    """Whether a trace changed list ``obj`` in a way to undo (see ``_restore_dict``)."""
    if len(obj) == len(saved) and all(a is b for a, b in zip(obj, saved)):
        return False
    if full:
        return True
    return any(isinstance(v, torch.Tensor) for v in saved) or any(
        _holds_tensor(v) for v in obj if not any(v is x for x in saved))


def _restore_dict(d: Dict[Any, Any], saved: Dict[Any, Any], full: bool = False) -> None:
    """Undo what a trace did to ``d``, if it touched a tensor there (or, ``full``, anything).

    A dict (or an object's attributes) where the trace left or replaced a tensor,
    or an object holding one, is put back whole, flags included (a lazily
    initialised cache and its ``is_initialized`` go back together). Where only
    Python values changed, the changes stay after a trace that succeeds: as in
    JAX, Python side effects such as a counter of traces happen when the
    function is traced.
    """
    if not full and not _tensors_changed(d, saved):
        return
    for k in [k for k in d if k not in saved]:
        del d[k]
    for k, v in saved.items():
        if d.get(k, _MISSING) is not v:
            d[k] = v


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


def _opt_params(opt: _Optimizer) -> List[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


# -- the environment part of the signature ------------------------------------------------


_PLAIN_TYPES = (int, float, bool, complex, str, bytes, type(None))


def plain_object_roots(roots: Sequence[Root]) -> List[Tuple[str, Any]]:
    """The plain objects among ``roots`` whose Python attributes are keyed (see env_key_fn).

    Not torch's own objects kept as state (LR schedulers, a GradScaler: handled as state).
    """
    return [(r.name, r.obj) for r in roots if type(r.obj) not in (list, dict, tuple) and _plain_object(r.obj)
            and not isinstance(r.obj, (_Module, _Optimizer) + _TORCH_STATE)]


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
        # plain objects (a config, `self` of a user's class passed as an argument): their
        # Python attributes the trace reads are keyed the same way (see env_key_fn)
        self.objs = plain_object_roots(roots)
        self.names: Dict[int, Set[str]] = {}
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
        self._swapped, untracked = track_reads(self.mods + [o for _, o in self.objs])
        self.untracked |= untracked
        self._outer = getattr(_READING, "reads", None)
        _READING.reads = self
        return self

    def __exit__(self, *exc: Any) -> None:
        self._calls.__exit__()
        _READING.reads = self._outer
        untrack_reads(self._swapped)
        self._swapped = []

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

    def __init__(self, slots: Sequence[Slot], desc: str):
        self.slots = list(slots)
        self.desc = desc
        self.last: List[Any] = [None] * len(self.slots)
        self.ptrs: List[int] = [0] * len(self.slots)
        self.reuse = False  # True where replays write the same memory again (CUDA)

    def before_replay(self) -> None:
        """Poison objects of the last call that the caller still holds elsewhere."""
        if not self.reuse:
            return
        from ._liveness import poison_tensor

        last = self.last
        for i in range(len(last)):
            obj = last[i]
            if obj is None:
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
            if self.reuse:
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


def uninitialized_modules(roots: Sequence[Root]) -> List[str]:
    """Paths of the lazy modules (``nn.LazyLinear``...) under ``roots`` not initialised yet.

    Their first forward creates the parameters, which a trace must not do: it would leave
    the module with parameters made under the trace (no data) and its hook gone.
    """
    from torch.nn.modules.lazy import LazyModuleMixin

    return [path for path, m in root_modules(roots)
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]  # type: ignore[misc]


def lazy_error(desc: str, paths: Sequence[str]) -> GraphifyError:
    """``f.trace(...)`` before a lazy module's first forward."""
    return GraphifyError(
        f"{desc}: the function reaches lazy modules whose parameters do not exist yet "
        f"({', '.join(paths[:4])}).\n"
        "Why: their first forward creates the parameters; tracing it would create them under the "
        "trace, without data, and leave the module so.\n"
        "Fix: call the function once (its first call runs eagerly and creates them), or run one "
        "forward of the model on an example input, before tracing it."
    )


def change_error(desc: str, changes: Sequence[Change]) -> GraphifyError:
    """The function changes Python values in reachable state on every call."""
    listing = "; ".join(list(dict.fromkeys(c.text() for c in changes))[:4])
    where = ""
    for c in changes:
        fwd = getattr(type(c.owner), "forward", None) if isinstance(c.owner, _Module) else None
        code = getattr(fwd, "__code__", None)
        if code is not None:
            where = f"  in {type(c.owner).__name__}.forward at {code.co_filename}:{code.co_firstlineno}\n"
            break
    sched = next((c for c in changes if isinstance(c.owner, _SCHEDULERS)), None)
    rebind = next((c for c in changes if c.rebinds), None)
    if any(".state[...][" in c.path for c in changes):  # a hand-written optimizer's int step count
        fix = ("Fix: keep the per-parameter count in a tensor on the parameters' device, updated in place "
               "(state['step'] = torch.zeros((), device=p.device), then state['step'] += 1), as "
               "torch.optim's capturable optimizers do, or keep opt.step() outside the graphified function.")
    else:
        fix = ("Fix: keep the value in a tensor updated in place (e.g. self.register_buffer('n', "
               "torch.zeros(())) and self.n += 1), or move the update out of the graphified function.")
        if any(c.owner is None for c in changes):  # a plain dict's or list's number
            fix += (" A counter that decides what the function does (gradient accumulation: "
                    "opt.step() every K-th call) belongs outside: count in your loop and pass the "
                    "decision as a static argument (gt.graphify(step, static_argnames=('do_step',)), "
                    "step(x, y, do_step=(i + 1) % K == 0)).")
    if rebind is not None:
        return GraphifyError(
            f"{desc}: the function binds state to other tensors on every call ({listing}).\n{where}"
            "Why: a recording replays tensor work only; the binding would happen once, while "
            "tracing, and never again, and later calls would read and write the wrong tensors.\n"
            f"Fix: keep {rebind.path} bound to one tensor and change its values in place instead "
            "(for double buffers: copy_ the new values into it, or keep both in one stacked "
            "buffer indexed by a step counter tensor)."
        )
    mode = [c for c in changes if c.key == "training" and isinstance(c.owner, _Module)]
    if mode and len(mode) == len(changes):
        # model.train() / model.eval() inside: a train step and an eval step sharing the model
        root = min((c.path.rsplit(".", 1)[0] for c in mode), key=len)
        return GraphifyError(
            f"{desc}: the function sets the modules' training mode ({listing}): {root}.train() or "
            f"{root}.eval() inside it, and the other mode was set since its last call (an eager "
            f"validation calling {root}.eval(), or another graphified function sharing the model).\n"
            "Why: the training flags are part of the signature (each mode gets its own recording), "
            "but a switch made inside the function happens once, while tracing, and a replay would "
            "leave the modules in the mode they were in.\n"
            f"Fix: call {root}.train() / {root}.eval() outside the graphified functions, before "
            "calling them (after each validation too; each mode is then recorded once and replayed)."
        )
    if sched is not None:
        fix = (f"Fix: call {sched.path.rsplit('.', 1)[0]}.step() outside the graphified function, after "
               "each call: the learning rate it sets is read by the next call (a new Python-float lr "
               "records again; a tensor lr with an optimizer that supports it is read in place).")
    return GraphifyError(
        f"{desc}: the function changes Python numbers in the state it reaches ({listing}).\n{where}"
        "Why: a recording replays tensor work only; a Python-side update would happen once, "
        "while tracing, and never again, and the value it reads would be frozen.\n" + fix
    )

"""Roots: the Python objects a function reaches without taking them as arguments.

Modules, optimizers, LR schedulers, GradScalers, closed-over containers and plain
objects, found by walking the function's globals, closure cells and ``self``
(:func:`find_roots`); and the tensors among them, each with the :class:`Slot` it is
read through (a global, a closure cell, an attribute, a dict entry), so that a
tensor rebound between calls is seen. Nothing here changes what it finds:
``_snapshot`` snapshots and undoes, ``_host_effects`` refuses what a replay cannot
repeat, ``_state`` indexes the state tensors and writes escapes back.
"""

from __future__ import annotations

import collections
import dis
import functools
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch

from ._compat import LR_SCHEDULER_LEGACY_BASE
from ._errors import GraphifyError, is_library_file

__all__ = ["Root", "Slot", "find_roots", "root_modules", "named_values", "python_values", "plain_value"]

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
_Distribution = torch.distributions.Distribution
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


def _library_wrapper(fn: Any, wrapped: Any) -> bool:
    """Whether library function ``fn`` wraps another function (``functools.wraps``) that it calls."""
    return callable(wrapped) and wrapped is not fn and not isinstance(wrapped, type)


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME"})


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> FrozenSet[str]:
    """The names ``code`` (and the code nested in it) reads or writes as globals.

    Not ``co_names``, which also holds every attribute name: a global named ``logits`` or ``t``
    is not what ``out.logits`` or ``self.t`` reads.
    """
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return frozenset(names)


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
    if _is_library_code(fn) and _library_wrapper(fn, wrapped):
        # a decorator of a library (torch.no_grad(), autocast, torch.func.vmap / grad, made with
        # functools.wraps) around the user's function: walked through, not counted as a level
        _candidates(wrapped, depth, out, seen, where)
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
    for name in _global_names(code):
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


# the standard library's machinery, not state (types.SimpleNamespace and argparse.Namespace are)
# (threading.local is: state kept per thread)
_STDLIB = frozenset({"builtins", "logging", "queue", "multiprocessing", "concurrent", "asyncio", "socket",
                     "subprocess", "io", "_io", "weakref", "tempfile", "warnings", "unittest"})


def _plain_object(v: Any) -> bool:
    if isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType, torch.Tensor)):
        return False
    if not hasattr(v, "__dict__"):
        return False
    if isinstance(v, _TORCH_STATE + (_Distribution,)):
        return True  # (torch's objects that hold state: a scheduler, a GradScaler, a distribution's loc/scale)
    top = (type(v).__module__ or "").split(".")[0]
    # (torch's own objects and the standard library's machinery: a logging.Logger reaches every
    # logger of the process through its manager. Packages named torch_geometric,
    # torchdiffeq, torchvision... are not torch: their objects (a PyG Data) are walked)
    return not (top in ("torch", "gtransform") or top in _STDLIB)


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
                if (type(v) is tuple or isinstance(v, (list, dict, collections.deque)) or _plain_object(v)
                        or isinstance(v, _Optimizer)):
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
                            if isinstance(v, (list, dict, collections.deque)) or _plain_object(v):
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
            for cls in _user_module_classes([Root("m", m)]):
                # a memo the class keeps for all its instances (`_cache = {}` of a rotary table)
                for k, v in list(vars(cls).items()):
                    if type(v) in (list, dict) and not k.startswith("__") and id(v) not in seen:
                        add(f"{cls.__name__}.{k}", v, 1, Slot("attr", cls, k, f"{cls.__name__}.{k}"))
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


def named_values(fn: Any, roots: Sequence[Root] = (), forward_only: bool = False) -> List[Tuple[str, Any, str, Any]]:
    """``(path, where, key, value)`` of each name ``fn`` reaches: its closure cells and globals.

    And those of the functions it names (3 levels; functools caches followed to the function
    they wrap), and the attributes of the user's own classes and modules it names; with
    ``roots``, those of the methods of the user's own module classes under them too.
    """
    out: List[Tuple[str, Any, str, Any]] = []
    seen: Set[int] = set()

    def walk(f: Any, depth: int) -> None:
        if depth > 3 or id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            # (its bound arguments: `partial(step, scale=0.5)`, a keyword changed in place)
            out.extend((f"{_fn_name(f.func)}.keywords[{k!r}]", f.keywords, k, v) for k, v in f.keywords.items())
            walk(f.func, depth + 1)
            return
        owner = None
        if inspect.ismethod(f):
            owner, f = f.__self__, f.__func__
        wrapped = getattr(f, "__wrapped__", None)
        if not isinstance(f, types.FunctionType) and wrapped is not None:
            walk(wrapped, depth + 1)  # (functools.lru_cache: a C-level wrapper)
            return
        if isinstance(f, types.FunctionType) and _is_library_code(f) and _library_wrapper(f, wrapped):
            walk(wrapped, depth)  # (torch.no_grad(), autocast, vmap around the user's function)
            return
        if not isinstance(f, types.FunctionType) or (depth > 0 and _is_library_code(f)):
            return
        code = f.__code__
        names = _code_names(code)
        if isinstance(owner, type) and _users_namespace(owner):  # (`cls.scale` in a classmethod)
            out.extend((f"{owner.__name__}.{a}", owner, a, owner.__dict__[a]) for a in names if a in owner.__dict__)
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            out.append((name, cell, "cell_contents", v))
            if callable(v):
                walk(v, depth + 1)
        g = f.__globals__
        for name in _global_names(code):
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
    for cls in _user_module_classes(roots):
        # every method of the user's own module classes (forward, and what it calls on self: a
        # rotary table, an lru_cache'd mask): their globals, closures and caches; with
        # ``forward_only``, forward's alone
        for k, v in list(vars(cls).items()):
            if forward_only and k != "forward":
                continue
            v = getattr(v, "__func__", v)  # (staticmethod, classmethod)
            if callable(getattr(v, "cache_clear", None)) and callable(getattr(v, "cache_info", None)):
                out.append((f"{cls.__name__}.{k}", cls, k, v))
            if isinstance(v, types.FunctionType) or callable(getattr(v, "__wrapped__", None)):
                walk(v, 0)
    return out


def _user_module_classes(roots: Sequence[Root]) -> List[type]:
    """The classes (and their user-written bases) of the modules under ``roots`` that the user wrote."""
    out: List[type] = []
    for _path, m in root_modules(roots):
        for cls in type(m).__mro__:
            if cls in out or cls is _Module or not _users_namespace(cls):
                continue
            fwd = vars(cls).get("forward")
            if fwd is None or (isinstance(fwd, types.FunctionType) and not _is_library_code(fwd)):
                out.append(cls)
    return out


def _fn_name(f: Any) -> str:
    return getattr(f, "__qualname__", None) or type(f).__name__


def python_values(named: Sequence[Tuple[str, Any, str, Any]]) -> Tuple[Tuple[str, Any, str, Any], ...]:
    """The plain Python values among ``named`` (:func:`named_values`): ``(path, where, key, value)``.

    Numbers, strings, bytes, None and short tuples of them bound to a global, a closure cell,
    a ``functools.partial`` keyword or an attribute of the user's own class or module that the
    function names. A trace reads them once; eager reads them at every call, so each is part
    of the signature (``SCALE = 0.5`` rebound between calls traces again), as TorchDynamo's
    guards make them. The values are taken before the trace runs.
    """
    seen: Set[Tuple[int, str]] = set()
    out = []
    for path, where, key, v in named:
        if plain_value(v) and (id(where), key) not in seen:
            seen.add((id(where), key))
            out.append((path, where, key, v))
    return tuple(out)


def plain_value(v: Any) -> bool:
    """A number, string, bytes or None, or a short tuple (a ``torch.Size`` too) of them.

    A value a signature can compare and a replay can set again (``SCALE = 0.5``,
    ``self.in_shape = x.shape``).
    """
    if type(v) in _NUMBERS:
        return True
    return type(v) in (tuple, torch.Size) and len(v) <= 16 and all(type(x) in _NUMBERS for x in v)


# -- the environment part of the signature ------------------------------------------------


_PLAIN_TYPES = (int, float, bool, complex, str, bytes, type(None))


def plain_object_roots(roots: Sequence[Root]) -> List[Tuple[str, Any]]:
    """The plain objects among ``roots`` whose Python attributes are keyed (see env_key_fn).

    Not torch's own objects kept as state (LR schedulers, a GradScaler: handled as state).
    """
    return [(r.name, r.obj) for r in roots if type(r.obj) not in (list, dict, tuple) and _plain_object(r.obj)
            and not isinstance(r.obj, (_Module, _Optimizer) + _TORCH_STATE)]


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

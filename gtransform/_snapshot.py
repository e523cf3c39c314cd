"""Snapshot and undo: a trace has no visible effect on the Python side.

Python state the function reaches (its roots: modules, optimizers, closed-over lists,
dicts and objects) is snapshotted before each trace and put back after it
(:class:`Snapshot`). Python values the function changed are reported as
:class:`Change` records (an attribute, a hook, a global or closure binding); the
caller decides which a replay re-sets and which are refused (:func:`change_error`).
A failed trace puts the roots back whole, Python values included, so that the call,
run eagerly or refused, finds them as the caller left them.
"""

from __future__ import annotations

import enum
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from ._errors import GraphifyError, is_library_file
from ._host_effects import _COUNTS
from ._roots import _NUMBERS, _SCHEDULERS, _SEQUENCES, Root, Slot, _Module, _Optimizer, plain_value, root_modules
from ._state import leaf_grad
from ._symbolic import symbolic_value

__all__ = ["Change", "HookChange", "BindingChange", "ScanResult", "Snapshot", "contains", "change_error"]


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


def _value(v: Any) -> bool:
    """A plain value (:func:`_roots.plain_value`) or a symbolic size of a symbolic trace (``self.n = x.shape[0]``)."""
    return plain_value(v) or symbolic_value(v)


def _value_changed(old: Any, new: Any) -> bool:
    """Whether the trace changed a Python value (``self.calls += 1``, ``self.in_shape = x.shape``).

    A symbolic size stored is a change: its number is the call's own, unknown to the comparison
    without pinning it (the concretizing after the trace pins it).
    """
    if not (_value(new) and _value(old)):
        return False
    return symbolic_value(new) or symbolic_value(old) or old != new


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
                elif k in old and _value_changed(old[k], v):
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
                        elif k in old_s and _value_changed(old_s[k], v):
                            res.changes.append(Change(f"{path}.state[...][{k!r}]", old_s[k], v, s, k, True, obj))
                        else:
                            res.note_stored(f"{path}.state[...][{k!r}]", v, old_s.get(k, _MISSING), is_fake)
                for i, (g, old) in enumerate(groups):  # noqa: B007
                    for k, v in g.items():
                        if k == "params":
                            continue
                        if is_fake(v):
                            res.escapes.append((Slot("item", g, k, f"{path}.param_groups[{i}][{k!r}]"), v))
                        elif k in old and _value_changed(old[k], v):
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
                    elif i < len(old) and len(obj) == len(old) and _value_changed(old[i], v):
                        # a number changed in place (`cnt[0] += 1`), as a dict's (`ctr["i"] += 1`)
                        res.changes.append(Change(f"{path}[{i}]", old[i], v, obj, i))
                    elif not any(v is x for x in old):  # (an item moved along by an insert is no new one)
                        res.note_stored(f"{path}[{i}]", v, _MISSING, is_fake, appended_to=None if i < len(old) else path)
            elif kind == "dict":
                for k, v in obj.items():
                    if is_fake(v):
                        res.escapes.append((Slot("item", obj, k, f"{path}[{k!r}]"), v))
                    elif k in saved and _value_changed(saved[k], v):
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


def change_error(desc: str, changes: Sequence[Change], set_at: Optional[Dict[Tuple[int, str], str]] = None) -> GraphifyError:
    """The function changes Python values in reachable state on every call.

    ``set_at``: where the trace set attributes of tracked objects (``AttrReads.set_at``).
    """
    listing = "; ".join(list(dict.fromkeys(c.text() for c in changes))[:4])
    where = ""
    for c in changes:
        site = (set_at or {}).get((id(c.where), c.key)) if isinstance(c.key, str) else None
        if site:
            where = f"  at {site}\n"
            break
    for c in changes if not where else ():
        fwd = getattr(type(c.owner), "forward", None) if isinstance(c.owner, _Module) else None
        code = getattr(fwd, "__code__", None)
        if code is not None and not is_library_file(code.co_filename):  # (torch's placeholder forward: no)
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
    lib = next((c for c in changes if c.owner is not None and not isinstance(c.owner, _Module)
                and (type(c.owner).__module__ or "").split(".")[0] == "transformers"), None)
    if lib is not None:  # (a Hugging Face cache layer's token count: not the user's to change)
        fix = (f"Fix: {type(lib.owner).__name__} is Hugging Face's own object, which counts in Python (a "
               "sliding-window cache layer's token count): graphify cannot record it. Use "
               "torch.compile(fn, backend=\"gtransform\") (TorchDynamo traces again where the count "
               "matters and records the rest), a cache without that counter (StaticCache on a model "
               "without sliding-window layers), or run this part eagerly.")
    if sched is not None:
        fix = (f"Fix: call {sched.path.rsplit('.', 1)[0]}.step() outside the graphified function, after "
               "each call: the learning rate it sets is read by the next call (a new Python-float lr "
               "records again; a tensor lr with an optimizer that supports it is read in place).")
    return GraphifyError(
        f"{desc}: the function changes Python numbers in the state it reaches ({listing}).\n{where}"
        "Why: a recording replays tensor work only; a Python-side update would happen once, "
        "while tracing, and never again, and the value it reads would be frozen.\n" + fix
    )

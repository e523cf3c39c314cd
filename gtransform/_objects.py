"""Output trees: the containers and objects a function returns, taken apart and rebuilt.

Pytree nodes of our namespace are flattened as they are. Types registered with
``torch.utils._pytree`` (Hugging Face's ``ModelOutput``) and dataclasses are
registered in our namespace when first met. A plain Python object made inside
the function that holds the trace's tensors at any depth (a
``torch.distributions.Normal``, Hugging Face's ``DynamicCache``) is taken apart
by its ``__dict__`` (:class:`_Rebuilt`) and rebuilt on every call, as
``copy.copy`` builds one; the objects it holds that nothing outside the output
refers to (a ``TanhTransform`` and its cache) are rebuilt fresh as well, as
eager makes new ones on every call. Other objects holding the trace's tensors
are refused with the reason.
"""

from __future__ import annotations

import collections.abc
import copy
import functools
import gc
import types
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ._compat import FakeTensor
from ._errors import GraphifyError
from ._tree import NAMESPACE, flatten, leaf_paths, register_containers_in, unflatten

__all__ = ["flatten_output"]


_QDTYPES = tuple(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n))
_SCALARS = (int, float, complex, bool, str, bytes, type(None), type, torch.dtype, torch.device, torch.Size)
# code, not data: a function's closure is looked into, but a function is never rebuilt
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType,
              functools.partial, types.ModuleType)


def _kids(obj: Any, path: str) -> List[Tuple[Any, str]]:
    """The values ``obj`` holds, with their paths: items, attributes, a closure's cells."""
    if isinstance(obj, torch.Tensor):
        return []  # a leaf (its __dict__ holds our own bookkeeping)
    if isinstance(obj, dict):
        return [(v, f"{path}[{k!r}]") for k, v in list(obj.items())]
    if isinstance(obj, (list, tuple)):
        return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(v, f"{path}{{...}}") for v in list(obj)]
    if isinstance(obj, weakref.ReferenceType):
        return [(obj(), f"{path}()")]
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or ()
        out = []
        for name, c in zip(obj.__code__.co_freevars, cells):
            try:
                out.append((c.cell_contents, f"{path}.<closure {name}>"))
            except ValueError:  # an empty cell
                pass
        return out
    if isinstance(obj, types.MethodType):
        return [(obj.__self__, f"{path}.__self__")]
    if isinstance(obj, functools.partial):
        return [(obj.func, f"{path}.func"), (obj.args, f"{path}.args"), (obj.keywords, f"{path}.keywords")]
    if isinstance(obj, (_SCALARS, types.ModuleType, types.BuiltinFunctionType, types.BuiltinMethodType)):
        return []
    kids: List[Tuple[Any, str]] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        kids = [(v, f"{path}.{k}") for k, v in list(d.items())]
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for sl in (slots,) if isinstance(slots, str) else slots:
            if sl in ("__dict__", "__weakref__"):
                continue
            try:
                kids.append((getattr(obj, sl), f"{path}.{sl}"))
            except AttributeError:
                pass
    return kids


def _tensor_inside(x: Any, limit: int = 200_000) -> Optional[str]:
    """Where an opaque object holds a tensor the trace made (``.layers[0].keys``), or ``None``.

    Looks through attributes (``__dict__``, ``__slots__``), lists, tuples, sets,
    dicts, weak references and closures, breadth first, so that a cache object
    holding its tensors a few levels down (Hugging Face's ``DynamicCache``:
    ``.layers[i].keys``) is found as well as a ``torch.distributions.Normal``'s
    ``.loc``. Modules are state, not looked into. Past ``limit`` values the
    answer is ``"..."``: not known, treated as holding one.
    """
    seen = {id(x)}
    todo: List[Tuple[Any, str]] = [(x, "")]
    n = 0
    while todo:
        obj, path = todo.pop()
        for v, p in _kids(obj, path):
            n += 1
            if n > limit:
                return "..."
            if isinstance(v, torch.Tensor):
                if isinstance(v, FakeTensor):  # one the trace made
                    return p
                continue  # a real tensor: state the object holds (a StaticCache passed in), fine
            if id(v) not in seen and not isinstance(v, _SCALARS) and not isinstance(v, torch.nn.Module):
                seen.add(id(v))
                todo.append((v, p))
    return None


class _Rebuilt:
    """An output object taken apart by its ``__dict__``, rebuilt on every call.

    Its attribute values are a subtree (tensors become outputs in the recording's
    memory); every call builds a new instance of ``cls`` from them, the way
    ``copy.copy`` does (``cls.__new__`` and the attributes set, ``__init__`` not
    run), as eager returns a new object on every call.
    """

    __slots__ = ("cls", "keys", "values")

    def __init__(self, cls: type, keys: Tuple[str, ...], values: List[Any]):
        self.cls, self.keys, self.values = cls, keys, values


def _rebuild_object(meta: Tuple[Any, Tuple[str, ...]], values: Any) -> Any:
    cls, keys = meta
    obj = object.__new__(cls) if cls is not types.SimpleNamespace else types.SimpleNamespace()
    obj.__dict__.update(zip(keys, values))
    return obj


def _open_rebuilt(r: _Rebuilt) -> Tuple[List[Any], Tuple[type, Tuple[str, ...]], Tuple[str, ...]]:
    return r.values, (r.cls, r.keys), r.keys


class _Fresh:
    """A private mutable object without tensors (a ``set``): a shallow copy on every call."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _open_fresh(f: _Fresh) -> Tuple[List[Any], Any]:
    return [], f.value


def _fresh_copy(value: Any, _: Any) -> Any:
    return copy.copy(value)


def _register_nodes() -> None:
    import optree

    try:
        optree.register_pytree_node(
            _Rebuilt,  # type: ignore[arg-type]
            _open_rebuilt,  # type: ignore[arg-type]
            _rebuild_object,  # type: ignore[arg-type]
            path_entry_type=optree.GetAttrEntry,
            namespace=NAMESPACE,
        )
        optree.register_pytree_node(
            _Fresh,  # type: ignore[arg-type]
            _open_fresh,  # type: ignore[arg-type]
            _fresh_copy,  # type: ignore[arg-type]
            namespace=NAMESPACE,
        )
    except ValueError:  # pragma: no cover - registered already
        pass


_register_nodes()

_COPIES_ITS_OWN_WAY = ("__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__copy__", "__getnewargs__",
                       "__getnewargs_ex__")


def _why_not_rebuilt(x: Any) -> Optional[str]:
    """Why ``x`` cannot be rebuilt from its ``__dict__`` as ``copy.copy`` would, or ``None``."""
    cls = type(x)
    if cls is types.SimpleNamespace:
        return None
    if isinstance(x, (torch.nn.Module, type) + _FUNCTIONS):
        return f"a {cls.__name__} is not rebuilt"
    if cls.__module__ == "builtins":
        return f"a {cls.__name__} is not rebuilt"
    slotted = [b.__name__ for b in cls.__mro__ if b.__dict__.get("__slots__") not in (None, (), [], "__dict__")]
    if slotted:
        return f"{slotted[0]} keeps state in __slots__"
    if not isinstance(getattr(x, "__dict__", None), dict):
        return "it has no __dict__"
    for name in _COPIES_ITS_OWN_WAY:
        if getattr(cls, name, None) is not getattr(object, name, None):
            return f"{cls.__name__} defines {name} (it copies itself its own way)"
    if cls.__new__ is not object.__new__:
        return f"{cls.__name__} defines __new__"
    return None


def _is_leaf(v: Any) -> bool:
    """Whether our pytree policy keeps ``v`` whole (not a container it takes apart)."""
    leaves, _ = flatten(v)
    return len(leaves) == 1 and leaves[0] is v


def _private_objects(out: Any) -> Set[int]:
    """Ids of the objects inside ``out``'s objects that nothing outside the output refers to.

    Eager makes them anew on every call (a ``TanhTransform(cache_size=1)`` in a
    returned distribution, a set of tags): shared between calls, one call's
    changes would show in the next call's objects. An object anything else refers
    to (a config, a module, a global) is kept as it is. One scan of the heap
    (``gc.get_referrers``), at trace time only.
    """
    inside: Dict[int, Any] = {}  # candidates: plain objects and mutable sets below an object
    internal: Set[int] = set()  # the output's own containers and objects
    todo: List[Tuple[Any, bool]] = [(out, False)]
    seen = {id(out)}
    while todo:
        obj, below = todo.pop()
        internal.add(id(obj))
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            internal.add(id(d))
        is_obj = not isinstance(obj, (dict, list, tuple, set, frozenset, _SCALARS))
        for v, _ in _kids(obj, ""):
            if isinstance(v, (torch.Tensor, torch.nn.Module, _SCALARS) + _FUNCTIONS) or id(v) in seen:
                continue
            seen.add(id(v))
            if (below or is_obj) and _is_leaf(v) and _tensor_inside(v) is None:
                inside[id(v)] = v  # (one holding the trace's tensors is rebuilt in any case)
            todo.append((v, below or is_obj))
    if not inside:
        return set()
    cands = list(inside.values())
    private = set(inside)
    ours = {id(cands), id(todo), id(seen), id(inside)}
    for r in gc.get_referrers(*cands):
        if id(r) in internal or id(r) in ours:
            continue
        if type(r) is tuple and len(r) == len(cands) and all(a is b for a, b in zip(r, cands)):
            continue  # the call's own argument tuple
        if isinstance(r, types.FrameType):
            continue  # a local variable of a running function (ours)
        for v in gc.get_referents(r):
            private.discard(id(v))
    return private


def _copyable(x: Any) -> bool:
    try:
        copy.copy(x)
    except Exception:
        return False
    return True


def _open_objects(leaves: List[Any], opened: Set[int], private: Set[int]) -> bool:
    """Replace the objects among ``leaves`` that must be rebuilt by ``_Rebuilt``/``_Fresh`` nodes.

    Those are the plain objects holding trace-made tensors, and the private objects
    inside them (:func:`_private_objects`): plain ones rebuilt the same way, others
    (a ``set``, a ``Counter``) copied with ``copy.copy`` on every call. Returns whether
    any was replaced. An object met again (a cycle, or one object reached twice) is left
    as it is.
    """
    new = False
    for i, x in enumerate(leaves):
        if isinstance(x, (torch.Tensor,) + _SCALARS) or id(x) in opened:
            continue
        # the private objects hold none of the trace's tensors (_private_objects)
        holds = id(x) not in private and _tensor_inside(x) is not None
        if not holds and id(x) not in private:
            continue
        if _why_not_rebuilt(x) is None:
            keys = tuple(x.__dict__)
            leaves[i] = _Rebuilt(type(x), keys, [x.__dict__[k] for k in keys])
        elif not holds and not isinstance(x, _FUNCTIONS + (type, torch.nn.Module)) and _copyable(x):
            leaves[i] = _Fresh(x)  # a set, a Counter: a shallow copy on every call
        else:
            continue
        opened.add(id(x))
        new = True
    return new


# generators, coroutines and iterators over a container or a range (itertools', map's, zip's...):
# objects with a position that a replay would hand out again as they were left
_ITERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType, collections.abc.Iterator)


def flatten_output(out: Any, desc: str) -> Tuple[List[Any], Any]:
    """Flatten an output tree, taking apart containers and plain objects holding trace tensors.

    Registered containers and dataclasses are flattened as pytree nodes, plain objects
    holding the trace's tensors by their ``__dict__`` (:class:`_Rebuilt`); other opaque
    objects holding them are refused.
    """
    opened: Set[int] = set()
    private = _private_objects(out)  # before anything else holds the output's parts
    for _ in range(64):
        leaves, spec = flatten(out)
        if register_containers_in(leaves):
            continue
        if not _open_objects(leaves, opened, private):
            break
        out = unflatten(spec, leaves)
    else:
        leaves, spec = flatten(out)
    for i, x in enumerate(leaves):
        quantized = isinstance(x, torch.Tensor) and (x.is_quantized or x.dtype in _QDTYPES)
        if isinstance(x, torch.Tensor) and (x.layout != torch.strided or x.is_nested or quantized):
            path = leaf_paths(out, root="output")[i]
            what = ("a nested tensor" if x.is_nested else f"a quantized tensor ({x.dtype})" if quantized
                    else f"a {x.layout} tensor")
            fix = ("return t.to_dense(), or its parts (t.indices() and t.values() for COO; "
                   "crow_indices(), col_indices() and values() for CSR) and rebuild it outside"
                   if x.layout != torch.strided else "return padded dense tensors (t.to_padded_tensor(0.0))"
                   if x.is_nested else "return t.dequantize(), or t.int_repr() and rebuild it outside")
            raise GraphifyError(
                f"{desc}: {path} is {what}.\nWhy: outputs are dense strided tensors in the "
                f"recording's memory.\nFix: {fix}."
            )
        if isinstance(x, _ITERATORS):
            path = leaf_paths(out, root="output")[i]
            raise GraphifyError(
                f"{desc}: {path} is an iterator ({type(x).__name__}).\nWhy: it is made once, while "
                "tracing, and a replay would hand back that same object on every call, already run "
                "through; eager makes a new one on every call.\n"
                "Fix: return a list or tuple of its items (list(...)), or make the iterator outside the "
                "graphified function from what it returns."
            )
        inside = None if isinstance(x, (torch.Tensor,) + _SCALARS) else _tensor_inside(x)
        if inside is not None:
            path = leaf_paths(out, root="output")[i]
            name = type(x).__name__
            if id(x) in opened:
                why = "the output reaches it twice, or it holds itself (it would be rebuilt as two objects)"
            elif isinstance(x, weakref.ReferenceType):
                why = "a weak reference to a tensor made inside cannot be rebuilt"
            elif isinstance(x, _FUNCTIONS):
                why = "a function or method is not rebuilt; its closure would keep the trace's placeholders"
            else:
                why = _why_not_rebuilt(x) or "it cannot be rebuilt"
            raise GraphifyError(
                f"{desc}: {path} is a {name} object that holds tensors ({path}{inside}), and "
                f"gtransform cannot take it apart: {why}.\nWhy: outputs are flattened into tensors (which "
                "live in the recording's memory) and a structure rebuilt on every call; plain objects are "
                "rebuilt from their __dict__, as copy.copy does, but this one would carry the trace's "
                "placeholders instead of real tensors.\n"
                "Fix: return its tensors in a tuple, dict or dataclass and rebuild the object outside the "
                "function, or register its type as a pytree node "
                "(optree.register_pytree_node(..., namespace='gtransform'))."
            )
    return leaves, spec

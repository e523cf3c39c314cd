"""One pytree policy for the whole library, leaf paths, and signature keys.

Containers optree does not know are registered in our namespace when first met (as inputs
or as outputs): types registered with ``torch.utils._pytree`` (Hugging Face's
``ModelOutput``) the way torch flattens them, dataclasses by their fields.

Policy: optree with ``namespace="gtransform"`` and ``none_is_leaf=False``
(``None`` is an empty subtree, as in JAX). Users may register their own
containers in that namespace with ``optree.register_pytree_node(...,
namespace="gtransform")``.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Number as _Number
from typing import Any, Hashable, List, Sequence, Tuple

import optree
import torch

from ._compat import torch_pytree as tpytree

__all__ = [
    "NAMESPACE",
    "flatten",
    "unflatten",
    "leaf_paths",
    "static_leaf_key",
    "tensor_meta",
    "has_grad",
    "flatten_args",
    "register_containers_in",
]

NAMESPACE = "gtransform"


def flatten(tree: Any) -> Tuple[List[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` with the library's policy."""
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, leaves)


def leaf_paths(tree: Any, root: str = "args", statics: Sequence[Any] = ()) -> List[str]:
    """Human paths of every leaf, e.g. ``args[0]['w']`` or ``kwargs['lr']``.

    ``tree`` is the ``(args, kwargs)`` pair for inputs (``root="args"``), or an
    output tree (``root="output"``). ``statics``: the call's static arguments
    ``(where, value, key)``, taken out of ``tree``: positions count them, as the
    caller passed the arguments (``f(n, x)`` with ``n`` static: ``x`` is ``args[1]``).
    """
    accessors = optree.tree_flatten_with_accessor(tree, none_is_leaf=False, namespace=NAMESPACE)[0]
    skipped = sorted(s[0] for s in statics if isinstance(s[0], int))
    out = []
    for acc in accessors:
        code = acc.codify("")
        if root == "args":
            if code.startswith("[0]"):
                code = "args" + (_renumbered(code[3:], skipped) if skipped else code[3:])
            elif code.startswith("[1]"):
                code = "kwargs" + code[3:]
        else:
            code = root + code
        out.append(code)
    return out


def _renumbered(code: str, skipped: Sequence[int]) -> str:
    """``[k]...`` of the k-th non-static argument as the position the caller passed it at."""
    end = code.index("]")
    k = int(code[1:end])
    for p in skipped:  # (ascending)
        if p <= k:
            k += 1
    return f"[{k}]{code[end + 1:]}"


class _NaN:
    """Key stand-in for float NaN (NaN != NaN would defeat the cache)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NaN)

    def __hash__(self) -> int:
        return 0x7FF8


_NAN = _NaN()


class _Identity:
    """Key stand-in comparing an object by identity (it keeps the object, so its id stays its own)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def holds_tensor(v: Any, depth: int = 8) -> bool:
    """Whether ``v`` is a tensor, or a container or dataclass holding one (``depth`` levels down)."""
    if isinstance(v, torch.Tensor):
        return True
    if depth <= 0:
        return False
    if isinstance(v, dict):
        vals: Any = v.values()
    elif isinstance(v, (list, tuple, set, frozenset)):
        vals = v
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        vals = [getattr(v, f.name, None) for f in dataclasses.fields(v)]
    else:
        return False
    return len(vals) <= 4096 and any(holds_tensor(x, depth - 1) for x in vals)


def _holds_tensors(leaf: Any) -> bool:
    d = getattr(leaf, "__dict__", None)
    return type(d) is dict and any(isinstance(v, torch.Tensor) for v in d.values())


_PLAIN = frozenset((int, bool, str, bytes, type(None), torch.dtype, torch.device))


def static_leaf_key(leaf: Any) -> Hashable:
    """Cache-key entry of a non-tensor leaf: its type and value.

    Raises:
        TypeError: the leaf is not hashable (the caller adds the leaf path).
    """
    t = type(leaf)
    if t in _PLAIN:  # the common leaves first: their value is their key
        return (t, leaf)
    if t is float:
        if math.isnan(leaf):
            return (float, _NAN)
        # -0.0 == 0.0 in Python, but 1/x tells them apart
        return (float, leaf, math.copysign(1.0, leaf))
    if isinstance(leaf, torch.Tensor):
        # a tensor's == is elementwise and its hash its identity: never a value of the signature
        raise TypeError("a tensor cannot be a static value")
    if t is tuple or t is frozenset or (isinstance(leaf, tuple) and hasattr(t, "_fields")):
        # element by element: (2,) == (2.0,) and frozenset({2}) == frozenset({2.0}) in Python,
        # but torch.full(..., v[0]) makes int64 from one and float32 from the other
        # (a namedtuple's fields too)
        hash(leaf)
        keys = [static_leaf_key(x) for x in leaf]
        return (t, tuple(keys) if t is not frozenset else frozenset(keys))
    if dataclasses.is_dataclass(leaf) and getattr(t, "__hash__", None) is not None and t.__dataclass_params__.eq:  # type: ignore[attr-defined]
        # a frozen dataclass compares its fields with ==: keyed field by field, as a tuple
        hash(leaf)
        return (t, tuple(static_leaf_key(getattr(leaf, f.name)) for f in dataclasses.fields(leaf) if f.compare))
    if getattr(t, "__eq__", None) is not object.__eq__ and not isinstance(leaf, _Number) and _holds_tensors(leaf):
        # an object of the user's class with a value __eq__ (a name) and tensors of its own:
        # state read through it (self.w), so another object is another signature, however equal
        hash(leaf)
        return (t, _Identity(leaf))
    if t is complex:
        if leaf != leaf:
            return (t, _NAN)
        return (t, leaf, math.copysign(1.0, leaf.real), math.copysign(1.0, leaf.imag))
    hash(leaf)
    if isinstance(leaf, _Number):
        if leaf != leaf:
            # NaN of another number type (np.float64("nan"), np.float32, complex)
            return (t, _NAN)
        if leaf == 0 and not isinstance(leaf, (int, complex)):
            try:  # numpy's -0.0 (np.float64, np.float32)
                return (t, leaf, math.copysign(1.0, float(leaf)))  # type: ignore[arg-type]
            except (TypeError, ValueError):
                pass
    return (t, leaf)


def has_grad(t: torch.Tensor) -> bool:
    """Whether ``t`` has a ``.grad`` (read without the non-leaf warning)."""
    return (t.is_leaf or t.retains_grad) and t.grad is not None


def tensor_meta(t: torch.Tensor) -> Tuple[Any, ...]:
    """Cache-key entry of a tensor leaf."""
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _register_container(cls: type) -> bool:
    """Teach our pytree namespace a container type optree does not know.

    Types registered with ``torch.utils._pytree`` (e.g. Hugging Face's
    ``ModelOutput``) are flattened the way torch does; dataclasses by their
    fields. Returns whether ``cls`` was newly registered.
    """
    import dataclasses

    import optree

    node = tpytree.SUPPORTED_NODES.get(cls)
    try:
        if node is not None:
            flat, unflat = node.flatten_fn, node.unflatten_fn

            def _flat_t(x: Any) -> Any:
                children, ctx = flat(x)
                children = list(children)
                if isinstance(ctx, (list, tuple)) and len(ctx) == len(children) and all(isinstance(k, str) for k in ctx):
                    return children, ctx, tuple(ctx)  # the keys name the leaves (output.logits)
                return children, ctx

            optree.register_pytree_node(cls, _flat_t, lambda ctx, ch: unflat(list(ch), ctx), namespace=NAMESPACE)
            return True
        if dataclasses.is_dataclass(cls):
            names = tuple(f.name for f in dataclasses.fields(cls))

            def _flat_d(x: Any) -> Any:
                return [getattr(x, n) for n in names], names, names

            def _unflat_d(ctx: Any, children: Any) -> Any:
                obj = object.__new__(cls)
                for n, v in zip(ctx, children):
                    object.__setattr__(obj, n, v)
                return obj

            optree.register_pytree_node(cls, _flat_d, _unflat_d, namespace=NAMESPACE)  # type: ignore[arg-type]
            return True
    except ValueError:  # already registered
        return False
    return False


def register_containers_in(leaves: Sequence[Any]) -> bool:
    """Register the dataclasses and ``torch.utils._pytree`` types among ``leaves``.

    Returns whether any was new (the tree must then be flattened again). Inputs and
    outputs take such containers apart alike, whichever the process met first.
    """
    import dataclasses

    new = False
    for x in leaves:
        if isinstance(x, torch.Tensor) or x is None:
            continue
        cls = type(x)
        if cls in _NOT_CONTAINERS:  # torch.Size: a leaf, it comes back as a torch.Size (torch's pytree rebuilds a tuple)
            continue
        if cls in tpytree.SUPPORTED_NODES or (dataclasses.is_dataclass(cls) and not isinstance(x, type)):
            new = _register_container(cls) or new
    return new


_NOT_CONTAINERS = frozenset((int, float, bool, str, type(None), complex, torch.Size))


def flatten_args(args: Any, kwargs: Any, desc: str = "graphify(fn)") -> Tuple[List[Any], Any]:
    """Flatten the call's arguments (``desc``: the function, for the message of a cycle).

    Dataclasses and torch-pytree containers are taken apart (registered on first
    sight, as outputs are), nested ones too.
    """
    try:
        leaves, spec = flatten((args, kwargs))
        for _ in range(8):
            if not register_containers_in(leaves):
                break
            leaves, spec = flatten((args, kwargs))
    except RecursionError:
        raise TypeError(
            f"{desc}: the arguments hold a container that contains itself (a list appended to itself) "
            "or nest deeper than Python's recursion limit; graphify flattens the arguments to find "
            "their tensors. Fix: pass the tensors in a shallower structure, or pass the object "
            "through state the function reaches (a closed-over object) instead of as an argument."
        ) from None
    return leaves, spec

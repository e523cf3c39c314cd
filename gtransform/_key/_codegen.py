"""Writing checks as straight-line Python: constants, the structure of the arguments, static values.

The generated functions (the generic match of a signature, the fast path of its
recording) are straight-line code, with no loop over generic structures: each check
of :mod:`._checks` writes its lines with :data:`FAIL` where the function gives up, which
the generic match turns into ``return None`` and the fast path into ``return MISS``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import optree

from .._tree import static_leaf_key

__all__ = ["FAIL", "Gen", "gen_flatten", "const_check"]

FAIL = "__FAIL__"
"""Where generated check code gives up (replaced by each generated function's own return)."""

_K = optree.PyTreeKind
_SIMPLE_LEAF_TYPES = (int, str, bool, type(None), bytes)


class Gen:
    """A generated function's constants (named in its namespace) and temporary names."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.consts: Dict[str, Any] = {}
        self.n = 0

    def const(self, value: Any, prefix: str = "K") -> str:
        name = f"{prefix}{len(self.consts)}"
        self.consts[name] = value
        return name

    def tmp(self) -> str:
        self.n += 1
        return f"t{self.n}"


def gen_flatten(g: Gen, spec: Any, expr: str, leaves: List[str], sample: Any = None) -> bool:
    """Lines that take ``expr`` apart by indexing into the names ``l0, l1...``, checking its structure.

    Container types, lengths and a dict's key order (part of the signature: optree sorts
    keys, the function may not) must be the signature's; False where the structure has
    kinds this cannot write (the caller then flattens with optree and compares specs).
    """
    kind = spec.kind
    if kind == _K.LEAF:
        name = f"l{len(leaves)}"
        g.lines.append(f"{name} = {expr}")
        leaves.append(name)
        return True
    if kind == _K.NONE:
        g.lines.append(f"if {expr} is not None: {FAIL}")
        return True
    if kind in (_K.TUPLE, _K.LIST, _K.DICT):
        typ = {_K.TUPLE: "tuple", _K.LIST: "list", _K.DICT: "dict"}[kind]
        v = g.tmp()
        n = spec.num_children
        g.lines.append(f"{v} = {expr}")
        g.lines.append(f"if type({v}) is not {typ} or len({v}) != {n}: {FAIL}")
        children = spec.children()
        if kind == _K.DICT:
            if type(sample) is dict and len(sample) > 1:
                g.lines.append(f"if tuple({v}) != {g.const(tuple(sample))}: {FAIL}")
            for key, child in zip(spec.entries(), children):
                k = repr(key) if type(key) in (str, int) else g.const(key)
                sub = sample[key] if type(sample) is dict else None
                if not gen_flatten(g, child, f"{v}[{k}]", leaves, sub):
                    return False
        else:
            for i, child in enumerate(children):
                sub = sample[i] if isinstance(sample, (list, tuple)) and i < len(sample) else None
                if not gen_flatten(g, child, f"{v}[{i}]", leaves, sub):
                    return False
        return True
    return False


def const_check(g: Gen, name: str, value: Any) -> str:
    """A condition true where the static value named ``name`` is not ``value``'s signature.

    As :func:`gtransform._tree.static_leaf_key` compares: ``2``, ``2.0`` and ``True`` are
    three signatures, every NaN is one, and ``-0.0`` is not ``0.0``.
    """
    t = type(value)
    if t is float:
        if math.isnan(value):
            return f"type({name}) is not float or {name} == {name}"
        sign = math.copysign(1.0, value)
        # (a named constant: repr(inf) is `inf`, not a Python expression)
        return f"type({name}) is not float or {name} != {g.const(value)} or _copysign(1.0, {name}) != {sign!r}"
    if t in _SIMPLE_LEAF_TYPES:
        return f"type({name}) is not {g.const(t)} or {name} != {g.const(value)}"
    return f"_key({name}) != {g.const(static_leaf_key(value))}"


NAMESPACE: Dict[str, Any] = {"_copysign": math.copysign, "_key": static_leaf_key}
"""Names every generated check function finds (see :func:`const_check`)."""

"""Elements of an input read at fixed indices, passed to inductor as inputs of their own.

An unrolled loop over a tensor (a fixed time grid ``for t0, t1 in zip(t[:-1], t[1:])``, a
table of coefficients) reads a different element at every step. Inductor fuses each read
into the kernel that uses it, with the index as a literal (``in_ptr1[7]``), so the kernels
of otherwise identical steps differ in source and each is compiled on its own: the
torchdiffeq rk4 solve over 20 steps compiled 81 kernels, each a Triton (or C++) compile.
Passed as inputs of their own (views of the input: no copy, no kernel), the reads are
``in_ptrK[0]`` in every step, the steps' kernels have one source, and inductor compiles
each once.

Only small views (a few elements) of inputs the graph does not write are lifted: a view
of an input the graph updates in place would be read at a point inductor cannot order
against the update.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

_aten = torch.ops.aten
# view ops through which an element of an input is reached (no data moved)
_VIEWS = frozenset((_aten.slice.Tensor, _aten.select.int, _aten.unbind.int, _aten.view.default,
                    _aten.squeeze.dim, _aten.unsqueeze.default, operator.getitem))
# the ops that pick elements at a fixed index (the reason to lift)
_INDEXING = frozenset((_aten.select.int, operator.getitem))
MAX_ELEMENTS = 16

Chain = Tuple[int, Tuple[Tuple[Any, Tuple[Any, ...]], ...]]  # (placeholder index, ((op, other args)...))


def lift_indexed_views(gm: torch.fx.GraphModule, args: Sequence[Any]) -> List[Chain]:
    """Replace small fixed-index views of ``gm``'s unwritten inputs by new inputs (appended, in order).

    Args:
        gm: the graph (changed in place).
        args: the call's inputs (to size the views).

    Returns:
        How to make each new input from the call's inputs (see :func:`views_of`); empty if none.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    origin: Dict[torch.fx.Node, Chain] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _VIEWS and n.args:
            src = n.args[0]
            if src in origin:
                p, chain = origin[src]
            elif src in index:
                p, chain = index[src], ()
            else:
                continue
            origin[n] = (p, chain + ((n.target, tuple(n.args[1:])),))
    written = _written_inputs(graph, index)
    lifted: List[Chain] = []
    last = placeholders[-1] if placeholders else None
    for n, (p, chain) in origin.items():
        if p in written or not any(op in _INDEXING for op, _ in chain) or not _used_beyond_views(n):
            continue
        value = _apply(args[p], chain)
        if not isinstance(value, torch.Tensor) or value.numel() > MAX_ELEMENTS:
            continue
        with graph.inserting_after(last):
            new = graph.placeholder(f"lifted_{len(lifted)}")
        new.meta.update({k: v for k, v in n.meta.items() if k == "val"})
        n.replace_all_uses_with(new)
        last = new
        lifted.append((p, chain))
    if lifted:
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
    return lifted


def views_of(lifted: Sequence[Chain], args: Sequence[Any]) -> List[torch.Tensor]:
    """The lifted inputs of a call: each view made from the call's inputs as the graph made it."""
    return [_apply(args[p], chain) for p, chain in lifted]


def with_lifted(fn: Callable[..., Any], lifted: Sequence[Chain]) -> Callable[..., Any]:
    """``fn`` of the original inputs, passing the lifted views after them (made again where an input changed)."""
    made: List[Optional[Tuple[Any, List[torch.Tensor]]]] = [None]
    sources = sorted({p for p, _ in lifted})

    def call(*args: Any) -> Any:
        key = [(id(args[p]), args[p].data_ptr()) for p in sources]
        got = made[0]
        if got is None or got[0] != key:
            got = made[0] = (key, views_of(lifted, args))  # type: ignore[assignment]
        return fn(*args, *got[1])  # type: ignore[index]

    return call


def _apply(t: Any, chain: Sequence[Tuple[Any, Tuple[Any, ...]]]) -> Any:
    for op, rest in chain:
        t = op(t, *rest)
    return t


def _used_beyond_views(n: torch.fx.Node) -> bool:
    """Whether a user of ``n`` computes with it (a view of it is lifted on its own, if it qualifies)."""
    return any(u.op != "call_function" or u.target not in _VIEWS for u in n.users)


def _written_inputs(graph: torch.fx.Graph, index: Dict[torch.fx.Node, int]) -> set:
    """Inputs the graph writes (``copy_``, ``add_``, an ``out=``...), directly or through any alias of them."""
    alias: Dict[torch.fx.Node, int] = dict(index)
    written = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem:  # (an element of a list of views: unbind, split...)
            if n.args and n.args[0] in alias:
                alias[n] = alias[n.args[0]]
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None:
            continue
        for k, a in enumerate(schema.arguments):
            info = a.alias_info
            if info is None:
                continue
            v = n.args[k] if k < len(n.args) else n.kwargs.get(a.name)
            for x in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(x, torch.fx.Node) and x in alias:
                    if info.is_write:
                        written.add(alias[x])
                    elif any(r.alias_info is not None for r in schema.returns) and n not in alias:
                        alias[n] = alias[x]  # a view of it (t, expand, as_strided, view_as_real...)
    return written

"""Repeated calls compiled once, for ``graphify(fn, fuse=True)``.

A trace unrolls every call: an ODE solver takes 20 steps of four evaluations of its
vector field, a transformer runs a dozen identical blocks. Inductor compiles the
whole unrolled graph, and its scheduling and code generation grow with the number of
ops, not the number of distinct ones (the rk4 solve of the benchmark: ~1,500 ops,
21 s on an H200 against torch.compile's 9 s, cold: dynamo compiles one step and
reuses it).

The trace marks each node with the Python calls under way when its op ran (a serial
number per call, outermost first: ``meta["gt_calls"]``, see ``_watch._Calls``). Here
the calls at one nesting depth whose ops form the same graph over inputs of the same
layout are each replaced by ``invoke_subgraph`` of one shared subgraph, inductor's
higher-order op for repeated regions: it lowers and generates the subgraph once and
calls it from every place. The depth is the one that leaves the fewest ops to
compile. A call is outlined only where that is exact: its ops are contiguous in the
graph, write nothing, draw no random numbers, exchange only tensors with the rest of
the graph and return no view. Where inductor refuses the outlined graph, the plain
one is compiled (``_inductor``).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._log import log

__all__ = ["outline"]

_MIN_OPS = 4  # calls with fewer ops are left inline (an invoke costs a launch boundary)
_MAX_DEPTH = 96
_PER_SUBGRAPH = 8  # ops a subgraph is worth in choosing the depth


def outline(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> int:
    """Replace repeated calls in ``gm`` by calls of shared subgraphs; how many were replaced.

    ``inputs``: the graph's inputs (real or fake), whose layouts its placeholders take.
    """
    invoke = getattr(getattr(torch.ops, "higher_order", None), "invoke_subgraph", None)
    if invoke is None:  # pragma: no cover - a torch without the op
        return 0
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not any("gt_calls" in n.meta for n in nodes):
        return 0
    for n in nodes:  # (an op a rewrite made, gtransform's GEMV of q, k and v: its users' call)
        if "gt_calls" not in n.meta:
            marked = next((u.meta["gt_calls"] for u in n.users if "gt_calls" in u.meta), None)
            if marked is not None:
                n.meta["gt_calls"] = marked
    for p, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        if "val" not in p.meta and isinstance(v, torch.Tensor):
            p.meta["val"] = v
    found: List[Tuple[List[torch.fx.Node], List[torch.fx.Node], List[torch.fx.Node], Any]] = []
    best_saved = 0
    for depth in _candidate_depths(nodes):
        calls, saved = _repeats(_calls_at(nodes, depth))
        if saved > best_saved:
            found, best_saved = calls, saved
    if not found:
        return 0
    shared: Dict[Any, Tuple[str, torch.fx.GraphModule]] = {}
    done = 0
    for members, _, _, key in found:
        # (again: an earlier call's outputs it reads are now the getitems of that call's invoke)
        cut = _cut(members)
        if cut is None:  # pragma: no cover - outlining another call cannot make this one inexact
            continue
        ins, outs = cut
        if key not in shared:
            name = f"gt_region_{len(shared)}"
            sub = _subgraph(members, ins, outs)
            gm.add_submodule(name, sub)
            shared[key] = (name, sub)
        _replace(gm, invoke, shared[key][0], members, ins, outs)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
        log.info("fuse=True: %d repeated calls compiled as %d subgraph(s)", done, len(shared))
    return done


def _candidate_depths(nodes: Sequence[torch.fx.Node], n: int = 3) -> List[int]:
    """The ``n`` nesting depths whose calls repeat the same op lists over the most ops (a cheap first look)."""
    scored = []
    for depth in range(_MAX_DEPTH):
        by_ops: Dict[Tuple[Any, ...], List[int]] = {}
        groups = _calls_at(nodes, depth)
        if not groups:
            break
        for members in groups:
            if len(members) >= _MIN_OPS:
                by_ops.setdefault(tuple(n.target for n in members), []).append(len(members))
        saved = sum(sum(sizes) - sizes[0] for sizes in by_ops.values() if len(sizes) > 1)
        if saved:
            scored.append((saved, depth))
    return [d for _, d in sorted(scored, reverse=True)[:n]]


def _repeats(calls: Sequence[List[torch.fx.Node]]) -> Tuple[List[Any], int]:
    """The calls that can be outlined and repeat another's graph exactly, and the ops that saves."""
    cut = []
    counts: Dict[Any, int] = {}
    for members in calls:
        c = _cut(members)
        if c is not None:
            key = _key(members, c[0], c[1])
            counts[key] = counts.get(key, 0) + 1
            cut.append((members, c[0], c[1], key))
    found = [c for c in cut if counts[c[3]] > 1]
    firsts: Dict[Any, int] = {}
    for members, _, _, key in found:
        firsts.setdefault(key, len(members))
    # (each subgraph is one more thing to compile: of two depths that save as many ops, the
    # one with fewer, larger subgraphs)
    return found, sum(len(c[0]) for c in found) - sum(firsts.values()) - _PER_SUBGRAPH * len(firsts)


def _calls_at(nodes: Sequence[torch.fx.Node], depth: int) -> List[List[torch.fx.Node]]:
    """The ops of each call at nesting ``depth`` (0: outermost), in graph order."""
    groups: Dict[Tuple[int, ...], List[torch.fx.Node]] = {}
    for n in nodes:
        calls = n.meta.get("gt_calls")
        if calls is not None and len(calls) > depth:
            groups.setdefault(calls[: depth + 1], []).append(n)
    return list(groups.values())


def _pure(n: torch.fx.Node) -> bool:
    """Whether a call may hold ``n``: it writes nothing, draws nothing, gives tensors.

    Not ``_rewrite._pure`` (the dead-op pass's): that one takes data-dependent ops and aten/prims
    only; a subgraph may hold gtransform's own kernels and attention without dropout, and its
    values must be tensors (they cross the subgraph's boundary).
    """
    t = n.target
    if t is operator.getitem:
        return True
    schema = getattr(t, "_schema", None)  # (an OpOverload's)
    if schema is None or schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()) and not _no_dropout(n, schema):
        return False
    return isinstance(n.meta.get("val"), torch.Tensor) or _tensors(n.meta.get("val"))


def _no_dropout(n: torch.fx.Node, schema: Any) -> bool:
    """A seeded op that draws nothing here: attention with ``dropout_p=0`` (a model in eval)."""
    for i, a in enumerate(schema.arguments):
        if a.name == "dropout_p":
            v = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else a.default_value)
            return isinstance(v, (int, float)) and v == 0
    return False


def _view(n: torch.fx.Node) -> bool:
    """Whether ``n``'s value aliases its inputs (a view op, or an item of one: ``split``'s pieces)."""
    t = n.target
    if t is operator.getitem:
        src = n.args[0]
        return not isinstance(src, torch.fx.Node) or src.op != "call_function" or _view(src)
    schema = getattr(t, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _tensors(v: Any) -> bool:
    """A multi-output op's value: tensors, and the sizes and Nones attention kernels return beside them."""
    return isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v) and all(
        isinstance(x, (torch.Tensor, int, torch.SymInt)) or x is None for x in v)


def _cut(members: List[torch.fx.Node]) -> Optional[Tuple[List[torch.fx.Node], List[torch.fx.Node]]]:
    """The call's inputs and outputs, or None where outlining it would not be exact."""
    if len(members) < _MIN_OPS or not all(_pure(n) for n in members):
        return None
    inside = set(members)
    # contiguous: no other op between its first and last (the outlined call takes their place)
    n = members[0]
    last = members[-1]
    while n is not last:
        n = n.next
        if n.op == "call_function" and n not in inside:
            return None
    ins: List[torch.fx.Node] = []
    seen = set()
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside and a not in seen:
                if not isinstance(a.meta.get("val"), torch.Tensor):
                    return None
                seen.add(a)
                ins.append(a)
    outs = [m for m in members if any(u not in inside for u in m.users)]
    if not outs or not all(isinstance(m.meta.get("val"), torch.Tensor) for m in outs):
        return None
    if any(_view(m) for m in outs):  # (an output aliasing an input or another output: not outlined)
        return None
    return ins, outs


def _layout(v: torch.Tensor) -> Tuple[Any, ...]:
    return (tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)


def _key(members: Sequence[torch.fx.Node], ins: Sequence[torch.fx.Node], outs: Sequence[torch.fx.Node]) -> Any:
    """Equal for two calls whose ops form the same graph over inputs of the same layout."""
    index: Dict[torch.fx.Node, str] = {a: f"i{k}" for k, a in enumerate(ins)}
    index.update((m, f"n{k}") for k, m in enumerate(members))

    def arg(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda x: index[x])  # type: ignore[arg-type, return-value]

    ops = tuple((str(m.target), repr(arg(m.args)), repr(arg(m.kwargs))) for m in members)
    return (ops, tuple(_layout(a.meta["val"]) for a in ins), tuple(index[o] for o in outs))


def _subgraph(members: Sequence[torch.fx.Node], ins: Sequence[torch.fx.Node],
              outs: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    for k, a in enumerate(ins):
        p = g.placeholder(f"arg{k}")
        p.meta["val"] = a.meta["val"]
        env[a] = p
    for m in members:
        env[m] = g.node_copy(m, lambda x: env[x])
    g.output(tuple(env[o] for o in outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _replace(gm: torch.fx.GraphModule, invoke: Any, name: str, members: Sequence[torch.fx.Node],
             ins: Sequence[torch.fx.Node], outs: Sequence[torch.fx.Node]) -> None:
    graph = gm.graph
    inside = set(members)
    with graph.inserting_after(members[-1]):
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(invoke, (attr, name, *ins))
    call.meta["val"] = tuple(o.meta["val"] for o in outs)
    last = call
    for k, o in enumerate(outs):
        with graph.inserting_after(last):
            item = graph.call_function(operator.getitem, (call, k))
        item.meta["val"] = o.meta["val"]
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        last = item
    for m in reversed(members):
        graph.erase_node(m)

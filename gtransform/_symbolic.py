"""Sizes that vary: one symbolic trace for every size of a dimension seen to vary.

A graphified function is traced per signature, and a signature holds every size. When a
call differs from an earlier signature only in the sizes of some dimensions (a batch
that grows, a prompt of another length), those dimensions are traced once more with
symbolic sizes (``_trace``, a shape environment of torch's, as ``torch.compile``'s
automatic dynamic shapes do); each later size whose guards hold takes that plan as it
is: a new size costs a recording (warm-up and capture), not a trace.

The calls of one *family* are those whose keys agree but for the sizes of row-major
tensor inputs. A family takes a symbolic trace only where:

* the sizes that vary are 2 or more on the call traced symbolically (0 and 1 are specialised,
  as torch does: a first call of one row keeps its own trace, and the sizes after it share one);
* the function did not pin a symbol (``if x.shape[0] == 8``, an ``int(x.shape[0])`` that
  decides something, a size it returns or stores as a number), freeze a host read or change
  Python values while tracing. Outputs that are views of inputs keep their sizes as
  expressions of the symbols: each size's signature gets its own (``shared_plan``).

Calls differentiated through gtransform's autograd wrapper (the backward outside the
function) share the forward's plan the same way, and ``_partition`` traces their joint
forward and backward once, symbolically, for every size whose guards hold.

Anything else, or a trace that fails symbolically, is traced per size as before (the
family tries at most :data:`TRIES` symbolic traces). This module keeps the families'
books (``_lookup`` consults it before it traces) and the symbolic side of one trace
(``_trace`` uses it): the stand-ins' symbols, what a finished trace holds for
(:class:`SymbolicSizes`), and the sizes that leave the trace as numbers.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Hashable, List, Optional, Sequence, Tuple

import torch

from ._log import log

__all__ = ["Family", "Families", "TRIES", "family_key", "Layouts", "graph_layouts", "symbol_dims", "shared_plan", "sizes_line", "dim_names", "shareable",
           "SymbolicSizes", "SymbolicLeak", "symbolic_fakes", "holds_for_sizes", "concrete", "sym_expr", "hint",
           "symbolic_value", "new_shape_env", "symbolic_dispatch"]

TRIES = 2  # symbolic traces a family may take (a new dimension that varies later: the second)


def family_key(key: Tuple[Any, ...], tpos: Sequence[int], tensors: Sequence[torch.Tensor],
               layouts: Optional[Layouts] = None) -> Hashable:
    """A call's key with the sizes of its row-major tensor inputs left out (their number of dims kept).

    Only inputs whose strides are exactly the row-major ones of their sizes (what the symbolic
    trace's stand-ins have, size-1 dimensions included) lose their sizes; the others keep
    their whole entry, and calls that differ in them are of different families. With
    ``layouts`` (a half of a symbolic partition), the inputs whose layout holds a symbol lose
    their sizes and strides instead (the layouts and their guards decide).
    """
    spec, parts, *rest = key
    general = list(parts)
    for k, (p, t) in enumerate(zip(tpos, tensors)):
        if layouts.varies(k) if layouts is not None else t.stride() == _row_major(t.shape):
            typ, _shape, _stride, dtype, device, rg = parts[p]
            general[p] = (typ, t.dim(), dtype, device, rg)
    return (spec, tuple(general), *rest)


@dataclass(frozen=True)
class Layouts:
    """The sizes and strides of a graph's tensor inputs as expressions of its trace's symbols.

    A half of a symbolic partition (see ``_partition``) takes activations laid out as the
    joint trace laid them out: transposed, sliced out of a buffer, expanded. Its calls' sizes
    differ as those expressions say, which row-major stand-ins cannot follow; its symbolic
    trace takes stand-ins laid out by these expressions instead, one symbol for each of the
    joint's, read from the first ``(input, dim)`` that is exactly that symbol (``where``).
    """

    sizes: Tuple[Tuple[Any, ...], ...]
    strides: Tuple[Tuple[Any, ...], ...]
    where: Tuple[Tuple[Any, Tuple[int, int]], ...]  # (symbol, (input, dim)), in the symbols' order

    def varies(self, k: int) -> bool:
        """Whether input ``k``'s layout holds a symbol."""
        return any(not isinstance(e, int) for e in (*self.sizes[k], *self.strides[k]))

    def dims(self) -> FrozenSet[Tuple[int, int]]:
        return frozenset(w for _s, w in self.where)

    def values(self, tensors: Sequence[torch.Tensor]) -> Dict[Any, int]:
        return {sym: int(tensors[i].shape[d]) for sym, (i, d) in self.where}

    def match(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these tensors are laid out as the expressions say (a call the layouts can trace)."""
        values = self.values(tensors)
        return all(tuple(t.shape) == tuple(_number(e, values) for e in sz)
                   and t.stride() == tuple(_number(e, values) for e in st)
                   for t, sz, st in zip(tensors, self.sizes, self.strides))


def _number(e: Any, values: Dict[Any, int]) -> int:
    """A size expression's value for these values of its symbols (an int as it is)."""
    return e if isinstance(e, int) else int(e.xreplace(values))


def symbol_dims(vals: Sequence[torch.Tensor]) -> Dict[Any, Tuple[int, int]]:
    """Each symbol that is exactly a dimension of these (fake) tensors: the first ``(tensor, dim)`` it is."""
    where: Dict[Any, Tuple[int, int]] = {}
    for j, v in enumerate(vals):
        for d, x in enumerate(v.shape):
            if isinstance(x, torch.SymInt) and x.node.expr.is_Symbol:
                where.setdefault(x.node.expr, (j, d))
    return where


def graph_layouts(gm: Any) -> Optional[Layouts]:
    """The :class:`Layouts` of a symbolic graph's tensor placeholders, or None (a symbol no dimension is)."""
    import sympy

    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [v for v in vals if isinstance(v, torch.Tensor)]

    def expr(x: Any) -> Any:
        if not isinstance(x, torch.SymInt):
            return int(x)
        e = x.node.expr
        return int(e) if e.is_number else e

    sizes = [[expr(x) for x in v.shape] for v in vals]
    strides = [[expr(x) for x in v.stride()] for v in vals]
    where = symbol_dims(vals)
    # a size whose symbols no dimension is alone (labels flattened: (s1*s2,)) is read whole, as
    # a symbol of its own wherever it appears
    for j in range(len(sizes)):
        for d in range(len(sizes[j])):
            e = sizes[j][d]  # (as the replacements so far left it)
            if not isinstance(e, int) and not e.free_symbols <= where.keys():
                u = sympy.Symbol(f"gt_size_{j}_{d}", positive=True, integer=True)
                where[u] = (j, d)
                sizes = [[x if isinstance(x, int) else x.xreplace({e: u}) for x in s_] for s_ in sizes]
                strides = [[x if isinstance(x, int) else x.xreplace({e: u}) for x in s_] for s_ in strides]
    free = set()
    for e in (x for sz in sizes + strides for x in sz):
        if not isinstance(e, int):
            free |= e.free_symbols
    if not where or not free <= where.keys():
        return None
    return Layouts(tuple(map(tuple, sizes)), tuple(map(tuple, strides)),
                   tuple(sorted(where.items(), key=lambda kv: kv[1])))


def _row_major(shape: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


class Family:
    """The calls of one family key: the first call's sizes, the symbolic plan and its dimensions."""

    __slots__ = ("shapes", "dims", "plan", "tries", "why", "warm", "layouts", "made_with")

    def __init__(self, shapes: List[Tuple[int, ...]], layouts: Optional[Layouts] = None):
        self.shapes = shapes  # the tensor inputs' sizes of the first call
        # a half of a symbolic partition: its inputs' layouts, traced from its first call
        self.layouts = layouts
        self.dims: FrozenSet[Tuple[int, int]] = frozenset()  # the symbolic plan's (input, dim)
        self.plan: Any = None  # the symbolic plan (a _trace.Plan whose ``sizes`` is set)
        # the Python side the plan was traced with, as its signature saw it (see python_of)
        self.made_with: Any = None
        self.tries = 0
        self.why = ""  # why the last symbolic trace is not shared (for describe/logs)
        # the key of a call of the family that ran the eager first call of a signature touching
        # state (while that key stays warm, see _lookup._settle): the state it made lazily
        # (optimizer moments) exists for the family's other sizes too
        self.warm: Any = None

    def varying(self, tensors: Sequence[torch.Tensor]) -> FrozenSet[Tuple[int, int]]:
        """The ``(input, dim)`` whose size differs from the first call's."""
        return frozenset((k, d) for k, (a, t) in enumerate(zip(self.shapes, tensors))
                         for d, (x, y) in enumerate(zip(a, t.shape)) if x != y)

    def plan_for(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The symbolic plan where it holds for these tensors' sizes, else None."""
        plan = self.plan
        if plan is None or (self.layouts is None and not self.varying(tensors) <= self.dims):
            return None
        if any(tensors[k].shape[d] < 2 for k, d in self.dims):
            return None  # (0 and 1 are specialised: a trace of their own)
        return plan if plan.sizes.holds(tensors) else None

    def dims_to_trace(self, tensors: Sequence[torch.Tensor]) -> FrozenSet[Tuple[int, int]]:
        """The dimensions a symbolic trace of this call would take, or none (trace it as is)."""
        if self.tries >= TRIES:
            return frozenset()
        if self.layouts is not None:  # (the layouts' symbols, where this call follows them)
            dims = self.layouts.dims()
            ok = self.layouts.match(tensors) and all(tensors[k].shape[d] >= 2 for k, d in dims)
            return dims if ok else frozenset()
        dims = self.dims | self.varying(tensors)
        # (the first call's size may be 0 or 1, a server's first request of one row: it keeps its
        # own trace, and the symbolic one, which holds from 2 on, serves the sizes after it)
        if not dims or dims == self.dims or any(tensors[k].shape[d] < 2 for k, d in dims):
            return frozenset()
        return dims

    def traced(self, plan: Any, dims: FrozenSet[Tuple[int, int]], entry: Any, desc: str) -> None:
        """A trace of one of the family's calls, and the entry it made (None: an eager first call).

        A symbolic trace is adopted (shared where it can be), except one whose entry was not
        kept (an eager first call: the next call's trace is adopted).
        """
        if plan.sizes is not None or plan.sizes_pinned:
            if entry is not None or plan.sizes is None:
                self.adopt(plan, dims, entry is not None and shareable(plan), desc)
                if self.plan is plan:
                    self.made_with = python_of(entry)

    def serves(self, entry: Any) -> bool:
        """Whether a new size's ``entry`` over the symbolic plan sees the Python side the plan was traced with.

        Module attributes, hooks, training flags, optimizer settings (the environment), the
        tensors' Python attributes and which ``.grad`` are None are constants of the trace:
        changed since, the plan no longer holds (it computed with the old values).
        """
        return self.made_with is not None and python_of(entry) == self.made_with
    def state_made(self, key: Hashable, warmed: Any) -> None:
        """Note a call of the family whose key is in ``warmed`` (its eager first call made the state)."""
        if key in warmed:
            self.warm = key

    def state_exists(self, warmed: Any) -> bool:
        """Whether a call of the family made the state lazily and its key is still warm (see _lookup._settle)."""
        return self.warm is not None and self.warm in warmed

    def failed_once(self) -> None:
        """A symbolic trace raised: one of the family's tries (a size the function refuses may raise so)."""
        self.tries += 1

    def give_up(self, err: BaseException, desc: str) -> None:
        """A symbolic trace failed where the call traces as is: no more symbolic traces for the family."""
        self.tries = TRIES
        self.why = f"the symbolic trace failed ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})"
        log.info("%s: %s; traced per size", desc, self.why)

    def forget(self) -> None:
        """The symbolic plan no longer serves (the state it reads was replaced, or its Python side changed)."""
        self.plan, self.dims, self.made_with = None, frozenset(), None

    def adopt(self, plan: Any, dims: FrozenSet[Tuple[int, int]], shared: bool, desc: str) -> None:
        """The result of a symbolic trace over ``dims``: kept for the family's next sizes where ``shared``."""
        self.tries += 1
        why = "" if shared else _not_shared(plan)
        if not why:
            self.plan, self.dims, self.why = plan, dims, ""
            log.info("%s: traced once for every size of %s", desc, ", ".join(dim_names(plan, dims)))
        else:
            self.why = why
            log.info("%s: the symbolic trace over %s is kept for this size alone: %s", desc,
                     ", ".join(dim_names(plan, dims)), why)


def python_of(entry: Any) -> Any:
    """What of the Python side an entry's signature checks, as values (see ``Family.serves``)."""
    return (entry.env_val, entry.attrs, tuple(map(id, entry.grad_none)))


def _not_shared(plan: Any) -> str:
    if plan.sizes is None:
        return (f"{plan.sizes_pinned or 'a size that varies was fixed'} (compared with a number, or made a "
                "Python int)")
    if plan.frozen:
        return "the trace froze a host read"
    return "the trace changed Python values"


def dim_names(plan: Any, dims: FrozenSet[Tuple[int, int]]) -> List[str]:
    """``x.size(0)`` for each dimension, by the input's leaf path."""
    return [f"{plan.in_paths[k]}.size({d})" for k, d in sorted(dims)]


def sizes_line(plan: Any) -> str:
    """describe(): the symbolic dimensions of a plan and its guards, by the inputs' leaf paths."""
    code = plan.sizes.code
    if code:
        code = re.sub(r"L\['t(\d+)'\]", lambda m: plan.in_paths[int(m.group(1))], code)
    return f"one symbolic trace for every size of {', '.join(dim_names(plan, plan.sizes.dims))} " \
           f"(guards: {code or 'none'})"


def shareable(plan: Any) -> bool:
    """Whether a symbolic plan can serve other sizes."""
    return plan.sizes is not None and not plan.frozen and not plan.py_changes


def shared_plan(plan: Any, fuse: bool, tensors: Sequence[torch.Tensor]) -> Any:
    """The family's plan for one more signature (of these tensors' sizes).

    The graph, the output rules and the state are shared, and so is the fused graph
    (``fuse``: compiled once, with symbolic sizes); the outputs that are views of inputs get
    this signature's sizes; what a plan caches for the signature that runs it (the
    collectives' bookkeeping) starts empty.
    """
    if fuse:
        plan.fused()  # (made now, compiled on its first call: one compile for the family)
    p = copy.copy(plan)
    p.__dict__ = {k: v for k, v in plan.__dict__.items() if not k.startswith("_gt_")}
    views = plan.sizes.views_for(tensors)
    if views:
        p.out_entries = [dataclasses.replace(e, size=views[k][0], stride=views[k][1], rel_offset=views[k][2])
                         if k in views else e for k, e in enumerate(plan.out_entries)]
        fused = p._fused
        p.__post_init__()  # (the entries it derives from them)
        p._fused = fused
    p.shared = True
    return p


class Families:
    """One thread's families of a graphified function (bounded, least recently used first out)."""

    __slots__ = ("d", "limit")

    def __init__(self) -> None:
        self.d: OrderedDict[Hashable, Family] = OrderedDict()
        self.limit: Optional[int] = 64

    def get(self, key: Hashable, tensors: Sequence[torch.Tensor], layouts: Optional[Layouts] = None) -> Family:
        """The family of ``key`` (made with these tensors' sizes on its first call)."""
        f = self.d.get(key)
        if f is None:
            f = self.d[key] = Family([tuple(t.shape) for t in tensors], layouts)
            if self.limit is not None and len(self.d) > self.limit:
                del self.d[next(iter(self.d))]
        else:
            self.d.move_to_end(key)
        return f

    def clear(self) -> None:
        self.d.clear()

    def shared_for(self, key: Tuple[Any, ...], tpos: Sequence[int], tensors: Sequence[torch.Tensor],
                   layouts: Optional[Layouts] = None) -> bool:
        """explain(): whether a call of this key would be recorded from its family's symbolic trace."""
        f = self.d.get(family_key(key, tpos, tensors, layouts))
        return f is not None and f.plan_for(tensors) is not None

    def lines(self) -> List[str]:
        """describe(): each family's symbolic plan, or why its symbolic trace serves one size."""
        out = []
        for f in self.d.values():
            if f.plan is not None:
                out.append(f"sizes that vary: {sizes_line(f.plan)}")
            elif f.why:
                out.append(f"sizes that vary: a symbolic trace kept for one size: {f.why}")
        return out


# -- the symbolic side of one trace (used by _trace) ----------------------------------------
def new_shape_env() -> Any:
    """A symbolic trace's shape environment: a symbol per size, no duck sizing.

    Reads of values and data-dependent shapes stay refused, as in a trace without one.
    """
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return ShapeEnv(duck_shape=False, allow_scalar_outputs=False, allow_dynamic_output_shape_ops=False)


def symbolic_dispatch(env: Any) -> Any:
    """What runs around a trace: for a symbolic one (``env`` set), torch's Python dispatcher.

    Composites then run their Python decompositions, which keep sizes symbolic (torch 2.11's
    C++ ``masked_fill`` fixed them), as ``make_fx(tracing_mode="symbolic")`` and AOTAutograd
    do. A plain trace: nothing.
    """
    if env is None:
        return contextlib.nullcontext()
    from ._compat import load_enable_python_dispatcher

    return load_enable_python_dispatcher()()


@dataclass
class SymbolicSizes:
    """A plan traced with symbolic sizes: the dimensions left symbolic and the guards on them.

    ``dims``: ``(input, dim)`` of the caller's tensor inputs traced as symbols; ``code``:
    the shape environment's guards over the inputs (``None``: none), evaluated on a call's
    tensors by :meth:`holds` (their sizes only: no device work).
    """

    dims: FrozenSet[Tuple[int, int]]
    env: Any
    code: Optional[str]
    # each symbol's (input, dim), and the outputs that are views of inputs: output index ->
    # (size, stride, offset from the input's) as expressions of the symbols (see :meth:`views_for`)
    symbols: Dict[Any, Tuple[int, int]] = field(default_factory=dict)
    views: Dict[int, Tuple[Tuple[Any, ...], Tuple[Any, ...], Any]] = field(default_factory=dict)
    # every (input, dim) whose size is symbolic: ``dims``, and with ``Layouts`` those sized by
    # an expression of them too (what fuse=True compiles as dynamic)
    symbolic: FrozenSet[Tuple[int, int]] = frozenset()

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the plan is right for these inputs (of the family's other sizes)."""
        return self.code is None or bool(self.env.evaluate_guards_expression(self.code, list(tensors)))

    def views_for(self, tensors: Sequence[torch.Tensor]) -> Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
        """The size, stride and offset of each output that is a view of an input, for these inputs' sizes."""
        num = self.numbers(tensors)
        return {k: (tuple(map(num, size)), tuple(map(num, stride)), num(off))
                for k, (size, stride, off) in self.views.items()}

    def numbers(self, tensors: Sequence[torch.Tensor]) -> Any:
        """A function from a size of the trace (an int, a SymInt, an expression of the symbols) to its value here."""
        values = {sym: int(tensors[i].shape[d]) for sym, (i, d) in self.symbols.items()}

        def num(e: Any) -> int:
            return _number(self.env.replace(e.node.expr) if isinstance(e, torch.SymInt) else e, values)

        return num

    def renamed(self, v: Any, symbols: Dict[Any, Tuple[int, int]], env: Any, hints: Dict[Any, int]) -> Any:
        """A size of this trace as a size of another shape environment's (``symbols``: its symbols' inputs and dims).

        For a trace of the same function that names the same ``(input, dim)`` with other
        symbols (the joint forward and backward of ``_partition``); ``hints``: the values of
        those symbols at the call traced.
        """
        if not isinstance(v, torch.SymInt):
            return int(v)
        by_dim = {where: sym for sym, where in symbols.items()}
        e = self.env.replace(v.node.expr).xreplace({s: by_dim[w] for s, w in self.symbols.items()})
        if e.is_number:
            return int(e)
        return env.create_symintnode(e, hint=int(e.xreplace(hints)))


def symbolic_fakes(env: Any, specs: Sequence[Tuple[Any, ...]], dims: FrozenSet[Tuple[int, int]],
                    paths: Sequence[str], symbols: Dict[Any, Tuple[int, int]],
                    layouts: Optional[Layouts] = None) -> List[Tuple[List[Any], List[Any]]]:
    """The sizes and strides of the stand-ins: a symbol for each dimension of ``dims`` (a contiguous input's).

    ``symbols`` is filled with each symbol's ``(input, dim)``. With ``layouts``, a symbol for
    each of theirs, and the stand-ins laid out by their expressions.
    """
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from ._compat import load_dim_source

    source = load_dim_source()
    out = []
    symbols.clear()
    if layouts is not None:
        return _laid_out_fakes(env, specs, paths, symbols, layouts, source, DimDynamic.DYNAMIC)
    for i, (size, stride, *_rest) in enumerate(specs):
        sizes: List[Any] = list(size)
        strides: List[Any] = list(stride)
        if any((i, d) in dims for d in range(len(size))):
            for d in range(len(size)):
                if (i, d) in dims:
                    src = source(f"{paths[i]}.size({d})")
                    sym = env.create_symbol(size[d], src, DimDynamic.DYNAMIC)
                    symbols[sym] = (i, d)
                    sizes[d] = env.create_symintnode(sym, hint=size[d], source=src)
            acc: Any = 1
            for d in reversed(range(len(size))):  # (the input is row-major: see _symbolic.family_key)
                strides[d] = acc
                acc = acc * sizes[d]
        out.append((sizes, strides))
    return out


def _laid_out_fakes(env: Any, specs: Sequence[Tuple[Any, ...]], paths: Sequence[str], symbols: Dict[Any, Tuple[int, int]],
                    layouts: Layouts, source: Any, dynamic: Any) -> List[Tuple[List[Any], List[Any]]]:
    """:func:`symbolic_fakes` for inputs laid out by :class:`Layouts` (``Family.dims_to_trace`` checked they are)."""
    new: Dict[Any, Any] = {}  # the layouts' symbols -> this trace's
    hints: Dict[Any, int] = {}
    nodes: Dict[Any, Any] = {}
    for old, (i, d) in layouts.where:
        size = int(specs[i][0][d])
        src = source(f"{paths[i]}.size({d})")
        sym = new[old] = env.create_symbol(size, src, dynamic)
        symbols[sym] = (i, d)
        hints[old] = size
        nodes[old] = env.create_symintnode(sym, hint=size, source=src)

    def value(e: Any) -> Any:
        if isinstance(e, int):
            return e
        if e in nodes:
            return nodes[e]
        return env.create_symintnode(e.xreplace(new), hint=int(e.xreplace(hints)))

    return [([value(e) for e in sz], [value(e) for e in st]) if layouts.varies(k) else (list(spec[0]), list(spec[1]))
            for k, (spec, sz, st) in enumerate(zip(specs, layouts.sizes, layouts.strides))]


def holds_for_sizes(env: Any, fakes: Sequence[torch.Tensor], dims: FrozenSet[Tuple[int, int]],
                     paths: Sequence[str], symbols: Dict[Any, Tuple[int, int]],
                     views: Dict[int, Any]) -> Tuple[Optional[SymbolicSizes], str]:
    """The symbolic plan's sizes, or None and where the trace pinned a symbol to its value.

    A symbol the function compared with a constant (``if x.shape[0] == 8``), or converted to
    a Python int, is pinned: the plan holds for that size alone. Outputs that are views of
    inputs keep their sizes as expressions of the symbols (see ``_Tracing._entry``); one
    whose expression holds another symbol (the trace's own) is pinned too.
    """
    for i, d in sorted(dims):
        s = fakes[i].shape[d]
        if not isinstance(s, torch.SymInt) or env.replace(s.node.expr).is_number:
            return None, f"{paths[i]}.size({d}) was fixed to its value{_pin_site(env, s)}"
    def final(e: Any) -> Any:  # (through the trace's replacements: in the input symbols)
        return e if isinstance(e, int) else env.replace(e)

    views = {k: (tuple(map(final, size)), tuple(map(final, stride)), final(off))
             for k, (size, stride, off) in views.items()}
    known = set(symbols)
    for k, (size, stride, off) in views.items():
        for e in (*size, *stride, off):
            if not isinstance(e, int) and not set(e.free_symbols) <= known:
                return None, f"output {k}, a view of an input, has a size of the trace's own ({e})"
    symbolic = frozenset((i, d) for i, f in enumerate(fakes) for d, x in enumerate(f.shape)
                         if isinstance(x, torch.SymInt) and not env.replace(x.node.expr).is_number)
    return SymbolicSizes(frozenset(dims), env, env.produce_guards_expression(list(fakes)), dict(symbols), views,
                         symbolic | frozenset(dims)), ""


_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def concrete(v: Any) -> Any:
    """A value of a symbolic trace with its sizes made this call's numbers (``int()``: which pins them).

    An output ``x.shape[0]``, a ``torch.Size`` or a Python value the function stored: a
    replay hands out constants, so the trace holds for this size alone (see ``holds_for_sizes``).
    """
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, torch.SymFloat):
        return float(v)
    if isinstance(v, torch.SymBool):
        return bool(v)
    if isinstance(v, torch.Size) and any(isinstance(d, torch.SymInt) for d in v):
        return torch.Size(int(d) for d in v)
    return v


def sym_expr(v: Any) -> Any:
    """A size of a symbolic trace as an int, or as its expression of the input symbols (no guard made)."""
    return v.node.expr if isinstance(v, torch.SymInt) else int(v)


def hint(v: Any) -> int:
    """A size of a symbolic trace, this call's value (no guard made where torch knows it)."""
    if isinstance(v, torch.SymInt):
        h = getattr(v.node, "hint", None)  # (a property of SymNode's; a method on another torch)
        h = h() if callable(h) else h
        return int(h) if h is not None else int(v)
    return int(v)


class SymbolicLeak(Exception):
    """A symbolic trace left a size inside an object it returned or stored: the call is traced as is."""


def symbolic_value(v: Any) -> bool:
    return isinstance(v, _SYM_TYPES) or (isinstance(v, torch.Size) and any(isinstance(d, torch.SymInt) for d in v))


def _pin_site(env: Any, s: Any) -> str:
    """Where the shape environment's guard that fixed symbol ``s`` was made (best effort)."""
    node = getattr(s, "node", None)
    sym = getattr(node, "_expr", None)  # (its .expr reads through the replacement: the value)
    for g in getattr(env, "guards", ()):
        expr = getattr(g, "expr", None)
        if sym is not None and expr is not None and sym in getattr(expr, "free_symbols", ()):
            return f" ({expr}, at {getattr(g, 'sloc', '?')})"
    return ""

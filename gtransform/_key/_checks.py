"""The one list of checks a call must pass to replay a signature.

Each :class:`Check` guards one part of a signature and says, in one place, how:

* ``applies(entry)``: whether the signature needs it (a function that writes no input
  in place needs no aliasing check);
* ``code(entry, names)``: straight-line Python lines that reach :data:`FAIL` where a call
  does not match. The generic match of a signature (:func:`build_match`, behind
  :meth:`Entry.match`) and the fast path of its recording (``gtransform._fastpath``) are
  both written from these lines, in the order of :data:`CHECKS`: a check cannot be in one
  and missing from the other. ``names.fast`` tells where a check writes a faster form
  for the fast path (the arguments taken apart by indexing; no ``isinstance`` on state);
* ``explain(entry, call)``: how a call differs, in words (``f.explain``, the log of a
  signature traced again, the retrace warnings).

Adding a guard is adding a :class:`Check` here, and a scenario for it in
``tests/test_key_checks.py``, which makes two calls that differ only in what the check
guards and requires eager's numbers through both paths, and which requires every check
in this list to have one.

What is not a check of the signature: routing (a call that needs gradients goes through
the autograd wrapper, never the fast path) and the recording's own binding (inputs read
in place must be at the addresses it was recorded with), both written by the fast path.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Optional, Sequence

import torch

from .._compat import SDP_FLAG_NAMES, get_deterministic_algorithms, is_any_autocast_enabled, sdpa_flags, tensor_version
from .._trace import plain_layout
from .._tree import leaf_paths, static_leaf_key, tensor_meta
from .._watch import FOR_GRAD
from ._codegen import FAIL, NAMESPACE, Gen, const_check
from ._parts import alias_pattern, attrs_key, dict_orders, has_grad, same_objects

__all__ = ["Call", "Check", "CHECKS", "Names", "build_match"]


class Call:
    """A call as the checks see it: its leaves, structure, static arguments, global settings and tree."""

    __slots__ = ("leaves", "spec", "statics", "glob", "tree", "_paths")

    def __init__(self, leaves: Sequence[Any], spec: Any, statics: Any, glob: Any, tree: Any = None):
        self.leaves = leaves
        self.spec = spec
        self.statics = statics
        self.glob = glob
        self.tree = tree
        self._paths: Optional[List[str]] = None

    @property
    def paths(self) -> List[str]:
        """The leaves' paths (``args[0]['w']``), for messages."""
        if self._paths is None:
            self._paths = leaf_paths(self.tree, statics=self.statics) if self.tree is not None else [f"leaf {i}" for i in range(len(self.leaves))]
        return self._paths


class Names:
    """The names generated check code reads: leaves ``l0...``, the caller's tensors, state ``s0...``.

    ``fast`` is set for the fast path, where ``rec`` is the recording it serves.
    """

    def __init__(self, gen: Gen, leaves: List[str], tpos: Sequence[int], n_state: int, fast: bool, rec: Any = None):
        self.gen = gen
        self.leaves = leaves
        self.user = [leaves[i] for i in tpos]
        self.state = [f"s{k}" for k in range(n_state)]
        self.fast = fast
        self.rec = rec

    @property
    def tens(self) -> List[str]:
        """The caller's tensors, then the state's: the recording's inputs in order."""
        return self.user + self.state


@dataclass(frozen=True)
class Check:
    """One part of a signature: whether it applies, its code, and how a call differs in it."""

    name: str
    guards: str
    applies: Callable[[Any], bool]
    code: Callable[[Any, Names], List[str]]
    explain: Callable[[Any, Call], List[str]]


def _always(e: Any) -> bool:
    return True


# -- the checks, one function group each -----------------------------------------------------------
def _structure_code(e: Any, n: Names) -> List[str]:
    if n.fast:
        return []  # (the fast path's preamble takes the arguments apart by indexing: gen_flatten)
    lines = [f"if spec != {n.gen.const(e.spec)}: {FAIL}"]
    if e.orders:
        lines.append(f"if _orders(tree if tree is not None else _unflatten(spec, leaves)) != "
                     f"{n.gen.const(e.orders)}: {FAIL}")
    return lines


def _structure_explain(e: Any, call: Call) -> List[str]:
    if call.spec != e.spec:
        return [f"the structure of the arguments differs from the recorded one: {call.spec} vs {e.spec}"]
    if e.orders and call.tree is not None and dict_orders(call.tree) != e.orders:
        return [f"the order of a dict's keys differs: {dict_orders(call.tree)} vs {e.orders}"]
    return []


def _statics_code(e: Any, n: Names) -> List[str]:
    return [f"if statics != {n.gen.const(e.statics)}: {FAIL}"]


def _statics_explain(e: Any, call: Call) -> List[str]:
    if call.statics == e.statics:
        return []
    return [f"static arguments {[(w, v) for w, v, _k in e.statics]!r} -> {[(w, v) for w, v, _k in call.statics]!r}"]


_GLOB_NAMES = ("grad mode (torch.is_grad_enabled())", "the default dtype", "autocast",
               "torch.use_deterministic_algorithms", "inference mode", "differentiated by torch.func.grad / vjp")


def _glob_code(e: Any, n: Names) -> List[str]:
    if not n.fast:
        return [f"if glob != {n.gen.const(e.glob)}: {FAIL}"]
    gm, dt, ac, det, inf, for_grad = e.glob
    # (an open forward-AD level: its dual tensors take the generic path, which runs them eagerly)
    lines = [f"if _grad_enabled() is not {gm!r} or _default_dtype() is not {n.gen.const(dt)} "
             f"or _deterministic() is not {det!r} or _inference_mode() is not {inf!r} "
             f"or FWAD._current_level >= 0: {FAIL}",
             f"if _any_autocast(): {FAIL}" if ac is None else FAIL]
    if for_grad:  # (a signature of calls under torch.func.grad never serves a plain call)
        lines.append(FAIL)
    return lines


def _glob_explain(e: Any, call: Call) -> List[str]:
    return [f"{name}: {old} -> {new}" for name, old, new in zip(_GLOB_NAMES, e.glob, call.glob) if old != new]


def _consts_code(e: Any, n: Names) -> List[str]:
    return [f"if {const_check(n.gen, n.leaves[i], e.const_vals[i])}: {FAIL}" for i, _k in e.consts]


def _consts_explain(e: Any, call: Call) -> List[str]:
    out = []
    tset = set(e.tpos)
    for i, x in enumerate(call.leaves):
        if i in tset:
            if not isinstance(x, torch.Tensor):
                out.append(f"{call.paths[i]}: tensor -> {type(x).__name__}")
            continue
        old_v = e.const_vals.get(i)
        if isinstance(x, torch.Tensor):
            out.append(f"{call.paths[i]}: static {type(old_v).__name__} -> tensor")
            continue
        try:
            same = static_leaf_key(x) == static_leaf_key(old_v)
        except TypeError:
            same = False
        if not same:
            out.append(f"{call.paths[i]}: static value {old_v!r} -> {x!r}")
    return out


def _state_code(e: Any, n: Names) -> List[str]:
    """The state read again where the function reaches it, each the very object it traced where bound.

    (A new object over the same memory, ``m.w = nn.Parameter(m.w.data)``, passes the address
    check, but .grad write-backs and optimizer steps are bound to the traced one: traced again.)
    Under ``torch.func.grad`` (generic path only) a slot may hold the transform's wrapper: the
    tensor under it is the one read.
    """
    g, lines, same = n.gen, [], []
    if not n.fast:
        lines.append("fg = getattr(FOR_GRAD, 'on', False)")
    for k, (slot, const, traced) in enumerate(e.state_src):
        s = n.state[k]
        if slot is None:
            lines.append(f"{s} = {g.const(const, 'S')}")
            continue
        obj = g.const(slot.obj, "S")
        if slot.kind == "path":  # (inside a tuple: through where the tuple is bound)
            lines.append(f"{s} = {g.const(slot, 'S')}.get()")
        elif slot.kind == "grad":
            lines.append(f"{s} = {obj}.grad")
        elif slot.kind == "attr":
            lines.append(f"{s} = {obj}.{slot.key}" if str(slot.key).isidentifier()
                         else f"{s} = getattr({obj}, {slot.key!r})")
        else:
            lines.append(f"{s} = {obj}[{g.const(slot.key, 'S')}]")
        if n.fast:
            if slot.kind == "grad":
                lines.append(f"if {s} is None: {FAIL}")
        else:
            lines.append(f"if fg and isinstance({s}, _Tensor): {s} = _base({s})")
            lines.append(f"if not isinstance({s}, _Tensor): {FAIL}")
        if traced is not None:
            same.append(f"{s} is not {g.const(traced, 'S')}")
    if same:
        lines.append(f"if {' or '.join(same)}: {FAIL}")
    return lines


def _state_explain(e: Any, call: Call) -> List[str]:
    if e.resolve_state() is not None:
        return []
    gone: List[str] = []
    for k, (slot, _const, traced) in enumerate(e.state_src):
        if slot is None:
            continue
        v = slot.get()
        name = e.plan.state_names[k] if k < len(e.plan.state_names) else slot.path
        if not isinstance(v, torch.Tensor):
            gone.append(f"state {name} is gone (its slot holds {type(v).__name__} now)")
        elif traced is not None and v is not traced:
            gone.append(f"state {name} is another tensor now (rebound between calls)")
    return gone or ["a state tensor the function reads is gone or was replaced"]


def _frozen_code(e: Any, n: Names) -> List[str]:
    """Each tensor a frozen host read hangs on: the very object read, at the version counter read.

    (A weak reference's call and an integer compare per tensor: nothing reaches the device.)
    """
    lines = []
    for idx, (ref, version, ptr) in sorted(e.plan.frozen_guard.items()):
        t = n.tens[idx]
        # (the data pointer: `t.data = other` keeps the object and its version counter)
        lines.append(f"if {t} is not {n.gen.const(ref, 'F')}() or _version({t}) != {version!r} "
                     f"or {t}.data_ptr() != {ptr!r}: {FAIL}")
    return lines


def _frozen_explain(e: Any, call: Call) -> List[str]:
    ts = [call.leaves[i] if i < len(call.leaves) else None for i in e.tpos] + list(e.resolve_state() or [])
    out = []
    for idx, (ref, version, ptr) in sorted(e.plan.frozen_guard.items()):
        t = ts[idx] if idx < len(ts) else None
        name = e.plan.in_paths[idx]
        site = next((r.site for r in e.plan.frozen if idx in r.deps), "?")
        if t is not ref():
            out.append(f"{name} is another tensor now (a value read on the host at {site} was frozen from it)")
        elif isinstance(t, torch.Tensor) and tensor_version(t) != version:
            out.append(f"{name} was written in place since the recording (version {version} -> "
                       f"{tensor_version(t)}; a value read on the host at {site} was frozen from it)")
        elif isinstance(t, torch.Tensor) and t.data_ptr() != ptr:
            out.append(f"{name} holds other memory since the recording (`.data =`; a value read on the host "
                       f"at {site} was frozen from it)")
    return out


def _values_code(e: Any, n: Names) -> List[str]:
    """Each plain Python value the function names (a global, a closure cell...): the value traced with."""
    lines = []
    for _path, where, key, value in e.plan.py_values:
        v, w = n.gen.tmp(), n.gen.const(where, "W")
        read = (f"{w}.get({key!r}, _MISSING)" if type(where) is dict else f"_cell({w})"
                if type(where) is _CellType else f"getattr({w}, {key!r}, _MISSING)")
        lines += [f"{v} = {read}", f"if {const_check(n.gen, v, value)}: {FAIL}"]
    return lines


def _values_explain(e: Any, call: Any) -> List[str]:
    out = []
    for path, where, key, value in e.plan.py_values:
        now = _read_value(where, key)
        if static_leaf_key(now) != static_leaf_key(value):
            out.append(f"{path} is {'gone' if now is _MISSING else repr(now)} now (traced with {value!r}: "
                       "a Python value the function reads, frozen into the recording)")
    return out


_MISSING = object()
_CellType = types.CellType


def _cell(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # (an empty cell: `del` of the name)
        return _MISSING


def _read_value(where: Any, key: str) -> Any:
    if type(where) is dict:
        return where.get(key, _MISSING)
    return _cell(where) if type(where) is _CellType else getattr(where, key, _MISSING)


def _grad_none_code(e: Any, n: Names) -> List[str]:
    return [f"if {n.gen.const(t, 'G')}.grad is not None: {FAIL}" for t in e.grad_none]


def _grad_none_explain(e: Any, call: Call) -> List[str]:
    return [f"a .grad the recording makes is there before the call ({type(t).__name__} of shape {tuple(t.shape)})"
            for t in e.grad_none if t.grad is not None]


def _copied(names: Sequence[str], static_idx: Sequence[int]) -> List[str]:
    """The names of the inputs the recording copies: all but those it reads in place (``static_idx``)."""
    sset = set(static_idx)
    return [u for i, u in enumerate(names) if i not in sset]


def _same_code(e: Any, n: Names) -> List[str]:
    user = n.user
    if not n.fast or e.same:
        return [f"if _same([{', '.join(user)}]) != {e.same!r}: {FAIL}"]
    rec = n.rec
    static_user = [i for i in rec.static_idx if i < len(user)]
    ptrs = [rec.static_ptrs[k] for k, i in enumerate(rec.static_idx) if i < len(user)]
    if len(set(ptrs)) != len(ptrs):
        return [f"if len(set(map(id, ({''.join(u + ', ' for u in user)})))) != {len(user)}: {FAIL}"]
    # inputs read in place at distinct recorded addresses cannot be one object (the
    # recording's address check sees it, and TensorGuards refuses repeated tensors too); one
    # of the others that is such an input has its address: only the others are looked at
    others = _copied(user, static_user)
    out = []
    if len(others) > 1:
        out.append(f"if len(set(map(id, ({''.join(u + ', ' for u in others)})))) != {len(others)}: {FAIL}")
    if others and ptrs:
        out.append(f"if not {n.gen.const(frozenset(ptrs), 'P')}.isdisjoint(map(_data_ptr, ({''.join(u + ', ' for u in others)}))): {FAIL}")
    return out


def _same_explain(e: Any, call: Call) -> List[str]:
    ts = [call.leaves[i] for i in e.tpos if isinstance(call.leaves[i], torch.Tensor)]
    if len(ts) != len(e.tpos) or same_objects(ts) == e.same:
        return []
    return [f"which tensor arguments are the same object changed: {e.same or 'none'} -> {same_objects(ts) or 'none'}"]


def _alias_code(e: Any, n: Names) -> List[str]:
    rec = n.rec
    if n.fast and not e.alias and rec.static_idx and len(set(rec.static_ptrs)) == len(rec.static_ptrs):
        # the fast path finds the inputs read in place at their recorded addresses, so in the
        # storages they had then, none shared (a function with many such inputs, a split
        # piece's parameters, an optimizer's state, would otherwise make a storage object of each
        # per call): only the other inputs' storages are looked at
        others = _copied(n.tens, rec.static_idx)
        if not others:
            return []
        mine = n.gen.const(frozenset(rec.gm_args[i].untyped_storage()._cdata for i in rec.static_idx), "A")
        return [f"if _alias_with({mine}, [{', '.join(others)}]): {FAIL}"]
    return [f"if _alias([{', '.join(n.tens)}]) != {e.alias!r}: {FAIL}"]


def alias_with(storages: FrozenSet[int], tensors: Sequence[torch.Tensor]) -> bool:
    """Whether some of ``tensors`` share storage with each other or lie in one of ``storages`` (``_cdata``)."""
    cds = [t.untyped_storage()._cdata for t in tensors]
    return len(set(cds)) != len(cds) or not storages.isdisjoint(cds)


def _alias_explain(e: Any, call: Call) -> List[str]:
    state = e.resolve_state()
    ts = [call.leaves[i] for i in e.tpos]
    if state is None or not all(isinstance(t, torch.Tensor) for t in ts) or alias_pattern(ts + state) == e.alias:
        return []
    return [f"which inputs share memory changed (the function writes an input in place): "
            f"{e.alias or 'none'} -> {alias_pattern(ts + state) or 'none'}"]


def _guard_code(e: Any, n: Names) -> List[str]:
    if e.guard.impl is not None:
        return [f"if not GUARD.check({', '.join(n.tens)}): {FAIL}"]
    return [f"if not GUARD.check([{', '.join(n.tens)}]): {FAIL}"]


def _guard_explain(e: Any, call: Call) -> List[str]:
    out = []
    for k, i in enumerate(e.tpos):
        x = call.leaves[i] if i < len(call.leaves) else None
        if not isinstance(x, torch.Tensor):
            continue
        out += _meta_diffs(call.paths[i], e.guard.metas[k], tensor_meta(x))
    state = e.resolve_state() if e.state_src else []
    for k, t in enumerate(state or ()):
        out += _meta_diffs(f"state {e.plan.state_names[k]}", e.guard.metas[e.n_user + k], tensor_meta(t))
    return out


_META_FIELDS = ((1, "shape"), (3, "dtype"), (2, "strides"), (5, "requires_grad"), (4, "device"), (0, "type"))


def _meta_diffs(label: str, old: Any, new: Any) -> List[str]:
    """Lines "label: field old -> new" for each field of :func:`tensor_meta` that differs."""
    return [f"{label}: {name} {_meta_value(old[j])} -> {_meta_value(new[j])}"
            for j, name in _META_FIELDS if old[j] != new[j]]


def _meta_value(v: Any) -> Any:
    return v.__name__ if isinstance(v, type) else v


def _env_code(e: Any, n: Names) -> List[str]:
    cond = "ENV() != ENVVAL" if n.fast else "check_env and ENV() != ENVVAL"
    n.gen.consts["ENV"], n.gen.consts["ENVVAL"] = e.env, e.env_val
    return [f"if {cond}: {FAIL}"]


def _env_explain(e: Any, call: Call) -> List[str]:
    if e.env() == e.env_val:
        return []
    diff = getattr(e.env, "diff", None)
    return (diff(e.env_val) if diff is not None else None) or [
        "module training flags, attributes, hooks or optimizer hyperparameters changed"]


def _attrs_code(e: Any, n: Names) -> List[str]:
    if e.attrs is None:
        return [f"if {' or '.join(f'{u}.__dict__' for u in n.user)}: {FAIL}"]
    return [f"if ({', '.join(f'_attrs_key({u})' for u in n.user)},) != {n.gen.const(e.attrs)}: {FAIL}"]


def _attrs_explain(e: Any, call: Call) -> List[str]:
    olds = e.attrs or ((),) * len(e.tpos)
    out = []
    for i, old_a in zip(e.tpos, olds):
        x = call.leaves[i] if i < len(call.leaves) else None
        if isinstance(x, torch.Tensor) and attrs_key(x) != old_a:
            out.append(f"{call.paths[i]}: its Python attributes changed ({', '.join(sorted(x.__dict__)) or 'none now'})")
    return out


def _grads_read_code(e: Any, n: Names) -> List[str]:
    return [f"if {' or '.join(f'_has_grad({n.tens[i]})' for i in sorted(e.plan.grad_idx))}: {FAIL}"]


def _grads_read_explain(e: Any, call: Call) -> List[str]:
    return [f"{call.paths[e.tpos[i]]}.grad is set now (the function read it as None)" for i in sorted(e.plan.grad_idx)
            if i < len(e.tpos) and isinstance(call.leaves[e.tpos[i]], torch.Tensor) and has_grad(call.leaves[e.tpos[i]])]


def _layouts_read_code(e: Any, n: Names) -> List[str]:
    return [f"if not ({' and '.join(f'_plain({n.tens[i]})' for i in sorted(e.plan.layout_idx))}): {FAIL}"]


def _layouts_read_explain(e: Any, call: Call) -> List[str]:
    return [f"{call.paths[e.tpos[i]]} is a view into a larger storage now (the function reads its layout)"
            for i in sorted(e.plan.layout_idx) if i < len(e.tpos)
            and isinstance(call.leaves[e.tpos[i]], torch.Tensor) and not plain_layout(call.leaves[e.tpos[i]])]


def _leaves_read_code(e: Any, n: Names) -> List[str]:
    # (an input traced with history must have a grad_fn, one traced as a leaf must not)
    conds = [f"({n.tens[i]}.grad_fn is {'' if h else 'not '}None)" for i, h in sorted(e.plan.leaf_idx.items())]
    return [f"if {' or '.join(conds)}: {FAIL}"]


def _leaves_read_explain(e: Any, call: Call) -> List[str]:
    out = []
    for i, h in sorted(e.plan.leaf_idx.items()):
        x = call.leaves[e.tpos[i]] if i < len(e.tpos) else None
        if isinstance(x, torch.Tensor) and (x.grad_fn is not None) != h:
            out.append(f"{call.paths[e.tpos[i]]} {'is a leaf now' if h else 'has autograd history now'} "
                       "(the function reads is_leaf or grad_fn)")
    return out


def _sdpa_code(e: Any, n: Names) -> List[str]:
    return [f"if _sdpa_flags() != {e.plan.sdpa_flags!r}: {FAIL}"]


def _sdpa_explain(e: Any, call: Call) -> List[str]:
    return [f"scaled_dot_product_attention's {name} kernel: {'allowed' if a else 'off'} -> {'allowed' if b else 'off'} "
            "(torch.nn.attention.sdpa_kernel, torch.backends.cuda.enable_*_sdp)"
            for name, a, b in zip(SDP_FLAG_NAMES, e.plan.sdpa_flags, sdpa_flags()) if a != b]


CHECKS: List[Check] = [
    Check("structure", "the tree structure of the arguments and the order of each dict's keys",
          _always, _structure_code, _structure_explain),
    Check("static arguments", "the values of static_argnums / static_argnames",
          _always, _statics_code, _statics_explain),
    Check("global settings", "grad mode, the default dtype, autocast, deterministic algorithms, inference "
          "mode, torch.func.grad, forward-mode AD", _always, _glob_code, _glob_explain),
    Check("attention backends", "the kernels scaled_dot_product_attention may pick (sdpa_kernel), where the "
          "function calls it", lambda e: e.plan.sdpa_flags is not None, _sdpa_code, _sdpa_explain),
    Check("static values", "the values of the non-tensor leaves (2, 2.0 and True are three; every NaN is one)",
          lambda e: bool(e.consts), _consts_code, _consts_explain),
    Check("state", "the state tensors, read where the function reaches them, each the very object traced "
          "where the recording binds it", lambda e: bool(e.state_src), _state_code, _state_explain),
    Check("Python values", "the numbers, strings and None bound to the globals, closure cells, partial keywords and "
          "class or module attributes the function names (SCALE = 0.5 rebound between calls)",
          lambda e: bool(e.plan.py_values), _values_code, _values_explain),
    Check("frozen reads", "the tensors a host read frozen into the trace hangs on: the very objects, unwritten "
          "(their version counters)", lambda e: bool(e.plan.frozen_guard), _frozen_code, _frozen_explain),
    Check("absent grads", "the .grad the recording makes is not there before the call",
          lambda e: bool(e.grad_none), _grad_none_code, _grad_none_explain),
    Check("same objects", "which tensor arguments are the very same object (a function may branch on a is b)",
          lambda e: e.n_user > 1, _same_code, _same_explain),
    Check("aliasing", "which inputs share memory, where the function writes an input in place",
          lambda e: bool(e.plan.mutated) and e.n_user + len(e.state_src) > 1, _alias_code, _alias_explain),
    # (the conjugate, negative and inference bits of the tensor arguments are part of the key, and
    # TensorGuards checks them with the dispatch keys; where it does not serve a signature, a copied
    # input's bits are resolved by the copy: the recording computes on the values eager sees)
    Check("tensors", "each tensor's type, shape, strides, dtype, device, requires_grad and dispatch keys",
          lambda e: e.n_user + len(e.state_src) > 0, _guard_code, _guard_explain),
    Check("environment", "module training flags, hooks and attributes read, optimizer hyperparameters and "
          "structure, containers' lengths, name bindings", lambda e: e.env is not None, _env_code, _env_explain),
    Check("tensor attributes", "the Python attributes set on tensor arguments (read by the trace)",
          lambda e: e.n_user > 0 and e.reads_attrs, _attrs_code, _attrs_explain),
    Check("grads read", "the .grad of arguments the function read as None", lambda e: bool(e.plan.grad_idx),
          _grads_read_code, _grads_read_explain),
    Check("layouts read", "arguments whose storage offset or layout the function reads own their storage",
          lambda e: bool(e.plan.layout_idx), _layouts_read_code, _layouts_read_explain),
    Check("leafness read", "arguments whose is_leaf or grad_fn the function reads have the same autograd history",
          lambda e: bool(e.plan.leaf_idx), _leaves_read_code, _leaves_read_explain),
]
"""Every check, in the order the generated code runs them (cheap and likely to differ first)."""


_NAMESPACE = dict(
    NAMESPACE, _Tensor=torch.Tensor, _orders=dict_orders, _alias=alias_pattern, _alias_with=alias_with, _same=same_objects,
    _attrs_key=attrs_key, _has_grad=has_grad, _plain=plain_layout, FOR_GRAD=FOR_GRAD, _version=tensor_version,
    _data_ptr=torch.Tensor.data_ptr, _MISSING=_MISSING, _cell=_cell,
    # the global settings' getters (the fast path reads them itself: see _glob_code)
    _grad_enabled=torch.is_grad_enabled, FWAD=torch.autograd.forward_ad,
    _inference_mode=torch.is_inference_mode_enabled, _default_dtype=torch.get_default_dtype,
    _deterministic=get_deterministic_algorithms, _sdpa_flags=sdpa_flags,
    _any_autocast=is_any_autocast_enabled if is_any_autocast_enabled is not None else (lambda: True),
)


def check_lines(e: Any, names: Names, fail: str) -> List[str]:
    """The code of every check that applies to ``e``, in order, with ``fail`` where it gives up."""
    out: List[str] = []
    for c in e.checks:
        out += [line.replace(FAIL, fail) for line in c.code(e, names)]
    return out


def namespace(gen: Gen) -> dict:
    """The names the generated code of the checks reads, and the generator's constants."""
    ns = dict(_NAMESPACE)
    ns.update(gen.consts)
    return ns


def build_match(e: Any) -> Callable[..., Optional[List[torch.Tensor]]]:
    """Write ``e``'s generic match: ``match(leaves, spec, statics, glob, tree, check_env)``.

    It returns the call's state tensors where the call replays ``e``, else None.
    """
    from .._state import functorch_base
    from .._tree import unflatten

    gen = Gen()
    leaves = [f"l{i}" for i in range(e.n_leaves)]
    names = Names(gen, leaves, e.tpos, len(e.state_src), fast=False)
    body = [f"if len(leaves) != {e.n_leaves}: return None"]
    body += [f"{name} = leaves[{i}]" for i, name in enumerate(leaves)]
    body += check_lines(e, names, "return None")
    body.append(f"return [{', '.join(names.state)}]")
    src = "def match(leaves, spec, statics, glob, tree, check_env):\n    try:\n"
    src += "".join(f"        {line}\n" for line in body)
    src += "    except (KeyError, IndexError, TypeError, AttributeError):\n        return None\n"
    ns = namespace(gen)
    ns.update(_base=functorch_base, _unflatten=unflatten, GUARD=e.guard.impl if e.guard.impl is not None else e.guard)
    exec(compile(src, f"<gtransform match of {getattr(e.plan.fn, '__qualname__', 'fn')}>", "exec"), ns)
    match = ns["match"]
    match.source = src
    return match  # type: ignore[no-any-return]

"""The per-call fast path: one generated function per (signature, recording).

Every microsecond on the per-call path counts, so once a signature's
recording is settled, gtransform generates straight-line Python for it that
does the whole call with no loops over generic structures:

1. flatten the arguments by indexing (``args[0]['w']``), checking container
   types and sizes on the way (any surprise -> miss -> generic path);
2. check the static leaves' values and, in one C++ call, every tensor's
   dtype, device, sizes, strides and ``requires_grad``;
3. check that the tensors read in place are at the addresses recorded;
4. copy the other inputs into the static buffers (one ``_foreach_copy_``),
   poison the pool's stale outputs, replay, copy back in-place updates;
5. build the output tree literally (``{'y': o0, 'n': 3}``).

A miss returns ``MISS`` and the caller takes the generic path, which handles
new signatures, autograd, torch.func transforms and every error message.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import optree
import torch

from . import _record
from ._liveness import StaleOutput
from ._signature import alias_pattern, attrs_key, has_grad, same_objects
from ._trace import plain_layout
from ._tree import flatten, static_leaf_key

__all__ = ["MISS", "build_fast_path"]

MISS = object()

STRICT = False
"""Raise when a fast path cannot be built (the test suite sets it), instead of
quietly serving the signature through the generic path."""

_K = optree.PyTreeKind
_SIMPLE_LEAF_TYPES = (int, str, bool, type(None), bytes)


class _Gen:
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


def _gen_flatten(g: _Gen, spec: Any, expr: str, leaves: List[str], sample: Any = None) -> bool:
    kind = spec.kind
    if kind == _K.LEAF:
        name = f"l{len(leaves)}"
        g.lines.append(f"{name} = {expr}")
        leaves.append(name)
        return True
    if kind == _K.NONE:
        g.lines.append(f"if {expr} is not None: return MISS")
        return True
    if kind in (_K.TUPLE, _K.LIST, _K.DICT):
        typ = {_K.TUPLE: "tuple", _K.LIST: "list", _K.DICT: "dict"}[kind]
        v = g.tmp()
        n = spec.num_children
        g.lines.append(f"{v} = {expr}")
        g.lines.append(f"if type({v}) is not {typ} or len({v}) != {n}: return MISS")
        children = spec.children()
        if kind == _K.DICT:
            if type(sample) is dict and len(sample) > 1:
                # key order is part of the signature (optree sorts keys; the function may not)
                g.lines.append(f"if tuple({v}) != {g.const(tuple(sample))}: return MISS")
            for key, child in zip(spec.entries(), children):
                k = repr(key) if type(key) in (str, int) else g.const(key)
                sub = sample[key] if type(sample) is dict else None
                if not _gen_flatten(g, child, f"{v}[{k}]", leaves, sub):
                    return False
        else:
            for i, child in enumerate(children):
                sub = sample[i] if isinstance(sample, (list, tuple)) and i < len(sample) else None
                if not _gen_flatten(g, child, f"{v}[{i}]", leaves, sub):
                    return False
        return True
    return False


def _gen_build(g: _Gen, node: Any, spec: Any) -> Optional[str]:
    """Expression that rebuilds ``node`` (a sample tree of output indices)."""
    kind = spec.kind
    if kind == _K.LEAF:
        return f"o{node}"
    if kind == _K.NONE:
        return "None"
    children = spec.children()
    if kind == _K.TUPLE:
        parts = [_gen_build(g, c, cs) for c, cs in zip(node, children)]
        return None if None in parts else "(" + "".join(p + ", " for p in parts) + ")"  # type: ignore[operator]
    if kind == _K.LIST:
        parts = [_gen_build(g, c, cs) for c, cs in zip(node, children)]
        return None if None in parts else "[" + ", ".join(parts) + "]"  # type: ignore[arg-type]
    if kind == _K.DICT:
        # ``node`` keeps the caller's key order; the spec's children are sorted
        child_of = dict(zip(spec.entries(), children))
        items = []
        for key, c in node.items():
            k = repr(key) if type(key) in (str, int) else g.const(key)
            p = _gen_build(g, c, child_of[key])
            if p is None:
                return None
            items.append(f"{k}: {p}")
        return "{" + ", ".join(items) + "}"
    if kind == _K.NAMEDTUPLE:
        parts = [_gen_build(g, c, cs) for c, cs in zip(node, children)]
        if None in parts:
            return None
        return f"{g.const(spec.type)}(" + ", ".join(parts) + ")"  # type: ignore[arg-type]
    return None


def _const_check(g: _Gen, name: str, value: Any) -> str:
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


_GRAPH_REPLAY = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)


def build_fast_path(owner: Any, entry: Any, rec: Any, pool: Any) -> Any:
    """Generate the fast call of ``entry``'s settled recording ``rec``.

    Returns:
        A function ``fast(root)`` of ``root = (args, kwargs)`` returning the
        output tree, or ``MISS``.
    """
    g = _Gen()
    leaves: List[str] = []
    sample = optree.tree_unflatten(entry.spec, list(range(entry.n_leaves)))  # the recorded key order
    if not _gen_flatten(g, entry.spec, "root", leaves, sample):
        g.lines = ["flat, spec = _flatten(root)", "if spec != SPEC: return MISS"]
        g.lines += [f"l{i} = flat[{i}]" for i in range(entry.n_leaves)]
        leaves = [f"l{i}" for i in range(entry.n_leaves)]
    flat = list(g.lines)
    for i, _k in entry.consts:
        flat.append(f"if {_const_check(g, leaves[i], entry.const_vals[i])}: return MISS")
    # state: read again from where the function reaches it (a module's
    # _parameters, an optimizer's state...), so replaced tensors are seen
    state_names: List[str] = []
    same: List[str] = []  # state that must still be the traced object (see Entry.resolve_state)
    for k, (slot, const, traced) in enumerate(entry.state_src):
        name = f"s{k}"
        state_names.append(name)
        if traced is not None:
            same.append(f"{name} is not {g.const(traced, 'S')}")
        if slot is None:
            flat.append(f"{name} = {g.const(const, 'S')}")
        elif slot.kind == "grad":
            flat.append(f"{name} = {g.const(slot.obj, 'S')}.grad")
            flat.append(f"if {name} is None: return MISS")
        elif slot.kind == "attr":
            flat.append(f"{name} = {g.const(slot.obj, 'S')}.{slot.key}" if str(slot.key).isidentifier()
                        else f"{name} = getattr({g.const(slot.obj, 'S')}, {slot.key!r})")
        else:
            flat.append(f"{name} = {g.const(slot.obj, 'S')}[{g.const(slot.key, 'S')}]")

    if same:
        # a new object over the same memory (`m.w = nn.Parameter(m.w.data)`) passes the
        # address check below, but .grad write-backs and optimizer steps are bound to the
        # traced one: a miss (the generic path traces again)
        flat.append(f"if {' or '.join(same)}: return MISS")
    for t in entry.grad_none:  # a .grad that must not be there (see Entry.grad_none)
        flat.append(f"if {g.const(t, 'S')}.grad is not None: return MISS")

    checks: List[str] = []
    tens = [leaves[i] for i in entry.tpos] + state_names
    if entry.env is not None:
        checks.append("if ENV() != ENVVAL: return MISS")
    # global settings (grad mode, default dtype, autocast) are part of the signature
    gm, dt, ac, det, inf, for_grad = entry.glob
    # (an open forward-AD level: its dual tensors take the generic path, which runs them eagerly)
    checks.append(f"if _grad_enabled() is not {gm!r} or _default_dtype() is not {g.const(dt)} "
                  f"or _deterministic() is not {det!r} or _inference_mode() is not {inf!r} "
                  "or FWAD._current_level >= 0: return MISS")
    checks.append("if _any_autocast(): return MISS" if ac is None else "return MISS")
    if (entry.any_rg and gm) or for_grad:
        # (a signature of calls under torch.func.grad never serves a plain call: see global_key)
        checks.append("return MISS")
    if tens:
        if entry.guard.impl is not None:
            checks.append(f"if not GUARD.check({', '.join(tens)}): return MISS")
        else:
            checks.append(f"if not GUARD.check([{', '.join(tens)}]): return MISS")
    user = [leaves[i] for i in entry.tpos]
    if entry.attrs is None:
        # Python attributes set on an input (read by the trace as they were) are part of the signature
        if user:
            checks.append(f"if {' or '.join(f'{u}.__dict__' for u in user)}: return MISS")
    else:
        checks.append(f"if ({', '.join(f'_attrs_key({u})' for u in user)},) != {g.const(entry.attrs)}: return MISS")
    if entry.plan.grad_idx:
        gr = " or ".join(f"_has_grad({tens[i]})" for i in sorted(entry.plan.grad_idx))
        checks.append(f"if {gr}: return MISS")
    if entry.plan.leaf_idx:
        # the function reads whether these inputs are leaves (is_leaf, grad_fn)
        leaf = " or ".join(f"({tens[i]}.grad_fn is {'' if h else 'not '}None)" for i, h in sorted(entry.plan.leaf_idx.items()))
        checks.append(f"if {leaf}: return MISS")
    if entry.plan.layout_idx:
        # the function reads these inputs' storage offset or layout (see _watch._FnWatch)
        lay = " and ".join(f"_plain({tens[i]})" for i in sorted(entry.plan.layout_idx))
        checks.append(f"if not ({lay}): return MISS")
    if rec.static_idx:
        st = ", ".join(tens[i] for i in rec.static_idx)
        checks.append(f"if list(map(_data_ptr, ({st},))) != PTRS: return MISS")
    esc = rec.escapes is not None
    if entry.plan.mutated and len(tens) > 1:
        checks.append(f"if _alias([{', '.join(tens)}]) != {entry.alias!r}: return MISS")
    if len(user) > 1:
        # the same tensor passed twice is another signature (see _signature.same_objects)
        static_user = [i for i in rec.static_idx if i < len(user)]
        ptrs = [rec.static_ptrs[k] for k, i in enumerate(rec.static_idx) if i < len(user)]
        if entry.same:
            checks.append(f"if _same([{', '.join(user)}]) != {entry.same!r}: return MISS")
        elif len(static_user) < len(user) or len(set(ptrs)) < len(ptrs):
            # (inputs read in place at distinct recorded addresses cannot be one object: the
            # address check above sees it)
            checks.append(f"if len(set(map(id, ({''.join(u + ', ' for u in user)})))) != {len(user)}: return MISS")

    call: List[str] = []
    if rec.copy_idx:
        if rec.copy_base:
            call.append("_copy(BUFS, REC.copy_sources([" + ", ".join(tens) + "]))")
        else:
            call.append(f"_copy(BUFS, [{', '.join(tens[i] for i in rec.copy_idx)}])")
    cuda_replay = _GRAPH_REPLAY is not None and type(rec)._replay is _record.CUDARecording._replay
    bind = [f"ARGS[{i}] = {tens[i]}" for i in rec.static_idx]  # see Recording.bind_statics
    if bind and not cuda_replay:
        call += bind  # the CPU replay runs on them
    call.append("POOL.begin_call(DESC)")
    if rec.returned_inputs:  # see Recording.rescue_returned
        stale = " or ".join(f"type({tens[i]}) is _Stale" for i in rec.returned_inputs)
        call.append(f"if {stale}: REC.rescue_returned([{', '.join(tens)}])")
    if bind and cuda_replay:
        # (bound if a new output generation is captured on them)
        st = "".join(f"{tens[i]}, " for i in rec.static_idx)
        call.append(f"if REC.must_retire: REC._maybe_retire(({st}))")
    else:
        call.append("if REC.must_retire: REC._maybe_retire()")
    if esc:
        call.append("ESC.before_replay()")
    if cuda_replay:
        # CUDAGraph.replay's C method on the active generation's graph: the
        # Python wrappers (Recording._replay, CUDAGraph.replay) cost ~0.5 us
        call.append("_greplay(REC.graph)")
    else:
        call.append("REPLAY()")
    call.append("REC.replays += 1")
    if rec.cb_idx:
        cb = ", ".join(tens[i] for i in rec.cb_idx)
        # an output fed back in and updated in place was poisoned by begin_call, or an input has
        # the conj / neg bit, which the bulk copy refuses (zero-cost try; see copy_back_stale)
        call += ["try:", f"    _cbcopy([{cb}], CBBUFS)", "except RuntimeError:", f"    REC.copy_back_stale([{cb}])"]
    if esc:
        call.append(f"ESC.write(REC.escape_values([{', '.join(tens)}]))")
    for t in rec.grad_cleared:  # see Plan.grad_cleared
        call.append(f"{g.const(t, 'G')}.grad = None")
    if rec.groups:
        call.append("POOL.outstanding.append(REC.handout)")
    plan = entry.plan
    if any(e.kind == "pool" for e in plan.out_entries):
        call.append("objs = REC.handout.objs")
    for idx, e in enumerate(plan.out_entries):
        if e.kind == "const":
            if e.fresh is None:
                call.append(f"o{idx} = {g.const(e.value, 'C')}")
            else:  # see OutEntry.fresh
                call.append(f"o{idx} = {g.const(e.fresh, 'F')}({g.const(e.value, 'C')})")
        elif e.kind == "pool":
            call.append(f"o{idx} = objs[{rec.slots[e.index]}]")
        else:
            src = tens[e.index]
            if e.identical:
                call.append(f"o{idx} = {src}")
            else:
                view = f"{src}.as_strided({tuple(e.size)!r}, {tuple(e.stride)!r}, {src}.storage_offset() + {e.rel_offset})"
                # the conjugate / negative bit the function toggled (z.conj()): see OutEntry.conj
                if e.conj:
                    view += ".conj()"
                if e.neg:
                    view = f"_neg_view({view})"
                call.append(f"o{idx} = {view}")
    n_out = len(plan.out_entries)
    sample = optree.tree_unflatten(plan.out_spec, list(range(n_out)))
    build = _gen_build(g, sample, plan.out_spec)
    call.append("OWNER._hits += 1")
    if build is None:
        call.append(f"return _unflatten(OUTSPEC, [{', '.join(f'o{i}' for i in range(n_out))}])")
    else:
        call.append(f"return {build}")

    text = ["def fast(root):", "    try:"]
    text += ["        " + line for line in flat] or ["        pass"]
    text += ["    except (KeyError, IndexError, TypeError):", "        return MISS"]
    text += ["    " + line for line in checks]
    if pool.lock is not None:
        text += ["    with LOCK:"] + ["        " + line for line in call]
    else:
        text += ["    " + line for line in call]
    src = "\n".join(text) + "\n"
    ns: Dict[str, Any] = {
        "MISS": MISS,
        "GUARD": entry.guard.impl if entry.guard.impl is not None else entry.guard,
        "BUFS": rec.bufs,
        "CBBUFS": rec.cb_bufs,
        "POOL": pool,
        "DESC": owner._desc,
        "REC": rec,
        "REPLAY": rec._replay,
        "ARGS": rec.gm_args,
        "_Stale": StaleOutput,
        "_greplay": _GRAPH_REPLAY,
        "PTRS": list(rec.static_ptrs),
        "_data_ptr": torch.Tensor.data_ptr,
        "LOCK": pool.lock,
        "OWNER": owner,
        "SPEC": entry.spec,
        "OUTSPEC": plan.out_spec,
        "_copy": rec.copier,
        "_cbcopy": rec.cb_copier,
        "_neg_view": torch._neg_view,
        "_copysign": math.copysign,
        "_key": static_leaf_key,
        "_grad_enabled": torch.is_grad_enabled,
        "FWAD": torch.autograd.forward_ad,
        "_inference_mode": torch.is_inference_mode_enabled,
        "_default_dtype": torch.get_default_dtype,
        "_deterministic": getattr(torch._C, "_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled),
        "_any_autocast": getattr(torch._C, "_is_any_autocast_enabled", lambda: True),
        "_alias": alias_pattern,
        "_same": same_objects,
        "_attrs_key": attrs_key,
        "_has_grad": has_grad,
        "_plain": plain_layout,
        "_flatten": flatten,
        "_unflatten": optree.tree_unflatten,
        "ENV": entry.env,
        "ENVVAL": entry.env_val,
        "ESC": rec.escapes,
    }
    ns.update(g.consts)
    exec(compile(src, f"<gtransform fast path of {owner._desc}>", "exec"), ns)
    fast = ns["fast"]
    fast.source = src
    return fast



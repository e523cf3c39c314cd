"""The per-call fast path: one generated function per (signature, recording).

Every microsecond on the per-call path counts, so once a signature's
recording is settled, gtransform generates straight-line Python for it that
does the whole call with no loops over generic structures:

1. take the static arguments apart, flatten the others by indexing (``args[0]['w']``), checking container
   types and sizes on the way (any surprise -> miss -> generic path);
2. run every check of the signature (``_key._checks.CHECKS``: the same code the
   generic match runs), among them the static leaves' values and, in one C++
   call, every tensor's dtype, device, sizes, strides and ``requires_grad``;
3. check that the tensors read in place are at the addresses recorded;
4. copy the other inputs into the static buffers (one ``_foreach_copy_``),
   poison the pool's stale outputs, replay, copy back in-place updates;
5. build the output tree literally (``{'y': o0, 'n': 3}``).

A miss returns ``MISS`` and the caller takes the generic path, which handles
new signatures, autograd, torch.func transforms and every error message.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import optree
import torch

from . import _handed, _record
from ._bind import split
from ._compat import cuda_graph_replay as _GRAPH_REPLAY  # (None: CPU builds)
from ._compat import increment_version, neg_view
from ._key._checks import Names, check_lines, namespace
from ._key._codegen import FAIL, Gen, gen_flatten
from ._liveness import StaleOutput
from ._tree import flatten

__all__ = ["MISS", "build_fast_path"]

MISS = object()

STRICT = False
"""Raise when a fast path cannot be built (the test suite sets it), instead of
quietly serving the signature through the generic path."""

_K = optree.PyTreeKind


def _gen_build(g: Gen, node: Any, spec: Any) -> Optional[str]:
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


def build_fast_path(owner: Any, entry: Any, rec: Any, pool: Any) -> Any:
    """Generate the fast call of ``entry``'s settled recording ``rec``.

    Returns:
        A function ``fast(args, kwargs)`` of the call's arguments as the caller
        passed them (static ones included) returning the output tree, or ``MISS``.
    """
    g = Gen()
    flat, tens = _check_lines(g, entry, rec)
    call = (_replay_lines(g, rec, tens) + _set_lines(g, entry) + _flag_lines(entry, tens)
            + _output_lines(g, entry.plan, rec, tens))
    # the static arguments apart as the generic path takes them (a refused one -> miss)
    text = ["def fast(args, kwargs):", "    try:"]
    if owner._has_static:
        text.append("        args, kwargs, statics = SPLIT(args, kwargs)")
    else:
        text.append("        statics = ()")
    text.append("        root = (args, kwargs)")
    text += ["        " + line for line in flat[0]]
    text += ["    except (KeyError, IndexError, TypeError, AttributeError):", "        return MISS"]
    text += ["    " + line for line in flat[1]]
    if pool.lock is not None:
        text += ["    with LOCK:"] + ["        " + line for line in call]
    else:
        text += ["    " + line for line in call]
    src = "\n".join(text) + "\n"
    ns: Dict[str, Any] = namespace(g)  # (what the checks' code reads, and its constants)
    ns.update(_names(owner, entry, rec, pool))
    exec(compile(src, f"<gtransform fast path of {owner._desc}>", "exec"), ns)
    fast = ns["fast"]
    fast.source = src
    return fast


def _check_lines(g: Gen, entry: Any, rec: Any) -> Tuple[Tuple[List[str], List[str]], List[str]]:
    """The arguments taken apart and every check of the signature (those that may raise, the others); tensor names."""
    leaves: List[str] = []
    sample = optree.tree_unflatten(entry.spec, list(range(entry.n_leaves)))  # the recorded key order
    if not gen_flatten(g, entry.spec, "root", leaves, sample):
        g.lines = ["flat, spec = _flatten(root)", f"if spec != SPEC: {FAIL}"]
        g.lines += [f"l{i} = flat[{i}]" for i in range(entry.n_leaves)]
        leaves = [f"l{i}" for i in range(entry.n_leaves)]
    names = Names(g, leaves, entry.tpos, len(entry.state_src), fast=True, rec=rec)
    # the arguments taken apart (the structure check), then every check of the signature,
    # the same code the generic match runs (see _key._checks)
    flat = [line.replace(FAIL, "return MISS") for line in g.lines] + check_lines(entry, names, "return MISS")
    tens = names.tens
    checks: List[str] = []
    if entry.any_rg and entry.glob[0]:
        # routing, not a check: a call that needs gradients goes through the autograd wrapper
        checks.append("return MISS")
    if rec.static_idx:
        # the recording's binding, not the signature: inputs read in place at the recorded addresses
        st = ", ".join(tens[i] for i in rec.static_idx)
        checks.append(f"if list(map(_data_ptr, ({st},))) != PTRS: return MISS")
    return (flat, checks), tens


def _replay_lines(g: Gen, rec: Any, tens: List[str]) -> List[str]:
    """The inputs copied into the static buffers, the pool's stale outputs poisoned, the replay, the write-backs."""
    call: List[str] = []
    if rec.special:  # buffers handed out, or donated inputs (see _handed)
        call += _special_in(g, rec, tens)
    elif rec.copy_idx:
        if rec.copy_base:
            call.append("_copy(BUFS, REC.copy_sources([" + ", ".join(tens) + "]))")
        else:
            call.append(f"_copy(BUFS, [{', '.join(tens[i] for i in rec.copy_idx)}])")
    cuda_replay = _cuda_replay(rec)
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
        call.append(f"if REC.must_retire or POOL.shared_pins: REC._maybe_retire(({st}))")
    else:
        call.append("if REC.must_retire or POOL.shared_pins: REC._maybe_retire()")
    if rec.escapes is not None:
        call.append("ESC.before_replay()")
    if cuda_replay:
        # CUDAGraph.replay's C method on the active generation's graph: the
        # Python wrappers (Recording._replay, CUDAGraph.replay) cost ~0.5 us
        call.append("_greplay(REC.graph)")
    else:
        call.append("REPLAY()")
    call.append("REC.replays += 1")
    if rec.bump_idx:  # see Recording.bump_idx
        call.append(f"_bump([{', '.join(tens[i] for i in rec.bump_idx)}])")
    if rec.special:
        tl = "[" + ", ".join(tens) + "]"
        if rec.cb_idx:
            call.append(f"_hcopy_back(REC, {tl}, _hskip(OWN, FREED))")
        if rec.donate_idx:
            call.append(f"if GONE: _hinvalidate(REC, {tl}, GONE)")
    elif rec.cb_idx:
        cb = ", ".join(tens[i] for i in rec.cb_idx)
        # an output fed back in and updated in place was poisoned by begin_call, or an input has
        # the conj / neg bit, which the bulk copy refuses (zero-cost try; see copy_back_stale)
        call += ["try:", f"    _cbcopy([{cb}], CBBUFS)", "except RuntimeError:", f"    REC.copy_back_stale([{cb}])"]
    if rec.escapes is not None:
        call.append(f"ESC.write(REC.escape_values([{', '.join(tens)}]))")
    for t in rec.grad_cleared:  # see Plan.grad_cleared
        call.append(f"{g.const(t, 'G')}.grad = None")
    if rec.groups:
        call.append("POOL.outstanding.append(REC.handout)")
    return call


def _special_in(g: Gen, rec: Any, tens: List[str]) -> List[str]:
    """The copy-in of a recording whose buffers were handed out (inputs that are them: no copy) or with donated inputs."""
    tl = "[" + ", ".join(tens) + "]"
    if not rec.copy_idx:
        return [f"OWN, GONE, FREED = {g.const(frozenset(), 'S')}, (), {g.const(frozenset(), 'S')}"]
    if not rec.handed:
        return [f"OWN, GONE, FREED = _hcopy_in(REC, {tl})"]
    # the usual call passes the buffers themselves: checked by identity, inline
    cond = " and ".join(f"{tens[i]} is {g.const(b, 'B')}" for i, b in zip(rec.copy_idx, rec.full_bufs))
    every = g.const(frozenset(rec.copy_idx), "S")
    return [f"if {cond}:", f"    OWN, GONE, FREED = {every}, (), {g.const(frozenset(), 'S')}",
            "else:", f"    OWN, GONE, FREED = _hcopy_in(REC, {tl})"]


def _set_lines(g: Gen, entry: Any) -> List[str]:
    """The Python values the function sets, set as its trace left them (see ``Entry.sets``)."""
    return [f"{g.const(where, 'W')}[{g.const(key, 'K')}] = {g.const(value, 'V')}" for where, key, value in entry.sets]


def _flag_lines(entry: Any, tens: List[str]) -> List[str]:
    """The inputs the function makes require grad, set so on the caller's tensors (see ``Plan.input_flags``)."""
    return [f"{tens[i]}.requires_grad_({flag!r})" for i, flag in sorted(entry.plan.input_flags.items())]


def _output_lines(g: Gen, plan: Any, rec: Any, tens: List[str]) -> List[str]:
    """The output tree built literally (``{'y': o0, 'n': 3}``) from the pool, the inputs and constants."""
    call: List[str] = []
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
    return call


def _names(owner: Any, entry: Any, rec: Any, pool: Any) -> Dict[str, Any]:
    """What the generated code reads besides the checks' names: the recording, its buffers, the pool."""
    return {
        "MISS": MISS,
        "SPLIT": functools.partial(split, owner._desc, owner._static_argnums, owner._static_argnames),
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
        "OUTSPEC": entry.plan.out_spec,
        "_copy": rec.copier,
        "_cbcopy": rec.cb_copier,
        "_neg_view": neg_view,
        "_bump": increment_version,
        "_flatten": flatten,
        "_unflatten": optree.tree_unflatten,
        "ESC": rec.escapes,
        "_hcopy_in": _handed.copy_in,
        "_hcopy_back": _handed.copy_back,
        "_hskip": _handed.skip_set,
        "_hinvalidate": _handed.invalidate,
    }


def _cuda_replay(rec: Any) -> bool:
    """Whether the fast path calls CUDAGraph.replay's C method itself (a CUDA recording of the stock kind)."""
    return _GRAPH_REPLAY is not None and type(rec)._replay is _record.CUDARecording._replay

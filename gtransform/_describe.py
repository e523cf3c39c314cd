"""Introspection: what a graphified function would record, has recorded, and why a call would not replay.

``f.trace(...)`` traces without recording (``_lookup`` with ``record=False``),
``f.describe()`` lists this thread's signatures and what they hold, ``f.explain(...)``
asks each check of the closest signature how the call differs (``Entry.explain``); the
signatures ``on_break`` runs split or eagerly are said so (``_breaks``).
Nothing here records, replays or changes the cache.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from ._bind import bind
from ._breaks import describe_lines, explain_line
from ._key import Call, Entry, call_key, global_key
from ._lookup import lookup, thread_state
from ._sized import describe_lines as size_lines
from ._sized import explain_line as size_line
from ._sized import pad_size
from ._symbolic import sizes_line
from ._tree import leaf_paths, unflatten

__all__ = ["trace", "describe", "explain"]


def trace(g: Any, args: Any, kwargs: Any) -> torch.fx.GraphModule:
    """What a call with these arguments would record (see ``Graphified.trace``)."""
    b = bind(g, args, kwargs)
    found = lookup(g, thread_state(g), Call(b.leaves, b.spec, b.statics, global_key(), b.tree), record=False)
    assert found is not None
    return found[0].plan.gm


def describe(g: Any) -> str:
    """This thread's signatures of ``g`` and what each holds (see ``Graphified.describe``)."""
    st = g._tls.__dict__.get("state")
    entries = list(st.cache.values()) if st is not None else []
    lines = [f"{g._desc}: {len(entries)} signature(s) in this thread; cache {g.cache_info()}"]
    pools = _pool_bytes() if any(e.rec is not None and e.cuda for e in entries) else {}
    for n, e in enumerate(entries):
        lines += _signature_lines(n, e, pools)
    for what, count in g._eager_calls.items():
        lines.append(f"ran eagerly, not recorded: {count} call(s) {what}")
    lines += describe_lines(g) + size_lines(g)
    if st is not None:
        lines += st.families.lines()
    for h in list(g._vmapped.values()):
        lines.append("calls under torch.func.vmap, recorded as " + h.describe().replace("\n", "\n  "))
    return "\n".join(lines)


def _short(v: Any) -> str:
    """A static value for describe(): its repr, cut at 80 characters."""
    try:
        r = repr(v)
    except Exception as e:  # (a user's __repr__ that raises: describe() still describes)
        r = f"<{type(v).__name__} object: repr() raised {type(e).__name__}>"
    return r if len(r) <= 80 else r[:77] + "..."


def _signature_lines(n: int, e: Entry, pools: Dict[Any, int]) -> List[str]:
    rec = e.rec
    backend = "cuda" if e.cuda else "cpu"
    parts = [p for p in e.parts.values() if p is not None]
    how = "recorded" if rec else ("differentiated: a forward and a backward recorded" if parts else "traced only")
    count = f", {rec.replays} replays{' of the plain call' if parts else ''}" if rec else ("" if parts else ", 0 replays")
    lines = [f"signature {n} ({backend}, {e.plan.op_count} ops traced, {how}{count}):"]
    for p in parts:
        fw, bw = p.fw.cache_info(), p.bw.cache_info()
        lines.append(f"  calls that need grad: {p.fw._desc} ({fw.hits + fw.misses} call(s)) and {p.bw._desc} "
                     f"({bw.hits + bw.misses} call(s)), each described by its own describe()")
    static = set(rec.static_idx) if rec else set()
    for i, path in enumerate(e.plan.in_paths):
        meta = e.guard.metas[i]
        how = "read in place" if i in static else ("copied" if rec else "-")
        if e.handed and i in e.handed:
            how += "; its buffer handed out by input_buffers: passing it copies nothing"
        if rec is not None and i in getattr(rec, "donate_idx", ()):
            how += "; donated"
        if i in e.plan.mutated:
            how += ", updated in place"
        what = "state" if i >= e.n_user else "in   "
        lines.append(f"  {what} {path}: {meta[3]} {list(meta[1])} ({how})")
    if e.statics or e.const_vals:
        paths = leaf_paths(unflatten(e.spec, [0] * e.n_leaves), statics=e.statics)
        for w, v, _k in sorted(e.statics, key=lambda s: (isinstance(s[0], str), s[0])):
            lines.append(f"  static {f'args[{w}]' if isinstance(w, int) else f'kwargs[{w!r}]'}: {_short(v)}")
        for i, v in e.const_vals.items():
            lines.append(f"  static {paths[i]}: {_short(v)}")
    for k, oe in enumerate(e.plan.out_entries):
        if oe.kind == "const":
            lines.append(f"  out {k}: constant {_short(oe.value)}")
        elif oe.kind == "input":
            lines.append(f"  out {k}: {'the' if oe.identical else 'a view of the'} caller's input {e.plan.in_paths[oe.index]}")
        else:
            lines.append(f"  out {k}: pool tensor")
    reads: Dict[Any, List[str]] = {}
    for r in e.plan.frozen:
        reads.setdefault((r.op, r.site, r.deps), []).append(r.value)
    for (op, site, deps), values in reads.items():
        on = ", ".join(e.plan.in_paths[i] for i in deps) or "constants"
        seen = values[0] if len(values) == 1 else f"{len(values)} reads, first {values[0]}"
        lines.append(f"  frozen host read: {op} at {site}, hangs on {on} (identity and version "
                     f"checked on every call): {seen}")
    if e.plan.py_values:
        shown = ", ".join(f"{path}={_short(v)}" for path, _w, _k, v in e.plan.py_values[:8])
        more = f" and {len(e.plan.py_values) - 8} more" if len(e.plan.py_values) > 8 else ""
        lines.append(f"  Python values read from names (checked on every call; a new value traces again): {shown}{more}")
    for slot in e.plan.escape_slots:
        lines.append(f"  written back after each call: {slot.path}")
    for c in e.plan.py_changes:
        lines.append(f"  Python value changed while tracing (not replayed): {c.path}: {c.old!r} -> {c.new!r}")
    if e.plan.sizes is not None:
        lines.append(f"  sizes: {sizes_line(e.plan)}"
                     + ("; this signature was not traced, only recorded" if e.plan.shared else ""))
    if e.plan.touches_state:
        if e.eager_first:
            lines.append("  first call: ran eagerly (the signature touches state); recorded on the second call")
        elif not e.plan.shared:
            lines.append("  first call: recorded (the state it touches exists already: another size's first "
                         "call made it)")
        if e.env is not None:
            lines.append(f"  also keyed on: {getattr(e.env, 'describe', 'module and optimizer settings')}")
    if rec:
        lines.append(_bytes_line(rec, pools))
    return lines


def _pool_bytes() -> Dict[Any, int]:
    """Device memory reserved by each private pool (CUDA graph pools), by pool id."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out: Dict[Any, int] = {}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid != (0, 0):
            out[pid] = out.get(pid, 0) + int(seg["total_size"])
    return out


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB" if n >= 2 ** 20 else f"{n} B"


def _bytes_line(rec: Any, pools: Dict[Any, int]) -> str:
    """What a recording holds: static buffers, its output generations, the pools they live in."""
    blocks = {w.data_ptr() for w in getattr(rec, "shared_inputs", ())}
    own = shared_in = 0
    for b in getattr(rec, "full_bufs", rec.bufs):
        if b.data_ptr() in blocks and b.storage_offset() == 0:
            shared_in += b.numel() * b.element_size()
        else:
            own += b.untyped_storage().nbytes()
    buf = _mib(own + shared_in)
    if shared_in:
        buf += f" ({'' if not own else _mib(shared_in) + ' '}over memory shared with the pool's other signatures)"
    per_gen = sum(grp.base.untyped_storage().nbytes() for grp in rec.groups)
    line = (f"  bytes: static input buffers {buf}; outputs {_mib(per_gen)} per generation, "
            f"{len(rec.ring) or 1} generation(s)")
    if rec.backend == "cuda":
        own = sum(pools.get(tuple(s.pool_id), 0) for s in rec.ring if s.pool_id is not None)
        shared = pools.get(tuple(rec.pool.cuda_pool), 0) if rec.pool.cuda_pool is not None else 0
        if rec.released:
            line += "; the first generation's outputs shared with the pool's other signatures (given back while idle)"
        line += (f" (later generations' own pools: {_mib(own)}); the function's graph pool, intermediates "
                 f"included, shared by its signatures: {_mib(shared)} reserved")
    return line


def explain(g: Any, args: Any, kwargs: Any) -> str:
    """Whether a call with these arguments would replay, and if not, why (see ``Graphified.explain``)."""
    b = bind(g, args, kwargs)
    st = g._tls.__dict__.get("state")
    entries = list(st.cache.values()) if st is not None else []
    call = Call(b.leaves, b.spec, b.statics, global_key(), b.tree)
    sz = g._sizes
    if sz is not None:
        n = pad_size(sz, args, kwargs)[0] if sz.buckets is not None else sz.size_of(b.leaves, b.spec, note=False)
        said = size_line(g, n)
        if said is not None:
            return said
    if g._breaks is not None:
        said = explain_line(g, st, call_key(g._desc, b.leaves, b.spec, b.tree, b.statics, call.glob).key)
        if said is not None:
            return said
    if any(e.match(call) is not None for e in entries):
        return f"{g._desc}: replays a recorded signature (hit)"
    if not entries:
        return f"{g._desc}: nothing recorded yet in this thread (miss)"
    best, best_diff = None, None
    for e in entries:
        if e.spec != b.spec:
            continue
        diff = e.explain(call)
        if best_diff is None or len(diff) < len(best_diff):
            best, best_diff = e, diff
    if best is None:
        return (f"{g._desc}: a new signature (miss): the structure of the arguments differs "
                f"from every recorded one: {b.spec} vs {entries[-1].spec}")
    said = f"{g._desc}: a new signature (miss): " + "; ".join(best_diff or ["aliasing between inputs"])
    ck = call_key(g._desc, b.leaves, b.spec, b.tree, b.statics, call.glob)
    if st is not None and st.families.shared_for(ck.key, ck.tpos, [b.leaves[i] for i in ck.tpos],
                                                 g.__dict__.get("_layouts")):
        said += " (recorded from the symbolic trace of its sizes, not traced)"
    return said

"""Finding a call's signature, or tracing a new one: the second stage of a call.

It takes the flat leaves of a call (from ``_bind``) and gives the next stage
(``_replay``) the signature's :class:`~gtransform._key.Entry` and the call's tensors (the
caller's, then the state the function reads), or ``None`` when the call must run eagerly:
the first call of a signature that touches state (so that lazily made state, such as
optimizer moments, exists as real tensors before anything is recorded), a call whose
trace raised the function's own exception (eager raises it again, after eager's side
effects), lazy modules not yet initialised, a signature whose trace read the call's own
data under ``on_break="split"``/``"eager"`` (``_breaks`` runs it).

Whether a call matches a signature is :mod:`gtransform._key`'s answer; this module keeps
the books around it: the thread's cache (``_cache.ThreadState``), alternates, the
eager-first-call marks, the storm warnings' notes, and the trace itself (``_trace``).
It never records or replays.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._bind import rebuild as rebuild_statics
from ._breaks import mark, routes
from ._cache import ThreadState
from ._eager import ran_lazy, trace_failed
from ._errors import GraphifyError
from ._key import Call, Entry, call_key, env_key_fn, global_key, makes_no_state, reusable_after_eager
from ._key._call import CallKey
from ._log import log
from ._roots import find_roots, lazy_error, uninitialized_modules
from ._snapshot import change_error
from ._symbolic import dim_names, family_key, shared_plan
from ._trace import trace
from ._tree import unflatten

__all__ = ["thread_state", "entry_for", "lookup"]

def thread_state(g: Any) -> ThreadState:
    """The calling thread's signatures of graphified ``g`` (made at its first call in the thread)."""
    st = g._tls.__dict__.get("state")
    if st is None:
        st = g._new_state()
    if st.clear_requested:  # cache_clear() in another thread (see Graphified.cache_clear)
        st.clear()
    return st  # type: ignore[no-any-return]


def entry_for(g: Any, leaves: List[Any], spec: Any, statics: Any, tree: Any = None,
              grad_mode: Optional[bool] = None) -> Tuple[Optional[Entry], ThreadState, List[torch.Tensor]]:
    """The entry of this call's signature (looked up or traced), the thread's state, and the call's tensors.

    The tensors are the caller's tensor leaves followed by the state the function reads.
    The entry is ``None`` when this call must run eagerly.
    """
    st = thread_state(g)
    call = Call(leaves, spec, statics, global_key(grad_mode), tree if tree is not None else unflatten(spec, leaves))
    e = st.last
    if e is not None:
        state = e.match(call)
        if state is not None:
            g._hits += 1
            return e, st, [leaves[i] for i in e.tpos] + state
    found = lookup(g, st, call, record=True)
    if found is None:
        return None, st, []
    e, state = found
    return e, st, [leaves[i] for i in e.tpos] + state


def lookup(g: Any, st: ThreadState, call: Call, record: bool) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
    """Find or trace the signature of a call: the entry and the call's state tensors, or ``None`` (eager)."""
    ck = call_key(g._desc, call.leaves, call.spec, call.tree, call.statics, call.glob)
    if record and ck.key in st.eager_only:
        st.eager_now = True  # (counted as it runs: see _eager.eager)
        return None
    if record and ck.key in st.broken:
        st.broke_now = True  # (run as on_break says: see _breaks.run_broken)
        return None
    found = _cached(g, st, ck.key, call, record)
    if found is not None:
        return found
    g._misses += 1
    g._storm.note(call.spec, ck.parts, call.paths, call.statics, stacklevel=5, calls=g._hits + g._misses,
                  maxsize=g._maxsize)
    return _new_signature(g, st, ck, call, record)


def _cached(g: Any, st: ThreadState, key: Any, call: Call, record: bool) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
    """The cached entry of ``key`` (or an alternate of it) this call replays; a stale one is put aside or dropped."""
    e = st.cache.get(key)
    env_only = grads_only = False
    if e is not None:
        state = e.match(call)
        if state is not None:
            st.cache.move_to_end(key)
            if record:
                g._hits += 1
            st.last = e
            return e, state
        env_only = e.env_only_mismatch(call)
        grads_only = not env_only and (e.grads_came_or_went(call.leaves) or e.frozen_only_mismatch(call))
    alts = st.alts.get(key)
    if alts and (env_only or grads_only or e is None):
        for a in alts:
            state = a.match(call)
            if state is not None:
                # switched back (model.train() after model.eval()): that recording again
                alts.remove(a)
                if e is not None:
                    st.set_aside(e)
                st.cache[key] = a
                if record:
                    g._hits += 1
                st.last = a
                return a, state
    if e is not None:
        _forget(g, st, key, e, call, env_only, grads_only, record)
    return None


def _forget(g: Any, st: ThreadState, key: Any, e: Entry, call: Call, env_only: bool, grads_only: bool,
            record: bool) -> None:
    """A cached signature the call no longer matches: kept as an alternate, or dropped; noted for the warnings."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s: tracing a signature again: %s", g._desc, "; ".join(e.explain(call)) or "its state changed")
    if e.plan.touches_state and (not (env_only and e.env_keeps_lazy_state()) and not grads_only
                                 or any(q.grad is not None for q in e.opt_grad_none)):
        # what changed may have emptied lazily created state (optimizer.state.clear(),
        # load_state_dict), or the step will make some (a parameter with a .grad now, its
        # momentum): the next call runs eagerly again before anything is traced
        st.warmed.discard(key)
    if grads_only:
        st.set_aside(e)  # kept: gradient accumulation switches back (see Entry.grads_came_or_went)
    elif env_only:
        st.set_aside(e)  # kept: a switch back replays it
        if record:
            g._storm.note_env(e.env.diff(e.env_val) if hasattr(e.env, "diff") else [],
                              g._hits + g._misses, stacklevel=6)
    else:
        st.drop(e)
        if record:
            g._storm.note_retrace(e.explain(call), g._hits + g._misses, stacklevel=6)


def _new_signature(g: Any, st: ThreadState, ck: CallKey, call: Call,
                   record: bool) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
    """A signature not in the cache: the first call's trace kept for it, or a new trace; ``None``: eager."""
    pending = st.pending.pop(ck.key, None) if st.pending else None
    if pending is not None and record:
        # the second call of a signature that touches state: the first call's trace, if this
        # call matches it (not traced again: for a model, most of a second's worth of first
        # call on a GPU host); state with autograd history (a cache written outside no_grad
        # by the eager call) is not in the guards: traced again, where it is refused
        state = pending.match(call)
        if state is not None and not any(t.grad_fn is not None for t in state):
            st.insert(ck.key, pending, g._maxsize, g._storm.note_evicted)
            return pending, state
        log.info("%s: the first call's trace no longer matches (the eager call changed what it "
                 "reads); tracing again", g._desc)
    leaves, paths = call.leaves, call.paths
    cuda = ck.device is not None and ck.device.type == "cuda"
    tensors = [leaves[i] for i in ck.tpos]
    extra = [(paths[i], x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
    extra += [(f"static {w}", v) for w, v, _k in call.statics]
    roots = find_roots(g._fn, extra)  # the Python state the function reaches (see _state)
    lazy = uninitialized_modules(roots)
    if lazy:
        if not record:
            raise lazy_error(g._desc, lazy)
        ran_lazy(g, lazy)
        return None
    rebuild = _rebuilder(call, ck)
    if g._fuse and cuda and record:
        from .fuse import warm_pool  # the fused backend: loaded for fuse=True alone

        warm_pool()  # inductor's compile workers start while the function is traced
    in_paths = [paths[i] for i in ck.tpos]
    fam = dims = None
    if record:
        layouts = g.__dict__.get("_layouts")  # (a half of a symbolic partition: see _partition)
        fam = st.families.get(family_key(ck.key, ck.tpos, tensors, layouts), tensors, layouts)
        found = _family_plan(g, st, ck, call, fam, tensors, cuda)
        if found is not None:
            return found
        dims = fam.dims_to_trace(tensors)
    seen = st.frozen_args
    stable = [k for k, (p, t) in enumerate(zip(in_paths, tensors)) if any(r() is t for r in seen.get(p, ()))]
    try:
        plan = _trace_sizes(g, fam, dims, rebuild, tensors, in_paths, cuda, roots, extra, stable)
    except GraphifyError as err:
        if _reads_new_arguments(g, st, ck.key, err, in_paths, tensors, record):
            return None
        if (record and ck.key not in st.warmed and getattr(err, "gt_touched_state", False)
                and not getattr(err, "gt_own_data", False) and not (st.warmed and routes(g, err))):
            # state may be created lazily by the first call (a cache allocated on first
            # use): run it eagerly, and trace again on the next call (once the function has
            # run such a call, a read on_break takes is routed: a new shape on every call
            # would otherwise run eagerly, traced, on every call)
            st.warmed.add(ck.key)
            log.info("%s: the first trace failed after reading state (%s); this call runs "
                     "eagerly, the next one traces again", g._desc, str(err).splitlines()[0])
            return None
        if record and routes(g, err):
            mark(g, st, ck.key, err)  # a read of the call's own data: on_break="split" or "eager"
            st.broke_now = True
            return None
        raise
    except Exception as err:
        trace_failed(g, st, ck.key, err, [paths[i] for i in ck.tpos], tensors, record)
        return None
    # (the objects seen stay: a train and a validation graph frozen in turn; a third new one is data)
    if ck.device is None and plan.uses_cuda and torch.cuda.is_available():
        cuda = True
    found = _settle(g, st, ck, call, plan, cuda, record,
                    sibling_warm=fam is not None and fam.state_exists(st.warmed))
    if fam is not None:
        fam.state_made(ck.key, st.warmed)
        fam.traced(plan, dims or frozenset(), st.cache.get(ck.key) or st.pending.get(ck.key), g._desc)
    return found


def _trace_sizes(g: Any, fam: Any, dims: Any, rebuild: Any, tensors: List[torch.Tensor], in_paths: List[str],
                 cuda: bool, roots: Any, extra: Any, stable: List[int]) -> Any:
    """The trace of a new signature: symbolic over ``dims`` (see ``_symbolic``) where given, else as is.

    A symbolic trace that fails is traced again as is, which raises what the call does wrong
    (a size the function refuses: one of the family's tries, and a later size may still be
    traced symbolically); where the call traces as is, the failure was the symbolic trace's,
    and the family takes no more.
    """
    if not dims:
        return trace(g._fn, rebuild, tensors, in_paths, g._desc, cuda, roots, extra, stable)
    try:
        return trace(g._fn, rebuild, tensors, in_paths, g._desc, cuda, roots, extra, stable, dims, fam.layouts)
    except Exception as err:
        failed = err
    fam.failed_once()  # (the call's own failure, if the trace as is raises too)
    plan = trace(g._fn, rebuild, tensors, in_paths, g._desc, cuda, roots, extra, stable)
    fam.give_up(failed, g._desc)
    return plan


def _family_plan(g: Any, st: ThreadState, ck: CallKey, call: Call, fam: Any, tensors: List[torch.Tensor],
                 cuda: bool) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
    """A new size of a family whose symbolic plan holds for it: a new signature, not traced.

    Recorded on this call (the family's first size ran the eager first call that makes lazy
    state); where the state it reads is no longer the plan's (a module's tensors replaced),
    the plan is dropped and the call traced.
    """
    plan = fam.plan_for(tensors)
    if plan is None:
        return None
    e = new_entry(g, ck, call, shared_plan(plan, g._fuse and cuda, tensors), cuda)
    state = e.match(call) if fam.serves(e) else None
    if state is None:
        fam.forget()
        return None
    st.warmed.add(ck.key)
    st.insert(ck.key, e, g._maxsize, g._storm.note_evicted)
    log.info("%s: a new size of %s, recorded from the symbolic trace", g._desc,
             ", ".join(dim_names(plan, fam.dims)))
    return e, state


def _name_the_arguments(err: GraphifyError, paths: List[str]) -> None:
    """A read of floating-point arguments: name them, and how to have the read frozen if they never change."""
    which = ", ".join(paths)
    what, its, it, same = (("a floating-point argument", "its", "it", "it is the same tensor") if len(paths) == 1
                           else ("floating-point arguments", "their", "them", "they are the same tensors"))
    err.args = (str(err) + f"\nThe read depends on {which}, {what}: {its} values are taken as the call's data. "
                "A value that changes with every call (a loss to log, a stopping test) is read outside: return "
                "it and read it in the caller's loop (every 10 steps for a log), or let Python run the read "
                f"(on_break=\"split\"). If {same} on every call (a time grid, a table) and the read depends on "
                f"nothing the call writes, close over {it} instead of passing {it} (gt.graphify(lambda y0: "
                "fn(y0, t))): reads of tensors the function reaches and never writes are frozen into the "
                "recording and guarded by the tensor's identity and version counter.",)


_FROZEN_CANDIDATES = 2  # tensors remembered per argument whose read may be frozen when passed again (a train and a val graph)


def _reads_new_arguments(g: Any, st: ThreadState, key: Any, err: GraphifyError, in_paths: List[str],
                         tensors: List[torch.Tensor], record: bool) -> bool:
    """Whether a call whose trace read arguments on the host runs eagerly, to freeze them on the next call.

    Only index-like arguments (integer or bool: ``edge_index``, a mask of a graph's structure);
    a floating-point argument is the call's data, and its read stays the trace's error. Its
    arguments read (all else it read unchanged) are remembered: passed again as the very
    same tensors (``edge_index``, a time grid), the next trace freezes the read (see
    ``_frozen``). Where the call before ran eagerly for the same argument and this one passes
    another tensor, the read is of the call's own data: the trace's error stands.
    """
    new = getattr(err, "gt_frozen_args", None)
    if not record or not new:
        return False
    if any(tensors[k].is_floating_point() or tensors[k].is_complex() for k in new):
        if not g.__dict__.get("_dynamo_piece", False):  # (a piece's arguments are not the user's)
            _name_the_arguments(err, [in_paths[k] for k in sorted(new)])
        err.gt_own_data = True  # type: ignore[attr-defined]  # (not a lazily made state's first call: see lookup)
        return False  # (values are the call's data; index-like arguments, integer or bool, its structure)
    seen = st.frozen_args
    if any(len(seen.get(in_paths[k], ())) >= _FROZEN_CANDIDATES for k in new):  # (dropped ones count too)
        # (a new tensor there on call after call: the call's own data, from now on: every later call
        # with another new tensor there is refused too, not run eagerly two calls out of three)
        which = ", ".join(in_paths[k] for k in sorted(new))
        err.args = (str(err) + f"\nThe read depends on {which}: the calls before passed {_FROZEN_CANDIDATES} other "
                    "tensors there (and ran eagerly to freeze the read), so its values are taken as the call's data. "
                    "A graph or mask that stays the same over calls is frozen where the calls pass the very same "
                    "tensor object again (from its second call; guarded by its identity and version counter; a few "
                    "such objects in turn, a train and a validation graph, are each frozen): keep one object per "
                    "graph, or close over it. Graphs that change every call need on_break=\"split\" or \"eager\".",)
        err.gt_own_data = True  # type: ignore[attr-defined]
        return False
    for k in new:
        seen[in_paths[k]] = list(seen.get(in_paths[k], ())) + [weakref.ref(tensors[k])]
    st.warmed.add(key)  # (lazily made state exists after this eager call: see _settle)
    log.info("%s: the trace read %s on the host; this call runs eagerly, and the read is frozen where "
             "the next call passes the very same tensors", g._desc, ", ".join(in_paths[k] for k in sorted(new)))
    return True


def _rebuilder(call: Call, ck: CallKey) -> Callable[[Sequence[torch.Tensor]], Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """How the trace calls the function on its stand-ins of the call's tensors: ``(args, kwargs)`` rebuilt."""
    tpos, spec, statics = ck.tpos, call.spec, call.statics
    # (not the call's tensors: the signature outlives the call, and a tensor it kept alive
    # would be held by the caller's as far as the outputs' liveness can tell)
    tset = set(tpos)
    template = [None if i in tset else x for i, x in enumerate(call.leaves)]
    same = ck.key[2][1]  # which tensor arguments are the same object (see _key._call)

    def rebuild(ts: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        ls = list(template)
        if same:  # the same tensor passed twice: one object, as in eager (`a is b`)
            ts = [ts[k] for k in same] + list(ts[len(same):])
        for p, t in zip(tpos, ts):
            ls[p] = t
        a, kw = unflatten(spec, ls)
        a, skw = rebuild_statics(a, statics)
        if skw:
            kw = dict(kw)
            kw.update(skw)
        return a, kw

    return rebuild


def _settle(g: Any, st: ThreadState, ck: CallKey, call: Call, plan: Any, cuda: bool,
            record: bool, sibling_warm: bool = False) -> Optional[Tuple[Entry, List[torch.Tensor]]]:
    """A new trace's fate: the first call of a signature that touches state runs eagerly, else a new entry.

    Not where another size of the same calls ran its eager first call and is still warm
    (``sibling_warm``, see ``_symbolic.Family.warm``) and this trace made no state
    (``makes_no_state``: no optimizer moment, no Python value changed): the state that eager
    call made lazily exists already, so a training step over a new batch size is recorded on
    its first call.

    Python numbers the trace changed in modules or optimizers (``self.calls += 1`` in
    forward), and in plain dicts and lists of a function that reaches state (a training
    step's accumulation counter): undone, so that this call, run eagerly, does exactly what
    eager does; changed again by a trace after an eager call, they change on every call,
    which a replay cannot do. (A function that reaches no state keeps the trace-time changes
    of its plain dicts, as in JAX: a counter of traces.)
    """
    key = ck.key
    model_changes = [c for c in plan.py_changes if c.model or plan.touches_state]
    after = _places(st, model_changes) if record else {}
    if model_changes and record:
        for c in model_changes:
            c.undo()
        # not refused: attributes and hooks the trace made (a library's lazy set-up for a setting
        # changed since the eager call, e.g. output_hidden_states turned on; the eager call makes
        # them), flags the function sets (model.train() in a step, model.eval() in an eager
        # validation between steps: the replays set them, see Entry.sets), and values the
        # signature's first trace set alike (self.n = x.shape[0], whatever another size's call
        # left there); a count is
        first = st.first_sets.get(key)
        if key in st.warmed and not all(c.made or type(c.new) is bool or _same_set(first, c) for c in model_changes):
            raise change_error(g._desc, model_changes, getattr(plan.attr_reads, "set_at", None))
    if record and key not in st.first_sets:
        st.note_first_sets(key, {(id(c.where), c.key): c.new for c in model_changes})
    ran_eagerly = key in st.warmed  # (this key's first call ran eagerly: describe says so)
    warm = not (plan.touches_state or model_changes) or ran_eagerly
    if not warm and record and sibling_warm and makes_no_state(plan):
        warm = True
        st.warmed.add(key)
    # the first call of a signature that touches state runs eagerly; its trace is kept for
    # the second call where that call can replay it
    keep = warm or not record or (not model_changes and reusable_after_eager(plan))
    e = None
    if keep:
        try:
            e = new_entry(g, ck, call, plan, cuda)
            e.eager_first = ran_eagerly or (record and not warm)
            e.sets = [(where, k, after.get((id(where), k), where.get(k, None))) for where, k in st.places.values()
                      if (id(where), k) in after or k in where]
        except GraphifyError:
            if warm or not record:
                raise
            # (raised by the second call's own trace)
    if record and not warm:
        st.warmed.add(key)
        if log.isEnabledFor(logging.INFO):
            log.info("%s: this signature touches state (%d state tensors, %d written back, %d Python "
                     "values changed): its first call runs eagerly, the next one is recorded",
                     g._desc, len(plan.state), len(plan.escape_slots), len(model_changes))
        if e is not None:
            st.keep_pending(key, e)
        return None
    assert e is not None
    if warm:
        st.insert(key, e, g._maxsize, g._storm.note_evicted)
    # (not warm: f.trace(...) before the first call; not kept)
    return e, list(plan.state)


_SET_TYPES = (int, float, bool, str, type(None))


def _settable(v: Any) -> bool:
    """A value replays can set again: a number, string or None, or a short tuple or torch.Size of them."""
    return type(v) in _SET_TYPES or (type(v) in (tuple, torch.Size) and len(v) <= 16
                                     and all(type(x) in _SET_TYPES for x in v))


def _same_set(first: Optional[Dict[Tuple[int, Any], Any]], c: Any) -> bool:
    """Whether change ``c`` sets what the signature's first trace set there (a constant of the signature)."""
    if first is None or not _settable(c.new):
        return False
    place = (id(c.where), c.key)
    if place not in first:
        # a module's attribute the first trace left as it found it (self.n = 4 where a call of 4
        # had left 4): this value is the signature's. (Not an optimizer's per-parameter state,
        # whose dict the eager first call made anew: a count there is refused.)
        if c.owner is None or c.where is not getattr(c.owner, "__dict__", None):
            return False
        first[place] = c.new
    old = first[place]
    return type(old) is type(c.new) and old == c.new


_UNSET = object()


def _places(st: ThreadState, changes: List[Any]) -> Dict[Tuple[int, Any], Any]:
    """Note the module and object attributes ``changes`` set to Python values; their values after the trace.

    (Not values the trace made where there was none, nor hooks: the eager call makes those.)
    """
    after: Dict[Tuple[int, Any], Any] = {}
    for c in changes:
        where = c.where
        if type(where) is dict and not c.made and not c.rebinds and _settable(c.new):
            place = (id(where), c.key)
            after[place] = c.new
            if place not in st.places and len(st.places) < 64:
                st.places[place] = (where, c.key)
                # the signatures recorded before set nothing there on replay: a trace that found
                # the value it set already there (self.n = 4 after a call of 4) saw no change; they
                # are traced again, and set theirs
                st.drop_recorded()
    return after


def new_entry(g: Any, ck: CallKey, call: Call, plan: Any, cuda: bool) -> Entry:
    """The signature of a trace, refused when a replay could not do what eager does."""
    e = Entry(ck.key, call.spec, call.leaves, ck.tpos, call.statics, plan, cuda)
    # a graph TorchDynamo made (a piece, see _dynamo) reads no Python attribute of its tensors:
    # dynamo guards those its Python read (and ~0.4 us a tensor per call is spared: the piece
    # of a decode step takes every parameter and cache tensor)
    e.reads_attrs = not g.__dict__.get("_dynamo_piece", False)
    if e.after_backward:
        raise _after_backward(g._desc, plan)
    if e.any_rg:
        _refuse_stored_grad_tensors(g._desc, plan)
        _refuse_c10d_collectives(g._desc, plan)
        g._storm.differentiated = True  # (its warning names the cost and the fix, see _storm)
    # a module without tensors (nn.LeakyReLU) has attributes and a training flag too; so does
    # one the function called without the roots leading to it (AttrReads.called)
    if plan.roots or (plan.attr_reads is not None and plan.attr_reads.called):
        e.env = env_key_fn(plan.roots, plan.attr_reads)
        e.env_val = e.env() if e.env is not None else None
    return e


def _after_backward(desc: str, plan: Any) -> GraphifyError:
    """A training step that returns an output made after its backward, which requires grad."""
    return GraphifyError(
        f"{desc}: {plan.after_backward[0]} requires grad and is computed after the function's "
        f"backward (at {plan.backward_at}), in a call that updates parameters (a training step).\n"
        "Why: such a call is replayed, not differentiated again: that output would come back without "
        "its autograd graph, and a loss built from it outside would give the parameters no gradient.\n"
        "Fix: return it .detach()ed if no gradient is needed (a prediction for logging), or compute it "
        "outside the graphified step."
    )


def _refuse_c10d_collectives(desc: str, plan: Any) -> None:
    """Refuse a differentiated call whose graph holds c10d's in-place collectives (``dist.all_reduce``).

    The autograd wrapper re-traces and runs the function's graph in halves, which c10d's
    process-group arguments and in-place results do not survive (a replay read a result the
    collective was still writing: outputs and gradients raced).
    """
    ops = sorted({str(n.target) for n in plan.gm.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "namespace", None) == "c10d"})
    if ops:
        raise GraphifyError(
            f"{desc}: the call is differentiated (an input or parameter requires grad) and the function "
            f"runs torch.distributed's in-place collectives ({', '.join(ops[:3])}).\n"
            "Why: a differentiated call runs through gtransform's autograd wrapper, which cannot carry "
            "c10d's in-place collectives into its forward and backward recordings.\n"
            "Fix: use the functional collectives, which are differentiable "
            "(torch.distributed.nn.functional.all_reduce(x), or torch.distributed._functional_collectives"
            ".all_reduce(x, 'sum', group)), graphify the whole training step (backward inside), or make "
            "the collective under torch.no_grad() in a call that is not differentiated."
        )


def _refuse_stored_grad_tensors(desc: str, plan: Any) -> None:
    """A differentiated call that leaves a tensor requiring grad in Python state: refused with the fix."""
    kept_slots = [s for s, o in zip(plan.escape_slots, plan.escape_entries) if s.kind != "grad" and o.requires_grad]
    if not kept_slots:
        return
    kept = [s.path for s in kept_slots]
    owner = kept_slots[0].obj
    hooks = [h for h in getattr(owner, "_forward_pre_hooks", {}).values()
             if (type(h).__module__ or "").startswith("torch.nn.utils")]
    if hooks:
        # torch.nn.utils.prune, the old weight_norm / spectral_norm: a forward pre-hook
        # recomputes the weight from its parts and stores it on the module each call
        fix = (f"Fix: {type(hooks[0]).__name__} (torch.nn.utils) recomputes {kept[0]} in a forward "
               "pre-hook on every call. Use the parametrization API instead "
               "(torch.nn.utils.parametrizations.weight_norm / spectral_norm, or "
               "torch.nn.utils.parametrize.register_parametrization), make pruning permanent "
               "(torch.nn.utils.prune.remove(module, 'weight')), or call it under torch.no_grad().")
    else:
        fix = (f"Fix: return it as an output of the function instead, or store a detached copy "
               f"({kept[0].rsplit('.', 1)[-1]} = h.detach()) if it is only looked at.")
    raise GraphifyError(
        f"{desc}: the function stores a tensor that requires grad in {kept[0]} (Python "
        "state), and the call is differentiated.\n"
        "Why: a replay writes that tensor back as plain memory after each call; it cannot "
        "carry the autograd graph eager attaches to it, so a loss built from it later would "
        "silently miss its gradients.\n" + fix
    )

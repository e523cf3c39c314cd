"""Differentiating through a graphified function.

A call that needs gradients (an input requires grad under grad mode, or the
call happens inside ``torch.func.grad``/``vjp``) goes through
:class:`GraphFn`, an ``autograd.Function`` with ``setup_context``, so both
``loss.backward()`` and ``torch.func`` transforms see it.

Normally the signature's graph is split by AOTAutograd's joint trace and the
default partitioner (see ``_partition.py``): the forward recording also
returns the activations the backward needs, which stay in its pool and are
handed to autograd; the backward recording takes them with the output
gradients. Where that does not fit (outputs that alias inputs), the backward
is itself a graphified function that recomputes the forward from the saved
inputs. On CUDA both passes replay from graphs either way.

Outputs that get no gradient (no loss used them) reach the backward as None,
not zeros: as in eager, an input that no output with a gradient reaches gets
no gradient (None; ``torch.autograd.grad`` without ``allow_unused`` raises).
The partitioned backward takes zeros for their tangents (one tensor per
output, read in place) and drops the unreached inputs' gradients; the
recompute path leaves those outputs out of its ``autograd.grad``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._compat import TRANSFORM_VMAP as _VMAP
from ._compat import DisableTorchFunctionSubclass, autocast_off, autograd_excluded, retrieve_all_functorch_interpreters
from ._compat import backward_keeps_graph as _keeps_graph
from ._compat import get_unwrapped as _get_unwrapped
from ._compat import is_batchedtensor as _is_batched
from ._compat import is_functorch_wrapped_tensor as _is_wrapped
from ._compat import peek_interpreter_stack as _peek
from ._compat import temporarily_clear_interpreter_stack as _clear_stack
from ._errors import GraphifyError
from ._log import log
from ._partition import partition
from ._replay import call_plain, run_flat
from ._rewrite import run_graph

__all__ = ["call_with_autograd", "GraphFn", "partition_for", "backward_for", "unwrap", "no_functorch"]


class no_functorch:
    """Run the backward recording outside torch.func's interpreters (first order).

    Under ``torch.inference_mode()``, torch.func.grad runs the function with inference mode
    off; clearing its interpreters brings back inference mode's dispatch keys (autograd left
    out) while inference mode reads as off, so nothing in there would record a gradient (a
    ``grad`` of zeros). Inference mode is then turned off for real, grad mode kept.
    """

    def __enter__(self) -> None:
        self.cms: List[Any] = []
        if _clear_stack is not None:
            self._enter(_clear_stack())
            if autograd_excluded():
                grad = torch.is_grad_enabled()  # (inference_mode(False) keeps forward-mode AD's)
                self._enter(torch.inference_mode(False))
                self._enter(torch.set_grad_enabled(grad))

    def _enter(self, cm: Any) -> None:
        cm.__enter__()
        self.cms.append(cm)

    def __exit__(self, *exc: Any) -> None:
        for cm in reversed(self.cms):
            cm.__exit__(*exc)


def unwrap(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The plain tensor under torch.func's wrappers, and how many there were.

    The count is ``-1`` if one of them is a vmap batch: then the backward must
    stay eager.
    """
    n = 0
    if _is_wrapped is not None:
        while _is_wrapped(t):
            if _is_batched is not None and _is_batched(t):
                return t, -1
            t = _get_unwrapped(t)
            n += 1
    return t, n


def _eager_backward(gm: Any, prims: Sequence[torch.Tensor], grads: Sequence[Any], need: Sequence[bool]) -> List[Any]:
    """The backward as plain differentiable torch code.

    For torch.func transforms that a recording cannot take part in (vmap over
    the backward, as in jacrev): right, not recorded. Outputs that got no
    gradient (None) are left out; an input that none of the others reaches
    gets None (see :func:`_graph_reach`).
    """
    diff = [i for i, n in enumerate(need) if n]
    if all(g is None for g in grads):
        return [None] * len(diff)

    def f(*d: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        full = list(prims)
        for i, t in zip(diff, d):
            full[i] = t
        outs = _run_graph(gm, full)
        return tuple(o for o, g in zip(outs, grads) if g is not None and (o.is_floating_point() or o.is_complex()))

    vjp_fn = torch.func.vjp(f, *[prims[i] for i in diff])[1]
    outs = _run_graph(gm, prims)
    take = [j for j, (o, g) in enumerate(zip(outs, grads)) if g is not None and (o.is_floating_point() or o.is_complex())]
    got: List[Any] = list(vjp_fn(tuple(grads[j] for j in take)))
    if len(take) < len(outs):
        reached = 0
        for j in take:
            reached |= _graph_reach(gm)[j]
        got = [g if (reached >> i) & 1 else None for i, g in zip(diff, got)]
    return got


def _graph_reach(gm: Any) -> List[int]:
    """Per output of a traced graph, the inputs it depends on through differentiable values (bitmasks).

    The data flow of the graph, cut at ``detach``, at ``torch.no_grad()`` blocks and at
    values that cannot carry a gradient (integers, booleans). Autograd's edges follow that
    flow, so an input it does not reach gets no gradient in eager either (None); it may reach
    one that eager's autograd graph does not (the gradient is then zeros, not None).
    Computed once per graph.
    """
    cached = gm.meta.get("gt_reach")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    detach = torch.ops.aten.detach.default
    masks: Dict[Any, int] = {}
    k = 0
    out: List[int] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            masks[n] = 1 << k
            k += 1
        elif n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
            out = [masks.get(a, 0) if isinstance(a, torch.fx.Node) else 0 for a in outs]
        else:
            v = n.meta.get("val")
            if n.target is detach or n.meta.get("gt_no_grad") or (
                    isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())):
                masks[n] = 0
                continue
            m = 0
            for a in n.all_input_nodes:
                m |= masks.get(a, 0)
            masks[n] = m
    gm.meta["gt_reach"] = out
    return out


def _higher_order(desc: str) -> GraphifyError:
    return GraphifyError(
        f"{desc}: higher-order differentiation through a graphified function "
        "(grad of grad, or backward with create_graph=True) is not supported.\n"
        "Why: the backward pass is a recording; its result is not differentiable again.\n"
        "Fix: graphify the whole transformed function instead, e.g. "
        "graphify(torch.func.grad(torch.func.grad(f))), or differentiate the eager function."
    )


def _differentiated_again() -> bool:
    """Whether a torch.func grad or jvp level runs over this (vmapped) backward.

    ``jacrev(jacrev(g))``: the inner jacrev's backward runs under vmap, inside the outer
    grad level, which would see the recording's saved values as constants (a zero Hessian).
    """
    if retrieve_all_functorch_interpreters is None:  # pragma: no cover
        return False
    return any(i.key() != _VMAP for i in retrieve_all_functorch_interpreters())


class _Box:
    """Per-call carrier between ``forward`` and ``backward`` (not a tensor)."""

    __slots__ = ("g", "entry", "need", "part", "pre", "grad_mode", "rng", "keep", "outer")

    def __init__(self, g: Any, entry: Any, need: Tuple[bool, ...]):
        self.g = g
        self.entry = entry  # the call's signature, as the caller resolved it
        self.need = need
        self.part: Any = None
        self.pre: Any = None  # inputs the forward updates in place, as they were before it
        self.grad_mode = torch.is_grad_enabled()  # the caller's (forward runs with grad off)
        self.rng: Any = None  # generator states before a random forward (the recompute draws them again)
        self.keep: Any = None  # aliases of the outputs until the backward has run (see _keep_outputs)
        # the plain tensors under torch.func's wrappers that require grad (see _outer_graph)
        self.outer: List[torch.Tensor] = []


def partition_for(e: Any, need: Tuple[bool, ...], owner: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The partitioned forward/backward of signature ``e`` for these inputs (``None``: recompute instead)."""
    if need in e.parts:
        return e.parts[need]
    part = None
    if any(need) and not e.plan.mutated:
        try:
            with torch.enable_grad(), no_functorch():
                part = partition(e.plan, e.guard.metas, need, owner, tensors)
        except Exception as exc:  # the recompute path is always available
            if getattr(exc, "gt_final", False):
                raise
            log.info("%s: partitioning failed (%s); the backward recomputes the forward", owner._desc, exc)
            e.plan.joint_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            part = None
    e.parts[need] = part
    return part


def backward_for(e: Any, need: Tuple[bool, ...], owner: Any) -> Any:
    """The graphified backward of signature ``e`` for these needed inputs."""
    g = e.bwd.get(need)
    if g is None:
        fn = make_backward(e.plan, need)
        fn.__qualname__ = fn.__name__ = f"backward of {owner._desc}"
        g = e.bwd[need] = owner._spawn(fn)
    return g


class GraphFn(torch.autograd.Function):
    """``autograd.Function`` around one graphified call (torch.func-compatible)."""

    @staticmethod
    def forward(box: _Box, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:  # type: ignore[override]
        g = box.g
        if _peek() is not None:
            raise _higher_order(g._desc)
        # the signature the caller resolved for this call (not looked up again here: under
        # torch.func.grad the slots of the state hold the transform's wrappers, which only
        # that lookup sees through)
        e, st = box.entry, g._tls.state
        bad = [i for i in e.plan.mutated if box.need[i]]
        if bad:
            i0 = sorted(bad)[0]
            paths = ", ".join(e.plan.in_paths[i] for i in sorted(bad))
            op, line = e.plan.mutated_at.get(i0, ("an in-place op", "?"))
            if line.startswith("<"):  # generated code (a module's forward called by graphify(module))
                line = "library code the function calls (e.g. a torch.nn module's forward)"
            state = i0 >= e.n_user
            what = ("tensors it reaches that require grad (parameters)" if state
                    else "arguments that require grad")
            fix = ("Fix: make that update outside the graphified function, or under torch.no_grad() "
                   "inside it where it is not meant to be differentiated (a max-norm renormalisation, "
                   "nn.Embedding(max_norm=...): keep max_norm=None and renormalise the weight under "
                   "torch.no_grad() between steps)."
                   if state else
                   "Fix: return the new values instead of updating the arguments in place, or call "
                   "the function under torch.no_grad() if no gradient is needed.")
            raise GraphifyError(
                f"{g._desc}: the function updates {what} in place ({paths}), and the call is "
                f"differentiated.\n  op {op} at {line}\n"
                "Why: the recording's autograd wrapper differentiates its inputs as they were "
                "before the call; an in-place update of a differentiated input inside it would "
                "give gradients of the wrong values.\n" + fix
            )
        part = partition_for(e, box.need, g, tensors)
        if part is not None:
            box.part = part
            res = call_plain(part.fw, tuple(tensors), {})
            n = part.n_out
            _keep_outputs(box, res[:n])
            # saved activations go to autograd as fresh aliases: if autograd
            # still holds them at the next forward, the forward moves its
            # outputs instead of writing over them. (One may be an input that is
            # the last call's output fed back, `h = step(h, x)`: its object was
            # poisoned as this call began, while its memory stays pinned by the
            # aliases the last forward keeps for its backward; the alias is made
            # past the poison.)
            with DisableTorchFunctionSubclass():
                saved = [t.detach() for t in res[n:]]
                # a saved activation that is an output's memory (exp, sigmoid, tanh save
                # their result) is that output's alias, sharing its version counter: an
                # in-place change of the output before its backward raises as in eager
                # (it gave the gradient of the changed values)
                pairs = part.out_alias
                if pairs is None:
                    pairs = part.out_alias = _output_aliases(res[:n], res[n:])
                for j, i in pairs:
                    o = res[i]
                    if type(o) is torch.Tensor and o.data_ptr() == saved[j].data_ptr():
                        saved[j] = o.detach()
            return (*res[:n], *saved)
        if e.plan.hooks:
            raise _recompute_refusal(
                g._desc, e.plan, f"registers a tensor hook (at {e.plan.hooks[0]})", "hooks do not exist there",
                "return a copy (.clone()) of outputs that are inputs or views of them and do not update "
                "inputs in place, or apply the hook's change to the gradient outside the function.")
        if e.plan.custom_grad:
            name = e.plan.custom_grad[0]
            fix = ("do not update inputs or buffers in place in a function you differentiate (return the new "
                   "values), return a copy (.clone()) of outputs that are inputs, or call it under torch.no_grad().")
            if name == "CheckpointFunction":  # torch.utils.checkpoint(..., use_reentrant=True)
                fix = ("pass use_reentrant=False to torch.utils.checkpoint (the reentrant variant runs its "
                       "own backward, which cannot be recorded), or call it under torch.no_grad().")
            reads = _backward_reads(e.plan.joint_error)
            if reads:
                # (torchdiffeq's odeint_adjoint walks its time grid on the host in its backward; a
                # gradient guard `if not torch.isfinite(g).all()`)
                fix = ("graphify(fn, on_break=\"eager\") runs such calls eagerly (correct, not faster), and "
                       "torch.compile(fn, backend=\"gtransform\") records the pieces between the reads; or keep "
                       "the backward on the device (for torchdiffeq: odeint instead of odeint_adjoint, its grid "
                       "closed over, is recorded whole).")
            err = _recompute_refusal(
                g._desc, e.plan, f"uses the custom autograd function {name}",
                f"they hold {name}.forward's operations, not its backward: the gradients would differ from eager's",
                fix, reads=f"{name}.backward reads a value on the host (a data-dependent operation), which a "
                           "recording cannot replay" if reads else "")
            # (on_break takes it: see _run)
            err.gt_backward_reads = reads  # type: ignore[attr-defined]
            raise err
        if e.plan.mutated:
            # the backward recomputes the forward from the inputs as they were
            box.pre = {i: tensors[i].detach().clone() for i in e.plan.mutated}
        if e.plan.random:
            # ... and draws the forward's random numbers again (dropout's mask)
            box.rng = rng_snapshot(e.plan)
        outs = run_flat(g, e, st, list(tensors))
        _keep_outputs(box, outs)
        # autograd.Function may not return an input as-is when it also saves it; a view
        # of an input that does not require grad in eager (x.detach()) is made from the
        # detached input, as eager's is (else autograd hands it out requiring grad)
        ids = {id(t) for t in tensors}
        rg = e.plan.rg_traced
        return tuple(
            o.detach() if rg and oe.kind == "input" and not oe.requires_grad else o.view_as(o) if id(o) in ids else o
            for o, oe in zip(outs, e.plan.tensor_entries)
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        box = inputs[0]
        ctx.box = box
        # the backward sees which outputs got no gradient (None, not zeros): eager gives an
        # input that no output with a gradient reaches no gradient at all (None; AdamW then
        # leaves the parameter alone), where zeros would decay it and make moments
        ctx.set_materialize_grads(False)
        part = box.part
        if part is not None:
            saved = output[part.n_out:]
            ctx.save_for_backward(*saved)
            # outputs that do not require grad in eager (made under no_grad, detached, integer)
            nd = [o for o, d in zip(output[: part.n_out], part.diff_out) if not d]
            ctx.mark_non_differentiable(*saved, *nd)
            return
        # (not taken off the box: under torch.func, setup_context runs once per transform
        # level, and each must save the inputs as they were before the call; the second saved
        # the updated ones, so the backward's recompute applied the update twice)
        pre = box.pre or {}
        ctx.save_for_backward(*[pre.get(i, t) for i, t in enumerate(inputs[1:])])
        # outputs that do not require grad in eager (detached, made under no_grad, integer)
        plan = box.entry.plan
        nd = [o for o, oe in zip(output, plan.tensor_entries)
              if not ((oe.requires_grad or not plan.rg_traced) and (o.is_floating_point() or o.is_complex()))]
        if nd:
            ctx.mark_non_differentiable(*nd)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:  # type: ignore[override]
        box: _Box = ctx.box
        if _keeps_graph is None or not _keeps_graph():
            box.keep = None  # the nodes after this one, which may have saved the outputs, have run
        # (backward(retain_graph=True): they may run again, with what they saved)
        need = tuple(bool(n) for n in ctx.needs_input_grad[1:])
        if box.part is not None:
            return (None, *_partitioned_backward(box, ctx.saved_tensors, grads, need))
        bwd = backward_for(box.entry, need, box.g)
        create_graph = torch.is_grad_enabled()
        batched = any(unwrap(t)[1] < 0 for t in list(ctx.saved_tensors) + [g for g in grads if g is not None])
        if box.rng is not None:
            # the recomputed forward draws what the forward drew; the generators
            # then go on from where the forward left them, as in eager
            now = rng_snapshot(box.entry.plan)
            rng_restore(box.rng)
            try:
                return _recompute_backward(ctx, box, grads, need, bwd, create_graph, batched)
            finally:
                rng_restore(now)
        return _recompute_backward(ctx, box, grads, need, bwd, create_graph, batched)


def _output_aliases(outs: Sequence[Any], saved: Sequence[torch.Tensor]) -> List[Tuple[int, int]]:
    """(saved index, output index) of saved activations laid out exactly as an output."""
    def lay(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            return None
        return (t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

    at: Dict[Any, int] = {}
    for i, o in enumerate(outs):
        k = lay(o)
        if k is not None and o.numel() > 0:
            at.setdefault(k, i)
    return [(j, at[k]) for j, k in enumerate(map(lay, saved)) if k is not None and k in at]


def _unpoisoned(saved: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The saved inputs, an alias for each one that a later call poisoned.

    An input that is an earlier call's output fed back (``h = cell(x, h)``, unrolled for
    backpropagation through time) is poisoned when the next call begins while the caller
    still holds it; its memory stays pinned until this backward has run (the aliases
    ``_keep_outputs`` keeps), so its values are this forward's.
    """
    from ._liveness import StaleOutput, unseal

    if not any(type(t) is StaleOutput for t in saved):
        return list(saved)
    unseal()  # the aliases made here may outlive the backward
    with DisableTorchFunctionSubclass():
        return [t.detach() if type(t) is StaleOutput else t for t in saved]


def _recompute_backward(ctx: Any, box: _Box, grads: Sequence[Any], need: Tuple[bool, ...], bwd: Any,
                        create_graph: bool, batched: bool) -> Tuple[Any, ...]:
    if batched:
        if _differentiated_again():
            raise _higher_order(box.g._desc)
        got = _outer_graph(box, _eager_backward(box.entry.plan.gm, _unpoisoned(ctx.saved_tensors), grads, need))
        return (None, *[got.pop(0) if n else None for n in need])
    with no_functorch():
        prims, depth = [], 0
        for p in _unpoisoned(ctx.saved_tensors):
            t, n = unwrap(p)
            prims.append(t)
            depth = max(depth, n)
        tangents: List[Any] = []
        for gr in grads:
            if gr is None:  # an output without a gradient: the recorded backward leaves it out
                tangents.append(None)
                continue
            t, n = unwrap(gr)
            tangents.append(t)
            depth = max(depth, n)
        # torch.func runs backward with grad mode on and tangents wrapped
        # once; plain autograd with create_graph=True has plain tangents
        if depth > 1 or (depth == 0 and create_graph):
            raise _higher_order(box.g._desc)
        res: Optional[List[Any]]
        try:
            res = _outer_graph(box, _to_autograd(call_plain(bwd, (prims, tangents), {})))
        except NotImplementedError as e:
            if "BatchedTensorImpl" not in str(e):
                raise
            res = None  # is_grads_batched=True (see _partitioned_backward)
    if res is None:
        res = _eager_backward(box.entry.plan.gm, _unpoisoned(ctx.saved_tensors), grads, need)
    out: List[Any] = [None]
    j = 0
    for n in need:
        if n:
            out.append(res[j])
            j += 1
        else:
            out.append(None)
    return tuple(out)


def _tangents(part: Any, grads: Sequence[Any]) -> Tuple[List[Any], List[bool]]:
    """The partitioned backward's tangents, and per differentiated input whether its gradient is None.

    Where an output got no gradient (None: no loss used it), its tangent is zeros (the
    recorded backward takes one) and the inputs that no output with a gradient reaches get
    None, as in eager.
    """
    for i in part.diff_idx:
        if grads[i] is None:
            break
    else:  # every output that requires grad has a gradient (the common case)
        return [grads[i] for i in part.tan_idx], part.grad_none
    tangents = [grads[i] if grads[i] is not None else part.zero_tangent(i) for i in part.tan_idx]
    return tangents, part.none_for(tuple(grads[i] is not None for i in range(part.n_out)))


def _partitioned_backward(box: _Box, saved: Sequence[torch.Tensor], grads: Sequence[Any], need: Sequence[bool]) -> List[Any]:
    part = box.part
    tangents, none = _tangents(part, grads)
    if none is not part.grad_none and all(none):  # no output with a gradient reaches an input
        return [None] * len(need)
    res: Optional[List[Any]] = None
    if any(unwrap(t)[1] < 0 for t in list(saved) + list(tangents)):
        # vmap over the backward (jacrev): the backward graph, eagerly
        if _differentiated_again():
            raise _higher_order(box.g._desc)
        with autocast_off():
            res = _outer_graph(box, _to_autograd(list(run_graph(part.bw_gm, *saved, *tangents))))
    else:
        create_graph = torch.is_grad_enabled()
        with no_functorch():
            plain, depth = [], 0
            for t in list(saved) + list(tangents):
                u, n = unwrap(t)
                plain.append(u)
                depth = max(depth, n)
            if depth > 1 or (depth == 0 and create_graph):
                raise _higher_order(box.g._desc)
            try:
                res = _outer_graph(box, _to_autograd(list(call_plain(part.bw, tuple(plain), {}))))
            except NotImplementedError as e:
                if "BatchedTensorImpl" not in str(e):
                    raise
                # torch.autograd.grad(..., is_grads_batched=True): the older vmap's batched
                # tangents, which torch.func cannot see: the backward graph, eagerly
                res = None
        if res is None:
            res = list(run_graph(part.bw_gm, *saved, *tangents))
    # the backward returns the gradients that exist; eager's None stays None
    it = iter(res or ())
    flags = iter(part.grad_none)
    out = [None if not n or next(flags) else next(it) for n in need]
    if none is not part.grad_none:
        # ... as does the gradient of an input that no output with a gradient reaches
        unreached = iter(none)
        out = [None if not n or next(unreached) else g for n, g in zip(need, out)]
    return out


def _bottom(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The plain tensor under torch.func's wrappers (or ``t`` itself), if it requires grad.

    Called under a torch.func transform: a plain tensor that requires grad there (a
    closed-over parameter) is a constant of the transform and a variable of the
    autograd graph outside it.
    """
    while _is_wrapped(t):
        t = _get_unwrapped(t)
    return t if t.requires_grad else None


def _gradient_differentiated(desc: str) -> GraphifyError:
    """The refusal of :class:`_NotDifferentiable`: a torch.func gradient differentiated by an outer backward."""
    return GraphifyError(
        f"{desc}: higher-order differentiation through a graphified function: a gradient that torch.func "
        "(grad, vjp, jacrev) computed through it is differentiated again by a backward outside the transform, "
        "whose inputs require grad there too (a gradient penalty on torch.func.grad(f)(w); MAML's inner "
        "step p - lr * torch.func.grad(inner)(p), then loss.backward()).\n"
        "Why: the backward pass is a recording; its result is not differentiable again (eager's gradient "
        "holds the second-order terms).\n"
        "Fix: graphify the whole penalty or outer step, with torch.func for both levels "
        "(gt.graphify(torch.func.grad(outer_loss))); for first-order MAML take the inner gradient as a "
        "value (torch.func.grad(inner) at {k: v.detach() for k, v in p.items()}, or g.detach()); or call "
        "the function eagerly."
    )


class _NotDifferentiable(torch.autograd.Function):
    """A gradient that eager could differentiate again, and whose backward refuses to.

    (Also under torch.func.vmap: jacrev's vmapped backward.)
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(desc: str, r: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return r.view_as(r)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        ctx.desc = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise _gradient_differentiated(ctx.desc)


def _outer_graph(box: _Box, res: List[Any]) -> List[Any]:
    """Gradients computed under torch.func (grad, vjp) whose inputs also require grad outside it.

    ``torch.func.grad(g)(w)`` with ``w`` a parameter: eager's gradient depends on ``w``
    again (it requires grad, a second-order graph). The recording's does not: without
    this it would not require grad, and a backward through it (a gradient penalty) would
    silently leave its term out. Here it requires grad as eager's does, and a backward
    through it raises the higher-order error.
    """
    if not box.outer or not torch.is_grad_enabled():
        return res
    desc = box.g._desc
    with torch.enable_grad():
        return [_NotDifferentiable.apply(desc, r, *box.outer)
                if isinstance(r, torch.Tensor) and (r.is_floating_point() or r.is_complex()) else r for r in res]


def _keep_outputs(box: _Box, outs: Sequence[Any]) -> None:
    """Keep aliases of this call's outputs until its backward has run.

    Eager operations after the function save its outputs for their own backward
    (``mse_loss(f(x), t)`` saves ``f(x)``) in C++, where the outputs' liveness
    check cannot see them. If the function is called again before that backward
    (two batches, one ``.backward()``), these aliases make the next call move its
    outputs to other memory (as views the caller keeps do) instead of writing over
    what those operations saved. The box lives as long as the autograd graph; the
    backward drops them.
    """
    box.keep = _to_autograd(outs)


def _to_autograd(res: Sequence[Any]) -> List[Any]:
    """The backward's gradients as fresh aliases of the recording's outputs.

    Autograd holds gradients in C++ (an input buffer summing the gradients of a
    tensor used twice, ``.grad``), where the outputs' liveness check cannot see
    them; a fresh alias pins the memory instead (its storage's use count), so a
    second replay of this backward in the same pass (the function called twice
    before one ``.backward()``) moves its outputs rather than write over the
    first replay's gradients, as the forward does with saved activations.
    """
    return [t.detach() if type(t) is torch.Tensor else t for t in res]


class _NoGradRegions(torch.fx.Interpreter):
    """Runs a traced graph with its ``torch.no_grad()`` blocks (see _watch._tagging_no_grad)."""

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.meta.get("gt_no_grad"):
            with torch.no_grad():
                return super().run_node(n)
        return super().run_node(n)


_HOST_READ_FAILURES = ("DataDependentOutput", "GuardOnDataDependent", "reads a tensor's value on the host",
                       "_local_scalar_dense")


def _backward_reads(joint_error: Optional[str]) -> bool:
    """Whether the joint trace failed on a host read (a data-dependent op in a custom backward)."""
    return bool(joint_error) and any(s in joint_error for s in _HOST_READ_FAILURES)  # type: ignore[operator]


def _recompute_refusal(desc: str, plan: Any, what: str, why: str, fix: str, reads: str = "") -> GraphifyError:
    """The error for something only the joint trace keeps, on the recompute path."""
    if reads:
        how = reads
    elif plan.mutated:
        how = "it updates an input or state in place"
    elif plan.joint_error:
        how = f"the joint trace of its forward and backward failed ({plan.joint_error})"
    else:
        how = plan.no_partition or "an output is an input or a view of one"
        if plan.no_partition.startswith("it stores a tensor"):
            # (a Grad-CAM forward hook keeping the activation): that store is what to change
            fix = ("return the stored tensor as an output of the function instead of keeping it in "
                   "Python state (or store it outside the graphified function); then the function's "
                   "forward and backward are recorded together and the hook is part of it.")
    return GraphifyError(
        f"{desc}: the function {what} and is differentiated, but its backward cannot be traced "
        f"from the function: {how}.\nWhy: the backward is then recomputed from the recorded "
        f"operations; {why}.\nFix: {fix}"
    )


def _has_no_grad_nodes(gm: Any) -> bool:
    return any(n.meta.get("gt_no_grad") for n in gm.graph.nodes)


def _run_graph(gm: Any, args: Sequence[Any], no_grad_nodes: Optional[bool] = None) -> Any:
    """Run a traced graph eagerly, as differentiable code, its no_grad blocks included."""
    if no_grad_nodes is None:
        no_grad_nodes = _has_no_grad_nodes(gm)
    with autocast_off():  # (the graph holds the trace's casts)
        return _NoGradRegions(gm).run(*args) if no_grad_nodes else run_graph(gm, *args)


def make_backward(plan: Any, need: Sequence[bool]) -> Any:
    """The backward of ``plan``'s graph as a plain function.

    It maps ``(primals, tangents)`` to the gradients of the inputs in ``need``.
    """
    gm = plan.gm
    diff = [i for i, n in enumerate(need) if n]
    mutated = set(plan.mutated)
    no_grad_nodes = _has_no_grad_nodes(gm)

    def backward(primals: List[torch.Tensor], tangents: List[torch.Tensor]) -> List[torch.Tensor]:
        with torch.enable_grad():
            # inputs the forward updates in place (BatchNorm's running stats) are
            # cloned: recomputing the forward must not update them a second time
            ps = [p.detach().requires_grad_(True) if i in diff else
                  (p.detach().clone() if i in mutated else p.detach()) for i, p in enumerate(primals)]
            outs = _run_graph(gm, ps, no_grad_nodes)
            # (an output that got no gradient has no tangent: it is left out, as eager's
            # backward leaves out what no loss used)
            pairs = [(o, t) for o, t in zip(outs, tangents) if o.requires_grad and t is not None]
            wrt = [ps[i] for i in diff]
            got: Sequence[Any] = (None,) * len(wrt)
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True)
        # an input the outputs do not depend on gets no gradient (None), as in eager
        return list(got)

    backward.__name__ = backward.__qualname__ = f"backward_of_{getattr(gm, '_gt_name', 'fn')}"
    return backward


def call_with_autograd(g: Any, e: Any, tensors: List[torch.Tensor]) -> Any:
    """Call graphified ``g`` through :class:`GraphFn` and return the output tree.

    ``tensors`` are the caller's tensor leaves followed by the state the
    function reads: gradients reach closed-over parameters as they reach
    arguments.
    """
    need = tuple(bool(t.requires_grad and (t.is_floating_point() or t.is_complex())) for t in tensors)
    box = _Box(g, e, need)
    if box.grad_mode and _is_wrapped is not None and _peek() is not None:
        box.outer = [b for b in map(_bottom, tensors) if b is not None]
    outs = GraphFn.apply(box, *tensors)
    if box.part is not None:
        outs = outs[: box.part.n_out]
    plan = box.entry.plan
    if plan.out_views and _peek() is None:  # (not under torch.func: its wrappers are views of their own)
        outs = _as_views(outs, plan.out_views)
    if box.part is None and plan.returns_inputs:
        # an input returned as it came in (return lin.weight) is that very tensor, as in
        # eager, not the autograd.Function's view of it (gradients reach it directly); a view
        # of an input (return x[1:]) is that input's view: the caller may update it in place,
        # as eager's, which autograd refuses on an autograd.Function's output
        outs = tuple(_input_as_eager(tensors[oe.index], o, oe) if oe.kind == "input" and not (oe.conj or oe.neg)
                     else o for o, oe in zip(outs, plan.tensor_entries))
    return plan.assemble(outs)


def _input_as_eager(t: torch.Tensor, o: torch.Tensor, oe: Any) -> torch.Tensor:
    """An output that is input ``t`` or a view of it, as eager returns it (``o``: the wrapper's)."""
    if oe.identical:
        return t
    if _peek() is not None:  # (torch.func's wrappers: the wrapper's output stands)
        return o
    if not oe.requires_grad:  # (the function detached it)
        t = t.detach()
    return t.as_strided(oe.size, oe.stride, t.storage_offset() + oe.rel_offset)


def _as_views(outs: Sequence[torch.Tensor], views: Sequence[Tuple[int, int, str]]) -> Tuple[torch.Tensor, ...]:
    """Outputs returned twice as one object, and views of another output as its views (as eager's are).

    The autograd wrapper's outputs are each its own node: ``h[:, -1]`` returned beside ``h``
    would share ``h``'s memory but not its autograd history, so an in-place change of one,
    or ``retain_grad()`` on ``h`` with a loss of the view, gave other gradients than eager's.
    ``h.detach()`` returned beside ``h`` is a view of its memory without its history, and
    ``h.detach().requires_grad_()`` a new leaf over it.
    """
    out = list(outs)
    for j, i, how in views:
        o, base = out[j], out[i]
        if how == "same":
            out[j] = base
        else:
            base = base if how == "view" else base.detach()
            out[j] = base.as_strided(o.shape, o.stride(), o.storage_offset())
            if how == "leaf":
                out[j].requires_grad_()
    return tuple(out)


def rng_snapshot(plan: Any) -> List[Tuple[Any, torch.Tensor]]:
    """The state of every generator a random recording draws from.

    The CPU's, the current CUDA device's (if the recording is on CUDA) and any
    explicit ones.
    """
    snap: List[Tuple[Any, torch.Tensor]] = [(None, torch.get_rng_state())]
    if (plan.cuda or plan.uses_cuda) and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        snap.append((dev, torch.cuda.get_rng_state(dev)))
    for gen in plan.generators:
        snap.append((gen, gen.get_state()))
    return snap


def rng_restore(snap: List[Tuple[Any, torch.Tensor]]) -> None:
    """Put the generators of :func:`rng_snapshot` back in that state."""
    for who, state in snap:
        if who is None:
            torch.set_rng_state(state)
        elif isinstance(who, int):
            torch.cuda.set_rng_state(state, who)
        else:
            who.set_state(state)

"""Partitioned forward and backward for differentiating through a recording.

For a signature and a set of inputs to differentiate, the joint
forward+backward graph is traced **from the user's function itself**, at the
level of autograd: the function runs on fake tensors that require grad, and
``torch.autograd.grad`` of its outputs is traced with it. So everything that
exists only for autograd is respected as eager respects it: ``torch.no_grad``
blocks, ``.detach()``, custom ``torch.autograd.Function`` backwards, tensor
hooks, and random numbers (a dropout mask is drawn once, in the forward, and
saved for the backward). The default partitioner then splits the joint graph
into a forward that also returns the activations the backward needs
("saved") and a backward that takes them with the output gradients. Each half
is recorded as a graphified function of its own, so the saved activations live
in the forward recording's pool.

The joint trace also records, per output, which differentiated inputs its
autograd graph reaches: eager gives an input that no output with a gradient
reaches no gradient (None), and so does the backward when some outputs get
none (see ``_autograd._tangents``). The backward takes only the tangents it
uses.

A saved activation is handed to autograd as a fresh alias of pool memory; if
autograd still holds it when the forward replays again (two forwards before
a backward), the forward moves its outputs to new memory first (the same
pinning that protects views the caller derived), so a backward never reads
overwritten activations.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._compat import FakeTensorMode, autocast_off, load_default_partition, load_extract_tensor_metadata, load_sympy_eval
from ._errors import GraphifyError
from ._log import log
from ._rewrite import run_graph
from ._symbolic import graph_layouts, new_shape_env, shareable, symbol_dims, symbolic_dispatch, symbolic_fakes

__all__ = ["Partition", "partition", "build_partition"]

_UNSET = object()


class Partition:
    """The recorded forward and backward of one signature."""

    def __init__(self, fw: Any, bw: Any, n_out: int, n_saved: int, diff_out: List[bool], bw_gm: Any, grad_none: List[bool],
                 reach: List[int], out_metas: List[Tuple[Any, ...]]):
        self.fw = fw
        self.bw = bw
        self.n_out = n_out
        self.n_saved = n_saved
        self.diff_out = diff_out  # outputs that require grad (as in eager): they receive a tangent
        self.bw_gm = bw_gm  # the backward graph as a function of saved and tangents: eager use under vmap (jacrev)
        self.grad_none = grad_none  # per differentiated input: eager's gradient is None
        # per output, the differentiated inputs its autograd graph reaches (a bitmask in
        # grad_none's order): an input that no output with a gradient reaches gets None
        self.reach = reach
        self.out_metas = out_metas  # (shape, stride, dtype, device) per output, for zero tangents
        self.tan_idx: List[int] = []  # which outputs' gradients the backward takes (of diff_out ones)
        self.diff_idx = [j for j, d in enumerate(diff_out) if d]  # the outputs that get gradients
        # saved activations that are an output's very memory (exp saves its result): pairs
        # (saved index, output index), found at the first call (see GraphFn.forward)
        self.out_alias: Optional[List[Tuple[int, int]]] = None
        self.zero_tangents: Dict[int, torch.Tensor] = {}  # by output index (see zero_tangent)
        self.none_when: Dict[Tuple[bool, ...], List[bool]] = {}  # grad_none, by which outputs have a gradient
        # a symbolic partition (one for every size of a symbolic plan): its shape environment
        # and the guards of its joint trace over the caller's tensors (None: none)
        self.env: Any = None
        self.guards: Optional[str] = None

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a symbolic partition is right for a call with these tensors (the caller's)."""
        return self.guards is None or bool(self.env.evaluate_guards_expression(self.guards, list(tensors)))

    def at(self, plan: Any, tensors: Sequence[torch.Tensor]) -> Partition:
        """A symbolic partition for one signature of its plan: the same recordings, this size's zero tangents."""
        part = copy.copy(self)
        part.out_metas = _output_specs(plan, tensors)
        part.zero_tangents = {}
        part.out_alias = None
        return part

    def zero_tangent(self, i: int) -> torch.Tensor:
        """The tangent of output ``i`` when it gets no gradient: zeros, the same tensor every call.

        The backward recording takes a tensor for each tangent; one object passed on every call
        is read in place (no copy). Nothing writes it: the backward graph is functional, and a
        gradient that would be this very tensor (an input that only output ``i`` reaches) is
        None then (see :meth:`none_for`), never handed out.
        """
        z = self.zero_tangents.get(i)
        if z is None:
            shape, stride, dtype, device = self.out_metas[i]
            z = self.zero_tangents[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
        return z

    def none_for(self, have: Tuple[bool, ...]) -> List[bool]:
        """Per differentiated input, whether its gradient is None when only outputs in ``have`` have one.

        Eager's rule: None where no output that has a gradient reaches the input in the
        autograd graph (``grad_none``: None even when every output has one).
        """
        none = self.none_when.get(have)
        if none is None:
            reached = 0
            for r, h in zip(self.reach, have):
                if h:
                    reached |= r
            none = self.none_when[have] = [gn or not (reached >> k) & 1 for k, gn in enumerate(self.grad_none)]
        return none


def _reach(outs: Sequence[torch.Tensor], diff: Sequence[bool], wrt: Sequence[torch.Tensor]) -> List[int]:
    """Per output, which tensors of ``wrt`` (leaves) its autograd graph reaches, as a bitmask.

    Eager gives a differentiated tensor no gradient (None; an error without ``allow_unused``)
    where no output that has a gradient reaches it, whatever the values: the graph decides,
    so it is walked here, once per signature (each node once, its mask the union of its
    successors').
    """
    target = {id(t): 1 << k for k, t in enumerate(wrt)}
    memo: Dict[Any, int] = {}

    def mask(root: Any) -> int:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if not done:
                if node in memo:
                    continue
                stack.append((node, True))
                stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in memo)
                continue
            m = target.get(id(getattr(node, "variable", None)), 0)  # AccumulateGrad of a leaf
            for n, _ in node.next_functions:
                if n is not None:
                    m |= memo[n]
            memo[node] = m
        return memo[root]

    return [mask(o.grad_fn) if d and o.grad_fn is not None else 0 for o, d in zip(outs, diff)]


def _flat_fn(gm: Any, name: str, n: Optional[int] = None) -> Any:
    """``gm`` as a function returning a tuple (its first ``n`` outputs: the tensors)."""
    def run(*args: torch.Tensor) -> tuple:
        return tuple(run_graph(gm, *args))[:n]

    run.__name__ = run.__qualname__ = name
    return run


def _backward_draws(desc: str) -> GraphifyError:
    """Random numbers drawn by the backward pass itself: no recording can draw them where eager does."""
    from ._errors import format_frame, user_frame

    err = GraphifyError(
        f"{desc}: the backward pass of the function draws random numbers (torch.utils.checkpoint's "
        "recompute with preserve_rng_state=False around dropout, or a custom backward that draws), "
        f"and the function is differentiated through its recording.\n  at {format_frame(user_frame())}\n"
        "Why: eager draws them when .backward() runs, from wherever the generator stands then; the "
        "recording would draw other numbers (recomputing the forward's, or drawing them in the "
        "forward), and the gradients would differ from eager's.\n"
        "Fix: use preserve_rng_state=True (torch's default: the recompute repeats the forward's "
        "numbers, as the recording does), or graphify the whole training step (forward and "
        ".backward() inside the function), or call this function eagerly."
    )
    err.gt_final = True  # type: ignore[attr-defined]  # not a reason to fall back to the recompute path
    return err


def partition(plan: Any, metas: Sequence[Any], need: Tuple[bool, ...], owner: Any,
              tensors: Sequence[torch.Tensor]) -> Optional[Partition]:
    """The partitioned forward and backward of a signature for the inputs in ``need``; ``None`` if it cannot be.

    A plan traced with symbolic sizes (see ``_symbolic``) is partitioned once for all its
    sizes: its joint forward and backward are traced with the same sizes as symbols, the
    partition is kept on the plan (its copies for other sizes share it), and each size whose
    guards hold takes it with zero tangents of its own. The forward and backward are
    graphified functions, whose own symbolic traces then serve the sizes. A joint trace that
    fixes a size, or a size its guards do not hold for, is partitioned for that size alone.

    Args:
        plan: the traced signature (its function, how to call it, its state).
        metas: ``tensor_meta`` of each tensor input (the caller's, then state).
        need: which inputs are differentiated.
        owner: the graphified function (for its name and options).
        tensors: the call's tensors (the caller's, then state): their sizes.
    """
    if shareable(plan):  # (a symbolic plan that serves other sizes)
        shared = plan.joints.get(need, _UNSET)
        if shared is _UNSET:
            shared = plan.joints[need] = _symbolic_partition(plan, metas, need, owner, tensors)
        if shared is not None and shared.holds(tensors[: plan.n_user_in]):
            return shared.at(plan, tensors)
    return build_partition(plan, metas, need, owner, tensors)


def _symbolic_partition(plan: Any, metas: Sequence[Any], need: Sequence[bool], owner: Any,
                        tensors: Sequence[torch.Tensor]) -> Optional[Partition]:
    """The partition of a symbolic plan for all its sizes, or ``None`` (each size is partitioned as is)."""
    try:
        return build_partition(plan, metas, need, owner, tensors, symbolic=True)
    except Exception as exc:
        if getattr(exc, "gt_final", False):
            raise
        log.info("%s: the symbolic joint trace failed (%s: %s); each size is partitioned as is", owner._desc,
                 type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else "")
        return None


def build_partition(plan: Any, metas: Sequence[Any], need: Sequence[bool], owner: Any,
                    tensors: Sequence[torch.Tensor], symbolic: bool = False) -> Optional[Partition]:
    """Partition the joint graph of ``plan``'s signature for the inputs in ``need``; ``None`` if it cannot be.

    Args:
        plan: the traced signature (its function, how to call it, its state).
        metas: ``tensor_meta`` of each tensor input (the caller's, then state).
        need: which inputs are differentiated.
        owner: the graphified function (for its name and options).
        tensors: the call's tensors (the caller's, then state).
        symbolic: trace with the symbolic plan's dimensions as symbols (see :func:`partition`).

    Returns:
        A :class:`Partition`, or ``None`` when the graph does not fit (outputs
        that alias inputs, inputs updated in place): the caller then recomputes
        the forward inside the backward recording instead. A symbolic one is ``None``
        also where the joint trace fixed a size, or the backward takes a size it cannot
        read from its tensors.
    """
    if not _partitionable(plan, need):
        return None
    joint = _joint_trace(plan, metas, need, owner, tensors, symbolic)
    if joint is None:
        return None
    gm, box = joint
    gm = _functional_joint(gm, plan, box)
    return _split_joint(gm, plan, owner, box, tensors)


def _partitionable(plan: Any, need: Sequence[bool]) -> bool:
    """Whether the joint graph can be partitioned; where not, ``plan.no_partition`` says why (for messages)."""
    # (why not, for the messages of what the recompute path refuses: see _recompute_refusal)
    if plan.fn is None or plan.mutated:
        return False
    why = ""
    if plan.escape_slots:
        why = f"it stores a tensor in Python state ({plan.escape_slots[0].path})"
    elif any(t.grad_fn is not None for t in plan.state):
        # state with autograd history (a hidden state carried from an earlier call): the
        # joint trace's backward would run on into that history, which is not the function's;
        # the recompute path differentiates from the state as a leaf, and autograd goes on
        why = "state it reads carries autograd history from an earlier call"
    elif any(plan.leaf_idx.values()):
        # the joint trace's inputs are leaves: it would take the other branch of `if x.is_leaf`
        why = "it reads whether an input with autograd history is a leaf (is_leaf, grad_fn)"
    elif any(e.kind == "input" for e in plan.out_entries):
        # outputs that alias inputs: the partitioner cannot split them (recompute instead)
        why = "an output is an input or a view of one"
    elif any(need[plan.n_user_in + k] and not t.requires_grad for k, t in enumerate(plan.state)):
        # differentiated under torch.func.grad through a wrapper its slot holds (functional_call
        # of detached parameters): the joint trace differentiates the state tensors themselves,
        # which here do not require grad; the recompute path differentiates copies of them
        why = "state it differentiates does not require grad itself (torch.func's wrapper of it does)"
    if why:
        plan.no_partition = why
        return False
    return True


def _joint_trace(plan: Any, metas: Sequence[Any], need: Sequence[bool], owner: Any, tensors: Sequence[torch.Tensor],
                 symbolic: bool) -> Optional[Tuple[Any, dict]]:
    """The function's forward and backward traced as one graph (primals, then tangents), and what it found.

    ``symbolic``: the symbolic plan's dimensions are symbols of a shape environment of the
    joint trace's own (``box["env"]``, its guards over the caller's tensors ``box["guards"]``);
    ``None`` where the trace fixed one of them.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from ._patches import trace_scope
    from ._state import StateIndex
    from ._trace import TRACE_LOCK, _TraceMode
    from ._watch import _Watch

    n_user, n_state, n_out = plan.n_user_in, len(plan.state), len(plan.tensor_entries)
    env = new_shape_env() if symbolic else None
    mode = _TraceMode(allow_non_fake_inputs=True, shape_env=env, static_shapes=True) if symbolic else \
        _TraceMode(allow_non_fake_inputs=True)
    shapes, tan_specs = _stand_in_shapes(plan, metas, tensors, env)
    with mode:
        fakes = [
            torch.empty_strided(shape, stride, dtype=m[3], device=m[4]).requires_grad_(bool(n))
            for (shape, stride), m, n in zip(shapes, metas[:n_user], need[:n_user])
        ]
        # a tangent per output, shaped like it; those of outputs that do not require grad stay unused
        tangents = [torch.zeros(shape, dtype=dtype, device=device) for shape, _stride, dtype, device in tan_specs]
    storages: dict = {}
    watch = _Watch(storages, list(plan.in_paths[:n_user]), owner._desc, plan.cuda, mode, StateIndex(()), n_user)
    for t in plan.state:  # state keeps the forward plan's order: inputs line up with the recording's
        watch._fake(t)
    box: dict = {"env": env}
    # (the functional re-trace's inputs: primals, the caller's then state, then tangents)
    box["specs"] = [(shape, stride, m[3], m[4]) for (shape, stride), m in zip(shapes, metas[:n_user])] + \
        [(m[1], m[2], m[3], m[4]) for m in metas[n_user:]] + list(tan_specs)
    joint = functools.partial(_joint, plan, need, owner, watch, storages, box)
    if len(tangents) != n_out:
        return None
    try:
        # (library code sees the same torch.compiler.is_compiling() as in the forward's trace:
        # it must take the same branch in both)
        with TRACE_LOCK, trace_scope(), mode, symbolic_dispatch(env):
            gm = make_fx(joint, tracing_mode="real", _allow_non_fake_inputs=True)(*fakes, *tangents)
    finally:
        mode.closed = owner._desc
    if box.get("draws_in_backward"):
        raise _backward_draws(owner._desc)
    if len(watch.state) != n_state or len(box["diff"]) != n_out:
        return None  # the backward reached state the forward did not: keep the recompute path
    if env is not None:
        for i, d in sorted(plan.sizes.dims):
            s = fakes[i].shape[d]
            if not isinstance(s, torch.SymInt) or env.replace(s.node.expr).is_number:
                log.info("%s: the joint trace fixed %s.size(%d); each size is partitioned as is", owner._desc,
                         plan.in_paths[i], d)
                return None
        box["guards"] = env.produce_guards_expression(fakes)
    from ._rewrite import _drop_profiler_nodes, _lift_state, _name_default_dtypes

    _lift_state(gm, watch.state_fakes)
    _drop_profiler_nodes(gm)
    _name_default_dtypes(gm)
    # placeholders as the partitioner expects them: primals (the caller's, then state), then tangents
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = phs[:n_user] + phs[n_user + n_out:] + phs[n_user:n_user + n_out]
    body = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for n in order:
        body.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return gm, box


def _joint(plan: Any, need: Sequence[bool], owner: Any, watch: Any, storages: dict, box: dict,
           *ins: torch.Tensor) -> tuple:
    """The joint function ``make_fx`` traces: the forward, then ``autograd.grad`` of its outputs."""
    from ._objects import flatten_output
    from ._patches import muted_hooks
    from ._watch import _RnnScope

    n_user, n_state = plan.n_user_in, len(plan.state)
    user, tans = list(ins[:n_user]), ins[n_user:]
    storages.clear()
    for i, t in enumerate(user):
        storages.setdefault(StorageWeakRef(t.untyped_storage()), i)
    for k, f in enumerate(watch.state_fakes):
        storages.setdefault(StorageWeakRef(f.untyped_storage()), n_user + k)
    args, kwargs = plan.rebuild(user)
    with torch.enable_grad():
        with watch, _RnnScope(watch):
            out = plan.fn(*args, **kwargs)
        leaves, _ = flatten_output(out, owner._desc)
        outs = [x for x in leaves if isinstance(x, torch.Tensor)]
        # forward outputs before any backward op (the partitioner goes by placement)
        detached = [o.detach() for o in outs]
        diff = [bool(o.requires_grad and (o.is_floating_point() or o.is_complex())) for o in outs]
        wrt = [user[i] for i in range(n_user) if need[i]] + [plan.state[k] for k in range(n_state) if need[n_user + k]]
        pairs = [(o, t) for o, t, d in zip(outs, tans, diff) if d]
        box["reach"] = _reach(outs, diff, wrt)
        grads: Sequence[Any] = [None] * len(wrt)
        if pairs and wrt:
            # hooks the caller registered on state (p.register_hook(...)) run where eager
            # runs them, when the recording's gradient reaches the parameter: not in here,
            # or the recorded backward would apply them a second time
            # (muted for this thread only: another thread's backward still runs them)
            drawn = sum(watch.rng.draws.values())
            # (autocast off: the caller's backward runs after their autocast block, as torch
            # recommends; the forward above ran under it, as in eager)
            with muted_hooks(plan.state), watch, autocast_off():
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True)
            if sum(watch.rng.draws.values()) > drawn:
                box["draws_in_backward"] = True
    box["diff"] = diff
    box["none"] = [g is None for g in grads]
    return tuple(detached) + tuple(g for g in grads if g is not None)


def _stand_in_shapes(plan: Any, metas: Sequence[Any], tensors: Sequence[torch.Tensor],
                     env: Any) -> Tuple[List[Tuple[Any, Any]], List[Tuple[Any, Any, Any, Any]]]:
    """The joint trace's inputs: the caller's tensors' (size, stride), and each tangent's (size, stride, dtype, device).

    With a shape environment (``env``), the symbolic plan's dimensions are its symbols, and the
    tangents' sizes their expressions of them (the plan's output sizes, renamed); a tangent's
    stride is then ``None`` (row-major).
    """
    n_user = plan.n_user_in
    specs = [(m[1], m[2]) for m in metas[:n_user]]
    if env is None:
        return specs, _output_specs(plan, tensors)
    symbols: Dict[Any, Tuple[int, int]] = {}
    shapes = symbolic_fakes(env, specs, plan.sizes.dims, plan.in_paths, symbols)
    hints = {sym: int(metas[i][1][d]) for sym, (i, d) in symbols.items()}
    tans = [(tuple(plan.sizes.renamed(x, symbols, env, hints) for x in v.shape), None, v.dtype, v.device)
            for v in _output_metas(plan)]
    return [(list(a), list(b)) for a, b in shapes], tans


def _functional_joint(gm: Any, plan: Any, box: dict) -> Any:
    """The joint graph functionalized and tagged as the partitioner wants it.

    The partitioner wants a functional graph (dropout's bernoulli_ and div_ are in place):
    functionalize it, as AOTAutograd does. Views stay views (as in AOTAutograd): a view
    turned into a copy loses eager's strides, which random fills follow (see
    _random_ops_in_place).
    """
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    from ._trace import TRACE_LOCK

    _extract_tensor_metadata = load_extract_tensor_metadata()
    n_user, n_state, n_out = plan.n_user_in, len(plan.state), len(plan.tensor_entries)
    env = box["env"]
    fmode = FakeTensorMode(shape_env=env, static_shapes=True) if env is not None else FakeTensorMode()
    with fmode:
        ins = [torch.empty(shape, dtype=dtype, device=device) if stride is None else
               torch.empty_strided(shape, stride, dtype=dtype, device=device)
               for shape, stride, dtype, device in box["specs"]]
        with TRACE_LOCK, symbolic_dispatch(env), autocast_off():
            # (its forward: a module call would run the global module hooks on gtransform's graph)
            gm = make_fx(functionalize(functools.partial(run_graph, gm), remove="mutations"), tracing_mode="real")(*ins)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, n in enumerate(phs):
        n.target = n.name = f"primals_{k + 1}" if k < n_user + n_state else f"tangents_{k - n_user - n_state + 1}"
    # the partitioner saves forward values that carry tensor metadata (and recomputes the
    # rest in the backward: a random op would draw again)
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and "tensor_meta" not in n.meta:
            n.meta["tensor_meta"] = _extract_tensor_metadata(v)
    # the forward is what the forward outputs need (AOTAutograd tags it the same way)
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    todo = [a for a in out_node.args[0][:n_out] if isinstance(a, torch.fx.Node)]
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op != "placeholder":
            n.meta["partitioner_tag"] = "is_forward"
        todo.extend(n.all_input_nodes)
    gm.graph.lint()
    gm.recompile()
    return gm


def _copy_reinterpreted_saves(fw_gm: torch.fx.GraphModule, n_out: int) -> None:
    """Save copies of the views of an input with another dtype that the backward takes (``z.real``).

    The forward's recording hands a value that aliases an input back as a view of the
    caller's tensor, which needs the same dtype; a complex input's real part (a float view of
    complex memory) is copied instead, as any value the forward computes.
    """
    out = next(n for n in fw_gm.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    dtypes = {}
    for p in fw_gm.graph.nodes:
        v = p.meta.get("val") if p.op == "placeholder" else None
        if isinstance(v, torch.Tensor):
            dtypes[StorageWeakRef(v.untyped_storage())] = v.dtype
    changed = False
    for k in range(n_out, len(outs)):
        a = outs[k]
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if not isinstance(v, torch.Tensor) or dtypes.get(StorageWeakRef(v.untyped_storage()), v.dtype) == v.dtype:
            continue
        with fw_gm.graph.inserting_before(out):
            c = fw_gm.graph.call_function(torch.ops.aten.clone.default, (a,))
        c.meta["val"] = v.clone()
        outs[k] = c
        changed = True
    if changed:
        out.args = (tuple(outs),)
        fw_gm.recompile()


def _split_joint(gm: Any, plan: Any, owner: Any, box: dict, tensors: Sequence[torch.Tensor]) -> Optional[Partition]:
    """The functional joint graph split into a forward and a backward, each a graphified function.

    ``None`` for a symbolic joint whose backward takes a size it cannot read from its tensors.
    """
    default_partition = load_default_partition()
    n_out = len(plan.tensor_entries)
    fw_gm, bw_gm = default_partition(gm, None, num_fwd_outputs=n_out)
    _random_ops_in_place(fw_gm)
    _copy_reinterpreted_saves(fw_gm, n_out)
    # a random op the backward does not use (the forward saved its result) must not draw
    # again: the backward graph is functional, so whatever no output needs goes
    bw_gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output"))
    # nor does it take the tangents it does not use (of outputs that do not require grad, or
    # whose gradient does not depend on it): autograd hands those over as None, and a recording
    # would need a tensor for each; nor sizes it does not use (symbolic)
    for n in list(bw_gm.graph.nodes):
        if n.op == "placeholder" and not n.users and ("tangents" in str(n.target) or not _is_tensor(n)):
            bw_gm.graph.erase_node(n)
    bw_gm.recompile()
    fw_outs = [n for n in fw_gm.graph.nodes if n.op == "output"][0].args[0]
    # (a symbolic forward also returns the sizes the backward takes, after the tensors: they
    # are read from the backward's own tensors instead, see _sized_backward)
    n_fw = sum(1 for a in fw_outs if not isinstance(a, torch.fx.Node) or _is_tensor(a))
    backward = _sized_backward(bw_gm, f"backward of {owner._desc}")
    if backward is None:
        log.info("%s: the symbolic backward takes a size none of its tensors has; each size is partitioned as is",
                 owner._desc)
        return None
    # the tangents the backward takes (by their position among the outputs)
    tan_idx = [int(str(n.target).split("_")[-1]) - 1 for n in bw_gm.graph.nodes
               if n.op == "placeholder" and "tangents" in str(n.target)]
    every_size = box["env"] is not None
    fw = owner._spawn(_flat_fn(fw_gm, f"forward of {owner._desc}", n_fw), every_size)
    bw = owner._spawn(backward, every_size)
    if every_size:  # (traced symbolically from their first calls, laid out as here: see _symbolic.Layouts)
        fw._layouts = graph_layouts(fw_gm)
        bw._layouts = graph_layouts(bw_gm)
    part = Partition(fw, bw, n_out, n_fw - n_out, box["diff"], backward, box["none"], box["reach"],
                     _output_specs(plan, tensors))
    part.tan_idx = tan_idx
    if box["env"] is not None:
        part.env, part.guards = box["env"], box["guards"]
    return part


def _is_tensor(n: torch.fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _sized_backward(bw_gm: Any, name: str) -> Optional[Any]:
    """The backward as a function of its tensors alone: the sizes it takes, read from their sizes.

    The partition of a symbolic joint hands the backward the sizes it uses as numbers
    (AOTAutograd's saved SymInts). A recording takes tensors: each size is an expression of
    the trace's symbols, and each symbol is a dimension of one of the backward's tensors
    (an activation or a tangent), read there (traced symbolically, a SymInt of that
    dimension). ``None`` where a symbol is no tensor's dimension.
    """
    phs = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
    sized = [n for n in phs if not _is_tensor(n)]
    if not sized:
        return _flat_fn(bw_gm, name)
    if phs[: len(sized)] != sized:
        return None  # (the partitioner puts the sizes first)
    where = symbol_dims([n.meta["val"] for n in phs[len(sized):]])
    exprs = []
    for n in sized:
        v = n.meta.get("val")
        if not isinstance(v, (int, torch.SymInt)):
            return None
        e = v.node.expr if isinstance(v, torch.SymInt) else None
        if e is not None and not e.free_symbols <= where.keys():
            return None
        exprs.append(e if e is not None else int(v))
    evaluate = load_sympy_eval()

    def run(*ts: torch.Tensor) -> tuple:
        values = {sym: ts[j].shape[d] for sym, (j, d) in where.items()}
        return tuple(run_graph(bw_gm, *[e if isinstance(e, int) else evaluate(e, values) for e in exprs], *ts))

    run.__name__ = run.__qualname__ = name
    return run


@functools.cache
def _functional_random() -> Dict[Any, Any]:
    """Functional random ops (what functionalization makes of an in-place fill) -> the in-place op."""
    aten = torch.ops.aten
    pairs = [("bernoulli", "p", "bernoulli_", "float"), ("uniform", "default", "uniform_", "default"),
             ("normal_functional", "default", "normal_", "default"), ("exponential", "default", "exponential_", "default"),
             ("random", "default", "random_", "default"), ("random", "from", "random_", "from"), ("random", "to", "random_", "to")]
    out = {}
    for f, fo, i, io in pairs:
        try:
            out[getattr(getattr(aten, f), fo)] = getattr(getattr(aten, i), io)
        except AttributeError:
            pass
    return out


def _random_ops_in_place(gm: torch.fx.GraphModule) -> None:
    """Random fills back in place, on a tensor laid out like eager's.

    Functionalization turns dropout's ``empty_like(x).bernoulli_(p)`` into ``bernoulli(empty_like(x), p)``,
    whose result is contiguous whatever ``x``'s strides: the same random stream then lands on
    other elements than in eager when ``x`` is transposed (a mask that differs from eager's).
    ``bernoulli_(empty_like(a), p)`` fills memory in eager's order. (These ops overwrite every
    element: ``a``'s values play no part.)
    """
    table = _functional_random()
    changed = False
    for n in list(gm.graph.nodes):
        inplace = table.get(n.target) if n.op == "call_function" else None
        if inplace is None or not n.args or not isinstance(n.args[0], torch.fx.Node):
            continue
        with gm.graph.inserting_before(n):
            fresh = gm.graph.call_function(torch.ops.aten.empty_like.default, (n.args[0],))
            filled = gm.graph.call_function(inplace, (fresh, *n.args[1:]), dict(n.kwargs))
        filled.meta.update(n.meta)
        n.replace_all_uses_with(filled)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _output_specs(plan: Any, tensors: Sequence[torch.Tensor]) -> List[Tuple[Any, ...]]:
    """Each tensor output's (size, stride, dtype, device) at this call (a symbolic plan's: for these tensors' sizes)."""
    vals = _output_metas(plan)
    if plan.sizes is None:
        return [(tuple(v.shape), tuple(v.stride()), v.dtype, v.device) for v in vals]
    num = plan.sizes.numbers(tensors)
    return [(tuple(map(num, v.shape)), tuple(map(num, v.stride())), v.dtype, v.device) for v in vals]


def _output_metas(plan: Any) -> List[Any]:
    """Fake values of the forward plan's tensor outputs (from its graph's output node)."""
    out = [n for n in plan.gm.graph.nodes if n.op == "output"][0]
    vals = []
    for a in list(out.args[0])[: len(plan.tensor_entries)]:
        v = a.meta.get("val") if hasattr(a, "meta") else None
        if v is None:
            raise RuntimeError("no output metadata")
        vals.append(v)
    return vals

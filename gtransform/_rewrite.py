"""Passes over the traced fx graph, run once the trace is made.

``make_fx`` returns a graph that holds state as constants and carries host-only
markers; these passes rewrite it in place into one that can be recorded and
replayed: state becomes trailing inputs (:func:`_lift_state`), profiler markers
go (:func:`_drop_profiler_nodes`), factory ops name the default dtype they used
(:func:`_name_default_dtypes`), pure ops whose results nothing uses
(:func:`_drop_dead_ops`), kernels whose saved outputs need grad mode
keep it (:func:`_kernels_in_grad_mode`), autograd's zero tensors become memory
(:func:`_materialize_zero_tensors`), and a CUDA function's constants move to
the device (:func:`_constants_to_device`). ``_trace.trace`` and ``_partition``
run them; watching the function while it is traced is ``_watch``'s.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._compat import FakeTensor, aten_efficientzerotensor, autocast_off


def _constants_to_device(gm: torch.fx.GraphModule, device: Optional[torch.device]) -> None:
    """Move tensor constants made inside a CUDA function to the device once.

    Constants such as ``torch.tensor(5.)`` or the ``5.`` of ``x[0] = 5.`` are
    then copied on the device instead of from pageable host memory.
    """
    if device is None:
        return
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            val = getattr(gm, node.target, None)
            if isinstance(val, torch.Tensor) and val.device.type == "cpu":
                setattr(gm, node.target, val.to(device))


def _lift_state(gm: torch.fx.GraphModule, fakes: Sequence[FakeTensor]) -> None:
    """Turn the graph's constants that are state into trailing placeholders (in ``fakes`` order)."""
    graph = gm.graph
    index = {id(f): k for k, f in enumerate(fakes)}
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = phs[-1] if phs else None
    new_ph = []
    for k in range(len(fakes)):
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                ph = graph.placeholder(f"state_{k}")
        else:
            with graph.inserting_after(anchor):
                ph = graph.placeholder(f"state_{k}")
        anchor = ph
        new_ph.append(ph)
    by_storage = {StorageWeakRef(f.untyped_storage()): k for k, f in enumerate(fakes)}
    names = set()
    for n in list(graph.nodes):
        if n.op == "get_attr":
            const = getattr(gm, n.target, None)
            found = index.get(id(const))
            if found is not None:
                n.replace_all_uses_with(new_ph[found])
                graph.erase_node(n)
                names.add(n.target)
            elif isinstance(const, FakeTensor) and (found := by_storage.get(StorageWeakRef(const.untyped_storage()))) is not None:
                # another tensor object over state's memory, made where the trace could not
                # see it (torch 2.14's AccumulateGrad adds into an alias of .grad): that
                # view of the state input
                with graph.inserting_before(n):
                    view = graph.call_function(torch.ops.aten.as_strided.default, (
                        new_ph[found], list(const.shape), list(const.stride()), const.storage_offset()))
                view.meta["val"] = const
                n.replace_all_uses_with(view)
                graph.erase_node(n)
                names.add(n.target)
    for name in names:
        if hasattr(gm, name):
            delattr(gm, name)


@functools.cache
def _rnn_layer_in_grad_mode() -> Any:
    """``aten.mkldnn_rnn_layer`` run with grad mode on: an op of its own for the trace.

    The CPU's oneDNN LSTM/GRU kernel makes the workspace its backward needs only when
    grad mode is on (its ``train`` argument is not enough), and recorded forwards
    replay without grad mode: the saved workspace would be missing. The op detaches
    its inputs, so no autograd graph is built.
    """
    aten_op = torch.ops.aten.mkldnn_rnn_layer.default

    @torch.library.custom_op("gtransform::mkldnn_rnn_layer_in_grad_mode", mutates_args=())
    def rnn_layer(input: torch.Tensor, weight0: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
                  weight3: torch.Tensor, hx_: torch.Tensor, cx_: torch.Tensor, reverse: bool, batch_sizes: List[int],
                  mode: int, hidden_size: int, num_layers: int, has_biases: bool, bidirectional: bool,
                  batch_first: bool, train: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in
                (input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, batch_sizes, mode, hidden_size,
                 num_layers, has_biases, bidirectional, batch_first, train)]
        with torch.enable_grad():
            out = aten_op(*args)
        return tuple(o if o is not None else torch.empty(0, dtype=torch.uint8, device=input.device) for o in out)  # type: ignore[return-value]

    @rnn_layer.register_fake
    def _(*args: Any) -> Any:
        return aten_op(*args)

    return torch.ops.gtransform.mkldnn_rnn_layer_in_grad_mode.default


def _kernels_in_grad_mode(gm: torch.fx.GraphModule) -> None:
    """Forward ops whose saved outputs exist only with grad mode on run with it (see above)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.mkldnn_rnn_layer.default:
            n.target = _rnn_layer_in_grad_mode()
            changed = True
    if changed:
        gm.recompile()


def _materialize_zero_tensors(gm: torch.fx.GraphModule) -> None:
    """Record autograd's zero tensors (``aten._efficientzerotensor``) as ``aten.zeros``.

    Some derivative formulas give a gradient that is known to be zero as a ZeroTensor:
    ``sgn``'s of a real input, the ``grad`` of an op on a ZeroTensor. Such a tensor has
    no memory (its storage's address is null) and lives on its dispatch key alone; a
    recording hands its outputs out, and saves activations, as aliases of the pool
    storage the graph produced, which drop that key: reading one then reads address 0
    (a segfault on the CPU, an illegal address on CUDA). The trace has already applied
    what being a ZeroTensor means to every op that takes one (``zt * y`` is traced as a
    new zero tensor), so a zero tensor with memory gives the same numbers everywhere.
    """
    zero = aten_efficientzerotensor()
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is zero:
            n.target = torch.ops.aten.zeros.default
            changed = True
    if changed:
        gm.recompile()


def _name_default_dtypes(gm: torch.fx.GraphModule) -> None:
    """Give factory ops that made floating tensors of the default dtype that dtype by name.

    ``torch.ones(3)`` is traced as ``aten.ones(..., dtype=None)``: run, it takes the default
    dtype of the moment. A function that changes the default dtype part-way (a block that
    builds a grid in float64) was traced under the dtype of each point; a replay runs
    every op under the dtype the call started with.
    """
    changed = False
    for n in gm.graph.nodes:
        t = n.target
        schema = getattr(t, "_schema", None)  # (an OpOverload's)
        if n.op != "call_function" or schema is None or n.all_input_nodes:
            continue
        if n.kwargs.get("dtype") is not None or not any(a.name == "dtype" and a.kwarg_only for a in schema.arguments):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
            n.kwargs = {**n.kwargs, "dtype": v.dtype}
            changed = True
    if changed:
        gm.recompile()


def _drop_profiler_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove record_function markers (torch.optim's): host work with no effect on the numbers."""
    graph = gm.graph
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "profiler" and not n.users:
            graph.erase_node(n)


_KEPT_PREFIXES = ("_assert", "sym_constrain", "_functional_sym_constrain", "_functional_assert", "_print",
                  "record_stream", "_make_dep_token")


# data-dependent ops: the trace makes the op's node before its fake kernel refuses; where a
# frozen read replaced the value (see _frozen) the node is left without users, and replayed it
# would compute the value again (on CUDA a host sync, which a capture refuses). They are pure.
_DATA_DEPENDENT_OPS = frozenset(f"aten.{n}" for n in (  # (op names compared as strings)
    "nonzero.default", "masked_select.default", "_unique2.default", "unique_dim.default",
    "unique_consecutive.default", "index.Tensor", "bincount.default", "repeat_interleave.Tensor",
    "equal.default", "_local_scalar_dense.default",
))


def _pure(n: torch.fx.Node) -> bool:
    """Whether node ``n`` only computes its result.

    An aten/prims op that writes nothing, draws no random numbers and asserts nothing, or an
    item of a multi-output op's result.
    """
    if n.op != "call_function":
        return False
    t = n.target
    if str(t) in _DATA_DEPENDENT_OPS:
        return True
    if n.is_impure():
        return False
    if t is operator.getitem:
        return True
    schema = getattr(t, "_schema", None)  # (an OpOverload's)
    if schema is None or getattr(t, "namespace", None) not in ("aten", "prims"):
        return False
    if schema.is_mutable or not schema.returns or torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()):
        return False
    return not schema.name.split("::")[-1].startswith(_KEPT_PREFIXES)


def _drop_dead_ops(gm: torch.fx.GraphModule) -> int:
    """Take out the pure ops whose results nothing uses; how many.

    Eager runs them for nothing: torchdiffeq's ``t.to(y.abs().dtype)`` (a kernel per step for a
    dtype), a comparison or a data-dependent op whose value a frozen read replaced (``t1 >= t[j]``,
    PyG's ``nonzero`` of a mask: see ``_frozen``), a library's unused intermediate. A replay that skips them gives the same outputs and
    state, as ``torch.compile``'s graphs do. Writes, random draws (their generator's offset
    moves) and asserts stay.
    """
    graph = gm.graph
    dropped = 0
    for n in reversed(list(graph.nodes)):
        if not n.users and _pure(n):
            graph.erase_node(n)
            dropped += 1
    return dropped


def _reshape_computed_views(gm: torch.fx.GraphModule) -> int:
    """Record ``aten.view`` of a computed tensor as ``aten.reshape`` where nothing depends on the alias.

    Whether a reshape could be a view was decided on the trace's fake strides. A few of
    torch's fake kernels give other strides than the real kernel (``softplus_backward`` on
    the CPU with a transposed gradient), and the recorded view then fails on the real
    tensor ("view size is not compatible"). ``reshape`` is the same view when the real
    strides allow one and a copy otherwise; it is used only where neither the view nor a
    further view of it is written in place or returned, and where its source is computed
    (an input's strides are the caller's, known exactly). Returns how many nodes changed.
    """
    view = torch.ops.aten.view.default
    reshape = torch.ops.aten.reshape.default
    outputs: set = set()
    for n in gm.graph.nodes:
        if n.op == "output":
            torch.fx.node.map_arg(n.args, outputs.add)

    def aliases(node: torch.fx.Node) -> bool:
        s = getattr(node.target, "_schema", None)
        return s is not None and any(r.alias_info is not None for r in s.returns)

    def of_input(node: Any) -> bool:  # a view (of a view...) of an input or constant
        while isinstance(node, torch.fx.Node) and node.op == "call_function" and aliases(node):
            node = node.args[0]
        return not isinstance(node, torch.fx.Node) or node.op != "call_function"

    def alias_free(node: torch.fx.Node) -> bool:  # nothing writes, returns or keeps the alias
        for u in node.users:
            s = getattr(u.target, "_schema", None)
            if u.op != "call_function" or s is None or s.is_mutable:
                return False
            if aliases(u) and (u in outputs or not alias_free(u)):
                return False
        return True

    changed = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not view or n in outputs:
            continue
        if of_input(n.args[0]) or not alias_free(n):
            continue
        n.target = reshape
        changed += 1
    return changed


def run_graph(gm: Any, *args: Any) -> Any:
    """Run a traced (or compiled) graph: what every replay, warm-up and capture calls.

    Its ``forward``, not ``Module.__call__``: the GraphModule is gtransform's, and the global
    module hooks (``torch.nn.modules.module.register_module_forward_hook``: FLOP counters,
    activation statistics) are for the user's modules, which the trace ran them for. Outside
    autocast: the graph holds the trace's casts.
    """
    run = gm.forward if isinstance(gm, torch.fx.GraphModule) else gm
    with autocast_off():
        return run(*args)

"""Tracing a function over flat tensor leaves into an aten-level fx graph.

Each new signature is traced once with fake tensors (``make_fx`` under our own
``FakeTensorMode``, with no shape environment, so anything data-dependent fails
at once instead of being frozen). A dispatch mode sits inside the trace and
watches every operation (``_watch``): it records which inputs are written in
place, refuses resizes of inputs, and (for CUDA functions) refuses copies
between host and device and operations on CPU tensors, naming the user's
source line. The traced graph then goes through the passes of ``_rewrite``
and becomes a :class:`Plan`; the fused backend (:mod:`gtransform.fuse`) compiles it
for ``fuse=True``.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from ._compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    module_global_backward_hooks,
    sdpa_flags,
)
from ._errors import _PKG_DIR, GraphifyError, format_frame, innermost_frame, user_frame, user_frame_from_exc
from ._frozen import Frozen, Refreeze, guard_refs
from ._host_effects import (
    GeneratorGuard,
    UnseenOptimizers,
    function_caches,
    global_settings,
    iterator_position,
    iterators,
    number_bindings,
    settings_left_changed,
)
from ._objects import flatten_output
from ._patches import trace_scope
from ._rewrite import (
    _constants_to_device,
    _drop_dead_ops,
    _drop_profiler_nodes,
    _kernels_in_grad_mode,
    _lift_state,
    _materialize_zero_tensors,
    _name_default_dtypes,
    _reshape_computed_views,
)
from ._roots import Root, Slot, named_values, python_values
from ._snapshot import ScanResult, Snapshot, contains
from ._state import AttrReads, StateIndex, dynamic_cache_error, escape_error, is_dynamic_cache, leaf_grad, stored_error
from ._symbolic import (
    Layouts,
    SymbolicLeak,
    SymbolicSizes,
    concrete,
    hint,
    holds_for_sizes,
    new_shape_env,
    sym_expr,
    symbolic_dispatch,
    symbolic_fakes,
    symbolic_value,
)
from ._trace_checks import arg_containers, arg_containers_kept, made_after_backward, no_ddp_forward, output_views
from ._tree import has_grad, unflatten
from ._watch import (
    _AsIs,
    _FnWatch,
    _no_seeding,
    _returned_as_is,
    _TensorAttr,
    _tensors_in,
    _Watch,
    drop_history,
)

try:  # torch >= 2.1
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover
    GuardOnDataDependentSymNode = DataDependentOutputException  # type: ignore[misc,assignment]

__all__ = ["Plan", "OutEntry", "trace", "TRACE_LOCK", "tracing", "plain_layout"]

TRACE_LOCK = threading.RLock()
_ACTIVE = threading.local()


def tracing() -> bool:
    """Whether this thread is inside a graphify trace (a nested graphified call inlines)."""
    return bool(_ACTIVE.__dict__.get("depth"))


def plain_layout(t: torch.Tensor) -> bool:
    """Whether ``t`` owns its storage exactly: offset 0, dense, nothing else in the storage.

    A static buffer made for such an input has the caller's layout to the byte, so
    ``storage_offset()`` and ``as_strided`` read the same elements in the recording.
    """
    if t.storage_offset() != 0:
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _overlaps(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of this size and stride may have elements sharing memory."""
    dims = sorted((abs(st), sz) for sz, st in zip(size, stride) if sz != 1)
    if any(sz == 0 for sz in size):
        return False
    reach = 0  # the farthest element offset spanned by the dims so far
    for st, sz in dims:
        if st <= reach:
            return True
        reach += st * (sz - 1)
    return False


_FRIENDLY = {
    "aten._local_scalar_dense.default": (
        "reads a tensor's value on the host (.item(), float(t), int(t), bool(t), .tolist(), "
        "or Python control flow such as `if t > 0:`)"
    ),
    "aten.nonzero.default": "has an output shape that depends on the data (nonzero)",
    "aten._unique2.default": "has an output shape that depends on the data (torch.unique)",
    "aten.unique_dim.default": "has an output shape that depends on the data (torch.unique)",
    "aten.unique_consecutive.default": "has an output shape that depends on the data",
    "aten.masked_select.default": "has an output shape that depends on the data (masked_select)",
}
# ops torch cannot run on fake tensors (no shape rule), whose output shapes depend on values:
# what they are, and the fix
_CTC = ("has no shape rule in torch for fake tensors (CTC loss: torch computes its output size by running it)",
        " Compute the CTC loss outside the graphified function: return the log-probabilities from it "
        "and call F.ctc_loss on them.")
_NO_SHAPE_RULE = {
    "aten._ctc_loss.default": _CTC,
    "aten._ctc_loss.Tensor": _CTC,
    "aten._pack_padded_sequence.default": (
        "computes a packed sequence's batch sizes on the host (pack_padded_sequence)",
        " Run the recurrent layer on the padded batch and mask the padded steps (or pack and "
        "unpack outside the graphified function)."),
}
_FRIENDLY.update({k: v[0] for k, v in _NO_SHAPE_RULE.items()})
_FRIENDLY["aten.equal.default"] = "compares two tensors on the host (torch.equal)"
# public functions that read values on the host inside torch (a line of the call stack
# matching the pattern), and the fix: an equivalent without the read
_PUBLIC_HINTS = (
    (r"\b(cov|corrcoef)\(",
     " torch.cov and torch.corrcoef check their normalisation factor on the host. Write the "
     "product out: xc = x - x.mean(dim=1, keepdim=True); cov = xc @ xc.T.conj() / (x.shape[1] - 1) "
     "(corrcoef: d = cov.diagonal().sqrt(); cov / torch.outer(d, d))."),
    (r"\blstsq\(",
     " torch.linalg.lstsq picks its driver's work and its result from the matrix on the host. "
     "Use torch.linalg.pinv(A) @ B, or, for a well-conditioned full-rank A, "
     "torch.linalg.solve(A.mT @ A, A.mT @ B)."),
    (r"\bcombinations\(",
     " torch.combinations selects its pairs with a mask. Index with fixed indices instead: "
     "i, j = torch.triu_indices(n, n, offset=1, device=x.device); torch.stack([x[i], x[j]], dim=-1)."),
)
_SPARSE_NNZ = ("makes a sparse tensor whose number of nonzeros depends on the data (its nnz, values() "
               "and indices() are known only when it runs: while tracing they would read 0)")
# the ops that make such a tensor from a dense one (a sparse tensor built from known indices, as
# nn.Embedding(sparse=True)'s gradient, keeps a known number of nonzeros: allowed)
_SPARSE_MAKERS = frozenset(f"aten::{n}" for n in (
    "_to_sparse", "to_sparse", "_to_sparse_csr", "_to_sparse_csc", "_to_sparse_bsr", "_to_sparse_bsc",
    "to_sparse_csr", "to_sparse_csc", "to_sparse_bsr", "to_sparse_bsc"))
_FRIENDLY.update({f"aten.{m[6:]}.{o}": _SPARSE_NNZ for m in _SPARSE_MAKERS for o in ("default", "sparse_dim")})


def _sparse(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout != torch.strided


# torch's own messages for host reads that fake tensors cannot serve
_HOST_READS = (
    (".numpy() is not supported", ".numpy()"),
    ("Cannot access data pointer of Tensor", "an access to the data pointer"),
    ("Cannot access storage of", "an access to the storage"),
    # torch.tensor([y[1], -y[0]]) copies the values of 0-dim tensors on the host; so do
    # tensor_split and friends given tensor indices
    ("its data is not allocated yet", "building a tensor from tensors (torch.tensor([a, b]) of tensors, "
                                      "or tensor indices given to tensor_split)"),
)
_HOST_READ_FIX = {
    "its data is not allocated yet": " (torch.stack([a, b]) instead of torch.tensor([a, b]); Python "
                                     "integers as split indices)",
}


@dataclass
class OutEntry:
    """How to produce one leaf of the output tree at call time."""

    kind: str  # "const" | "input" | "pool"
    value: Any = None  # const: the value
    index: int = -1  # input: tensor-input index; pool: gm output index
    size: Tuple[int, ...] = ()
    stride: Tuple[int, ...] = ()
    rel_offset: int = 0
    identical: bool = False
    requires_grad: bool = False  # tensor: whether the function's output required grad while tracing
    # input: whether the output toggles the input's conjugate / negative bit (``z.conj()``,
    # ``torch._neg_view(x)``): a lazy view, rebuilt over the caller's tensor with the same toggle
    conj: bool = False
    neg: bool = False
    # const: a copy per call of a mutable value the function made (a set, a numpy array):
    # eager returns a new one on every call, so a change the caller makes must not show in
    # the next call's output
    fresh: Any = None


def fresh_copier(value: Any) -> Any:
    """How to give each call its own copy of a mutable non-tensor output leaf, or None."""
    t = type(value)
    if t in (set, bytearray):
        return t
    np = sys.modules.get("numpy")
    if np is not None and t is np.ndarray:
        return np.ndarray.copy
    return None


@dataclass
class Plan:
    """Everything known about one signature after tracing."""

    gm: torch.fx.GraphModule
    in_paths: List[str]
    mutated: Set[int]
    out_spec: Any
    out_entries: List[OutEntry]
    n_gm_out: int
    uses_cuda: bool
    random: bool
    op_count: int
    generators: List[Any] = field(default_factory=list)
    generator_at: List[str] = field(default_factory=list)  # the line of each one's first draw
    notes: List[str] = field(default_factory=list)
    # caller's inputs whose storage offset / layout the function reads: keyed on being plain
    layout_idx: Set[int] = field(default_factory=set)
    # caller's inputs whose ``.grad`` the function reads (it was None): keyed on staying None
    grad_idx: Set[int] = field(default_factory=set)
    # caller's inputs whose leafness the function reads (``is_leaf``, ``grad_fn``): keyed on
    # having autograd history (True) or not
    leaf_idx: Dict[int, bool] = field(default_factory=dict)
    # lines that registered tensor hooks (honoured by the joint trace, lost by a recompute)
    hooks: List[str] = field(default_factory=list)
    # custom torch.autograd.Functions the outputs depend on (likewise: their backward is
    # in the joint trace, not in a recompute of the recorded operations)
    custom_grad: List[str] = field(default_factory=list)
    # whether the outputs' requires_grad seen while tracing is eager's (inputs that
    # require grad, traced outside torch.func: there the stand-ins do not)
    rg_traced: bool = False
    # state (see _state.py): real tensors read as extra inputs after the
    # caller's, where each lives, and tensors left in Python state
    state: List[torch.Tensor] = field(default_factory=list)
    state_slots: List[Any] = field(default_factory=list)
    state_names: List[str] = field(default_factory=list)
    escape_slots: List[Any] = field(default_factory=list)
    escape_entries: List[OutEntry] = field(default_factory=list)
    # per escape, the out entry it is (the same tensor: ``self.last = h; return h``), or None
    escape_returned: List[Optional[int]] = field(default_factory=list)
    py_changes: List[Any] = field(default_factory=list)
    roots: List[Any] = field(default_factory=list)
    attr_reads: Any = None  # _state.AttrReads: the root modules' attributes the function read
    grad_cleared: List[torch.Tensor] = field(default_factory=list)  # .grad set to None by the function
    # state tensors whose .grad the function read before setting it to None (see _watch)
    grad_read_first: List[torch.Tensor] = field(default_factory=list)
    mutated_at: Dict[int, Tuple[str, str]] = field(default_factory=dict)  # input -> (op, line) of a write
    ran_backward: bool = False  # the function ran a backward itself (.backward(), autograd.grad)
    # the user's function and how to call it on the flat tensors (for the joint
    # forward+backward trace of _partition)
    fn: Any = None
    rebuild: Any = None
    cuda: bool = False
    # why the joint trace failed, if it did (named by the recompute path's refusals)
    joint_error: Optional[str] = None
    # why the forward and backward are not partitioned (set by _partition.build_partition)
    no_partition: str = ""
    # host reads of unchanged tensors frozen into the trace (see _frozen), and what they hang
    # on: input index -> (reference to the tensor, its version counter when read)
    frozen: List[Any] = field(default_factory=list)
    frozen_guard: Dict[int, Tuple[Any, int, int]] = field(default_factory=dict)
    # the plain Python values bound to names the function reaches (globals, closure cells,
    # partial keywords, the user's class and module attributes), as the call found them:
    # (path, where, key, value); see _roots.python_values
    py_values: Tuple[Tuple[str, Any, str, Any], ...] = ()
    # caller's inputs the function turns requires_grad on or off for (x.requires_grad_() inside,
    # the forces of a potential: -autograd.grad(E(x), x)): set so after every call, as eager leaves them
    input_flags: Dict[int, bool] = field(default_factory=dict)
    # traced with symbolic sizes (see _symbolic): the sizes it holds for, or None
    sizes: Optional[SymbolicSizes] = None
    shared: bool = False  # this signature's copy of another's symbolic plan: not traced
    sizes_pinned: str = ""  # traced symbolically, but a size was fixed: which, and where
    # a symbolic plan's partitioned forward and backward, by the inputs differentiated (see
    # _partition.partition): one joint trace for every size, shared with the plan's copies
    joints: Dict[Any, Any] = field(default_factory=dict)
    # (j, i, how): tensor output j is output i returned again ("same"), a view inside output i's
    # memory ("view"), its detached view ("detached") or a new leaf over it ("leaf"); the
    # autograd wrapper hands them out as such (see _trace_checks.output_views,
    # _autograd.call_with_autograd)
    out_views: List[Tuple[int, int, str]] = field(default_factory=list)
    # outputs that require grad, made after the function's last backward (a prediction after a
    # training step's update): their paths, and where that backward was called (see _key/_entry)
    after_backward: List[str] = field(default_factory=list)
    backward_at: str = ""
    # scaled_dot_product_attention's backend flags at trace time, if the function calls it: the
    # kernel traced is the one they picked (sdpa_kernel(...), torch.backends.cuda.enable_*_sdp)
    sdpa_flags: Optional[Tuple[bool, ...]] = None

    def __post_init__(self) -> None:
        self.tensor_entries = [e for e in self.out_entries if e.kind != "const"]
        # an input returned as is, or a view of one (handed out as eager's: see _autograd)
        self.returns_inputs = any(e.kind == "input" for e in self.tensor_entries)
        self.n_user_in = len(self.in_paths) - len(self.state)
        self.touches_state = bool(self.state or self.escape_slots)
        self.all_const = not self.tensor_entries
        self._fused: Any = None

    def fused(self) -> Any:
        """The graph compiled by TorchInductor (made once, on first use).

        Inductor's own CUDA graphs are off (gtransform records the result),
        and random ops use eager's generator (``fallback_random``) so that
        they keep following ``torch.manual_seed`` exactly. A plan traced with symbolic
        sizes is compiled once for all of them (its copies for other sizes share it: see
        ``_symbolic.shared_plan``).
        """
        if self._fused is None:
            from .fuse import compiled  # the fused backend: loaded for fuse=True alone

            self._fused = compiled(self.gm, self.sizes.symbolic if self.sizes is not None else None)
        return self._fused

    def assemble(self, flat: Sequence[Any]) -> Any:
        """Output tree from the tensor outputs (in graph order)."""
        it = iter(flat)
        leaves = [(e.value if e.fresh is None else e.fresh(e.value)) if e.kind == "const" else next(it)
                  for e in self.out_entries]
        return unflatten(self.out_spec, leaves)


class _TraceMode(FakeTensorMode):
    """The trace's fake mode; once the trace is over, any work on its tensors is an error.

    A tensor made while tracing that was left somewhere gtransform could not
    see (JAX's "leaked tracer") then fails loudly instead of computing on
    placeholders.
    """

    _closed: Optional[str] = None

    @property
    def closed(self) -> Optional[str]:
        return self._closed

    @closed.setter
    def closed(self, desc: Optional[str]) -> None:
        self._closed = desc
        if desc is not None:
            self._forget_real_tensors()

    def _forget_real_tensors(self) -> None:
        """Drop the converter's weak references to the real tensors it met (parameters, state).

        A tensor with a weak reference cannot be swapped (torch.utils.swap_tensors,
        module.to() with swap_module_params_on_conversion); a closed mode converts nothing more.
        """
        conv = getattr(self, "fake_tensor_converter", None)
        meta = getattr(conv, "meta_converter", None)
        desc = getattr(meta, "describer", None)
        for owner, name in ((desc, "lookup_tensor"), (desc, "lookup_storage"), (conv, "tensor_memo"),
                            (meta, "tensor_memo")):
            d = getattr(owner, name, None)
            if d is not None and hasattr(d, "clear"):
                try:
                    d.clear()
                except Exception:  # pragma: no cover - another torch's layout
                    pass

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if self.closed is not None:
            site = ""
            for a in list(args) + list((kwargs or {}).values()):
                for t in _tensors_in(a):
                    site = t.__dict__.get("_gt_site", "") if isinstance(t, FakeTensor) else ""
                    if site:
                        break
                if site:
                    break
            made = f"\n  made at {site}" if site else ""
            raise GraphifyError(
                f"{self.closed}: a tensor made while tracing it was used after the trace "
                f"(operation {func}).{made}\n"
                "Why: the function stored a traced tensor in Python state (a list, a dict, an "
                "attribute...) where gtransform could not see it; it is a placeholder without data.\n"
                "Fix: return the tensor from the function and keep the returned value instead "
                "(e.g. log.append(f(x).clone())), or write into a preallocated tensor in place."
            )
        if func.overloadpacket._qualified_op_name in _SPARSE_MAKERS and args and not _sparse(args[0]):
            # a dense tensor made sparse: its fake reports 0 nonzeros (to_sparse().values()
            # .numel() read 0); reads from Python are refused by _watch._FnWatch
            raise DynamicOutputShapeException(func)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _resolved(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The graph's outputs, those with the conjugate or negative bit made plain tensors.

    The bit is a property of the tensor object, not of its memory: an output handed out
    over the pool's memory (or a saved activation that reaches the backward recording)
    would lose it and read the wrong values. Such outputs are materialised in the graph
    (one copy, only for them). Views of the inputs keep the bit instead: their entry
    toggles it on the caller's tensor (see ``OutEntry.conj``).
    """
    if not any(o.is_conj() or o.is_neg() for o in outs):
        return list(outs)
    ins = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    done: Dict[int, torch.Tensor] = {}  # an output returned twice stays one tensor
    res = []
    for o in outs:
        if (o.is_conj() or o.is_neg()) and isinstance(o, FakeTensor) and StorageWeakRef(o.untyped_storage()) not in ins:
            r = done.get(id(o))
            if r is None:
                r = o
                if r.is_conj():
                    r = torch.ops.aten.resolve_conj.default(r)
                if r.is_neg():
                    r = torch.ops.aten.resolve_neg.default(r)
                done[id(o)] = r
            o = r
        res.append(o)
    return res


def _custom_functions(outs: Sequence[torch.Tensor], stop: Sequence[Any] = ()) -> List[str]:
    """Names of the custom autograd functions (``torch.autograd.Function``) in the outputs' autograd graph.

    ``stop``: nodes not to enter, the history of state tensors (an RNN's carried hidden
    state ``m.h = out`` of an earlier call): it lies outside the function, and autograd
    reaches it through the state's gradient, as in eager.
    """
    seen: Set[Any] = set(stop)
    names: List[str] = []
    todo: List[Any] = [o.grad_fn for o in outs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            cls = getattr(node, "_forward_cls", None)
            name = getattr(cls, "__qualname__", type(node).__name__)
            # a custom op's registered autograd (torch.library) is not one: the op is a node
            # of the graph, and running that node under autograd runs its backward
            if name.startswith("GeneratedBackwardFor_"):
                pass
            elif name not in names:
                names.append(name)
        todo.extend(f for f, _ in node.next_functions)
    return names


def _public_library_frame(filename: str) -> bool:
    """Whether a frame is a library's public code.

    That is torch.nn, torch.optim, torch.distributions or a third-party package; not
    gtransform, generated code or torch's machinery (dispatch, fake tensors, fx).
    """
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_PKG_DIR + os.sep):
        return False
    i = path.rfind(os.sep + "torch" + os.sep)
    if i < 0:
        return True
    sub = path[i + len(os.sep + "torch" + os.sep):]
    return sub.startswith(("nn" + os.sep, "optim" + os.sep, "distributions" + os.sep))


def _data_dependent(desc: str, exc: BaseException, cuda: bool = False) -> GraphifyError:
    op = str(exc).split("\n", 1)[0].strip()
    key = ""
    if isinstance(exc, GuardOnDataDependentSymNode):
        op_desc = "branches on a tensor's value"
        op = "a data-dependent guard"
    else:
        key = op.split(" ")[0]
        op_desc = _FRIENDLY.get(key, "depends on the values inside a tensor")
    tb = traceback.extract_tb(exc.__traceback__)
    fr = user_frame(tb)
    if fr is None or fr.filename.startswith("<"):
        # no line of the user's in the trace (graphify(module) of a torch module): the
        # innermost real file (torch's own, e.g. batchnorm.py) says more than generated code
        fr = next((f for f in reversed(tb) if _public_library_frame(f.filename)), fr)
    inner = innermost_frame(tb)
    where = f"  at {format_frame(fr)}"
    if inner is not None and (fr is None or (inner.filename, inner.lineno) != (fr.filename, fr.lineno)):
        where += f"\n  read at {format_frame(inner)}"
    hint = ""
    if key in _NO_SHAPE_RULE:
        hint = _NO_SHAPE_RULE[key][1]
    if not hint:
        # public functions whose aten ops read values on the host (their names alone say little)
        called = " ".join(f.line for f in tb if f.line)
        hint = next((h for pattern, h in _PUBLIC_HINTS if re.search(pattern, called)), "")
    own_fix = bool(hint) or op_desc is _SPARSE_NNZ  # the fix is the hint alone (the generic one misleads)
    one_hot = [f for f in tb if f.line and "one_hot" in f.line]
    if one_hot and not hint:
        hint = (" F.one_hot without num_classes reads the largest class index on the host: pass "
                "num_classes= (e.g. F.one_hot(t, num_classes=10)).")
    if op_desc is _SPARSE_NNZ:
        hint = (" A sparse tensor's nonzeros are known only when it runs. Keep sparse tensors out of "
                "the graphified function: compute densely (a dense mask and torch.where instead of "
                "to_sparse()), or, for nn.Embedding(sparse=True) with SparseAdam, use sparse=False with "
                "a dense optimizer (Adam(fused=True)), or keep opt.step() outside.")
    optim = [f for f in tb if os.sep + os.path.join("torch", "optim") + os.sep in f.filename]
    dist = [f for f in tb if os.sep + os.path.join("torch", "distributions") + os.sep in f.filename]
    bn = [f for f in tb if f.filename.endswith("batchnorm.py") and "num_batches_tracked" in (f.line or "")]
    scaler = [f for f in tb if f.filename.endswith("grad_scaler.py")]
    clip = [f for f in tb if f.filename.endswith("clip_grad.py") and "nonfinite" in (f.line or "")]
    if bn:
        at = bn[-1].filename[bn[-1].filename.rfind(os.sep + "torch" + os.sep) + 1:]
        hint = (f" The read is BatchNorm's cumulative moving average ({at}:{bn[-1].lineno}): with "
                "momentum=None it divides by its batch count, read on the host. Give the layer a "
                "momentum (e.g. momentum=0.1), or run it in eval mode (model.eval()).")
    elif hint:
        pass
    elif scaler:
        hint = (f" The read is torch.amp.GradScaler's check for overflowed gradients ({format_frame(scaler[-1])}): "
                "keep scaler.step(optimizer) and scaler.update() outside the graphified function (graphify the "
                "forward, the loss and scaler.scale(loss).backward(); GradScaler also keeps a new dict of "
                "per-optimizer state each step, which a replay cannot make).")
    elif clip:
        hint = (f" The read is clip_grad_norm_'s error_if_nonfinite=True check ({format_frame(clip[-1])}): "
                "pass error_if_nonfinite=False (the default), or check torch.isfinite(total_norm) on "
                "the returned norm outside the graphified function.")
    elif optim and re.search(r"\blr\b", optim[-1].line or "") and "step" not in (optim[-1].line or ""):
        hint = (f" The read is inside torch.optim ({format_frame(optim[-1])}): this optimizer reads a "
                "tensor learning rate on the host. Construct it with an implementation that keeps the "
                "learning rate on the device: fused=True (SGD, Adam, AdamW, Adagrad), foreach=True (SGD, "
                "Adagrad, Rprop) or, on the GPU, capturable=True (Adam, AdamW). Else pass lr as a Python "
                "float (a scheduler that changes it then records once per value), or keep opt.step() "
                "outside the graphified function.")
    elif dist and not optim:
        at = dist[-1].filename[dist[-1].filename.rfind(os.sep + "torch" + os.sep) + 1:]
        hint = (f" The read is inside torch.distributions ({at}:{dist[-1].lineno}, argument validation): a distribution "
                "checks its arguments on the host (validate_args, on by default). Pass "
                "validate_args=False to it (e.g. Categorical(logits=x, validate_args=False)), or call "
                "torch.distributions.Distribution.set_default_validate_args(False) once. The checks "
                "then do not run: where eager would raise on invalid parameters (NaN logits, a "
                "negative scale), the recording computes with them.")
    elif optim and os.path.basename(optim[-1].filename) in _STEP_COUNT_OPTIMIZERS:
        if cuda:
            hint = (f" The read is inside torch.optim ({format_frame(optim[-1])}): construct the optimizer "
                    "with capturable=True, so its step count stays a tensor on the GPU instead of being "
                    "read on the host.")
        else:
            hint = (f" The read is inside torch.optim ({format_frame(optim[-1])}): optimizers with a step count (Adam family, Adagrad...) "
                    "read their step count on the host unless capturable=True, which torch supports on GPUs "
                    "only. On the CPU, construct it with fused=True (Adam, AdamW, Adagrad, SGD keep the count "
                    "on the device), keep opt.step() outside the graphified function (graphify the forward, "
                    "or forward and backward), or use an optimizer without a step count such as SGD.")
    elif optim:
        what = {"swa_utils.py": "torch.optim.swa_utils (AveragedModel / SWALR count their updates on the host)",
                "lbfgs.py": "LBFGS (its line search and stopping tests read values on the host)"}.get(
            os.path.basename(optim[-1].filename), "torch.optim")
        hint = (f" The read is inside {what}, at {format_frame(optim[-1])}. Keep that call outside the "
                "graphified function (after it, on its outputs or the updated parameters).")
    return GraphifyError(
        f"{desc}: operation {op} {op_desc}.\n{where}\n"
        "Why: a recording is made once for each input signature and replayed without Python; "
        "a value read from a tensor while tracing would be frozen into the recording, "
        "and an output whose shape depends on the data cannot be replayed into fixed memory.\n"
        + (f"Fix:{hint}" if own_fix else
           "Fix: keep the value on the device (e.g. torch.where instead of `if`), make it static "
           "(pass a Python number, or mark the argument with static_argnums/static_argnames), "
           "or move this part out of the graphified function." + hint)
    )


# optimizers whose step count is read on the host unless capturable=True
_STEP_COUNT_OPTIMIZERS = frozenset(("adam.py", "adamw.py", "adamax.py", "nadam.py", "radam.py", "asgd.py",
                                    "adagrad.py", "_adafactor.py", "adafactor.py", "sparse_adam.py", "optimizer.py"))


def _host_rng_state(found: Sequence[Tuple[str, Any]] = ()) -> List[Tuple[str, Any, Any]]:
    """The state of the host's random generators, to see which ones a trace drew from.

    numpy's global one (if numpy is loaded), Python's ``random`` and the generator objects
    the function reaches (``found``: ``random.Random``, numpy's ``Generator`` and ``RandomState``).

    (Python's global ``random`` is not watched where torch.distributed is initialized: it
    draws from it while tracing, for its own purposes.)
    """
    out: List[Tuple[str, Any, Any]] = []
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            out.append(("numpy.random", np.random, np.random.get_state()))
        except Exception:  # pragma: no cover - a numpy without the legacy global generator
            pass
    dist = getattr(torch, "distributed", None)
    if not (dist is not None and dist.is_available() and dist.is_initialized()):
        out.append(("random", random, random.getstate()))
    for name, g in found:
        out.append((name, g, _rng_get(g)))
    return out


def _rng_get(g: Any) -> Any:
    """The state of a host generator (a module such as ``random``, or a generator object)."""
    if hasattr(g, "get_state"):  # (numpy.random, a RandomState)
        return g.get_state()
    if hasattr(g, "getstate"):  # (random, a random.Random)
        return g.getstate()
    return g.bit_generator.state  # (numpy's Generator)


def _rng_set(g: Any, st: Any) -> None:
    if hasattr(g, "set_state"):
        g.set_state(st)
    elif hasattr(g, "setstate"):
        g.setstate(st)
    else:
        g.bit_generator.state = st


def _rng_same(a: Any, b: Any) -> bool:
    """Two states of one host generator (numpy's legacy states hold an array)."""
    if isinstance(a, tuple) and len(a) == 5 and hasattr(a[1], "shape"):
        return a[0] == b[0] and a[2] == b[2] and a[3] == b[3] and bool((a[1] == b[1]).all())
    return bool(a == b)


def _host_rng_restore(saved: List[Tuple[str, Any, Any]]) -> List[str]:
    """Put the host generators back; the names of those the trace moved."""
    moved = []
    for name, g, st in saved:
        try:
            if not _rng_same(_rng_get(g), st):
                moved.append(name)
                _rng_set(g, st)
        except Exception:  # pragma: no cover
            pass
    return moved


def _no_traced_constants(gm: torch.fx.GraphModule, is_ours: Callable[[Any], bool], desc: str) -> None:
    """Refuse a graph that holds one of the trace's own tensors as a constant.

    A tensor the trace made but lost track of (stored in state and read back through
    torch's C++ accessors) would be a placeholder without data in every replay. (State is
    faked outside the tracer, so faking a ``.grad`` that is a view leaves no constant.)
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and is_ours(getattr(gm, str(node.target), None)):
            users = ", ".join(str(u.target) for u in list(node.users)[:2])
            raise GraphifyError(
                f"{desc}: the recording would read a tensor the trace made but could not follow"
                f"{f' (used by {users})' if users else ''}.\nWhy: it was stored in Python state and read back from there in "
                "the same call through a path the trace does not see (torch's C++ accessors); a replay "
                "would find a placeholder without data.\n"
                "Fix: store a copy where the function stores it (state.x = t.clone()), or compute it "
                "where it is read."
            )




def _no_dynamic_cache(desc: str, roots: Sequence[Root], scan: ScanResult) -> None:
    """Refuse a trace that grew a Hugging Face ``DynamicCache`` the function reaches.

    Its layers appended (an empty cache) or its keys and values made anew (a filled one):
    it grows on every call, which the generic messages would blame on the user's code.
    """
    changed = scan.grown + [s.path for s, _ in scan.escapes] + [p for p, _, _ in scan.stored]
    for r in roots:
        if not is_dynamic_cache(r.obj):
            continue
        mine = [p for p in changed if p == r.name or p.startswith((r.name + ".", r.name + "["))]
        if mine:
            sites = scan.sites + scan.stored_sites + [f.__dict__.get("_gt_site", "") for _, f in scan.escapes]
            made = next((x for x in sites if x), "")
            raise dynamic_cache_error(desc, r.name, r.obj, list(dict.fromkeys(mine)),
                                      f"\n  made at {made}" if made else "")


def _backward_hooked_modules(roots: Sequence[Root]) -> List[str]:
    """Names of the modules the function reaches that have backward hooks ("(global)" for global ones)."""
    if module_global_backward_hooks():
        return ["(global: register_module_full_backward_hook)"]
    out: List[str] = []
    for r in roots:
        if isinstance(r.obj, torch.nn.Module):
            for name, m in r.obj.named_modules():
                if m._backward_hooks or getattr(m, "_backward_pre_hooks", None):
                    out.append(f"{r.name}.{name} ({type(m).__name__})" if name else f"{r.name} ({type(m).__name__})")
    return out


def _internal_failure(desc: str, exc: BaseException, cuda: bool) -> Optional[GraphifyError]:
    """A GraphifyError for an error raised inside torch while tracing (not by the user's code).

    The user's own exceptions propagate unchanged; this is for operations that
    run eagerly but cannot be traced with fake tensors.
    """
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb or not tb[-1].filename.startswith(os.path.dirname(os.path.abspath(torch.__file__))):
        return None
    text = str(exc)
    if "meta" not in text and "fake" not in text.lower():
        return None  # e.g. a shape mismatch: the user's own error, raised as eager would
    fr = user_frame(tb)
    hint = ""
    if any(os.sep + os.path.join("torch", "optim") + os.sep in f.filename for f in tb):
        hint = (" The failing operation is inside torch.optim: " + (
            "construct the optimizer with capturable=True." if cuda else
            "Adam-family optimizers need capturable=True, which torch supports on GPUs only; on the CPU "
            "construct Adam, AdamW or Adagrad with fused=True, keep opt.step() outside the graphified "
            "function, or use SGD."))
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return GraphifyError(
        f"{desc}: torch cannot trace an operation of the function: {type(exc).__name__}: {first}\n"
        f"  at {format_frame(fr)}\n"
        "Why: graphify traces each signature with fake tensors (no data); this operation works "
        "eagerly but not on fake tensors.\n"
        "Fix: move this operation out of the graphified function, or call the function eagerly." + hint
    )


def _grad_of_argument(desc: str, path: str, where: str, history: bool = False) -> None:
    """Refuse a backward inside the function that fills the .grad of an argument."""
    if history:
        # `update(loss)` with the loss computed eagerly: the backward would run through the
        # caller's autograd graph, which no recording holds
        raise GraphifyError(
            f"{desc}: a backward pass inside the function (loss.backward()) runs through {path}, a "
            "tensor with autograd history made outside the function (a loss computed eagerly and "
            f"passed in).\n  at {where or '?'}\n"
            "Why: a recording holds only the operations the function runs; the backward through "
            "the caller's graph (the forward that made the loss) cannot be part of it.\n"
            "Fix: compute the forward inside the graphified function too (pass the batch, not the "
            "loss), or call .backward() outside and graphify only the optimizer step "
            "(def update(): opt.step(); opt.zero_grad())."
        )
    raise GraphifyError(
        f"{desc}: a backward pass inside the function (loss.backward()) writes {path}.grad, the "
        f"gradient of a tensor the function takes as an argument.\n  at {where or '?'}\n"
        "Why: a recording writes gradients only into state the function reaches without taking it "
        "as an argument (a module's parameters); an argument may be another tensor on every call, "
        "so its .grad would be left unset (as None) on every call.\n"
        "Fix: close over the parameters (call a module, or read a list or dict of them that the "
        "function does not take as an argument), or return the gradients instead: "
        "torch.autograd.grad(loss, params), or graphify(torch.func.grad(loss_fn))."
    )


def _no_grad_outputs_requiring_grad(desc: str, spec: Any, leaves: Sequence[Any], escapes: Sequence[Any]) -> None:
    """Refuse outputs that require grad from a call made with grad mode off.

    The function turned grad mode on itself (``torch.enable_grad()``,
    ``torch.set_grad_enabled(True)``): eager's outputs then carry an autograd
    graph although the caller is under ``torch.no_grad()``, and a replay's would
    not (a call is differentiated only when the caller's grad mode is on).
    """
    from ._tree import leaf_paths

    paths = leaf_paths(unflatten(spec, list(range(len(leaves)))), "output")
    bad = [p for p, leaf in zip(paths, leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad
           and not leaf.is_leaf]
    bad += [slot.path for slot, fake in escapes if fake.requires_grad and not fake.is_leaf]
    if bad:
        raise GraphifyError(
            f"{desc}: {bad[0]} requires grad (the function turns grad mode on with torch.enable_grad() "
            "or torch.set_grad_enabled(True)), but the call is made with grad mode off "
            "(torch.no_grad() or torch.inference_mode() around it).\n"
            "Why: a call is differentiated only when the caller's grad mode is on; under no_grad the "
            "replay's outputs would not carry the autograd graph eager's carry, and a backward "
            "through them would miss its gradients.\n"
            "Fix: call the function with grad mode on (outside torch.no_grad()), or .detach() what it "
            "returns if no gradient is needed (gradients computed inside the function with "
            "torch.autograd.grad and returned are fine)."
        )


@dataclass
class _Inputs:
    """What the trace takes from the caller's tensor inputs: their metadata, never their values."""

    specs: List[Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype, torch.device, bool]]  # size, stride, dtype, device, rg
    plain: List[bool]  # owns its storage exactly (plain_layout): what storage_offset() and as_strided read
    grads: List[bool]  # has a .grad (reading it is refused)
    attrs: List[Optional[Dict[str, Any]]]  # its Python attributes (t.__dict__), set on the stand-in
    histories: List[Any]  # its grad_fn in the caller's graph (None: a leaf): what is_leaf / grad_fn read
    bits: List[Tuple[bool, bool, bool]]  # conjugate, negative, inference (part of the signature)
    storages: List[Any]  # weak references to their storages (which inputs share memory with state)

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> _Inputs:
        return cls([(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors],
                   [plain_layout(t) for t in tensors], [has_grad(t) for t in tensors],
                   [dict(t.__dict__) or None for t in tensors], [t.grad_fn for t in tensors],
                   [(t.is_conj(), t.is_neg(), t.is_inference()) for t in tensors],
                   [StorageWeakRef(t.untyped_storage()) for t in tensors])

    @property
    def any_rg(self) -> bool:
        return any(sp[4] for sp in self.specs)


def trace(
    fn: Callable[..., Any],
    rebuild: Callable[[Sequence[torch.Tensor]], Tuple[Tuple[Any, ...], Dict[str, Any]]],
    tensors: Sequence[torch.Tensor],
    in_paths: List[str],
    desc: str,
    cuda: bool,
    roots: Sequence[Root] = (),
    extra: Sequence[Tuple[str, Any]] = (),
    stable: Sequence[int] = (),
    dims: FrozenSet[Tuple[int, int]] = frozenset(),
    layouts: Optional[Layouts] = None,
) -> Plan:
    """Trace ``fn`` for one signature.

    Args:
        fn: the user's function.
        rebuild: maps the flat tensor inputs back to ``(args, kwargs)``.
        tensors: the caller's tensor inputs: the trace reads their metadata (size, strides,
            dtype, device, ``requires_grad``, layout, ``.grad`` present, Python attributes,
            autograd history, conjugate / negative / inference bits), never their values.
        in_paths: leaf paths of the tensor inputs, for messages.
        desc: ``graphify(name)``, for messages.
        cuda: whether the function is recorded by the CUDA backend.
        roots: the Python state ``fn`` reaches (see ``_roots.find_roots``): put
            back as it was after the trace, and searched for escapes.
        extra: the call's other arguments, ``(path, value)``: the caller's generators
            passed in are watched like those the function closes over.
        stable: indices of the tensor inputs passed as the very same tensor as in the call
            before: host reads of them (and of unwritten state) are frozen (see ``_frozen``).
        dims: ``(input, dim)`` traced as symbolic sizes (see ``_symbolic``): the plan's
            ``sizes`` says whether it holds for other sizes of them.
        layouts: with ``dims``, the inputs' sizes and strides as expressions of the symbols
            (a half of a symbolic partition: see ``_symbolic.Layouts``).

    Returns:
        The :class:`Plan` of the signature.

    Raises:
        GraphifyError: something the recording cannot contain.
    """
    inputs = _Inputs.of(tensors)
    gens = GeneratorGuard(fn, extra, roots)
    # (one walk of the names it reaches, and those the methods of the user's modules name: for the
    # four below)
    own = named_values(fn)
    named = own + named_values(None, roots)
    snap = Snapshot(roots, number_bindings(named), function_caches(named))
    its = [(path, it, iterator_position(it)) for path, it in iterators(named)]
    # (the Python values of the function and of its modules' forwards: a module's other methods,
    # a logging helper naming a global step counter, would make every call a new signature)
    values = python_values(own + named_values(None, roots, forward_only=True))
    real = {i: tensors[i] for i in stable}
    no_freeze: FrozenSet[int] = frozenset()
    try:
        while True:
            try:
                with UnseenOptimizers(roots, desc):
                    plan = _Tracing(fn, rebuild, inputs, list(in_paths), desc, cuda, roots, snap, real, no_freeze,
                                    dims, layouts, gens.host).plan()
                break
            except Refreeze as again:
                # a frozen read of a tensor the function writes: not unchanged; traced again
                # without freezing it, where the read fails as any host read does
                snap.restore(full=True)
                no_freeze = frozenset(again.leaves)
    except BaseException:
        # a failed trace leaves no half-state (DESIGN semantics 9): the roots go back whole,
        # Python values included (which a trace that succeeds leaves as it made them, as in
        # JAX): the call then runs eagerly or raises, and finds the state as the caller left it
        snap.restore(full=True)
        gens.check(desc, raise_=False)
        raise
    gens.check(desc, raise_=True)
    gens.refuse_unknown(desc, list(zip(plan.generators, plan.generator_at)))
    _refuse_iterators_taken(desc, its)
    plan.py_values = values
    return plan


def _refuse_iterators_taken(desc: str, its: List[Tuple[str, Any, Any]]) -> None:
    """Refuse a trace that took items from an iterator the function reaches (``x, y = next(it)``)."""
    taken = [path for path, it, pos in its if pos is not None and iterator_position(it) != pos]
    if taken:
        raise GraphifyError(
            f"{desc}: the function takes items from the iterator {taken[0]} (next({taken[0]}), a for loop over it).\n"
            "Why: the function runs once, while tracing: a replay would reuse the items taken then (the same "
            "batch on every call) and never take another. (The item the trace took is gone from the iterator.)\n"
            "Fix: take the items outside the function and pass them in (x, y = next(it); step(x, y))."
        )


def _input_flags(desc: str, paths: List[str], tensors: Sequence[torch.Tensor], inputs: _Inputs,
                 outs: Sequence[Any]) -> Dict[int, bool]:
    """The caller's inputs the function made require grad (``x.requires_grad_()``): index -> True.

    A replay sets them so on the caller's tensors, as eager leaves them. Refused where an output
    carries a graph back to such an input: eager's output would be differentiable with respect to
    it (a backward fills its ``.grad``), the recording's, traced for the input as passed, is not.
    """
    flags = {i: True for i, t in enumerate(tensors)
             if t.requires_grad and not inputs.specs[i][4] and inputs.histories[i] is None}
    on = {id(tensors[i]): i for i in flags}
    if on:
        reached = _leaves_reached([x for x in outs if isinstance(x, torch.Tensor) and x.grad_fn is not None], on)
        if reached is not None:
            where = paths[reached]
            raise GraphifyError(
                f"{desc}: the function makes its input {where} require grad ({where}.requires_grad_()) and "
                "returns an output that depends on it differentiably.\n"
                f"Why: the recording is made for {where} as the caller passes it, without requires_grad; eager's "
                f"output would carry a graph back to {where}, and a backward through it would fill {where}.grad.\n"
                f"Fix: call {where}.requires_grad_() before calling the function (the recording then "
                "differentiates through it), or return outputs detached from it (e.detach(), or a gradient "
                "from torch.autograd.grad without create_graph).")
    return flags


def _leaves_reached(outs: Sequence[torch.Tensor], leaves: Dict[int, int]) -> Optional[int]:
    """The first of ``leaves`` (id -> input index) whose gradient the outputs' graphs accumulate, or None."""
    seen: Set[Any] = set()
    todo = [x.grad_fn for x in outs]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and id(var) in leaves:
            return leaves[id(var)]
        todo.extend(n for n, _ in node.next_functions)
    return None


class _Tracing:
    """One trace: the stand-ins of the inputs, the watchers, ``make_fx``, the checks after it, the plan."""

    def __init__(self, fn: Callable[..., Any], rebuild: Callable[..., Any], inputs: _Inputs, paths: List[str],
                 desc: str, cuda: bool, roots: Sequence[Root], snap: Snapshot,
                 stable: Optional[Dict[int, torch.Tensor]] = None, no_freeze: FrozenSet[int] = frozenset(),
                 dims: FrozenSet[Tuple[int, int]] = frozenset(), layouts: Optional[Layouts] = None,
                 host_rngs: Sequence[Tuple[str, Any]] = ()):
        self.fn, self.rebuild, self.inputs, self.paths = fn, rebuild, inputs, paths
        self.host_rngs = host_rngs  # the host generator objects the function reaches (see _host_rng_state)
        self.desc, self.cuda, self.roots, self.snap = desc, cuda, roots, snap
        self.dims = dims
        self.symbols: Dict[Any, Tuple[int, int]] = {}  # each symbol's (input, dim)
        self.views: Dict[int, Any] = {}  # outputs that are views of inputs: their symbolic size, stride, offset
        if dims:  # (a shape environment: sizes as symbols; state and constants keep theirs)
            self.env: Any = new_shape_env()
            self.mode = mode = _TraceMode(allow_non_fake_inputs=True, shape_env=self.env, static_shapes=True)
            shapes = symbolic_fakes(self.env, inputs.specs, dims, paths, self.symbols, layouts)
        else:
            self.env = None
            self.mode = mode = _TraceMode(allow_non_fake_inputs=True)
            shapes = [(list(sp[0]), list(sp[1])) for sp in inputs.specs]
        with mode:
            self.fakes = [torch.empty_strided(size, stride, dtype=sp[2], device=sp[3]).requires_grad_(sp[4])
                          for (size, stride), sp in zip(shapes, inputs.specs)]
        self.box: Dict[str, Any] = {}
        self.storages: Dict[Any, int] = {}
        self.index = StateIndex(roots)
        self.reads = AttrReads(roots)
        self.watch = watch = _Watch(self.storages, paths, desc, cuda, mode, self.index, len(self.fakes))
        watch.overlapping = {i for i, sp in enumerate(inputs.specs) if _overlaps(sp[0], sp[1])}
        watch.frozen = Frozen(len(self.fakes), dict(stable or {}), no_freeze, self.inputs.storages)
        self.fnwatch = _FnWatch(watch, self.storages, len(self.fakes), inputs.plain, inputs.grads,
                                inputs.histories, inputs.bits)
        for i, (t, a) in enumerate(zip(self.fakes, inputs.attrs)):
            if a:  # (a tensor-valued attribute: a stand-in whose use is refused)
                t.__dict__.update({k: (_TensorAttr(watch, paths[i], k) if isinstance(v, torch.Tensor) else v)
                                   for k, v in a.items()})

    def is_ours(self, v: Any) -> bool:
        return isinstance(v, FakeTensor) and v.fake_mode is self.mode

    def flat_fn(self, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The function over the flat tensor inputs, as ``make_fx`` traces it; what it leaves goes in ``box``."""
        watch, box, desc = self.watch, self.box, self.desc
        self.storages.clear()
        for i, t in enumerate(tensors):
            self.storages.setdefault(StorageWeakRef(t.untyped_storage()), i)
        box["inputs"] = tensors
        self.fnwatch.inputs = tensors
        frozen = watch.frozen
        if frozen is not None:
            for i, t in enumerate(tensors):
                frozen.leaf(t, i, frozen.stable.get(i))
        args, kwargs = self.rebuild(tensors)
        settings = global_settings()
        containers = arg_containers(args, kwargs)
        with watch, self.fnwatch, self.reads:
            out = self.fn(*args, **kwargs)
        settings_left_changed(desc, settings)
        arg_containers_kept(desc, containers)
        leaves, spec = flatten_output(out, desc)
        # a tensor the function returns as it reached it (a closed-over W,
        # `return self.weight`) is that very tensor in eager: state read in
        # place (so the output is the current tensor itself), or, a CPU tensor
        # of a CUDA function, handed back as is
        leaves = [_returned_as_is(x, watch, self.cuda) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
                  else x for x in leaves]
        box["spec"] = spec
        box["leaves"] = leaves
        box["custom_grad"] = _custom_functions([x for x in leaves if isinstance(x, torch.Tensor)],
                                               [t.grad_fn for t in watch.state if t.grad_fn is not None])
        box["input_flags"] = _input_flags(desc, self.paths, tensors, self.inputs, leaves)
        histories = self.inputs.histories
        for i, t in enumerate(tensors):
            if t.requires_grad and self.is_ours(leaf_grad(t)):
                # (the first backward: an argument's .grad is made by the first one reaching it, an
                # FGSM step's; a later one is usually the loss of the parameters alone)
                _grad_of_argument(desc, self.paths[i], self.fnwatch.first_backward_at,
                                  i < len(histories) and histories[i] is not None)
        scan = self.snap.scan(self.is_ours)
        slots = {(id(s.obj), s.kind, s.key) for s, _ in scan.escapes}
        for k, t in enumerate(watch.state):
            g = leaf_grad(t) if t.requires_grad else None
            if self.is_ours(g) and (id(t), "grad", "grad") not in slots:
                scan.escapes.append((Slot("grad", t, "grad", f"{watch.paths[watch.n_in + k]}.grad"), g))
        box["scan"] = scan
        # .grad set to None by the function (zero_grad()) and not made again by its backward
        # (a parameter this signature does not use): eager leaves it None after every call
        box["grad_cleared"] = [t for t in self.fnwatch.grad_cleared.values() if leaf_grad(t) is None]
        box["grad_read_first"] = list(self.fnwatch.grad_read_first.values())
        outs = [x for x in leaves if isinstance(x, torch.Tensor)] + [f for _, f in scan.escapes]
        return tuple(_resolved(outs, list(tensors) + list(watch.state_fakes)))

    def make_fx(self) -> Tuple[torch.fx.GraphModule, List[str]]:
        """``make_fx`` of :meth:`flat_fn`, its failures told as the user's; and what it drew on the host."""
        desc, cuda = self.desc, self.cuda
        host_rng = _host_rng_state(self.host_rngs)
        host_drew: List[str] = []
        try:
            try:
                # fx tracing keeps global state (its patcher): one trace at a time. What the
                # trace changes in torch, for this thread only: see _patches
                with TRACE_LOCK, trace_scope(), _no_seeding(desc), self.mode, symbolic_dispatch(self.env):
                    _ACTIVE.depth = _ACTIVE.__dict__.get("depth", 0) + 1
                    try:
                        gm = make_fx(self.flat_fn, tracing_mode="real", _allow_non_fake_inputs=True)(*self.fakes)
                    finally:
                        _ACTIVE.depth -= 1
            except Exception as e:
                told = _trace_error(desc, e, cuda)
                if told is None:
                    raise
                raise told[0] from told[1]
            finally:
                # the trace has no visible effect on the Python state the function reaches,
                # nor on its tensors' autograd history
                self.snap.restore()
                for handle in self.fnwatch.real_hooks:
                    handle.remove()
                drop_history(self.watch.no_history)
                self.mode.closed = desc
                host_drew = _host_rng_restore(host_rng)
        except GraphifyError as err:
            # the first call of a signature that touches state may fail to trace before
            # lazily created state exists: the caller may run that call eagerly instead
            err.gt_touched_state = bool(self.watch.state)  # type: ignore[attr-defined]
            # a host read of arguments passed for the first time: frozen if the next call
            # passes the very same tensors (see _lookup)
            frozen = self.watch.frozen
            err.gt_frozen_args = set(frozen.candidates) if frozen is not None else set()  # type: ignore[attr-defined]
            if frozen is not None:
                self._why_not_frozen(err, frozen.rewritten, (
                    "which the function writes in place (a counter, a running statistic): its value changes "
                    "with every call, so it is not frozen. Fix: keep such a counter as a Python number outside "
                    "the graphified function (or pass it in as a static argument), keep the test on the device "
                    "(torch.where), or on_break=\"split\"."))
                self._why_not_frozen(err, frozen.through_written - frozen.rewritten, (
                    "unchanged, but the value read is computed through a tensor the function "
                    "(or a library it calls) makes and then writes in place (grid[-1] = t[-1]): a frozen "
                    "read recomputes the ops that made a tensor, not the writes into it, so it is not "
                    "frozen. Fix: on_break=\"split\" (the read runs in Python on every call), or build "
                    "that tensor without the in-place write (torch.cat)."))
                self._why_not_frozen(err, frozen.inference, (
                    "which was made under torch.inference_mode(): an inference tensor has no version counter, "
                    "so an in-place change of it could not be seen, and it is not frozen. Fix: make it outside "
                    "inference mode (under torch.no_grad(), or t = t.clone() outside torch.inference_mode()), "
                    "or on_break=\"split\"."))
                self._why_not_frozen(err, frozen.trained, (
                    "which require grad: tensors being trained change at every optimizer step (also through "
                    ".data, which no version counter shows), and a value frozen from them would carry no "
                    "gradient, so it is not frozen (in a torch.no_grad() block of a call under grad mode too). Fix: "
                    "on_break=\"split\" (the read runs in Python on every call), or call the function under "
                    "torch.no_grad() where they do not change (inference)."))
            raise
        return gm, host_drew

    def _why_not_frozen(self, err: GraphifyError, leaves: Set[int], why: str) -> None:
        """Say in ``err`` which inputs kept a host read from being frozen, and ``why``."""
        if leaves:
            names = ", ".join(self.paths[d] if d < len(self.paths) else f"state tensor {d}" for d in sorted(leaves))
            err.args = (str(err) + f"\nThe read depends on {names}, {why}",)

    def check(self, host_drew: List[str]) -> None:
        """Refuse what the trace did that a replay cannot do as eager does."""
        desc, watch, scan, fnwatch = self.desc, self.watch, self.box["scan"], self.fnwatch
        watch.check_layouts(list(self.box["inputs"]) + list(watch.state_fakes))
        if host_drew:
            raise GraphifyError(
                f"{desc}: the function draws random numbers on the host ({' and '.join(host_drew)}).\n"
                "Why: host random numbers become constants of the recording: every replay would reuse "
                "the numbers drawn while tracing (torch's random ops draw fresh ones on every call).\n"
                "Fix: draw them with torch (torch.rand, torch.randint, torch.bernoulli... follow "
                "torch.manual_seed), or draw them outside and pass them in as tensor arguments (a "
                "decision such as `if random.random() < p` as a static argument). For "
                "Hugging Face speech models (wav2vec2, HuBERT, WavLM, Whisper), SpecAugment masks time "
                "steps with numpy: set config.mask_time_prob = config.mask_feature_prob = 0 (or "
                "apply_spec_augment=False) while graphified."
            )
        no_ddp_forward(desc, self.reads, fnwatch)
        _no_dynamic_cache(desc, self.roots, scan)
        if scan.appended:
            made = next((x for x in scan.sites if x), "")
            raise escape_error(desc, scan.appended, f"\n  made at {made}" if made else "", scan.grown)
        if scan.stored:
            made = next((x for x in scan.stored_sites if x), "")
            refusal = stored_error(desc, scan.stored, f"\n  made at {made}" if made else "")
            # an object made on first use (`if self.cache is None: self.cache = Cache(...)`): that
            # call runs eagerly, and a trace that stores one again (every call does) is refused
            refusal.gt_touched_state = True  # type: ignore[attr-defined]
            raise refusal
        if torch.is_grad_enabled() and not fnwatch.for_grad and (
                self.inputs.any_rg or any(f.requires_grad for f in watch.state_fakes)):
            _no_backward_hooks(desc, self.roots)
        if not torch.is_grad_enabled() and not fnwatch.for_grad:
            _no_grad_outputs_requiring_grad(desc, self.box["spec"], self.box["leaves"], scan.escapes)

    def graph(self, gm: torch.fx.GraphModule) -> None:
        """The passes of ``_rewrite`` over the traced graph."""
        _lift_state(gm, self.watch.state_fakes)
        _drop_dead_ops(gm)  # (a data-dependent op whose value a frozen read replaced among them)
        _no_traced_constants(gm, self.is_ours, self.desc)
        _drop_profiler_nodes(gm)
        _name_default_dtypes(gm)
        _reshape_computed_views(gm)
        _kernels_in_grad_mode(gm)
        _materialize_zero_tensors(gm)
        gm.recompile()
        if self.cuda:
            _constants_to_device(gm, next((t.device for t in self.fakes), None))

    def outputs(self) -> Tuple[List[OutEntry], List[OutEntry], List[Optional[int]]]:
        """How each output leaf and each tensor left in Python state is produced at call time.

        And, per tensor left in state, the output leaf it is (the same tensor object), or None.
        """
        inputs = list(self.box["inputs"]) + list(self.watch.state_fakes)
        in_store: Dict[Any, int] = {}
        for i, t in enumerate(inputs):
            in_store.setdefault(StorageWeakRef(t.untyped_storage()), i)
        entries: List[OutEntry] = []
        for leaf in self.box["leaves"]:
            if isinstance(leaf, _AsIs):
                entries.append(OutEntry("const", value=leaf.t))
            elif not isinstance(leaf, torch.Tensor):
                if self.env is not None:
                    leaf = concrete(leaf)
                    if contains(leaf, symbolic_value):  # (inside an object: traced as is instead)
                        raise SymbolicLeak(f"a symbolic size inside output {len(entries)} ({type(leaf).__name__})")
                c = fresh_copier(leaf)  # (a copy of its own: the first call may hand out the traced one)
                entries.append(OutEntry("const", value=leaf if c is None else c(leaf), fresh=c))
            else:
                entries.append(self._entry(leaf, f"output {len(entries)}", inputs, in_store, entries))
        esc_entries: List[OutEntry] = []
        returned = {id(leaf): k for k, leaf in enumerate(self.box["leaves"]) if entries[k].kind == "pool"}
        for slot, fake in self.box["scan"].escapes:
            if fake.layout != torch.strided:
                _sparse_left(self.desc, fake, slot)
            esc_entries.append(self._entry(fake, slot.path, inputs, in_store, entries + esc_entries))
        is_out = [returned.get(id(fake)) if e.kind == "pool" else None
                  for (_, fake), e in zip(self.box["scan"].escapes, esc_entries)]
        return entries, esc_entries, is_out

    def _entry(self, val: torch.Tensor, what: str, inputs: List[torch.Tensor], in_store: Dict[Any, int],
               before: List[OutEntry]) -> OutEntry:
        src = in_store.get(StorageWeakRef(val.untyped_storage()))
        if src is None:
            ent = OutEntry("pool", index=sum(e.kind != "const" for e in before))
        else:
            inp = inputs[src]
            if val.dtype != inp.dtype:
                raise GraphifyError(
                    f"{self.desc}: {what} is a view of input {self.paths[src]} with another dtype "
                    f"({inp.dtype} -> {val.dtype}).\nWhy: outputs that alias inputs are rebuilt "
                    "from the caller's tensor, which needs the same dtype.\n"
                    "Fix: return .clone() of that output."
                )
            size, stride, off = tuple(val.shape), tuple(val.stride()), val.storage_offset() - inp.storage_offset()
            if self.env is not None and (val is inp or what.startswith("output ")):
                # (symbolic: an output view's layout kept as expressions, evaluated for each size's
                # signature, this one's from the hints; an input returned as is needs none. A view
                # left in Python state is pinned by int() below: it serves this size alone.)
                if val is not inp:
                    self.views[len(before)] = (tuple(map(sym_expr, size)), tuple(map(sym_expr, stride)), sym_expr(off))
                size, stride, off = tuple(map(hint, size)), tuple(map(hint, stride)), hint(off)
            ent = OutEntry("input", index=src, size=tuple(map(int, size)), stride=tuple(map(int, stride)),
                           rel_offset=int(off), identical=val is inp,
                           conj=val.is_conj() != inp.is_conj(), neg=val.is_neg() != inp.is_neg())
        ent.requires_grad = bool(val.requires_grad)
        return ent

    def plan(self) -> Plan:
        """Trace, check, rewrite: the :class:`Plan` of the signature."""
        gm, host_drew = self.make_fx()
        frozen = self.watch.frozen
        if frozen is not None and frozen.written_leaves():
            raise Refreeze(frozen.written_leaves() | set(frozen.no_freeze))
        self.check(host_drew)
        try:
            self.graph(gm)
        except GraphifyError as err:
            # (a tensor the trace stored in state and read back: an optimizer's lazily made
            # momentum, where the state did not exist yet; the first call may run eagerly)
            if not hasattr(err, "gt_touched_state"):
                err.gt_touched_state = bool(self.watch.state)  # type: ignore[attr-defined]
            raise
        entries, esc_entries, esc_returned = self.outputs()
        watch, fnwatch, scan, paths = self.watch, self.fnwatch, self.box["scan"], self.paths
        state_slots = [self.index.slot_of(t) for t in watch.state]
        if self.env is not None:  # (Python values the function stored: this call's numbers, as eager's)
            self.snap.concretize(symbolic_value, concrete)
            for c in scan.changes:
                if symbolic_value(c.new):
                    c.new = concrete(c.new)
            deep = self.snap.find(symbolic_value)
            if deep is not None:  # (inside an object the function stored: traced as is instead)
                raise SymbolicLeak(f"a symbolic size stored in {deep}")
        sizes, pinned = (holds_for_sizes(self.env, self.fakes, self.dims, paths, self.symbols, self.views)
                         if self.dims else (None, ""))
        return Plan(
            gm=gm,
            in_paths=paths,
            mutated=set(watch.mutated),
            mutated_at=dict(watch.mutated_at),
            out_spec=self.box["spec"],
            out_entries=entries,
            n_gm_out=sum(e.kind != "const" for e in entries + esc_entries),
            uses_cuda=watch.uses_cuda,
            random=watch.random,
            op_count=watch.ops,
            generators=watch.generators,
            generator_at=watch.generator_at,
            state=list(watch.state),
            state_slots=state_slots,
            state_names=paths[len(self.fakes):],
            escape_slots=[s for s, _ in scan.escapes],
            grad_cleared=self.box.get("grad_cleared", []),
            grad_read_first=self.box.get("grad_read_first", []),
            escape_entries=esc_entries,
            escape_returned=esc_returned,
            py_changes=list(scan.changes),
            roots=list(self.roots),
            attr_reads=self.reads,
            layout_idx=set(fnwatch.layout_used),
            grad_idx=set(fnwatch.grad_read),
            leaf_idx=dict(fnwatch.leaf_read),
            hooks=list(fnwatch.hooks),
            custom_grad=self.box.get("custom_grad", []),
            rg_traced=(self.inputs.any_rg or any(f.requires_grad for f in watch.state_fakes)) and not fnwatch.for_grad,
            ran_backward=fnwatch.backward_calls > 0 or any(s.kind == "grad" for s, _ in scan.escapes) or any(
                s is not None and s.kind == "grad" for s in state_slots),
            fn=self.fn,
            rebuild=self.rebuild,
            cuda=self.cuda,
            frozen=list(frozen.reads) if frozen is not None else [],
            frozen_guard=guard_refs(frozen) if frozen is not None else {},
            input_flags=self.box.get("input_flags", {}),
            sizes=sizes,
            sizes_pinned=pinned,
            out_views=output_views([x for x in self.box["leaves"] if isinstance(x, torch.Tensor)], entries),
            after_backward=made_after_backward(self.box["spec"], self.box["leaves"], fnwatch),
            backward_at=fnwatch.backward_at,
            sdpa_flags=sdpa_flags() if fnwatch.sdpa else None,
        )


def _host_read(err: GraphifyError) -> GraphifyError:
    """A host read of the call's data (or a data-dependent shape): marked for ``on_break``, its fix named.

    ``gt_host_read`` tells ``_breaks`` which refusals ``on_break="split"``/``"eager"`` route.
    """
    err.gt_host_read = True  # type: ignore[attr-defined]
    err.args = (str(err) + "\nOr let Python run the read: graphify(fn, on_break=\"split\") records the pieces "
                "between such reads through TorchDynamo and runs the reads in Python; on_break=\"eager\" "
                "runs such calls eagerly (warned once per signature).",)
    return err


def _trace_error(desc: str, e: Exception, cuda: bool) -> Optional[Tuple[BaseException, Optional[BaseException]]]:
    """What ``make_fx``'s exception ``e`` means for the user: the error to raise and its cause, or None (as is)."""
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)):
        return _host_read(_data_dependent(desc, e, cuda)), None
    if isinstance(e, NotImplementedError):
        if "Generator" not in str(e):
            return None
        return GraphifyError(
            f"{desc}: a random op takes an explicit torch.Generator, which this version of "
            f"torch ({torch.__version__}) cannot trace.\n  at {format_frame(user_frame_from_exc(e))}\n"
            "Why: the tracer cannot record a Generator object as an argument of an operation.\n"
            "Fix: use the default generator (seeded with torch.manual_seed), or upgrade torch "
            "(2.13 traces explicit generators)."
        ), None
    if isinstance(e, RuntimeError):
        msg = str(e)
        host = next((what for key, what in _HOST_READS if key in msg), None)
        fix_more = next((f for key, f in _HOST_READ_FIX.items() if key in msg), "")
        if host is None:
            internal = _internal_failure(desc, e, cuda)
            return None if internal is None else (internal, e)
        return _host_read(GraphifyError(
            f"{desc}: {host} reads a tensor's data on the host.\n  at {format_frame(user_frame_from_exc(e))}\n"
            "Why: a recording is traced once without real data and replayed without Python; "
            "host-side reads of tensor data cannot be part of it.\n"
            f"Fix: keep the computation in torch ops on the device{fix_more}, or move this part out "
            "of the graphified function."
        )), None
    if isinstance(e, TypeError):
        # raised inside torch on fake tensors (torch.optim's traceable branch of Adamax with
        # foreach=True passes tensors where eager passes numbers); the user's own TypeError
        # propagates unchanged
        internal = _internal_failure(desc, e, cuda)
        return None if internal is None else (internal, e)
    if isinstance(e, SyntaxError):
        # torch.fx writes each op as `torch.ops.aten.<op>.<overload>`: an overload named
        # after a Python keyword (aten.random_.from, of Tensor.random_(low, high)) cannot be
        # written so (a torch limitation)
        line = (e.text or "").strip()
        return GraphifyError(
            f"{desc}: torch.fx cannot write the traced graph as Python code (SyntaxError at "
            f"`{line}`).\n"
            "Why: an operation's overload has the name of a Python keyword; Tensor.random_(low, "
            "high) is one (aten.random_.from), and torch's tracer cannot record it.\n"
            "Fix: draw with torch.randint(low, high, size, device=..., dtype=...) instead of "
            "Tensor.random_(low, high) (it follows torch.manual_seed as eager does), or move that "
            "operation out of the graphified function."
        ), None
    if isinstance(e, UnsupportedOperatorException):
        return GraphifyError(
            f"{desc}: operator {e} cannot be traced with fake tensors.\n  at {format_frame(user_frame_from_exc(e))}\n"
            "Why: graphify traces each signature without running it, and this operator has no "
            "shape rule (meta kernel).\nFix: move this operation out of the graphified function."
        ), None
    return None


def _no_backward_hooks(desc: str, roots: Sequence[Root]) -> None:
    """A differentiated call of a module with backward hooks: refused (a replay's backward runs no Python)."""
    hooked = _backward_hooked_modules(roots)
    if hooked:
        raise GraphifyError(
            f"{desc}: the function uses module {hooked[0]}, which has backward hooks "
            "(register_full_backward_hook / register_full_backward_pre_hook), in grad mode.\n"
            "Why: eager calls those Python hooks in every backward; a recording's backward is "
            "replayed without Python, so they would run once, while tracing, or never.\n"
            "Fix: remove the hooks while the model runs graphified (handle.remove()), call it "
            "under torch.no_grad() if no gradient is needed, or hook the parameters instead "
            "(p.register_hook(...) runs when the gradient reaches p)."
        )


def _sparse_left(desc: str, fake: torch.Tensor, slot: Any) -> None:
    """A sparse tensor left in Python state (a sparse embedding's gradient): refused."""
    sparse_grad = (" (nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) make sparse "
                   "gradients)") if slot.kind == "grad" else ""
    raise GraphifyError(
        f"{desc}: the function leaves a {fake.layout} tensor in {slot.path}{sparse_grad}.\n"
        "Why: what the function leaves in Python state is written back from the recording's "
        "memory after every call, as dense strided tensors.\n"
        "Fix: use dense tensors there (nn.Embedding(..., sparse=False)), or leave nothing behind "
        "(call opt.zero_grad() at the end of the function, after opt.step())."
    )

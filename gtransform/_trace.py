"""Tracing a function over flat tensor leaves into an aten-level fx graph.

Each new signature is traced once with fake tensors (``make_fx`` under our own
``FakeTensorMode``, with no shape environment, so anything data-dependent fails
at once instead of being frozen). A dispatch mode sits inside the trace and
watches every operation: it records which inputs are written in place, refuses
resizes of inputs, and (for CUDA functions) refuses copies between host and
device and operations on CPU tensors, naming the user's source line.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._errors import GraphifyError, format_frame, innermost_frame, is_library_file, user_frame, user_frame_from_exc
from ._state import Root, Slot, Snapshot, StateIndex, escape_error, leaf_grad
from ._tree import NAMESPACE, flatten, leaf_paths, unflatten

try:  # torch >= 2.1
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover
    GuardOnDataDependentSymNode = DataDependentOutputException  # type: ignore[misc,assignment]

__all__ = ["Plan", "OutEntry", "trace", "flatten_output", "TRACE_LOCK", "tracing", "plain_layout"]

TRACE_LOCK = threading.RLock()
_ACTIVE = threading.local()
# set while a signature is looked up for torch.func.grad/vjp of a graphified
# function: its inputs are differentiated although the traced stand-ins are not
FOR_GRAD = threading.local()


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

_aten = torch.ops.aten
_RESIZES = {_aten.resize_.default, _aten.resize_as_.default}
_SETS = {getattr(_aten.set_, o) for o in _aten.set_.overloads()}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
# fresh constants made from Python data inside the function (torch.tensor(3.0), x[0] = 5.)
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
# ops that update arguments in place without saying so in their schema:
# batch norm's running statistics (in training mode, the bool at index 5)
_HIDDEN_WRITES: Dict[Any, Tuple[int, ...]] = {}
for _name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
    _op = getattr(_aten, _name, None)
    if _op is not None and hasattr(_op, "default"):
        _HIDDEN_WRITES[_op.default] = (3, 4)
_SEEDED: Any
try:
    _SEEDED = torch.Tag.nondeterministic_seeded
except AttributeError:  # pragma: no cover
    _SEEDED = None

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


# torch's own messages for host reads that fake tensors cannot serve
_HOST_READS = (
    (".numpy() is not supported", ".numpy()"),
    ("Cannot access data pointer of Tensor", "an access to the data pointer"),
    ("Cannot access storage of", "an access to the storage"),
)


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
    notes: List[str] = field(default_factory=list)
    # caller's inputs whose storage offset / layout the function reads: keyed on being plain
    layout_idx: Set[int] = field(default_factory=set)
    # caller's inputs whose ``.grad`` the function reads (it was None): keyed on staying None
    grad_idx: Set[int] = field(default_factory=set)
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
    py_changes: List[Any] = field(default_factory=list)
    roots: List[Any] = field(default_factory=list)
    ran_backward: bool = False
    # the user's function and how to call it on the flat tensors (for the joint
    # forward+backward trace of _partition)
    fn: Any = None
    rebuild: Any = None
    cuda: bool = False

    def __post_init__(self) -> None:
        self.tensor_entries = [e for e in self.out_entries if e.kind != "const"]
        self.any_identical = any(e.identical for e in self.tensor_entries)  # an input returned as is
        self.n_user_in = len(self.in_paths) - len(self.state)
        self.touches_state = bool(self.state or self.escape_slots)
        self.all_const = not self.tensor_entries
        self._fused: Any = None

    def fused(self) -> Any:
        """The graph compiled by TorchInductor (made once, on first use).

        Inductor's own CUDA graphs are off (gtransform records the result),
        and random ops use eager's generator (``fallback_random``) so that
        they keep following ``torch.manual_seed`` exactly.
        """
        if self._fused is None:
            self._fused = _Inductor(self.gm)
        return self._fused

    def assemble(self, flat: Sequence[Any]) -> Any:
        """Output tree from the tensor outputs (in graph order)."""
        it = iter(flat)
        leaves = [e.value if e.kind == "const" else next(it) for e in self.out_entries]
        return unflatten(self.out_spec, leaves)


class _Inductor:
    """A traced graph compiled by TorchInductor on its first call (that call's tensors are the examples).

    Straight to inductor's ``compile_fx``, as dynamo's inductor backend does: the
    graph is already an aten graph of flat tensors, so ``torch.compile`` would only
    trace its generated code again with dynamo and build guards nobody checks (the
    signature is gtransform's): 1-2 s of the benchmark's resnet18, GPT-2 and Llama
    first calls on an H100 (benchmarks/NOTES.md). Like dynamo, it hands inductor
    fake inputs of static shapes inside a tracing context with a shape environment:
    without one, inductor's persistent cache is bypassed; with real inputs there,
    sizes become symbolic (resnet18 took 19 s instead of 10). Inductor compiles a
    copy of the graph: its passes rewrite the graph they are given.
    """

    __slots__ = ("gm", "fn")

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.fn: Any = None

    def __call__(self, *args: Any) -> Any:
        fn = self.fn
        if fn is None:
            from torch._guards import TracingContext, tracing
            from torch._inductor.compile_fx import compile_fx
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            gm = torch.fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
            fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True)
            examples = [fake.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
            with tracing(TracingContext(fake)), torch._inductor.config.patch({"fallback_random": True, "triton.cudagraphs": False}):
                fn = self.fn = compile_fx(gm, examples)
        return fn(*args)


def _tensors_in(v: Any) -> List[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_LIB_CACHE: Dict[str, bool] = {}


def _site() -> str:
    """``file:line`` of the innermost user frame (cheap: no source lines)."""
    f: Any = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        lib = _LIB_CACHE.get(fn)
        if lib is None:
            lib = _LIB_CACHE[fn] = is_library_file(fn)
        if not lib:
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return ""


class _TraceMode(FakeTensorMode):
    """The trace's fake mode; once the trace is over, any work on its tensors is an error.

    A tensor made while tracing that was left somewhere gtransform could not
    see (JAX's "leaked tracer") then fails loudly instead of computing on
    placeholders.
    """

    closed: Optional[str] = None

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
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Watch(TorchDispatchMode):
    """Watches every aten op of the trace (runs above make_fx's proxy mode).

    Real tensors that reach an operation are *state* (the function reached them
    without taking them as arguments): each is swapped for a fake of its own,
    so the trace never reads or writes real memory, and later becomes an input
    of the graph.
    """

    def __init__(self, inputs: Dict[Any, int], paths: List[str], desc: str, cuda: bool, mode: FakeTensorMode, index: StateIndex, n_in: int):
        super().__init__()
        self.inputs = inputs
        self.paths = paths
        self.desc = desc
        self.cuda = cuda
        self.mode = mode
        self.index = index
        self.n_in = n_in
        self.mutated: Set[int] = set()
        self.uses_cuda = False
        self.random = False
        self.ops = 0
        self.lifted: Set[int] = set()  # ids of constants made inside the function
        self.generators: List[torch.Generator] = []  # explicit generators used by random ops
        self.state: List[torch.Tensor] = []
        self.state_fakes: List[FakeTensor] = []
        self._fake_of: Dict[int, FakeTensor] = {}
        self.overlapping: Set[int] = set()  # caller's inputs whose elements share memory

    def _fail(self, what: str, why: str, fix: str) -> None:
        fr = user_frame(traceback.extract_stack())
        raise GraphifyError(
            f"{self.desc}: {what}\n  at {format_frame(fr)}\n"
            f"Why: {why}\nFix: {fix}"
        )

    def _fake(self, t: torch.Tensor) -> FakeTensor:
        f = self._fake_of.get(id(t))
        if f is None:
            k = len(self.state)
            name = self.index.name_of(t, k)
            if self.cuda and t.device.type == "cpu":
                self._fail(
                    f"the function reads the CPU tensor {name} (state it reaches without taking it "
                    "as an argument) inside a CUDA function.",
                    "a CUDA graph reads a CPU tensor once, at recording time; its value would be frozen.",
                    "keep that state on the GPU (module.to(device); for torch.optim optimizers pass "
                    "capturable=True so their step counts live on the GPU), or pass a Python number.",
                )
            # a tensor with autograd history (``W = base * 2`` closed over, a cache an eager
            # call in grad mode wrote into) is traced as a leaf that requires grad, like a
            # parameter: at call time it is an input of the autograd node, so gradients flow
            # on into its history as in eager
            history = t.grad_fn is not None
            f = self.mode.from_tensor(t.detach() if history else t, static_shapes=True)
            if history:
                f.requires_grad_(True)
            self._fake_of[id(t)] = f
            self.state.append(t)
            self.state_fakes.append(f)
            self.inputs.setdefault(StorageWeakRef(f.untyped_storage()), self.n_in + k)
            self.paths.append(name)
        return f

    def _swap(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v if isinstance(v, FakeTensor) else self._fake(v)
        if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in v):
            return type(v)(self._swap(t) for t in v) if isinstance(v, list) else tuple(self._swap(t) for t in v)
        return v

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func not in _LIFTS:
            args = [self._swap(a) for a in args]
            if kwargs:
                kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        schema = func._schema
        hidden = _HIDDEN_WRITES.get(func)
        if hidden is not None and len(args) > 5 and args[5]:
            for i in hidden:
                for t in _tensors_in(args[i]):
                    idx = self.inputs.get(StorageWeakRef(t.untyped_storage()))
                    if idx is not None:
                        self.mutated.add(idx)
        written: List[Tuple[torch.Tensor, int, Any]] = []
        if schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                ai = a.alias_info
                if ai is None or not ai.is_write:
                    continue
                v = args[i] if (i < len(args) and not a.kwarg_only) else kwargs.get(a.name)
                for t in _tensors_in(v):
                    idx = self.inputs.get(StorageWeakRef(t.untyped_storage()))
                    if idx is None:
                        continue
                    if func in _RESIZES or func in _SETS:
                        self._fail(
                            f"{func} changes the size or storage of input {self.paths[idx]} in place.",
                            "a recording replays fixed memory; an input's storage cannot be resized "
                            "or replaced inside it.",
                            "return the new tensor instead of resizing the input, or do the resize "
                            "outside the graphified function.",
                        )
                    if idx in self.overlapping:
                        self._fail(
                            f"{func} updates input {self.paths[idx]} in place, and that input overlaps "
                            "itself (its elements share memory).",
                            "eager updates such a tensor element by element in an order-dependent way "
                            "through the shared memory; the recording updates a copy and writes it back.",
                            f"pass {self.paths[idx]}.contiguous() or .clone() (or update a copy and "
                            "return it).",
                        )
                    hist = self.state[idx - self.n_in].grad_fn if idx >= self.n_in else None
                    if hist is not None and torch.is_grad_enabled():
                        self._fail(
                            f"{func} updates {self.paths[idx]} in place, a tensor in state the function "
                            f"reaches (not an argument) that carries autograd history "
                            f"(grad_fn={type(hist).__name__}): an earlier call in grad mode wrote a tensor "
                            "that requires grad into it (a KV cache updated by a decode step run outside "
                            "torch.no_grad(), for instance).",
                            "gtransform keeps state as plain memory between calls; it cannot grow the "
                            "autograd graph that eager extends through that tensor on every call.",
                            "call the function under torch.no_grad() or torch.inference_mode() (decoding, "
                            "rollouts), or write detached values into the state "
                            "(cache.index_copy_(2, pos, k.detach())).",
                        )
                    written.append((t, idx, (t.shape, t.stride(), t.storage_offset())))
                    self.mutated.add(idx)
        if _SEEDED is not None and _SEEDED in func.tags:
            self.random = True
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and all(gen is not g for g in self.generators):
            self.generators.append(gen)
        out = func(*args, **kwargs)
        for t, idx, meta in written:
            if (t.shape, t.stride(), t.storage_offset()) != meta:
                self._fail(
                    f"{func} changes the shape or strides of input {self.paths[idx]} in place "
                    f"({list(meta[0])} -> {list(t.shape)}).",
                    "eager changes the caller's tensor object itself; a recording only writes "
                    "values back into the caller's tensor, whose shape it cannot change.",
                    "use the out-of-place op and return its result (e.g. y = x.t() instead of "
                    "x.t_()), or change the tensor outside the graphified function.",
                )
        if func in _LIFTS:
            self.lifted.update(id(t) for t in _tensors_in(out))
        site = None
        for t in _tensors_in(out):
            if isinstance(t, FakeTensor) and "_gt_site" not in t.__dict__:
                if site is None:
                    site = _site()
                t.__dict__["_gt_site"] = site
        if self.cuda or self.uses_cuda:
            self._check_devices(func, args, kwargs, out)
        else:
            for t in _tensors_in(out):
                if t.device.type == "cuda":
                    self.uses_cuda = True
        return out

    def _check_devices(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> None:
        self.uses_cuda = True
        ins = [t for v in list(args) + list(kwargs.values()) for t in _tensors_in(v)]
        outs = _tensors_in(out)
        if func in _LIFTS:
            return  # constants are moved to the device when recorded
        if func in _COPIES:
            devs = {t.device.type for t in ins + outs if id(t) not in self.lifted}
            if "cpu" in devs and "cuda" in devs:
                self._fail(
                    f"{func} copies between the host and the GPU inside a CUDA function.",
                    "a CUDA graph cannot contain a synchronising host<->device copy; its value "
                    "would be read once, at recording time.",
                    "create tensors directly on the inputs' device (device=x.device), pass them "
                    "as inputs, or move the copy out of the graphified function.",
                )
        for t in outs:
            if id(t) in self.lifted:
                continue
            if t.device.type == "cpu" and (t.dim() > 0 or (_SEEDED is not None and _SEEDED in func.tags)):
                self._fail(
                    f"{func} makes a CPU tensor of shape {tuple(t.shape)} inside a CUDA function.",
                    "CPU work is not recorded by CUDA graph capture: it would run once, at "
                    "recording time, and its result would be frozen.",
                    "create the tensor on the GPU (device=x.device), or move this work out of "
                    "the graphified function.",
                )


_DATA_SET = torch._C.TensorBase.__dict__["data"]
_GRAD_ATTR = torch._C.TensorBase.__dict__["grad"]
_REGISTER_HOOK = torch.Tensor.register_hook
# calls whose result leaves the autograd graph: make_fx may record them as plain aliases
# (torch 2.14 records x.detach() as aten.alias), which a graph run under autograd would
# differentiate through; their nodes are marked like no_grad blocks (_tagging_no_grad)
_DETACHES = frozenset([torch.Tensor.detach, torch.detach, torch.Tensor.detach_, _DATA_SET.__get__])


class _AsIs:
    """An output leaf that is a real tensor the function returned unchanged (see trace)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


def _returned_as_is(t: torch.Tensor, watch: Any, cuda: bool) -> Any:
    if cuda and t.device.type == "cpu":
        return _AsIs(t)
    return watch._fake(t)


class _NoHandle:
    """Handle of a hook that the forward trace did not register."""

    def remove(self) -> None:
        return None
_LAYOUT_READS = frozenset(
    getattr(torch._C.TensorBase, n) for n in ("storage_offset", "as_strided", "as_strided_")
    if hasattr(torch._C.TensorBase, n)
)


class _FnWatch(TorchFunctionMode):
    """Watches the Python-level tensor calls of the trace that dispatch cannot see.

    ``x.data = ...`` on an input (eager swaps the caller's tensor's data; a
    recording cannot), and ``storage_offset()`` / ``as_strided`` on an input
    whose layout a static buffer does not keep (an offset view, a strided view).
    """

    def __init__(self, watch: _Watch, storages: Dict[Any, int], n_in: int, plain: Sequence[bool],
                 grads: Sequence[bool] = ()):
        super().__init__()
        self.watch = watch
        self.storages = storages
        self.n_in = n_in
        self.plain = plain
        self.grads = grads
        self.layout_used: Set[int] = set()
        self.grad_read: Set[int] = set()
        self.hooks: List[str] = []
        self.for_grad = bool(getattr(FOR_GRAD, "on", False))
        self.inputs: Sequence[Any] = ()  # the trace's input tensors (set by the traced function)

    def _input(self, t: Any) -> Optional[int]:
        if not isinstance(t, FakeTensor):
            return None
        idx = self.storages.get(StorageWeakRef(t.untyped_storage()))
        return idx if idx is not None and idx < self.n_in else None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _REGISTER_HOOK and args:
            self.hooks.append(format_frame(user_frame(traceback.extract_stack())))
            if self.for_grad and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
                # under torch.func.grad the tensor requires grad in eager; the trace's
                # stand-in does not: the hook acts in the backward, which the joint
                # trace of the function makes (see _partition.py)
                return _NoHandle()
        if args and getattr(func, "__self__", None) is _GRAD_ATTR and getattr(func, "__name__", "") == "__get__":
            idx = self._input(args[0])
            if idx is not None and args[0] is self.inputs[idx]:
                if idx < len(self.grads) and self.grads[idx]:
                    path = self.watch.paths[idx]
                    self.watch._fail(
                        f"the function reads {path}.grad, the gradient attached to input {path}.",
                        "a recording takes tensors, not their attributes: the gradient is not an "
                        "input of the recording, so its values (and whether there is one) would "
                        "be frozen at the first call.",
                        "pass the gradient as an argument of its own (e.g. f(p, p.grad)), or "
                        "close over the tensor instead of passing it (state's .grad is read every call).",
                    )
                self.grad_read.add(idx)  # read as None: keyed on staying None
        if args and (func in _LAYOUT_READS or getattr(func, "__self__", None) is _DATA_SET):
            idx = self._input(args[0])
            if idx is not None:
                w = self.watch
                path = w.paths[idx]
                if func not in _LAYOUT_READS:
                    w._fail(
                        f"`{path}.data = ...` replaces the data of input {path}.",
                        "eager swaps the caller's tensor's storage; a recording reads and writes fixed "
                        "memory and cannot replace the caller's storage.",
                        f"update it in place instead (e.g. {path}.clamp_(-0.5, 0.5), or "
                        f"{path}.copy_(new_value)), or return the new tensor.",
                    )
                name = getattr(func, "__name__", str(func))
                if not self.plain[idx]:
                    w._fail(
                        f"{name}() reads the memory layout of input {path}, which is a view into "
                        "a larger storage, or not dense.",
                        "an input copied into a static buffer gets a dense buffer of its own, "
                        "so its storage offset and the memory around it differ from the caller's.",
                        f"pass {path}.contiguous() (or .clone()), or call {name} outside the "
                        "graphified function.",
                    )
                self.layout_used.add(idx)
        if not torch.is_grad_enabled() or func in _DETACHES:
            return _tagging_no_grad(func, args, kwargs)
        return func(*args, **kwargs)


class _rnn_weights_as_they_are:
    """While tracing, recurrent modules do not re-pack their weights (``flatten_parameters``).

    A module's parameters are stand-ins during a trace, so ``nn.LSTM`` sees its weights
    changed and, on CUDA, packs them into one cuDNN buffer by swapping their storages
    (``_cudnn_rnn_flatten_weight``): not an operation a graph can hold. Unpacked weights
    are what cuDNN copies into its buffer inside the recorded op. Traces hold TRACE_LOCK;
    another thread's eager LSTM meanwhile just skips the packing (slower, same numbers).
    """

    def __enter__(self) -> None:
        from torch.nn.modules.rnn import RNNBase

        self.orig = RNNBase.__dict__["flatten_parameters"]
        RNNBase.flatten_parameters = _no_flatten  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        from torch.nn.modules.rnn import RNNBase

        RNNBase.flatten_parameters = self.orig  # type: ignore[method-assign]


def _no_flatten(self: Any) -> None:
    return None


def _custom_functions(outs: Sequence[torch.Tensor]) -> List[str]:
    """Names of the custom autograd functions (``torch.autograd.Function``) in the outputs' autograd graph."""
    seen: Set[Any] = set()
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
            if name not in names:
                names.append(name)
        todo.extend(f for f, _ in node.next_functions)
    return names


def _tagging_no_grad(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Run ``func`` and mark the graph nodes it adds as made under ``torch.no_grad()`` (or detached).

    A graph has no grad mode of its own. The recorded backward that recomputes the
    forward (see _autograd.make_backward) runs these nodes without grad again, so a
    ``no_grad`` block of the function (a detached statistic, spectral norm's power
    iteration writing its buffers with ``out=``) stays out of the gradients as in eager.
    """
    mode = get_proxy_mode()
    graph = getattr(getattr(mode, "tracer", None), "graph", None)
    if graph is None:
        return func(*args, **kwargs)
    root = graph._root
    last = root._prev
    out = func(*args, **kwargs)
    n = last._next
    while n is not root:
        n.meta["gt_no_grad"] = True
        n = n._next
    return out


TENSOR_ATTR = object()  # a tensor-valued attribute of an input (see _signature.tensor_attrs)


class _TensorAttr:
    """Stand-in for a tensor that the caller hung on a tensor argument (``p.mask = m``).

    Any use of it is a GraphifyError with the fix: such a tensor is neither an
    argument nor state the function reaches, so a recording would freeze it.
    """

    __slots__ = ("_gt_where",)

    def __init__(self, watch: Any, path: str, name: str):
        object.__setattr__(self, "_gt_where", (watch, path, name))

    def _gt_fail(self) -> None:
        watch, path, name = object.__getattribute__(self, "_gt_where")
        watch._fail(
            f"the function uses {path}.{name}, a tensor set as a Python attribute of input {path}.",
            "a recording takes tensors as arguments or as state it reaches (closures, modules, "
            "globals); a tensor hung on an argument is neither, so the recording would keep the "
            "first call's tensor.",
            f"pass {path}.{name} as an argument of its own (e.g. f(p, p.{name}) instead of f(p)), "
            "or keep it on a module or in a closure that the function reads.",
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, _TensorAttr):
                a._gt_fail()
        raise TypeError("unreachable")  # pragma: no cover

    def __getattr__(self, name: str) -> Any:
        self._gt_fail()

    def __repr__(self) -> str:
        watch, path, name = object.__getattribute__(self, "_gt_where")
        return f"<tensor attribute {path}.{name} (not traceable)>"


def _tensor_attr_fail(self: _TensorAttr, *a: Any, **k: Any) -> Any:
    self._gt_fail()


for _name in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "lt", "le", "gt", "ge", "neg", "pos", "abs", "invert", "bool", "float", "int", "index",
              "len", "iter", "getitem", "setitem", "array", "contains"):
    setattr(_TensorAttr, f"__{_name}__", _tensor_attr_fail)
    if _name in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor"):
        setattr(_TensorAttr, f"__r{_name}__", _tensor_attr_fail)


_SEED_FNS = (
    (torch, "manual_seed"),
    (torch.random, "manual_seed"),
    (torch, "seed"),
    (torch.random, "seed"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
)
_SEED_MSG = (
    "Why: a recording draws fresh random numbers on every replay from the generator's "
    "current state; seeding inside the function happens once, while tracing, so eager "
    "would draw the same numbers on every call and the recording different ones.\n"
    "Fix: seed outside the function (torch.manual_seed before the call), or use a "
    "torch.Generator passed as an argument (generator=g in the random ops)."
)


class _no_seeding:
    """Seeding a default generator inside the traced function is a GraphifyError.

    ``torch.manual_seed`` and its relatives are wrapped while this thread
    traces (other threads pass through).
    """

    def __init__(self, desc: str):
        self.desc = desc
        self.saved: List[Tuple[Any, str, Any]] = []
        self.thread = threading.get_ident()

    def _wrap(self, orig: Any, name: str) -> Any:
        desc, thread = self.desc, self.thread

        @functools.wraps(orig)
        def seeding(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != thread:
                return orig(*a, **k)
            fr = user_frame(traceback.extract_stack())
            raise GraphifyError(
                f"{desc}: torch.{name}() seeds a default random generator inside the function.\n"
                f"  at {format_frame(fr)}\n{_SEED_MSG}"
            )

        return seeding

    @staticmethod
    def _generators() -> List[Any]:
        gens = [torch.default_generator]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gens += list(torch.cuda.default_generators)
        return gens

    def __enter__(self) -> _no_seeding:
        # a reseed changes a generator's initial seed; drawing numbers (in any thread) does not
        gens = self._generators()
        self.seeds = [g.initial_seed() for g in gens]
        self.states = [g.get_state() for g in gens]
        for mod, name in _SEED_FNS:
            orig = getattr(mod, name, None)
            if orig is not None:
                self.saved.append((mod, name, orig))
                setattr(mod, name, self._wrap(orig, f"{mod.__name__[len('torch.'):] + '.' if mod is not torch else ''}{name}"))
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        # (the generators' state is not compared: other threads may draw meanwhile)
        for mod, name, orig in reversed(self.saved):
            setattr(mod, name, orig)
        self.saved = []
        gens = self._generators()
        if len(gens) == len(self.seeds) and any(g.initial_seed() != s for g, s in zip(gens, self.seeds)):
            for g, st in zip(gens, self.states):
                g.set_state(st)
            if typ is None:
                raise GraphifyError(
                    f"{self.desc}: the function reseeds a default random generator directly "
                    "(e.g. torch.default_generator.manual_seed(...)) while tracing.\n"
                    f"{_SEED_MSG}"
                )


def _data_dependent(desc: str, exc: BaseException, cuda: bool = False) -> GraphifyError:
    op = str(exc).split("\n", 1)[0].strip()
    if isinstance(exc, GuardOnDataDependentSymNode):
        op_desc = "branches on a tensor's value"
        op = "a data-dependent guard"
    else:
        key = op.split(" ")[0]
        op_desc = _FRIENDLY.get(key, "depends on the values inside a tensor")
    tb = traceback.extract_tb(exc.__traceback__)
    fr = user_frame(tb)
    inner = innermost_frame(tb)
    where = f"  at {format_frame(fr)}"
    if inner is not None and (fr is None or (inner.filename, inner.lineno) != (fr.filename, fr.lineno)):
        where += f"\n  read at {format_frame(inner)}"
    hint = ""
    optim = [f for f in tb if os.sep + os.path.join("torch", "optim") + os.sep in f.filename]
    dist = [f for f in tb if os.sep + os.path.join("torch", "distributions") + os.sep in f.filename]
    if optim and "lr" in (optim[-1].line or "") and "step" not in (optim[-1].line or ""):
        hint = (f" The read is inside torch.optim ({format_frame(optim[-1])}): this optimizer reads a "
                "tensor learning rate on the host. Pass lr as a Python float (a scheduler that changes "
                "it then records once per value), or keep opt.step() outside the graphified function.")
    elif dist and not optim:
        at = dist[-1].filename[dist[-1].filename.rfind(os.sep + "torch" + os.sep) + 1:]
        hint = (f" The read is inside torch.distributions ({at}:{dist[-1].lineno}, argument validation): a distribution "
                "checks its arguments on the host (validate_args, on by default). Pass "
                "validate_args=False to it (e.g. Categorical(logits=x, validate_args=False)), or call "
                "torch.distributions.Distribution.set_default_validate_args(False) once. The checks "
                "then do not run: where eager would raise on invalid parameters (NaN logits, a "
                "negative scale), the recording computes with them.")
    elif optim:
        if cuda:
            hint = (" The read is inside torch.optim: construct the optimizer with capturable=True, so its "
                    "step count stays a tensor on the GPU instead of being read on the host.")
        else:
            hint = (" The read is inside torch.optim: Adam-family optimizers read their step count on the "
                    "host unless capturable=True, which torch supports on GPUs only. On the CPU, keep "
                    "opt.step() outside the graphified function (graphify the forward, or forward and "
                    "backward), or use an optimizer without a step count such as SGD.")
    return GraphifyError(
        f"{desc}: operation {op} {op_desc}.\n{where}\n"
        "Why: a recording is made once for each input signature and replayed without Python; "
        "a value read from a tensor while tracing would be frozen into the recording, "
        "and an output whose shape depends on the data cannot be replayed into fixed memory.\n"
        "Fix: keep the value on the device (e.g. torch.where instead of `if`), make it static "
        "(pass a Python number, or mark the argument with static_argnums/static_argnames), "
        "or move this part out of the graphified function." + hint
    )


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


def _register_container(cls: type) -> bool:
    """Teach our pytree namespace a container type optree does not know.

    Types registered with ``torch.utils._pytree`` (e.g. Hugging Face's
    ``ModelOutput``) are flattened the way torch does; dataclasses by their
    fields. Returns whether ``cls`` was newly registered.
    """
    import dataclasses

    import optree
    import torch.utils._pytree as tpytree

    node = tpytree.SUPPORTED_NODES.get(cls)
    try:
        if node is not None:
            flat, unflat = node.flatten_fn, node.unflatten_fn

            def _flat_t(x: Any) -> Any:
                children, ctx = flat(x)
                return list(children), ctx

            optree.register_pytree_node(cls, _flat_t, lambda ctx, ch: unflat(list(ch), ctx), namespace=NAMESPACE)
            return True
        if dataclasses.is_dataclass(cls):
            names = tuple(f.name for f in dataclasses.fields(cls))

            def _flat_d(x: Any) -> Any:
                return [getattr(x, n) for n in names], names, names

            def _unflat_d(ctx: Any, children: Any) -> Any:
                obj = object.__new__(cls)
                for n, v in zip(ctx, children):
                    object.__setattr__(obj, n, v)
                return obj

            optree.register_pytree_node(cls, _flat_d, _unflat_d, namespace=NAMESPACE)  # type: ignore[arg-type]
            return True
    except ValueError:  # already registered
        return False
    return False


def _holds_tensor(x: Any) -> bool:
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict) and any(isinstance(v, torch.Tensor) for v in d.values()):
        return True
    return any(isinstance(getattr(x, s, None), torch.Tensor) for s in getattr(type(x), "__slots__", ()) or ())


def flatten_output(out: Any, desc: str) -> Tuple[List[Any], Any]:
    """Flatten an output tree, taking apart registered containers; refuse opaque ones holding tensors."""
    import dataclasses

    import torch.utils._pytree as tpytree

    for _ in range(16):
        leaves, spec = flatten(out)
        new = False
        for x in leaves:
            if isinstance(x, torch.Tensor) or x is None:
                continue
            cls = type(x)
            if cls in tpytree.SUPPORTED_NODES or (dataclasses.is_dataclass(cls) and not isinstance(x, type)):
                new = _register_container(cls) or new
        if not new:
            break
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) and _holds_tensor(x):
            path = leaf_paths(out, root="output")[i]
            raise GraphifyError(
                f"{desc}: the output {path} is a {type(x).__name__} object that holds tensors, and "
                "gtransform cannot take it apart.\nWhy: outputs are flattened into tensors (which "
                "live in the recording's memory) and a structure rebuilt on every call; an opaque "
                "object would carry the trace's placeholders instead of real tensors.\n"
                "Fix: return its tensors in a tuple, dict or dataclass (e.g. (dist.loc, dist.scale) "
                "and rebuild it outside), or register the type as a pytree node "
                "(optree.register_pytree_node(..., namespace='gtransform'))."
            )
    return leaves, spec


def _backward_hooked_modules(roots: Sequence[Root]) -> List[str]:
    """Names of the modules the function reaches that have backward hooks ("(global)" for global ones)."""
    mm = torch.nn.modules.module
    if getattr(mm, "_global_backward_hooks", None) or getattr(mm, "_global_backward_pre_hooks", None):
        return ["(global: register_module_full_backward_hook)"]
    out: List[str] = []
    for r in roots:
        if isinstance(r.obj, torch.nn.Module):
            for name, m in r.obj.named_modules():
                if m._backward_hooks or getattr(m, "_backward_pre_hooks", None):
                    out.append(f"{r.name}.{name} ({type(m).__name__})" if name else f"{r.name} ({type(m).__name__})")
    return out


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


def _drop_profiler_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove record_function markers (torch.optim's): host work with no effect on the numbers."""
    graph = gm.graph
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "profiler" and not n.users:
            graph.erase_node(n)


class _compiling:
    """``torch.compiler.is_compiling()`` is true while tracing, as under torch.export.

    Library code then takes its traceable path: torch.optim keeps step counts and
    tensor learning rates as tensors instead of reading them with ``.item()``.
    """

    def __enter__(self) -> None:
        import torch.compiler as tc

        self.old = getattr(tc, "_is_compiling_flag", None)
        if self.old is not None:
            tc._is_compiling_flag = True

    def __exit__(self, *exc: Any) -> None:
        import torch.compiler as tc

        if self.old is not None:
            tc._is_compiling_flag = self.old


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
            "keep opt.step() outside the graphified function, or use SGD."))
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return GraphifyError(
        f"{desc}: torch cannot trace an operation of the function: {type(exc).__name__}: {first}\n"
        f"  at {format_frame(fr)}\n"
        "Why: graphify traces each signature with fake tensors (no data); this operation works "
        "eagerly but not on fake tensors.\n"
        "Fix: move this operation out of the graphified function, or call the function eagerly." + hint
    )


def trace(
    fn: Callable[..., Any],
    rebuild: Callable[[Sequence[torch.Tensor]], Tuple[Tuple[Any, ...], Dict[str, Any]]],
    in_specs: Sequence[Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype, torch.device, bool]],
    in_paths: List[str],
    desc: str,
    cuda: bool,
    roots: Sequence[Root] = (),
    plain: Optional[Sequence[bool]] = None,
    grads: Sequence[bool] = (),
    attrs: Sequence[Optional[Dict[str, Any]]] = (),
) -> Plan:
    """Trace ``fn`` for one signature.

    Args:
        fn: the user's function.
        rebuild: maps the flat tensor inputs back to ``(args, kwargs)``.
        in_specs: ``(size, stride, dtype, device, requires_grad)`` per tensor input.
        in_paths: leaf paths of the tensor inputs, for messages.
        desc: ``graphify(name)``, for messages.
        cuda: whether the function is recorded by the CUDA backend.
        roots: the Python state ``fn`` reaches (see ``_state.find_roots``): put
            back as it was after the trace, and searched for escapes.
        plain: per tensor input, whether it owns its storage exactly
            (:func:`plain_layout`); ``None``: all do.
        grads: per tensor input, whether it has a ``.grad`` (reading it is refused).
        attrs: per tensor input, its Python attributes (``t.__dict__``) or None:
            set on the trace's stand-in, so the function reads their values.

    Returns:
        The :class:`Plan` of the signature.

    Raises:
        GraphifyError: something the recording cannot contain.
    """
    mode = _TraceMode(allow_non_fake_inputs=True)
    with mode:
        fakes = []
        for size, stride, dtype, device, rg in in_specs:
            t = torch.empty_strided(size, stride, dtype=dtype, device=device)
            if rg:
                t.requires_grad_(True)
            fakes.append(t)
    box: Dict[str, Any] = {}
    storages: Dict[Any, int] = {}
    paths = list(in_paths)
    index = StateIndex(roots)
    snap = Snapshot(roots)
    watch = _Watch(storages, paths, desc, cuda, mode, index, len(fakes))
    watch.overlapping = {i for i, sp in enumerate(in_specs) if _overlaps(sp[0], sp[1])}
    fnwatch = _FnWatch(watch, storages, len(fakes), plain if plain is not None else [True] * len(fakes), grads)
    for i, (t, a) in enumerate(zip(fakes, attrs)):
        if a:
            t.__dict__.update({k: (_TensorAttr(watch, paths[i], k) if v is TENSOR_ATTR else v) for k, v in a.items()})

    def is_ours(v: Any) -> bool:
        return isinstance(v, FakeTensor) and v.fake_mode is mode

    def flat_fn(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        storages.clear()
        for i, t in enumerate(tensors):
            storages.setdefault(StorageWeakRef(t.untyped_storage()), i)
        box["inputs"] = tensors
        fnwatch.inputs = tensors
        args, kwargs = rebuild(tensors)
        with watch, fnwatch:
            out = fn(*args, **kwargs)
        leaves, spec = flatten_output(out, desc)
        # a tensor the function returns as it reached it (a closed-over W,
        # `return self.weight`) is that very tensor in eager: state read in
        # place (so the output is the current tensor itself), or, a CPU tensor
        # of a CUDA function, handed back as is
        leaves = [_returned_as_is(x, watch, cuda) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                  for x in leaves]
        box["spec"] = spec
        box["leaves"] = leaves
        box["custom_grad"] = _custom_functions([x for x in leaves if isinstance(x, torch.Tensor)])
        scan = snap.scan(is_ours)
        slots = {(id(s.obj), s.kind, s.key) for s, _ in scan.escapes}
        for k, t in enumerate(watch.state):
            g = leaf_grad(t) if t.requires_grad else None
            if is_ours(g) and (id(t), "grad", "grad") not in slots:
                scan.escapes.append((Slot("grad", t, "grad", f"{watch.paths[watch.n_in + k]}.grad"), g))
        box["scan"] = scan
        return tuple(x for x in leaves if isinstance(x, torch.Tensor)) + tuple(f for _, f in scan.escapes)

    try:
        try:
            # fx tracing keeps global state (its patcher): one trace at a time
            with TRACE_LOCK, _compiling(), _no_seeding(desc), _rnn_weights_as_they_are(), mode:
                _ACTIVE.depth = _ACTIVE.__dict__.get("depth", 0) + 1
                try:
                    gm = make_fx(flat_fn, tracing_mode="real", _allow_non_fake_inputs=True)(*fakes)
                finally:
                    _ACTIVE.depth -= 1
        except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode) as e:
            raise _data_dependent(desc, e, cuda) from None
        except NotImplementedError as e:
            if "Generator" not in str(e):
                raise
            fr = user_frame_from_exc(e)
            raise GraphifyError(
                f"{desc}: a random op takes an explicit torch.Generator, which this version of "
                f"torch ({torch.__version__}) cannot trace.\n  at {format_frame(fr)}\n"
                "Why: the tracer cannot record a Generator object as an argument of an operation.\n"
                "Fix: use the default generator (seeded with torch.manual_seed), or upgrade torch "
                "(2.13 traces explicit generators)."
            ) from None
        except RuntimeError as e:
            msg = str(e)
            host = next((what for key, what in _HOST_READS if key in msg), None)
            if host is None:
                internal = _internal_failure(desc, e, cuda)
                if internal is None:
                    raise
                raise internal from e
            fr = user_frame_from_exc(e)
            raise GraphifyError(
                f"{desc}: {host} reads a tensor's data on the host.\n  at {format_frame(fr)}\n"
                "Why: a recording is traced once without real data and replayed without Python; "
                "host-side reads of tensor data cannot be part of it.\n"
                "Fix: keep the computation in torch ops on the device, or move this part out of the "
                "graphified function."
            ) from None
        except UnsupportedOperatorException as e:
            fr = user_frame_from_exc(e)
            raise GraphifyError(
                f"{desc}: operator {e} cannot be traced with fake tensors.\n  at {format_frame(fr)}\n"
                "Why: graphify traces each signature without running it, and this operator has no "
                "shape rule (meta kernel).\nFix: move this operation out of the graphified function."
            ) from None
        finally:
            # the trace has no visible effect on the Python state the function reaches
            snap.restore()
            mode.closed = desc

    except GraphifyError as err:
        # the first call of a signature that touches state may fail to trace before
        # lazily created state exists: the caller may run that call eagerly instead
        err.gt_touched_state = bool(watch.state)  # type: ignore[attr-defined]
        raise

    scan = box["scan"]
    if scan.appended:
        made = next((x for x in scan.sites if x), "")
        raise escape_error(desc, scan.appended, f"\n  made at {made}" if made else "")
    if torch.is_grad_enabled() and not fnwatch.for_grad and (
            any(sp[4] for sp in in_specs) or any(f.requires_grad for f in watch.state_fakes)):
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
    _lift_state(gm, watch.state_fakes)
    _drop_profiler_nodes(gm)
    _kernels_in_grad_mode(gm)
    gm.recompile()
    if cuda:
        _constants_to_device(gm, next((t.device for t in fakes), None))
    inputs = list(box["inputs"]) + list(watch.state_fakes)
    in_store: Dict[Any, int] = {}
    for i, t in enumerate(inputs):
        in_store.setdefault(StorageWeakRef(t.untyped_storage()), i)
    k = 0

    def entry(val: torch.Tensor, what: str) -> OutEntry:
        src = in_store.get(StorageWeakRef(val.untyped_storage()))
        if src is None:
            return OutEntry("pool", index=k)
        inp = inputs[src]
        if val.dtype != inp.dtype:
            raise GraphifyError(
                f"{desc}: {what} is a view of input {paths[src]} with another dtype "
                f"({inp.dtype} -> {val.dtype}).\nWhy: outputs that alias inputs are rebuilt "
                "from the caller's tensor, which needs the same dtype.\n"
                "Fix: return .clone() of that output."
            )
        rel = val.storage_offset() - inp.storage_offset()
        return OutEntry("input", index=src, size=tuple(val.shape), stride=val.stride(), rel_offset=rel, identical=val is inp)

    entries: List[OutEntry] = []
    for leaf in box["leaves"]:
        if isinstance(leaf, _AsIs):
            entries.append(OutEntry("const", value=leaf.t))
            continue
        if not isinstance(leaf, torch.Tensor):
            entries.append(OutEntry("const", value=leaf))
            continue
        ent = entry(leaf, f"output {k}")
        ent.requires_grad = bool(leaf.requires_grad)
        entries.append(ent)
        k += 1
    esc_entries: List[OutEntry] = []
    for slot, fake in scan.escapes:
        esc_entries.append(entry(fake, slot.path))
        k += 1
    state_slots = [index.slot_of(t) for t in watch.state]
    return Plan(
        gm=gm,
        in_paths=paths,
        mutated=set(watch.mutated),
        out_spec=box["spec"],
        out_entries=entries,
        n_gm_out=k,
        uses_cuda=watch.uses_cuda,
        random=watch.random,
        op_count=watch.ops,
        generators=watch.generators,
        state=list(watch.state),
        state_slots=state_slots,
        state_names=paths[len(fakes):],
        escape_slots=[s for s, _ in scan.escapes],
        escape_entries=esc_entries,
        py_changes=list(scan.changes),
        roots=list(roots),
        layout_idx=set(fnwatch.layout_used),
        grad_idx=set(fnwatch.grad_read),
        hooks=list(fnwatch.hooks),
        custom_grad=box.get("custom_grad", []),
        rg_traced=(any(sp[4] for sp in in_specs) or any(f.requires_grad for f in watch.state_fakes)) and not fnwatch.for_grad,
        ran_backward=any(s.kind == "grad" for s, _ in scan.escapes) or any(
            s is not None and s.kind == "grad" for s in state_slots),
        fn=fn,
        rebuild=rebuild,
        cuda=cuda,
    )

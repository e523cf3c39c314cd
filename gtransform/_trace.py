"""Tracing a function over flat tensor leaves into an aten-level fx graph.

Each new signature is traced once with fake tensors (``make_fx`` under our own
``FakeTensorMode``, with no shape environment, so anything data-dependent fails
at once instead of being frozen). A dispatch mode sits inside the trace and
watches every operation: it records which inputs are written in place, refuses
resizes of inputs, and (for CUDA functions) refuses copies between host and
device and operations on CPU tensors, naming the user's source line.
"""

from __future__ import annotations

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
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ._errors import GraphifyError, format_frame, user_frame, user_frame_from_exc
from ._tree import flatten, unflatten

try:  # torch >= 2.1
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover
    GuardOnDataDependentSymNode = DataDependentOutputException  # type: ignore[misc,assignment]

__all__ = ["Plan", "OutEntry", "trace", "TRACE_LOCK"]

TRACE_LOCK = threading.RLock()

_aten = torch.ops.aten
_RESIZES = {_aten.resize_.default, _aten.resize_as_.default}
_SETS = {getattr(_aten.set_, o) for o in _aten.set_.overloads()}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
# fresh constants made from Python data inside the function (torch.tensor(3.0), x[0] = 5.)
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
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
    grad_consts: int = 0
    generators: List[Any] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tensor_entries = [e for e in self.out_entries if e.kind != "const"]
        self.all_const = not self.tensor_entries
        self._fused: Any = None

    def fused(self) -> Any:
        """The graph compiled by TorchInductor (made once, on first use).

        Inductor's own CUDA graphs are off (gtransform records the result),
        and random ops use eager's generator (``fallback_random``) so that
        they keep following ``torch.manual_seed`` exactly.
        """
        if self._fused is None:
            self._fused = torch.compile(
                self.gm,
                backend="inductor",
                fullgraph=True,
                dynamic=False,
                options={"fallback_random": True, "triton.cudagraphs": False},
            )
        return self._fused

    def assemble(self, flat: Sequence[Any]) -> Any:
        """Output tree from the tensor outputs (in graph order)."""
        it = iter(flat)
        leaves = [e.value if e.kind == "const" else next(it) for e in self.out_entries]
        return unflatten(self.out_spec, leaves)


def _tensors_in(v: Any) -> List[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


class _Watch(TorchDispatchMode):
    """Watches every aten op of the trace (runs above make_fx's proxy mode)."""

    def __init__(self, inputs: Dict[Any, int], paths: List[str], desc: str, cuda: bool):
        super().__init__()
        self.inputs = inputs
        self.paths = paths
        self.desc = desc
        self.cuda = cuda
        self.mutated: Set[int] = set()
        self.uses_cuda = False
        self.random = False
        self.ops = 0
        self.lifted: Set[int] = set()  # ids of constants made inside the function
        self.grad_consts = 0  # closed-over tensors that require grad (module parameters)
        self.generators: List[torch.Generator] = []  # explicit generators used by random ops
        self._seen: Set[int] = set()

    def _fail(self, what: str, why: str, fix: str) -> None:
        fr = user_frame(traceback.extract_stack())
        raise GraphifyError(
            f"{self.desc}: {what}\n  at {format_frame(fr)}\n"
            f"Why: {why}\nFix: {fix}"
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        schema = func._schema
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
                    self.mutated.add(idx)
        if _SEEDED is not None and _SEEDED in func.tags:
            self.random = True
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and all(gen is not g for g in self.generators):
            self.generators.append(gen)
        for v in list(args) + list(kwargs.values()):
            for t in _tensors_in(v):
                if t.requires_grad and not isinstance(t, FakeTensor) and id(t) not in self._seen:
                    self._seen.add(id(t))
                    self.grad_consts += 1
        out = func(*args, **kwargs)
        if func in _LIFTS:
            self.lifted.update(id(t) for t in _tensors_in(out))
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
        for t in ins:
            if t.device.type == "cpu" and not isinstance(t, FakeTensor) and func not in _LIFTS:
                self._fail(
                    f"{func} reads a CPU tensor that the function closes over, inside a CUDA function.",
                    "its value would be read once, at recording time, and frozen into the graph.",
                    "pass the tensor as an argument on the GPU, or use a Python number.",
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


def _data_dependent(desc: str, exc: BaseException) -> GraphifyError:
    op = str(exc).split("\n", 1)[0].strip()
    if isinstance(exc, GuardOnDataDependentSymNode):
        op_desc = "branches on a tensor's value"
        op = "a data-dependent guard"
    else:
        key = op.split(" ")[0]
        op_desc = _FRIENDLY.get(key, "depends on the values inside a tensor")
    fr = user_frame_from_exc(exc)
    return GraphifyError(
        f"{desc}: operation {op} {op_desc}.\n  at {format_frame(fr)}\n"
        "Why: a recording is made once for each input signature and replayed without Python; "
        "a value read from a tensor while tracing would be frozen into the recording, "
        "and an output whose shape depends on the data cannot be replayed into fixed memory.\n"
        "Fix: keep the value on the device (e.g. torch.where instead of `if`), make it static "
        "(pass a Python number, or mark the argument with static_argnums/static_argnames), "
        "or move this part out of the graphified function."
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


def trace(
    fn: Callable[..., Any],
    rebuild: Callable[[Sequence[torch.Tensor]], Tuple[Tuple[Any, ...], Dict[str, Any]]],
    in_specs: Sequence[Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype, torch.device, bool]],
    in_paths: List[str],
    desc: str,
    cuda: bool,
) -> Plan:
    """Trace ``fn`` for one signature.

    Args:
        fn: the user's function.
        rebuild: maps the flat tensor inputs back to ``(args, kwargs)``.
        in_specs: ``(size, stride, dtype, device, requires_grad)`` per tensor input.
        in_paths: leaf paths of the tensor inputs, for messages.
        desc: ``graphify(name)``, for messages.
        cuda: whether the function is recorded by the CUDA backend.

    Returns:
        The :class:`Plan` of the signature.

    Raises:
        GraphifyError: something the recording cannot contain.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = []
        for size, stride, dtype, device, rg in in_specs:
            t = torch.empty_strided(size, stride, dtype=dtype, device=device)
            if rg:
                t.requires_grad_(True)
            fakes.append(t)
    box: Dict[str, Any] = {}
    storages: Dict[Any, int] = {}
    watch = _Watch(storages, in_paths, desc, cuda)

    def flat_fn(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        storages.clear()
        for i, t in enumerate(tensors):
            storages.setdefault(StorageWeakRef(t.untyped_storage()), i)
        box["inputs"] = tensors
        args, kwargs = rebuild(tensors)
        with watch:
            out = fn(*args, **kwargs)
        leaves, spec = flatten(out)
        box["spec"] = spec
        box["leaves"] = leaves
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    try:
        # fx tracing keeps global state (its patcher): one trace at a time
        with TRACE_LOCK, mode:
            gm = make_fx(flat_fn, tracing_mode="real", _allow_non_fake_inputs=True)(*fakes)
    except (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode) as e:
        raise _data_dependent(desc, e) from None
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
            raise
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

    if cuda:
        _constants_to_device(gm, next((t.device for t in fakes), None))
    inputs = box["inputs"]
    in_store = {StorageWeakRef(t.untyped_storage()): i for i, t in enumerate(inputs)}
    entries: List[OutEntry] = []
    k = 0
    for leaf in box["leaves"]:
        if not isinstance(leaf, torch.Tensor):
            entries.append(OutEntry("const", value=leaf))
            continue
        val = leaf
        src = in_store.get(StorageWeakRef(val.untyped_storage()))
        if src is not None:
            inp = inputs[src]
            if val.dtype != inp.dtype:
                raise GraphifyError(
                    f"{desc}: output {k} is a view of input {in_paths[src]} with another dtype "
                    f"({inp.dtype} -> {val.dtype}).\nWhy: outputs that alias inputs are rebuilt "
                    "from the caller's tensor, which needs the same dtype.\n"
                    "Fix: return .clone() of that output."
                )
            rel = val.storage_offset() - inp.storage_offset()
            ident = val is inp
            entries.append(
                OutEntry("input", index=src, size=tuple(val.shape), stride=val.stride(), rel_offset=rel, identical=ident)
            )
        else:
            entries.append(OutEntry("pool", index=k))
        k += 1
    return Plan(
        gm=gm,
        in_paths=in_paths,
        mutated=set(watch.mutated),
        out_spec=box["spec"],
        out_entries=entries,
        n_gm_out=k,
        uses_cuda=watch.uses_cuda,
        random=watch.random,
        op_count=watch.ops,
        grad_consts=watch.grad_consts,
        generators=watch.generators,
    )

"""What the user's function runs under while it is traced.

The modes that police the function turn what a recording cannot hold into a
GraphifyError that names the user's line: :class:`_Watch` sees every aten
operation (in-place writes and resizes of inputs, host/device copies, state
reached without being an argument, which it swaps for fakes), :class:`_FnWatch`
the Python-level tensor calls dispatch cannot see (``.data =``, layout reads,
``.grad``, hooks, ``no_grad`` blocks), :class:`_TensorAttr` stands in for
tensors hung on arguments, and :class:`_no_seeding` refuses reseeding. While a
:class:`_Watch` is entered, the Python-level getters and setters of the default
generators' states are followed (:class:`_RngLedger`): a state set back inside the
function (``torch.set_rng_state``, ``fork_rng``, ``torch.utils.checkpoint``'s
recompute) that would make eager repeat random numbers is refused. What these need
changed in torch (the state functions, the seeding functions,
``torch.compiler.is_compiling``) is changed by ``_patches`` while a trace runs, for
the tracing thread only; the replacements' bodies are here (:func:`rng_getter`,
:func:`rng_setter`, :func:`seed_refusal`). ``_trace.trace`` and the joint trace of
``_partition`` enter them; what is done with the traced graph afterwards is
``_rewrite``'s.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from . import _cudnn_rnn
from ._compat import (
    TENSOR_PRIVATE_SPARSE_READS,
    TENSOR_VERSION_ATTR,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TensorBase,
    TorchDispatchMode,
    aten_to_copy,
    disable_proxy_modes_tracing,
)
from ._compat import aten_linalg_check_errors as _CHECK_ERRORS
from ._compat import aten_local_scalar_dense as _LOCAL_SCALAR
from ._compat import disable_current_modes as _disable_current_modes
from ._compat import get_current_dispatch_mode_stack as _get_current_dispatch_mode_stack
from ._compat import written_arguments as _written_arguments
from ._errors import _PKG_DIR, GraphifyError, PrintWarning, format_frame, is_library_file, user_frame
from ._frozen import NO_VALUE, Frozen
from ._patches import Route, add_shared, tracing
from ._state import StateIndex
from ._symbolic import hint

__all__ = ["FOR_GRAD", "TENSOR_ATTR", "storage_extent"]

# set while a signature is looked up for torch.func.grad/vjp of a graphified
# function: its inputs are differentiated although the traced stand-ins are not
FOR_GRAD = threading.local()


_aten = torch.ops.aten
_RESIZES = {_aten.resize_.default, _aten.resize_as_.default}
_SETS = {getattr(_aten.set_, o) for o in _aten.set_.overloads()}
_COPIES = {aten_to_copy, _aten.copy_.default, _aten.copy.default}
# fresh constants made from Python data inside the function (torch.tensor(3.0), x[0] = 5.)
_LIFTS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
# ops that update arguments in place without saying so in their schema:
# batch norm's running statistics (in training mode, the bool at index 5)
# (every overload: native_batch_norm.out too)
_HIDDEN_WRITES: Dict[Any, Tuple[int, ...]] = {}
for _name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
    _op = getattr(_aten, _name, None)
    for _ov in (_op.overloads() if _op is not None else ()):
        _HIDDEN_WRITES[getattr(_op, _ov)] = (3, 4)
_SEEDED: Any
try:
    _SEEDED = torch.Tag.nondeterministic_seeded
except AttributeError:  # pragma: no cover
    _SEEDED = None


def _tensors_in(v: Any) -> List[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, torch.Tensor)]
    return []


_LIB_CACHE: Dict[str, bool] = {}
_QUANTIZE = ("aten::quantize_per_", "aten::_make_per_tensor_quantized", "aten::_make_per_channel_quantized")


def _site() -> str:
    """``file:line`` of the innermost user frame (cheap: no source lines).

    Code without a file (``<string>``: a dataclass's generated ``__init__``,
    ``exec``) is passed over for a frame with one, and named only if there is none.
    """
    f: Any = sys._getframe(2)
    synthetic = ""
    while f is not None:
        fn = f.f_code.co_filename
        lib = _LIB_CACHE.get(fn)
        if lib is None:
            lib = _LIB_CACHE[fn] = is_library_file(fn)
        if not lib:
            if not fn.startswith("<"):
                return f"{fn}:{f.f_lineno}"
            synthetic = synthetic or f"{fn}:{f.f_lineno}"
        f = f.f_back
    return synthetic


def storage_extent(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes of its storage a tensor can reach: [first, last + 1).

    A symbolic trace's sizes are read as this call's (``hint``: no guard is made).
    """
    start = hint(t.storage_offset()) * t.element_size()
    shape = [hint(n) for n in t.shape]
    if 0 in shape:
        return start, start
    reach = sum((n - 1) * abs(hint(st)) for n, st in zip(shape, t.stride()))
    return start, start + (reach + 1) * t.element_size()


# ops whose data-dependent shape comes from a boolean mask alone (see Frozen.by_index)
_BY_INDEX = frozenset((torch.ops.aten.index.Tensor, torch.ops.aten.masked_select.default))


class _Watch(TorchDispatchMode):
    """Watches every aten op of the trace (runs above make_fx's proxy mode).

    Real tensors that reach an operation are *state* (the function reached them
    without taking them as arguments): each is swapped for a fake of its own,
    so the trace never reads or writes real memory, and later becomes an input
    of the graph.
    """

    # marks a thread running the trace's work (autograd's device threads carry the
    # tracing thread's dispatch modes): see _patches.tracing
    _gt_trace = True

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
        self.mutated_at: Dict[int, Tuple[str, str]] = {}  # input -> (op, user's line) of its first write
        self.uses_cuda = False
        self.random = False
        self.ops = 0
        self.calls = _Calls()
        self.lifted: Set[int] = set()  # ids of constants made inside the function
        self.generators: List[torch.Generator] = []  # explicit generators used by random ops
        self.generator_at: List[str] = []  # the line of each one's first draw
        self.state: List[torch.Tensor] = []
        self.state_fakes: List[FakeTensor] = []
        # state tensors without autograd history when first seen: an in-place write of a value
        # that requires grad, in grad mode, gives the real tensor a grad_fn over the trace's
        # tensors (autograd runs above this mode); the trace takes it off again (drop_history)
        self.no_history: List[torch.Tensor] = []
        self._fake_of: Dict[int, FakeTensor] = {}
        self.overlapping: Set[int] = set()  # caller's inputs whose elements share memory
        # state tensors by storage, where several share one (an LSTM's weights packed by
        # flatten_parameters, views of one buffer): a write to one marks each it overlaps
        self.sharing: Dict[Any, List[int]] = {}
        self.rng = _RngLedger(desc)
        # inputs whose shape, strides or offset an in-place op changed: input -> (op, user's
        # line, layout before). Refused unless the function changes them back before it ends
        # (matmul(v, m, out=o) unsqueezes a 1-d `o` around its product): see check_layouts
        self.reshaped: Dict[int, Tuple[str, str, Any]] = {}
        # host reads of unchanged tensors, frozen (see _frozen); None: none is (the joint trace)
        self.frozen: Optional[Frozen] = None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        super().__exit__(typ, exc, tb)
        self.calls.clear()
        if typ is None:
            self.rng.check_end()

    def _fail(self, what: str, why: str, fix: str, host: bool = False) -> None:
        """Refuse the trace (``host``: a read of host memory, which ``on_break`` may take: see ``_breaks``)."""
        fr = user_frame(traceback.extract_stack())
        err = GraphifyError(
            f"{self.desc}: {what}\n  at {format_frame(fr)}\n"
            f"Why: {why}\nFix: {fix}"
        )
        if host:
            err.gt_host_read = True  # type: ignore[attr-defined]
        raise err

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
                    "capturable=True so their step counts live on the GPU), or pass a Python number. "
                    "Or let Python run it: graphify(fn, on_break=\"split\") records the pieces around it "
                    "(a piece that cannot be recorded runs eagerly, warned once); on_break=\"eager\" runs "
                    "such calls eagerly.",
                    host=True,
                )
            if t.layout != torch.strided or t.is_nested or t.is_quantized:
                what = ("a nested tensor" if t.is_nested else f"a quantized tensor ({t.dtype})"
                        if t.is_quantized else f"a {t.layout} tensor")
                self._fail(
                    f"the function reads {name}, {what} in state it reaches without taking it as an "
                    "argument.",
                    "graphify records dense strided tensors only: state becomes an input of the "
                    "recording, read in place on every call.",
                    "keep a dense copy as the state (t.to_dense(), t.dequantize()) or build this tensor "
                    "inside the function from dense tensors (x.to_sparse() there works), or call this "
                    "part eagerly.",
                )
            # a tensor with autograd history (``W = base * 2`` closed over, a cache an eager
            # call in grad mode wrote into) is traced as a leaf that requires grad, like a
            # parameter: at call time it is an input of the autograd node, so gradients flow
            # on into its history as in eager
            history = t.grad_fn is not None
            # (outside the tracer: torch 2.14 fakes a ``.grad`` that is a view by running
            # ``as_strided`` on its base, which make_fx would record as a constant of the graph)
            with disable_proxy_modes_tracing():
                f = self.mode.from_tensor(t.detach() if history else t, static_shapes=True)
            if history:
                f.requires_grad_(True)
            self._fake_of[id(t)] = f
            self.state.append(t)
            if not t.requires_grad:
                self.no_history.append(t)
            self.state_fakes.append(f)
            if self.frozen is not None:
                self.frozen.leaf(f, self.n_in + k, t)
            key = StorageWeakRef(f.untyped_storage())
            self.inputs.setdefault(key, self.n_in + k)
            self.sharing.setdefault(key, []).append(self.n_in + k)
            self.paths.append(name)
        return f

    def _mark_written(self, t: torch.Tensor, idx: int) -> None:
        """Record that input ``idx`` (the first input on ``t``'s storage) is written through ``t``.

        Where several state tensors share that storage (a packed weight buffer is several
        parameters), each one whose memory ``t`` overlaps is the one updated: the
        recording puts each back after its warm-up.
        """
        shared = self.sharing.get(StorageWeakRef(t.untyped_storage()))
        if shared is None or len(shared) < 2:
            self.mutated.add(idx)
            return
        lo, hi = storage_extent(t)
        hit = []
        for j in shared:
            jlo, jhi = storage_extent(self.state_fakes[j - self.n_in])
            if jlo < hi and lo < jhi:
                hit.append(j)
        self.mutated.update(hit or (idx,))

    def _no_history_on_views(self, func: Any, real_args: Sequence[Any], real_kwargs: Dict[str, Any],
                             args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        """Refuse a grad-requiring write into a state view without history, before autograd sees it.

        Such a view: ``register_buffer("lo", self.big[:4])``. Autograd would give the real
        view a history over the trace's tensors; unlike a whole tensor's (see
        :func:`drop_history`), a view's cannot be taken off again, and the module would fail
        from then on, in eager too. Refused, the first call runs eagerly.
        """
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = real_args[i] if (i < len(real_args) and not a.kwarg_only) else real_kwargs.get(a.name)
            for t in _tensors_in(v):
                if type(t) is FakeTensor or t.requires_grad or not t._is_view() or id(t) not in self._fake_of:
                    continue
                if not any(x.requires_grad for x in _tensors_in(list(args) + list(kwargs.values()))):
                    return
                k = next(j for j, s in enumerate(self.state) if s is t)
                self._fail(
                    f"{func} writes a value that requires grad into {self.paths[self.n_in + k]}, a view "
                    "of another tensor in state, in grad mode.",
                    "eager gives that view autograd history (and grows it on every call); the trace "
                    "cannot take history off a view again, and a recording keeps state as plain "
                    "memory.",
                    "write detached values (value.detach()), or call the function under "
                    "torch.no_grad() (or torch.inference_mode()).",
                )

    def _swap(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v if isinstance(v, FakeTensor) else self._fake(v)
        if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in v):
            return type(v)(self._swap(t) for t in v) if isinstance(v, list) else tuple(self._swap(t) for t in v)
        return v

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func is _LOCAL_SCALAR and self.frozen is not None:
            # a host read of unchanged tensors: its real value, a constant of the trace
            value = self.frozen.read(func, [self._swap(a) for a in args], {}, lift=False)
            if value is not NO_VALUE:
                return value
        if func not in _LIFTS:
            args, kwargs = self._stand_ins(func, args, kwargs)
        if func in _SETS and len(args) > 1 and isinstance(args[1], (torch.UntypedStorage, torch.TypedStorage)):
            return self._set_storage(func, args)
        if func._schema.name.startswith(_QUANTIZE):
            self._fail(
                f"{func} makes a quantized tensor.",
                "graphify records dense tensors of ordinary dtypes; torch's fake kernels give "
                "quantize ops a float32 result, so the recording would hand back a broken tensor.",
                "quantize outside the graphified function, or keep the values and the scale apart "
                "(torch.fake_quantize_per_tensor_affine simulates quantization in float).",
            )
        hidden = _HIDDEN_WRITES.get(func)
        if hidden is not None and len(args) > 5 and args[5]:
            for i in hidden:
                for t in _tensors_in(args[i]):
                    idx = self.inputs.get(StorageWeakRef(t.untyped_storage()))
                    if idx is not None:
                        self._mark_written(t, idx)
        written = self._input_writes(func, args, kwargs) if _written_arguments(func) else []
        seeded = _SEEDED is not None and _SEEDED in func.tags and not _no_dropout(func, args, kwargs)
        if seeded:
            self.random = True
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and all(gen is not g for g in self.generators):
            self.generators.append(gen)
            self.generator_at.append(format_frame(user_frame(traceback.extract_stack())))
        last = None
        if self.cuda:
            if func in _CUDA_REWRITES:
                # a host read inside the op's CUDA kernel, where an equivalent records
                return _CUDA_REWRITES[func](*args, **kwargs)
            if func is _CHECK_ERRORS:
                self._fail(*_check_errors_refusal(args))
        graph = _proxy_graph()
        last = graph._root._prev if graph is not None else None
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            # an output shape that depends on unchanged tensors: their real result, a constant
            out = NO_VALUE
            if self.frozen is not None and not kwargs:
                # x[mask], masked_select: an unchanged mask's indices frozen, the op traced over x
                # (x's values and gradients follow; only the mask is guarded)
                out = self.frozen.by_index(func, args)
            if out is NO_VALUE and self.frozen is not None and func not in _BY_INDEX:
                out = self.frozen.read(func, args, kwargs, lift=True)
            if out is NO_VALUE:
                raise
            self.lifted.update(id(t) for t in _tensors_in(out))
        if last is not None:
            # the user's line on the op's nodes (CUDA: named if its capture fails), and the
            # Python calls under way (the fused backend compiles repeated calls' ops once)
            _tag(last, self.cuda, self.calls)
        if seeded:
            self.rng.drew(func, gen, out)
        self._after(func, args, kwargs, out, written)
        if self.frozen is not None:
            self.frozen.note(func, args, kwargs, out, seeded)
        return out

    def _stand_ins(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
        """The op's arguments with the real tensors it reaches (state) replaced by their stand-ins."""
        host_read = func is _LOCAL_SCALAR and bool(args) and isinstance(args[0], torch.Tensor) \
            and type(args[0]) is not FakeTensor
        real_args, real_kwargs = args, kwargs
        args = [self._swap(a) for a in args]
        if kwargs:
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        if func._schema.is_mutable and torch.is_grad_enabled():
            self._no_history_on_views(func, real_args, real_kwargs, args, kwargs)
        if host_read:
            # a host read of state (float(self.num_batches_tracked)), its stand-in made (the
            # state is touched: a first call then runs eagerly): refused here, not left to
            # the stand-in, which may carry the value as a constant (torch 2.15 returns it,
            # and the value would be frozen into the recording)
            raise DataDependentOutputException(func)
        return args, kwargs

    def _input_writes(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[torch.Tensor, int, Any]]:
        """The inputs and state an in-place op writes (marked written), refusing what a replay cannot do."""
        written: List[Tuple[torch.Tensor, int, Any]] = []
        schema_args = func._schema.arguments
        for i in _written_arguments(func):
            a = schema_args[i]
            v = args[i] if (i < len(args) and not a.kwarg_only) else kwargs.get(a.name)
            for t in _tensors_in(v):
                idx = self.inputs.get(StorageWeakRef(t.untyped_storage()))
                if idx is None:
                    continue
                self._check_write(func, t, idx, args)
                written.append((t, idx, (t.shape, t.stride(), t.storage_offset())))
                if idx not in self.mutated_at:  # for messages: the op and the user's line
                    self.mutated_at[idx] = (str(func), format_frame(user_frame(traceback.extract_stack())))
                self._mark_written(t, idx)
        return written

    def _check_write(self, func: Any, t: torch.Tensor, idx: int, args: Sequence[Any]) -> None:
        if func in _SETS or (func in _RESIZES and not _same_size(func, t, args)):
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
                "an update through memory shared by several elements (an expand()ed "
                "tensor) has no single answer: eager refuses most such ops (\"more than one "
                "element of the written-to tensor refers to a single memory location\") and "
                "the recording would update a copy and write it back.",
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

    def _after(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any,
               written: List[Tuple[torch.Tensor, int, Any]]) -> None:
        """What the op did, noted: inputs it reshaped, constants it lifted, where its outputs were made, devices."""
        for t, idx, meta in written:
            if (t.shape, t.stride(), t.storage_offset()) != meta and idx not in self.reshaped:
                self.reshaped[idx] = (str(func), format_frame(user_frame(traceback.extract_stack())), meta)
        if func in _LIFTS:
            self.lifted.update(id(t) for t in _tensors_in(out))
        site = None
        for t in _tensors_in(out):
            if isinstance(t, FakeTensor) and "_gt_site" not in t.__dict__:
                if site is None:
                    site = _site()
                t.__dict__["_gt_site"] = site
                t.__dict__["_gt_op"] = self.ops  # (when it was made: after the function's backward?)
        if self.cuda or self.uses_cuda:
            self._check_devices(func, args, kwargs, out)
        else:
            for t in _tensors_in(out):
                if t.device.type == "cuda":
                    self.uses_cuda = True

    def check_layouts(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse an input (``tensors``: the trace's inputs, then state) left with another shape or strides.

        Eager changes the caller's tensor object itself (``x.t_()``, ``x.unsqueeze_(0)``,
        ``out=`` resizing a wrongly shaped output); a recording writes values back into the
        caller's tensor, whose shape it cannot change. A change undone before the function
        ends leaves the caller's tensor as it was and is recorded as it is.
        """
        for idx, (op, line, meta) in sorted(self.reshaped.items()):
            t = tensors[idx] if idx < len(tensors) else None
            if t is None or (t.shape, t.stride(), t.storage_offset()) == meta:
                continue
            raise GraphifyError(
                f"{self.desc}: {op} changes the shape or strides of input {self.paths[idx]} in place "
                f"({list(meta[0])} -> {list(t.shape)}).\n  at {line}\n"
                "Why: eager changes the caller's tensor object itself; a recording only writes values "
                "back into the caller's tensor, whose shape it cannot change.\n"
                "Fix: use the out-of-place op and return its result (e.g. y = x.t() instead of x.t_()), "
                "pass an out= tensor of the result's shape, or change the tensor outside the graphified "
                "function."
            )

    def _set_storage(self, func: Any, args: Sequence[Any]) -> Any:
        """``t.set_(storage)``: a graph has no node that holds a storage object.

        (cuDNN's recurrent layers do this inside eager's composite; their calls are routed
        around it while tracing, see ``_cudnn_rnn``.)
        """
        self._fail(
            f"{func} points a tensor at another tensor's storage object.",
            "a recording is a graph of tensor operations; a storage object is not a tensor, so "
            "the graph cannot hold it.",
            "use a view of the tensor instead (t.view(...), t.as_strided(...), t.set_(other_tensor)), "
            "or do this outside the graphified function.",
        )

    def _check_devices(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> None:
        self.uses_cuda = True
        ins = [t for v in list(args) + list(kwargs.values()) for t in _tensors_in(v)]
        outs = _tensors_in(out)
        if func in _LIFTS:
            return  # constants are moved to the device when recorded
        if ins and all(id(t) in self.lifted for t in ins):
            # work on constants made from Python data alone (torch.func.jacfwd's
            # torch.tensor(sizes).cumsum(0)): a constant too, the same on every call
            self.lifted.update(id(t) for t in outs)
            return
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
            # (an empty one holds no value to freeze: torch.utils.checkpoint makes one)
            if t.device.type == "cpu" and t.numel() > 0 and (t.dim() > 0 or (_SEEDED is not None and _SEEDED in func.tags)):
                self._fail(
                    f"{func} makes a CPU tensor of shape {tuple(t.shape)} inside a CUDA function.",
                    "CPU work is not recorded by CUDA graph capture: it would run once, at "
                    "recording time, and its result would be frozen.",
                    "create the tensor on the GPU (device=x.device), or move this work out of "
                    "the graphified function.",
                )


def _same_size(func: Any, t: torch.Tensor, args: Sequence[Any]) -> bool:
    """Whether ``resize_`` / ``resize_as_`` keeps ``t``'s shape (a no-op: out= tensors of the right shape)."""
    if len(args) < 2:
        return False
    want = args[1].shape if func is _aten.resize_as_.default and isinstance(args[1], torch.Tensor) else args[1]
    try:
        return tuple(want) == tuple(t.shape)
    except TypeError:
        return False


# -- CUDA ops whose kernels read values on the host (a synchronisation: no CUDA graph can hold it)
# (_CHECK_ERRORS: aten._linalg_check_errors, None where missing; see _compat)


def _check_errors_refusal(args: Sequence[Any]) -> Tuple[str, str, str]:
    """What to say of torch.linalg's host check of its factorization's ``info`` (raise on a singular matrix)."""
    api = str(args[1]) if len(args) > 1 else "torch.linalg"
    api = api if api.startswith("torch.") else f"torch.{api}"
    base = api[:-3] if api.endswith("_ex") else api
    ex = base + "_ex"
    mod, _, name = ex.rpartition(".")
    has_ex = hasattr(sys.modules.get(mod) or torch.linalg, name) if mod in ("torch.linalg", "torch") else False
    fix = (f"use {ex}, which returns the check's result on the device instead of raising (e.g. "
           f"`out, info = {ex}(A)`; look at info outside the function), or call {base} outside the "
           "graphified function." if has_ex else
           f"call {base} outside the graphified function, or an equivalent that does not check on the host "
           "(torch.linalg.lstsq's and pinv's checks are of the same kind; for a solve, "
           "torch.linalg.solve_ex).")
    return (f"{base} checks its result on the host (it raises for a singular or non-positive-definite "
            "matrix): a synchronisation inside a CUDA function.",
            "a CUDA graph replays kernels without the host: the check would run once, while recording, "
            "and the capture fails on its synchronisation.", fix)


def _masked_fill_where(self: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``masked_fill(self, mask, value)`` with a tensor value, as ``where`` (CUDA's kernel calls value.item())."""
    return _aten.where.self(mask, value.to(self.dtype), self)


def _masked_fill_where_(self: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _aten.copy_.default(self, _aten.where.self(mask, value.to(self.dtype), self))


def _index_mask(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """A bool mask of ``self``'s dimension ``dim`` where ``index`` points, shaped to broadcast along it."""
    dim = dim % self.dim()
    n = self.shape[dim]
    mask = _aten.index_fill.int_Scalar(_aten.zeros.default([n], dtype=torch.bool, device=self.device), 0, index, True)
    shape = [1] * self.dim()
    shape[dim] = n
    return _aten.view.default(mask, shape)


def _index_fill_where(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``index_fill`` with a tensor value, as ``where`` over an index mask (CUDA's kernel calls value.item())."""
    if self.dim() == 0:
        return _aten.index_fill.int_Tensor(self, dim, index, value)
    return _aten.where.self(_index_mask(self, dim, index), value.to(self.dtype), self)


def _index_fill_where_(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if self.dim() == 0:
        return _aten.index_fill_.int_Tensor(self, dim, index, value)
    return _aten.copy_.default(self, _aten.where.self(_index_mask(self, dim, index), value.to(self.dtype), self))


def _isin_sorted(elements: torch.Tensor, test_elements: torch.Tensor, *, assume_unique: bool = False,
                 invert: bool = False) -> torch.Tensor:
    """``torch.isin`` as a sort and a binary search.

    CUDA's kernel takes torch.unique for large test sets (a synchronisation); this is exact
    for every input, NaN included (never found).
    """
    dtype = torch.promote_types(elements.dtype, test_elements.dtype)
    values = _aten.reshape.default(elements.to(dtype), [-1])
    table = _aten.sort.default(_aten.reshape.default(test_elements.to(dtype), [-1]))[0]
    if table.numel() == 0:
        found = _aten.zeros_like.default(values, dtype=torch.bool)
    else:
        keys = table
        if table.is_floating_point():  # (NaN, sorted last, breaks the search: searched as +inf, never equal)
            keys = _aten.where.ScalarSelf(_aten.isnan.default(table), float("inf"), table)
        at = _aten.clamp.default(_aten.searchsorted.Tensor(keys, values), None, table.numel() - 1)
        found = _aten.eq.Tensor(_aten.index_select.default(table, 0, at), values)
    if invert:
        found = _aten.logical_not.default(found)
    return _aten.reshape.default(found, list(elements.shape))


_CUDA_REWRITES: Dict[Any, Callable[..., Any]] = {}
if hasattr(_aten, "masked_fill"):
    _CUDA_REWRITES[_aten.masked_fill.Tensor] = _masked_fill_where
    _CUDA_REWRITES[_aten.masked_fill_.Tensor] = _masked_fill_where_
if hasattr(_aten, "index_fill"):
    _CUDA_REWRITES[_aten.index_fill.int_Tensor] = _index_fill_where
    _CUDA_REWRITES[_aten.index_fill_.int_Tensor] = _index_fill_where_
if hasattr(_aten, "isin"):
    _CUDA_REWRITES[_aten.isin.Tensor_Tensor] = _isin_sorted


class _Calls:
    """The Python calls under way at each op of a trace: a serial number per call, outermost first.

    Two calls of one function get different numbers (each frame is held until the trace
    ends, so its id is not reused). The fused backend compiles the ops of repeated calls
    once (``gtransform.fuse._regions``).
    """

    __slots__ = ("serial", "held", "cached")

    def __init__(self) -> None:
        self.serial = 0
        self.held: List[Any] = []  # the frames numbered (let go when the watch exits)
        self.cached: Dict[int, Tuple[int, ...]] = {}

    def now(self) -> Tuple[int, ...]:
        cached = self.cached
        f: Any = sys._getframe(3)
        new: List[Any] = []
        while f is not None and id(f) not in cached:
            new.append(f)
            f = f.f_back
        calls = cached[id(f)] if f is not None else ()
        for g in reversed(new):
            self.held.append(g)
            self.serial += 1
            calls = cached[id(g)] = calls + (self.serial,)
        return calls

    def clear(self) -> None:
        self.held.clear()
        self.cached.clear()


def _proxy_graph() -> Any:
    mode = get_proxy_mode()
    return getattr(getattr(mode, "tracer", None), "graph", None)


def _tag(last: Any, cuda: bool, calls: Any) -> None:
    """Mark the nodes recorded after ``last`` with where they come from.

    The user's line (CUDA traces: named if a capture fails) and the Python calls under
    way (``gt_calls``, see :class:`_Calls`).
    """
    site = None
    n = last._next
    while n.op != "root":
        if cuda:
            if site is None:
                site = _site()
            n.meta["gt_site"] = site
        if calls is not None:
            n.meta["gt_calls"] = calls.now()
        n = n._next


_DATA_SET = TensorBase.__dict__["data"]
_FORMAT = torch.Tensor.__format__
_REPR = torch.Tensor.__repr__
_GRAD_ATTR = TensorBase.__dict__["grad"]
# autograd facts of an input that its stand-in does not share: whether it is a leaf and its
# grad_fn (an input with history is traced as a leaf), and its version counter
_IS_LEAF_ATTR = TensorBase.__dict__["is_leaf"]
_GRAD_FN_ATTR = TensorBase.__dict__["grad_fn"]
_VERSION_ATTR = TENSOR_VERSION_ATTR
_REGISTER_HOOK = torch.Tensor.register_hook
_HOOK_REGISTRATIONS = frozenset(h for h in (_REGISTER_HOOK, getattr(torch.Tensor, "register_post_accumulate_grad_hook", None))
                                if h is not None)
_SDPA = torch.nn.functional.scaled_dot_product_attention


_REPLAYS_SAVED_RNG: Dict[Any, bool] = {}


def _no_dropout(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
    """Whether a random op is called with dropout off.

    Scaled dot-product attention with dropout_p=0 draws nothing (eager's generator does
    not move). Neither does an attention backward that takes the forward's saved
    ``philox_seed``/``philox_offset`` (tagged seeded, but it replays the forward's mask).
    """
    replays = _REPLAYS_SAVED_RNG.get(func)
    if replays is None:
        replays = _REPLAYS_SAVED_RNG[func] = any(a.name in ("philox_seed", "rng_state") for a in func._schema.arguments)
    if replays:
        return True
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get("dropout_p", a.default_value
                                                                               if a.has_default_value() else None)
            return isinstance(v, (int, float)) and v == 0
    return False


_DATA_PTR = torch.Tensor.data_ptr


def _numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of a torch dtype, as ``Tensor.numpy()`` gives (TypeError where it has none)."""
    import numpy as np

    names = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.int64: "int64",
             torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
             torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128"}
    if dtype not in names:
        raise TypeError(f"Got unsupported ScalarType {str(dtype).replace('torch.', '').capitalize()}")
    return np.dtype(names[dtype])
_RANDOM_ = torch.Tensor.random_
# reads of a sparse tensor's nonzeros: a fake sparse tensor reports 0 of them
_SPARSE_READS = frozenset(TENSOR_PRIVATE_SPARSE_READS + tuple(getattr(torch.Tensor, n) for n in (
    "values", "indices", "coalesce", "crow_indices", "col_indices", "ccol_indices", "row_indices")
    if hasattr(torch.Tensor, n)))
# what a stand-in cannot show: its address, a sparse tensor's nonzeros, its values printed
_HOST_LOOKS = frozenset([_DATA_PTR, _REPR, _FORMAT]) | _SPARSE_READS
# reads of a whole tensor's values into Python or numpy: of a CPU tensor they touch its memory
# without an op the dispatch sees (tolist) or over the stand-in's (numpy: aten.detach)
_VALUE_READS = frozenset([torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__])
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
# calls whose result leaves the autograd graph: make_fx may record them as plain aliases
# (torch 2.14 records x.detach() as aten.alias), which a graph run under autograd would
# differentiate through; their nodes are marked like no_grad blocks (_tagging_no_grad)
_DETACHES = frozenset([torch.Tensor.detach, torch.detach, torch.Tensor.detach_, _DATA_SET.__get__])


class _AsIs:
    """An output leaf that is a real tensor the function returned unchanged (see _trace.trace)."""

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
_AUTOGRAD_FACTS = (_IS_LEAF_ATTR, _GRAD_FN_ATTR, _VERSION_ATTR)
_BIT_READS = {TensorBase.is_conj: 0, TensorBase.is_neg: 1, TensorBase.is_inference: 2}
# the code of Optimizer.zero_grad and Module.zero_grad (under torch's decorators): a .grad
# read made from there is zero_grad's (see _FnWatch._zero_grad_reads)
_ZERO_GRADS = frozenset(inspect.unwrap(f).__code__ for f in (torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad))
# While tracing, recurrent modules do not re-pack their weights. A module's parameters are
# stand-ins during a trace, so nn.LSTM sees its weights changed and, on CUDA,
# flatten_parameters packs them into one cuDNN buffer by swapping their storages
# (_cudnn_rnn_flatten_weight): not an operation a graph can hold, and its data_ptr() reads
# are a placeholder's. The modes of the trace answer its question `fw.is_cuda` with False,
# so it returns at once, as it does for CPU weights; unpacked weights are what cuDNN copies
# into its buffer inside the recorded op (see _cudnn_rnn). The modes are the tracing
# thread's only: another thread's eager LSTM packs its weights as ever.
_FLATTEN = torch.nn.modules.rnn.RNNBase.flatten_parameters.__code__
_IS_CUDA_ATTR = TensorBase.__dict__["is_cuda"]


def _is_cuda_get(func: Any) -> bool:
    return getattr(func, "__self__", None) is _IS_CUDA_ATTR and getattr(func, "__name__", "") == "__get__"


def _caller() -> Any:
    """The frame of the code whose tensor call a mode's ``__torch_function__`` (the caller of this) sees.

    Past other modes' ``__torch_function__`` frames: a mode entered inside the function
    (``with torch.device(...)``) handles the call first and makes it again from its own frame.
    """
    f = sys._getframe(2)
    while f.f_back is not None and (f.f_code.co_name == "__torch_function__" or f.f_code.co_filename == _OVERRIDES):
        f = f.f_back
    return f


_OVERRIDES = sys.modules["torch.overrides"].__file__


def _called_from_library(frame: Any) -> bool:
    """Whether ``frame`` (the code that made a call) is torch's or a library's, not the user's."""
    fn = frame.f_code.co_filename if frame is not None else ""
    lib = _LIB_CACHE.get(fn)
    if lib is None:
        lib = _LIB_CACHE[fn] = is_library_file(fn)
    return lib


_LAYOUT_READS = frozenset(
    [getattr(TensorBase, n) for n in ("storage_offset", "as_strided", "as_strided_", "as_strided_scatter")
     if hasattr(TensorBase, n)]
    + [getattr(torch, n) for n in ("as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter")
       if hasattr(torch, n)]
)


class _FnWatch(TorchFunctionMode):
    """Watches the Python-level tensor calls of the trace that dispatch cannot see.

    ``x.data = ...`` on an input (eager swaps the caller's tensor's data; a
    recording cannot), and ``storage_offset()`` / ``as_strided`` on an input
    whose layout a static buffer does not keep (an offset view, a strided view).
    """

    def __init__(self, watch: _Watch, storages: Dict[Any, int], n_in: int, plain: Sequence[bool],
                 grads: Sequence[bool] = (), histories: Sequence[Any] = (), bits: Sequence[Tuple[bool, ...]] = ()):
        super().__init__()
        self.watch = watch
        self.storages = storages
        self.n_in = n_in
        self.plain = plain
        self.grads = grads
        self.histories = histories  # per input, the caller's grad_fn (None for a leaf)
        # per input, the caller's conjugate, negative and inference bits (part of the key; the
        # stand-in has none): what `x.is_conj()` reads while tracing
        self.bits = bits
        # inputs whose leafness the function read (is_leaf, grad_fn): input -> had history
        self.leaf_read: Dict[int, bool] = {}
        self.layout_used: Set[int] = set()
        self.grad_read: Set[int] = set()
        self.hooks: List[str] = []
        self.real_hooks: List[Any] = []  # handles of hooks put on real tensors (state) while tracing
        self.backward_calls = 0  # .backward(), torch.autograd.backward/grad called by the function
        self.backward_end = 0  # the op count when the last one returned
        self.sdpa = False  # whether it called scaled_dot_product_attention
        self.backward_at = ""  # where the last one was called (file:line)
        self.first_backward_at = ""  # and the first
        self.for_grad = bool(getattr(FOR_GRAD, "on", False))
        self.inputs: Sequence[Any] = ()  # the trace's input tensors (set by the traced function)
        self.printed = False  # a tensor printed inside (warned once per trace)
        # state tensors whose .grad the function set to None (zero_grad(), `p.grad = None`)
        self.grad_cleared: Dict[int, torch.Tensor] = {}
        # state tensors whose .grad the function reads before it sets it to None (an optimizer's
        # step before its zero_grad(): a .grad there at call time is read), by id
        self.grad_read_first: Dict[int, torch.Tensor] = {}
        self._grad_seen: Set[int] = set()

    def _input(self, t: Any) -> Optional[int]:
        if not isinstance(t, FakeTensor):
            return None
        idx = self.storages.get(StorageWeakRef(t.untyped_storage()))
        return idx if idx is not None and idx < self.n_in else None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _FORMAT and len(args) > 1 and args[1] and isinstance(args[0], torch.Tensor) and args[0].dim() == 0:
            # f"{t:.3f}": eager formats t.item(), a host read (frozen where t is unchanged)
            return format(self.watch._swap(args[0]).item(), args[1])
        if args and isinstance(args[0], FakeTensor) and func in _HOST_LOOKS:
            self._host_look(func, args)
        if func in _VALUE_READS and args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], FakeTensor):
            return self._value_read(func, args[0], args[1:], kwargs)
        if func is _RANDOM_ and isinstance(args[0] if args else None, FakeTensor):
            lo_hi = list(args[1:]) + [kwargs[k] for k in ("from", "to") if k in kwargs]
            if len(lo_hi) == 2 and lo_hi[1] is not None:
                # Tensor.random_(low, high): its overload, aten.random_.from, is named after a
                # Python keyword and torch.fx cannot write it; torch.randint draws the same
                # numbers from the same generator (it is empty(...).random_(low, high))
                t = args[0]
                r = torch.randint(int(lo_hi[0]), int(lo_hi[1]), tuple(t.shape), dtype=t.dtype,
                                  device=t.device, generator=kwargs.get("generator"))
                return t.copy_(r)
        if func is _SDPA:
            self.sdpa = True  # (its kernel is picked by the backend flags: part of the signature)
        if func in _BACKWARDS:
            self.backward_calls += 1
            self.backward_at = format_frame(user_frame(traceback.extract_stack()))
            if not self.first_backward_at:
                self.first_backward_at = self.backward_at
            out = self._call(func, args, kwargs)
            self.backward_end = self.watch.ops  # (tensors made after it: see Plan.after_backward)
            return out
        if (func is _REGISTER_HOOK or getattr(func, "__wrapped__", None) is _REGISTER_HOOK) and args:
            self.hooks.append(format_frame(user_frame(traceback.extract_stack())))
            if self.for_grad and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
                # under torch.func.grad the tensor requires grad in eager; the trace's
                # stand-in does not: the hook acts in the backward, which the joint
                # trace of the function makes (see _partition.py)
                return _NoHandle()
        if func in _HOOK_REGISTRATIONS and args and isinstance(args[0], torch.Tensor) \
                and not isinstance(args[0], FakeTensor):
            # a hook put on a tensor of state (a parameter) while tracing: taken off after the
            # trace, with the Python values it restores (a module's "hooked" flag), so that the
            # eager first call registers it once, as eager does
            handle = self._call(func, args, kwargs)
            self.real_hooks.append(handle)
            return handle
        if args and func in _BIT_READS:
            idx = self._input(args[0])
            if idx is not None and args[0] is self.inputs[idx] and idx < len(self.bits):
                return self.bits[idx][_BIT_READS[func]]
        if args and getattr(func, "__name__", "") == "__get__" and getattr(func, "__self__", None) in _AUTOGRAD_FACTS:
            return self._autograd_fact(func.__self__, args[0], func)
        if args and getattr(func, "__self__", None) is _GRAD_ATTR and getattr(func, "__name__", "") == "__get__":
            self._grad_read(args[0])
        if (len(args) > 1 and args[1] is None and getattr(func, "__self__", None) is _GRAD_ATTR
                and getattr(func, "__name__", "") == "__set__" and isinstance(args[0], torch.Tensor)
                and not isinstance(args[0], FakeTensor)):
            self.grad_cleared[id(args[0])] = args[0]
            self._grad_seen.add(id(args[0]))  # (set before any read: a .grad there at call time is not read)
        if args and getattr(func, "__self__", None) is _DATA_SET and getattr(func, "__name__", "") == "__set__":
            self._data_set(args[0])
        if args and func in _LAYOUT_READS:
            self._layout_read(func, args[0])
        if _is_cuda_get(func) and _caller().f_code is _FLATTEN:
            return False  # (see _FLATTEN)
        if func in _cudnn_rnn.FUNCS and not kwargs and _cudnn_rnn.applies(func, args):
            fail = self.watch._fail
            return self._call(lambda *a: _cudnn_rnn.call(func, a, fail), args, kwargs)
        out = kwargs.get("out")
        if out is not None:
            return self._call_out(func, args, kwargs, out)
        return self._call(func, args, kwargs)

    def _value_read(self, func: Any, t: torch.Tensor, rest: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """``t.tolist()``, ``t.numpy()``, ``np.asarray(t)`` of a tensor in state: element reads of its stand-in.

        Each element is a host read (``aten._local_scalar_dense``), frozen and guarded where
        the tensor is unchanged (or refused as the call's data), as ``.item()`` is; the array
        handed back is a read-only copy (a write into it could not reach the state).
        """
        values = self.watch._swap(t).tolist()
        if func is torch.Tensor.tolist:
            return values
        import numpy as np

        arr = np.array(values, dtype=_numpy_dtype(t.dtype))
        asked = (rest[0] if rest else kwargs.get("dtype")) if func is torch.Tensor.__array__ else None  # __array__(dtype)
        if asked is not None:
            arr = arr.astype(asked)
        arr.flags.writeable = False
        return arr

    def _host_look(self, func: Any, args: Sequence[Any]) -> None:
        """A read of what a stand-in cannot show (its address, a sparse tensor's nonzeros, its printed values)."""
        if func is _DATA_PTR:
            self.watch._fail(
                "the function reads a tensor's memory address (data_ptr()).",
                "graphify traces with fake tensors, which have no memory (their address reads 0); a "
                "comparison or a value built from it would be frozen into the recording.",
                "compare tensors by identity (a is b) or with torch ops, or move this part out of the "
                "graphified function.",
            )
        if func in _SPARSE_READS and args[0].layout != torch.strided:
            name = getattr(func, "__name__", str(func))
            self.watch._fail(
                f"the function reads the nonzeros of a sparse tensor ({name}()), whose number depends "
                "on the data.",
                "graphify traces with fake tensors, whose sparse stand-ins have no data: they report "
                "0 nonzeros, which would be frozen into the recording (SparseAdam then skips its "
                "update; values().numel() reads 0).",
                "keep sparse tensors out of the graphified function: compute densely (a dense mask "
                "and torch.where), or, for nn.Embedding(sparse=True) with SparseAdam, use "
                "sparse=False with a dense optimizer (Adam(fused=True)), or keep opt.step() outside.",
            )
        if func is _REPR and not self.printed:
            # print(t) inside: eager prints the values on every call; the trace prints a
            # placeholder once and a replay nothing (as jax.jit prints its tracers)
            self.printed = True
            fr = user_frame(traceback.extract_stack())
            warnings.warn_explicit(
                f"{self.watch.desc}: the function prints a tensor (print / repr / str): it shows a "
                "placeholder while tracing, and nothing on later calls (a replay runs no Python). "
                "Return the value and print it outside the graphified function.",
                PrintWarning,
                getattr(fr, "filename", "<unknown>") or "<unknown>",
                getattr(fr, "lineno", 0) or 0,
            )
        if func is _FORMAT and len(args) > 1 and args[1]:
            self.watch._fail(
                f"formatting a tensor with a format spec (f\"{{t:{args[1]}}}\") reads its value on the host.",
                "a recording is traced once without real data and replayed without Python; a value "
                "read on the host would be the same (or nothing) on every call.",
                "return the tensor and format it outside the graphified function (printing a value "
                "needs it on the host, a sync eager pays too).",
            )

    def _grad_read(self, t: Any) -> None:
        """``t.grad`` read: zero_grad's reads noted; an input's refused where it has one, else keyed on staying None."""
        caller = _caller()
        if caller.f_code in _ZERO_GRADS:
            self._zero_grad_reads(t, caller)
        elif isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and id(t) not in self._grad_seen:
            self.grad_read_first[id(t)] = t
        if isinstance(t, torch.Tensor):
            self._grad_seen.add(id(t))
        idx = self._input(t)
        if idx is not None and t is self.inputs[idx]:
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

    def _layout_read(self, func: Any, t: Any) -> None:
        """An input's memory layout read (storage_offset, data_ptr of a view...): refused unless it is plain, else keyed."""
        idx = self._input(t)
        if idx is not None:
            w = self.watch
            path = w.paths[idx]
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

    def _call_out(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> Any:
        """A call with ``out=`` tensors made in the trace, which must be written.

        Some composite ops take another branch under a dispatch mode, and that branch
        forgets ``out`` (``torch.linalg.matrix_rank(A, out=r)`` computes the rank and leaves
        ``r`` as it was, under any TorchDispatchMode): no write reaches the trace. Their
        version counters tell; the result is then computed without ``out`` and copied into
        it, as eager's branch does.
        """
        outs = _tensors_in(out)
        if not outs or not all(isinstance(t, FakeTensor) for t in outs):
            return self._call(func, args, kwargs)
        before = [t._version for t in outs]
        res = self._call(func, args, kwargs)
        if all(t._version != v for t, v in zip(outs, before)):
            return res
        fresh = self._call(func, args, {k: v for k, v in kwargs.items() if k != "out"})
        got = _tensors_in(fresh)
        if len(got) != len(outs):
            return res  # (not a result to copy: leave it as torch made it)
        for o, r in zip(outs, got):
            if o.shape != r.shape:
                o.resize_(r.shape)
            o.copy_(r)
        if res is None or isinstance(out, torch.Tensor):
            return res if res is None else out  # (ops writing a list of outs return nothing)
        return type(fresh)(tuple(outs)) if isinstance(fresh, tuple) and hasattr(type(fresh), "n_fields") else tuple(outs)

    def _autograd_fact(self, attr: Any, t: Any, func: Any) -> Any:
        """``x.is_leaf``, ``x.grad_fn`` or ``x._version`` of an input (or state), as eager sees them.

        An input with autograd history is traced as a leaf: its leafness and grad_fn are the
        caller's (and part of the signature from then on). Its version counter counts the
        writes made to it before the call, which change from call to call: a value the
        user's code reads is refused (torch's own reads, checkpoint's check of saved
        values, are of the trace's tensors and stay as they are).
        """
        idx = self._input(t)
        if attr is _VERSION_ATTR:
            real = idx is not None or (isinstance(t, FakeTensor) and self.storages.get(
                StorageWeakRef(t.untyped_storage()), -1) >= self.n_in)
            if real and not _called_from_library(sys._getframe(2)):
                name = self.watch.paths[idx] if idx is not None else "a tensor in state"
                self.watch._fail(
                    f"the function reads {name}._version, the count of in-place writes made to it.",
                    "that count grows from call to call (and differs between the caller's tensor and "
                    "the recording's), so a value read from it while tracing would be frozen into the "
                    "recording.",
                    "keep a counter of your own as a tensor (updated in place inside the function), or "
                    "read _version outside the graphified function and pass what it decides as a "
                    "static argument.",
                )
            return func(t)
        if idx is None or t is not self.inputs[idx] or idx >= len(self.histories):
            return func(t)
        hist = self.histories[idx]
        self.leaf_read[idx] = hist is not None
        if attr is _IS_LEAF_ATTR:
            return hist is None
        return hist

    def _zero_grad_reads(self, t: Any, frame: Any) -> None:
        """``zero_grad()`` reads ``t.grad``: note ``t`` as a parameter whose ``.grad`` eager leaves None.

        ``Optimizer.zero_grad()`` / ``Module.zero_grad()`` set ``.grad`` to None only where
        there is one: a parameter whose ``.grad`` is None while tracing shows no write.
        Eager leaves it None after every call whatever the caller put there, so the trace
        notes every parameter they cover (the ``p.grad = None`` they run is seen below too).
        """
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and frame.f_locals.get("set_to_none", True):
            self.grad_cleared[id(t)] = t

    def _data_set(self, t: Any) -> None:
        """Refuse ``t.data = ...`` on an input or on state (eager swaps that tensor's storage)."""
        w = self.watch
        idx = self._input(t)
        if idx is not None:
            path = w.paths[idx]
            w._fail(
                f"`{path}.data = ...` replaces the data of input {path}.",
                "eager swaps the caller's tensor's storage; a recording reads and writes fixed "
                "memory and cannot replace the caller's storage.",
                f"update it in place instead (e.g. {path}.clamp_(-0.5, 0.5), or "
                f"{path}.copy_(new_value)), or return the new tensor.",
            )
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            # state (a parameter, a buffer, a closed-over tensor): the trace would leave the
            # real tensor over a placeholder without memory
            name = w.index.name_of(t, len(w.state))
            w._fail(
                f"`{name}.data = ...` replaces the data of {name}, state the function reaches "
                "(e.g. a parameter or buffer; torch.nn.utils.vector_to_parameters does this too).",
                "a recording reads and writes the state's memory in place on every call; replacing "
                "its storage cannot be replayed.",
                f"update it in place instead: `{name}.data.copy_(new_value)` (e.g. "
                f"`{name}.data.copy_(torch.renorm(...))`, or `with torch.no_grad(): "
                f"{name}.copy_(new_value)`), or make the replacement outside the graphified function.",
            )

    @staticmethod
    def _call(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        if not torch.is_grad_enabled() or func in _DETACHES:
            return _tagging_no_grad(func, args, kwargs)
        return func(*args, **kwargs)


class _RnnScope(TorchFunctionMode):
    """Routes cuDNN recurrent layers as :class:`_FnWatch` does (see ``_cudnn_rnn``).

    For traces that run without a :class:`_FnWatch` (the joint trace of ``_partition``).
    """

    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda_get(func) and _caller().f_code is _FLATTEN:
            return False  # (see _FLATTEN)
        if func in _cudnn_rnn.FUNCS and not kwargs and _cudnn_rnn.applies(func, args):
            return _cudnn_rnn.call(func, args, self.watch._fail)
        return func(*args, **kwargs)


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


TENSOR_ATTR = object()  # a tensor-valued attribute of an input (see _key._parts.tensor_attrs)


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


_SEED_MSG = (
    "Why: a recording draws fresh random numbers on every replay from the generator's "
    "current state; seeding inside the function happens once, while tracing, so eager "
    "would draw the same numbers on every call and the recording different ones.\n"
    "Fix: seed outside the function (torch.manual_seed before the call); for the same numbers "
    "on every call, as the seed gives eager, draw them once outside and close over the tensor "
    "(noise = torch.randn(..., generator=torch.Generator().manual_seed(0))); for a stream of its "
    "own, pass a torch.Generator as an argument (generator=g in the random ops)."
)
_SEEDING = threading.local()  # .desc: the description of the trace this thread runs under _no_seeding
_SEEDED_ELSEWHERE = [0]  # seeding calls made, while a trace ran, by code that was not traced


def seed_refusal(orig: Any, name: str) -> Any:
    """What ``torch.<name>()`` (``manual_seed``, ``cuda.seed_all``...) does while a trace runs.

    Installed by ``_patches`` (in every thread: see :class:`_no_seeding`): a GraphifyError
    inside a :class:`_no_seeding` block of this thread, the original function elsewhere.
    """
    def seeding(*a: Any, **k: Any) -> Any:
        if not tracing():
            _SEEDED_ELSEWHERE[0] += 1
            return orig(*a, **k)
        desc = getattr(_SEEDING, "desc", None)
        if desc is None:  # (a joint trace, autograd's thread: left to _no_seeding's check)
            return orig(*a, **k)
        ledgers = _watches()
        if ledgers and name in _MANUAL_SEEDS:
            # a generator set to a state of its own, as set_rng_state does (see rng_setter): fine
            # where the function puts the state it saved back before drawing (fork_rng around
            # code that seeds), refused at its next draw or at the end otherwise (_RngLedger)
            keys = _seeded_keys(name)
            for led in ledgers:
                for key in keys:
                    led.set(key, object(), f"torch.{name}()")
            return torch.default_generator if name == "manual_seed" else None
        fr = user_frame(traceback.extract_stack())
        raise GraphifyError(
            f"{desc}: torch.{name}() seeds a default random generator inside the function.\n"
            f"  at {format_frame(fr)}\n{_SEED_MSG}"
        )

    return seeding


_SEEDS = "manual_seed("  # (in a ledger entry's `what`: the state set is a seed's)
_MANUAL_SEEDS = ("manual_seed", "cuda.manual_seed", "cuda.manual_seed_all")


def _seeded_keys(name: str) -> List[str]:
    """The ledger keys of the default generators ``torch.<name>(seed)`` seeds."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if name == "cuda.manual_seed":
        return [_cuda_key()] if cuda else []
    keys = [] if name == "cuda.manual_seed_all" else ["cpu"]
    return keys + ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else [])


class _no_seeding:
    """Seeding a default generator inside the traced function is a GraphifyError.

    ``torch.manual_seed`` and its relatives refuse in this thread while it is
    entered (see :func:`seed_refusal`); a generator reseeded directly (a C method) is
    found on exit by its changed initial seed. Unless code that is not traced (another
    thread) seeded meanwhile: its seed is then neither judged nor undone (a reseed through
    the generator object in another thread cannot be told apart from the function's).
    """

    def __init__(self, desc: str):
        self.desc = desc

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
        self.outer = getattr(_SEEDING, "desc", None)
        self.elsewhere = _SEEDED_ELSEWHERE[0]
        _SEEDING.desc = self.desc
        return self

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        # (the generators' state is not compared: other threads may draw meanwhile)
        _SEEDING.desc = self.outer
        gens = self._generators()
        if _SEEDED_ELSEWHERE[0] != self.elsewhere:
            return
        if len(gens) == len(self.seeds) and any(g.initial_seed() != s for g, s in zip(gens, self.seeds)):
            for g, st in zip(gens, self.states):
                g.set_state(st)
            if typ is None:
                raise GraphifyError(
                    f"{self.desc}: the function reseeds a default random generator directly "
                    "(e.g. torch.default_generator.manual_seed(...)) while tracing.\n"
                    f"{_SEED_MSG}"
                )


# -- the generators' states set inside the function ---------------------------------------
#
# The random ops of a recording draw, on every replay, from where each default generator
# stands. Eager code may move a generator itself: torch.set_rng_state(s), fork_rng putting
# back the state it saved, torch.utils.checkpoint's recompute (preserve_rng_state=True),
# which replays the forward's dropout masks. Such a set happens once, on the host, while
# tracing. The ledger follows where each generator stands in the function's sequence of
# draws: a state got inside the function is tagged with the number of draws made from its
# generator so far; setting it back is harmless where no draw came in between (fork_rng
# around deterministic code, checkpoint of a module without dropout), and otherwise the
# next draw from that generator, or the end of the function, is a GraphifyError. (A state
# set through the generator object itself, Generator.set_state, is a C method that cannot
# be routed; _no_seeding sees it where it changes the generator's seed.) The functions
# torch.get_rng_state / set_rng_state and torch.cuda's are routed to rng_getter and
# rng_setter in the tracing thread (see _patches); their code, not their names, so that
# set_rng_state_all and fork_rng, which reach them by module-level names, are covered too.

_RNG_FIX = (
    "Fix: set dropout to 0 in the checkpointed blocks (or turn checkpointing off), or draw "
    "the random numbers outside the graphified function and pass them in (instead of setting the "
    "generator back inside it), or call the function eagerly: each gives eager's numbers. Also "
    "recorded, but not eager's numbers: preserve_rng_state=False to torch.utils.checkpoint (Hugging Face models: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False, "
    "\"preserve_rng_state\": False})) records, but its recompute then draws new dropout masks, so the "
    "backward differs from the forward's, as it would in eager with that flag."
)
_RNG_FIX_SET = (
    "Fix: draw the random numbers outside the graphified function and pass them in (e.g. a "
    "mask drawn once and used twice), set the generator's state outside it, between calls, or "
    "call the function eagerly."
)


def _rng_fix(what: str) -> str:
    """The fix for a generator set back by ``what`` (a checkpoint's recompute, or the user's call)."""
    return _RNG_FIX if "checkpoint" in what else _RNG_FIX_SET


def _cuda_key(device: Any = "cuda") -> str:
    if isinstance(device, str):
        device = torch.device(device)
    idx = device if isinstance(device, int) else getattr(device, "index", None)
    if idx is None:
        idx = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    return f"cuda:{idx}"


def _gen_name(key: str) -> str:
    return "CPU" if key == "cpu" else f"CUDA ({key})"


def _key_of_generator(gen: torch.Generator) -> Optional[str]:
    """The default generator ``gen`` is, or None for a generator of the caller's."""
    if gen is torch.default_generator:
        return "cpu"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, g in enumerate(torch.cuda.default_generators):
            if gen is g:
                return f"cuda:{i}"
    return None


def _who_sets(name: str) -> str:
    """How the function set a generator's state: the library call in the stack, or ``name``."""
    f: Any = sys._getframe(2)
    fork = False
    while f is not None:
        fn = f.f_code.co_filename.replace("\\", "/")
        if fn.endswith("torch/utils/checkpoint.py"):
            return "torch.utils.checkpoint's recompute (preserve_rng_state=True)"
        if fn.endswith("torch/random.py") and f.f_code.co_name == "fork_rng":
            fork = True
        f = f.f_back
    return "torch.random.fork_rng() (putting back the state it saved)" if fork else f"{name}()"


class _RngLedger:
    """Where each default generator stands in the function's sequence of random draws.

    ``draws[key]`` counts the trace's random ops that draw from generator ``key``
    (``"cpu"``, ``"cuda:0"``): each one draws in the recording from where the previous
    one left the generator, as eager does while nothing moves it. ``off[key]`` is there
    while the function has set that generator to a state the recording cannot stand
    for: the draw count the state was got at (``None``: a state from elsewhere), what
    set it and the user's line.
    """

    def __init__(self, desc: str):
        self.desc = desc
        self.thread = threading.get_ident()  # the tracing thread (a CUDA backward runs on another)
        self.draws: Dict[str, int] = {}
        self.off: Dict[str, Tuple[Optional[int], str, str]] = {}
        self.saved: Dict[int, Tuple[Any, str, Optional[int]]] = {}  # id(state) -> (state, key, tag)

    def _at(self, key: str) -> Optional[int]:
        off = self.off.get(key)
        return off[0] if off is not None else self.draws.get(key, 0)

    def got(self, key: str, state: Any) -> None:
        self.saved[id(state)] = (state, key, self._at(key))  # (kept alive: ids stay unique)

    def set(self, key: str, state: Any, what: str) -> None:
        n = self.draws.get(key, 0)
        entry = self.saved.get(id(state))
        # a state from elsewhere (saved before the call, or through Generator.get_state) is
        # set on every eager call, whatever it equals while tracing
        tag = entry[2] if entry is not None and entry[0] is state and entry[1] == key else None
        if tag == n:
            self.off.pop(key, None)
        else:
            self.off[key] = (tag, what, self._where())

    def _where(self) -> str:
        """The user's line, ``file:line`` and source.

        Found in this thread, or in the tracing thread, which waits in the user's
        ``.backward()`` while autograd's CUDA worker thread runs the backward.
        """
        fr = user_frame(traceback.extract_stack())
        if fr is None and threading.get_ident() != self.thread:
            frame = sys._current_frames().get(self.thread)
            if frame is not None:
                fr = user_frame(traceback.extract_stack(frame))
        return format_frame(fr)

    def _back_to(self, key: str, tag: Optional[int]) -> str:
        if tag is None:
            return "a state the function did not save from it during this call"
        n = self.draws.get(key, 0) - tag
        return f"a state from before {n} random draw{'s' if n != 1 else ''} the function made from it"

    def drew(self, func: Any, gen: Any, out: Any) -> None:
        if isinstance(gen, torch.Generator):
            key = _key_of_generator(gen)
        else:
            t = next(iter(_tensors_in(out)), None)
            dev = t.device if t is not None else None
            key = "cpu" if dev is None or dev.type == "cpu" else f"cuda:{dev.index or 0}" if dev.type == "cuda" else None
        if key is None:
            return
        off = self.off.get(key)
        if off is not None:
            tag, what, site = off
            at = self._where()
            where = f"  at {at}\n" + (f"  state set at {site}\n" if site != at else "")
            if _SEEDS in what:
                raise GraphifyError(
                    f"{self.desc}: {what} seeds a default random generator inside the function (the "
                    f"{_gen_name(key)} one), and {func} then draws from it.\n{where}{_SEED_MSG}")
            raise GraphifyError(
                f"{self.desc}: {func} draws random numbers from the {_gen_name(key)} generator after "
                f"{what} set that generator back to {self._back_to(key, tag)}.\n"
                f"{where}"
                "Why: a recording draws fresh numbers from the generator's current state on every "
                "replay; a state set inside the function happens once, while tracing. Eager draws "
                "again here the numbers it drew before (a checkpoint's recompute repeats the forward's "
                "dropout mask), the recording new ones: the numbers, and the gradients made from "
                f"them, would differ from eager's.\n{_rng_fix(what)}"
            )
        self.draws[key] = self.draws.get(key, 0) + 1

    def check_end(self) -> None:
        """The function returns with a generator set back: eager repeats numbers on every call."""
        if self.off:
            key, (tag, what, site) = next(iter(self.off.items()))
            if _SEEDS in what:
                raise GraphifyError(
                    f"{self.desc}: {what} seeds a default random generator inside the function (the "
                    f"{_gen_name(key)} one) and leaves it seeded.\n  at {site}\n{_SEED_MSG}")
            raise GraphifyError(
                f"{self.desc}: {what} sets the {_gen_name(key)} random generator back to "
                f"{self._back_to(key, tag)}, and the function leaves it there.\n  at {site}\n"
                "Why: a recording draws fresh numbers from the generator's current state on every "
                "replay; a state set inside the function happens once, while tracing. Eager sets "
                "the generator back on every call, so the same random numbers come again (in the "
                "next call, or after it), while the recording draws new ones and leaves the "
                f"generator where they move it.\n{_rng_fix(what)}"
            )


def _watches() -> List[_RngLedger]:
    """The ledgers of the traces this thread (or its autograd engine's) runs inside."""
    return [m.rng for m in _get_current_dispatch_mode_stack() if isinstance(m, _Watch)]


def _from_us() -> bool:
    """Whether the state function routed to the replacement that asks was called by gtransform itself.

    (Frames: this one, the replacement, the routed function (``_patches``), its caller.)
    """
    return sys._getframe(3).f_code.co_filename.startswith(_PKG_DIR + os.sep)


def rng_getter(orig: Any, kind: str) -> Any:
    """What ``torch.get_rng_state`` (``kind="cpu"``) or ``torch.cuda.get_rng_state`` does while tracing.

    Installed by ``_patches`` (for tracing threads only); ``orig`` is the original function.
    """
    def get_rng_state(*a: Any, **k: Any) -> Any:
        ledgers = _watches()
        if not ledgers or _from_us():
            return orig(*a, **k)
        # a host-side copy of the generator's state, not part of the computation: made
        # outside the trace (a CPU tensor inside a CUDA function's trace is refused)
        with _disable_current_modes():
            state = orig(*a, **k)
        key = "cpu" if kind == "cpu" else _cuda_key(*a, **k)
        for led in ledgers:
            led.got(key, state)
        return state

    return get_rng_state


def rng_setter(orig: Any, kind: str, name: str) -> Any:
    """What ``torch.set_rng_state`` or ``torch.cuda.set_rng_state`` (``name``) does while tracing."""
    def set_rng_state(new_state: Any, *a: Any, **k: Any) -> Any:
        ledgers = _watches()
        if not ledgers or _from_us():
            return orig(new_state, *a, **k)
        key = "cpu" if kind == "cpu" else _cuda_key(*a, **k)
        what = _who_sets(name)
        for led in ledgers:
            led.set(key, new_state, what)
        # not applied to the generator: the recording draws from where it stands, and a
        # refused trace leaves it as it was (where the ledger accepts the function, the
        # state set is the one the generator has)
        return None

    return set_rng_state


def drop_history(tensors: Sequence[torch.Tensor]) -> None:
    """Take off the autograd history a trace gave state tensors (see ``_Watch.no_history``).

    A view cannot be detached in place; writes that would give one history are refused
    while tracing (``_Watch._no_history_on_views``).
    """
    for t in tensors:
        if t.grad_fn is not None and not t._is_view():  # (a leaf the function made require grad stays)
            t.detach_()


def _rng_routes() -> List[Any]:
    """The RNG state functions and the seeding functions, routed while any trace runs (see ``_patches``)."""
    import torch.cuda.random as cuda_random

    out: List[Any] = []
    for mod, name, kind, label in ((torch.random, "get_rng_state", "cpu", "torch.get_rng_state"),
                                   (torch.random, "set_rng_state", "cpu", "torch.set_rng_state"),
                                   (cuda_random, "get_rng_state", "cuda", "torch.cuda.get_rng_state"),
                                   (cuda_random, "set_rng_state", "cuda", "torch.cuda.set_rng_state")):
        top = torch if kind == "cpu" else torch.cuda
        make = (functools.partial(rng_getter, kind=kind) if name.startswith("get")
                else functools.partial(rng_setter, kind=kind, name=label))
        out.append(Route([(mod, name), (top, name)], make))
    for mod, top, prefix, names in ((torch.random, torch, "", ("manual_seed", "seed")),
                                    (cuda_random, torch.cuda, "cuda.", ("manual_seed", "manual_seed_all", "seed",
                                                                        "seed_all"))):
        for name in names:
            # (in every thread: a seed set by another thread is not to be judged by the trace's check)
            out.append(Route([(mod, name), (top, name)], functools.partial(seed_refusal, name=prefix + name),
                             when=lambda: True))
    return out


add_shared(_rng_routes)

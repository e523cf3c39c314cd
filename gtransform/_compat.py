"""Every private torch name gtransform uses, in one place, with the torch versions it was checked on.

The rule: no other module of gtransform names a private torch attribute (``torch._C...``,
``torch._dynamo...``, ``torch.utils._pytree``, ``torch.ops.aten._to_copy``,
``getattr(torch..., "_x")``); it imports the name from here (``from ._compat import ...``;
``gtransform.fuse`` from ``.._compat``). A new one is added here, grouped by area, with what it
is for, the torch versions it was checked on and its fallback where torch may lack it;
``tests/test_compat.py`` checks both (no private torch name elsewhere; each name here present in
the installed torch, or one of :data:`OPTIONAL`).

How a name is bound here keeps what the code did before it moved here:

* a name read when gtransform is imported is read when this module is, with the same fallback
  (``getattr(..., None)``, a stand-in, ``try``/``except``) or none (the import fails without it);
* a name read only when used, from a module that ``import torch`` or gtransform's import loads
  anyway, is bound at import with ``getattr(..., None)``: a torch without it still imports
  gtransform, and the use fails there, as it did (calling ``None``);
* a name of a module gtransform imports only on first use (dynamo, inductor, the partitioner,
  ``torch.distributed``'s internals, a few ops looked up on first use) is looked up by a
  ``load_*`` / ``aten_*`` function here when that use comes: they stay lazy, and an
  ``ImportError`` reaches the caller's handling as before;
* state torch rebinds at run time (parametrize's cache, the global hook dicts) is read by a
  function here at each use, as before.

Modules bind the names as their own globals at import (``from ._compat import
peek_interpreter_stack as _peek_functorch``): the per-call paths (``Graphified.__call__``, the
generated fast paths and their namespaces, ``_liveness``, a recording's replay) read a global, as
they did; nothing here is called on them.

Versions: "2.11 (GPU image; run by the GPU suite)": the name was in use before it moved here, and
the GPU suite runs on that image's torch (2.11); nothing beyond that is claimed for 2.11. "2.13.0":
the CI torch (this machine's venv, a CPU build). "2.14.1": checked by importing this module under
torch 2.14.1 (a CUDA 13.0 build) and reading every name, loaders called. A CUDA-only name is
``None`` on a CPU build (:data:`OPTIONAL` says which).

Private attributes of objects stay where they are read (they are the objects' own, not names
to import); gtransform reads these:

* ``nn.Module``: ``_parameters``, ``_buffers``, ``_modules`` (``_state``: the state a trace reaches,
  snapshots, the dict names skipped in ``__dict__``; ``_key/_environment``: the environment key),
  ``_forward_hooks``, ``_forward_pre_hooks`` (``_state``: hooks' closures; ``_key/_environment``;
  ``_lookup``: parametrization hooks, ``getattr`` with a default), ``_backward_hooks``,
  ``_backward_pre_hooks`` (``_key/_environment``; ``_trace``: modules with backward hooks).
* Tensor: ``_backward_hooks`` (``_liveness``: outputs given autograd state; ``_patches``:
  ``muted_hooks``; ``_state``: parameters' hook dicts), ``_post_accumulate_grad_hooks``
  (``_state``), ``_is_view()`` (``_watch``), ``_version`` (``_watch``: outputs written in place;
  ``_record``: the version kept across a take-back).
* UntypedStorage: ``_cdata`` (``_key/_parts``: storages shared between arguments; ``_liveness``:
  a pinned pool's storages).
* Optimizer: ``_optimizer_step_pre_hooks``, ``_optimizer_step_post_hooks``
  (``_key/_environment``).
* OpOverload: ``_schema`` (``_watch``, ``_distributed``, ``_record``, ``_rewrite``,
  ``fuse/_gemv``); OpOverloadPacket: ``_qualified_op_name`` (``_trace``: sparse makers).
* torch.fx: ``Graph._root``, ``Node._prev``, ``Node._next`` (``_watch``: the nodes an op
  recorded, for their source lines).
* ``torch.fx.experimental.symbolic_shapes.SymNode``: ``_expr`` (``_symbolic``: the symbol a size
  was made with, to name the guard that fixed it; ``getattr`` with a default).
* autograd's ``BackwardCFunction``: ``_forward_cls`` (``_trace``: names in messages, ``getattr``
  with a default).
* the module ``torch.autograd.forward_ad``: ``_current_level`` (-1 unless a dual level is open),
  read live per call: by ``_bind.bind`` and by the generated signature check of
  ``_key/_checks`` (``FWAD._current_level``, its namespace's ``FWAD`` the public module). A value
  bound at import would be stale and a function here would cost a call per call:
  ``tests/test_compat.py`` lists ``_bind``'s read as the one exception to the rule.
  (Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.)

Not attribute reads, so not here: op names compared as strings (``"aten._local_scalar_dense.default"``
in ``_trace``'s messages, ``"_segment_reduce"`` in ``_record``, ``"_c10d_functional"`` in
``_distributed``'s namespaces), torch's source directories (``_eager``: ``"_refs"``, ``"_prims"``...)
and Triton's ``CompiledKernel._init_handles`` (``fuse/_triton``; Triton's, not torch's).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.cuda.jiterator
import torch.utils._pytree as torch_pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as get_current_dispatch_mode_stack

__all__ = [
    # torch.func's C++ interpreters (functorch)
    "peek_interpreter_stack", "is_functorch_wrapped_tensor", "is_batchedtensor", "get_unwrapped",
    "maybe_get_level", "unwrap_batched", "add_batch_dim", "TRANSFORM_GRAD", "TRANSFORM_VMAP",
    # torch.func's Python interpreters
    "retrieve_all_functorch_interpreters", "coerce_cinterpreter", "temporarily_pop_interpreter_stack",
    "temporarily_clear_interpreter_stack",
    "autograd_excluded", "backward_keeps_graph",
    # tensors, autograd and version counters
    "TensorBase", "TENSOR_VERSION_ATTR", "tensor_version", "TENSOR_PRIVATE_SPARSE_READS",
    "DisableTorchFunctionSubclass", "disabled_torch_function_impl", "VariableFunctions", "storage_use_count", "tensor_use_count", "increment_version",
    "unsafe_set_version_counter", "foreach_copy_", "neg_view",
    # global state a signature depends on
    "get_deterministic_algorithms", "is_any_autocast_enabled", "autocast_off", "sdpa_flags", "SDP_FLAG_NAMES", "written_arguments", "TensorGuards",
    # dispatch modes and fake tensors
    "TorchDispatchMode", "disable_current_modes", "disable_proxy_modes_tracing", "get_current_dispatch_mode_stack", "len_torch_dispatch_stack",
    "FakeTensor", "FakeTensorMode", "DataDependentOutputException", "DynamicOutputShapeException",
    "UnsupportedOperatorException",
    # containers
    "torch_pytree",
    # CUDA graphs and the jiterator
    "cuda_graph_replay", "clear_cublas_workspaces", "route_to_pool", "end_route_to_pool", "release_pool", "JittedFunction", "JITERATOR_NAME", "jiterator_launch",
    # aten ops
    "aten_to_copy", "aten_local_scalar_dense", "aten_linalg_check_errors", "aten_cudnn_rnn",
    "aten_cudnn_rnn_backward", "aten_efficientzerotensor", "aten_unsafe_view", "load_elementwise_dtypes",
    # nn, optim
    "LR_SCHEDULER_LEGACY_BASE", "parametrize_cache", "module_global_hooks", "module_global_backward_hooks",
    "optimizer_global_hooks",
    # torch.fx and AOTAutograd's partitioner
    "load_extract_tensor_metadata", "load_default_partition",
    # dynamo
    "load_dynamo_skip",
    # torch.distributed
    "load_resolve_process_group", "load_get_default_store", "load_get_default_group", "c10d_functional",
    "c10d_allgather_base", "c10d_reduce_scatter_base",
    # inductor (gtransform.fuse)
    "load_inductor_config", "load_maybe_warm_pool", "load_compile_fx", "load_tracing_context",
    "load_set_triton_ptxas_path", "load_static_launcher_class", "load_dim_source", "load_enable_python_dispatcher",
    "load_sympy_eval",
]

OPTIONAL: Dict[str, str] = {
    "cuda_graph_replay": "None on CPU builds (2.13.0+cpu): the fast path calls the recording's own replay",
    "clear_cublas_workspaces": "None on CPU builds (2.13.0+cpu): no workspaces (CUDA recordings only)",
    "route_to_pool": "None where missing: the warm-up allocates outside the graph pool (more memory on the first call)",
    "end_route_to_pool": "None where missing: see route_to_pool",
    "release_pool": "None where missing: see route_to_pool",
    "jiterator_launch": "None on CPU builds (2.13.0+cpu): no jiterator to route",
    "JittedFunction": "None where torch lacks torch.cuda.jiterator: nothing to route",
    "TensorGuards": "None where torch lacks it: signatures compare tensor metadata in Python",
    "aten_linalg_check_errors": "None where the op is missing: nothing to refuse",
    "LR_SCHEDULER_LEGACY_BASE": "None where torch dropped the alias: LRScheduler covers it",
    "temporarily_clear_interpreter_stack": "None: the backward recording runs under the interpreters",
    "backward_keeps_graph": "None: outputs are let go after the first backward, even with retain_graph=True",
    "tensor_use_count": "None: a donated tensor's memory is never given back (copied as usual)",
    "unsafe_set_version_counter": "None: a take-back keeps the bumped version counter",
    "TRANSFORM_GRAD": "None: no call counts as under torch.func.grad",
    "TRANSFORM_VMAP": "None: no call counts as under torch.func.vmap",
    "load_set_triton_ptxas_path": "ImportError where torch lacks it: Triton picks its ptxas",
    "load_maybe_warm_pool": "ImportError or other errors are ignored: the compile starts the workers",
    "load_dynamo_skip": "errors are ignored: torch.compile traces into graphified functions",
}
"""The names whose fallback (``None``, a stand-in, an ``ImportError`` the caller handles) is a
working path: where they are missing gtransform still works, one feature less. (The others are
needed where they are used.)"""


# -- torch.func's C++ interpreters (torch._C._functorch) --------------------------------------------
_functorch = torch._C._functorch  # required at import, as before (_batching read it at import)

# the innermost active torch.func transform, None outside them: Graphified.__call__ reads it per
# call (_api), the backward checks it (_autograd). No fallback (_api read it at import; _autograd's
# fallback was never reached). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
peek_interpreter_stack: Callable[[], Any] = _functorch.peek_interpreter_stack

# the tensors under torch.func's wrappers (_autograd, _state, _patches); None: tensors are taken as
# they are. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
is_functorch_wrapped_tensor: Any = getattr(_functorch, "is_functorch_wrapped_tensor", None)
get_unwrapped: Any = getattr(_functorch, "get_unwrapped", None)
# a vmap's batched tensor (_autograd: None skips the check; _batching: needed).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
is_batchedtensor: Any = getattr(_functorch, "is_batchedtensor", None)

# a batched tensor's level, taken apart and put together (_batching: a graphified function called
# under vmap). Read at use before (a missing one failed the vmapped call, as None does now).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
maybe_get_level: Any = getattr(_functorch, "maybe_get_level", None)
unwrap_batched: Any = getattr(_functorch, "_unwrap_batched", None)
add_batch_dim: Any = getattr(_functorch, "_add_batch_dim", None)

# the kinds of transform (_calls: which path serves a call; _autograd: a grad over a vmapped
# backward); None: not recognised. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
TRANSFORM_GRAD: Any
TRANSFORM_VMAP: Any
try:
    TRANSFORM_GRAD = _functorch.TransformType.Grad
    TRANSFORM_VMAP = _functorch.TransformType.Vmap
except AttributeError:  # pragma: no cover
    TRANSFORM_GRAD = TRANSFORM_VMAP = None


# -- torch.func's Python interpreters (torch._functorch.pyfunctorch; loaded with torch.func) ----------
_pyfunctorch: Any
try:
    from torch._functorch import pyfunctorch as _pyfunctorch
except ImportError:  # pragma: no cover
    _pyfunctorch = None

# the stack of active transforms (_calls, _batching, _autograd); None: a caller takes "not only
# grad"/"not only vmap"/"not differentiated again", as its ImportError handling did.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
retrieve_all_functorch_interpreters: Any = getattr(_pyfunctorch, "retrieve_all_functorch_interpreters", None)
# a vmap level's Python interpreter and running under it without it (_batching; needed there).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
coerce_cinterpreter: Any = getattr(_pyfunctorch, "coerce_cinterpreter", None)
temporarily_pop_interpreter_stack: Any = getattr(_pyfunctorch, "temporarily_pop_interpreter_stack", None)
# the backward recording outside the transforms (_autograd.no_functorch; None: under them).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
temporarily_clear_interpreter_stack: Any = getattr(_pyfunctorch, "temporarily_clear_interpreter_stack", None)
# whether the thread's dispatch keys leave autograd out: clearing the interpreters of a
# torch.func.grad called under torch.inference_mode() restores inference mode's keys while
# inference mode reads as off (_autograd.no_functorch then turns it off for real).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
_tls_excluded: Any = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)
_AUTOGRAD_KEY: Any = getattr(torch._C.DispatchKey, "AutogradFunctionality", None)


# whether the backward running now was asked to keep its graph (backward(retain_graph=True)):
# _autograd.GraphFn keeps its outputs' memory for a second backward then. None where missing:
# the outputs are let go after the first backward, and a second one after another call raises
# torch's "modified by an inplace operation". Checked: 2.13.0, 2.14.1 (2.11: the GPU suite).
backward_keeps_graph: Any = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def autograd_excluded() -> bool:
    """Whether autograd is left out of this thread's dispatch (False where torch cannot say)."""
    return bool(_tls_excluded is not None and _AUTOGRAD_KEY is not None and _tls_excluded(_AUTOGRAD_KEY))



# -- tensors, autograd and version counters ---------------------------------------------------------
# the C base of torch.Tensor: its descriptors (data, grad, is_leaf, grad_fn, is_cuda) and methods as
# the trace's modes see them (_watch). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
TensorBase: Any = torch._C.TensorBase
# the descriptor of a tensor's version counter (_watch: reads of x._version), and its getter
# (_liveness: per call). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
TENSOR_VERSION_ATTR: Any = torch._C.TensorBase.__dict__["_version"]
tensor_version: Callable[[torch.Tensor], int] = torch.Tensor._version.__get__  # type: ignore[attr-defined]
# a sparse tensor's private reads of its nonzeros (_watch: host looks a stand-in cannot answer; the
# missing ones left out). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
TENSOR_PRIVATE_SPARSE_READS: Tuple[Any, ...] = tuple(
    getattr(torch.Tensor, n) for n in ("_nnz", "_values", "_indices") if hasattr(torch.Tensor, n))
# tensor subclasses' __torch_function__ off (_autograd: saved activations; _liveness: a stale
# output's metadata reads). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
DisableTorchFunctionSubclass: Any = getattr(torch._C, "DisableTorchFunctionSubclass", None)
# the __torch_function__ of a class that turned it off (Parameter, FakeTensor): _patches answers
# has_torch_function as eager does for torch's fast-path checks. At import, no fallback.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
disabled_torch_function_impl: Any = torch._C._disabled_torch_function_impl
# torch._VF's recurrent layers, as traced calls name them (_cudnn_rnn; at import, no fallback).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
VariableFunctions: Any = torch._C._VariableFunctions
# how many references a storage has (_liveness, _record: whether a pool's memory is free; per call;
# at import, no fallback). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
storage_use_count: Callable[[Any], int] = torch._C._storage_Use_Count
# how many C++ references a tensor has (a DLPack export holds one: torch.from_dlpack(x), a JAX or
# CuPy array over it), which the storage's use count does not show (_handed: a donated tensor's
# memory is given back only where nothing else holds it). None where missing: nothing is given back.
# Checked: 2.13.0, 2.14.1 (2.11: the GPU suite).
tensor_use_count: Any = getattr(torch.Tensor, "_use_count", None)
# bump a version counter (_liveness); the public torch.autograd.graph.increment_version where the C
# function is missing. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
increment_version: Callable[..., Any] = (getattr(torch._C, "_increment_version", None)
                                         or torch.autograd.graph.increment_version)
# set a version counter back (_record); None: the bump stays.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
unsafe_set_version_counter: Any = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
# the batched copy into a recording's buffers (_record: where every dtype has a kernel).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
foreach_copy_: Any = getattr(torch, "_foreach_copy_", None)
# a lazily negated view (_record, the fast path's namespace: outputs with the negative bit).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
neg_view: Any = getattr(torch, "_neg_view", None)


# -- the global state a signature depends on -----------------------------------------------------------
# torch.use_deterministic_algorithms' state (_key/_parts, _key/_checks' namespace; per call): the public
# getter where the C one is missing. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
get_deterministic_algorithms: Callable[[], bool] = getattr(torch._C, "_get_deterministic_algorithms",
                                                           torch.are_deterministic_algorithms_enabled)
# whether any autocast is on (_key/_parts: None reads each device type's; _key/_checks' namespace
# takes `lambda: True` for None, as before). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
is_any_autocast_enabled: Any = getattr(torch._C, "_is_any_autocast_enabled", None)


_SDP_FLAGS = tuple(getattr(torch.backends.cuda, n) for n in ("flash_sdp_enabled", "mem_efficient_sdp_enabled",
                                                                 "math_sdp_enabled", "cudnn_sdp_enabled")
                   if hasattr(torch.backends.cuda, n))
SDP_FLAG_NAMES = ("flash", "memory-efficient", "math", "cuDNN")


def sdpa_flags() -> Tuple[bool, ...]:
    """Which kernels ``scaled_dot_product_attention`` may pick (``sdpa_kernel(...)`` sets them; per call).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return tuple(f() for f in _SDP_FLAGS)


_WRITTEN: Dict[Any, Tuple[int, ...]] = {}


def written_arguments(func: Any) -> Tuple[int, ...]:
    """The positions of the arguments an aten op writes in place (cached per op).

    Those its schema marks ``(a!)``; and the first argument of c10d's in-place collectives
    (``c10d::allreduce_(Tensor[] tensors, ...)``, ``broadcast_``, ``_allgather_base_``...),
    whose schemas mark no write. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    out = _WRITTEN.get(func)
    if out is None:
        schema = func._schema
        out = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        if not out and getattr(func, "namespace", "") == "c10d" and schema.name.endswith("_"):
            out = (0,)
        _WRITTEN[func] = out
    return out


def autocast_off() -> Any:
    """Every autocast off while entered (a context that does nothing when none is on).

    A traced graph holds the casts autocast made while tracing (and none where the function
    turned autocast off): run or captured under the caller's autocast, its ops would be
    cast again (an ``autocast(enabled=False)`` block inside the function lost).
    """
    if is_any_autocast_enabled is not None and not is_any_autocast_enabled():
        return _NO_CONTEXT
    return _AutocastOff([d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)])


class _AutocastOff:
    """``torch.autocast(d, enabled=False)`` for each device type ``d`` given, entered together."""

    def __init__(self, devices: List[str]):
        self.blocks = [torch.autocast(d, enabled=False) for d in devices]

    def __enter__(self) -> None:
        for b in self.blocks:
            b.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for b in reversed(self.blocks):
            b.__exit__(*exc)


class _NoContext:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: Any) -> None:
        pass


_NO_CONTEXT = _NoContext()
# dynamo's C++ check of tensors' metadata (_key/_guard; None: checked in Python).
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards
except Exception:  # pragma: no cover
    TensorGuards = None


# -- dispatch modes and fake tensors (imported above) -----------------------------------------------------
# torch.utils._python_dispatch: TorchDispatchMode, disable_current_modes, get_current_dispatch_mode_stack
# (_watch's modes, _patches.tracing); torch._subclasses.fake_tensor: FakeTensor, FakeTensorMode and
# the exceptions of ops a fake tensor cannot run (_trace, _watch, _objects, _patches, _rewrite,
# _jiterator, _partition, _distributed, fuse/_inductor). At import, no fallback.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
# the number of dispatch modes on the stack (_patches.tracing: none, no trace); `lambda: 1` where
# missing (the stack is then looked at). Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
len_torch_dispatch_stack: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


# -- containers (imported above) ----------------------------------------------------------------------------
# torch.utils._pytree as torch_pytree: vmap's in_dims trees (_batching), containers registered with
# torch (Hugging Face's ModelOutput) flattened as torch does (_tree). At import, no fallback.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.


# -- CUDA graphs and the jiterator --------------------------------------------------------------------------
# CUDAGraph.replay's C method, called by the fast path itself (_fastpath); None on CPU builds (and
# where missing): the recording's own replay. Checked: 2.11 (GPU image; run by the GPU suite),
# 2.14.1 (CUDA build); 2.13.0+cpu: None.
cuda_graph_replay: Any = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
# Frees cuBLAS's per-stream workspaces (torch's cudagraph trees call it around each capture, for
# the same reason): called around each capture (_record), a capture allocates the capture stream's
# workspace in the graph's pool instead of holding one more for that stream outside it. None on
# CPU builds. Checked: 2.11 (GPU image; run by the GPU suite), 2.14.1 (CUDA build); 2.13.0+cpu: None.
clear_cublas_workspaces: Any = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
# A thread's CUDA allocations routed to a graph pool and back (torch's cudagraph trees route their
# warm-ups so, torch.cuda.use_mem_pool its pools): the warm-up (_record) allocates in the pool its
# capture then reuses, instead of beside it. begin counts a use of the pool and release drops it; the
# pool must be held by a graph captured into it before (at a use count of 0 the allocator frees it
# and asserts on its next use). Present on CPU builds as placeholders that raise. Checked: 2.11
# (GPU image; run by the GPU suite), 2.13.0+cpu (placeholders), 2.14.1.
route_to_pool: Any = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
end_route_to_pool: Any = getattr(torch._C, "_cuda_endAllocateToPool", None)
release_pool: Any = getattr(torch._C, "_cuda_releasePool", None)
# torch.cuda.jiterator's launch function, a C function of torch._C (_jiterator: the recorded op
# calls it); None on CPU builds. Checked: 2.11 (GPU image; run by the GPU suite), 2.14.1 (CUDA
# build); 2.13.0+cpu: None.
JITERATOR_NAME = "_cuda_jiterator_compile_and_launch_kernel"
jiterator_launch: Any = torch._C.__dict__.get(JITERATOR_NAME)
# the class of the functions torch.cuda.jiterator._create_jit_fn makes: _patches routes the code
# of its __call__ (Python) while tracing, so torch._C's launch function is never replaced.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0 (present on CPU builds too), 2.14.1.
JittedFunction: Any = getattr(torch.cuda.jiterator, "_JittedFunction", None)


# -- aten ops --------------------------------------------------------------------------------------------------
# dtype casts (_watch: copies; fuse/_inductor: narrowing casts kept). At import, no fallback.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
aten_to_copy: Any = torch.ops.aten._to_copy.default
# .item() and friends (_watch: host reads refused). At import, no fallback.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
aten_local_scalar_dense: Any = torch.ops.aten._local_scalar_dense.default
# linalg's error checks, which read the info tensor on the host (_watch); None where missing.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
aten_linalg_check_errors: Any = getattr(getattr(torch.ops.aten, "_linalg_check_errors", None), "default", None)


def aten_cudnn_rnn() -> Any:
    """``aten._cudnn_rnn`` (``_cudnn_rnn``: recurrent layers on cuDNN; looked up on use, as before).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.aten._cudnn_rnn.default


def aten_cudnn_rnn_backward() -> Any:
    """``aten._cudnn_rnn_backward`` (``_cudnn_rnn``; looked up on use, as before).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.aten._cudnn_rnn_backward.default


def aten_efficientzerotensor() -> Any:
    """``aten._efficientzerotensor``: autograd's zero tensors (``_rewrite``; looked up on use, as before).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.aten._efficientzerotensor.default


def aten_unsafe_view() -> Any:
    """``aten._unsafe_view`` (``fuse/_gemv``: views of a product's operand; looked up when it loads).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.aten._unsafe_view.default


def load_elementwise_dtypes() -> Tuple[Any, Any]:
    """``torch._prims_common``'s ``(elementwise_dtypes, ELEMENTWISE_TYPE_PROMOTION_KIND)``.

    For the jiterator op's fake (``_jiterator``), imported on use as before.
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    return elementwise_dtypes, ELEMENTWISE_TYPE_PROMOTION_KIND


# -- nn and optim ------------------------------------------------------------------------------------------------
# the LR schedulers' old base class (_state: schedulers are Python state); None where torch dropped it.
# Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1 (a deprecated alias of LRScheduler).
LR_SCHEDULER_LEGACY_BASE: Any = getattr(torch.optim.lr_scheduler, "_LRScheduler", None)

_MODULE_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                        "_global_backward_pre_hooks")
_OPTIMIZER_GLOBAL_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def parametrize_cache() -> Optional[Dict[Any, Any]]:
    """``torch.nn.utils.parametrize``'s cache, read now (``parametrize.cached()`` rebinds it); None: none.

    For ``_patches`` (the entries a trace put there are taken out).
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.nn.utils import parametrize

    cache = getattr(parametrize, "_cache", None)
    return cache if isinstance(cache, dict) else None


def module_global_hooks() -> List[Dict[Any, Any]]:
    """``nn.Module``'s global hook dicts (``register_module_forward_hook`` and friends), read now.

    For ``_key/_environment`` (a hook added or removed records again); a missing one is left out.
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.nn.modules import module as _mm

    return [getattr(_mm, n) for n in _MODULE_GLOBAL_HOOKS if isinstance(getattr(_mm, n, None), dict)]


def module_global_backward_hooks() -> bool:
    """Whether a global module backward hook is registered (``_trace``: named in messages).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    mm = torch.nn.modules.module
    return bool(getattr(mm, "_global_backward_hooks", None) or getattr(mm, "_global_backward_pre_hooks", None))


def optimizer_global_hooks() -> List[Dict[Any, Any]]:
    """The optimizers' global step hook dicts (``register_optimizer_step_pre_hook`` ...), read now.

    For ``_key/_environment``; a missing one is left out.
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.optim import optimizer as _om

    return [getattr(_om, n) for n in _OPTIMIZER_GLOBAL_HOOKS if isinstance(getattr(_om, n, None), dict)]


# -- torch.fx and AOTAutograd's partitioner (imported on use) --------------------------------------------------
def load_extract_tensor_metadata() -> Callable[..., Any]:
    """``torch.fx.passes.shape_prop._extract_tensor_metadata`` (``_partition``: the joint graph's metadata).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    return _extract_tensor_metadata


def load_default_partition() -> Callable[..., Any]:
    """AOTAutograd's ``default_partition`` (``_partition``: the joint graph split; imported on use).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._functorch.partitioners import default_partition

    return default_partition


# -- dynamo (imported on use) ---------------------------------------------------------------------------------------
def load_dynamo_skip() -> Tuple[Callable[[str], Any], Callable[..., Any], Any, Any]:
    """``(trace_rules.add, set_code_exec_strategy, FrameAction, FrameExecStrategy)`` of ``torch._dynamo``.

    For ``_calls.opaque_to_dynamo`` (graphified functions are graph breaks that run as they are),
    whose caller ignores any error (a torch without them). Imports dynamo.
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._dynamo import trace_rules
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    return trace_rules.add, set_code_exec_strategy, FrameAction, FrameExecStrategy


# -- torch.distributed (imported on use: torch may lack it) --------------------------------------------------------
def load_resolve_process_group() -> Callable[..., Any]:
    """``distributed_c10d._resolve_process_group`` (``_distributed``: a group from its traced name).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group


def load_get_default_store() -> Callable[..., Any]:
    """``distributed_c10d._get_default_store`` (``_distributed``: the ranks' rendezvous).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store


def load_get_default_group() -> Callable[..., Any]:
    """``distributed_c10d._get_default_group`` (``_distributed``: the current default group).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group


def c10d_functional() -> Any:
    """The ops namespace ``torch.ops._c10d_functional`` (``_distributed``: functional collectives).

    Looked up on use, as before. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops._c10d_functional


def c10d_allgather_base() -> Any:
    """``c10d._allgather_base_`` (``_distributed``: an in-place all-gather rewritten; looked up on use).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.c10d._allgather_base_.default


def c10d_reduce_scatter_base() -> Any:
    """``c10d._reduce_scatter_base_`` (``_distributed``: an in-place reduce-scatter rewritten; on use).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    return torch.ops.c10d._reduce_scatter_base_.default


# -- inductor (gtransform.fuse; imported on use: plain use never loads the compiler) -------------------------------------
def load_inductor_config() -> Any:
    """The module ``torch._inductor.config`` (``fuse/_inductor``: the settings patched for fuse=True).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    import torch._inductor.config as c

    return c


def load_maybe_warm_pool() -> Callable[[], Any]:
    """``torch._inductor.async_compile.maybe_warm_pool`` (``fuse/_inductor``: compile workers started early).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._inductor.async_compile import maybe_warm_pool

    return maybe_warm_pool


def load_compile_fx() -> Callable[..., Any]:
    """Inductor's ``compile_fx`` (``fuse/_inductor``: the graph compiled).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


def load_tracing_context() -> Tuple[Any, Any]:
    """``(TracingContext, tracing)`` of ``torch._guards`` (``fuse/_inductor``: the context inductor compiles in).

    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._guards import TracingContext, tracing

    return TracingContext, tracing


def load_set_triton_ptxas_path() -> Callable[[], Any]:
    """Inductor's ``compile_tasks._set_triton_ptxas_path`` (``fuse/_triton``: Triton keyed to torch's ptxas).

    The caller takes an ``ImportError`` as "Triton's own choice".
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1.
    """
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    return _set_triton_ptxas_path


def load_static_launcher_class() -> Any:
    """Inductor's ``StaticallyLaunchedCudaKernel`` (``fuse/_static``: launches without Triton's launcher).

    From ``static_triton_launcher``, else (torch 2.8 to 2.10, before the launcher served XPU too)
    ``static_cuda_launcher``; the caller takes any error as "no static launcher".
    Checked: static_triton_launcher: 2.11 (GPU image; run by the GPU suite), 2.13.0, 2.14.1;
    static_cuda_launcher: not in 2.13.0 or 2.14.1 (the fallback for older torch, not checked here).
    """
    try:
        from torch._inductor.runtime import static_triton_launcher as module
    except ImportError:  # torch before the launcher served XPU too (2.8 to 2.10)
        from torch._inductor.runtime import static_cuda_launcher as module  # type: ignore[no-redef,attr-defined]
    return module.StaticallyLaunchedCudaKernel


# -- symbolic sizes (``_symbolic``: one trace for every size of a dimension that varies) ---------------------------------
def load_dim_source() -> Callable[[str], Any]:
    """A named source for a symbolic size: ``torch._dynamo.source.ConstantSource(source_name=...)``.

    ``ShapeEnv.create_symbol`` takes a ``torch._guards.Source``; the base class's interface
    changed between versions (``name`` a method, then a cached property), so a source of
    dynamo's own is used. Imported on the first symbolic trace (it loads dynamo).
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0.
    """
    from torch._dynamo.source import ConstantSource

    return lambda name: ConstantSource(source_name=name)


def load_enable_python_dispatcher() -> Callable[[], Any]:
    """``torch._dispatch.python.enable_python_dispatcher`` (``_symbolic``: around a symbolic trace).

    With it, composite operations run their Python decompositions, which keep sizes symbolic;
    without it, some of torch 2.11's C++ composites (``masked_fill``) read concrete sizes and
    fix the symbol. ``make_fx(tracing_mode="symbolic")`` and AOTAutograd enable it the same way.
    Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0.
    """
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher


def load_sympy_eval() -> Callable[[Any, Dict[Any, Any]], Any]:
    """Evaluate a size expression of a shape environment's symbols on values (ints or SymInts).

    ``torch.utils._sympy.interp.sympy_interp`` with ``PythonReferenceAnalysis`` (Python's own
    arithmetic, which SymInts follow): ``_partition`` computes the sizes a symbolic backward
    takes from its tensors' sizes. Checked: 2.11 (GPU image; run by the GPU suite), 2.13.0.
    """
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    def evaluate(expr: Any, values: Dict[Any, Any]) -> Any:
        if expr.is_Symbol:
            return values[expr]
        if expr.is_number:
            return int(expr)
        return sympy_interp(PythonReferenceAnalysis, values, expr)

    return evaluate

"""What every part of the benchmark shares: the columns, the tolerances, a row's description.

A row (`Workload`) is a function of its arguments with a way to make them, or, for a program
with state (a closed-over model, optimizer or cache), a factory that builds a fresh copy of
the program (`Instance`) for every column, so that no column sees another's updates. A
column (a method, `benchmarks.methods`) raises `NotApplicable` or `Skipped` where it has no
figure; the runner turns those into the cells "n/a" and "skip". float32 precision is one
setting for every column (`PRECISION`, set once by the command line), and so are the
tolerances of the checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

METHODS: Dict[str, str] = {
    "eager": "eager",
    "graph_copy": "CUDA graph: copy-in + replay",
    "graph_replay": "CUDA graph: replay alone",
    "mgc": "make_graphed_callables",
    "compile": "torch.compile reduce-overhead",
    "jax": "jax.jit",
    "gt_same": "gt: same tensors",
    "gt_new": "gt: new tensors",
    "gt_held": "gt: same, out held",
    "gt_views": "gt: same, views of 4 calls held",
    "gt_fused": "gt fuse=True: same tensors",
    "gt_split": "gt on_break=split: same tensors",
    "gt_split_fused": "gt on_break=split, fuse=True",
    "compile_gt": "torch.compile backend=gtransform",
}
CUDA_ONLY = {"graph_copy", "graph_replay", "mgc"}

TOL_FP32 = 1e-4
TOL_FP32_TF32 = 1e-2  # --tf32: float32 matmuls/convolutions on tensor cores, 10-bit mantissa
TOL_BF16 = 2e-2

# float32 precision, the same for every column (set by environment.set_precision):
# default "ieee": no TF32 anywhere (cuBLAS, cuDNN, inductor's matmul templates: torch
# defaults cuDNN convolutions to TF32, so this is set explicitly), jax at "highest";
# --tf32: TF32 everywhere, jax at "tensorfloat32".
PRECISION: Dict[str, Any] = {"tf32": False}


class NotApplicable(Exception):
    """The method does not apply to this workload (cell: n/a)."""


class Skipped(Exception):
    """The method cannot run here (cell: skip), e.g. CUDA-only on the CPU."""


def short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


@dataclass
class Workload:
    name: str
    title: str
    fn: Optional[Callable[..., Any]]  # the torch function, fn(*args) (None: see factory)
    make_args: Callable[[torch.device], tuple]  # fresh random args (a tuple of pytrees)
    jax_fn: Optional[Callable[[Any, Any], Callable[..., Any]]] = None  # (jax, jnp) -> function of the same args
    jax_key: bool = False  # the jax function takes and returns a PRNG key (threaded through calls)
    mgc: bool = True  # make_graphed_callables applies
    compile_ok: bool = True
    bf16: bool = False
    n_sets: int = 8  # pre-made input sets (rotated through by the "new tensors" columns)
    check: Optional[Callable[[list, list, tuple], float]] = None  # custom (out, ref, args) -> error
    # Real programs with state (a closed-over model, optimizer, KV cache): factory(device) builds a
    # fresh Instance from the same initial state for every column; the check runs `steps` calls
    # (one per input set, in order) and compares each call's outputs with eager's, and the state
    # after them (Instance.state) with eager's. See "Stateful rows" in benchmarks/context.py.
    factory: Optional[Callable[[torch.device], Instance]] = None
    steps: int = 4
    no_grad: bool = False  # build, check and time every column under torch.no_grad()
    state_tol: float = 1e-3  # for Instance.state, compared as updates (state_delta) or values
    state_delta: bool = True
    only_methods: Optional[tuple] = None  # other columns: n/a (to keep the run short)
    host_reads: bool = False  # the program reads tensor values on the host (issue #35): gt_split, compile_gt apply
    note: str = ""

    @property
    def tol(self) -> float:
        if self.bf16:
            return TOL_BF16
        return TOL_FP32_TF32 if PRECISION["tf32"] else TOL_FP32


@dataclass
class Instance:
    """One column's own copy of a stateful program."""

    fn: Callable[..., Any]  # what every column calls, records or compiles (closes over the state)
    state: Optional[Callable[[], Any]] = None  # tensors compared with eager's after the check steps
    mgc_module: Optional[torch.nn.Module] = None  # make_graphed_callables graphs this module ...
    mgc_args: Optional[Callable[[tuple], tuple]] = None  # ... with these of the step's args (default: all)
    keep: Any = None  # anything else the instance must keep alive


def need(module: str, what: str = "") -> Any:
    """Import a package the row needs, or skip the row saying why."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:
        raise Skipped(f"{module} not importable{' (' + what + ')' if what else ''}: {short_error(e)}") from None


def seeded(seed: int = 0):
    """Every column's copy of a stateful program starts from the same random initial state."""
    torch.manual_seed(seed)

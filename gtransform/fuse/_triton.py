"""What fuse=True's two Triton kernels do alike: which ptxas, one launch, precompiling in threads.

:mod:`._gemm` and :mod:`._gemv` each define a Triton kernel and plan its launches (the
grid, the arguments, the compile-time constants); the rest is the same for both and
lives here:

* :func:`use_inductors_ptxas`, called before Triton first computes a cache key in this
  process, so that the keys of our kernels are the same in every process;
* :func:`launch`: Triton's binding picks (or compiles) the variant the arguments need,
  and :func:`launcher` launches its binary without the C launcher Triton would
  otherwise build for it (0.36-0.42 s a variant on an H100 with a cold cache); where
  it cannot, Triton launches as usual;
* :func:`precompile`: the variants a graph's launches will need, compiled in threads
  while inductor compiles the rest of the graph, and loaded for our launch.

Launches happen only while a recording is made: a replay never comes back to Python.
Triton is imported by the kernels' own modules, on the first CUDA launch or precompile.

``GTRANSFORM_FUSE_LAUNCHER`` picks the launcher: ``cubin`` (the default: ours,
:mod:`._cubin`), ``torch`` (torch's static launcher, :mod:`._static`, which says why
it is not the default yet) or ``triton`` (Triton's own, C launcher and all: the
baseline both avoid).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._compat import load_set_triton_ptxas_path
from . import _cubin, _static

__all__ = ["LAUNCHERS", "launch", "launcher", "precompile", "specialization", "use_inductors_ptxas"]

LAUNCHERS = ("cubin", "torch", "triton")
"""The values of ``GTRANSFORM_FUSE_LAUNCHER``; the first is the default."""


def use_inductors_ptxas() -> None:
    """Point Triton at the ptxas inductor uses (torch's own), as its compile workers do.

    Triton keys its on-disk kernel cache on the ptxas version, read once per process
    when it first computes a key. Inductor sets ``TRITON_PTXAS_PATH`` only when it
    first compiles a kernel in this process, so which ptxas the keys name depended on
    what ran first: a second process whose inductor kernels all came from the cache
    keyed fuse=True's matrix-product kernels to another ptxas, missed the entries the
    first process wrote and compiled them again (0.6-1.4 s each on an H100,
    benchmarks/NOTES.md). Set before the first compile, the keys are the same in
    every process that runs the same program. A path the user set is kept.
    """
    try:
        set_triton_ptxas_path = load_set_triton_ptxas_path()
    except ImportError:  # pragma: no cover - another torch: Triton's own choice
        return
    set_triton_ptxas_path()


def launcher(compiled: Any, device: int) -> Optional[Any]:
    """What launches Triton's ``CompiledKernel`` on CUDA device ``device``, per ``GTRANSFORM_FUSE_LAUNCHER``.

    Returns:
        A callable ``(grid, stream, args)``, or None: Triton's own launch.

    Raises:
        ValueError: the variable names no launcher of :data:`LAUNCHERS`.
    """
    which = os.environ.get("GTRANSFORM_FUSE_LAUNCHER", LAUNCHERS[0])
    if which == "cubin":
        return _cubin.launcher(compiled, device)
    if which == "torch":
        return _static.launcher(compiled, device)
    if which == "triton":
        return None
    raise ValueError(f"GTRANSFORM_FUSE_LAUNCHER={which!r} names no launcher of fuse=True's kernels: "
                     f"use one of {', '.join(LAUNCHERS)} (the default: {LAUNCHERS[0]})")


def launch(kernel: Any, grid: Sequence[int], args: Sequence[Any], consts: Dict[str, Any], device: int) -> None:
    """``kernel[grid](*args, **consts)`` on the current stream of CUDA device ``device`` (the current one).

    Triton's binding picks (or compiles) the variant these arguments need; the launch
    skips the C launcher Triton would build for it (:func:`launcher`).
    """
    compiled = kernel.warmup(*args, grid=grid, **consts)
    if hasattr(compiled, "result"):  # Triton's async compile mode
        compiled = compiled.result()
    run = None if compiled is None else launcher(compiled, device)
    if run is None:
        kernel[grid](*args, **consts)
    else:
        run(grid, torch.cuda.current_stream().cuda_stream, args)


def specialization(ints: Sequence[int]) -> Tuple[int, ...]:
    """What Triton specializes a kernel on, of these integer arguments: being 1, or a multiple of 16.

    Launches whose integers agree here (and whose constants are the same) use one
    compiled variant: :func:`precompile` builds each such variant once.
    """
    return tuple(1 if v == 1 else 16 if v % 16 == 0 else 0 for v in ints)


def precompile(kernel: Any, jobs: Sequence[Tuple[Sequence[Any], Any, Dict[str, Any]]], device: Optional[int],
               workers: int, name: str) -> List[Any]:
    """Start compiling, in threads, these variants of ``kernel`` for CUDA device ``device``.

    Each job is ``(args, grid, consts)`` as a launch's, with a dtype in place of each
    tensor (Triton keys its variants on dtypes, not on the tensors). Triton's compiler
    spends much of its time outside the interpreter (MLIR passes, ptxas), so the
    variants build while inductor compiles the rest of the graph; a launch whose
    variant is not ready (or differs) compiles it then, as it would anyway. Each built
    variant is loaded for our own launch (or, where :func:`launcher` has none for it,
    given Triton's C launcher now rather than at the launch).

    Args:
        kernel: the Triton ``JITFunction`` (made before: Triton is imported once, not
            in each thread).
        jobs: one per variant.
        device: the device index the launches will use; None: the current one.
        workers: at most this many threads.
        name: the threads' name prefix.

    Returns:
        Futures to wait on (their failures are only logged: the launch reports them).
    """
    if not jobs:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix=name)
    on = torch.cuda.current_device() if device is None else device

    def build(args: Sequence[Any], grid: Any, consts: Dict[str, Any]) -> None:
        with torch.cuda.device(on):  # Triton compiles for (and caches under) the current device
            compiled = kernel.warmup(*args, grid=grid, **consts)
            if launcher(compiled, on) is None:  # loads it for our own launch
                init = getattr(compiled, "_init_handles", None)
                if init is not None:  # Triton's: builds its C launcher (0.25-0.4 s when cold)
                    init()

    futures = [pool.submit(build, args, grid, consts) for args, grid, consts in jobs]
    pool.shutdown(wait=False)
    return futures

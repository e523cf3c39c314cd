"""Launching our compiled Triton kernels with torch's static launcher (``GTRANSFORM_FUSE_LAUNCHER=torch``).

The same job as :mod:`._cubin` (no C launcher built by Triton on the first call's
critical path), done by torch's code instead of ours, so that the two can be timed
side by side on a GPU; :mod:`._cubin` stays the default until they are. Inductor
launches its own Triton kernels this way: ``StaticallyLaunchedCudaKernel`` reads a
compiled kernel's metadata, loads its cubin, and launches it through
``torch._C._StaticCudaLauncher``, C++ built into torch (nothing is compiled at run
time). This module hands it the very binary :mod:`._cubin` would launch (what our
``kernel.warmup`` compiled), so kernels, numerics and replays are the same; only the
loading and the launch during warm-up and capture differ.

Why not ``torch.library.triton_op`` (torch >= 2.6), the supported route, with which
inductor itself compiles and launches a user's kernel (torch 2.13's source, and 2.8
to 2.13 for the config below):

* inductor launches user-defined kernels with its static launcher only under
  ``static_launch_user_defined_triton_kernels`` (added in 2.8, off by default up to
  2.13): without it each kernel variant gets Triton's C launcher, built on the first
  call, the very cost :mod:`._cubin` removes (0.36-0.42 s a variant on an H100);
* inductor's codegen of user-defined kernels ignores ``do_not_specialize``: an
  integer argument equal to 1 becomes a constant, so the epilogue flags of
  ``gtransform::gemm`` (bias, ReLU, mask) would compile one variant per combination
  instead of one kernel for every layer of an MLP, and the binaries would differ
  from today's;
* it copies a kernel's source with the functions it reaches through its globals
  only (``co_names``), not its closure: ``_gemv``'s kernel calls ``part``, defined
  beside it inside ``_kernel()`` (so that Triton is imported on the first launch
  only); both kernels would have to move to a module that imports Triton at the top;
* the kernels would compile inside inductor's compile (its worker pool, once the
  graph is lowered) instead of in threads from the rewrite on, while inductor lowers
  the graph (:func:`._triton.precompile`).

That is a rewrite of both ops and of the first call's schedule, to be measured on its
own, not a swap of launchers. Torch's static launcher alone swaps: the names it needs
changed across versions, so each is looked up, and anything unexpected makes
:func:`launcher` return None (the caller then launches through Triton):

* the class lives in ``torch._inductor.runtime.static_triton_launcher`` since the
  rename of January 2026 (pytorch/pytorch#169121: torch 2.11 on, by its date) and in
  ``static_cuda_launcher`` before (2.8 to 2.10); its ``load_kernel`` takes the
  device (2.13) or uses the current one (2.8); the constants it strips are named
  ``full_constexprs`` (2.13) or ``constexprs`` (2.8);
* it reads the cubin from a file named by ``CompiledKernel._cubin_path`` (inductor
  points it into Triton's cache; here a temporary file, removed once loaded);
* it refuses what it does not support (launch hooks, clusters, scratch memory; 2.8:
  over 48 KB of shared memory or 25 arguments) by raising, which means None here. It
  does not compare the kernel's threads with the registers it uses, as
  :mod:`._cubin` does: our kernels run 4 warps, which fit any register count.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._compat import load_static_launcher_class as _static_kernel_class  # (a test reads it by this name)

__all__ = ["Launcher", "launcher"]


class Launcher:
    """One loaded kernel binary on one device: ``launcher(grid, stream, args)`` launches it."""

    __slots__ = ("compiled", "kernel", "keep")

    def __init__(self, compiled: Any, kernel: Any, keep: List[int]):
        self.compiled = compiled
        self.kernel = kernel  # torch's StaticallyLaunchedCudaKernel, loaded
        self.keep = keep  # which of a launch's arguments the binary takes, in order

    def __call__(self, grid: Sequence[int], stream: int, args: Sequence[Any]) -> None:
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        if gx * gy * gz == 0:
            return
        self.kernel.run(gx, gy, gz, stream, *[args[i] for i in self.keep])


_LOCK = threading.Lock()
_LAUNCHERS: Dict[Tuple[int, int], Tuple[Any, Optional[Launcher]]] = {}


def launcher(compiled: Any, device: int) -> Optional[Launcher]:
    """A :class:`Launcher` for Triton's ``CompiledKernel`` on CUDA device ``device``, or None.

    None where torch's static launcher is missing or refuses the kernel, or loading
    fails; the caller then launches through Triton. The result is kept per kernel and
    device.
    """
    key = (id(compiled), device)
    hit = _LAUNCHERS.get(key)
    if hit is not None and hit[0] is compiled:
        return hit[1]
    with _LOCK:
        hit = _LAUNCHERS.get(key)
        if hit is not None and hit[0] is compiled:
            return hit[1]
        made = _make(compiled, device)
        _LAUNCHERS[key] = (compiled, made)
        return made


def _make(compiled: Any, device: int) -> Optional[Launcher]:
    try:
        cls = _static_kernel_class()
        cubin = compiled.asm["cubin"]
    except Exception:  # no static launcher in this torch, a kernel without a cubin
        return None
    fd, path = tempfile.mkstemp(prefix="gtransform-", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        compiled._cubin_path = path
        try:
            kernel = cls(compiled)
        finally:
            del compiled._cubin_path
        if "device" in inspect.signature(kernel.load_kernel).parameters:
            kernel.load_kernel(device)
        else:
            with torch.cuda.device(device):  # torch 2.8's loads into the current device
                kernel.load_kernel()
        stripped = getattr(kernel, "full_constexprs", None)
        if stripped is None:
            stripped = kernel.constexprs  # torch 2.8's name
        keep = [i for i in range(len(kernel.arg_names)) if i not in set(stripped)]
        if len(keep) != len(kernel.arg_tys):
            return None
    except Exception:  # refused (NotImplementedError), or another torch than those above
        return None
    finally:
        os.unlink(path)
    return Launcher(compiled, kernel, keep)

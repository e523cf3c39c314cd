"""Launching our own compiled Triton kernels without Triton's generated C launcher.

Triton launches a kernel through a small C extension that it generates for the
kernel's signature and builds with the system's C compiler the first time it sees
that signature: 0.36-0.42 s per kernel variant on the lent H100 hosts with a cold
Triton cache, on the critical path of ``fuse=True``'s first call (benchmarks/NOTES.md,
"The matrix-product kernel's launcher"). Inductor avoids that build for its own
kernels with torch's static launcher; this module does the same for the kernel of
:mod:`gtransform.fuse._gemm`. It loads the compiled binary with the driver utilities
Triton has already built in this process and launches it with the CUDA driver's
``cuLaunchKernel`` through ctypes.

Launches happen only while a recording is made (a replay never comes back to
Python), so the few microseconds ctypes costs per launch do not matter.

Anything this module does not know for sure (a Triton whose compiled kernel lacks a
field, clusters, programmatic launch, scratch memory, an argument type it does not
list) makes :func:`launcher` return None, and the caller launches through Triton as
before.

Torch's own static launcher does the same job for inductor's kernels:
:mod:`._static` hands it ours under ``GTRANSFORM_FUSE_LAUNCHER=torch`` (this module
stays the default until the two are timed side by side on a GPU), and says why
``torch.library.triton_op`` is no drop-in replacement for either.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["Launcher", "launcher", "plan"]

_SCALARS: Dict[str, Callable[[Any], Any]] = {
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "f32": ctypes.c_float,
    "fp64": ctypes.c_double,
}


def _pointer(t: Any) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(t.data_ptr()) if t is not None else 0)


def plan(compiled: Any) -> Optional[Tuple[List[Tuple[int, Callable[[Any], Any]]], int]]:
    """Which of a kernel's arguments its binary takes, converted how, plus the trailing null pointers.

    ``compiled`` is Triton's ``CompiledKernel``. Its binary takes the arguments that are
    neither declared ``tl.constexpr`` nor specialized into constants by Triton (an
    integer equal to 1, for one), in order, then one pointer for each scratch buffer the
    metadata names (null: none is used). Returns None where any of that is unsure.
    """
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    fn = getattr(src, "fn", None)
    names = getattr(fn, "arg_names", None)
    signature = getattr(src, "signature", None)
    if md is None or names is None or not isinstance(signature, dict):
        return None
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or getattr(md, "launch_cooperative_grid", False):
        return None
    if getattr(md, "tensordesc_meta", None):
        return None
    scratch = 0
    for field in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(md, field):
            if getattr(md, field):
                return None
            scratch += 1

    def index(key: Any) -> int:
        if isinstance(key, str):
            return list(names).index(key)
        if isinstance(key, tuple):
            if len(key) != 1:  # an element of a tuple argument: not ours to flatten
                raise ValueError(key)
            return int(key[0])
        return int(key)

    try:
        sig = {index(k): v for k, v in signature.items()}
        constants = {index(k) for k in (getattr(src, "constants", None) or {})}
    except ValueError:
        return None
    steps: List[Tuple[int, Callable[[Any], Any]]] = []
    for i in sorted(sig):
        ty = sig[i]
        if ty == "constexpr" or i in constants:
            continue
        if not isinstance(ty, str):
            return None
        conv = _pointer if ty.startswith("*") else _SCALARS.get(ty)
        if conv is None:
            return None
        steps.append((i, conv))
    return steps, scratch


@functools.cache
def _cuda() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.POINTER(ctypes.c_void_p)]
    launch.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorString.restype = ctypes.c_int
    return lib


class Launcher:
    """One loaded kernel binary on one device: ``launcher(grid, stream, args)`` launches it."""

    __slots__ = ("compiled", "module", "function", "threads", "shared", "steps", "scratch")

    def __init__(self, compiled: Any, module: Any, function: Any, threads: int, shared: int,
                 steps: List[Tuple[int, Callable[[Any], Any]]], scratch: int):
        self.compiled = compiled  # kept alive: Triton may unload a collected kernel's module
        self.module, self.function = module, function
        self.threads, self.shared = threads, shared
        self.steps, self.scratch = steps, scratch

    def __call__(self, grid: Sequence[int], stream: int, args: Sequence[Any]) -> None:
        values = [conv(args[i]) for i, conv in self.steps]
        values += [ctypes.c_uint64(0) for _ in range(self.scratch)]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        if gx * gy * gz == 0:
            return
        lib = _cuda()
        rc = lib.cuLaunchKernel(self.function, gx, gy, gz, self.threads, 1, 1, self.shared, stream, params, None)
        if rc != 0:
            text = ctypes.c_char_p()
            lib.cuGetErrorString(rc, ctypes.byref(text))
            name = getattr(self.compiled.metadata, "name", "?")
            raise RuntimeError(f"gtransform: launching the Triton kernel {name} failed: CUDA error {rc} "
                               f"({(text.value or b'?').decode()})")


_LOCK = threading.Lock()
_LAUNCHERS: Dict[Tuple[int, int], Tuple[Any, Optional[Launcher]]] = {}


def launcher(compiled: Any, device: int) -> Optional[Launcher]:
    """A :class:`Launcher` for Triton's ``CompiledKernel`` on CUDA device ``device``, or None.

    None where :func:`plan` is unsure, the binary does not fit the device (Triton's own
    launch then raises its OutOfResources), or loading fails; the caller then launches
    through Triton. The result is kept per kernel and device.
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
    steps = plan(compiled)
    if steps is None:
        return None
    try:
        from triton.runtime.driver import driver

        md = compiled.metadata
        binary = getattr(compiled, "kernel", None) or compiled.asm["cubin"]
        utils = driver.active.utils
        shared = int(md.shared)
        if shared > int(utils.get_device_properties(device)["max_shared_mem"]):
            return None
        loaded = utils.load_binary(md.name, binary, shared, device)
        module, function = loaded[0], loaded[1]
        threads = 32 * int(md.num_warps)
        if len(loaded) >= 5 and threads > int(loaded[4]):
            return None
        _cuda()
    except Exception:  # another Triton, no libcuda: Triton's own launch
        return None
    return Launcher(compiled, module, function, threads, shared, steps[0], steps[1])

"""Compile caches: every column compiles cold, and the warm-cache measurement reuses them.

bench.py makes a fresh root directory for TorchInductor's and Triton's caches before torch
or jax is imported (`use_root` hands it here; it is removed at exit), and every cell gets a
new empty directory under it, with this process's in-memory compile caches cleared, so no
column inherits another's compile. The second process of the warm-cache measurement
(`benchmarks.warm`) rebuilds a cell with the directory its cold first call filled.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Dict, Optional

import torch

# Per-column TorchInductor/Triton cache directories live under this root
# (removed at exit). None: the user set TORCHINDUCTOR_CACHE_DIR, and every
# column shares it (to measure warm-cache compiles on purpose); also where the
# package is used without bench.py (the probes).
_CACHE_ROOT: Optional[str] = None


def use_root(path: Optional[str]) -> None:
    """Make the per-cell cache directories under ``path`` (None: share the user's, see _CACHE_ROOT)."""
    global _CACHE_ROOT
    _CACHE_ROOT = path


def root() -> Optional[str]:
    """The root of the per-cell cache directories, or None where every cell shares the user's."""
    return _CACHE_ROOT


def clear_compile_memory() -> None:
    """Forget what this process compiled: dynamo's code caches, inductor's
    in-memory caches (loaded kernel modules, compiled Triton kernels) and
    fuse=True's own matrix-product kernels (a Triton JIT function keeps the
    kernels it built in memory: a row would reuse another row's, write nothing
    to its own cache directory, and its warm-cache process would compile
    them), so the next compile reads only the (fresh or reused) cache directory."""
    for name in ("gtransform.fuse._gemm", "gtransform.fuse._gemv", "gtransform._gemm", "gtransform._gemv"):
        mod = sys.modules.get(name)  # (gtransform.fuse since 2026-11-27; the old paths for A/B runs)
        if mod is not None:
            mod._kernel.cache_clear()
    if "torch._dynamo" in sys.modules:
        try:
            torch._dynamo.reset()
        except Exception:
            pass
    if "torch._inductor.utils" in sys.modules:
        u = sys.modules["torch._inductor.utils"]
        clear = getattr(u, "clear_caches", None) or getattr(u, "clear_inductor_caches", None)
        if clear is not None:
            try:
                clear()
            except Exception:
                pass


@contextlib.contextmanager
def compile_caches(label: str, reuse: Optional[str] = None):
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for one column: a new empty
    directory (cold), or `reuse` (the warm-cache measurement). Yields the dir."""
    if _CACHE_ROOT is None and reuse is None:
        yield os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return
    d = reuse or tempfile.mkdtemp(prefix=label.replace("/", "_") + "-", dir=_CACHE_ROOT)
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {k: os.environ.get(k) for k in keys}
    clear_compile_memory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    os.environ["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
    try:
        yield d
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def compile_counters(reset: bool = False) -> Optional[Dict[str, int]]:
    """TorchInductor's and AOTAutograd's cache hit/miss/bypass counters (dynamo's ``counters``)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return None
    if reset:
        for group in ("inductor", "aot_autograd"):
            counters[group].clear()
        return {}
    return {f"{group}.{k}": int(v) for group in ("inductor", "aot_autograd")
            for k, v in counters[group].items() if "cache" in k or "bypass" in k}


"""The switch that makes graphified functions run their Python eagerly.

``gt.disable()`` (a context manager, also a decorator) and ``GTRANSFORM_DISABLE=1`` in
the environment, as ``jax.disable_jit()`` / ``JAX_DISABLE_JIT`` and
``TORCH_COMPILE_DISABLE``: for debugging with prints and breakpoints. The context
manager acts in the thread that enters it (other threads keep replaying); the
environment variable, read at import, acts in every thread of the process.

Graphified calls check :data:`OFF` first (one thread-local attribute read).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

__all__ = ["OFF", "disable", "ENV_DISABLED"]

ENV_DISABLED = os.environ.get("GTRANSFORM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")


class _Off(threading.local):
    """Per thread: whether graphified functions run eagerly."""

    on = ENV_DISABLED


OFF = _Off()


def disable(fn: Any = None) -> Any:
    """Run every graphified function eagerly inside this block (this thread).

    The function's own Python runs on every call, so ``print``, ``breakpoint()`` and
    Python control flow behave as without ``graphify``; nothing is traced, recorded or
    replayed, and recordings made before stay for later calls. ``GTRANSFORM_DISABLE=1``
    in the environment does the same for the whole process. Like ``jax.disable_jit()``.

    Examples:
        >>> import torch, gtransform as gt
        >>> f = gt.graphify(lambda x: x * 2)
        >>> with gt.disable():
        ...     y = f(torch.ones(2))
        >>> f.cache_info().misses
        0

    Also a decorator, with or without parentheses (``@gt.disable`` or ``@gt.disable()``):
    the decorated function's calls run graphified functions eagerly.
    """
    if fn is None:
        return _disabled()
    if not callable(fn):
        raise TypeError(f"gt.disable(fn): expected a function to decorate, got {type(fn).__name__} "
                        "(as a context manager: `with gt.disable():`)")
    return _disabled()(fn)


@contextlib.contextmanager
def _disabled() -> Iterator[None]:
    before = OFF.on
    OFF.on = True
    try:
        yield
    finally:
        OFF.on = before

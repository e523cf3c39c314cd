"""Error classes and the helpers that make their messages point at user code."""

from __future__ import annotations

import os
import traceback
from typing import Optional

__all__ = ["GraphifyError", "OverwrittenOutputError", "RerecordWarning", "EagerWarning", "PrintWarning", "user_frame", "innermost_frame", "format_frame", "is_library_file"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR: Optional[str] = None
_STDLIB_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) for p in (os.__file__, traceback.__file__)
)


class GraphifyError(RuntimeError):
    """A function could not be recorded into a graph.

    Raised when ``graphify`` meets something a recording cannot contain: a
    data-dependent operation (``.item()``, ``bool(t)``, ``nonzero``,
    ``torch.unique``), a copy between the host and the device inside a CUDA
    function, an operation on a CPU tensor inside a CUDA function, an in-place
    resize of an input, mixed devices among the inputs, or a CUDA capture that
    the driver rejected.

    The message always says what happened, where (the function, the leaf path
    such as ``args[0]['w']``, the operation and the user's ``file:line``), why a
    recording cannot contain it, and how to fix it: make the value static
    (a Python number, or ``static_argnums``), move the work out of the
    function, or create tensors on the inputs' device.

    A failed trace or capture leaves no half-state: the function, its cache,
    the memory pool and the random number generator stay usable.

    Examples:
        >>> import torch, gtransform as gt
        >>> @gt.graphify
        ... def f(x):
        ...     return x * x.sum().item()
        >>> try:
        ...     f(torch.ones(3))
        ... except gt.GraphifyError as e:
        ...     print("item" in str(e))
        True
    """


class OverwrittenOutputError(RuntimeError):
    """A stale output of a graphified function was touched.

    Outputs of a graphified function live in its memory pool, and the next call
    of the same function in the same thread (or of any function sharing its
    pool) writes new results over them. An output object the caller still holds
    at that moment is poisoned: any operation, method, indexing, printing or
    NumPy conversion on it raises this error instead of silently showing the
    new numbers.

    Fix: ``.clone()`` an output you want to keep past the next call, or drop
    it (let it go out of scope) before calling again. Views you derived from a
    poisoned output keep the values of their own call (gtransform moves them
    to private memory before overwriting), but the output object itself raises.

    Examples:
        >>> import torch, gtransform as gt
        >>> f = gt.graphify(lambda x: x * 2)
        >>> a = f(torch.ones(2))
        >>> b = f(torch.ones(2))
        >>> try:
        ...     a + 1
        ... except gt.OverwrittenOutputError:
        ...     print("stale")
        stale
    """


def _torch_dir() -> str:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        # with the separator: torchdiffeq, torchvision, torchaudio live beside torch
        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return _TORCH_DIR


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is torch's, ours, the standard library's or generated code."""
    path = os.path.abspath(filename)
    if path.startswith(_PKG_DIR + os.sep) and not os.path.basename(path).startswith("test"):
        return True
    if path.startswith(_torch_dir()):
        return True
    if filename.startswith("<") and filename not in ("<stdin>", "<string>"):
        # generated code (fx graph modules, eval'd helpers)
        return True
    for d in _STDLIB_DIRS:
        if path.startswith(d) and "site-packages" not in path:
            return True
    # third-party libraries (torchdiffeq, transformers...): the user's own line is
    # further out; ``innermost_frame`` points inside them
    return "site-packages" in path or "dist-packages" in path


def user_frame(tb: Optional[traceback.StackSummary] = None) -> Optional[traceback.FrameSummary]:
    """Return the innermost frame that belongs to user code (not torch, not us)."""
    if tb is None:
        tb = traceback.extract_stack()
    for fr in reversed(tb):
        if not is_library_file(fr.filename):
            return fr
    return innermost_frame(tb)


def innermost_frame(tb: traceback.StackSummary) -> Optional[traceback.FrameSummary]:
    """The innermost frame outside torch, gtransform and the standard library.

    Unlike :func:`user_frame` it may be inside a third-party library (e.g. where
    torchdiffeq reads a value), which is where a host read really happens.
    """
    for fr in reversed(tb):
        path = os.path.abspath(fr.filename)
        if path.startswith(_PKG_DIR + os.sep) or path.startswith(_torch_dir()) or fr.filename.startswith("<"):
            continue
        if any(path.startswith(d) and "site-packages" not in path for d in _STDLIB_DIRS):
            continue
        return fr
    return None


def user_frame_from_exc(exc: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost user frame of an exception's traceback."""
    return user_frame(traceback.extract_tb(exc.__traceback__))


def format_frame(fr: Optional[traceback.FrameSummary]) -> str:
    """``file:line in func`` plus the source line, or a placeholder."""
    if fr is None:
        return "<unknown location>"
    s = f"{fr.filename}:{fr.lineno} in {fr.name}"
    if fr.line:
        s += f"\n    {fr.line.strip()}"
    return s


def describe_fn(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"graphify({name})"


class RerecordWarning(UserWarning):
    """A graphified function keeps recording new signatures, or recording again.

    Each new signature (tree structure, tensor shapes/dtypes/strides, values
    of non-tensor leaves) costs a trace and a recording. The warning names the
    part of the signature that keeps changing and how to keep it stable:
    pass changing Python numbers as tensors, pad inputs to a few fixed
    shapes, or keep the structure of the arguments fixed. It is also issued
    when the same signature keeps recording again because its environment
    changes between calls (a Python-float learning rate set by a scheduler
    after every step, a module attribute the function reads), naming what
    changed and the fix (a tensor learning rate, a buffer).

    Examples:
        >>> import warnings, torch, gtransform as gt
        >>> f = gt.graphify(lambda x, s: x * s)
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     for i in range(20):
        ...         _ = f(torch.ones(2), float(i))
        >>> issubclass(w[0].category, gt.RerecordWarning)
        True
    """


class EagerWarning(UserWarning):
    """A graphified function ran its Python eagerly: this call was not recorded.

    Issued once per function and reason, where gtransform cannot record a call and
    runs it as eager PyTorch instead (correct, not faster): a call under a
    ``torch.func`` transform it does not record (``vmap``, ``jvp``, ``jacfwd``,
    ``hessian``) or with forward-mode dual tensors (``torch.func.linearize``,
    ``torch.autograd.forward_ad``). The message says how to get a recording, usually
    by graphifying the transformed function: ``gt.graphify(torch.func.vmap(f))``.
    ``f.describe()`` counts such calls.
    """


class PrintWarning(UserWarning):
    """A tensor printed inside a graphified function.

    While tracing it is a placeholder without values (``FakeTensor(..., size=(2,))``),
    and a replay runs no Python, so later calls print nothing. Return the value and
    print it outside; ``warnings.filterwarnings("ignore", category=gt.PrintWarning)``
    silences it.
    """


def not_a_module_error(desc: str, fn: object, name: str) -> AttributeError:
    """The AttributeError of ``graphify(model).name``: a graphified module is a function."""
    import torch

    if name.startswith("_") or not isinstance(fn, torch.nn.Module) or not hasattr(fn, name):
        return AttributeError(f"'Graphified' object has no attribute {name!r}")
    return AttributeError(
        f"{desc} is a function, not an nn.Module: it has no attribute {name!r} (the module "
        f"{type(fn).__name__} has). Reach the module itself (f.__wrapped__.{name}), and for "
        "torch.func.functional_call graphify a function that calls it: "
        "gt.graphify(lambda params, x: torch.func.functional_call(model, params, (x,))).")

"""Calls that run as eager PyTorch instead of a recording: why, counted, and never silently.

A call runs eagerly where it cannot (yet) be recorded: the first call of a signature that
touches state (by design: lazily made state exists before anything is recorded; not
warned of), a call whose trace raised the function's own exception (eager raises it
again, after eager's side effects before the raise), and calls gtransform does not record
at all (forward-mode AD, torch.func transforms other than grad and vmap, a signature
whose trace fails where eager runs). The last kind is counted by reason
(``f.describe()``) and warned of once per function with an :class:`EagerWarning`
naming the fix.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any, List, Tuple

import torch

from ._errors import EagerWarning, GraphifyError, user_frame
from ._log import log

__all__ = ["eager", "note", "ran_lazy", "trace_failed", "TRACE_FAILS", "FORWARD_AD", "BACKWARD_READS"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FAKE_KERNEL_DIRS = tuple(_TORCH_DIR + d
                          for d in ("_refs", "_prims", "_meta_registrations.py", "_decomp", "_subclasses",
                                    "_prims_common"))

TRACE_FAILS = (
    "with a signature whose trace fails where eager runs",
    "look at the traceback of f.trace(...) with the same arguments: code that behaves otherwise on the "
    "trace's placeholders (fake tensors without data, e.g. a check of torch.compiler.is_compiling()), or an "
    "operation torch's fake kernels cannot run; move that part out of the graphified function.",
)
BACKWARD_READS = (
    "differentiated through a custom autograd function whose backward reads values on the host, under "
    "on_break",
    "keep the backward on the device to record it (torchdiffeq: odeint instead of odeint_adjoint), or "
    "torch.compile(fn, backend=\"gtransform\") to record the pieces between the reads.",
)
FORWARD_AD = (
    "with forward-mode dual tensors (torch.func.linearize, torch.autograd.forward_ad)",
    "graphify the transformed function instead: gt.graphify(lambda x, t: torch.func.jvp(f, (x,), (t,))) "
    "records the forward and its tangent, and for linearize, out, jvp_fn = torch.func.linearize(f, x); "
    "gt.graphify(jvp_fn).",
)


def eager(g: Any, st: Any, args: Any, kwargs: Any) -> Any:
    """A call the lookup left unrecorded (``_lookup`` returned no entry), run eagerly (as the caller passed it).

    After a trace that raised the function's own exception (a shape check, an assert),
    eager raises it again, with eager's side effects before the raise (a counter or an
    input updated in place), which the trace, on placeholders, did not make. Where eager
    runs fine instead, the exception was the trace's own (code that behaves otherwise on
    fake tensors): that signature runs eagerly from now on, with a warning.
    """
    key = st.raised
    if key is None:
        if st.eager_now:  # a signature marked to run eagerly (below)
            st.eager_now = False
            g._eager_calls[TRACE_FAILS[0]] = g._eager_calls.get(TRACE_FAILS[0], 0) + 1
        return g._fn(*args, **kwargs)
    st.raised = None
    out = g._fn(*args, **kwargs)  # eager's exception propagates from here
    st.eager_only.add(key)
    note(g, TRACE_FAILS, f" (the trace raised {st.raised_what})")
    return out


def note(g: Any, reason: Tuple[str, str], detail: str = "") -> None:
    """Count a call of ``g`` that runs eagerly, and warn of the function's first with an EagerWarning."""
    what, fix = reason
    first = not g._eager_calls
    g._eager_calls[what] = g._eager_calls.get(what, 0) + 1
    if first:
        fr = user_frame()
        warnings.warn_explicit(
            EagerWarning(f"{g._desc}: called {what}{detail}, which gtransform does not record: the "
                         "function runs eagerly (correct, not faster; shown once per function, "
                         f"f.describe() counts such calls). Fix: {fix}"),
            EagerWarning, getattr(fr, "filename", "<unknown>") or "<unknown>", getattr(fr, "lineno", 0) or 0)





def ran_lazy(g: Any, lazy: List[str]) -> None:
    """Lazy modules (nn.LazyLinear) make their parameters in their first forward: that call runs eagerly."""
    g._lazy_calls += 1
    if g._lazy_calls == 2:
        # a lazy module the calls never run (an unused head): never recorded, silently
        log.warning("%s: %s still not initialised after %d calls: every call runs eagerly (nothing "
                    "is recorded) until they are. Fix: run each lazy module once (a forward on an "
                    "example input) or replace it by its non-lazy form.",
                    g._desc, ", ".join(lazy[:4]), g._lazy_calls)
    else:
        log.info("%s: %s not initialised yet: this call runs eagerly, the next one is traced",
                 g._desc, ", ".join(lazy[:4]))


def trace_failed(g: Any, st: Any, key: Any, err: Exception, in_paths: List[str],
                  tensors: List[torch.Tensor], record: bool) -> None:
    """A trace that raised something other than a GraphifyError: the call runs eagerly, or it is raised.

    The function's own exception (a shape check, an assert), or one torch's fake kernels
    raised (a bad view, a shape mismatch: the user's own, in their wording): the call runs
    eagerly, so that eager's side effects before the raise happen and eager's exception
    propagates unchanged (see :func:`eager`, which also handles an eager call that runs fine).
    """
    if isinstance(err, RuntimeError) and "leaf Variable that requires grad is being used in an in-place" in str(err):
        # the trace's stand-ins of inputs that require grad are leaves; the caller's may not be
        # (an eager backbone's output), where eager updates them in place
        nonleaf = [in_paths[i] for i, t in enumerate(tensors) if t.requires_grad and not t.is_leaf]
        if nonleaf:
            raise GraphifyError(
                f"{g._desc}: the function updates an input that requires grad in place "
                f"({', '.join(nonleaf)}, an output of earlier differentiable work).\nWhy: the trace "
                "stands for such an input with a leaf of its own, which autograd does not let a "
                "function update in place; in-place updates of inputs are not supported through the "
                "autograd wrapper of a recording.\nFix: make the update out of place "
                "(nn.ReLU(inplace=False), x = x + 1 instead of x += 1), or call the function under "
                "torch.no_grad() if no gradient is needed.") from None
    if not record or _raised_by_gtransform(err):
        raise err
    first = str(err).splitlines()[0][:200] if str(err) else ""
    st.raised = key
    if _raised_by_fake_kernels(err) or "NestedTensorImpl" in first:
        st.raised_what = f"{type(err).__name__} inside torch's fake kernels: {first}"
        if "NestedTensorImpl" in first or "nested" in first.lower():
            # (eager's nn.TransformerEncoder in eval mode without grad, given a padding mask, runs its
            # layers on a nested tensor and pads the output with zeros: a recording holds dense tensors)
            st.raised_what += ("; the function makes a nested tensor (nn.TransformerEncoder in eval mode without "
                               "grad, given src_key_padding_mask, does): recordings hold dense tensors only. To "
                               "record it, build the encoder with enable_nested_tensor=False (eager then leaves "
                               "the padded positions' outputs unmasked instead of zero)")
        log.info("%s: the trace failed inside torch's fake kernels (%s): this call runs eagerly",
                 g._desc, st.raised_what)
    else:
        st.raised_what = f"{type(err).__name__}: {first}"
        log.info("%s: the trace raised the function's own exception (%s): this call runs eagerly",
                 g._desc, st.raised_what)


def _raised_by_gtransform(err: BaseException) -> bool:
    """Whether an exception of the trace was raised by gtransform's own code (not the function's)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_PKG_DIR)


def _raised_by_fake_kernels(err: BaseException) -> bool:
    """Whether an exception of the trace comes from torch's fake or meta kernels."""
    frames = traceback.extract_tb(err.__traceback__)
    return (bool(frames) and frames[-1].filename.startswith(_TORCH_DIR)
            and any(f.filename.startswith(_FAKE_KERNEL_DIRS) for f in frames))

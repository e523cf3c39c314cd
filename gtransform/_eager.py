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

import warnings
from typing import Any, Tuple

from ._bind import run_eagerly
from ._errors import EagerWarning, user_frame

__all__ = ["eager", "note", "TRACE_FAILS", "FORWARD_AD"]

TRACE_FAILS = (
    "with a signature whose trace fails where eager runs",
    "look at the traceback of f.trace(...) with the same arguments: code that behaves otherwise on the "
    "trace's placeholders (fake tensors without data, e.g. a check of torch.compiler.is_compiling()), or an "
    "operation torch's fake kernels cannot run; move that part out of the graphified function.",
)
FORWARD_AD = (
    "with forward-mode dual tensors (torch.func.linearize, torch.autograd.forward_ad)",
    "graphify the transformed function instead: gt.graphify(lambda x, t: torch.func.jvp(f, (x,), (t,))) "
    "records the forward and its tangent, and for linearize, out, jvp_fn = torch.func.linearize(f, x); "
    "gt.graphify(jvp_fn).",
)


def eager(g: Any, st: Any, args: Any, kwargs: Any, statics: Any) -> Any:
    """A call the lookup left unrecorded (``_lookup`` returned no entry), run eagerly.

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
        return run_eagerly(g._fn, args, kwargs, statics)
    st.raised = None
    out = run_eagerly(g._fn, args, kwargs, statics)  # eager's exception propagates from here
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

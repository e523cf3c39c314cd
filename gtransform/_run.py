"""Running a bound call: its signature found (or traced), then replayed, differentiated or run eagerly.

The stage after ``_bind``. It asks ``_lookup`` for the entry of the call's signature and
the call's tensors (the caller's, then the state the function reads), then takes one of
three ways: the recording's replay (``_replay``), the autograd wrapper around it when
the call needs gradients (``_autograd``: ``loss.backward()``, ``torch.func.grad``), or
eager PyTorch where nothing may be recorded yet (``_eager``: a first call that touches
state, the function's own exception, forward-mode dual tensors), or as ``on_break`` says
where the signature's trace read the call's own data (``_breaks``: split by TorchDynamo, or eager).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, List, Optional, Tuple

import torch

from ._autograd import call_with_autograd, no_functorch, unwrap
from ._bind import Bound
from ._breaks import run_broken
from ._eager import BACKWARD_READS, FORWARD_AD, eager, note
from ._errors import GraphifyError
from ._lookup import entry_for
from ._replay import run_flat
from ._watch import FOR_GRAD

__all__ = ["run"]

_is_grad_enabled = torch.is_grad_enabled
_PLAIN = contextlib.nullcontext()


class _ForGrad:
    """The lookup of a call under ``torch.func.grad``: outside torch.func's interpreters, read as differentiated."""

    def __enter__(self) -> None:
        FOR_GRAD.on = True
        self.cm = no_functorch()
        self.cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.cm.__exit__(*exc)
        finally:
            FOR_GRAD.on = False


def run(g: Any, b: Bound, under_grad: bool) -> Any:
    """Run the bound call ``b`` of graphified ``g`` (``under_grad``: inside ``torch.func.grad``/``vjp``)."""
    if b.dual:
        note(g, FORWARD_AD)
        return g._fn(*b.args, **b.kwargs)
    br = g._breaks
    if br is not None and br.runner is not None and not under_grad:
        # on_break="split", once a signature split: every call goes to TorchDynamo, whose guards
        # and pieces take over the signatures (a step number passed each call is not a new one)
        return run_broken(g, b.args, b.kwargs)
    leaves: List[Any] = b.leaves
    tree: Optional[Tuple[Any, Any]] = b.tree
    mode: ContextManager[None] = _PLAIN
    if under_grad:
        # the signature is looked up on the tensors under torch.func's wrappers,
        # as the autograd wrapper's forward will see them
        leaves = [unwrap(x)[0] if isinstance(x, torch.Tensor) else x for x in b.leaves]
        tree, mode = None, _ForGrad()
    with mode:
        e, st, tensors = entry_for(g, leaves, b.spec, b.statics, tree)
    if e is None:
        if st.broke_now:  # a signature that reads its own data (on_break="split"/"eager")
            st.broke_now = False
            return run_broken(g, b.args, b.kwargs)
        return eager(g, st, b.args, b.kwargs)
    if under_grad:
        tensors = [b.leaves[i] for i in e.tpos] + e.held_state(tensors[e.n_user:])
    if under_grad or (e.any_rg and _is_grad_enabled()):
        try:
            out = call_with_autograd(g, e, tensors)
        except GraphifyError as err:
            if not (getattr(err, "gt_backward_reads", False) and g._options.on_break != "error" and not under_grad):
                raise
            # a custom backward that reads values on the host (odeint_adjoint): on_break runs the
            # call eagerly, before anything was replayed
            note(g, BACKWARD_READS, f" ({str(err).splitlines()[0][len(g._desc) + 2:]})")
            return g._fn(*b.args, **b.kwargs)
    else:
        out = e.plan.assemble(run_flat(g, e, st, tensors))
    for where, key, value in e.sets:  # (the Python values the function sets: see Entry.sets)
        where[key] = value
    for i, flag in e.plan.input_flags.items():  # (x.requires_grad_() inside: see Plan.input_flags)
        tensors[i].requires_grad_(flag)
    return out

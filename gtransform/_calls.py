"""The generic path of a call: which way it goes, stage by stage.

``Graphified.__call__`` tries the fast path of the last recording first; a miss comes
here. A plain call goes through the stages in order: bind (``_bind``: static arguments
apart, the leaves flattened) -> find or trace the signature (``_lookup``, which asks
``_key``) -> record and replay (``_replay``) -> the output tree (``Plan.assemble``, from
outputs handed out by ``_liveness``'s rules). A call that needs gradients takes the
autograd wrapper (``_autograd``) around the same stages; a call under ``torch.func.vmap``
replays a recording of the vmapped function (``_batching``); what cannot be recorded runs
eagerly, counted and warned of (``_eager``). Nothing here decides whether a recording
matches, records, or replays.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, Tuple

import torch

from ._autograd import call_with_autograd, no_functorch
from ._autograd import unwrap as unwrap_functorch
from ._batching import NOT_HANDLED, call_vmapped
from ._bind import flatten_args, run_eagerly
from ._eager import FORWARD_AD, eager, note
from ._lookup import entry_for
from ._replay import run_flat
from ._trace import tracing
from ._watch import FOR_GRAD

__all__ = ["call", "transformed", "opaque_to_dynamo"]

_is_grad_enabled = torch.is_grad_enabled
_fwad = torch.autograd.forward_ad  # its _current_level: -1 unless a dual level is open
_GRAD: Any
_VMAP: Any
try:
    _GRAD = torch._C._functorch.TransformType.Grad
    _VMAP = torch._C._functorch.TransformType.Vmap
except AttributeError:  # pragma: no cover
    _GRAD = _VMAP = None


def call(g: Any, args: Any, kwargs: Any, statics: Any) -> Any:
    """A plain call (no torch.func transform active) that the fast path did not serve."""
    if tracing():
        # called inside another graphified function's trace (its arguments are that
        # trace's fake tensors): inline it, like jax.jit inside jax.jit
        return run_eagerly(g._fn, args, kwargs, statics)
    leaves, spec = flatten_args(args, kwargs)
    if _fwad._current_level >= 0 and _any_tangent(leaves):
        note(g, FORWARD_AD)
        return run_eagerly(g._fn, args, kwargs, statics)
    e, st, tensors = entry_for(g, leaves, spec, statics, (args, kwargs))
    if e is None:
        return eager(g, st, args, kwargs, statics)
    if e.any_rg and _is_grad_enabled():
        return call_with_autograd(g, e, tensors)
    return e.plan.assemble(run_flat(g, e, st, tensors))


def transformed(g: Any, interp: Any, args: Any, kwargs: Any, statics: Any) -> Any:
    """A call under torch.func transforms.

    grad/vjp go through the autograd wrapper; vmap replays a recording of the vmapped
    function; the others (jvp...) run the function eagerly (correct, not recorded), with
    one :class:`EagerWarning` per function that says how to get a recording.
    """
    if tracing():
        return run_eagerly(g._fn, args, kwargs, statics)
    if interp.key() == _GRAD and _only_grad_transforms():
        return _under_grad(g, args, kwargs, statics)
    if interp.key() == _VMAP:
        out = call_vmapped(g, interp, args, kwargs, g._spawn_like)
        if out is not NOT_HANDLED:
            return out
    note(g, _transforms_reason())
    return run_eagerly(g._fn, args, kwargs, statics)


def _under_grad(g: Any, args: Any, kwargs: Any, statics: Any) -> Any:
    leaves, spec = flatten_args(args, kwargs)
    # the signature is looked up on the tensors under torch.func's wrappers,
    # as the autograd wrapper's forward will see them
    plain = [unwrap_functorch(x)[0] if isinstance(x, torch.Tensor) else x for x in leaves]
    FOR_GRAD.on = True
    try:
        with no_functorch():
            e, st, tensors = entry_for(g, plain, spec, statics)
    finally:
        FOR_GRAD.on = False
    if e is None:
        return eager(g, st, args, kwargs, statics)
    tensors = [leaves[i] for i in e.tpos] + e.held_state(tensors[e.n_user:])
    return call_with_autograd(g, e, tensors)


def _only_grad_transforms() -> bool:
    """Whether every active torch.func transform is grad/vjp (no vmap, jvp)."""
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        return all(i.key() == _GRAD for i in retrieve_all_functorch_interpreters())
    except Exception:  # pragma: no cover
        return False


def _any_tangent(leaves: Sequence[Any]) -> bool:
    """Whether a tensor leaf is a forward-mode dual (has a tangent at the open dual level)."""
    return any(isinstance(x, torch.Tensor) and _fwad.unpack_dual(x).tangent is not None for x in leaves)


def _transforms_reason() -> Tuple[str, str]:
    """What the active torch.func transforms are, and how to record them instead (see ``_eager.note``)."""
    try:
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        names = [i.key().name.lower() for i in retrieve_all_functorch_interpreters()]
    except Exception:  # pragma: no cover
        names = []
    listed = ", ".join(dict.fromkeys(names)) or "a transform"
    what = f"under torch.func.{names[0]}" if len(set(names)) == 1 else f"under torch.func transforms ({listed})"
    if "jvp" in names:
        fix = ("graphify the transformed function instead: gt.graphify(torch.func.jacfwd(f)), "
               "gt.graphify(torch.func.hessian(f)) or gt.graphify(lambda x, t: torch.func.jvp(f, (x,), (t,))) "
               "record the transform with the function.")
    elif set(names) == {"vmap"}:
        fix = ("graphify the batched function instead: gt.graphify(torch.func.vmap(f)) records it (as "
               "jax.jit(jax.vmap(f)) does).")
    else:
        fix = ("graphify the transformed function instead (e.g. gt.graphify(torch.func.vmap(f)), "
               "gt.graphify(torch.func.jacrev(f))): it records the transform with the function.")
    return what, fix


@functools.cache
def opaque_to_dynamo(call_code: Any) -> None:
    """Make torch.compile call graphified functions instead of tracing into them.

    Inside ``torch.compile`` a call of a graphified function (``call_code``: the code of
    ``Graphified.__call__``) is then a graph break that runs it as it is (record once,
    replay): dynamo cannot trace gtransform's machinery (weak references, a CUDA graph's
    replay), and leaves the call and everything it runs alone (no wrapper, so no per-call
    cost). Tracing imports dynamo anyway.
    """
    try:
        from torch._dynamo import trace_rules
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        trace_rules.add(__name__.rsplit(".", 1)[0])
        set_code_exec_strategy(call_code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # pragma: no cover - a torch without these
        pass

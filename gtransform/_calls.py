"""The generic path of a call: which way it goes.

``Graphified.__call__`` tries the fast path of the last recording first; a miss comes
here. A call inside another graphified function's trace is inlined; a plain call, or one
under ``torch.func.grad``/``vjp`` only, goes through the stages one after the other:
bind (``_bind``: static arguments apart, the leaves flattened) -> run (``_run``: find or
trace the signature with ``_lookup``, which asks ``_key``; then replay with ``_replay``,
the autograd wrapper of ``_autograd``, or eagerly with ``_eager``) -> the output tree
(``Plan.assemble``, from outputs handed out by ``_liveness``'s rules). A call under
``torch.func.vmap`` replays a recording of the vmapped function (``_batching``); other
transforms run eagerly, counted and warned of (``_eager``). Nothing here decides whether
a recording matches, records, or replays.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

from ._batching import NOT_HANDLED, call_vmapped
from ._bind import bind
from ._compat import TRANSFORM_GRAD as _GRAD
from ._compat import TRANSFORM_VMAP as _VMAP
from ._compat import load_dynamo_skip, retrieve_all_functorch_interpreters
from ._eager import note
from ._run import run
from ._sized import sized_call
from ._trace import tracing

__all__ = ["call", "opaque_to_dynamo"]


def call(g: Any, interp: Any, args: Any, kwargs: Any) -> Any:
    """A call the fast path did not serve (``interp``: the innermost torch.func transform, or None)."""
    if tracing():
        # called inside another graphified function's trace (its arguments are that
        # trace's fake tensors): inline it, like jax.jit inside jax.jit
        return g._fn(*args, **kwargs)
    if interp is None and g._sizes is not None:  # record_sizes= or buckets= (see _sized)
        return sized_call(g, g._sizes, args, kwargs)
    if interp is None or (interp.key() == _GRAD and _only_grad_transforms()):
        return run(g, bind(g, args, kwargs), interp is not None)
    if interp.key() == _VMAP:
        out = call_vmapped(g, interp, args, kwargs, g._spawn_like)
        if out is not NOT_HANDLED:
            return out
    # (jvp, jacfwd, ...: correct, not recorded; one EagerWarning per function says how to record)
    note(g, _transforms_reason())
    return g._fn(*args, **kwargs)


def _only_grad_transforms() -> bool:
    """Whether every active torch.func transform is grad/vjp (no vmap, jvp)."""
    try:
        return all(i.key() == _GRAD for i in retrieve_all_functorch_interpreters())
    except Exception:  # pragma: no cover
        return False


def _transforms_reason() -> Tuple[str, str]:
    """What the active torch.func transforms are, and how to record them instead (see ``_eager.note``)."""
    try:
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
        add_rule, set_code_exec_strategy, FrameAction, FrameExecStrategy = load_dynamo_skip()
        add_rule(__name__.rsplit(".", 1)[0])
        set_code_exec_strategy(call_code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # pragma: no cover - a torch without these
        pass

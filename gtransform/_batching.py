"""``torch.func.vmap`` over a graphified function, recorded: ``vmap(graphify(f))`` replays ``graphify(vmap(f))``.

Under vmap a call's tensors are batched tensors of the innermost vmap level. Where
every transform on the stack is a vmap, they are taken apart (the plain tensor and its
batch dimension), that level is popped, and a graphified ``vmap(f, in_dims=...)`` of
the same function is called on the plain tensors: a recording like any other, one per
argument structure, batch dimensions and randomness mode. Its outputs (batch dimension
0) go back into the level as batched tensors. As ``jax.jit`` inside ``jax.vmap``. Nested
vmaps take one level per call, down to a recording of ``vmap(vmap(f))``.

What it does not take (batched keyword arguments, static arguments, containers torch's
pytree does not know) runs eagerly with the caller's warning (see ``_api``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ._compat import add_batch_dim as _add_batch_dim
from ._compat import (
    coerce_cinterpreter,
    is_batchedtensor,
    maybe_get_level,
    retrieve_all_functorch_interpreters,
    temporarily_pop_interpreter_stack,
)
from ._compat import torch_pytree as pytree
from ._compat import unwrap_batched as _unwrap_batched

__all__ = ["call_vmapped", "NOT_HANDLED"]

NOT_HANDLED = object()

_SIMPLE = (int, float, bool, str, complex, type(None), torch.dtype, torch.device)


def _only_vmaps() -> bool:
    try:
        return all(i.key().name == "Vmap" for i in retrieve_all_functorch_interpreters())
    except Exception:  # pragma: no cover
        return False


def _take_apart(x: Any, level: int) -> Tuple[Any, Optional[int]]:
    """A leaf's plain value and its batch dimension at ``level`` (None: not batched there)."""
    if isinstance(x, torch.Tensor) and is_batchedtensor(x) and maybe_get_level(x) == level:
        v, bd = _unwrap_batched(x, level)
        return v, bd
    return x, None


def call_vmapped(owner: Any, cinterp: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 make: Callable[[Callable[..., Any]], Any]) -> Any:
    """Call graphified ``owner`` under a vmap level as a recording of the vmapped function.

    Args:
        owner: the graphified function (its ``_fn`` and its cache of vmapped helpers).
        cinterp: the innermost functorch interpreter (a vmap's).
        args: the call's positional arguments.
        kwargs: its keyword arguments (passed unbatched, as vmap passes them).
        make: graphifies a function with the owner's options.

    Returns:
        The outputs as batched tensors of the level, or :data:`NOT_HANDLED`.
    """
    if owner._has_static or not _only_vmaps():
        return NOT_HANDLED
    interp: Any = coerce_cinterpreter(cinterp)
    level = interp.level()
    leaves, spec = pytree.tree_flatten(args)
    if not all(isinstance(x, (torch.Tensor,) + _SIMPLE) for x in leaves):
        return NOT_HANDLED
    if any(_take_apart(x, level)[1] is not None for x in pytree.tree_leaves(kwargs)):
        return NOT_HANDLED  # (vmap passes keyword arguments unbatched)
    parts = [_take_apart(x, level) for x in leaves]
    dims = tuple(bd for _, bd in parts)
    if all(bd is None for bd in dims):
        return NOT_HANDLED
    randomness = interp.randomness()
    key = (spec, dims, randomness)
    helper = owner._vmapped.get(key)
    if helper is None:
        fn = owner._fn
        in_dims = pytree.tree_unflatten(list(dims), spec)

        def batched(*a: Any, **kw: Any) -> Any:
            return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*a, **kw)

        batched.__name__ = batched.__qualname__ = f"vmap({getattr(fn, '__name__', 'fn')})"
        helper = owner._vmapped[key] = make(batched)
    plain = pytree.tree_unflatten([v for v, _ in parts], spec)
    with temporarily_pop_interpreter_stack():
        out = helper(*plain, **kwargs)
    return pytree.tree_map(lambda t: _add_batch_dim(t, 0, level) if isinstance(t, torch.Tensor) else t, out)

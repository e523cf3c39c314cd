"""``f.input_buffers(...)``: the static input buffers of a signature's recording, handed to the caller.

It takes a call's arguments, binds them (``_bind``), finds or traces their signature
(``_lookup``) and records it if it is not yet (``_replay.hand_out``: the example values
are copied into the buffers; nothing is replayed), then returns the arguments' tree with
each tensor the recording copies replaced by its static buffer. Tensors the recording
reads in place (parameters, state, inputs passed as the same objects) are the caller's
own. From then on a call that passes a buffer itself skips its copy (``_handed``).
It never runs the function (beyond the CUDA warm-up of a recording) nor writes a
tensor of the caller.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ._bind import bind, rebuild
from ._errors import GraphifyError
from ._lookup import entry_for, thread_state
from ._replay import hand_out
from ._sized import refuse_buffers
from ._switch import OFF
from ._tree import flatten_args, unflatten

__all__ = ["input_buffers"]


def input_buffers(g: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The arguments' tree with the recording's static buffers in place of the tensors it copies (see module)."""
    if OFF.on:  # gt.disable(): nothing is recorded; buffers of the caller's own are as good
        leaves, spec = flatten_args(args, kwargs)
        own = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        return _shape(unflatten(spec, own), kwargs)
    b = bind(g, args, kwargs)
    if g._sizes is not None:  # record_sizes= / buckets=: a size served by no recording of its own has none
        refuse_buffers(g, g._sizes, b, args, kwargs)
    if b.dual:
        raise TypeError(f"{g._desc}.input_buffers(...): an argument is a forward-mode dual tensor; such calls run "
                        "eagerly and have no buffers. Fix: pass the primal tensors.")
    hits = g._hits
    st = thread_state(g)
    warmed, pending = set(st.warmed.d), set(st.pending)
    e, st, tensors = entry_for(g, b.leaves, b.spec, b.statics, b.tree)
    g._hits = hits  # (a look-up, not a call)
    if e is None:
        # (asking ran nothing: the signature's first call still runs eagerly, and the same ask
        # is refused again until it has)
        for key in [k for k in st.warmed.d if k not in warmed]:
            st.warmed.discard(key)
        for key in [k for k in st.pending if k not in pending]:
            del st.pending[key]
        raise GraphifyError(
            f"{g._desc}.input_buffers(...): this signature is not recorded yet, and cannot be recorded without "
            "running the function: it reads state on its first call (which runs eagerly), or runs eagerly or "
            "through torch.compile by on_break. Fix: call the function once with these arguments first, then "
            "ask for its buffers (a signature that runs eagerly has none).")
    if e.any_rg and torch.is_grad_enabled():
        raise ValueError(
            f"{g._desc}.input_buffers(...): a call with these arguments needs gradients, and goes through "
            "the autograd wrapper, whose recordings copy their inputs. Fix: ask (and call) under "
            "torch.no_grad(), or pass tensors that do not require grad.")
    rec = hand_out(g, e, st, tensors)
    leaves = list(b.leaves)
    full = dict(zip(rec.copy_idx, rec.full_bufs))
    for k, pos in enumerate(e.tpos):
        if k in full:
            leaves[pos] = full[k]
    dyn, kw = unflatten(b.spec, leaves)
    pos_args, static_kw = rebuild(dyn, b.statics)
    kw.update(static_kw)
    return _shape((pos_args, {k: kw[k] for k in kwargs}), kwargs)


def _shape(tree: Tuple[Any, Dict[str, Any]], kwargs: Dict[str, Any]) -> Any:
    """The positional arguments alone, or ``(args, kwargs)`` where keyword arguments were passed."""
    return tree if kwargs else tree[0]

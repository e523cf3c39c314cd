"""The copy-in and copy-back of a recording whose inputs may be its own buffers, or donated.

``f.input_buffers(...)`` hands a recording's static input buffers to the caller (see
``_buffers``): a call that passes one of them (that very tensor, or one at its address:
the signature fixes the layout) needs no copy into it, and no copy back of an in-place
update (the function updated the buffer itself, which is the caller's tensor). Inputs
donated with ``donate_argnums`` / ``donate_argnames`` that were copied in give their
memory back right after the copy-in (where nothing else shares it) and are invalidated
after the replay; an in-place update is not copied back into memory that was given back.

Only recordings that handed out their buffers or have donated inputs take these steps
(``Recording.special``); every other call copies as it did (``Recording.run_flat``).
What this module never does: decide which inputs are copied (``_replay``), or write
into a tensor the caller passed other than the in-place updates eager makes.
"""

from __future__ import annotations

from typing import Any, FrozenSet, List, Sequence, Set, Tuple

import torch

from ._compat import storage_use_count, tensor_use_count
from ._liveness import StaleOutput, poison_tensor, take_back
from ._tree import flatten, unflatten

__all__ = ["copy_in", "copy_back", "invalidate", "donated_message", "skip_set", "donated_inputs"]

_Tensor = torch.Tensor


def copy_in(rec: Any, tensors: Sequence[torch.Tensor]) -> Tuple[Set[int], List[int], Set[int]]:
    """Copy into the static buffers the inputs that are not these buffers; give donated memory back.

    Returns:
        The inputs that were their own buffers (no copy), the donated inputs to
        invalidate after the replay, and those among them whose memory was given back.
    """
    own: Set[int] = set()
    dsts: List[torch.Tensor] = []
    srcs: List[torch.Tensor] = []
    full, sources = rec.full_bufs, rec.copy_sources(tensors)  # (broadcast inputs narrowed, as the usual copy-in)
    for k, i in enumerate(rec.copy_idx):
        t = tensors[i]
        if rec.handed and (t is full[k] or t.data_ptr() == full[k].data_ptr()):
            own.add(i)
            continue
        dsts.append(rec.bufs[k])
        srcs.append(sources[k])
    if dsts and rec.handed:
        # a buffer passed in another input's place (f(b1, b0)) is read before any buffer is written
        written = {d.untyped_storage().data_ptr() for d in dsts}
        srcs = [s.clone() if s.untyped_storage().data_ptr() in written else s for s in srcs]
    if dsts:
        rec.copier(dsts, srcs)
    if not rec.donate_idx:
        return own, [], set()
    gone = [i for i in rec.donate_idx if i not in own and type(tensors[i]) is _Tensor
            and not any(x is tensors[i] for j, x in enumerate(tensors) if j != i)]
    freed = set()
    for i in gone:
        st = tensors[i].untyped_storage()
        # memory of its own only: not a pool output's alias, nor one the caller holds views of
        # (and no DLPack export of it, torch.from_dlpack(x) or a JAX array, which holds the tensor)
        if st.resizable() and storage_use_count(st._cdata) == 2 and _held_once(tensors[i]):  # (the tensor's, and st's)
            st.resize_(0)
            freed.add(i)
    return own, gone, freed


def _held_once(t: torch.Tensor) -> bool:
    """Whether nothing but its Python object holds the tensor (a DLPack export holds it too)."""
    return tensor_use_count is not None and tensor_use_count(t) == 1


def copy_back(rec: Any, tensors: Sequence[torch.Tensor], skip: Set[int]) -> None:
    """Copy in-place updates back into the inputs that were not their buffers nor gave their memory back."""
    pairs = [(tensors[i], b) for i, b in zip(rec.cb_idx, rec.cb_bufs) if i not in skip]
    if not pairs:
        return
    targets = [t for t, _ in pairs]
    bufs = [b for _, b in pairs]
    try:
        rec.cb_copier(targets, bufs)
    except RuntimeError:  # an output of an earlier call fed back in (poisoned), or a conj / neg bit
        for t, b in pairs:
            if type(t) is StaleOutput:
                take_back(t, keep_values=False)
            t.copy_(b)


def invalidate(rec: Any, tensors: Sequence[torch.Tensor], gone: List[int]) -> None:
    """Make the donated inputs of this call raise when touched (see :func:`donated_message`)."""
    for i in gone:
        poison_tensor(tensors[i], donated_message(rec.desc, rec.plan.in_paths[i]))


def donated_message(desc: str, path: str) -> str:
    """The message a donated input raises with once invalidated."""
    return (f"{desc}: this tensor ({path}) was donated to a call (donate_argnums / donate_argnames): "
            "the call took its values and gave its memory back, so it has no values any more.\n"
            "Fix: do not use a donated argument after the call, or drop it from donate_argnums / "
            "donate_argnames (or pass a .clone()).")


def skip_set(own: Set[int], freed: Set[int]) -> Set[int]:
    """The inputs whose in-place update is not copied back: their own buffers, and memory given back."""
    return own | freed if freed else own


def donated_inputs(g: Any, e: Any) -> FrozenSet[int]:
    """The indices, among a call's tensors, of the tensor leaves of ``g``'s donated arguments in signature ``e``."""
    nums, names = g._options.donate_argnums, g._options.donate_argnames
    if not nums and not names:
        return frozenset()
    args, kwargs = unflatten(e.spec, list(range(e.n_leaves)))
    leaves: Set[int] = set()
    for n in nums:
        # (static arguments before it, passed by position as it is, are not among the leaves)
        p = n - sum(1 for s in g._static_argnums if s < n)
        if 0 <= p < len(args):
            leaves.update(flatten(args[p])[0])
    for name in names:
        if name in kwargs:
            leaves.update(flatten(kwargs[name])[0])
    return frozenset(k for k, pos in enumerate(e.tpos) if pos in leaves)

"""Output memory shared by the recordings of one CUDA pool.

Every signature of a graphified function (and every function sharing its pool,
``gt.graph_pool()``) records its first output generation into the function's CUDA
graph pool. Each recording's outputs used to stay allocated there for good, so a
server that sees 64 batch sizes held 64 sets of outputs (GPT-2's logits: 12.7 GB where
eager peaks at 0.4). The rule of outputs allows more: an output is valid only until
the next call of any function of the pool. So before a new signature is captured
into the pool, the outputs that nobody holds of the pool's other recordings go back
to the pool (:func:`give_back_idle`), and the new capture may lie over them, as
torch's cudagraph trees let one generation's graphs share memory. (Not in a pool that
``gt.graph_pool()`` shares across threads: there another thread may be reading an output,
past its poison check, while this thread's call writes the memory.)

How a recording gives its outputs back (:func:`give_back`): its output groups are
rebuilt over the same addresses with tensors that do not own them
(``__cuda_array_interface__``), its output objects are moved onto them (the same
objects: a dropped output is still handed out again), and its own references to the
captured (owning) tensors are dropped; the allocator then frees those blocks into the
pool. Its graph
keeps writing those addresses on each replay, which overwrites whatever later
recordings of the pool put there: their outputs, which that call poisons anyway
(``PoolState.begin_call``), or their intermediates. What must not be overwritten:

* memory someone holds: a recording gives back only outputs that no object, view or
  autograd graph outside gtransform holds (their reference and use counts are ours);
* state a function leaves in Python (``p.grad``, ``self.cache = y``; the recording's
  escapes): recordings with escapes never give back, and one captured into a pool
  that has memory given back takes a private pool of its own;
* views the caller derived from outputs in the pool's shared memory: while one lives,
  no recording replays its generation there (``PoolState.shared_pins``,
  ``Recording._maybe_retire``), and a new signature is captured into a private pool.

The static input buffers of the pool's recordings share memory too (:func:`input_buffer`):
a call copies its inputs in just before its replay reads them, so what the last call of
another signature left there is never read. One block per input position serves every
size (a new, larger one is made when a larger size comes: the old recordings keep theirs).
Not where the caller was handed the buffers (``f.input_buffers``: they write a call's
inputs there ahead of it) nor in a pool shared across threads.

The memory stays with the device while any tensor over it lives: each non-owning
tensor holds the pool's keeper graph (see ``_record._function_pool``). A recording
that gave back and is closed (``cache_clear``, LRU) copies the outputs the caller
still holds to memory of their own, and its views' memory stays pinned.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from typing import Any, List, Tuple

import torch

from ._compat import storage_use_count as _use_count
from ._liveness import OutputGroup, StaleOutput, take_back

__all__ = ["give_back_idle", "give_back", "join", "needs_private_pool", "keep_held_on_close",
           "input_buffers_shared", "input_buffer"]

_getrefcount = sys.getrefcount


class _Address:
    """A device byte range as ``__cuda_array_interface__``: ``torch.as_tensor`` makes a tensor over it that owns nothing.

    It holds the pool's keeper (an empty graph captured into the pool), so the pool,
    and this memory with it, stays with the device while any tensor over it lives.
    """

    __slots__ = ("__cuda_array_interface__", "keeper")

    def __init__(self, ptr: int, nbytes: int, keeper: Any):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}
        self.keeper = keeper


def needs_private_pool(pool: Any, rec: Any) -> bool:
    """Whether ``rec``'s first generation must be captured outside the function's pool.

    Views of outputs in the pool's shared memory are alive, or the caller holds outputs of
    the last call over memory given back (the warm-up and the capture run before this
    call's start poisons or takes them back, and would write over them), or ``rec``
    leaves state in Python and some memory of the pool was given back (a replay of that
    memory's first owner would overwrite the state).
    """
    if pool.shared_pins and pool.shared_pinned():
        return True
    if not pool.released:
        return False
    if rec.escapes is not None:
        return True
    for h in pool.outstanding:
        ref = h.owner
        owner = ref() if ref is not None else None
        if (owner is None or owner.released) and h.objs and not h.idle():
            return True
    return False


def join(pool: Any, rec: Any) -> None:
    """``rec``'s first generation was captured in the function's pool: it may give back and take others' memory."""
    pool.members = [r for r in pool.members if r() is not None]
    pool.members.append(weakref.ref(rec))


def give_back_idle(pool: Any, rec: Any) -> None:
    """Before ``rec`` is captured into the function's pool: the pool's other recordings give back what nobody holds.

    Not in a pool shared across threads (``gt.graph_pool()``): there another thread may read
    an output (past its poison check) while this thread's call writes memory given back.
    """
    if rec.escapes is not None or pool.lock is not None:
        return
    for ref in list(pool.members):
        other = ref()
        if other is not None and other is not rec and give_back(other):
            pool.released = True


def give_back(rec: Any) -> bool:
    """Give ``rec``'s first generation's output memory back to the pool if nobody holds it (see the module docstring).

    Returns:
        Whether it did.
    """
    pool = rec.pool
    if (rec.released or rec.escapes is not None or len(rec.ring) != 1 or rec._pending_adopt is not None
            or not rec.groups or pool.keeper is None or rec.fpool is None or tuple(rec.fpool) != tuple(pool.cuda_pool)):
        return False
    slot = rec.ring[0]
    h = rec.handout
    if slot.pool_id is not None or slot.handout is not h or not h.idle():
        return False
    groups: List[OutputGroup] = []
    for g in rec.groups:
        st = g.base.untyped_storage()
        if st.nbytes() == 0:
            return False
        raw = torch.as_tensor(_Address(st.data_ptr(), st.nbytes(), pool.keeper), device=g.device)
        groups.append(OutputGroup(raw.untyped_storage(), g.members))
    h.move_to(groups)
    outs = list(slot.outs)
    starts = h.starts
    for k, m in rec.slots.items():
        gi = bisect.bisect_right(starts, m) - 1
        size, stride, offset, dtype = groups[gi].members[m - starts[gi]]
        outs[k] = torch.empty(0, dtype=dtype, device=groups[gi].device).set_(
            groups[gi].base.untyped_storage(), offset, size, stride)
    rec.groups = slot.groups = groups
    slot.outs = outs
    rec._activate(slot)
    rec.released = True
    return True


def keep_held_on_close(rec: Any) -> None:
    """A recording that gave back is closed: what the caller holds of its given-back memory stays right.

    Objects of its last call the caller holds get memory of their own (values copied); views'
    memory stays pinned in the pool (``PoolState.shared_pins``), since later recordings may
    write there.
    """
    h = rec.ring[0].handout if rec.ring else None
    if h is None or not h.objs:
        return
    for o, r, b in zip(h.objs, list(map(_getrefcount, h.objs)), h.rc_base):
        if r != b and type(o) is not StaleOutput:
            take_back(o, keep_values=True)
    starts = h.starts
    for gi, (u, b) in enumerate(zip(map(_use_count, h.cdatas), h.uc_base)):
        if u > b:
            rec.pool.shared_pins.append((h.cdatas[gi], b, h.storages[gi], h.objs[starts[gi]:starts[gi + 1]]))


def input_buffers_shared(pool: Any, reuse: Any) -> bool:
    """Whether a new recording's static input buffers may lie over the pool's shared input memory (see module).

    Args:
        pool: the recording's pool (one shared across threads shares no buffers).
        reuse: the buffers ``f.input_buffers`` handed out for the signature (None: none were,
            nor will be for this recording).
    """
    return reuse is None and pool.lock is None


def input_buffer(pool: Any, index: int, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A static buffer with ``t``'s size and (dense) strides over the pool's memory for input ``index``.

    Returns:
        The buffer, and the whole block it lies in: the recording keeps the block (the pool
        refers to it weakly, so the memory goes with the last recording using it). A size
        larger than the block makes a new block, half as large again as the old one, so that
        a stream of growing sizes makes few.
    """
    key = (index, t.dtype, t.device)
    ref = pool.inputs.get(key)
    whole = ref() if ref is not None else None
    n = t.numel()
    if whole is None or whole.numel() < n:
        cap = n if whole is None else max(n, whole.numel() * 3 // 2)
        whole = torch.empty(cap, dtype=t.dtype, device=t.device)
        pool.inputs[key] = weakref.ref(whole)
    return whole.as_strided(t.shape, t.stride(), 0), whole

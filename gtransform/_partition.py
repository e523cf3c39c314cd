"""Partitioned forward and backward for differentiating through a recording.

For a signature and a set of inputs to differentiate, AOTAutograd traces the
joint forward+backward graph of the signature's aten graph, and the default
partitioner splits it into a forward that also returns the activations the
backward needs ("saved") and a backward that takes them with the output
gradients. Each half is recorded as a graphified function of its own, so the
saved activations live in the forward recording's pool.

A saved activation is handed to autograd as a fresh alias of pool memory; if
autograd still holds it when the forward replays again (two forwards before
a backward), the forward moves its outputs to new memory first (the same
pinning that protects views the caller derived), so a backward never reads
overwritten activations.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["Partition", "build_partition"]


class Partition:
    """The recorded forward and backward of one signature."""

    def __init__(self, fw: Any, bw: Any, n_out: int, n_saved: int, diff_out: List[bool], bw_gm: Any):
        self.fw = fw
        self.bw = bw
        self.n_out = n_out
        self.n_saved = n_saved
        self.diff_out = diff_out  # outputs that receive a gradient (tangent)
        self.bw_gm = bw_gm  # for eager use under vmap (jacrev)


def _flat_fn(gm: Any, name: str) -> Any:
    def run(*args: torch.Tensor) -> tuple:
        return tuple(gm(*args))

    run.__name__ = run.__qualname__ = name
    return run


def build_partition(plan: Any, metas: Sequence[Any], need: Sequence[bool], owner: Any) -> Optional[Partition]:
    """Partition ``plan``'s graph for the inputs in ``need``; ``None`` if it cannot be.

    Args:
        plan: the traced signature.
        metas: ``tensor_meta`` of each tensor input.
        need: which inputs are differentiated.
        owner: the graphified function (for its name and ``fuse`` option).

    Returns:
        A :class:`Partition`, or ``None`` when the graph does not fit (outputs
        that alias inputs, a trace the partitioner rejects): the caller then
        recomputes the forward inside the backward recording instead.
    """
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._functorch.partitioners import default_partition

    if any(e.kind == "input" for e in plan.out_entries) or plan.escape_slots:
        return None

    mode = FakeTensorMode()
    with mode:
        args = []
        for (_typ, shape, stride, dtype, device, _rg), n in zip(metas, need):
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            args.append(t.requires_grad_(bool(n)))
        with torch.enable_grad():
            outs = plan.gm(*args)
        diff_out = [bool(o.requires_grad) for o in outs]
    n_out = len(outs)
    joint: Any = aot_export_joint_simple(_flat_fn(plan.gm, "forward"), tuple(args), trace_joint=True)
    fw_gm, bw_gm = default_partition(joint, args, num_fwd_outputs=n_out)
    n_fw = len([n for n in fw_gm.graph.nodes if n.op == "output"][0].args[0])
    n_saved = n_fw - n_out
    n_tangents = len([n for n in bw_gm.graph.nodes if n.op == "placeholder"]) - n_saved
    if n_tangents != sum(diff_out):
        return None
    fw = owner._spawn(_flat_fn(fw_gm, f"forward of {owner._desc}"))
    bw = owner._spawn(_flat_fn(bw_gm, f"backward of {owner._desc}"))
    return Partition(fw, bw, n_out, n_saved, diff_out, bw_gm)

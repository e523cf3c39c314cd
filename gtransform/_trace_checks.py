"""Checks of a trace's outcome that concern what the caller sees, and how its outputs relate.

Run by ``_trace.Trace`` once the function returned: containers it was passed and changed
(refused: it ran on rebuilt copies), DistributedDataParallel's forward with its backward
outside (refused: its gradient hooks run in Python), outputs that require grad made after
the function's own backward (``Plan.after_backward``), and outputs that are views of other
outputs or the same tensor twice (``Plan.out_views``, rebuilt by ``_autograd``).
"""

from __future__ import annotations

from dataclasses import is_dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._compat import FakeTensor
from ._errors import GraphifyError
from ._tree import unflatten
from ._watch import storage_extent

__all__ = ["arg_containers", "arg_containers_kept", "no_ddp_forward", "made_after_backward", "output_views"]


def no_ddp_forward(desc: str, reads: Any, fnwatch: Any) -> None:
    """Refuse a differentiable call of ``DistributedDataParallel``'s forward whose backward runs outside.

    DDP arms its gradient all-reduce in Python, in its forward (``reducer.prepare_for_backward``),
    which a replay does not run: the ranks' gradients would not be reduced, and their
    parameters would drift apart silently.
    """
    if not torch.is_grad_enabled() or fnwatch.backward_calls:
        return
    ddp_type = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    if ddp_type is None:
        return
    mods = list(getattr(reads, "mods", ())) + list(getattr(reads, "called", ()))
    ddp = next((m for m in mods if isinstance(m, ddp_type) and getattr(m, "require_backward_grad_sync", True)
                and any(p.requires_grad for p in m.parameters())), None)
    if ddp is not None:
        raise GraphifyError(
            f"{desc}: the function calls DistributedDataParallel's forward, and its backward runs outside "
            "the function.\nWhy: DDP arms its gradient all-reduce in Python during its forward "
            "(reducer.prepare_for_backward); a replay runs none of it, so the ranks' gradients would not "
            "be averaged and their parameters would drift apart.\n"
            "Fix: torch.compile(ddp, backend=\"gtransform\") (TorchDynamo keeps DDP's hooks and records the "
            "rest), graphify the wrapped module (ddp.module) and all-reduce the gradients yourself, or "
            "call it under torch.no_grad() for inference."
        )


def arg_containers(args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """The containers inside the arguments, each with its path and a shallow copy of what it holds.

    The function is called on containers rebuilt around the trace's tensors (``_lookup``): a
    change it makes to one (``state["h"] = h``, ``cache.append(t)``, ``dc.n += 1``) would
    reach the caller's in eager and be lost here (see :func:`arg_containers_kept`).
    """
    out: List[Tuple[str, Any, Any]] = []

    def walk(x: Any, path: str, depth: int) -> None:
        if depth > 32 or len(out) > 4096:
            return
        if type(x) is dict or isinstance(x, dict):
            out.append((path, x, list(x.items())))
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(x, list):
            out.append((path, x, list(x)))
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]", depth + 1)
        elif isinstance(x, tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]", depth + 1)
        elif is_dataclass(x) and not isinstance(x, type) and hasattr(x, "__dict__"):
            out.append((path, x, list(vars(x).items())))
            for k, v in vars(x).items():
                walk(v, f"{path}.{k}", depth + 1)

    for i, a in enumerate(args):
        walk(a, f"args[{i}]", 0)
    for k, v in kwargs.items():
        walk(v, f"kwargs[{k!r}]", 0)
    return out


def arg_containers_kept(desc: str, containers: Sequence[Tuple[str, Any, Any]]) -> None:
    """Refuse a function that changed a container it was passed (see :func:`arg_containers`)."""
    for path, c, before in containers:
        if _same_contents(c, before):
            continue
        what = ("a list" if isinstance(c, list) else "a dict" if isinstance(c, dict)
                else f"a {type(c).__name__}")
        raise GraphifyError(
            f"{desc}: the function changes {_first_change(path, c, before)} of {path}, {what} it was "
            "passed.\n"
            "Why: graphify calls the function on containers rebuilt around the traced tensors; eager "
            "changes the caller's container on every call, a replay runs none of the function's "
            "Python, so the caller's would stay as it was.\n"
            "Fix: return the new values and store them outside the function, or keep them in state "
            "the function reaches without taking it as an argument (a module attribute, a closed-over "
            "dict), which graphify writes back after every call."
        )


def _first_change(path: str, c: Any, before: Sequence[Any]) -> str:
    """What changed in container ``c``: ``args[0]['h'] (set)``, ``the length (2 -> 3)``."""
    if isinstance(c, list):
        if len(c) != len(before):
            return f"the length ({len(before)} -> {len(c)})"
        i = next(i for i, (a, b) in enumerate(zip(c, before)) if a is not b)
        return f"{path}[{i}] (set)"
    old = dict(before)
    now = dict(c.items()) if isinstance(c, dict) else dict(vars(c))
    sep = "[{!r}]" if isinstance(c, dict) else ".{}"
    for k in list(now) + [k for k in old if k not in now]:
        if k not in old or k not in now or now[k] is not old[k]:
            how = "added" if k not in old else "removed" if k not in now else "set"
            return f"{path}{sep.format(k)} ({how})"
    return "the order of its items"


def _same_contents(c: Any, before: Sequence[Any]) -> bool:
    """Whether container ``c`` holds the very objects it held (``before``: its items then)."""
    if isinstance(c, list):
        return len(c) == len(before) and all(a is b for a, b in zip(c, before))
    now = list(c.items()) if isinstance(c, dict) else list(vars(c).items())
    return len(now) == len(before) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(now, before))


def made_after_backward(spec: Any, leaves: Sequence[Any], fnwatch: Any) -> List[str]:
    """The paths of outputs that require grad and were made after the function's last backward."""
    if not fnwatch.backward_calls:
        return []
    from ._tree import leaf_paths

    paths = leaf_paths(unflatten(spec, list(range(len(leaves)))), "output")
    return [p for p, leaf in zip(paths, leaves) if isinstance(leaf, FakeTensor) and leaf.requires_grad
            and leaf.__dict__.get("_gt_op", -1) > fnwatch.backward_end]


def output_views(vals: Sequence[torch.Tensor], entries: Sequence[Any]) -> List[Tuple[int, int, str]]:
    """Tensor outputs the function returned twice, or as views inside another output's memory.

    ``return y, y`` is one object in eager, ``return h, h[:, -1]`` a view of ``h``: an
    in-place change of one and the gradient through the other follow from that.
    Returns ``(j, i, how)`` per such output ``j`` of the base output ``i`` (one that requires
    grad first, then the one reaching furthest into the memory): ``how`` is ``"same"`` (the
    same object), ``"view"`` (its view, gradients flowing through it) or ``"detached"``
    (``h.detach()`` returned beside ``h``: its memory, no gradient) or ``"leaf"`` (a new leaf
    over its memory, ``h.detach().requires_grad_()``: its gradient is its own).
    """
    pool: List[Tuple[int, torch.Tensor]] = [
        (j, v) for j, (v, e) in enumerate(zip(vals, (e for e in entries if e.kind != "const")))
        if e.kind == "pool" and isinstance(v, FakeTensor)]
    groups: Dict[Any, List[Tuple[int, torch.Tensor]]] = {}
    for j, v in pool:
        groups.setdefault(StorageWeakRef(v.untyped_storage()), []).append((j, v))
    out: List[Tuple[int, int, str]] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ext = {j: storage_extent(v) for j, v in members}
        i, base = max(members, key=lambda m: (m[1].requires_grad, ext[m[0]][1] - ext[m[0]][0], -m[0]))
        lo, hi = ext[i]
        for j, w in members:
            if j == i:
                continue
            if w is base:
                out.append((j, i, "same"))
            elif w.dtype != base.dtype or not (lo <= ext[j][0] and ext[j][1] <= hi):
                continue
            elif not w.requires_grad:
                out.append((j, i, "detached" if base.requires_grad else "view"))
            elif w.grad_fn is None and base.grad_fn is not None:
                out.append((j, i, "leaf"))
            else:
                out.append((j, i, "view"))
    return out

"""Warnings of a function that keeps recording: new signatures, or the same one again.

A new signature costs a trace and a recording. :class:`StormDetector` counts new
signatures, recordings of evicted ones, and recordings of a known signature made again
because its environment or its state changed, and warns once of each, with what keeps
changing and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .._errors import RerecordWarning

__all__ = ["StormDetector", "STORM_THRESHOLD", "ENV_STORM_CALLS", "STATE_STORM_CALLS", "RerecordWarning"]


STORM_THRESHOLD = 16


def _leaf_kind(values: Set[Any]) -> str:
    """The types of a leaf's static values, the most frequent first, with counts where several.

    ("int (8 values), float (8) and bool (1)": a lone bool among numbers is not what changed.)
    """
    counts: Dict[str, int] = {}
    for v in values:
        if isinstance(v, tuple) and v and isinstance(v[0], type):
            counts[v[0].__name__] = counts.get(v[0].__name__, 0) + 1
    if not counts:
        return "value"
    order = sorted(counts, key=lambda k: (-counts[k], k))
    if len(order) == 1:
        return order[0]
    parts = [f"{order[0]} ({counts[order[0]]} values)"] + [f"{k} ({counts[k]})" for k in order[1:]]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


_VALUE_TYPES = (int, float, bool, str, bytes, complex, type(None), tuple, frozenset, torch.dtype, torch.device)


def _objects(values: Set[Any]) -> bool:
    """Whether the static keys ``values`` are objects keyed by identity, not values."""
    for v in values:
        if not (isinstance(v, tuple) and v and isinstance(v[0], type)):
            return False
        t = v[0]
        if issubclass(t, _VALUE_TYPES) or dataclasses.is_dataclass(t) or t.__module__ in ("numpy", "enum"):
            return False
    return True


def explain_storm(desc: str, log: List[Any], differentiated: bool = False, piece: bool = False) -> str:
    """The warning text: which part of the signature keeps changing, and the fix.

    ``differentiated``: some of the calls went through the autograd wrapper, whose sizes each
    record a forward and a backward (two recordings, and the wrapper's work on every call).
    """
    n = len(log)
    specs = {id(x[0]): x[0] for x in log}
    lines = [f"{desc} has met {n} new signatures (more than {STORM_THRESHOLD}); each costs a recording (a "
             "capture and its memory), and a trace unless it differs from an earlier one only in sizes (a "
             "dimension that varies is traced once, symbolically); where the function reaches state, a "
             "signature's first call runs eagerly and only its second is recorded, so with a new one on "
             "almost every call, almost every call runs eagerly."]
    if differentiated:
        lines.append("Its calls are differentiated through gtransform's autograd wrapper (parameters that "
                     "require grad under grad mode, the backward outside the function): each new size records "
                     "a forward and a backward, and where the joint trace cannot keep a size symbolic, traces "
                     "them too. Fix: graphify the whole training step (the loss, loss.backward() and "
                     "optimizer.step() inside the function): each new size costs one recording.")
    same = [x for x in log if x[0] == log[-1][0]]
    if len({str(s) for s in specs.values()}) > 1 and len(same) < n // 2:
        lines.append("The structure of the arguments keeps changing (different containers, keys or lengths). "
                     "Fix: keep the argument tree fixed; pass varying collections as tensors.")
    parts = [x[1] for x in same]
    paths = same[-1][2]
    for i in range(len(parts[-1])):
        values = {p[i] for p in parts if i < len(p)}
        if len(values) <= 1:
            continue
        sample = parts[-1][i]
        path = paths[i] if i < len(paths) else f"leaf {i}"
        if isinstance(sample, tuple) and len(sample) == 6 and isinstance(sample[3], torch.dtype):
            what = []
            for j, name in ((1, "shape"), (3, "dtype"), (2, "strides"), (5, "requires_grad"), (4, "device")):
                if len({p[i][j] for p in parts}) > 1:
                    what.append(name)
            lines.append(f"{path} (a tensor) changed {', '.join(what) or 'layout'} {len(values)} times. "
                         "Fix: pad or bucket inputs to a few fixed shapes (graphify(fn, buckets=(1, 2, 4, 8, "
                         "...), pad=...)), or record only the most frequent batch sizes (record_sizes=N: the "
                         "others run eagerly); keep dtypes and layouts fixed.")
        elif _objects(values):
            lines.append(f"{path} (a {_leaf_kind(values)} object) was {len(values)} different objects: an object "
                         "argument is part of the signature by identity (the recording reads its tensors), so "
                         "each new object is a new signature. Fix: pass the same object on every call (e.g. "
                         "one transformers StaticCache, .reset() between requests), or close over it.")
        elif piece:
            lines.append(f"{path} (a Python {_leaf_kind(values)}) took {len(values)} values: TorchDynamo passes this "
                         "piece a number of your code (a loop index, a step count) that is used there other than "
                         "in arithmetic with a tensor (a size, an index, torch.full(..., float(i))), so each value "
                         "is a recording of its own. Fix: use it only in arithmetic with tensors there "
                         "(torch.ones(...) * i: it is then passed as a tensor, one recording for all values), keep "
                         "it in a tensor, or raise maxsize above the number of values.")
        else:
            lines.append(f"{path} (a Python {_leaf_kind(values)}) took {len(values)} values: non-tensor leaves are "
                         "static, so each value is a new signature. Fix: pass it as a tensor "
                         "(torch.tensor(v, device=...)).")
    stat = {x[3] for x in same}
    if len(stat) > 1:
        lines.append(f"the static arguments took {len(stat)} values. Fix: do not mark changing arguments static.")
    return "\n".join(lines)


ENV_STORM_CALLS = (8, 32)
"""Warn when 8 recordings caused by environment changes fall within 32 calls."""


STATE_STORM_CALLS = (4, 16)
"""Warn when a signature is traced again 4 times within 16 calls because its state changed
(each costs an eager call, a trace and a recording)."""


def _env_fix(whats: List[str]) -> str:
    """The fix for what keeps changing in the environment (see explain_env_storm)."""
    fixes = []
    if any("optimizer hyperparameter" in w and "['lr']" in w for w in whats):
        fixes.append(
            "A learning-rate scheduler sets a new Python-float lr after every step, and each value is "
            "a new recording. Give the optimizer a tensor learning rate, e.g. "
            "torch.optim.SGD(params, lr=torch.tensor(0.01, device=dev), fused=True), in an "
            "implementation that keeps it on the device: fused=True (SGD, Adam, AdamW, Adagrad), "
            "foreach=True (SGD, Adagrad, Rprop; SGD's default on the GPU) or capturable=True (Adam, "
            "AdamW on the GPU). The scheduler then updates it in place and every replay reads it. "
            "Or keep opt.step() outside the graphified function.")
    if any("optimizer hyperparameter" in w and "['lr']" not in w for w in whats):
        fixes.append(
            "An optimizer hyperparameter other than lr keeps changing (OneCycleLR and CyclicLR cycle "
            "momentum or betas by default): keep it fixed (cycle_momentum=False), or keep opt.step() "
            "outside the graphified function.")
    if any(w.startswith(("module attribute", "attribute", "class attribute")) for w in whats):
        fixes.append(
            "A Python attribute the function reads keeps changing: each value is a constant of its "
            "recording. Hold the value in a tensor the function reads instead (a buffer: "
            "module.register_buffer('scale', torch.tensor(v)), updated in place with .fill_(v)).")
    if any(w.endswith((": True -> False", ": False -> True")) and ".training" in w for w in whats):
        fixes.append(
            "Modules switch between train() and eval() with more than a few other changes in between; "
            "gtransform keeps 3 earlier environments per signature. Switch less often, or graphify the "
            "training and the evaluation step as two functions.")
    if not fixes:
        fixes.append("Keep module attributes, hooks and optimizer settings fixed between calls, or keep "
                     "the part that changes outside the graphified function.")
    return "\n".join("Fix: " + f for f in fixes)


def _tally(log: List[List[str]]) -> Tuple[List[str], Dict[str, int], Dict[str, str]]:
    """What changed in ``log`` (lines "what: old -> new" or "what is ..."), most often first."""
    counts: Dict[str, int] = {}
    last: Dict[str, str] = {}
    for changes in log:
        for c in changes:
            what = c.split(": ", 1)[0] if ": " in c else c.split(" is ", 1)[0]
            counts[what] = counts.get(what, 0) + 1
            last[what] = c
    return sorted(counts, key=lambda w: -counts[w]), counts, last


def explain_state_storm(desc: str, log: List[List[str]], calls: int) -> str:
    """The warning text for signatures traced again because their state changed (note_retrace)."""
    whats, counts, last = _tally(log)
    state = any(c.startswith("state ") for changes in log for c in changes)
    lines = [f"{desc} has traced and recorded the same signature again {len(log)} times in its last "
             f"{calls} calls because " + ("the state it reads changed between calls (the arguments did not)"
                                          if state else "something the recording depends on changed between calls")
             + "; each time costs a trace and a recording (and an eager call where it reads state), far "
             "more than an eager call."]
    lines += [f"  {last[w]}" + (f" ({counts[w]} times)" if counts[w] > 1 else "") for w in whats[:6]]
    texts = list(last.values())
    fixes = []
    if any(t.startswith("state ") and ": shape " in t for t in texts):
        fixes.append("A state tensor changes shape between calls (a KV cache that grows, such as "
                     "transformers' DynamicCache): keep it at a fixed size and write into it in place "
                     "(transformers' StaticCache with cache_position; a preallocated buffer and a mask), "
                     "or keep the growing part outside the graphified function.")
    if any(t.startswith("state ") and ": requires_grad " in t for t in texts):
        fixes.append("A state tensor's requires_grad keeps changing between calls (layers frozen and "
                     "unfrozen): each setting is a signature of its own. Keep it fixed, and leave a layer out "
                     "of training inside the function instead (its output under torch.no_grad(), or .detach()).")
    if any(t.startswith("state ") and (": dtype " in t or ": device " in t or ": strides " in t or ": type " in t)
           for t in texts):
        fixes.append("A state tensor keeps changing dtype, device, layout or type between calls (model.double() "
                     "then model.float(), .to(), a parameter replaced by a plain tensor): convert it once, "
                     "before the calls.")
    if any("rebound between calls" in t for t in texts):
        fixes.append("A state tensor is bound to a new tensor before every call (model.h = h.detach()): "
                     "keep one tensor there and write the new values into it in place "
                     "(model.h.copy_(h.detach()), with h a buffer).")
    if any("is gone" in t for t in texts):
        fixes.append("A state tensor's slot is emptied between calls: keep a tensor there.")
    if any("Python attributes changed" in t for t in texts):
        fixes.append("Python attributes set on an input tensor (t.scale = v) change between calls, and "
                     "the trace read them: pass the value as an argument of its own (a tensor) instead.")
    if any("was frozen from it" in t for t in texts):
        fixes.append("A value read on the host was frozen from a tensor that keeps changing (written in "
                     "place, or another object): each change traces again. Keep that tensor fixed (a time "
                     "grid, a graph), or let Python run the read on every call: "
                     "graphify(fn, on_break=\"split\") (graph breaks through TorchDynamo) or on_break=\"eager\".")
    if any("a Python value the function reads" in t for t in texts):
        fixes.append("A Python value the function reads from a global, a closure or a class changes between "
                     "calls (a step counter, a schedule; or the function's own `global n; n += 1`): pass it as "
                     "an argument instead (a tensor: one recording for every value; a Python number in "
                     "static_argnums: one per value), or keep the counting outside the function.")
    if not fixes:
        fixes.append("Keep the tensors the function reads (parameters, buffers, optimizer state, "
                     "caches) the same objects with the same shapes between calls, and change their "
                     "values in place.")
    lines += ["Fix: " + f for f in fixes]
    return "\n".join(lines)


def explain_env_storm(desc: str, log: List[List[str]], calls: int) -> str:
    """The warning text for recordings caused by environment changes (see StormDetector.note_env)."""
    whats, counts, last = _tally(log)
    lines = [f"{desc} has recorded again {len(log)} times in its last {calls} calls because what else "
             "decides its computation changed between calls (the arguments did not); each change costs "
             "a trace and a recording, more than an eager call."]
    for w in whats[:6]:
        lines.append(f"  {w} changed {counts[w]} times (last: {last[w].split(': ', 1)[-1]})")
    if not whats:
        lines.append("  module hooks, or an optimizer's parameter groups or state")
    lines.append(_env_fix([last[w] for w in whats]))
    return "\n".join(lines)


def _burst(calls: List[int], log: Optional[List[Any]], limits: Tuple[int, int]) -> bool:
    """Whether the last ``n`` events (their call numbers in ``calls``) fell within ``window`` calls.

    ``calls`` (and ``log``, kept beside it) are trimmed to the last ``ENV_STORM_CALLS[0]``
    events, and, when the answer is yes, to the last ``n``: what the warning reports.
    """
    n, window = limits
    keep = max(n, ENV_STORM_CALLS[0])
    del calls[:-keep]
    if log is not None:
        del log[:-keep]
    if len(calls) < n or calls[-1] - calls[-n] >= window:
        return False
    del calls[:-n]
    if log is not None:
        del log[:-n]
    return True


class StormDetector:
    """Warns once when a function keeps recording new signatures, or recording again.

    ``note`` counts new signatures (argument keys), and recordings of signatures the
    cache evicted (``note_evicted``); ``note_env`` counts recordings of a known key made
    again because its environment changed (a Python-float lr set by a scheduler, a module
    attribute the function reads), and ``note_retrace`` those made again because the state
    it reads changed (a growing KV cache, a rebound tensor), which ``note`` cannot see.
    """

    __slots__ = ("desc", "log", "keys", "warned", "env_log", "env_calls", "env_warned", "again", "again_warned",
                 "evicted", "st_log", "st_calls", "st_warned", "allowance", "differentiated", "silent", "piece")

    def __init__(self, desc: str, allowance: int = 0):
        self.desc = desc
        self.allowance = allowance  # new signatures asked for (record_sizes=, buckets=: see _sizes)
        self.log: List[Any] = []
        self.keys: Set[Any] = set()
        self.warned = False
        self.env_log: List[List[str]] = []
        self.env_calls: List[int] = []
        self.env_warned = False
        self.again: List[int] = []  # call numbers of recordings of keys the cache evicted before
        self.again_warned = False
        self.evicted: Set[Any] = set()
        self.st_log: List[List[str]] = []
        self.st_calls: List[int] = []
        self.st_warned = False
        # a signature was differentiated through the autograd wrapper (a forward and a backward per size)
        self.differentiated = False
        self.silent = False  # (see quiet)
        self.piece = False  # a graph TorchDynamo made (see _dynamo): its numbers are dynamo's arguments, not the user's

    def quiet(self) -> None:
        """Warn of nothing: a helper whose calls the function that made it warns about (see ``Graphified._spawn``)."""
        self.silent = self.warned = self.again_warned = self.env_warned = self.st_warned = True

    def note_evicted(self, e: Any) -> None:
        """The cache evicted ``e``'s signature (least recently used, beyond maxsize)."""
        k = hash((e.spec, e.key[1], e.statics))
        if not self.again_warned and k in self.keys:  # (only those ``note`` can see again)
            self.evicted.add(k)

    def _again(self, calls: int, maxsize: Any, stacklevel: int) -> None:
        """A signature recorded before is recorded again: the cache keeps evicting what the calls use."""
        if self.again_warned or maxsize is None:
            return
        self.again.append(calls)
        if not _burst(self.again, None, ENV_STORM_CALLS):
            return
        n = ENV_STORM_CALLS[0]
        self.again_warned = True
        self._warn(
            f"{self.desc} has recorded again {n} signatures it had recorded before, in its last "
            f"{calls - self.again[0] + 1} calls: the calls cycle through more signatures "
            f"({len(self.keys)} seen so far) than its cache keeps (maxsize={maxsize}), so each one is "
            "evicted before it is used again, and every call traces and records.\n"
            f"Fix: raise maxsize (gt.graphify(fn, maxsize={max(2 * len(self.keys), 2 * maxsize, 8)})), or "
            "keep fewer signatures (pad inputs to a few shapes, pass changing numbers as tensors).",
            stacklevel + 1)

    def note_retrace(self, changes: List[str], calls: int, stacklevel: int) -> None:
        """A known signature traced again because the state it reads changed (``diff_leaves``)."""
        if self.st_warned:
            return
        self.st_log.append(changes)
        self.st_calls.append(calls)
        # (state that keeps changing costs an eager call, a trace and a recording each time:
        # warned sooner than other changes, such as Python attributes set on an input)
        state = all(any(c.startswith("state ") for c in ch) for ch in self.st_log[-STATE_STORM_CALLS[0]:])
        if not _burst(self.st_calls, self.st_log, STATE_STORM_CALLS if state else ENV_STORM_CALLS):
            return
        self.st_warned = True
        self._warn(explain_state_storm(self.desc, self.st_log, calls - self.st_calls[0] + 1), stacklevel + 1)

    def note_env(self, changes: List[str], calls: int, stacklevel: int) -> None:
        """A known signature recorded again: ``changes`` (env.diff) at call number ``calls``."""
        if self.env_warned:
            return
        self.env_log.append(changes)
        self.env_calls.append(calls)
        if not _burst(self.env_calls, self.env_log, ENV_STORM_CALLS):
            return
        self.env_warned = True
        self._warn(explain_env_storm(self.desc, self.env_log, calls - self.env_calls[0] + 1), stacklevel + 1)

    def _warn(self, text: str, stacklevel: int) -> None:
        # at the user's call, whatever the path through gtransform (autograd, torch.func, threads)
        import traceback

        from .._errors import user_frame

        fr = user_frame(traceback.extract_stack())
        if fr is not None and getattr(fr, "filename", None):
            warnings.warn_explicit(RerecordWarning(text), RerecordWarning, fr.filename, fr.lineno or 0)
        else:
            warnings.warn(RerecordWarning(text), stacklevel=stacklevel)

    def note(self, spec: Any, parts: List[Any], paths: List[str], statics: Any, stacklevel: int,
             calls: int = 0, maxsize: Any = None) -> None:
        # hashes, not the keys: a key holds the call's static values (objects passed as
        # arguments, such as a KV cache), which must not stay alive for a warning's sake
        key = hash((spec, tuple(parts), statics))
        if key in self.keys:  # the same signature after eviction, or in another thread
            if key in self.evicted:
                self.evicted.discard(key)
                self._again(calls, maxsize, stacklevel + 1)
            return
        if self.warned:
            if not self.again_warned and len(self.keys) < 4096:  # (counted for _again's message)
                self.keys.add(key)
            return
        self.keys.add(key)
        self.log.append((spec, tuple(parts), tuple(paths), statics))
        if len(self.log) <= STORM_THRESHOLD + self.allowance:
            return
        self.warned = True
        self._warn(explain_storm(self.desc, self.log, self.differentiated, self.piece), stacklevel + 1)
        self.log = []  # (it holds the calls' static values)

"""One signature: what a call must be to replay it, and its trace and recording.

An :class:`Entry` is made from a trace (:class:`gtransform._trace.Plan`) and the call
that made it. It holds what the checks of :mod:`._checks` compare a later call with
(the static values, the state's slots, the tensors' guard, the aliasing, the
environment key...) and what the call path keeps per signature (its recording, its
backward halves).
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from .._record import Recording
from .._state import functorch_base
from .._trace import Plan
from .._tree import static_leaf_key
from .._watch import FOR_GRAD
from ._guard import Guard
from ._parts import alias_pattern, attrs_key, same_objects

__all__ = ["Entry", "reusable_after_eager"]


def _place(slot: Any) -> Tuple[int, Any]:
    """Where a slot points, the same for ``obj.k`` and ``vars(obj)["k"]``."""
    if slot.kind == "attr":
        return id(vars(slot.obj)) if hasattr(slot.obj, "__dict__") else id(slot.obj), slot.key
    return id(slot.obj), slot.key


class Entry:
    """One signature: its trace, its state binding and its current recording."""

    __slots__ = (
        "key", "spec", "tpos", "consts", "statics", "guard", "plan", "rec", "first_refs",
        "calls", "cuda", "any_rg", "must_static", "alias", "same", "n_leaves", "bwd", "const_vals", "parts",
        "state_src", "env", "env_val", "n_user", "state_static", "glob", "orders", "attrs", "reads_attrs", "grad_none",
        "bits", "_checks", "_match", "handed", "donated", "look_again", "eager_first",
        "padding_checked", "opt_grad_none", "sets", "after_backward",
    )

    def __init__(self, key: Hashable, spec: Any, leaves: Sequence[Any], tpos: List[int], statics: Any, plan: Plan, cuda: bool):
        self.key = key
        self.glob = key[4]  # type: ignore[index]
        self.orders = key[5]  # type: ignore[index]
        self.spec = spec
        self.tpos = tpos
        self.n_leaves = len(leaves)
        self.n_user = len(tpos)
        tset = set(tpos)
        self.consts = [(i, static_leaf_key(leaves[i])) for i in range(len(leaves)) if i not in tset]
        self.const_vals = {i: leaves[i] for i, _ in self.consts}
        self.statics = statics
        # state: where each state tensor is read from on every call, and the object it must
        # still be there (a parameter replaced by a new nn.Parameter is traced again: the
        # optimizer, hooks and .grad write-backs of the recording are bound to the old
        # object); not for .grad slots (replaced every step) nor for state the function
        # itself writes back (carried state)
        written = {_place(s) for s in plan.escape_slots}
        self.state_src: List[Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]] = [
            (slot, None if slot is not None else t,
             t if slot is not None and slot.kind != "grad" and _place(slot) not in written else None)
            for slot, t in zip(plan.state_slots, plan.state)
        ]
        state = list(plan.state)
        tensors = [leaves[i] for i in tpos] + state
        self.guard = Guard(tensors)
        # Python attributes of the caller's tensors (read by the trace): None when none has any
        attrs = tuple(attrs_key(t) for t in tensors[: len(tpos)])
        self.attrs = attrs if any(attrs) else None
        self.reads_attrs = True  # False: the attributes are no part of the signature (see _lookup.new_entry)
        self.alias = alias_pattern(tensors) if plan.mutated else ()
        self.same = same_objects(tensors[: len(tpos)])
        self.bits = key[2][2]  # type: ignore[index]
        self._checks: Optional[List[Any]] = None  # (made at the first match: see checks)
        self._match: Any = None
        self.plan = plan
        self.rec: Optional[Recording] = None
        self.first_refs: Optional[List[Any]] = None
        self.look_again = True  # (see _replay._run)
        self.calls = 0
        self.handed: Any = None  # {input index: static buffer} handed out by input_buffers (see _buffers)
        self.donated: Any = None  # the donated inputs' indices, found at the first recording (see _buffers)
        self.cuda = cuda
        self.env: Any = None
        self.env_val: Any = None
        # tensors whose .grad the function's backward creates (written back after each call)
        # and that had none when traced: eager accumulates into a .grad that is there (one
        # the last call left, unless something set it to None in between), so a .grad being
        # there at call time is another signature
        self.grad_none = [s.obj for s in plan.escape_slots if s.kind == "grad" and s.get() is None]
        # and an optimizer's parameters without a .grad when traced: the step skipped them (a
        # frozen layer, a head not used yet); one that has a .grad at call time (unfrozen) is
        # another signature, where the step updates it and makes its state
        seen = {id(t) for t in self.grad_none}
        self.opt_grad_none: List[torch.Tensor] = []  # (those of them: its state may be made then)
        read = {id(t) for t in plan.grad_read_first}  # (.grads read before any zero_grad() cleared them)
        for r in plan.roots:
            if isinstance(r.obj, torch.optim.Optimizer):
                for g in r.obj.param_groups:
                    for q in g["params"]:
                        if q.grad is None and id(q) not in seen and id(q) in read:
                            seen.add(id(q))
                            self.grad_none.append(q)
                            self.opt_grad_none.append(q)
        # state read in place (a .grad that is replaced every step is copied instead)
        self.state_static = {self.n_user + k for k, s in enumerate(plan.state_slots) if s is None or s.kind != "grad"}
        rg = [t.requires_grad for t in tensors]
        user_rg = any(rg[: self.n_user])
        state_rg = any(rg[self.n_user:])
        # a call is differentiated through the recording when an argument needs
        # grad, or when it reads parameters without updating them (a forward);
        # a whole training step (backward and optimizer inside) is a plain call
        # (an update of a parameter whose .grad the function reads: an optimizer step; an
        # update of one whose .grad it does not read, such as Embedding(max_norm=...)'s
        # renorm under no_grad in a forward, leaves the call differentiable, as in eager)
        # (and a call none of whose outputs needs grad, e.g. an EMA update that returns
        # nothing, stays a plain call)
        updated = [tensors[i] for i in plan.mutated if i >= self.n_user and rg[i]]
        # (a backward the function ran itself, then an update: a training step, also when it
        # ends with opt.zero_grad(), which leaves no .grad behind)
        # (a backward that only returns gradients, torch.autograd.grad(..., create_graph=True) for
        # a gradient penalty, writes no .grad and updates nothing: its outputs that require grad
        # in the trace do so in eager, and the call is differentiated)
        # (.grad written: made by a backward, or updated in place; a read alone, a grad-norm
        # metric in a forward, leaves the call a forward)
        touches_grads = any(s.kind == "grad" for s in plan.escape_slots) or any(
            s is not None and s.kind == "grad" and self.n_user + k in plan.mutated
            for k, s in enumerate(plan.state_slots))
        updates_params = touches_grads or (plan.ran_backward and (bool(updated) or not any(
            e.requires_grad for e in plan.tensor_entries)))
        if updated and not updates_params:
            graded = {id(s.obj) for s in plan.state_slots if s is not None and s.kind == "grad"}
            updates_params = any(id(t) in graded for t in updated) or not any(
                e.requires_grad for e in plan.tensor_entries)
        # (nothing the call leaves behind needs grad, e.g. a forward under `with torch.no_grad()`
        # inside the function or `@torch.no_grad()` on it: nothing to differentiate, a plain call)
        # (outputs that are inputs or views of them are rebuilt from the caller's tensors: the
        # autograd wrapper detaches them where the function did)
        leaves_grad = any(e.requires_grad or e.kind == "input" for e in plan.tensor_entries) or any(
            e.requires_grad or e.kind == "input" for e in plan.escape_entries) or any(rg[i] for i in plan.mutated)
        self.any_rg = (user_rg or (state_rg and not updates_params)) and leaves_grad
        # a replayed training step returning an output made after its backward (refused: see _lookup)
        self.after_backward = bool(updates_params and not self.any_rg and plan.after_backward)
        must = set()
        if plan.mutated and self.alias:
            groups: Dict[int, List[int]] = {}
            for i, gid in enumerate(self.alias):
                if gid >= 0:
                    groups.setdefault(gid, []).append(i)
            for members in groups.values():
                if any(i in plan.mutated for i in members):
                    must.update(members)
        self.must_static = must
        self.bwd: Dict[Tuple[bool, ...], Any] = {}
        self.parts: Dict[Tuple[bool, ...], Any] = {}
        self.eager_first = False  # its first call ran eagerly (it touches state: see _lookup._settle)
        self.padding_checked: Set[int] = set()  # buckets=: the batch sizes whose padded call matched eager (see _sized)
        # Python values the function sets in modules and objects (`self.n = x.shape[0]`, model.train()
        # inside it): ``(dict, key, value)`` set after each replay as its trace left them, so that
        # a replay leaves them as eager does (see _lookup._settle)
        self.sets: List[Tuple[Any, Any, Any]] = []

    def grads_came_or_went(self, leaves: Sequence[Any] = ()) -> bool:
        """Whether a ``.grad`` the recording reads is gone, or one it expects absent is there.

        Gradient accumulation alternates between both (the first micro-batch after
        ``zero_grad()`` makes the ``.grad``s, the next ones add to them): each kind keeps
        its recording as an alternate of the key (see ``ThreadState.alts``) instead of
        tracing again on every switch. So does an input whose leafness the function reads
        (``x.is_leaf``) and that comes with and without autograd history.
        """
        if any(t.grad is not None for t in self.grad_none):
            return True
        if self.plan.leaf_idx and leaves:
            ts = [leaves[i] for i in self.tpos]
            if any((ts[i].grad_fn is not None) != h for i, h in self.plan.leaf_idx.items() if i < len(ts)):
                return True
        return any(slot is not None and slot.kind == "grad" and slot.get() is None for slot, _c, _s in self.state_src)

    def resolve_state(self) -> Optional[List[torch.Tensor]]:
        """The state tensors as the function reaches them now (``None``: one is gone or replaced).

        For a call under ``torch.func.grad`` (looked up with ``FOR_GRAD`` on), the tensors
        under the transform's wrappers that slots may hold (``functional_call``'s
        parameters), as the trace reaches them: see :meth:`held_state`.
        """
        base = functorch_base if getattr(FOR_GRAD, "on", False) else None
        out: List[torch.Tensor] = []
        for slot, const, same in self.state_src:
            if slot is None:
                out.append(const)  # type: ignore[arg-type]
                continue
            v = slot.get()
            if base is not None and isinstance(v, torch.Tensor):
                v = base(v)
            if not isinstance(v, torch.Tensor) or (same is not None and v is not same):
                return None
            out.append(v)
        return out

    def held_state(self, state: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The objects the slots hold for ``state`` (:meth:`resolve_state`'s, just resolved).

        Under ``torch.func.grad`` those are the transform's wrappers where a slot holds
        one: the autograd wrapper of the recording must take them, not the tensors under
        them, for the transform to see its output depend on them.
        """
        return [t if slot is None else slot.get() for (slot, _c, _s), t in zip(self.state_src, state)]

    def brief(self) -> str:
        """The first few inputs of the signature, for log lines."""
        parts = [f"{p}: {m[3]}{list(m[1])}" for p, m in zip(self.plan.in_paths, self.guard.metas)]
        s = ", ".join(parts[:4])
        return s + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "")

    @property
    def checks(self) -> List[Any]:
        """The checks of :data:`._checks.CHECKS` that apply to this signature, in order.

        Made at the first match (the environment key is set after the entry is made).
        """
        if self._checks is None:
            from ._checks import CHECKS

            self._checks = [c for c in CHECKS if c.applies(self)]
        return self._checks

    def match(self, call: Any, check_env: bool = True) -> Optional[List[torch.Tensor]]:
        """The call's state tensors if ``call`` (a :class:`._checks.Call`) replays this signature, else None.

        Every check of :attr:`checks`, in one generated function (the fast path runs the same
        checks' code). ``check_env=False`` leaves the environment out: a call that differs in
        it alone replays an alternate of the key (see ``ThreadState.alts``).
        """
        m = self._match
        if m is None:
            from ._checks import build_match

            m = self._match = build_match(self)
        return m(call.leaves, call.spec, call.statics, call.glob, call.tree, check_env)  # type: ignore[no-any-return]

    def frozen_only_mismatch(self, call: Any) -> bool:
        """Whether a call differs from this signature only in the tensors its frozen reads hang on.

        (A train and a validation graph passed in turn: each is frozen into a recording of its own,
        kept as an alternate of the key, see ``ThreadState.alts``.)
        """
        if not self.plan.frozen_guard:
            return False
        differs = {c.name: c.explain(self, call) for c in self.checks}
        frozen = differs.pop("frozen reads", [])
        # (another object: a graph passed in turn; not one written in place, which changes for good)
        return bool(frozen) and all("is another tensor now" in line for line in frozen) and not any(differs.values())

    def env_only_mismatch(self, call: Any) -> bool:
        """Whether a call differs from this signature in its environment only.

        (Training flags, attributes read, hyperparameters: see ``_environment.env_key_fn``.)
        Such a signature is kept as an alternate of its key (see ``ThreadState.alts``):
        a model switched between train() and eval() replays both recordings.
        """
        if self.env is None or self.env() == self.env_val:
            return False
        return self.match(call, check_env=False) is not None

    def explain(self, call: Any) -> List[str]:
        """How ``call`` differs from this signature, check by check, in words."""
        return [line for c in self.checks for line in c.explain(self, call)]

    def env_keeps_lazy_state(self) -> bool:
        """Whether what changed in the environment leaves lazily made state as it was.

        A training flag, an attribute, a hook or a hyperparameter: yes; the optimizers'
        state or parameter groups, or the module tree (``optimizer.state.clear()``,
        a submodule replaced): no, the next call then runs eagerly first.
        """
        part = getattr(self.env, "lazy_part", None)
        return part is not None and part(self.env()) == part(self.env_val)


def reusable_after_eager(plan: Plan) -> bool:
    """Whether the trace made by the eager first call of a signature can serve its second.

    The second call must still match it as any cached signature must (its guards, the
    state it reads, the Python attributes it keys on).

    Only when the trace left Python state as it found it: it changed no Python value and
    wrote tensors back only where it read state tensors. Then the eager call, which runs the
    same operations, creates nothing the trace did not see (no optimizer moment, no cache
    allocated on first use, no attribute set): those make a second trace.
    """
    return not plan.py_changes and _writes_back_where_read(plan, grads=False)


def _writes_back_where_read(plan: Plan, grads: bool) -> bool:
    """Whether every tensor the trace wrote back went where it read a state tensor (or, with ``grads``, to a ``.grad``)."""
    read = {_place(s) for s in plan.state_slots if s is not None}
    return all((grads and s.kind == "grad") or _place(s) in read for s in plan.escape_slots)


def makes_no_state(plan: Plan) -> bool:
    """Whether the trace made no state its eager first call would make: recordable on its first call.

    Asked of a new size of calls whose first size already ran its eager first call (see
    ``_lookup._settle``): the trace changed no Python value, and wrote tensors back only where
    it read state tensors or into ``.grad`` (which every call of a training step makes anew, as
    ``zero_grad`` drops it). A tensor written where the trace read none (an optimizer moment
    made for a parameter whose state was cleared) is state made lazily: eager first.
    """
    return not plan.py_changes and _writes_back_where_read(plan, grads=True)


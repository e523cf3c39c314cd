"""The environment of state: what else decides what a function computes, read on every call.

Every root module's ``training`` flag, hooks and the plain Python attributes the trace
read on it; every root optimizer's Python hyperparameters, parameter groups and state
dict; the length of closed-over containers of tensors; the bindings of the names the
function reaches its objects through. :func:`env_key_fn` writes one straight-line Python
function per signature that computes all of it (it is on every call's path), and a
``diff`` that says what changed.
"""

from __future__ import annotations

import collections
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .._compat import module_global_hooks, optimizer_global_hooks
from .._patches import TRACE_HOOKS as _TRACE_HOOKS
from .._roots import _MODULE_ATTRS, Root, Slot, _Module, _Optimizer, _plain_object, plain_object_roots, root_modules
from .._state import AttrReads, GradHooks, _plain_attr, _RemovableHandle

__all__ = ["env_key_fn"]


def env_key_fn(roots: Sequence[Root], reads: Optional[AttrReads] = None) -> Optional[Callable[[], Any]]:
    """A cheap function of what else changes a module's computation, or ``None``.

    Covers every root module's ``training`` flag, hooks (and torch's global
    module hooks) and the plain Python attributes the trace read on it (numbers,
    strings, None, short tuples of them: ``momentum``, ``eps``, ``p``, ``padding``...;
    all of them where ``reads`` is None or could not track the module), and every root
    optimizer's Python-number hyperparameters, parameter groups and state dict as a whole.
    """
    named = _named_modules(roots, reads)
    mods = [m for _, m in named]
    opts = [r.obj for r in roots if isinstance(r.obj, _Optimizer)]
    opt_names = [r.name for r in roots if isinstance(r.obj, _Optimizer)]
    conts, obj_slots = _tensor_containers(roots, reads)
    conts += _iterated_tables(named, reads)
    pobj_attrs = _plain_object_attrs(roots, reads)
    # modules, optimizers, containers and plain objects found in a global or a closure cell:
    # rebinding the name between calls (`opt = torch.optim.Adam(...)`, a notebook cell run
    # again) gives the function other state; the recording is bound to the old objects
    bound = [r for r in roots if r.binding is not None and not isinstance(r.obj, torch.Tensor)
             and not _unread_attribute(r.binding, reads)]
    if not mods and not opts and not conts and not obj_slots and not bound:
        return _plain_objects_env(pobj_attrs) if pobj_attrs else None
    hook_dicts, gdicts = _hook_dicts(mods, opts)
    groups = [g for o in opts for g in o.param_groups]
    group_names = [f"{name}.param_groups[{gi}]" for name, o in zip(opt_names, opts)
                   for gi in range(len(o.param_groups))]
    # every Python hyperparameter: numbers (numpy's too: a schedule computed with numpy), tuples
    # of them (Adam's betas, Rprop's etas and step_sizes), strings, None
    keys = [tuple(k for k, v in g.items() if k != "params" and _plain_attr(v)) for g in groups]
    slots = _Slots(named, reads, pobj_attrs, roots)
    slots.id_slots += obj_slots
    # the module tree itself: a submodule replaced (`model.fc = nn.Linear(...)`, `seq[2] = ...`),
    # added (`seq.append(...)`) or removed, or a module's class changed (parametrizations
    # registered or removed swap it) records again; the recording is bound to the old objects.
    # By identity: the cached value holds the old modules, so no new one can take their ids.
    sub_dicts = [m._modules for m in mods if m._modules]
    sub_names = [name for name, m in named if m._modules]
    b_items = [r.binding for r in bound if r.binding.kind == "item"]
    # (a place inside a tuple, `layers = (a, b)` rebound: read through the Slot's value)
    b_attrs = [r.binding for r in bound if r.binding.kind == "attr"] + [
        Slot("attr", r.binding, "value", r.binding.path) for r in bound if r.binding.kind == "path"]
    env = _compile_env(slots.attr_dicts, hook_dicts, gdicts, groups, keys, opts, sub_dicts, mods, slots.extra(), conts,
                       ([b.obj for b in b_items], [b.key for b in b_items], [b.obj for b in b_attrs],
                        [b.key for b in b_attrs]) if bound else None,
                       grad_hooks=GradHooks(mods, groups))
    env.keep = ([r.obj for r in bound] + [o.state for o in opts] + groups + [g["params"] for g in groups]  # type: ignore[attr-defined]
                + [s for o in opts for s in o.state.values()]  # each parameter's state (opt.state[p] = {})
                + [d.get(k) for d, k, _ in slots.id_slots])
    env.diff = _differ(env, slots, named, sub_names, group_names, keys,  # type: ignore[attr-defined]
                       [b.path for b in b_items] + [b.path for b in b_attrs], len(pobj_attrs))
    # the parts where lazily made state may have gone: the optimizers' state and groups, the
    # module tree and classes (see Entry.env_keeps_lazy_state)
    env.lazy_part = lambda v: (v[4], v[5], v[6], v[7], v[11])  # type: ignore[attr-defined]
    env.watched = slots.watched()  # type: ignore[attr-defined]
    env.describe = (  # type: ignore[attr-defined]
        f"{len(mods)} module(s) (training flags, hooks, {slots.n_attrs()} Python attributes), {len(opts)} optimizer(s) "
        f"({sum(len(k) for k in keys)} Python hyperparameters, their parameter groups and state)"
        + (f", {len(pobj_attrs)} plain object(s) ({sum(len(ks) for _, _, ks in pobj_attrs)} Python attributes)"
           if pobj_attrs else "")
    )
    return env


def _named_modules(roots: Sequence[Root], reads: Optional[AttrReads]) -> List[Tuple[str, Any]]:
    """The root modules and their submodules, with those the function called without a root leading to them."""
    named = root_modules(roots)
    if reads is not None and reads.called:
        known = {id(m) for _, m in named}
        for m in reads.called:
            for n, sub in m.named_modules(remove_duplicate=False):
                if id(sub) not in known:
                    known.add(id(sub))
                    named.append((f"<{type(m).__name__} called by the function>{'.' + n if n else ''}", sub))
    return named


def _tensor_containers(roots: Sequence[Root], reads: Optional[AttrReads] = None
                       ) -> Tuple[List[Any], List[Tuple[Dict[str, Any], str, str]]]:
    """Closed-over lists and dicts of tensors (or modules, optimizers), and a plain object's containers of tensors (by slot).

    A tensor (a module) added or removed changes what the function reads (`caches.append(t)`,
    `layers.append(nn.Linear(...))`, `obj.ts = [new]`).
    """
    conts = [r.obj for r in roots if isinstance(r.obj, (list, dict, collections.deque)) and any(
        isinstance(v, (torch.Tensor, _Module, _Optimizer))
        or (isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v))  # (a list of transitions)
        for v in (r.obj.values() if isinstance(r.obj, dict) else r.obj))]
    # (those the trace read: an LR scheduler's _last_lr, rebound by every sched.step() outside, is
    # not part of the signature of a step that never reads it)
    obj_slots = [(vars(r.obj), k, f"{r.name}.{k}") for r in roots
                 if _plain_object(r.obj) and not isinstance(r.obj, (_Module, _Optimizer))
                 for read in [reads.read(r.obj) if reads is not None else None]
                 for k, v in vars(r.obj).items() if type(v) in (list, dict, tuple) and (read is None or k in read)
                 and any(isinstance(x, torch.Tensor) for x in (v.values() if isinstance(v, dict) else v))]
    return conts, obj_slots


def _unread_attribute(slot: Any, reads: Optional[AttrReads]) -> bool:
    """Whether ``slot`` is an attribute of a tracked object that the trace did not read.

    An LR scheduler's ``_last_lr`` list, rebound by every ``sched.step()`` outside a step that
    never reads it, would make every call a new signature.
    """
    if reads is None or getattr(slot, "kind", None) != "attr" or not reads.tracks(slot.obj):
        return False  # (a closure cell, a global: not tracked, its binding is watched)
    read = reads.read(slot.obj)
    return read is not None and slot.key not in read


def _iterated_tables(named: Sequence[Tuple[str, Any]], reads: Optional[AttrReads]) -> List[Any]:
    """The parameter and buffer tables of modules whose trace iterated them.

    ``self.parameters()`` (a weight penalty), ``named_buffers()``, ``state_dict()`` read a
    module's ``_parameters``/``_buffers`` as a whole: one registered or deleted between calls
    (``register_buffer``) changes what the function reads. Only those tables, so the usual
    forward (``self.weight``) costs nothing per call.
    """
    out: List[Any] = []
    for _, m in named:
        read = reads.read(m) if reads is not None else None
        for attr in ("_parameters", "_buffers"):
            if read is None or attr in read:
                out.append(getattr(m, attr))
    return out


_FLAG_DICT = 64  # dicts of plain values in a plain object, up to this size, are keyed by their values


def _plain_object_attrs(roots: Sequence[Root], reads: Optional[AttrReads]) -> List[Tuple[str, Dict[str, Any], Tuple[str, ...]]]:
    """Plain objects (a config, `self` of a user's class): the plain attributes the trace read on them.

    All of them where it could not track the object, like a module's.
    """
    out: List[Tuple[str, Dict[str, Any], Tuple[str, ...]]] = []
    for name, o in plain_object_roots(roots):
        read = reads.read(o) if reads is not None else None
        d = vars(o)
        ks = tuple(k for k, v in d.items() if _plain_attr(v) and (read is None or k in read))
        if ks:
            out.append((name, d, ks))
        # a small dict of flags or numbers the function read (Hugging Face's EncoderDecoderCache
        # .is_updated[layer]: its cross-attention keys computed on the first step after a reset)
        for k, v in d.items():
            if type(v) is dict and 0 < len(v) <= _FLAG_DICT and (read is None or k in read) \
                    and all(type(x) in (int, str, bool) for x in v) and all(_plain_attr(x) for x in v.values()):
                out.append((f"{name}.{k}", v, tuple(v)))
        # a class attribute read through the object (`self.scale` where only the class sets it)
        for k in sorted(read or ()):
            if k in d or k.startswith("__"):
                continue
            owner = next((c for c in type(o).__mro__ if k in c.__dict__), None)
            if owner is not None and owner.__module__.split(".")[0] not in ("torch", "builtins", "gtransform") \
                    and _plain_attr(owner.__dict__[k]) and not callable(owner.__dict__[k]):
                out.append((f"{type(o).__name__}", owner.__dict__, (k,)))  # type: ignore[arg-type]
    return out


def _hook_dicts(mods: Sequence[Any], opts: Sequence[Any]) -> Tuple[List[Dict[Any, Any]], List[Dict[Any, Any]]]:
    """The modules' and optimizers' hook dicts, and torch's global ones."""
    gdicts = module_global_hooks()
    hook_attrs = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    hook_dicts = [getattr(m, a) for m in mods for a in hook_attrs if isinstance(getattr(m, a, None), dict)]
    # optimizer step hooks (register_step_pre_hook / register_step_post_hook, and torch's
    # global ones) run inside opt.step(): traced with it, so adding or removing one records again
    hook_dicts += [getattr(o, a) for o in opts for a in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
                   if isinstance(getattr(o, a, None), dict)]
    if opts:
        gdicts += optimizer_global_hooks()
    return hook_dicts, gdicts


class _Slots:
    """The attributes the environment reads on modules and plain objects, by kind.

    The plain Python attributes the trace read (BatchNorm's momentum and eps, Dropout's
    p, LeakyReLU's negative_slope, GELU's approximate, a user's self.scale...) are
    constants in the recording, so a new value is a new signature, not the old numbers;
    attributes it did not read (`model.step = i` set by the loop) may change freely.
    """

    def __init__(self, named: Sequence[Tuple[str, Any]], reads: Optional[AttrReads],
                 pobj_attrs: Sequence[Tuple[str, Dict[str, Any], Tuple[str, ...]]], roots: Sequence[Root]):
        self.attr_dicts: List[Tuple[Dict[str, Any], Tuple[str, ...]]] = []
        self.attr_names: List[Tuple[str, Tuple[str, ...]]] = []
        # compared by identity (the objects kept alive by env.keep, so no new one takes an id):
        # containers and other objects among the attributes the trace read (`self.c = [a, b]`
        # rebound), a parameter or buffer slot that is None (`register_buffer("mask", None)`,
        # set later) or that holds a tensor found in another slot too (tied weights, untied later)
        self.id_slots: List[Tuple[Dict[str, Any], str, str]] = []  # (dict, key, path)
        # names the trace looked up that no dict held (getattr(self, "extra", 1.0), hasattr):
        # their appearance records again; class attributes read through the instance: by value
        self.absent: List[Tuple[Any, str, str]] = []  # (module, name, path)
        cls_slots: List[Tuple[Dict[str, Any], str, str]] = []  # (class __dict__, name, path)
        self.seen_t: Dict[int, Tuple[Dict[str, Any], str, str]] = {}
        for name, d, ks in pobj_attrs:
            self.attr_dicts.append((d, ks))
            self.attr_names.append((name, ks))
        for name, m in named:
            self._module(name, m, reads.read(m) if reads is not None else None, cls_slots)
        # a root module's forward replaced on the instance (`m.forward = types.MethodType(f, m)`,
        # as patching libraries do); a submodule's is not watched (a check per module per call)
        for r in roots:
            if isinstance(r.obj, _Module) and "forward" not in r.obj.__dict__:
                self.absent.append((r.obj, "forward", f"{r.name}.forward"))
        self.cls_slots = list({(id(d), k): (d, k, p) for d, k, p in cls_slots}.values())

    def _module(self, name: str, m: Any, read: Optional[Any], cls_slots: List[Tuple[Dict[str, Any], str, str]]) -> None:
        d = m.__dict__
        # `training` among them: one C-level getter per module reads everything
        ks = ("training",) + tuple(k for k, v in d.items() if k != "training" and _plain_attr(v)
                                   and (read is None or k in read))
        self.attr_dicts.append((d, ks))
        self.attr_names.append((name, ks))
        for k in read if read is not None else ():
            if k in d:
                v = d[k]
                if k not in _MODULE_ATTRS and not _plain_attr(v) and not isinstance(v, (torch.Tensor, _Module)):
                    self.id_slots.append((d, k, f"{name}.{k}"))
            elif k not in m._parameters and k not in m._buffers and k not in m._modules:
                owner = next((c for c in type(m).__mro__ if k in c.__dict__), None)
                if owner is None:
                    if not k.startswith("__"):
                        self.absent.append((m, k, f"{name}.{k}"))
                elif (_plain_attr(owner.__dict__[k]) and not callable(owner.__dict__[k])
                      and owner.__module__.split(".")[0] != "torch"):
                    cls_slots.append((owner.__dict__, k, f"{type(m).__name__}.{k}"))  # type: ignore[arg-type]
                    self.absent.append((m, k, f"{name}.{k}"))  # set on the instance later
        for dd in (m._parameters, m._buffers):
            for k, v in dd.items():
                if v is None:
                    self.id_slots.append((dd, k, f"{name}.{k}"))
                elif id(v) in self.seen_t:
                    self.id_slots.append((dd, k, f"{name}.{k}"))
                    self.id_slots.append(self.seen_t[id(v)])
                else:
                    self.seen_t[id(v)] = (dd, k, f"{name}.{k}")

    def extra(self) -> Any:
        """Per call, C-level maps only: the dicts and keys side by side (None: nothing to read)."""
        if not (self.id_slots or self.absent or self.cls_slots):
            return None
        id_d, id_k = [d for d, _, _ in self.id_slots], [k for _, k, _ in self.id_slots]
        ab_d = [dd for m, _, _ in self.absent for dd in (m.__dict__, m._parameters, m._buffers, m._modules)]
        ab_k = [k for _, k, _ in self.absent for _ in range(4)]
        cl_d, cl_k = [d for d, _, _ in self.cls_slots], [k for _, k, _ in self.cls_slots]
        return (id_d, id_k, ab_d, ab_k, cl_d, cl_k)

    def n_attrs(self) -> int:
        return (sum(len(ks) - 1 for _, ks in self.attr_names) + len(self.id_slots) + len(self.absent)
                + len(self.cls_slots))

    def watched(self) -> List[str]:
        return [p for _, _, p in self.id_slots] + [p for _, _, p in self.absent] + [p for _, _, p in self.cls_slots]


def _differ(env: Callable[[], Any], slots: _Slots, named: Sequence[Tuple[str, Any]], sub_names: Sequence[str],
            group_names: Sequence[str], keys: Sequence[Tuple[str, ...]], b_names: Sequence[str],
            n_pobj: int) -> Callable[[Any], List[str]]:
    """The ``diff`` of ``env``: what changed since an earlier value, for the retrace explanation."""

    def diff(old: Any) -> List[str]:
        """What changed since ``old`` (an earlier value of env()), for the retrace explanation."""
        new = env()
        out: List[str] = []
        if old[0] is not None and new[0] is not None:
            for i, ((name, ks), a, b) in enumerate(zip(slots.attr_names, old[0], new[0])):
                a, b = (a, b) if len(ks) > 1 else ((a,), (b,))
                what = "attribute" if i < n_pobj else "module attribute"
                out += [f"{name}.training: {x} -> {y}" if k == "training" else
                        f"{what} {name}.{k}: {x!r} -> {y!r}" for k, x, y in zip(ks, a, b) if x != y]
        elif old[0] != new[0]:
            out.append("an attribute the function read was deleted")
        for name, a, b in zip(sub_names, old[6], new[6]):
            if a != b:
                out.append(f"the submodules of {name or 'the module'} changed (one replaced, added or removed)")
        out += [f"the class of module {name} changed: {a.__name__} -> {b.__name__}"
                for (name, _), a, b in zip(named, old[7], new[7]) if a is not b]
        if old[3] != new[3] and len(old[3]) == len(new[3]):
            # (a tuple of values per group, keys in ``keys``' order: see _compile_env)
            for gname, ks, a, b in zip(group_names, keys, old[3], new[3]):
                out += [f"optimizer hyperparameter {gname}[{k!r}]: {x!r} -> {y!r}"
                        for k, x, y in zip(ks, a, b) if x != y]
        if list(old[1:3]) + list(old[4:6]) != list(new[1:3]) + list(new[4:6]) or len(old[3]) != len(new[3]):
            out.append("module hooks, or an optimizer's parameter groups or state, changed")
        if old[8] != new[8]:
            out.append("a gradient hook was added to or removed from a parameter (register_hook)")
        if old[10] != new[10]:
            out.append("a closed-over list or dict of tensors changed length (a dict: its keys, or their "
                       "order), or a module's parameters or buffers that the function iterates "
                       "(register_buffer, register_parameter, del)")
        if old[11] != new[11]:
            out += [f"the name {n!r} is bound to another object (rebound between calls)"
                    for n, x, y in zip(b_names, old[11], new[11]) if x != y]
        if old[9] != new[9]:
            a, b = old[9], new[9]
            out += [f"{p} is another object (rebound, set or tied)" for (_, _, p), x, y in zip(slots.id_slots, a[0], b[0]) if x != y]
            out += [f"{p} {'appeared' if any(b[1][4 * i:4 * i + 4]) else 'was deleted'}"
                    for i, (_, _, p) in enumerate(slots.absent) if a[1][4 * i:4 * i + 4] != b[1][4 * i:4 * i + 4]]
            out += [f"class attribute {p}: {x!r} -> {y!r}" for (_, _, p), x, y in zip(slots.cls_slots, a[2], b[2]) if x != y]
        return out

    return diff


def _at(c: Any, k: Any) -> Any:
    """``c[k]``, or None where it has no such item (a list grown shorter)."""
    try:
        return c[k]
    except (IndexError, KeyError, TypeError):
        return None


def _compile_env(attr_dicts: Sequence[Tuple[Dict[str, Any], Tuple[str, ...]]], hook_dicts: Sequence[Dict[Any, Any]],
                 gdicts: Sequence[Dict[Any, Any]], groups: Sequence[Dict[str, Any]], keys: Sequence[Tuple[str, ...]],
                 opts: Sequence[Any], sub_dicts: Sequence[Dict[str, Any]], mods: Sequence[Any], extra: Any,
                 conts: Sequence[Any], bound: Any, grad_hooks: Optional[GradHooks] = None) -> Callable[[], Any]:
    """The function :func:`env_key_fn` returns, written out as straight-line Python.

    It is on every call's path: each dict and attribute it reads is a name of its own and
    each part one expression, with no loop, comprehension or temporary map (a closed-over
    ``nn.Sequential`` of three modules: 3.2 us per call on the dev box as comprehensions,
    ~1 us written out; three to four times that on the lent GPU hosts). The value is the
    tuple ``diff`` and ``lazy_part`` index: attributes, module hooks, global hooks,
    optimizer hyperparameters, optimizers' structure, their groups' parameter lists,
    submodules, module classes, the parameters' gradient hooks (:class:`GradHooks`), identity
    slots / absent names / class attributes, container lengths, name bindings.
    """
    ns: Dict[str, Any] = {"_TRACE_HOOKS": _TRACE_HOOKS, "_id": id, "_at": _at}
    n = [0]

    def name(value: Any, prefix: str) -> str:
        n[0] += 1
        k = f"{prefix}{n[0]}"
        ns[k] = value
        return k

    def tup(items: Sequence[str]) -> str:
        return "(" + "".join(i + ", " for i in items) + ")"

    lines = ["def env():"]
    # attributes read by the trace (``training`` first for modules): a value per dict, or a tuple
    parts = []
    for d, ks in attr_dicts:
        dn = name(d, "A")
        if len(ks) == 1:
            parts.append(f"{dn}[{ks[0]!r}]")
        else:
            parts.append(tup([f"{dn}[{k!r}]" for k in ks]))
    lines += ["    try:", f"        attrs = {tup(parts)}", "    except KeyError:  # an attribute was deleted",
              "        attrs = None"]
    hooks = [name(h, "H") for h in hook_dicts]
    lines.append(f"    hooks = {tup([f'tuple({h})' for h in hooks])} if ({' or '.join(hooks)}) else ()"
                 if hooks else "    hooks = ()")
    ghooks = [name(h, "GH") for h in gdicts]
    ns["GHOOKS"] = list(gdicts)
    lines.append("    ghooks = tuple(t for t in (tuple(k for k in d if k not in _TRACE_HOOKS) for d in GHOOKS if d) if t)"
                 f" if ({' or '.join(ghooks)}) else ()" if ghooks else "    ghooks = ()")
    hyper = []
    for g, ks in zip(groups, keys):
        gn = name(g, "P")
        hyper.append(tup([f"{gn}[{k!r}]" for k in ks]))
    struct = []
    for o in opts:
        on = name(o, "O")
        struct.append(f"(tuple(map(_id, {on}.param_groups)), _id({on}.state), len({on}.state), "
                      f"tuple(map(_id, {on}.state.values())))")
    plists = [f"(_id({gn}['params']), len({gn}['params']))" for gn in (name(g, "Q") for g in groups)]
    subs = [f"tuple({name(d, 'S')}.values())" for d in sub_dicts]
    types_ = [f"{name(m, 'M')}.__class__" for m in mods]
    lines.append("    extra = None")
    if extra is not None:
        id_d, id_k, ab_d, ab_k, cl_d, cl_k = extra
        ids = [f"_id({name(d, 'I')}.get({name(k, 'K')}))" for d, k in zip(id_d, id_k)]
        ab = [f"({name(k, 'K')} in {name(d, 'B')})" for d, k in zip(ab_d, ab_k)]
        cl = [f"{name(d, 'C')}.get({name(k, 'K')})" for d, k in zip(cl_d, cl_k)]
        lines[-1] = f"    extra = ({tup(ids)}, {tup(ab)}, {tup(cl)})"
    conts_expr = "None"
    if conts:
        # (a dict's keys in order: an entry added, removed, renamed or moved to the end; a sequence's length)
        conts_expr = tup([f"tuple({name(c, 'L')})" if isinstance(c, dict) else f"len({name(c, 'L')})" for c in conts])
    bind_expr = "None"
    if bound is not None:
        # a name's binding (a global, a closure cell, a module's attribute) and what a container
        # or object the function reaches holds (a dict's entry, a list's item, an attribute)
        b_dicts, b_keys, b_objs, b_attrs = bound
        items = [f"_id({name(d, 'D')}.get({name(k, 'K')}))" if type(d) is dict
                 else f"_id(_at({name(d, 'D')}, {name(k, 'K')}))" for d, k in zip(b_dicts, b_keys)]
        items += [f"_id({name(c, 'Z')}.cell_contents)" if a == "cell_contents"
                  else f"_id(getattr({name(c, 'Z')}, {name(a, 'K')}, None))" for c, a in zip(b_objs, b_attrs)]
        lines += ["    try:", f"        binds = {tup(items)}", "    except ValueError:  # a cell was emptied (del)",
                  "        binds = None"]
        bind_expr = "binds"
    grads_expr = "None"
    if grad_hooks is not None:  # read again only when a hook may have been added or removed
        ns.update(GRADS=grad_hooks, RH=_RemovableHandle, GL=grad_hooks.lens)
        checks = ["RH.next_id == GRADS.seen"] + [f"len({name(d, 'GD')}) == GL[{i}]" for i, d in enumerate(grad_hooks.watched)]
        grads_expr = f"GRADS.value if {' and '.join(checks)} else GRADS.refresh()"
    lines.append(
        f"    return (attrs, hooks, ghooks, {tup(hyper)}, {tup(struct)}, {tup(plists)}, {tup(subs)}, "
        f"{tup(types_)}, {grads_expr}, extra, {conts_expr}, {bind_expr})")
    src = "\n".join(lines) + "\n"
    exec(compile(src, "<gtransform environment key>", "exec"), ns)
    env = ns["env"]
    env.source = src  # type: ignore[attr-defined]
    return env  # type: ignore[no-any-return]


def _plain_objects_env(pobj_attrs: List[Tuple[str, Dict[str, Any], Tuple[str, ...]]]) -> Callable[[], Any]:
    """:func:`env_key_fn` where only plain objects' attributes are keyed: one getter each."""
    getters = [(d, operator.itemgetter(*ks)) for _, d, ks in pobj_attrs]

    def env() -> Any:
        try:
            return [get(d) for d, get in getters]
        except KeyError:  # an attribute was deleted
            return None

    def diff(old: Any) -> List[str]:
        new = env()
        if old is None or new is None:
            return ["an attribute the function read was deleted"] if old != new else []
        out: List[str] = []
        for (name, _, ks), a, b in zip(pobj_attrs, old, new):
            a, b = (a, b) if len(ks) > 1 else ((a,), (b,))
            out += [f"attribute {name}.{k}: {x!r} -> {y!r}" for k, x, y in zip(ks, a, b) if x != y]
        return out

    env.diff = diff  # type: ignore[attr-defined]
    env.lazy_part = lambda v: None  # type: ignore[attr-defined]
    env.watched = []  # type: ignore[attr-defined]
    env.keep = []  # type: ignore[attr-defined]
    env.describe = (  # type: ignore[attr-defined]
        f"{len(pobj_attrs)} plain object(s) ({sum(len(ks) for _, _, ks in pobj_attrs)} Python attributes)")
    return env

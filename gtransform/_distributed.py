"""Collectives inside recordings (torch.distributed): lockstep recording and clean shutdown.

Hooks called by the recording layer (``_record.make_recording``):

* :func:`before_record` runs before a signature is recorded;
* :func:`track` sees every recording made.

Both do nothing unless the traced graph contains collectives
(``torch.ops._c10d_functional.*`` or ``torch.ops.c10d.*``) and a process
group of more than one rank is initialised. Nothing here runs per call: every
check happens when a signature is recorded, which is where ranks can disagree.

What this module does for a recording with collectives:

1. **Replay-safe graph.** c10d's in-place collectives (``dist.all_reduce`` and
   friends) trace without their ``work.wait()``; gloo runs them on a worker
   thread, so a CPU replay would read the result before it is there. On the CPU
   (and for ``fuse=True``, whose compiler cannot take c10d's process-group
   objects) they are rewritten into the equivalent functional collectives,
   ``wait_tensor`` and a copy into the tensor the c10d op writes. NCCL's synchronous collectives run
   on the current stream and are captured as traced.
2. **Lockstep.** Before recording, every rank taking part in the graph's
   collectives publishes what it is about to record (function, input
   signature, collectives) in the process group's store and waits for the
   others: a different signature is a :class:`GraphifyError` on every rank; a
   rank that does not arrive within the timeout (it is replaying a signature
   it recorded earlier, or failed) is a ``GraphifyError`` on the waiting rank,
   which then posts an abort to the store and aborts the groups it uses.
   A background thread on every rank watches for that abort, aborts its own
   groups (so a collective stuck waiting for the failed peer returns) and
   poisons its recordings: their next replay raises a ``GraphifyError``
   naming the function, the rank and the cause. After recording, the ranks
   meet once more, so a recording that failed on one rank is an error on the
   others instead of a hang in their next replay.
3. **Shutdown.** NCCL keeps a reference on its communicator for every CUDA
   graph that captured one of its collectives, and ``ncclCommDestroy`` waits
   for those graphs to go away (pytorch/pytorch#115388). Before
   ``torch.distributed.destroy_process_group`` (which ``_patches`` routes here
   from the first trace of a function with collectives until the whole world is
   destroyed: nothing is changed at import) and
   at interpreter exit, the device is synchronised and every recording with
   collectives is closed and its CUDA graphs destroyed. A function whose
   recordings were released raises a ``GraphifyError`` when called again
   until its cache is cleared. Process groups are held weakly, so that
   ``destroy_process_group`` frees a gloo group and joins its worker threads
   while the interpreter is alive (see ``_import_group_defaults``).

The timeout of the recording-time agreement is the process group's store
timeout (``init_process_group(timeout=...)``), or ``GTRANSFORM_COLLECTIVE_TIMEOUT``
seconds when that environment variable is set.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import importlib
import json
import operator
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ._compat import (
    FakeTensorMode,
    c10d_allgather_base,
    c10d_functional,
    c10d_reduce_scatter_base,
    load_get_default_group,
    load_get_default_store,
    load_resolve_process_group,
)
from ._errors import GraphifyError
from ._patches import route_always, unroute

__all__ = ["before_record", "track", "record_failed", "release", "collective_ops", "TIMEOUT_ENV"]

TIMEOUT_ENV = "GTRANSFORM_COLLECTIVE_TIMEOUT"
_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
_PREFIX = "gtransform"
_POLL_S = 0.25

try:
    import torch.distributed as _dist

    _AVAILABLE = bool(_dist.is_available())
except Exception:  # pragma: no cover - torch without distributed
    _dist = None  # type: ignore[assignment]
    _AVAILABLE = False

_REDUCE_NAMES = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor"}


# -- what a graph contains -----------------------------------------------------
def _namespace(target: Any) -> Optional[str]:
    ns = getattr(target, "namespace", None)
    return ns if isinstance(ns, str) else None


def collective_ops(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    """The nodes of ``gm`` that are collectives (c10d or functional collectives).

    Args:
        gm: a traced graph.

    Returns:
        The collective call nodes, in graph order (``wait_tensor`` included).
    """
    return [n for n in gm.graph.nodes if n.op == "call_function" and _namespace(n.target) in _NAMESPACES]


def _schema_arg(node: torch.fx.Node, name: str) -> Any:
    """The value of argument ``name`` of an op node (positional or keyword)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args) and not a.kwarg_only:
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else None)
    return None


def _attr_value(gm: torch.fx.GraphModule, v: Any) -> Any:
    if isinstance(v, torch.fx.Node) and v.op == "get_attr":
        obj: Any = gm
        for part in str(v.target).split("."):
            obj = getattr(obj, part)
        return obj
    return v


def _unbox_group(obj: Any) -> Any:
    """A ``ProcessGroup`` from a traced argument (torchbind object or group name)."""
    if isinstance(obj, str):
        return load_resolve_process_group()(obj)
    if _dist is not None and isinstance(obj, _dist.ProcessGroup):
        return obj
    return _dist.ProcessGroup.unbox(obj)  # type: ignore[union-attr]


def _reduce_name(obj: Any) -> Optional[str]:
    try:
        code = int(obj.op())
    except Exception:
        try:
            code = int(obj)
        except Exception:
            return None
    return _REDUCE_NAMES.get(code)


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` (a strong one if it cannot be referenced weakly)."""
    try:
        return weakref.ref(obj)
    except TypeError:  # pragma: no cover - every ProcessGroup of torch takes weak references
        return lambda: obj


class _Info:
    """What the recording layer needs to know about a plan's collectives.

    The process groups are held weakly, so that a recording (or a function's
    cache of plans) does not keep a group alive after ``destroy_process_group``:
    see :func:`_import_group_defaults`.
    """

    __slots__ = ("_groups", "ranks", "ops", "rewritten")

    def __init__(self, groups: List[Any], ranks: Tuple[int, ...], ops: List[str]):
        self._groups = [_weak(g) for g in groups]  # the ProcessGroup objects the graph uses
        self.ranks = ranks  # global ranks taking part (sorted)
        self.ops = ops  # readable summary of the collectives, for agreement
        self.rewritten = False

    @property
    def groups(self) -> List[Any]:
        """The graph's process groups that still exist."""
        return [g for g in (ref() for ref in self._groups) if g is not None]


def _analyse(gm: torch.fx.GraphModule) -> Optional[_Info]:
    nodes = [n for n in collective_ops(gm) if n.target is not c10d_functional().wait_tensor.default]
    if not nodes:
        return None
    groups: Dict[str, Any] = {}
    ops: List[str] = []
    for n in nodes:
        g = _schema_arg(n, "group_name")
        if g is None:
            g = _schema_arg(n, "process_group")
        try:
            pg = _unbox_group(_attr_value(gm, g))
            name = str(pg.group_name)
            groups.setdefault(name, pg)
        except Exception:
            name = "?"
        shapes = []
        for a in n.args:
            for x in a if isinstance(a, (list, tuple)) else [a]:
                val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
                if isinstance(val, torch.Tensor):
                    shapes.append(f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}")
        ops.append(f"{n.target}@{name}({', '.join(shapes)})")
    ranks: set = set()
    for pg in groups.values():
        try:
            ranks.update(_dist.get_process_group_ranks(pg))  # type: ignore[union-attr]
        except Exception:
            ranks.update(range(_dist.get_world_size()))  # type: ignore[union-attr]
    if not groups:
        ranks.update(range(_dist.get_world_size()))  # type: ignore[union-attr]
    return _Info(list(groups.values()), tuple(sorted(ranks)), ops)


# -- making c10d's in-place collectives replayable ------------------------------
def _work_node(g: torch.fx.Graph, n: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The node holding the Work that ``n`` returns (made if needed)."""
    rets = n.target._schema.returns  # type: ignore[union-attr]
    idx = next((i for i, r in enumerate(rets) if "Work" in str(r.type)), None)
    if idx is None:
        return None
    if len(rets) == 1:
        return n
    for u in n.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[1] == idx:
            return u
    with g.inserting_after(n):
        return g.call_function(operator.getitem, (n, idx))


def _tensor_users(n: torch.fx.Node, i: Optional[int]) -> List[torch.fx.Node]:
    """``getitem`` nodes that read output tensor ``i`` of a c10d op (``None``: the single tensor)."""
    outs = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
    if i is None:
        return outs
    return [v for o in outs for v in o.users if v.op == "call_function" and v.target is operator.getitem and v.args[1] == i]


def _rewrite_c10d(gm: torch.fx.GraphModule) -> bool:
    """Rewrite c10d's in-place collectives so that a replay waits for them.

    ``allreduce_``, ``broadcast_``, ``_allgather_base_`` and
    ``_reduce_scatter_base_`` become the functional collectives, their
    ``wait_tensor`` and a copy into the tensor the c10d op writes (the
    compiler of ``fuse=True`` understands those, and removes the copy);
    other c10d ops get a ``work.wait()`` after them.

    Returns:
        Whether the graph changed.
    """
    g = gm.graph
    c10d = torch.ops.c10d
    fc = c10d_functional()
    wait = fc.wait_tensor.default
    copy = torch.ops.aten.copy_.default
    changed = False

    def functional(after: torch.fx.Node, op: Any, args: Tuple[Any, ...], dst: Any) -> torch.fx.Node:
        # dst.copy_(wait_tensor(op(*args))): the functional collective, its wait, and
        # the in-place result the c10d op would have written
        with g.inserting_after(after):
            r = g.call_function(op, args)
        with g.inserting_after(r):
            wt = g.call_function(wait, (r,))
        with g.inserting_after(wt):
            return g.call_function(copy, (dst, wt))

    for n in list(g.nodes):
        if n.op != "call_function" or _namespace(n.target) != "c10d":
            continue
        target = n.target
        repl: List[Tuple[List[torch.fx.Node], torch.fx.Node]] = []  # (old users, new value)
        try:
            gname: Optional[str] = str(_unbox_group(_attr_value(gm, _schema_arg(n, "process_group"))).group_name)
        except Exception:
            gname = None
        done = False
        if gname is not None and target is c10d.allreduce_.default:
            op = _reduce_name(_attr_value(gm, _schema_arg(n, "reduce_op")))
            if op is not None and _schema_arg(n, "sparse_indices") is None:
                last = n
                for i, t in enumerate(n.args[0]):  # type: ignore[arg-type]
                    last = functional(last, fc.all_reduce.default, (t, op, gname), t)
                    repl.append((_tensor_users(n, i), last))
                done = True
        elif gname is not None and target is c10d.broadcast_.default and _schema_arg(n, "root_tensor") == 0:
            src = _schema_arg(n, "root_rank")
            last = n
            for i, t in enumerate(n.args[0]):  # type: ignore[arg-type]
                last = functional(last, fc.broadcast.default, (t, src, gname), t)
                repl.append((_tensor_users(n, i), last))
            done = True
        elif gname is not None and target is c10d_allgather_base():
            out, inp = n.args[0], n.args[1]
            size = _unbox_group(gname).size()
            c = functional(n, fc.all_gather_into_tensor.default, (inp, size, gname), out)
            repl.append((_tensor_users(n, None), c))
            done = True
        elif gname is not None and target is c10d_reduce_scatter_base():
            op = _reduce_name(_attr_value(gm, _schema_arg(n, "reduce_op")))
            if op is not None:
                out, inp = n.args[0], n.args[1]
                size = _unbox_group(gname).size()
                c = functional(n, fc.reduce_scatter_tensor.default, (inp, op, size, gname), out)
                repl.append((_tensor_users(n, None), c))
                done = True
        if done:
            for olds, new in repl:
                for old in olds:
                    old.replace_all_uses_with(new)
                    g.erase_node(old)
            for u in list(n.users):  # the list and Work getitems, now unused
                if not u.users:
                    g.erase_node(u)
            if not n.users:
                g.erase_node(n)
            changed = True
            continue
        work = _work_node(g, n)
        if work is not None:
            with g.inserting_after(work):
                g.call_method("wait", (work,))
            changed = True
    if changed:
        g.lint()
        gm.recompile()
    return changed


# -- process-group state -------------------------------------------------------
class _World:
    """State tied to one incarnation of the default process group."""

    def __init__(self, pg: Any, index: int):
        self.pg_ref = weakref.ref(pg)
        self.index = index
        self.rank = _dist.get_rank()  # type: ignore[union-attr]
        self.store = load_get_default_store()()
        self.seq: Dict[Tuple[int, ...], int] = {}
        self.aborted: Optional[str] = None
        self.monitor: Optional[threading.Thread] = None
        self.stop = threading.Event()

    def key(self, *parts: Any) -> str:
        return "/".join([_PREFIX, str(self.index)] + [str(p) for p in parts])

    def timeout(self) -> float:
        env = os.environ.get(TIMEOUT_ENV)
        if env:
            try:
                return max(0.1, float(env))
            except ValueError:
                pass
        try:
            return float(self.store.timeout.total_seconds())  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover
            return 1800.0


_LOCK = threading.RLock()
_WORLD: Optional[_World] = None
_INCARNATIONS = 0
# recordings with collectives: id -> (weakref to the recording, its info)
_TRACKED: Dict[int, Tuple[Any, _Info]] = {}
_TRACED_COLLECTIVES = False  # a signature with collectives was traced in this process (see _forget_groups)


def _world() -> Optional[_World]:
    """The state of the current default group (``None`` if not distributed)."""
    global _WORLD, _INCARNATIONS
    if not _AVAILABLE or not _dist.is_initialized():  # type: ignore[union-attr]
        return None
    pg = load_get_default_group()()
    w = _WORLD
    if w is None or w.pg_ref() is not pg:
        with _LOCK:
            w = _WORLD
            if w is None or w.pg_ref() is not pg:
                if w is not None:
                    w.stop.set()
                _INCARNATIONS += 1
                w = _WORLD = _World(pg, _INCARNATIONS)
    return w


def _signature(plan: Any, info: _Info) -> str:
    parts = []
    for path, node in zip(plan.in_paths, [n for n in plan.gm.graph.nodes if n.op == "placeholder"]):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            parts.append(f"{path}: {str(val.dtype).replace('torch.', '')}{list(val.shape)}")
    s = ", ".join(parts[:4]) + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "")
    return s


def _caller_flags(plan: Any) -> Tuple[bool, bool]:
    """(cuda, fuse) of the recording about to be made, read from ``make_recording``'s frame."""
    cuda, fuse = bool(getattr(plan, "uses_cuda", False)), False
    try:
        f = sys._getframe(2)
        loc = f.f_locals
        if "fuse" in loc and "plan" in loc and loc["plan"] is plan:
            fuse = bool(loc["fuse"])
            cuda = bool(loc.get("cuda", cuda))
    except Exception:  # pragma: no cover
        pass
    return cuda, fuse


_HOW_TO_FIX = (
    "Fix: every rank must call the function with the same shapes, dtypes and static arguments, in the same "
    "order (e.g. drop or pad an uneven last batch: DistributedSampler(..., drop_last=True)); make "
    "rank-dependent Python code outside the graphified function."
)
_WHY = (
    "Why: a recording with collectives is made and replayed in lockstep: every rank in its process groups "
    "must record the same signatures in the same order, or its collectives would be matched against "
    "other collectives and hang."
)


def _fail(w: _World, msg: str, abort: bool) -> GraphifyError:
    """Make the error; if ``abort``, post it for the other ranks and abort the groups."""
    if abort:
        try:
            w.store.set(w.key("abort"), msg)
        except Exception:
            pass
        _abort_local(w, msg)
    return GraphifyError(msg)


def before_record(plan: Any, desc: str, cuda: Optional[bool] = None, fuse: Optional[bool] = None) -> None:
    """Called before ``plan`` is recorded (may raise ``GraphifyError``).

    If ``plan`` contains collectives and a process group is initialised, make
    the graph replay-safe and agree with the other ranks on what is recorded.

    Args:
        plan: the traced signature (``plan.gm`` is its aten graph).
        desc: ``graphify(name)``, for messages.
        cuda: whether the CUDA backend records it (``None``: read from the caller).
        fuse: whether it is compiled with ``fuse=True`` (``None``: read from the caller).

    Raises:
        GraphifyError: the ranks disagree, a rank did not arrive in time, or
            an earlier lockstep violation aborted the groups.
    """
    if not _AVAILABLE:
        return
    w = _world()
    if w is None:
        return  # not distributed: collectives, if any, fail in torch with its own error
    info = plan.__dict__.get("_gt_collectives", False)
    if info is False:
        info = plan.__dict__["_gt_collectives"] = _analyse(plan.gm)
    if info is None:
        return
    global _TRACED_COLLECTIVES
    _TRACED_COLLECTIVES = True
    _route_destroy()
    if cuda is None or fuse is None:
        cuda, fuse = _caller_flags(plan)
    if (not cuda or fuse) and not info.rewritten:
        # the fused graph is compiled lazily from plan.gm, so rewriting now suffices
        _rewrite_c10d(plan.gm)
        info.rewritten = True
    if w.aborted is not None:
        raise GraphifyError(
            f"{desc}: cannot record on rank {w.rank}: its process group was aborted after a lockstep "
            f"violation:\n{w.aborted}\nFix: fix the cause above and restart the processes."
        )
    if len(info.ranks) <= 1 or w.rank not in info.ranks:
        return
    n = w.seq.get(info.ranks, 0)
    w.seq[info.ranks] = n + 1
    group = "-".join(map(str, info.ranks)) if len(info.ranks) <= 16 else hashlib.sha1(str(info.ranks).encode()).hexdigest()[:12]
    base = w.key("rec", group, n)
    sig = _signature(plan, info)
    digest = hashlib.sha1(json.dumps([desc, sig, info.ops]).encode()).hexdigest()
    mine = json.dumps({"desc": desc, "sig": sig, "digest": digest})
    _agree(w, base, mine, info.ranks, desc, sig, n, "record")
    plan.__dict__["_gt_pending"] = (base, info.ranks, desc, sig, n)


def _agree(w: _World, base: str, mine: str, ranks: Sequence[int], desc: str, sig: str, n: int, stage: str) -> List[Dict[str, Any]]:
    """Publish ``mine`` under ``base`` and wait for every rank's entry."""
    store = w.store
    store.set(f"{base}/{w.rank}", mine)
    keys = [f"{base}/{r}" for r in ranks]
    timeout = w.timeout()
    t0 = time.monotonic()
    abort_key = w.key("abort")
    while True:
        # wait in slices, so that an abort posted meanwhile ends the wait early
        left = timeout - (time.monotonic() - t0)
        try:
            store.wait(keys, timedelta(seconds=max(0.05, min(1.0, left))))
            break
        except Exception:
            pass
        try:
            if store.check([abort_key]):
                msg = store.get(abort_key).decode(errors="replace")
                w.aborted = msg
                _abort_local(w, msg)
                raise GraphifyError(
                    f"{desc}: rank {w.rank} stopped while recording {sig or 'a signature'}: another rank "
                    f"reported a lockstep violation:\n{msg}"
                )
        except GraphifyError:
            raise
        except Exception:
            pass
        if time.monotonic() - t0 >= timeout:
            missing = []
            for r, k in zip(ranks, keys):
                try:
                    if not store.check([k]):
                        missing.append(r)
                except Exception:
                    missing.append(r)
            what = "record" if stage == "record" else "finish recording"
            msg = (
                f"{desc}: rank {w.rank} waited {timeout:g} s for rank(s) {missing} to {what} the same signature "
                f"({sig or 'no tensor inputs'}; recording #{n} with collectives over ranks {list(ranks)}), and "
                "they did not.\n"
                + (
                    "Why: those ranks are replaying a signature they recorded earlier (their inputs differ from "
                    "this rank's), running other code, or failed; a recording with collectives is made in "
                    "lockstep on every rank of its groups, and replaying against a rank that records would hang.\n"
                    if stage == "record"
                    else "Why: the recording failed on those ranks (see their error) or they stopped; replaying "
                    "here would wait for them forever.\n"
                )
                + _HOW_TO_FIX
                + f" To wait longer for slow ranks, set {TIMEOUT_ENV} (seconds) or init_process_group(timeout=...)."
                " The process groups were aborted on every rank: restart the processes."
            )
            raise _fail(w, msg, abort=True)
    vals = []
    for k in keys:
        vals.append(json.loads(store.get(k).decode()))
    if stage == "record":
        digests = {v["digest"] for v in vals}
        if len(digests) > 1:
            listing = "\n".join(f"  rank {r}: {v['desc']} ({v['sig'] or 'no tensor inputs'})" for r, v in zip(ranks, vals))
            raise GraphifyError(
                f"{desc}: rank {w.rank}: the ranks are recording different signatures (recording #{n} with "
                f"collectives over ranks {list(ranks)}):\n{listing}\n{_WHY}\n{_HOW_TO_FIX}"
            )
    else:
        bad = [(r, v) for r, v in zip(ranks, vals) if not v.get("ok")]
        if bad:
            listing = "\n".join(f"  rank {r}: {v.get('error', 'failed')}" for r, v in bad)
            msg = (
                f"{desc}: rank {w.rank}: recording {sig or ''} failed on rank(s) {[r for r, _ in bad]}:\n{listing}\n"
                "Why: a recording with collectives must exist on every rank of its groups; replaying it here "
                "would wait forever for the ranks that have none.\nFix: fix the error on those ranks."
            )
            raise GraphifyError(msg)
    return vals


def record_failed(plan: Any, desc: str, exc: BaseException) -> None:
    """Tell the other ranks that recording ``plan`` failed here (hook for ``make_recording``).

    Args:
        plan: the plan whose recording failed.
        desc: ``graphify(name)``.
        exc: the error.
    """
    pending = plan.__dict__.pop("_gt_pending", None)
    w = _world()
    if pending is None or w is None:
        return
    base, _ranks, _desc, _sig, _n = pending
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        w.store.set(f"{base}/done/{w.rank}", json.dumps({"ok": False, "error": f"{type(exc).__name__}: {first}"}))
    except Exception:
        pass


# -- tracking, abort, shutdown --------------------------------------------------
def track(rec: Any) -> None:
    """Called with every new recording.

    Recordings with collectives are tracked (weakly) so that they can be
    released before their process group is destroyed, and the ranks meet once
    more: a recording that failed on another rank is an error here.

    Args:
        rec: the new recording.

    Raises:
        GraphifyError: the recording failed on another rank.
    """
    plan = rec.plan
    info = plan.__dict__.get("_gt_collectives")
    if not info:
        return
    w = _world()
    if w is None:
        return
    with _LOCK:
        _TRACKED[id(rec)] = (weakref.ref(rec, _untrack(id(rec))), info)
        _start_monitor(w)
    if getattr(rec, "backend", "") == "cpu" and not isinstance(rec.gm, _Guarded):
        rec.gm = _Guarded(rec.gm, rec.desc)
    pending = plan.__dict__.pop("_gt_pending", None)
    if pending is not None:
        base, ranks, desc, sig, n = pending
        try:
            _agree(w, f"{base}/done", json.dumps({"ok": True}), ranks, desc, sig, n, "done")
        except GraphifyError:
            rec.close()
            raise


def _untrack(key: int) -> Callable[[Any], None]:
    def cb(_ref: Any) -> None:
        _TRACKED.pop(key, None)

    return cb


class _Guarded:
    """A CPU recording's graph: turns a failed collective into a ``GraphifyError``.

    Costs one Python call per replay, on CPU recordings with collectives only
    (whose gloo collectives cost far more).
    """

    def __init__(self, gm: Any, desc: str):
        self.gm = gm
        self.desc = desc

    def __call__(self, *args: Any) -> Any:
        try:
            return self.gm(*args)
        except GraphifyError:
            raise
        except Exception as e:
            w = _world()
            if w is None or not _is_comm_failure(w, e):
                raise  # the user's or the compiler's error, unchanged
            raise GraphifyError(_replay_failure(w, self.desc, e)) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gm, name)


_COMM_WORDS = ("gloo", "nccl", "connection", "peer", "timed out", "timeout", "abort", "socket", "process group")


def _is_comm_failure(w: _World, e: BaseException) -> bool:
    """Whether ``e`` (raised by a replay) is a failed collective rather than the user's error."""
    if w.aborted is not None:
        return True
    dist_error = getattr(_dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(word in text for word in _COMM_WORDS)


def _replay_failure(w: _World, desc: str, e: BaseException) -> str:
    cause = w.aborted
    if cause is None:
        try:
            if w.store.check([w.key("abort")]):
                cause = w.store.get(w.key("abort")).decode(errors="replace")
        except Exception:
            cause = None
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if cause is not None:
        return (
            f"{desc}: a collective of its recording failed on rank {w.rank} ({first}) because another rank "
            f"reported a lockstep violation:\n{cause}"
        )
    return (
        f"{desc}: a collective of its recording failed on rank {w.rank}: {first}\n"
        "Why: another rank of its process group probably failed or exited, or is not running the same "
        "recording (ranks must call graphified functions with collectives in lockstep).\n"
        "Fix: look for the first error on the other ranks; restart the processes."
    )


def _poison(rec: Any, msg: str) -> None:
    """Make the next replay of ``rec`` raise ``GraphifyError(msg)`` (no per-call cost until then)."""

    def raise_it(*_a: Any, **_k: Any) -> None:
        raise GraphifyError(msg)

    try:
        rec._maybe_retire = raise_it
        rec.must_retire = True
    except Exception:  # pragma: no cover
        pass


def _live() -> List[Tuple[Any, _Info]]:
    out = []
    for ref, info in list(_TRACKED.values()):
        rec = ref()
        if rec is not None:
            out.append((rec, info))
    return out


def _abort_local(w: _World, msg: str) -> None:
    """Abort the groups of this rank's recordings and poison those recordings."""
    if w.aborted is None:
        w.aborted = msg
    groups: Dict[int, Any] = {}
    for rec, info in _live():
        _poison(
            rec,
            f"{rec.desc}: rank {w.rank} cannot replay: its process group was aborted after a lockstep violation:\n"
            f"{msg}\nFix: fix the cause above and restart the processes.",
        )
        for pg in info.groups:
            groups[id(pg)] = pg
    if not groups:
        return

    def abort_all() -> None:
        for pg in groups.values():
            try:
                pg.abort()
            except Exception:
                pass

    # An abort can block (NCCL may wait for a communicator that a CUDA graph of this rank
    # captured): it runs in a daemon thread, and this rank's error is raised all the same.
    t = threading.Thread(target=abort_all, name="gtransform-abort", daemon=True)
    t.start()
    t.join(timeout=min(10.0, w.timeout()))


def _start_monitor(w: _World) -> None:
    """Start the thread that watches the store for an abort posted by another rank."""
    if w.monitor is not None:
        return
    stop = w.stop
    store = w.store
    key = w.key("abort")
    wref = weakref.ref(w)

    def watch() -> None:
        while not stop.wait(_POLL_S):
            try:
                hit = store.check([key])
            except Exception:
                return  # the store is gone (shutdown)
            if hit:
                ww = wref()
                if ww is None or ww.aborted is not None:
                    return
                try:
                    msg = store.get(key).decode(errors="replace")
                except Exception:
                    msg = "another rank reported a lockstep violation"
                _abort_local(ww, msg)
                return

    t = threading.Thread(target=watch, name="gtransform-collectives-watch", daemon=True)
    w.monitor = t
    t.start()


def _graphs_of(rec: Any) -> Iterable[Any]:
    g = getattr(rec, "graph", None)
    if g is not None:
        yield g


def release(group: Any = None) -> int:
    """Release every recording with collectives (over ``group``, or all).

    Synchronises the device, closes the recordings and destroys their CUDA
    graphs, so that the NCCL communicators they captured can be destroyed.
    A function whose recording was released raises a ``GraphifyError`` when
    called again until its cache is cleared (``f.cache_clear()``).

    Args:
        group: a process group, or ``None`` for all.

    Returns:
        The number of recordings released.
    """
    with _LOCK:
        live = _live()
        if group is not None:
            try:
                name = str(group.group_name)
            except Exception:
                name = None
            live = [(r, i) for r, i in live if any(getattr(pg, "group_name", None) == name for pg in i.groups)]
        if not live:
            return 0
        w = _WORLD
        rank = w.rank if w is not None else "?"
        aborted = w is not None and w.aborted is not None
        cuda_recs = [r for r, _ in live if getattr(r, "backend", "") == "cuda"]
        if cuda_recs and torch.cuda.is_initialized() and not aborted:
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
        pools: Dict[int, Any] = {}
        for rec, _info in live:
            graphs = list(_graphs_of(rec))
            try:
                rec.close()
            except Exception:
                pass
            for g in graphs:
                try:
                    g.reset()
                except Exception:
                    pass
            pool = getattr(rec, "pool", None)
            if pool is not None and getattr(rec, "backend", "") == "cuda":
                pools[id(pool)] = (pool, getattr(rec, "device", None))
            _poison(
                rec,
                f"{rec.desc}: its recording with collectives was released on rank {rank} when the process group "
                "was destroyed (or at exit).\nWhy: a CUDA graph holding NCCL collectives keeps the communicator "
                "alive, so it is released before the group goes away.\n"
                f"Fix: call {rec.desc}.cache_clear() after init_process_group() to record it again over the "
                "new group, or make a new graphified function.",
            )
            _TRACKED.pop(id(rec), None)
        for pool, dev in pools.values():
            _renew_keeper(pool, dev)
        return len(live)


def _renew_keeper(pool: Any, dev: Any) -> None:
    """Destroy the pool's kept graph (it may hold collectives) and keep an empty one instead."""
    old = getattr(pool, "keeper", None)
    if old is None:
        return
    pool.keeper = None
    pid = getattr(pool, "cuda_pool", None)
    if pid is not None and dev is not None:
        # the new keeper first: the old one still holds the pool while it is captured into
        try:
            import warnings

            with torch.cuda.device(dev), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                s = torch.cuda.Stream()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(s):
                    g.capture_begin(pool=pid)
                    g.capture_end()
                pool.keeper = g  # keeps the pool id usable for later captures
        except Exception:
            pass  # (no keeper: the next recording takes a new pool, see _record._function_pool)
    try:
        old.reset()
    except Exception:
        pass


def _import_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` while no process group exists.

    ``destroy_process_group`` must free a gloo group: gloo joins its worker
    threads only in the group's destructor, and a group that lives on until
    interpreter exit is freed (if at all) during finalisation. A worker thread
    that is still releasing a collective then (the one that failed on this rank
    after a lockstep abort, moments before the process exits) takes the GIL to
    drop the Python objects of its tensors; Python ends that thread with
    ``pthread_exit`` and the unwinding through torch's ``noexcept`` destructor
    calls ``std::terminate``: the process dies with SIGABRT ("terminate called
    without an active exception") after a clean shutdown. Freed by
    ``destroy_process_group``, the group's destructor joins its workers with the
    GIL released, while the interpreter is alive.

    This module holds groups weakly (:class:`_Info`). The functions of
    ``torch.distributed.nn.functional`` take ``group=group.WORLD`` as a default
    argument, evaluated when the module is first imported; torch imports it
    lazily (through ``torch._dynamo``, which tracing and the functional
    collectives load), after ``init_process_group``, and its defaults would then
    keep the first default group alive until exit. Imported before any group
    exists (at ``import gtransform``), those defaults are ``None``.
    """
    if "torch.distributed.nn.functional" in sys.modules or _dist.is_initialized():  # type: ignore[union-attr]
        return  # too late: importing it now would keep the current group alive
    try:
        importlib.import_module("torch.distributed.nn.functional")
    except Exception:  # pragma: no cover - a build without it
        pass


def _forget_groups() -> None:
    """Drop the references to process groups that tracing left in torch's caches.

    FakeTensorMode's dispatch cache (a class attribute, kept for the life of the
    process) keys c10d's in-place collectives (``c10d.allreduce_`` and friends)
    on their arguments, the process group's C++ object among them: it would
    keep a destroyed gloo group, and its worker threads, alive until
    interpreter exit, where a thread still running then aborts the process
    (see ``_import_group_defaults``). The entries holding such objects are
    removed, and dead graphified functions caught in reference cycles with a
    group (a closure over ``dist.group.WORLD``) are collected.
    """
    try:
        cache = FakeTensorMode.cache
        script = getattr(torch, "ScriptObject", ())
        for k in [k for k in cache if any(isinstance(v, script) or "ProcessGroup" in type(v).__name__
                                          for v in getattr(k, "key", ()))]:
            cache.pop(k, None)
    except Exception:  # pragma: no cover - a torch without the cache
        pass
    gc.collect()


def _route_destroy() -> None:
    """Route ``destroy_process_group`` to :func:`_destroying` (in every thread, see ``_patches``).

    Its code is routed, not its name: ``from torch.distributed import destroy_process_group``
    written before (or after) gets it too, and the function stays torch's object.
    """
    if not _AVAILABLE:
        return
    import torch.distributed.distributed_c10d as c10d

    route_always(c10d.destroy_process_group, _destroying, [(c10d, "destroy_process_group"), (_dist, "destroy_process_group")])


def _destroying(orig: Any) -> Callable[..., None]:
    """What ``destroy_process_group`` does while routed; ``orig`` is torch's."""
    def destroy_process_group(group: Any = None) -> None:
        w = _WORLD
        try:
            if release(group) or _TRACED_COLLECTIVES:
                _forget_groups()
        finally:
            if group is None and w is not None:
                _stop_monitor(w)
        orig(group)
        if group is None:  # the whole world is gone, and every recording with collectives released
            import torch.distributed.distributed_c10d as c10d

            unroute(c10d.destroy_process_group)

    return destroy_process_group


def _stop_monitor(w: _World, timeout_s: float = 5.0) -> None:
    """Stop the watch thread and wait for it to end.

    The thread spends most of its time in ``store.check`` with the interpreter
    lock released; left running at interpreter exit, it would return from
    there into a finalising interpreter, which ends it with ``pthread_exit``,
    and the unwinding through pybind11's ``noexcept`` frame aborts the process
    (SIGABRT, "terminate called without an active exception") after a clean
    shutdown. Joined here, it ends while the interpreter is alive.
    """
    w.stop.set()
    t = w.monitor
    if t is not None and t is not threading.current_thread() and t.is_alive():
        t.join(timeout_s)


def _at_exit() -> None:
    w = _WORLD
    if w is not None:
        _stop_monitor(w)
    try:
        release(None)
    except Exception:  # pragma: no cover
        pass


if _AVAILABLE:
    # (an import of torch's own module, before any group exists: see _import_group_defaults)
    _import_group_defaults()
    atexit.register(_at_exit)

"""One thread's signatures of one graphified function: the cache, its alternates and marks.

:class:`ThreadState` holds the signatures (least recently used first, bounded by
``maxsize``), the alternates of a key (the same arguments in another environment:
``train()`` and ``eval()``), the marks of the eager-first-call rule and the first
call's trace kept for the second, and the generated fast path of the last recording.
Whether a call matches a signature is :mod:`._key`'s question, not this module's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

from ._key import Entry
from ._liveness import PoolState
from ._symbolic import Families

__all__ = ["ThreadState", "CacheInfo", "cache_info", "cache_clear", "new_thread_state"]


class CacheInfo(NamedTuple):
    """Cache statistics, shaped like ``functools.lru_cache``'s.

    Attributes:
        hits: calls that replayed an existing recording.
        misses: calls (or ``trace`` calls) that traced a new signature.
        maxsize: the bound on signatures kept per thread.
        currsize: signatures kept now, over all threads.

    Examples:
        >>> import torch, gtransform as gt
        >>> f = gt.graphify(lambda x: x + 1)
        >>> _ = f(torch.ones(2)); _ = f(torch.ones(3))
        >>> f.cache_info().misses
        2
    """

    hits: int
    misses: int
    maxsize: Optional[int]
    currsize: int


def cache_info(g: Any) -> CacheInfo:
    """Graphified ``g``'s statistics over every thread (see ``Graphified.cache_info``).

    Alternates of a signature (a model's eval() recording next to its train() one)
    count; so do the recordings of its calls under vmap, made by graphified vmaps of it.
    """
    size = sum(len(s.cache) + sum(map(len, s.alts.values())) for s in list(g._states) if not s.clear_requested)
    hits, misses = g._hits, g._misses
    for h in list(g._vmapped.values()):
        info = h.cache_info()
        hits, misses, size = hits + info.hits, misses + info.misses, size + info.currsize
    return CacheInfo(hits, misses, g._maxsize, size)


def cache_clear(g: Any) -> None:
    """Drop every recording of graphified ``g``, in every thread (see ``Graphified.cache_clear``)."""
    from ._key import StormDetector

    mine = g._tls.__dict__.get("state")
    for s in list(g._states):
        if s is mine:
            s.clear()
        else:
            s.drop_fast()  # its next call takes the generic path, which clears it first
            s.clear_requested = True
    g._hits = g._misses = 0
    quiet = g._storm.silent
    g._storm = StormDetector(g._desc, g._storm.allowance)  # (its log holds static values of the calls)
    if quiet:
        g._storm.quiet()
    for h in list(g._vmapped.values()):
        h.cache_clear()


def new_thread_state(g: Any, pool: PoolState) -> ThreadState:
    """The calling thread's first :class:`ThreadState` of graphified ``g``."""
    keep = g.__dict__.get("_keep_held")
    if keep is not None and pool.lock is None:
        pool.keep_held = keep  # (a piece of a split function: see _dynamo)
    st = ThreadState(pool)
    st.bound(g._maxsize)
    g._tls.state = st
    g._states.add(st)
    return st


class _Marks:
    """A set of signature keys, the oldest forgotten beyond a bound (see ThreadState.bound).

    The keys hold the calls' static values (objects passed as arguments: a KV cache, a
    config): unbounded, a server called with new lengths or new cache objects kept every
    one alive. Forgetting a mark costs at most an extra eager call.
    """

    __slots__ = ("d", "limit")

    def __init__(self) -> None:
        self.d: Dict[Hashable, None] = OrderedDict()
        self.limit: Optional[int] = None

    def add(self, key: Hashable) -> None:
        d = self.d
        d[key] = None
        if self.limit is not None:
            while len(d) > self.limit:
                del d[next(iter(d))]

    def discard(self, key: Hashable) -> None:
        self.d.pop(key, None)

    def clear(self) -> None:
        self.d.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.d

    def __len__(self) -> int:
        return len(self.d)


class ThreadState:
    """One thread's signature cache of one graphified function."""

    __slots__ = ("cache", "last", "pool", "fast", "fast_rec", "warmed", "eager_only", "pending",
                 "clear_requested", "alts", "pending_limit", "raised", "raised_what", "eager_now", "frozen_args",
                 "broken", "broke_now", "families", "places", "first_sets", "__weakref__")

    ALTS = 3  # alternates kept per key (see alts)

    def __init__(self, pool: PoolState):
        self.cache: OrderedDict[Hashable, Entry] = OrderedDict()
        self.last: Optional[Entry] = None
        self.pool = pool
        self.fast: Any = None  # generated fast call of the last settled recording
        self.fast_rec: Any = None
        # signatures that touch state and had their eager first call
        self.warmed: _Marks = _Marks()
        # signatures whose trace failed inside torch's fake kernels while eager ran fine
        self.eager_only: _Marks = _Marks()
        # the key of the call being made whose trace raised the function's own exception, and
        # that exception in words: the call runs eagerly (see Graphified._eager)
        self.raised: Optional[Hashable] = None
        self.raised_what = ""
        self.eager_now = False  # the call being made is of a signature that runs eagerly (eager_only)
        # signatures whose trace read the call's own data on the host, routed by on_break (see
        # _breaks), and whether the call being made is of one
        self.broken: _Marks = _Marks()
        self.broke_now = False
        # the first call's trace of a signature that touches state, kept for its second call
        # (see reusable_after_eager); checked there as any cached signature is
        self.pending: Dict[Hashable, Entry] = OrderedDict()
        self.pending_limit: Optional[int] = None
        self.clear_requested = False  # by cache_clear() in another thread
        # signatures of a key that differ from its cached one in their environment only (a
        # model in eval() mode while the cached one is train(); see Entry.env_only_mismatch),
        # most recent first: a switch back replays them instead of recording again
        self.alts: Dict[Hashable, List[Entry]] = {}
        # arguments read on the host by a call that ran eagerly for it (path -> weak reference):
        # passed again as the very same tensor, their reads are frozen (see _frozen)
        self.frozen_args: Dict[str, List[Any]] = {}
        # calls that differ only in sizes, and the symbolic trace they share (see _symbolic)
        self.families = Families()
        # Python values in modules and objects some trace of the function set (``(id(dict), key) ->
        # (dict, key)``): every later signature sets them after its replays (see _lookup._settle)
        self.places: Dict[Tuple[int, Hashable], Tuple[Dict[Any, Any], Hashable]] = {}
        # the Python values the first trace of each signature set (key -> {(id(dict), key): value}):
        # a later trace setting the same ones sets a constant of its signature (self.n = x.shape[0]),
        # one setting others counts (self.calls += 1), which a replay cannot do (see _lookup._settle)
        self.first_sets: Dict[Hashable, Dict[Tuple[int, Hashable], Any]] = {}

    def note_first_sets(self, key: Hashable, sets: Dict[Tuple[int, Hashable], Any]) -> None:
        """Keep what the first trace of ``key`` set, for as many signatures as ``warmed`` marks (keys hold arguments)."""
        self.first_sets[key] = sets
        limit = self.warmed.limit
        while limit is not None and len(self.first_sets) > limit:
            del self.first_sets[next(iter(self.first_sets))]

    def drop_recorded(self) -> None:
        """Forget the signatures recorded so far (their outputs handed out stay valid); the next calls trace again."""
        for e in list(self.cache.values()) + [a for alts in self.alts.values() for a in alts]:
            if e.rec is not None:
                e.rec.close()
        self.cache.clear()
        self.alts.clear()
        self.pending.clear()
        self.last = None
        self.drop_fast()

    def clear(self) -> None:
        self.clear_requested = False
        for e in self.cache.values():
            if e.rec is not None:
                e.rec.close()
        self.cache.clear()
        for alts in self.alts.values():
            for e in alts:
                if e.rec is not None:
                    e.rec.close()
        self.alts.clear()
        self.warmed.clear()
        self.eager_only.clear()
        self.broken.clear()
        self.pending.clear()
        self.families.clear()
        self.places.clear()
        self.first_sets.clear()
        self.last = None
        self.drop_fast()

    def drop(self, e: Entry, keep_alts: bool = False) -> None:
        """Forget one signature (its recording is closed), and its key's alternates unless ``keep_alts``."""
        if self.cache.get(e.key) is e:
            del self.cache[e.key]
            if not keep_alts:
                for a in self.alts.pop(e.key, ()):
                    self.drop(a, keep_alts=True)
        if e.rec is not None:
            if self.fast_rec is e.rec:
                self.drop_fast()
            e.rec.close()
        if self.last is e:
            self.last = None

    def set_aside(self, e: Entry) -> None:
        """Keep ``e`` as an alternate of its key (the cache's entry is being replaced)."""
        if self.cache.get(e.key) is e:
            del self.cache[e.key]
        if self.last is e:
            self.last = None
        alts = self.alts.setdefault(e.key, [])
        alts.insert(0, e)
        while len(alts) > self.ALTS:
            self.drop(alts.pop(), keep_alts=True)

    def insert(self, key: Hashable, e: Entry, maxsize: Optional[int], evicted: Callable[[Entry], None]) -> None:
        """Cache a new signature; beyond ``maxsize`` the least recently used goes (``evicted`` is told)."""
        self.cache[key] = e
        if maxsize is not None:
            while len(self.cache) > maxsize:
                old = next(iter(self.cache.values()))
                evicted(old)
                self.drop(old)
        self.last = e

    def drop_fast(self) -> None:
        self.fast = self.fast_rec = None

    def bound(self, maxsize: Optional[int]) -> None:
        """Bound the bookkeeping besides the cache by ``maxsize`` (its first-call traces, marks)."""
        limit = None if maxsize is None else max(2 * maxsize, 8)
        self.warmed.limit = self.eager_only.limit = self.broken.limit = limit
        self.pending_limit = None if maxsize is None else max(maxsize, 4)
        self.families.limit = limit

    def keep_pending(self, key: Hashable, e: Entry) -> None:
        """Keep the first call's trace of a signature for its second call (bounded)."""
        p = self.pending
        p[key] = e
        if self.pending_limit is not None:
            while len(p) > self.pending_limit:
                del p[next(iter(p))]

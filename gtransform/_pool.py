"""Memory pools that several graphified functions can share."""

from __future__ import annotations

import threading

from ._liveness import PoolState

__all__ = ["GraphPool", "graph_pool"]


class GraphPool:
    """A memory pool shared by the graphified functions given ``pool=`` it.

    By default each graphified function has a private pool per thread: all its
    signatures share it, so its memory is that of its largest recording, not
    the sum. Functions that always run one after another (a forward and an
    update step, say) can share one pool to save memory further.

    The price: an output of any function in the pool stays valid only until
    the next call of *any* function in the pool, and calls of functions in a
    shared pool are serialised (one at a time across threads), since two
    replays into one pool at once would overwrite each other's memory.

    Examples:
        >>> import torch, gtransform as gt
        >>> p = gt.graph_pool()
        >>> f = gt.graphify(lambda x: x + 1, pool=p)
        >>> g = gt.graphify(lambda x: x * 2, pool=p)
        >>> y = f(torch.ones(2)).clone()   # clone: g's call would poison it
        >>> z = g(y)
    """

    def __init__(self) -> None:
        self._state = PoolState(lock=threading.RLock())

    def __repr__(self) -> str:
        return f"<gtransform.GraphPool calls={self._state.calls}>"


def graph_pool() -> GraphPool:
    """Make a new memory pool handle to share between graphified functions.

    Returns:
        A :class:`GraphPool`; pass it as ``graphify(fn, pool=...)``.

    Examples:
        >>> import gtransform as gt
        >>> p = gt.graph_pool()
        >>> f = gt.graphify(lambda x: x.sin(), pool=p)
    """
    return GraphPool()

"""gtransform: ``jax.jit`` for PyTorch, with CUDA graph capture as the compiler.

Public names:
    graphify, Graphified, CacheInfo, graph_pool, GraphPool, disable,
    GraphifyError, OverwrittenOutputError, RerecordWarning, EagerWarning, PrintWarning.
"""

from ._api import CacheInfo as CacheInfo
from ._api import Graphified as Graphified
from ._api import RerecordWarning as RerecordWarning
from ._api import graphify as graphify
from ._errors import EagerWarning as EagerWarning
from ._errors import GraphifyError as GraphifyError
from ._errors import OverwrittenOutputError as OverwrittenOutputError
from ._errors import PrintWarning as PrintWarning
from ._pool import GraphPool as GraphPool
from ._pool import graph_pool as graph_pool
from ._switch import disable as disable

__version__ = "0.1.0"

__all__ = [
    "CacheInfo",
    "EagerWarning",
    "GraphPool",
    "Graphified",
    "GraphifyError",
    "OverwrittenOutputError",
    "PrintWarning",
    "RerecordWarning",
    "disable",
    "graph_pool",
    "graphify",
]

"""Is this the same recording? The one owner of that question.

A call replays a recording when it matches the recording's signature: the tree structure
of its arguments, each tensor's layout, the static values, which tensors are the same
object or share memory, the global settings, the state the function reaches and the
environment that decides what it computes. This package answers it and nothing else:

* :mod:`._parts`: the parts a call's signature is made of, computed from the call;
* :mod:`._call`: a call's hashable key (the cache index), validating its leaves;
* :mod:`._checks`: **the one list of checks** a call must pass to replay a signature. Both
  the generic match (:meth:`Entry.match`) and the fast path's checks (``_fastpath``) are
  generated from it, so a check cannot exist in one and be missing from the other, and
  each check explains how a call differs (``explain``, the retrace log);
* :mod:`._entry`: one signature (made from a trace) and what the checks compare with;
* :mod:`._guard`: the tensors' check in one C++ call;
* :mod:`._environment`: the environment of state, read on every call;
* :mod:`._storm`: the warnings of functions that keep recording;
"""

from ._call import call_key
from ._checks import CHECKS, Call, Check
from ._entry import Entry, makes_no_state, reusable_after_eager
from ._environment import env_key_fn
from ._parts import alias_pattern, attrs_key, dict_orders, global_key, has_grad, same_objects
from ._storm import StormDetector

__all__ = [
    "CHECKS", "Call", "Check", "Entry", "StormDetector", "alias_pattern", "attrs_key", "call_key", "dict_orders",
    "env_key_fn", "global_key", "has_grad", "makes_no_state", "reusable_after_eager", "same_objects",
]

"""The ``gtransform`` logger.

Set ``GTRANSFORM_LOG=info`` (or ``debug``) in the environment to see one line
per recording, re-recording and poisoning on standard error; or configure the
``gtransform`` logger with :mod:`logging` as usual.
"""

from __future__ import annotations

import logging
import os

__all__ = ["log"]

log = logging.getLogger("gtransform")

_level = os.environ.get("GTRANSFORM_LOG", "").strip().upper()
if _level:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[gtransform] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(getattr(logging, _level, logging.INFO))

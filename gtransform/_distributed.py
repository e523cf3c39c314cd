"""Collectives inside recordings (torch.distributed): lockstep recording and clean shutdown.

Hooks called by the recording layer (``_record.make_recording``):

* :func:`before_record` runs before a signature is recorded;
* :func:`track` sees every recording made.

Both are no-ops until a process group is initialised.
"""

from __future__ import annotations

from typing import Any

__all__ = ["before_record", "track"]


def before_record(plan: Any, desc: str) -> None:
    """Called before ``plan`` is recorded (may raise ``GraphifyError``)."""


def track(rec: Any) -> None:
    """Called with every new recording."""

"""``torch.compile(fn, backend="gtransform")``: the backend registered under that name.

The ``torch_dynamo_backends`` entry point of ``pyproject.toml`` names :func:`backend`; the
work is ``_dynamo``'s (each graph becomes a graphified function). This module only ties it
to :class:`~gtransform._api.Graphified`, which the pipeline below the front door cannot
import.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ._api import Graphified
from ._dynamo import GraphBackend, backend_options, next_name

__all__ = ["backend"]


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: Optional[str] = None,
            options: Optional[Dict[str, Any]] = None) -> Callable[..., Any]:
    """Record an FX graph of TorchDynamo with gtransform: ``torch.compile(fn, backend="gtransform")``.

    Each graph dynamo hands over (the pieces of ``fn`` between graph breaks) becomes a
    graphified function: recorded per input signature and replayed, parameters read in
    place, outputs valid until that graph's next call (touching a stale one raises
    :class:`~gtransform.OverwrittenOutputError`), ``loss.backward()`` replaying a
    recorded backward.

    Args:
        gm: the graph.
        example_inputs: its example inputs (unused: each signature is traced on its first call).
        mode: ``torch.compile``'s mode; only the default is accepted.
        options: graphify's ``fuse`` and ``maxsize`` for every graph
            (``torch.compile(fn, backend="gtransform", options={"fuse": True})``).

    Returns:
        The graphified graph, which dynamo calls with the graph's inputs.

    Raises:
        ValueError: an unknown option, or a mode.
    """
    opts = backend_options(mode, options)
    return GraphBackend(functools.partial(Graphified, **opts), next_name())(gm, example_inputs)

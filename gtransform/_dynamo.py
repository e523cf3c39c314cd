"""The TorchDynamo backend: each FX graph dynamo hands over becomes a graphified function.

``torch.compile(fn, backend="gtransform")`` (the ``torch_dynamo_backends`` entry point,
``gtransform._backend:backend``) and ``graphify(fn, on_break="split")`` (``_breaks``) both
come here. TorchDynamo runs ``fn``'s Python, cuts it into FX graphs at what it cannot trace
(a host read such as ``loss.item()``, a print, ``loss.backward()``), and resumes Python
after each cut. Each graph it hands to :class:`GraphBackend` is made a graphified function
(a *piece*) with gtransform's own machinery, unchanged: the signature cache, static input
buffers, the recording and its pool, the RNG and output rules, and for calls that need
gradients the autograd wrapper of ``_autograd`` (AOTAutograd's joint trace and partitioner:
the forward and backward graphs are each recorded). Dynamo passes parameters and other
tensors reached by ``fn`` as graph inputs: passed as the same tensors on every call, they
are read in place; so is a piece's output handed to the next piece, where it is the same
pool tensor on every call (the caller dropped the previous one). What a piece returns
stays valid: Python between the pieces holds outputs across their next calls (a list of
tokens, a solver's last step), so an output still held when its piece runs again is taken
back (its values copied to memory of its own) instead of going stale. Under
``graphify(fn, on_break="split")`` that holds within one call of ``fn``; an output held into
the next call goes stale as graphify's outputs do. ``torch.compile(fn, backend="gtransform")``
has no call of ``fn`` to see, so there a held output always keeps its values.

Each piece has its own pool: pieces of one call hand their outputs to each other, and a
shared pool would overwrite one piece's outputs with the next one's. Nothing here imports
``torch._dynamo`` (``torch.compile`` does, on its first call).
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ._errors import EagerWarning, GraphifyError

__all__ = ["GraphBackend", "backend_options", "compile_split", "OPTIONS"]

OPTIONS = ("fuse", "maxsize")  # torch.compile(..., options={...}) passed on to each piece's graphify
_COUNT = itertools.count()


class GraphBackend:
    """A dynamo backend: ``backend(gm, example_inputs)`` returns ``gm`` graphified (see the module docstring).

    ``make`` makes a graphified function of a graph (with the options it was given);
    ``name`` names the pieces in messages (``graphify(<name> piece 2)``); ``keep``: True
    (held outputs always keep their values), or an object whose ``generation()`` tells the
    calls apart (``_breaks``: within one call of the split function). The pieces made
    are kept weakly (dynamo's cache holds them), for ``describe``.
    """

    def __init__(self, make: Callable[[Callable[..., Any]], Any], name: str, keep: Any = True):
        self.make, self.name, self.keep = make, name, keep
        self.pieces: List[weakref.ref] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        # (an instance attribute: the piece's messages name it, see _errors.describe_fn)
        setattr(gm, "__qualname__", f"{self.name} piece {len(self.pieces)}")  # noqa: B010 - (an nn.Module)
        recompile = getattr(gm, "real_recompile", None)
        if callable(recompile):
            # a lazily compiled GraphModule writes its forward on its first call; traced
            # before that (under graphify's watch of the module), it calls itself forever
            recompile()
        piece = self.make(gm)
        piece._keep_held = self.keep  # its outputs held across its next call keep their values
        piece._dynamo_piece = True  # (its tensors' Python attributes are dynamo's to guard: see _lookup)
        piece._storm.piece = True  # (its warnings speak of dynamo's arguments)
        self.pieces.append(weakref.ref(piece))
        return _Piece(piece, gm, _scalar_ints(gm, example_inputs))

    def live(self) -> List[Any]:
        """The pieces made so far that dynamo still holds, in order."""
        return [p for p in (r() for r in self.pieces) if p is not None]


class _Piece:
    """What dynamo calls for one graph: its graphified function, or the graph itself once that refused.

    A graph that cannot be recorded (a CPU tensor in a CUDA graph, an op a capture refuses:
    the GraphifyError of its first trace or capture, which leaves no half-state) runs
    eagerly from then on, with one :class:`~gtransform.EagerWarning` naming the reason: the
    function still runs, and never silently eagerly.
    """

    __slots__ = ("piece", "gm", "eager", "scalars", "__weakref__")

    def __init__(self, piece: Any, gm: torch.fx.GraphModule, scalars: Any = None):
        self.piece, self.gm, self.eager = piece, gm, False
        # (position, device) of each int the graph only combines with tensors (see _scalar_ints)
        self.scalars = scalars

    def __call__(self, *args: Any) -> Any:
        if self.eager:
            return self.gm(*args)
        if self.scalars:
            args = tuple(_as_tensors(args, self.scalars))
        try:
            return self.piece(*args)
        except GraphifyError as e:
            self.eager = True
            self.piece.__dict__["_eager_reason"] = str(e).split("\n", 1)[0]
            warnings.warn(f"{self.piece._desc}: this piece cannot be recorded, so it runs eagerly from now "
                          f"on (the rest stays recorded). The reason:\n{e}", EagerWarning, stacklevel=2)
            return self.gm(*args)


# Arithmetic where an int and a 0-dim int64 tensor give the same dtype and values, when the
# other operand is a tensor with dimensions or of a floating or complex type (a 0-dim integer
# tensor would promote to int64 with a tensor, but not with an int). Not pow: an int exponent
# takes other kernels (x ** 2 is x * x) than a tensor one. Nor division: on CUDA `y / n` with
# a Python number multiplies by its reciprocal, which differs from a division in the last bit.
_SCALAR_FNS = frozenset([operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul])
_SCALAR_METHODS = frozenset(["add", "sub", "mul", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
                             "__rmul__"])


def _scalar_ints(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[List[Any]]:
    """The int inputs (``SymInt`` in dynamo's examples) that the graph only combines with tensors.

    Dynamo passes a Python number that changes (a step counter) as an input of the graph; a
    recording would take it as a static value, a signature (a trace and a capture) per value.
    Where its every use is arithmetic with a tensor, a 0-dim int64 tensor computes the same:
    it is passed as one, on the device of the graph's tensors, and copied into its static
    buffer like any input. Returns ``[(position, device), ...]``, or None.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(example_inputs):
        return None
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    if device is None:
        return None
    out = [(k, device) for k, (ph, ex) in enumerate(zip(phs, example_inputs))
           if isinstance(ex, torch.SymInt) and ph.users and all(_with_a_tensor(u, ph) for u in ph.users)]
    return out or None


def _with_a_tensor(use: torch.fx.Node, ph: torch.fx.Node) -> bool:
    """Whether ``use`` is arithmetic of ``ph`` with a tensor, where an int or a 0-dim int64 tensor agree."""
    if not ((use.op == "call_function" and use.target in _SCALAR_FNS)
            or (use.op == "call_method" and use.target in _SCALAR_METHODS)):
        return False
    if len(use.args) != 2 or ph in use.kwargs.values():
        return False
    other = use.args[1] if use.args[0] is ph else use.args[0] if use.args[1] is ph else None
    v = other.meta.get("example_value") if isinstance(other, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and (v.dim() > 0 or v.is_floating_point() or v.is_complex())


def _as_tensors(args: Sequence[Any], scalars: List[Any]) -> List[Any]:
    """``args`` with the ints at ``scalars``' positions as 0-dim int64 tensors (see _scalar_ints)."""
    out = list(args)
    for k, device in scalars:
        v = out[k]
        if type(v) is int:
            out[k] = torch.tensor(v, dtype=torch.int64, device=device)
    return out


def backend_options(mode: Optional[str], options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``torch.compile``'s ``mode`` and ``options`` as graphify's options of each piece (checked)."""
    if mode not in (None, "default"):
        raise ValueError(f"torch.compile(fn, backend=\"gtransform\", mode={mode!r}): gtransform takes no mode "
                         "(every graph is recorded and replayed). Fix: leave mode out.")
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"torch.compile(fn, backend=\"gtransform\", options=...): unknown option(s) {unknown}; "
                         f"gtransform's backend takes {list(OPTIONS)} (graphify's options of the same names).")
    return opts


def next_name() -> str:
    """A name for the graphs of a ``torch.compile(fn, backend="gtransform")`` (numbered per backend call)."""
    return f"torch.compile graph {next(_COUNT)}"


def compile_split(fn: Callable[..., Any], backend: GraphBackend) -> Callable[..., Any]:
    """``fn`` compiled by TorchDynamo with ``backend``.

    Dynamo's default for shapes and numbers (``dynamic=None``): a Python number that the
    resumed code reads (the ``.item()`` of a read) is made symbolic after it changes once,
    instead of compiling the rest of the function again for each value. A size that comes
    as a number to a piece is a static leaf of its signature there (a new size records anew).
    """
    return torch.compile(fn, backend=backend)  # type: ignore[no-any-return]

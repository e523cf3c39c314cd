"""Signatures whose trace reads the call's own data: where ``on_break`` sends them.

A host read of the call's data (``loss.item()``, ``if err > tol:``) or a shape that depends
on it cannot be part of one recording: ``_trace`` refuses it with a :class:`GraphifyError`
marked ``gt_host_read``. Under ``on_break="error"`` (the default) that error is raised as it
is. Otherwise ``_lookup`` hands the error to :func:`mark` (the first trace of a signature
tells, and the thread's marks keep the answer: the signature is not traced again) and the
call, like every later call of that signature, to :func:`run_broken`:

* ``"split"``: ``torch.compile(fn, backend=...)`` with gtransform's backend (``_dynamo``).
  TorchDynamo cuts ``fn`` at each read, runs the read in Python and resumes; each piece
  between reads is a graphified function, recorded and replayed.
* ``"eager"``: ``fn`` runs eagerly, one :class:`EagerWarning` per signature, counted in
  ``f.describe()``.

Nothing here traces or records; the compiled function is made on first use (which imports
TorchDynamo then).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Dict, Hashable, List, Optional

from ._dynamo import GraphBackend, compile_split
from ._errors import EagerWarning, GraphifyError, user_frame
from ._log import log

__all__ = ["ON_BREAK", "Breaks", "routes", "mark", "run_broken", "describe_lines", "explain_line"]

ON_BREAK = ("error", "split", "eager")


class Breaks:
    """One graphified function's signatures that read their own data, and how they run."""

    __slots__ = ("backend", "runner", "signatures", "calls", "reads", "local", "told_no_pieces")

    def __init__(self, g: Any):
        # each piece gets its own pool (see _dynamo), and this function's other options
        name = g._desc[len("graphify("):-1] if g._desc.startswith("graphify(") else g._desc
        self.backend = GraphBackend(lambda gm: type(g)(gm, maxsize=g._maxsize, fuse=g._fuse), name, keep=self)
        self.runner: Optional[Callable[..., Any]] = None  # torch.compile(fn, backend=self.backend)
        self.signatures = 0  # marked (in any thread)
        self.calls = 0  # calls run split or eagerly
        self.reads: Dict[str, None] = {}  # what each signature's trace read first, in words (ordered)
        self.local = threading.local()  # this thread's split calls so far (see generation)
        self.told_no_pieces = False  # (see _no_pieces)

    def generation(self) -> int:
        """The calling thread's split calls so far.

        A piece's outputs held within one call keep their values (Python between the pieces
        holds them); held into the next call, they go stale as graphify's outputs do (see
        ``_liveness.PoolState.begin_call``).
        """
        return getattr(self.local, "n", 0)  # type: ignore[no-any-return]


def _breaks(g: Any) -> Breaks:
    br = g._breaks
    if br is None:
        br = g._breaks = Breaks(g)
    return br  # type: ignore[no-any-return]


def routes(g: Any, err: GraphifyError) -> bool:
    """Whether ``on_break`` takes this refusal of a trace instead of raising it."""
    return g._options.on_break != "error" and bool(getattr(err, "gt_host_read", False))


def mark(g: Any, st: Any, key: Hashable, err: GraphifyError) -> None:
    """A signature whose trace read the call's own data: its calls run as ``on_break`` says from now on."""
    st.broken.add(key)
    br = _breaks(g)
    br.signatures += 1
    first = str(err).split("\n", 1)[0]
    read = (first[len(g._desc) + 2:] if first.startswith(g._desc + ": ") else first).rstrip(".")
    br.reads[read] = None
    if g._options.on_break == "eager":
        fr = user_frame()
        lines = str(err).split("\n")
        at = next((k for k, ln in enumerate(lines) if ln.startswith("  at ")), None)
        where = ""
        if at is not None:  # (the read's line: where the trace met it)
            code = lines[at + 1].strip() if at + 1 < len(lines) else ""
            where = f" {lines[at].strip()}" + (f": `{code}`" if code else "")
        warnings.warn_explicit(
            EagerWarning(f"{g._desc}: a signature reads the call's own data on the host ({read}){where}; with "
                         "on_break=\"eager\" its calls run eagerly (correct, not faster; shown once per signature, "
                         "f.describe() counts such calls). For recorded pieces between the reads: "
                         "on_break=\"split\"."),
            EagerWarning, getattr(fr, "filename", "<unknown>") or "<unknown>", getattr(fr, "lineno", 0) or 0)
    else:
        log.info("%s: %s: this signature runs split by TorchDynamo (on_break=\"split\")", g._desc, read)


def run_broken(g: Any, args: Any, kwargs: Any) -> Any:
    """A call of a marked signature: through the compiled function (``"split"``) or eagerly (``"eager"``)."""
    br = _breaks(g)
    br.calls += 1
    br.local.n = br.generation() + 1
    if g._options.on_break == "eager":
        return g._fn(*args, **kwargs)
    if br.runner is None:
        br.runner = compile_split(g._fn, br.backend)
    out = br.runner(*args, **kwargs)
    if not br.told_no_pieces and not br.backend.pieces:
        _no_pieces(g, br)
    return out


def _no_pieces(g: Any, br: Breaks) -> None:
    """A split call that TorchDynamo ran without handing over any graph: say so once (correct, not faster)."""
    br.told_no_pieces = True
    fr = user_frame()
    warnings.warn_explicit(
        EagerWarning(
            f"{g._desc}: on_break=\"split\" recorded nothing: TorchDynamo ran the whole call eagerly and "
            "handed over no graph to record (it does so when the host read is inside a loop of the function "
            "itself: \"graph break in loop\"; TORCH_LOGS=graph_breaks shows its reason). The results are "
            "eager's, the speed too.\n"
            "Fix: move the loop's body (the tensor work between the reads) into a function of its own, which "
            "TorchDynamo compiles and resumes after each read, or keep the read out of the loop (check every "
            "few steps on a tensor of flags)."),
        EagerWarning, getattr(fr, "filename", "<unknown>") or "<unknown>", getattr(fr, "lineno", 0) or 0)


def describe_lines(g: Any) -> List[str]:
    """What ``f.describe()`` says of the signatures ``on_break`` runs."""
    br = g._breaks
    if br is None:
        return []
    reads = "; ".join(br.reads)
    if g._options.on_break == "eager":
        return [f"on_break=\"eager\": {br.signatures} signature(s) read their own data ({reads}): "
                f"ran eagerly, not recorded: {br.calls} call(s)"]
    pieces = br.backend.live()
    lines = [f"on_break=\"split\": {br.signatures} signature(s) read their own data ({reads}): {br.calls} call(s) "
             f"ran split by TorchDynamo into {len(pieces)} recorded piece(s)"]
    for p in pieces:
        lines.append("  " + p.describe().replace("\n", "\n  "))
        if "_eager_reason" in p.__dict__:
            lines.append(f"  (runs eagerly: {p.__dict__['_eager_reason']})")
    return lines


def explain_line(g: Any, st: Any, key: Hashable) -> Optional[str]:
    """What ``f.explain(...)`` says of a call whose signature ``on_break`` runs (None: not one)."""
    if st is None or key not in st.broken:
        return None
    if g._options.on_break == "eager":
        return f"{g._desc}: this signature reads its own data on the host: runs eagerly (on_break=\"eager\")"
    n = len(g._breaks.backend.live()) if g._breaks is not None else 0
    return (f"{g._desc}: this signature reads its own data on the host: runs split by TorchDynamo "
            f"(on_break=\"split\"; {n} recorded piece(s) so far, over all its split signatures)")

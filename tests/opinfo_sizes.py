"""One trace for every size, against eager on PyTorch's operator database (OpInfo's ``op_db``).

For every op with float32 samples, each sample is called through one graphified function
at its own sizes and then at three others: every dimension of every tensor that has the
sample's most common size ``v`` (2 or more) gets ``v + 1``, ``v + 2``, ``v + 5`` (the
tensors filled with the sample's own values, cycled, so that indices and domains stay
valid). The second size is traced symbolically; the later ones are recorded from that
trace where its guards hold (counted: ``shared``). Every call is compared with eager on
identical copies (outputs and inputs, per-dtype tolerance, the same seed; the values of
uninitialised memory, ``empty_like`` and kin, are not compared); where eager raises,
graphify must raise too.

Classes per sample: ``match`` (``shared`` says how many of its sizes were recorded without
a trace), ``refused`` (a GraphifyError at any size), ``skip`` (no size to vary, or no
float32 sample), or a failure: ``mismatch``, ``meta``, ``crash``, ``silent`` (eager raised,
graphify returned).

    python tests/opinfo_sizes.py --device cpu [--samples 2] [--ops add,matmul] [--json FILE]

``tests/test_opinfo.py::test_opinfo_sizes_cpu`` runs it in CI.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import signal
import sys
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from opinfo_sweep import (  # noqa: E402
    RNG_STATE_OPS,
    UNINITIALISED,
    _fill,
    _Nondeterministic,
    _ops,
    _samples,
    _split,
    _watching,
    compare,
)

STEPS = (1, 2, 5)  # the sizes tried after the sample's own: v + step


def _most_common_size(ts: Sequence[Any]) -> Optional[int]:
    sizes = collections.Counter(d for t in ts for d in t.shape if d >= 2)
    return sizes.most_common(1)[0][0] if sizes else None


def _resized(t: Any, v: int, new: int) -> Any:
    """``t`` with every dimension of size ``v`` made ``new``, filled with its own values cycled."""
    import torch

    shape = [new if d == v else d for d in t.shape]
    n = math.prod(shape)
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or n == 0:
        return torch.zeros(shape, dtype=t.dtype, device=t.device)
    reps = -(-n // flat.numel())
    out = flat.repeat(reps)[:n].reshape(shape).clone()
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def run_sample(op: Any, sample: Any, device: str, traced: List[Any]) -> Dict[str, Any]:
    import torch

    import gtransform as gt

    ts: List[Any] = []
    template = _split((sample.input, sample.args, sample.kwargs), ts)
    if not ts or any(t.is_sparse or t.layout != torch.strided for t in ts):
        return {"cls": "skip", "note": "no strided tensor"}
    v = _most_common_size(ts)
    if v is None:
        return {"cls": "skip", "note": "no size of 2 or more"}

    def call(tensors: Sequence[Any]) -> Any:
        inp, args, kwargs = _fill(template, list(tensors))
        return op.op(inp, *args, **kwargs)

    g = gt.graphify(lambda *tensors: call(tensors))
    where = argparse.Namespace(device=device)  # (what _watching reads)
    shared = refused_by_eager = 0
    for k, new in enumerate([v] + [v + s for s in STEPS]):
        inputs = [t.detach().clone() if new == v else _resized(t, v, new) for t in ts]
        mine = [t.clone() for t in inputs]
        theirs = [t.clone() for t in inputs]
        before = len(traced)
        torch.manual_seed(k)
        try:
            want = _watching(where, functools.partial(call, theirs))
            raised: Optional[BaseException] = None
        except _Nondeterministic as e:
            return {"cls": "skip", "note": f"size {new}: a kernel torch says is nondeterministic: {e}"}
        except Exception as e:  # (eager refuses this size: graphify must refuse it too)
            want, raised = None, e
        torch.manual_seed(k)
        try:
            got = g(*mine)
        except gt.GraphifyError as e:
            return {"cls": "refused", "note": f"size {new}: {str(e).splitlines()[0][:200]}"}
        except Exception as e:
            if raised is not None:
                refused_by_eager += k >= 2
                continue  # (both raised)
            return {"cls": "crash", "note": f"size {new}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        if raised is not None:
            return {"cls": "silent", "note": f"size {new}: eager raised {type(raised).__name__}: "
                                             f"{str(raised).splitlines()[0][:160]}"}
        values = op.name not in UNINITIALISED  # (empty_like and kin: their values are whatever memory held)
        try:
            compare(got, want, f"output at size {new}", values=values, rng_state=op.name in RNG_STATE_OPS)
            compare(mine, theirs, f"inputs after the call at size {new}", values=values)
        except Exception as e:
            cls = getattr(e, "kind", "mismatch")
            return {"cls": cls, "note": f"size {new}: {str(e).splitlines()[0][:200]}"}
        if k >= 2 and len(traced) == before:
            shared += 1
    return {"cls": "match", "shared": shared, "eager_raised": refused_by_eager, "note": ""}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--samples", type=int, default=2, help="samples per op (0: all)")
    p.add_argument("--ops", default="", help="comma-separated op names (default: every op)")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=int, default=60, help="seconds per sample")
    a = p.parse_args(argv)

    import warnings

    import gtransform._lookup as lookup

    warnings.simplefilter("ignore")
    import torch

    # as tests/opinfo_sweep.py: float32 as float32, and on a GPU the deterministic variants of
    # kernels (those without one warn, and their samples are left out)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if a.device != "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    traced: List[Any] = []
    real = lookup.trace

    def counting(*args: Any, **kw: Any) -> Any:
        traced.append(1)
        return real(*args, **kw)

    lookup.trace = counting

    def alarm(*_: Any) -> None:
        raise TimeoutError("sample timed out")

    signal.signal(signal.SIGALRM, alarm)
    want = set(filter(None, a.ops.split(",")))
    results = []
    for op in _ops(a.device):
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if want and op.name not in want and name not in want:
            continue
        for i, s in enumerate(_samples(op, "forward", a.device, a.samples)):
            signal.alarm(a.timeout)
            try:
                r = run_sample(op, s, a.device, traced)
            except Exception as e:
                r = {"cls": "crash", "note": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            finally:
                signal.alarm(0)
            r.update(op=name, i=i)
            results.append(r)
            if r["cls"] not in ("match", "refused", "skip"):
                print(f"{r['cls']}: {name} [{i}]: {r['note']}", flush=True)
    counts = collections.Counter(r["cls"] for r in results)
    shared = sum(r.get("shared", 0) for r in results)
    raised = sum(r.get("eager_raised", 0) for r in results)
    print(f"{dict(counts)}; of the {counts['match'] * (len(STEPS) - 1)} later sizes of matched samples "
          f"({len(STEPS) - 1} each): {shared} recorded from a symbolic trace, {raised} raised in eager (and here)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)
    return 0 if all(r["cls"] in ("match", "refused", "skip") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Small-batch inference with a graphified model, keeping outputs correctly.

An output of a graphified function lives in the function's memory pool and
stays valid until the function's next call (in the same thread). This script
shows the three ways to live with that rule:

1. consume the output before the next call (here: accumulate a statistic);
2. keep it past the next call with ``.clone()``;
3. the mistake: keep the output object itself. After the next call, touching
   it raises ``gt.OverwrittenOutputError`` (instead of silently showing the
   next batch's numbers); the script catches and prints that error.

Every result is checked against the eager model; the script exits non-zero
if a check fails or if the stale output did not raise.

    python examples/inference_loop.py                 # cuda if available, else cpu
    python examples/inference_loop.py --device cpu --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

import gtransform as gt

Params = Dict[str, torch.Tensor]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_params(n_in: int, hidden: int, n_classes: int, device: torch.device, seed: int) -> Params:
    gen = torch.Generator().manual_seed(seed)
    p = {
        "w1": torch.randn(n_in, hidden, generator=gen) / n_in**0.5,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(hidden, hidden, generator=gen) / hidden**0.5,
        "b2": torch.zeros(hidden),
        "w3": torch.randn(hidden, n_classes, generator=gen) / hidden**0.5,
    }
    return {k: v.to(device) for k, v in p.items()}


def classify(params: Params, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    h = torch.relu(x @ params["w1"] + params["b1"])
    h = torch.relu(h @ params["w2"] + params["b2"])
    probs = torch.softmax(h @ params["w3"], dim=-1)
    conf, label = probs.max(dim=-1)
    return {"probs": probs, "conf": conf, "label": label}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    steps = max(args.steps, 2)

    params = init_params(64, 128, 10, device, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randn(args.batch, 64, generator=gen).to(device) for _ in range(steps)]
    predict = gt.graphify(classify)
    ok = True

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal ok
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            print(f"FAIL: {name} differs from eager")
            ok = False

    # 1. Consume before the next call: reduce each batch's output to a running
    #    statistic. The output objects are dropped each iteration, so every
    #    call hands the same objects out again (no allocation per call).
    total_conf = torch.zeros((), device=device)
    times_g: List[float] = []
    for x in batches:
        _sync(device)
        t0 = time.perf_counter()
        out = predict(params, x)
        total_conf += out["conf"].sum()
        del out  # not required, but lets the next call reuse the objects
        _sync(device)
        times_g.append(time.perf_counter() - t0)

    total_eager = torch.zeros((), device=device)
    times_e: List[float] = []
    for x in batches:
        _sync(device)
        t0 = time.perf_counter()
        total_eager += classify(params, x)["conf"].sum()
        _sync(device)
        times_e.append(time.perf_counter() - t0)
    check("accumulated confidence", total_conf, total_eager)

    # 2. Keep outputs past the next call: .clone() them.
    kept = [predict(params, x)["probs"].clone() for x in batches]
    for i, (x, probs) in enumerate(zip(batches, kept, strict=True)):
        check(f"cloned probs of batch {i}", probs, classify(params, x)["probs"])

    # A view you derived from an output keeps the values of its own call:
    # gtransform moves the outputs to new memory rather than write over it.
    # (Correct, but it costs a re-record on the next call; prefer .clone().)
    top_row = predict(params, batches[0])["probs"][0]
    _ = predict(params, batches[1])
    check("derived view", top_row, classify(params, batches[0])["probs"][0])
    del top_row, _

    # 3. The mistake: keeping the output object itself past the next call.
    stale = predict(params, batches[0])
    fresh = predict(params, batches[1])  # overwrites `stale`'s memory
    check("fresh output", fresh["probs"], classify(params, batches[1])["probs"])
    try:
        stale["probs"].sum()
    except gt.OverwrittenOutputError as e:
        print("as expected, touching a stale output raised OverwrittenOutputError:")
        print("    " + str(e).replace("\n", "\n    "))
    else:
        print("FAIL: touching a stale output did not raise OverwrittenOutputError")
        ok = False

    steady_g = statistics.median(times_g[2:] or times_g)
    steady_e = statistics.median(times_e[2:] or times_e)
    print(f"device={device} steps={steps} batch={args.batch}")
    print(f"graphify: first call {times_g[0] * 1e3:8.2f} ms, then median {steady_g * 1e6:9.1f} us/call")
    print(f"eager:    first call {times_e[0] * 1e3:8.2f} ms, then median {steady_e * 1e6:9.1f} us/call")
    print(f"cache: {predict.cache_info()}")
    print("OK: every output matches eager" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

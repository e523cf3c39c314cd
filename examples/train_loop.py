"""Graphify a functional training step and check it against eager.

The step is ``gt.graphify(torch.func.grad_and_value(loss))``: gradients and
loss of a small MLP, recorded once and replayed on every later call. The
parameters live in a dict; between calls they are updated in place (plain
SGD under ``torch.no_grad()``). Because the very same tensors are passed on
every call, gtransform reads them where they are (no copy) and sees the
updates. The batches are new tensors each step and are copied into the
recording's static input buffers.

The same steps are then run eagerly from the same initial parameters; the
script exits non-zero if the final parameters differ beyond float32
tolerance.

    python examples/train_loop.py                 # cuda if available, else cpu
    python examples/train_loop.py --device cpu --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.func

import gtransform as gt

Params = Dict[str, torch.Tensor]
Step = Callable[[Params, torch.Tensor, torch.Tensor], Tuple[Params, torch.Tensor]]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_params(sizes: Sequence[int], device: torch.device, seed: int) -> Params:
    """Plain tensors (requires_grad=False): torch.func.grad differentiates by itself."""
    gen = torch.Generator().manual_seed(seed)
    params: Params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = (torch.randn(n_in, n_out, generator=gen) / n_in**0.5).to(device)
        params[f"b{i}"] = torch.zeros(n_out).to(device)
    return params


def mlp_loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of a tanh MLP. Python control flow on the number of
    layers is fine: it is resolved when the step is traced."""
    n_layers = len(params) // 2
    h = x
    for i in range(n_layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n_layers - 1:
            h = torch.tanh(h)
    return ((h - y) ** 2).mean()


def make_batches(
    steps: int, batch: int, n_in: int, n_out: int, device: torch.device, seed: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randn(batch, n_in, generator=gen).to(device), torch.randn(batch, n_out, generator=gen).to(device))
        for _ in range(steps)
    ]


def sgd_step(step: Step, params: Params, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
    """One training step; returns a copy of the loss.

    ``grads`` and ``loss`` are outputs of the graphified step: they are valid
    until its next call. They are consumed here (the update, the clone) and
    go out of scope on return, so the next call hands the same output objects
    out again instead of poisoning them.
    """
    grads, loss = step(params, x, y)
    with torch.no_grad():
        for name, g in grads.items():
            params[name].sub_(g, alpha=lr)  # in place: the recording sees it next call
    return loss.clone()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    step: Step, params: Params, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]], lr: float, device: torch.device
) -> Tuple[List[torch.Tensor], List[float]]:
    losses, times = [], []
    for x, y in batches:
        _sync(device)
        t0 = time.perf_counter()
        losses.append(sgd_step(step, params, x, y, lr))
        _sync(device)
        times.append(time.perf_counter() - t0)
    return losses, times


def _fmt(times: List[float]) -> str:
    steady = times[2:] or times
    return f"first call {times[0] * 1e3:8.2f} ms, then median {statistics.median(steady) * 1e6:9.1f} us/step"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = (32, 64, 64, 4)

    batches = make_batches(args.steps, args.batch, sizes[0], sizes[-1], device, args.seed)
    params_g = init_params(sizes, device, args.seed)
    params_e = {k: v.clone() for k, v in params_g.items()}

    step = gt.graphify(torch.func.grad_and_value(mlp_loss))
    losses_g, times_g = run(step, params_g, batches, args.lr, device)
    eager_step = torch.func.grad_and_value(mlp_loss)
    losses_e, times_e = run(eager_step, params_e, batches, args.lr, device)

    print(f"device={device} steps={args.steps} sizes={sizes} batch={args.batch}")
    print(f"graphify: {_fmt(times_g)}")
    print(f"eager:    {_fmt(times_e)}")
    print(
        f"loss: first {losses_g[0].item():.5f}, last graphify {losses_g[-1].item():.5f}, last eager {losses_e[-1].item():.5f}"
    )
    print(f"cache: {step.cache_info()}")

    ok = True
    for name in params_e:
        if not torch.allclose(params_g[name], params_e[name], rtol=1e-4, atol=1e-5):
            diff = (params_g[name] - params_e[name]).abs().max().item()
            print(f"FAIL: parameter {name!r} differs from eager (max abs diff {diff:.3g})")
            ok = False
    if not torch.allclose(torch.stack(losses_g), torch.stack(losses_e), rtol=1e-4, atol=1e-5):
        print("FAIL: the losses differ from eager")
        ok = False
    if step.cache_info().misses != 1:
        print(f"FAIL: expected one recording, got {step.cache_info()}")
        ok = False
    print("OK: final parameters match eager" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

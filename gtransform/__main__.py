"""``python -m gtransform``: environment report and a graphified training-step demo."""

from __future__ import annotations

import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict

import optree
import torch
import torch.nn.functional as F

import gtransform as gt


def _report() -> str:
    cuda = torch.cuda.is_available()
    lines = [
        "gtransform environment",
        f"  gtransform {gt.__version__}",
        f"  python     {platform.python_version()} ({sys.executable})",
        f"  torch      {torch.__version__}",
        f"  optree     {optree.__version__}",
        f"  CUDA       {'available: ' + torch.cuda.get_device_name() + ' (CUDA ' + str(torch.version.cuda) + ')' if cuda else 'not available'}",
        f"  backend    {'cuda (CUDA graph capture and replay)' if cuda else 'cpu (replay of the traced aten graph)'}",
    ]
    return "\n".join(lines)


def _loss(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for i in range(4):
        h = torch.tanh(h @ p[f"w{i}"] + p[f"b{i}"])
    return F.mse_loss(h @ p["out"], y)


def _time(fn: Callable[[], Any], device: str, n: int) -> float:
    """Median microseconds per call over 5 repeats of ``n`` calls."""
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def demo(device: str, steps: int = 50) -> bool:
    """Train a small MLP with a graphified grad-and-value step; compare with eager."""
    torch.manual_seed(0)
    width, batch = 64, 32
    p = {f"w{i}": torch.randn(width, width, device=device) / width**0.5 for i in range(4)}
    p.update({f"b{i}": torch.zeros(width, device=device) for i in range(4)})
    p["out"] = torch.randn(width, 1, device=device) / width**0.5
    pe = {k: v.clone() for k, v in p.items()}
    data = [(torch.randn(batch, width, device=device), torch.randn(batch, 1, device=device)) for _ in range(8)]

    eager_step = torch.func.grad_and_value(_loss)
    step = gt.graphify(eager_step)

    t0 = time.perf_counter()
    step(p, *data[0])
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0

    worst = 0.0
    for i in range(steps):
        x, y = data[i % len(data)]
        g, loss = step(p, x, y)
        ge, loss_e = eager_step(pe, x, y)
        worst = max(worst, abs(loss.item() - loss_e.item()) / max(1e-12, abs(loss_e.item())))
        with torch.no_grad():
            for k in p:
                p[k].sub_(0.05 * g[k])
                pe[k].sub_(0.05 * ge[k])
    pmax = max(((p[k] - pe[k]).abs().max() / pe[k].abs().max().clamp_min(1e-12)).item() for k in p)
    ok = worst < 1e-4 and pmax < 1e-4

    x, y = data[0]
    n = 200 if device == "cuda" else 50
    t_eager = _time(lambda: eager_step(pe, x, y), device, n)
    t_graph = _time(lambda: step(p, x, y), device, n)
    print(f"\ndemo: graphify(torch.func.grad_and_value(loss)) of a 4-layer MLP, {steps} SGD steps on {device}")
    print(f"  first call (trace + record): {first * 1e3:.1f} ms")
    print(f"  matches eager:               {'yes' if ok else 'NO'} (loss rel. err {worst:.1e}, params rel. err {pmax:.1e})")
    print(f"  per call, eager:             {t_eager:8.1f} us")
    print(f"  per call, graphify:          {t_graph:8.1f} us")
    print(f"  speed-up:                    {t_eager / t_graph:8.2f}x")
    print(f"  {step.cache_info()}")
    return ok


def main() -> int:
    """Print the environment report and run the demo on the best device."""
    print(_report())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = demo(device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

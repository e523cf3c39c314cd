"""Issue #36 item 4, "no cliff": gt's per call against the same work captured and replayed by hand.

    python benchmarks/probes/_probe_floor.py [rl] [train] [prof]     (both by default; CUDA; prof: a
                                                                   profile of gt's RL calls)

rl     the RL policy step of the benchmark (benchmarks/workloads/synthetic.py: 2x64 tanh MLP, gaussian
       sample, batch 16) with ``fuse=True``: the recording's own fused callable (inductor's kernels)
       captured into a torch.cuda.CUDAGraph by hand and replayed alone (the floor), and with the
       observation copied in first; against gt called with the same tensors, with a new observation
       each call (a second graphified function: its recording copies the observation in), and
       holding the output.
train  a functional training step of torchvision's resnet18 (batch 8, 3x64x64, 10 classes):
       ``torch.func.grad`` of the loss through ``functional_call``, SGD, the new parameters returned and
       fed back (``params = step(params, buffers, x, y)``); BatchNorm's running statistics updated in
       the buffers. The floor: the same step captured by hand over static parameters, its new
       parameters copied back into them after each replay (what a hand-written loop must do), and
       the replay alone.

Each figure: µs per call, the median of 9 interleaved repeats of N calls and a synchronisation.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

import gtransform as gt
from benchmarks.workloads.synthetic import rl_args, rl_fn
from gtransform._bind import bind
from gtransform._lookup import thread_state

dev = "cuda"


def per_call(loops: Dict[str, Callable[[int], None]], n: int, repeats: int = 9) -> Dict[str, float]:
    res: Dict[str, List[float]] = {k: [] for k in loops}
    for _ in range(repeats):
        for k, loop in loops.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            loop(n)
            torch.cuda.synchronize()
            res[k].append((time.perf_counter() - t) / n * 1e6)
    return {k: statistics.median(v) for k, v in res.items()}


def by_hand(fn: Callable[..., Any], args: List[torch.Tensor]) -> Any:
    """``fn`` over clones of ``args`` captured into a CUDA graph: (graph, static args, static outputs)."""
    static = [a.clone() for a in args]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fn(*static)
    return g, static, outs


def rl() -> None:
    p, obs = rl_args(dev)
    f = gt.graphify(rl_fn, fuse=True)
    for _ in range(5):
        f(p, obs)
    e = thread_state(f).last
    b = bind(f, (p, obs), {})
    ins = [b.leaves[i] for i in e.tpos]
    k_obs = next(k for k, t in enumerate(ins) if t is obs)
    g, static, _outs = by_hand(e.rec.gm, ins)
    news = [torch.randn_like(obs) for _ in range(8)]

    def floor(n: int) -> None:
        for _ in range(n):
            g.replay()

    def floor_copy(n: int) -> None:
        for i in range(n):
            static[k_obs].copy_(news[i & 7])
            g.replay()

    def gt_same(n: int) -> None:
        for _ in range(n):
            f(p, obs)

    # (a function of its own: passed other observations, a recording copies its observation in,
    # which the same-tensors loops of `f` must not inherit)
    f_new = gt.graphify(rl_fn, fuse=True)
    for i in range(5):
        f_new(p, news[i & 7])

    def gt_new(n: int) -> None:
        for i in range(n):
            f_new(p, news[i & 7])

    def gt_held(n: int) -> None:
        out = None
        for _ in range(n):
            out = f(p, obs)
        del out

    r = per_call({"floor": floor, "floor+copy": floor_copy, "gt_same": gt_same, "gt_new": gt_new,
                  "gt_held": gt_held}, 3000)
    if "prof" in sys.argv:  # where gt's call spends its host time
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        gt_same(3000)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    print("rl fused (µs):", " ".join(f"{k} {v:.2f}" for k, v in r.items()),
          f"| gt_same/floor {r['gt_same'] / r['floor']:.3f} gt_held/floor {r['gt_held'] / r['floor']:.3f} "
          f"gt_new/floor+copy {r['gt_new'] / r['floor+copy']:.3f}", flush=True)


def resnet18_step(device: str = dev) -> Tuple[Callable[..., Dict[str, torch.Tensor]], Dict[str, torch.Tensor],
                                                Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The functional training step of the ``train`` row (also ``_probe_train_first.py``'s): step, params, buffers, x, y."""
    import torch.nn.functional as F
    from torch.func import functional_call, grad
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=10).to(device)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x = torch.randn(8, 3, 64, 64, device=device)
    y = torch.randint(0, 10, (8,), device=device)

    def loss_fn(ps: Dict[str, torch.Tensor], bs: Dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, (ps, bs), (x,)), y)

    def step(ps: Dict[str, torch.Tensor], bs: Dict[str, torch.Tensor], x: torch.Tensor,
             y: torch.Tensor) -> Dict[str, torch.Tensor]:
        gs = grad(loss_fn)(ps, bs, x, y)
        return {k: p - 0.01 * gs[k] for k, p in ps.items()}

    return step, params, buffers, x, y


def train() -> None:
    step, params, buffers, x, y = resnet18_step()
    f = gt.graphify(step)
    ps = params
    for _ in range(5):
        ps = f(ps, buffers, x, y)
    names = list(params)
    nb = list(buffers)

    def flat_step(*ts: torch.Tensor) -> List[torch.Tensor]:
        pd = dict(zip(names, ts[: len(names)]))
        bd = dict(zip(nb, ts[len(names): len(names) + len(nb)]))
        out = step(pd, bd, ts[-2], ts[-1])
        return [out[k] for k in names]

    g, static, outs = by_hand(flat_step, [ps[k] for k in names] + [buffers[k] for k in nb] + [x, y])
    sp = static[: len(names)]

    def floor(n: int) -> None:
        for _ in range(n):
            g.replay()

    def floor_feedback(n: int) -> None:
        for _ in range(n):
            g.replay()
            torch._foreach_copy_(sp, outs)

    state = {"ps": ps}

    def gt_loop(n: int) -> None:
        q = state["ps"]
        for _ in range(n):
            q = f(q, buffers, x, y)
        state["ps"] = q

    r = per_call({"floor": floor, "floor+feedback": floor_feedback, "gt": gt_loop}, 100)
    print("resnet18 functional train step, batch 8 (µs):", " ".join(f"{k} {v:.1f}" for k, v in r.items()),
          f"| gt/floor {r['gt'] / r['floor']:.3f} gt/floor+feedback {r['gt'] / r['floor+feedback']:.3f}",
          flush=True)
    print(f.describe().splitlines()[0])


if __name__ == "__main__":
    which = [a for a in sys.argv[1:] if a != "prof"] or ["rl", "train"]
    if "rl" in which:
        rl()
    if "train" in which:
        train()

"""Per-step time of data-parallel training on several GPUs (or gloo on the CPU).

Run under torchrun, one process per GPU:

    torchrun --nproc_per_node 2 benchmarks/bench_ddp.py --out $OUT

Columns (the same MLP, SGD, per-rank batch; median microseconds per step, host-timed with a
device synchronisation after each step):

* ``ddp``: eager ``DistributedDataParallel`` + ``torch.optim.SGD`` (forward, backward with DDP's
  bucketed all-reduce, step);
* ``ddp_compile``: the same with the DDP module under ``torch.compile(mode="reduce-overhead")``;
* ``gt_funcol``: ``gt.graphify`` of grad -> functional all_reduce per parameter -> SGD;
* ``gt_c10d``: the same with in-place ``dist.all_reduce``;
* ``gt_bucket``: the same with the gradients flattened into one all_reduce (like one DDP bucket).

Every column starts from the same parameters; after the timed steps the parameters of each
column are compared with ``ddp``'s (they all do SGD on the same data). Rank 0 writes
``bench_ddp.json`` and ``bench_ddp.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel as DDP

import gtransform as gt


def make_model(width: int, layers: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: List[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods).to(device)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--methods", default="ddp,ddp_compile,gt_funcol,gt_c10d,gt_bucket")
    return ap.parse_args()


def init_process_group(device: str) -> str:
    """NCCL on this rank's GPU, or gloo; returns the device the rank runs on."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
        dist.init_process_group("nccl", device_id=torch.device(device), timeout=timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    return device


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def time_steps(step: Callable[[int], Any], args: argparse.Namespace, sync: Callable[[], None]) -> Dict[str, Any]:
    """The first step's time, then ``warmup`` untimed steps, then the median of ``steps`` steps,
    each timed on the host with a device synchronisation after it."""
    t0 = time.perf_counter()
    step(0)
    sync()
    first = time.perf_counter() - t0
    for i in range(1, args.warmup):
        step(i)
    sync()
    ts = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        step(i)
        sync()
        ts.append(time.perf_counter() - t0)
    return {"us_per_step": statistics.median(ts) * 1e6, "first_call_s": first, "steps": args.warmup + args.steps}


def ddp_column(m: str, args: argparse.Namespace, device: str, xs: List[torch.Tensor], ys: List[torch.Tensor],
               lr: float) -> Tuple[Callable[[int], Any], Callable[[], Dict[str, torch.Tensor]]]:
    """``ddp`` / ``ddp_compile``: (the step, the parameters it trains)."""
    model = make_model(args.width, args.layers, device)
    ddp = DDP(model, device_ids=[torch.cuda.current_device()] if device.startswith("cuda") else None)
    fwd: Any = torch.compile(ddp, mode="reduce-overhead") if m == "ddp_compile" else ddp
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step_ddp(i: int, fwd: Any = fwd, opt: Any = opt) -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(fwd(xs[i % 4]), ys[i % 4]).backward()
        opt.step()

    return step_ddp, lambda model=model: dict(model.named_parameters())


def gt_column(m: str, args: argparse.Namespace, device: str, xs: List[torch.Tensor], ys: List[torch.Tensor],
              lr: float, world: int) -> Tuple[Callable[[int], Any], Callable[[], Dict[str, torch.Tensor]]]:
    """``gt_funcol`` / ``gt_c10d`` / ``gt_bucket``: (the graphified step, the parameters it trains)."""
    model = make_model(args.width, args.layers, device)
    p = {k: v.detach().clone() for k, v in model.named_parameters()}
    kind = m

    def loss_fn(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, model: Any = model) -> torch.Tensor:
        return loss_of(torch.func.functional_call(model, p, (x,)), y)

    def dp_step(p: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, kind: str = kind) -> None:
        grads = torch.func.grad(loss_fn)(p, x, y)
        if kind == "gt_bucket":
            flat = torch.cat([gr.reshape(-1) for gr in grads.values()])
            flat = funcol.all_reduce(flat, "sum", dist.group.WORLD)
            off = 0
            for k, gr in grads.items():
                n = gr.numel()
                p[k].sub_(flat[off:off + n].view_as(gr), alpha=lr / world)
                off += n
            return
        for k, gr in grads.items():
            if kind == "gt_c10d":
                dist.all_reduce(gr)
            else:
                gr = funcol.all_reduce(gr, "sum", dist.group.WORLD)
            p[k].sub_(gr, alpha=lr / world)

    f = gt.graphify(dp_step)
    return (lambda i, f=f, p=p: f(p, xs[i % 4], ys[i % 4])), (lambda p=p: p)


def write_table(results: Dict[str, Any], methods: List[str], args: argparse.Namespace, world: int, device: str,
                launch_to_last_step_s: float) -> None:
    """Rank 0: the table on stdout, bench_ddp.md and bench_ddp.json under ``--out``."""
    os.makedirs(args.out, exist_ok=True)
    base = results.get("ddp", {}).get("us_per_step")
    lines = [f"data-parallel step, {world} ranks ({'NCCL' if device.startswith('cuda') else 'gloo'}), "
             f"MLP {args.layers}x{args.width}, batch {args.batch} per rank, torch {torch.__version__}",
             "", "| method | us/step | vs eager DDP | first call (s) | max abs diff vs DDP |", "|---|---|---|---|---|"]
    for m in methods:
        r = results.get(m, {})
        if "error" in r:
            lines.append(f"| {m} | error: {r['error']} | | | |")
            continue
        sp = f"{base / r['us_per_step']:.2f}x" if base else "-"
        lines.append(f"| {m} | {r['us_per_step']:.1f} | {sp} | {r['first_call_s']:.2f} | {r.get('max_abs_diff_vs_ddp', float('nan')):.2e} |")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(args.out, "bench_ddp.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "bench_ddp.json"), "w") as fh:
        json.dump({"world": world, "device": device, "args": vars(args), "results": results,
                   "launch_to_last_step_s": launch_to_last_step_s}, fh, indent=1)


def main() -> None:
    args = parse_args()
    t_launch = time.time()
    device = init_process_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = 0.01
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(4)]
    ys = [torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(4)]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    results: Dict[str, Any] = {}
    finals: Dict[str, Dict[str, torch.Tensor]] = {}
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        dist.barrier()
        try:
            if m in ("ddp", "ddp_compile"):
                step, params = ddp_column(m, args, device, xs, ys, lr)
            else:
                step, params = gt_column(m, args, device, xs, ys, lr, world)
            results[m] = time_steps(step, args, sync)
            finals[m] = {k: v.detach().clone() for k, v in params().items()}
        except Exception as e:  # a column that fails is reported, the others still run
            results[m] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    ref = finals.get("ddp")
    for m, fin in finals.items():
        if ref is not None:
            results[m]["max_abs_diff_vs_ddp"] = max(float((fin[k] - ref[k]).abs().max()) for k in ref)
    last_step = time.time()
    if rank == 0:
        write_table(results, methods, args, world, device, last_step - t_launch)
    print(f"LAST_STEP_AT {last_step:.3f} rank {rank}", flush=True)
    t0 = time.perf_counter()
    dist.destroy_process_group()
    print(f"rank {rank}: destroy_process_group {time.perf_counter() - t0:.3f} s", flush=True)


if __name__ == "__main__":
    main()

"""Data-parallel training with graphify: grad -> all_reduce -> SGD, recorded as one graph per rank.

Each rank takes its shard of the global batch, computes gradients with ``torch.func``, averages
them over the ranks with a collective, and updates the parameters in place: the whole step,
collective included, is one recording (a CUDA graph with the NCCL all-reduce inside on GPUs;
the traced graph with gloo on the CPU). Every rank checks its final parameters against
single-process eager SGD on the same global batches, and times graphify against the same step
run eagerly.

    torchrun --nproc_per_node 2 examples/data_parallel.py            # NCCL on 2 GPUs
    torchrun --nproc_per_node 2 examples/data_parallel.py --device cpu   # gloo
    python examples/data_parallel.py --device cpu --steps 4          # launches torchrun itself

What must be the same on every rank: the calls of graphified functions with collectives, with
the same shapes (so the per-rank batch is the same size on every rank), in the same order.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import gtransform as gt

Params = Dict[str, torch.Tensor]


def init_params(sizes: Sequence[int], device: str) -> Params:
    g = torch.Generator().manual_seed(0)
    p: Params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        p[f"w{i}"] = (torch.randn(a, b, generator=g) / a**0.5).to(device)
        p[f"b{i}"] = torch.zeros(b, device=device)
    return p


def loss_fn(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    n = len(p) // 2
    for i in range(n):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            x = torch.relu(x)
    return torch.nn.functional.mse_loss(x, y)


def batch(step: int, n: int, sizes: Sequence[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + step)
    return torch.randn(n, sizes[0], generator=g).to(device), torch.randn(n, sizes[-1], generator=g).to(device)


def make_step(world: int, lr: float, inplace_c10d: bool):
    group = dist.group.WORLD

    def step(p: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        grads, loss = torch.func.grad_and_value(loss_fn)(p, x, y)
        for k, g in grads.items():
            if inplace_c10d:
                dist.all_reduce(g)  # in-place c10d collective
            else:
                g = funcol.all_reduce(g, "sum", group)  # functional collective
            p[k].sub_(g, alpha=lr / world)
        return funcol.all_reduce(loss.detach(), "sum", group) / world

    return step


def run(args: argparse.Namespace) -> int:
    device = args.device
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [args.width] * args.layers + [8]
    sizes[0] = 32
    per_rank = args.batch
    lr = 0.05

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step = make_step(world, lr, args.c10d)
    fast = gt.graphify(step)
    p = init_params(sizes, device)
    eager_p = init_params(sizes, device)
    times: Dict[str, List[float]] = {"graphify": [], "eager": []}
    for s in range(args.steps):
        x, y = batch(s, per_rank * world, sizes, device)
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        for name, fn, params in (("graphify", fast, p), ("eager", step, eager_p)):
            sync()
            t0 = time.perf_counter()
            fn(params, xs, ys)
            sync()
            times[name].append(time.perf_counter() - t0)
    # the reference: single-process eager SGD on the same global batches (no collectives)
    ref = init_params(sizes, device)
    for s in range(args.steps):
        x, y = batch(s, per_rank * world, sizes, device)
        grads = torch.func.grad(loss_fn)(ref, x, y)
        for k in ref:
            ref[k] -= lr * grads[k]
    err = max(float((p[k] - ref[k]).abs().max()) for k in p)
    err_dp = max(float((p[k] - eager_p[k]).abs().max()) for k in p)
    skip = min(2, max(0, args.steps - 1))
    g_us = statistics.median(times["graphify"][skip:]) * 1e6
    e_us = statistics.median(times["eager"][skip:]) * 1e6
    # graphify equals data-parallel eager; single-process eager of the same global batch sums in
    # another order (float32: ~1e-4 after 20 steps on an H200)
    tol_dp = 1e-5
    tol = 5e-4
    ok = err < tol and err_dp < tol_dp
    print(
        f"rank {rank}/{world} ({backend}, {'c10d in-place' if args.c10d else 'functional'} all_reduce): "
        f"graphify {g_us:.1f} us/step, eager {e_us:.1f} us/step ({e_us / g_us:.1f}x); "
        f"max |graphify - single-process eager| = {err:.2e}, vs data-parallel eager {err_dp:.2e}",
        flush=True,
    )
    if ok and rank == 0:
        print(f"OK: {args.steps} data-parallel steps on {world} ranks match single-process eager", flush=True)
    print(f"LAST_STEP_AT {time.time():.3f} rank {rank}", flush=True)
    t0 = time.perf_counter()
    dist.destroy_process_group()  # releases the recordings with collectives first
    print(f"rank {rank}: destroy_process_group {time.perf_counter() - t0:.3f} s", flush=True)
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--c10d", action="store_true", help="in-place dist.all_reduce instead of functional collectives")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not started by torchrun")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:
        return run(args)
    # not under torchrun: launch it (2 local ranks), and report what they print
    with socket.socket() as sock:  # a free port on this machine only
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__)]
    cmd += list(argv if argv is not None else sys.argv[1:])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    end = time.time()
    out = proc.stdout
    print(out, end="")
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
    last = [float(line.split()[1]) for line in out.splitlines() if line.startswith("LAST_STEP_AT")]
    if last:
        print(f"last step to exit of every rank: {end - max(last):.2f} s (launch to exit {end - t0:.1f} s)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

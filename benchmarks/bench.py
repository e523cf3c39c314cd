#!/usr/bin/env python3
"""gtransform benchmark: per-call latency of gt.graphify next to its peers.

One process, one device. For every workload of DESIGN.md ("Performance
targets") plus two realistic ones, each method (column) is built, checked
against eager (relative error), warmed up and timed:

    eager                         the plain function
    graph_copy                    hand-written torch.cuda.CUDAGraph: copy_ each input into its
                                  static buffer, then replay (new input tensors every call)
    graph_replay                  the same graph, replay alone: the floor
    mgc                           torch.cuda.make_graphed_callables (same sample tensors each call)
    compile                       torch.compile(mode="reduce-overhead") (same tensors each call)
    jax                           jax.jit of the same function written with jax.numpy
    gt_same                       gt.graphify, the same input tensor objects every call
    gt_new                        gt.graphify, fresh input tensors every call (pre-made, rotating)
    gt_held                       gt_same, but the loop keeps `out = f(...)` alive across calls
                                  (what a user's loop does; exercises the poison-and-alias path)
    gt_fused                      gt.graphify(fn, fuse=True): inductor-fused kernels, recorded

Per-call time is the median over repeats of (wall time of N calls followed
by a device synchronisation) / N. Also recorded: the first call's time
(trace + record, or compile), memory, and every variant's error against eager.

Outputs in --out: results.json (every figure), results.md (tables),
results.png (per-call time per workload and method). The per-call table is
printed last on stdout.

Run `python benchmarks/bench.py --help` for the flags; benchmarks/README.md
for the exact commands.
"""

from __future__ import annotations

import os

# Before jax or torch are imported: keep jax from grabbing the GPU's memory,
# and give torch.compile a fresh cache so its first-call time is a cold
# compile in every run (removed at exit).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile as _tempfile

    _INDUCTOR_DIR = _tempfile.mkdtemp(prefix="gt-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_DIR
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_INDUCTOR_DIR, "triton"))
else:
    _INDUCTOR_DIR = None

import argparse
import atexit
import gc
import itertools
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

try:
    import gtransform as gt
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gtransform as gt

if _INDUCTOR_DIR is not None:
    atexit.register(shutil.rmtree, _INDUCTOR_DIR, True)

perf_counter = time.perf_counter

# --------------------------------------------------------------------------
# Methods (table columns)
# --------------------------------------------------------------------------

METHODS: Dict[str, str] = {
    "eager": "eager",
    "graph_copy": "CUDA graph: copy-in + replay",
    "graph_replay": "CUDA graph: replay alone",
    "mgc": "make_graphed_callables",
    "compile": "torch.compile reduce-overhead",
    "jax": "jax.jit",
    "gt_same": "gt: same tensors",
    "gt_new": "gt: new tensors",
    "gt_held": "gt: same, out held",
    "gt_fused": "gt fuse=True: same tensors",
}
CUDA_ONLY = {"graph_copy", "graph_replay", "mgc"}

TOL_FP32 = 1e-4
TOL_BF16 = 2e-2


class NotApplicable(Exception):
    """The method does not apply to this workload (cell: n/a)."""


class Skipped(Exception):
    """The method cannot run here (cell: skip), e.g. CUDA-only on the CPU."""


# --------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    title: str
    fn: Callable[..., Any]  # the torch function, fn(*args)
    make_args: Callable[[torch.device], tuple]  # fresh random args (a tuple of pytrees)
    jax_fn: Optional[Callable[[Any, Any], Callable[..., Any]]] = None  # (jax, jnp) -> function of the same args
    jax_key: bool = False  # the jax function takes and returns a PRNG key (threaded through calls)
    mgc: bool = True  # make_graphed_callables applies
    compile_ok: bool = True
    bf16: bool = False
    n_sets: int = 8  # pre-made input sets (rotated through by the "new tensors" columns)
    check: Optional[Callable[[list, list, tuple], float]] = None  # custom (out, ref, args) -> error

    @property
    def tol(self) -> float:
        return TOL_BF16 if self.bf16 else TOL_FP32


# 1. chain of 200 elementwise ops on 1024 floats -------------------------------

CHAIN_OPS = 200


def chain_fn(x):
    for i in range(CHAIN_OPS):
        k = i % 4
        if k == 0:
            x = x * 1.01
        elif k == 1:
            x = x + 0.01
        elif k == 2:
            x = torch.sin(x)
        else:
            x = x - 0.02
    return x


def chain_args(dev):
    return (torch.randn(1024, device=dev),)


def chain_jax(jax, jnp):
    def f(x):
        for i in range(CHAIN_OPS):
            k = i % 4
            if k == 0:
                x = x * 1.01
            elif k == 1:
                x = x + 0.01
            elif k == 2:
                x = jnp.sin(x)
            else:
                x = x - 0.02
        return x

    return f


# 2. 8-layer MLP forward, 512 wide, batch 64: 17 leaves -----------------------

MLP_DEPTH, MLP_WIDTH, MLP_BATCH = 8, 512, 64


def mlp_params(dev):
    p = {}
    for i in range(MLP_DEPTH):
        p[f"w{i}"] = torch.randn(MLP_WIDTH, MLP_WIDTH, device=dev) * (2.0 / MLP_WIDTH) ** 0.5
        p[f"b{i}"] = torch.randn(MLP_WIDTH, device=dev) * 0.1
    return p


def mlp_fn(p, x):
    for i in range(MLP_DEPTH):
        x = torch.addmm(p[f"b{i}"], x, p[f"w{i}"])
        if i < MLP_DEPTH - 1:
            x = torch.relu(x)
    return x


def mlp_args(dev):
    return (mlp_params(dev), torch.randn(MLP_BATCH, MLP_WIDTH, device=dev))


def mlp_jax(jax, jnp):
    def f(p, x):
        for i in range(MLP_DEPTH):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < MLP_DEPTH - 1:
                x = jax.nn.relu(x)
        return x

    return f


# 3. torch.func.grad of that MLP's loss --------------------------------------


def mlp_loss(p, x):
    return mlp_fn(p, x).pow(2).mean()


mlp_grad_fn = torch.func.grad(mlp_loss)


def mlp_grad_jax(jax, jnp):
    fwd = mlp_jax(jax, jnp)
    return jax.grad(lambda p, x: jnp.mean(fwd(p, x) ** 2))


# 4. dict of 32 tensors in and out -------------------------------------------


def dict_fn(d):
    return {k: torch.tanh(v) * 2.0 + 1.0 for k, v in d.items()}


def dict_args(dev):
    return ({f"t{i:02d}": torch.randn(1024, device=dev) for i in range(32)},)


def dict_jax(jax, jnp):
    return lambda d: {k: jnp.tanh(v) * 2.0 + 1.0 for k, v in d.items()}


# 5. transformer block forward, bf16, batch 4, seq 64, d 512 -----------------

TF_B, TF_T, TF_D, TF_H = 4, 64, 512, 8


def transformer_params(dev):
    D, bf = TF_D, torch.bfloat16

    def w(o, i):
        return (torch.randn(o, i, device=dev) * i**-0.5).to(bf)

    def b(n):
        return (torch.randn(n, device=dev) * 0.02).to(bf)

    return {
        "ln1_w": (1 + 0.1 * torch.randn(D, device=dev)).to(bf), "ln1_b": b(D),
        "w_qkv": w(3 * D, D), "b_qkv": b(3 * D),
        "w_o": w(D, D), "b_o": b(D),
        "ln2_w": (1 + 0.1 * torch.randn(D, device=dev)).to(bf), "ln2_b": b(D),
        "w_1": w(4 * D, D), "b_1": b(4 * D),
        "w_2": w(D, 4 * D), "b_2": b(D),
    }


def transformer_fn(p, x):
    B, T, D = x.shape
    H = TF_H
    h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
    q, k, v = F.linear(h, p["w_qkv"], p["b_qkv"]).split(D, dim=-1)
    q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + F.linear(a.transpose(1, 2).reshape(B, T, D), p["w_o"], p["b_o"])
    h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
    return x + F.linear(F.gelu(F.linear(h, p["w_1"], p["b_1"])), p["w_2"], p["b_2"])


def transformer_args(dev):
    return (transformer_params(dev), torch.randn(TF_B, TF_T, TF_D, device=dev).to(torch.bfloat16))


def transformer_jax(jax, jnp):
    f32, bf = jnp.float32, jnp.bfloat16

    def ln(x, w, b):
        x = x.astype(f32)
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return ((x - mu) * jax.lax.rsqrt(var + 1e-5) * w.astype(f32) + b.astype(f32)).astype(bf)

    def f(p, x):
        B, T, D = x.shape
        H = TF_H
        hd = D // H
        h = ln(x, p["ln1_w"], p["ln1_b"])
        qkv = h @ p["w_qkv"].T + p["b_qkv"]
        q, k, v = (t.reshape(B, T, H, hd).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, axis=-1))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=f32) / math.sqrt(hd)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        a = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(bf), v)
        x = x + a.transpose(0, 2, 1, 3).reshape(B, T, D) @ p["w_o"].T + p["b_o"]
        h = ln(x, p["ln2_w"], p["ln2_b"])
        u = jax.nn.gelu((h @ p["w_1"].T + p["b_1"]).astype(f32), approximate=False).astype(bf)
        return x + u @ p["w_2"].T + p["b_2"]

    return f


# 6. RL policy step: 2x64 tanh MLP, gaussian sample, batch 16 -----------------

RL_OBS, RL_HID, RL_ACT, RL_BATCH = 17, 64, 6, 16
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def rl_params(dev):
    def w(i, o):
        return torch.randn(i, o, device=dev) * i**-0.5

    return {
        "w1": w(RL_OBS, RL_HID), "b1": torch.zeros(RL_HID, device=dev) + 0.01 * torch.randn(RL_HID, device=dev),
        "w2": w(RL_HID, RL_HID), "b2": 0.01 * torch.randn(RL_HID, device=dev),
        "w3": w(RL_HID, RL_ACT), "b3": 0.01 * torch.randn(RL_ACT, device=dev),
        "log_std": -0.5 + 0.1 * torch.randn(RL_ACT, device=dev),
    }


def rl_fn(p, obs):
    h = torch.tanh(obs @ p["w1"] + p["b1"])
    h = torch.tanh(h @ p["w2"] + p["b2"])
    mean = h @ p["w3"] + p["b3"]
    eps = torch.randn_like(mean)
    action = mean + p["log_std"].exp() * eps
    logp = (-0.5 * eps * eps - p["log_std"] - LOG_SQRT_2PI).sum(-1)
    return action, logp, mean


def rl_args(dev):
    return (rl_params(dev), torch.randn(RL_BATCH, RL_OBS, device=dev))


def rl_jax(jax, jnp):
    def f(p, obs, key):
        key, sub = jax.random.split(key)
        h = jnp.tanh(obs @ p["w1"] + p["b1"])
        h = jnp.tanh(h @ p["w2"] + p["b2"])
        mean = h @ p["w3"] + p["b3"]
        eps = jax.random.normal(sub, mean.shape, mean.dtype)
        action = mean + jnp.exp(p["log_std"]) * eps
        logp = (-0.5 * eps * eps - p["log_std"] - LOG_SQRT_2PI).sum(-1)
        return action, logp, mean, key

    return f


def rl_check(out: list, ref: list, args: tuple) -> float:
    """Random outputs differ between methods: check the deterministic mean
    against eager, the log-probability against the sample it came with, and
    that the noise looks standard normal."""
    action, logp, mean = out[:3]
    log_std = args[0]["log_std"].detach().double()
    eps = (action - mean) / log_std.exp()
    logp_again = (-0.5 * eps * eps - log_std - LOG_SQRT_2PI).sum(-1)
    m, s = eps.mean().item(), eps.std().item()
    if not (abs(m) < 0.5 and 0.6 < s < 1.5):
        return math.inf
    return max(rel_err(mean, ref[2]), rel_err(logp, logp_again))


# 7. bf16 matmul 8192^3 (compute-bound) ---------------------------------------


def matmul_fn(a, b):
    return a @ b


def matmul_args_factory(n):
    def make(dev):
        return (torch.randn(n, n, device=dev).to(torch.bfloat16), torch.randn(n, n, device=dev).to(torch.bfloat16))

    return make


def matmul_jax(jax, jnp):
    return lambda a, b: a @ b


def make_workloads(device: torch.device) -> List[Workload]:
    mm = 8192 if device.type == "cuda" else 512  # a CPU run only exercises the code
    return [
        Workload("chain", f"chain of {CHAIN_OPS} elementwise ops, 1024 floats", chain_fn, chain_args, chain_jax),
        Workload("mlp", "8-layer MLP forward, 512 wide, batch 64 (17 leaves)", mlp_fn, mlp_args, mlp_jax),
        Workload("mlp_grad", "torch.func.grad of that MLP's loss", mlp_grad_fn, mlp_args, mlp_grad_jax, mgc=False),
        Workload("dict32", "dict of 32 tensors in and out", dict_fn, dict_args, dict_jax),
        Workload("transformer", "transformer block fwd, bf16, batch 4, seq 64, d 512", transformer_fn,
                 transformer_args, transformer_jax, bf16=True),
        Workload("rl", "RL policy step (2x64 tanh MLP, gaussian sample, batch 16)", rl_fn, rl_args, rl_jax,
                 jax_key=True, check=rl_check),
        Workload("matmul", f"bf16 matmul {mm}^3 (compute-bound)", matmul_fn, matmul_args_factory(mm), matmul_jax,
                 mgc=False, bf16=True, n_sets=3),
    ]


# --------------------------------------------------------------------------
# Helpers: trees, errors, synchronisation, memory
# --------------------------------------------------------------------------


def tree_tensors(obj: Any) -> List[torch.Tensor]:
    """Tensor leaves in a fixed order (dict keys sorted)."""
    out: List[torch.Tensor] = []

    def rec(o):
        if isinstance(o, dict):
            for k in sorted(o):
                rec(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                rec(v)
        elif isinstance(o, torch.Tensor):
            out.append(o)

    rec(obj)
    return out


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: tree_map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map_tensors(fn, v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    return obj


def clone_args(args: tuple) -> tuple:
    return tree_map_tensors(lambda t: t.clone(), args)


def copy_into(dst_args: tuple, src_args: tuple) -> None:
    """Copy one input set's values into another's tensors, in place."""
    for d, s in zip(tree_tensors(dst_args), tree_tensors(src_args)):
        d.copy_(s)


def f64_leaves(obj: Any, device: torch.device) -> List[torch.Tensor]:
    """Every array leaf (torch or jax; dict keys sorted) as a float64 torch tensor."""
    out: List[torch.Tensor] = []

    def rec(o):
        if isinstance(o, dict):
            for k in sorted(o):
                rec(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                rec(v)
        elif isinstance(o, torch.Tensor):
            out.append(o.detach().to(torch.float64))
        elif o is None or isinstance(o, (bool, int, float, str)):
            pass
        else:  # a jax array
            out.append(torch.from_numpy(np.asarray(o).astype(np.float64)).to(device))

    rec(obj)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (inf for NaN or a shape mismatch)."""
    if a.shape != b.shape:
        return math.inf
    d = (a - b).norm().item()
    r = b.norm().item()
    if not (math.isfinite(d) and math.isfinite(r)):
        return math.inf
    return d / r if r > 0 else d


def error_vs(w: Workload, out: Any, ref: List[torch.Tensor], args: tuple, device: torch.device) -> float:
    """The error of one call's result against eager's (converted at once:
    graphified outputs are valid only until the next call)."""
    leaves = f64_leaves(out, device)
    del out
    if w.check is not None:
        return w.check(leaves, ref, args)
    if len(leaves) != len(ref):
        return math.inf
    return max((rel_err(a, b) for a, b in zip(leaves, ref)), default=0.0)


class Ctx:
    """What every method of one workload shares."""

    def __init__(self, w: Workload, device: torch.device, opts: argparse.Namespace):
        self.w = w
        self.device = device
        self.opts = opts
        self.cuda = device.type == "cuda"
        torch.manual_seed(1234)
        self.sets = [w.make_args(device) for _ in range(max(3, w.n_sets))]
        self.sync()
        self.refs = [f64_leaves(w.fn(*s), device) for s in self.sets[:3]]
        self.sync()

    def sync(self, _out: Any = None) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def err(self, out: Any, k: int, args: Optional[tuple] = None) -> float:
        return error_vs(self.w, out, self.refs[k], self.sets[k] if args is None else args, self.device)

    def mem(self) -> Optional[Dict[str, int]]:
        """Device memory in use now: garbage collected and unused cached blocks
        released first, so that "reserved" is what is really held (private
        graph pools of live recordings are never released by empty_cache)."""
        if not self.cuda:
            return None
        gc.collect()
        self.sync()
        torch.cuda.empty_cache()
        try:  # segments of private pools (CUDA graph pools), by address
            private = {s["address"]: s["total_size"] for s in torch.cuda.memory_snapshot()
                       if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)}
        except Exception:
            private = None
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "private": private}

    @staticmethod
    def mem_delta(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> Optional[Dict[str, int]]:
        if a is None or b is None:
            return None
        out = {f"{k}_delta_bytes": b[k] - a[k] for k in ("allocated", "reserved")}
        if a["private"] is not None and b["private"] is not None:
            out["new_pool_bytes"] = sum(v for addr, v in b["private"].items() if addr not in a["private"])
        return out


@dataclass
class Prepared:
    """A method, built, checked and warmed up: ready to time."""

    call: Callable[[], Any]
    errors: List[float]
    first_call_s: Optional[float] = None
    hold: bool = False  # keep each call's output alive until the next call
    sync: Optional[Callable[[Any], None]] = None  # default: the device synchronisation
    extra: Dict[str, Any] = field(default_factory=dict)
    after: Optional[Callable[[], Dict[str, Any]]] = None  # more figures, read after timing


def timed_first_call(ctx: Ctx, fn: Callable[[], Any]) -> tuple:
    ctx.sync()
    t0 = perf_counter()
    out = fn()
    ctx.sync(out)
    return out, perf_counter() - t0


# --------------------------------------------------------------------------
# Methods: each returns a Prepared (or raises NotApplicable / Skipped)
# --------------------------------------------------------------------------


def method_eager(ctx: Ctx) -> Prepared:
    w, args = ctx.w, ctx.sets[0]
    extra: Dict[str, Any] = {}
    out, first = timed_first_call(ctx, lambda: w.fn(*args))
    errors = [ctx.err(out, 0)]
    del out
    errors.append(ctx.err(w.fn(*ctx.sets[1]), 1))
    if ctx.cuda:  # transient memory of one call, beyond its inputs
        ctx.sync()
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = w.fn(*args)
        ctx.sync()
        extra["memory"] = {"peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
                           "output_bytes": torch.cuda.memory_allocated() - base}
        del out
    return Prepared(lambda: w.fn(*args), errors, first, extra=extra)


def _hand_graph(ctx: Ctx) -> Dict[str, Any]:
    """Static inputs, warm-up on a side stream, capture; built once for both columns."""
    cache = getattr(ctx, "_hand_graph", None)
    if cache is not None:
        return cache
    if not ctx.cuda:
        raise Skipped("CUDA only")
    w = ctx.w
    m0 = ctx.mem()
    t0 = perf_counter()
    static = clone_args(ctx.sets[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            w.fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = w.fn(*static)
    ctx.sync()
    setup = perf_counter() - t0
    cache = {"graph": g, "static": static, "static_leaves": tree_tensors(static), "out": static_out,
             "setup_s": setup, "memory": Ctx.mem_delta(m0, ctx.mem())}
    ctx._hand_graph = cache
    return cache


def method_graph_copy(ctx: Ctx) -> Prepared:
    hg = _hand_graph(ctx)
    g, static_leaves, static_out = hg["graph"], hg["static_leaves"], hg["out"]
    errors = []
    for k in (1, 2):  # copy-in of another input set, replay, compare
        for d, s in zip(static_leaves, tree_tensors(ctx.sets[k])):
            d.copy_(s)
        g.replay()
        errors.append(ctx.err(static_out, k))
    flat_sets = [tree_tensors(s) for s in ctx.sets]
    it = itertools.cycle(flat_sets)
    # the static inputs now hold set 2, which the replay-alone check uses

    def call():
        for d, s in zip(static_leaves, next(it)):
            d.copy_(s)
        g.replay()
        return static_out

    return Prepared(call, errors, hg["setup_s"], extra={"memory": hg["memory"], "first_call_is": "warm-up + capture"})


def method_graph_replay(ctx: Ctx) -> Prepared:
    hg = _hand_graph(ctx)
    g, static_out = hg["graph"], hg["out"]
    copy_into(hg["static"], ctx.sets[2])
    g.replay()
    errors = [ctx.err(static_out, 2)]

    def call():
        g.replay()
        return static_out

    return Prepared(call, errors, hg["setup_s"], extra={"memory": hg["memory"], "first_call_is": "warm-up + capture"})


def method_mgc(ctx: Ctx) -> Prepared:
    if not ctx.w.mgc:
        raise NotApplicable("not applicable")
    if not ctx.cuda:
        raise Skipped("CUDA only")
    w = ctx.w
    own = clone_args(ctx.sets[0])  # make_graphed_callables writes into its sample inputs
    m0 = ctx.mem()
    t0 = perf_counter()
    gf = torch.cuda.make_graphed_callables(w.fn, own)
    out = gf(*own)
    ctx.sync()
    first = perf_counter() - t0
    errors = [ctx.err(out, 0)]
    del out
    mem = Ctx.mem_delta(m0, ctx.mem())
    copy_into(own, ctx.sets[1])  # the same tensors, new values
    errors.append(ctx.err(gf(*own), 1))
    return Prepared(lambda: gf(*own), errors, first,
                    extra={"memory": mem, "first_call_is": "make_graphed_callables + first call"})


def method_compile(ctx: Ctx) -> Prepared:
    w = ctx.w
    if not w.compile_ok:
        raise NotApplicable("not applicable")
    if not ctx.cuda and not ctx.opts.cpu_compile:
        raise Skipped("slow on CPU (--cpu-compile runs it)")
    own = clone_args(ctx.sets[0])
    m0 = ctx.mem()
    cf = torch.compile(w.fn, mode="reduce-overhead")
    out, first = timed_first_call(ctx, lambda: cf(*own))
    errors = [ctx.err(out, 0)]
    del out
    t0 = perf_counter()
    for _ in range(4):  # cudagraph trees record on a later call
        cf(*own)
    ctx.sync()
    warm = perf_counter() - t0
    mem = Ctx.mem_delta(m0, ctx.mem())
    copy_into(own, ctx.sets[1])
    errors.append(ctx.err(cf(*own), 1))
    return Prepared(lambda: cf(*own), errors, first,
                    extra={"memory": mem, "next_4_calls_s": warm, "first_call_is": "compile + first call"})


_JAX: Any = None


def import_jax() -> Any:
    """jax and jax.numpy, imported on first use; Skipped if jax is missing."""
    global _JAX
    if _JAX is None:
        try:
            import jax
            import jax.numpy as jnp

            jax.config.update("jax_default_matmul_precision", "highest")  # float32 like torch's default
            _JAX = (jax, jnp)
        except Exception as e:  # not installed, or broken
            _JAX = e
    if isinstance(_JAX, Exception):
        raise Skipped(f"jax unavailable ({type(_JAX).__name__}: {str(_JAX).splitlines()[0] if str(_JAX) else ''})")
    return _JAX


def jax_device(jax: Any, cuda: bool) -> Any:
    if cuda:
        try:
            return jax.devices("gpu")[0]
        except RuntimeError as e:
            raise Skipped(f"jax has no GPU backend ({e})") from None
    return jax.devices("cpu")[0]


def to_jax(args: Any, jax: Any, jnp: Any, dev: Any) -> Any:
    def conv(t: torch.Tensor):
        if t.dtype == torch.bfloat16:
            return jax.device_put(jnp.asarray(t.float().cpu().numpy(), dtype=jnp.bfloat16), dev)
        return jax.device_put(t.cpu().numpy(), dev)

    return tree_map_tensors(conv, args)


def method_jax(ctx: Ctx) -> Prepared:
    w = ctx.w
    if w.jax_fn is None:
        raise NotApplicable("not written")
    jax, jnp = import_jax()
    dev = jax_device(jax, ctx.cuda)
    jf = jax.jit(w.jax_fn(jax, jnp))
    jargs = [to_jax(ctx.sets[k], jax, jnp, dev) for k in (0, 1)]
    if w.jax_key:
        key = [jax.device_put(jax.random.PRNGKey(0), dev)]

        def run(a):
            out = jf(*a, key[0])
            key[0] = out[-1]
            return out
    else:
        def run(a):
            return jf(*a)

    def block(out):
        jax.block_until_ready(out)
        ctx.sync()

    block(jargs)
    t0 = perf_counter()
    out = run(jargs[0])
    block(out)
    first = perf_counter() - t0
    errors = [ctx.err(out, 0), ctx.err(run(jargs[1]), 1)]
    del out
    a0 = jargs[0]
    return Prepared(lambda: run(a0), errors, first, hold=True, sync=block,
                    extra={"first_call_is": "trace + compile + first call"})


def _gt_prepare(ctx: Ctx, new_tensors: bool, held: bool, fuse: bool = False) -> Prepared:
    w = ctx.w
    f = gt.graphify(w.fn, fuse=fuse)
    extra: Dict[str, Any] = {"first_call_is": "trace + record + first call"}
    if new_tensors:
        sets = ctx.sets
        m0 = ctx.mem()
        out, first = timed_first_call(ctx, lambda: f(*sets[0]))
        del out
        for k in range(1, len(sets)):
            f(*sets[k])
        extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
        errors = [ctx.err(f(*sets[k]), k) for k in (1, 2)]
        it = itertools.cycle(sets)

        def call():
            return f(*next(it))
    else:
        own = clone_args(ctx.sets[0])  # the same tensor objects every call
        m0 = ctx.mem()
        out, first = timed_first_call(ctx, lambda: f(*own))
        errors = [ctx.err(out, 0, own)]
        del out
        # the second call sees the same tensors again and re-records to read them in place
        out, second = timed_first_call(ctx, lambda: f(*own))
        errors.append(ctx.err(out, 0, own))
        del out
        f(*own)
        extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
        extra["second_call_s"] = second
        copy_into(own, ctx.sets[1])  # in-place update of the same tensors must be seen
        errors.append(ctx.err(f(*own), 1, own))

        def call():
            return f(*own)

    return Prepared(call, errors, first, hold=held, extra=extra,
                    after=lambda: {"cache_info": f.cache_info()._asdict()})


def method_gt_same(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=False)


def method_gt_new(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=True, held=False)


def method_gt_held(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=True)


def method_gt_fused(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held=False, fuse=True)


METHOD_FNS: Dict[str, Callable[[Ctx], Prepared]] = {
    "eager": method_eager,
    "graph_copy": method_graph_copy,
    "graph_replay": method_graph_replay,
    "mgc": method_mgc,
    "compile": method_compile,
    "jax": method_jax,
    "gt_same": method_gt_same,
    "gt_new": method_gt_new,
    "gt_held": method_gt_held,
    "gt_fused": method_gt_fused,
}

# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def run_calls(call: Callable[[], Any], n: int, hold: bool) -> Any:
    if hold:
        out = None
        for _ in range(n):
            out = call()
        return out
    for _ in range(n):
        call()
    return None


def time_method(p: Prepared, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Median seconds per call over repeats of N calls + one synchronisation."""
    sync = p.sync or ctx.sync
    for _ in range(3):  # warm-up
        sync(run_calls(p.call, 1, True))
    t0 = perf_counter()
    sync(run_calls(p.call, 3, p.hold))
    est = max((perf_counter() - t0) / 3, 1e-7)
    n = int(min(max(opts.target_s / est, opts.min_calls), opts.max_calls))
    times = []
    gc.collect()
    for _ in range(opts.repeats):
        sync(None)
        t0 = perf_counter()
        out = run_calls(p.call, n, p.hold)
        sync(out)
        times.append((perf_counter() - t0) / n)
        del out
    med = statistics.median(times)
    return {
        "us_median": med * 1e6,
        "us_min": min(times) * 1e6,
        "us_max": max(times) * 1e6,
        "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
        "calls_per_repeat": n,
        "repeats": len(times),
        "times_us": [t * 1e6 for t in times],
    }


def short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def run_cell(method: str, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Build, check and time one method on one workload; never raises."""
    if not ctx.cuda and method in CUDA_ONLY:
        return {"status": "skipped", "reason": "CUDA only"}
    cell: Dict[str, Any] = {"tol": ctx.w.tol}
    try:
        p = METHOD_FNS[method](ctx)
        cell["rel_err"] = max(p.errors) if p.errors else None
        cell["rel_errs"] = p.errors
        cell["check_ok"] = bool(p.errors) and all(e <= ctx.w.tol for e in p.errors)
        cell["first_call_s"] = p.first_call_s
        cell.update(p.extra)
        cell.update(time_method(p, ctx, opts))
        if p.after is not None:
            cell.update(p.after())
        cell["status"] = "ok"
        del p
    except NotApplicable as e:
        return {"status": "n/a", "reason": str(e)}
    except Skipped as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:
        cell.update(status="error", error=short_error(e), traceback=traceback.format_exc(limit=8))
        try:
            ctx.sync()
        except Exception as e2:  # the device may be unusable now
            cell["sync_error"] = short_error(e2)
    return cell


def warm_up_process(device: torch.device, methods: List[str], opts: argparse.Namespace) -> Dict[str, float]:
    """One-time costs (library loading, first compile) kept out of the per-workload figures."""
    out: Dict[str, float] = {}
    x = torch.randn(64, 64, device=device)

    def timed(name, fn):
        try:
            t0 = perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[name] = perf_counter() - t0
        except Exception as e:
            out[name] = float("nan")
            print(f"[warm-up] {name}: {short_error(e)}", flush=True)

    timed("eager", lambda: [(x @ x).relu().sum() for _ in range(3)])
    if any(m.startswith("gt_") for m in methods):
        g = gt.graphify(lambda a: (a @ a).relu() + 1)
        timed("gtransform", lambda: [g(x) for _ in range(3)])
    if "compile" in methods and (device.type == "cuda" or opts.cpu_compile):
        c = torch.compile(lambda a: (a @ a).relu() + 1, mode="reduce-overhead")
        timed("torch.compile", lambda: [c(x) for _ in range(4)])
    if "jax" in methods:
        try:
            jax, jnp = import_jax()
            jd = jax_device(jax, device.type == "cuda")
            a = jax.device_put(np.ones((64, 64), np.float32), jd)
            timed("jax", lambda: jax.block_until_ready(jax.jit(lambda a: (a @ a) + 1)(a)))
        except Skipped:
            pass
    return out


# --------------------------------------------------------------------------
# Reports: JSON, Markdown, PNG
# --------------------------------------------------------------------------


def fmt_us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_mib(b: Optional[int]) -> str:
    return "" if b is None else f"{b / 2**20:.1f}"


def cell_text(cell: Dict[str, Any], notes: List[str], where: str) -> str:
    st = cell["status"]
    if st == "ok":
        txt = fmt_us(cell["us_median"])
        if not cell.get("check_ok", True):
            txt += " ✗"
            notes.append(f"{where}: result differs from eager, rel err {cell.get('rel_err'):.2e} > tol {cell['tol']:.0e}")
        return txt
    if st == "n/a":
        return "n/a"
    if st == "skipped":
        return "skip"
    notes.append(f"{where}: {cell.get('error')}")
    return "error"


def markdown(results: Dict[str, Any]) -> Dict[str, str]:
    """The tables: per-call (µs), targets (ratios), first call (s), memory (MiB)."""
    methods = results["methods_run"]
    wls = results["workloads"]
    tables: Dict[str, str] = {}

    notes: List[str] = []
    lines = ["| workload | " + " | ".join(METHODS[m] for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for name, wr in wls.items():
        cells = [cell_text(wr["cells"][m], notes, f"{name} / {m}") for m in methods]
        lines.append(f"| {wr['title']} | " + " | ".join(cells) + " |")
    skips = sorted({f"{m}: {c.get('reason')}" for wr in wls.values() for m, c in wr["cells"].items()
                    if c["status"] == "skipped"})
    foot = []
    if skips:
        foot.append("skip: " + "; ".join(skips))
    foot += [f"- {n}" for n in notes]
    tables["per_call"] = ("Microseconds per call, median of "
                          f"{results['meta']['repeats']} repeats ({results['meta']['device_name']}).\n\n"
                          + "\n".join(lines) + ("\n\n" + "\n".join(foot) if foot else ""))

    def us(wr, m):
        c = wr["cells"].get(m)
        return c["us_median"] if c and c["status"] == "ok" else None

    peers = [m for m in ("eager", "graph_copy", "mgc", "compile", "jax") if m in methods]
    lines = ["| workload | gt same ÷ replay alone (≤ 1.10) | gt new ÷ copy-in + replay | gt same ÷ best peer (< 1) | best peer | gt same ÷ eager |",
             "|---|---|---|---|---|---|"]
    for name, wr in wls.items():
        def ratio(a, b):
            return f"{a / b:.2f}" if a is not None and b else ""
        s = us(wr, "gt_same")
        peer_vals = [(us(wr, m), m) for m in peers if us(wr, m) is not None]
        best = min(peer_vals) if peer_vals else (None, "")
        lines.append(f"| {name} | {ratio(s, us(wr, 'graph_replay'))} | {ratio(us(wr, 'gt_new'), us(wr, 'graph_copy'))} | "
                     f"{ratio(s, best[0])} | {METHODS.get(best[1], '')} | {ratio(s, us(wr, 'eager'))} |")
    tables["targets"] = "Ratios (targets from DESIGN.md in brackets).\n\n" + "\n".join(lines)

    fc = [m for m in methods if m != "graph_replay"]
    heads = {**METHODS, "graph_copy": "CUDA graph: warm-up + capture"}
    lines = ["| workload | " + " | ".join(heads[m] for m in fc) + " | gt same: 2nd call |",
             "|---|" + "---|" * (len(fc) + 1)]
    for name, wr in wls.items():
        row = []
        for m in fc:
            c = wr["cells"][m]
            row.append(f"{c['first_call_s']:.3f}" if c["status"] == "ok" and c.get("first_call_s") is not None else "")
        sc = wr["cells"].get("gt_same", {})
        row.append(f"{sc['second_call_s']:.3f}" if sc.get("second_call_s") is not None else "")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    tables["first_call"] = (
        "First call, seconds (eager: first call; CUDA graph: warm-up + capture; make_graphed_callables: it + "
        "first call; torch.compile: compile + first call; jax: trace + compile + first call; gt: trace + record "
        "+ first call; gt's second call with the same tensors re-records to read them in place). One-time process "
        "costs, paid before the first workload: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in results["process_warmup_s"].items()) + ".\n\n" + "\n".join(lines))

    mem_cols = [m for m in ("graph_copy", "mgc", "compile", "gt_same", "gt_new") if m in methods]
    heads = {**METHODS, "graph_copy": "CUDA graph"}
    lines = ["| workload | eager: peak beyond inputs | eager: output | "
             + " | ".join(f"{heads[m]}: pool / alloc Δ" for m in mem_cols) + " |",
             "|---|---|---|" + "---|" * len(mem_cols)]
    for name, wr in wls.items():
        e = wr["cells"].get("eager", {}).get("memory") or {}
        row = [fmt_mib(e.get("peak_extra_bytes")), fmt_mib(e.get("output_bytes"))]
        for m in mem_cols:
            mm = wr["cells"][m].get("memory") or {}
            row.append(f"{fmt_mib(mm.get('new_pool_bytes'))} / {fmt_mib(mm.get('allocated_delta_bytes'))}"
                       if mm else "")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    tables["memory"] = (
        "Memory, MiB (CUDA only). Eager: torch.cuda.max_memory_allocated during one call minus what was allocated "
        "before it, and its output. Others, measured before and after building and warming up the method (each "
        "time after gc.collect() and torch.cuda.empty_cache()): pool = size of the private-pool segments "
        "(CUDA graph memory pools, from torch.cuda.memory_snapshot) that appeared; alloc Δ = change of "
        "torch.cuda.memory_allocated (static input buffers and live outputs, plus cuBLAS workspaces of new "
        "streams, 32 MiB each on Hopper; torch.compile's cudagraph trees free the existing cuBLAS workspaces, "
        "which can make its Δ negative). Inputs made beforehand are not counted; JSON has reserved too.\n\n"
        + "\n".join(lines))
    return tables


PLOT_LABELS: Dict[str, str] = {
    "eager": "eager",
    "graph_copy": "graph: copy-in+replay",
    "graph_replay": "graph: replay alone",
    "mgc": "make_graphed_callables",
    "compile": "torch.compile r-o",
    "jax": "jax.jit",
    "gt_same": "gt: same tensors",
    "gt_new": "gt: new tensors",
    "gt_held": "gt: same, out held",
    "gt_fused": "gt fuse=True: same tensors",
}


def plot(results: Dict[str, Any], path: str) -> None:
    """Per-call time: one panel per workload, one bar per method (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    wls = results["workloads"]
    methods = results["methods_run"]
    n = len(wls)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, (0.3 * len(methods) + 1.1) * rows + 0.6),
                             squeeze=False, layout="constrained")
    colors = plt.get_cmap("tab10")
    for ax, wr in zip(axes.flat, wls.values()):
        cells = [wr["cells"][m] for m in methods]
        vals = [c["us_median"] if c["status"] == "ok" else math.nan for c in cells]
        y = np.arange(len(methods))
        ax.barh(y, vals, color=[colors(i % 10) for i in range(len(methods))])
        ax.set_yticks(y, [PLOT_LABELS[m] for m in methods], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(wr["title"], fontsize=9)
        ok = [v for v in vals if not math.isnan(v)]
        if ok:
            ax.set_xlim(min(ok) / 2, max(ok) * 8)
        x0 = ax.get_xlim()[0]
        for yi, (v, c) in enumerate(zip(vals, cells)):
            if math.isnan(v):
                ax.text(x0, yi, " " + c["status"], va="center", fontsize=7, color="gray")
            else:
                mark = "" if c.get("check_ok", True) else " (check failed)"
                ax.text(v, yi, " " + fmt_us(v) + mark, va="center", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("µs per call (median, log scale)", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    m = results["meta"]
    fig.suptitle(f"gtransform benchmark: {m['device_name']}, torch {m['torch']}, jax {m['jax']}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(device: torch.device, opts: argparse.Namespace) -> Dict[str, Any]:
    meta: Dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gtransform": getattr(gt, "__version__", "?"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU",
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "argv": sys.argv,
        "quick": opts.quick,
        "repeats": opts.repeats,
        "target_s_per_repeat": opts.target_s,
        "tolerances": {"fp32": TOL_FP32, "bf16": TOL_BF16},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import jax

        meta["jax"] = jax.__version__
    except Exception:
        meta["jax"] = None
    try:  # identifies the gtransform sources even where the checkout has no .git (the device machine)
        import hashlib

        src = os.path.dirname(os.path.abspath(gt.__file__))
        h = hashlib.sha256()
        for fname in sorted(os.listdir(src)):
            if fname.endswith(".py"):
                with open(os.path.join(src, fname), "rb") as fh:
                    h.update(fname.encode() + b"\0" + fh.read())
        meta["gtransform_src_sha256"] = h.hexdigest()[:12]
    except Exception:
        meta["gtransform_src_sha256"] = None
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
    except Exception:
        meta["git"] = None
    return meta


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="output directory (default: benchmarks/results)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter repeats")
    ap.add_argument("--only", default=None,
                    help="comma-separated workloads: chain, mlp, mlp_grad, dict32, transformer, rl, matmul")
    ap.add_argument("--methods", default=None, help="comma-separated methods (columns): " + ", ".join(METHODS))
    ap.add_argument("--cpu-compile", action="store_true", help="on the CPU, also run torch.compile (slow)")
    opts = ap.parse_args(argv)
    opts.repeats = 3 if opts.quick else 9
    opts.target_s = 0.01 if opts.quick else 0.05  # wall time per repeat
    opts.min_calls = 3
    opts.max_calls = 200 if opts.quick else 5000
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    opts = parse_args(argv)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("CUDA is not available: use --device cpu", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    workloads = make_workloads(device)
    names = [w.name for w in workloads]
    if opts.only:
        want = [s.strip() for s in opts.only.split(",") if s.strip()]
        bad = [s for s in want if s not in names]
        if bad:
            print(f"unknown workload(s) {bad}; choose from {names}", file=sys.stderr)
            return 2
        workloads = [w for w in workloads if w.name in want]
    methods = list(METHODS)
    if opts.methods:
        want = [s.strip() for s in opts.methods.split(",") if s.strip()]
        bad = [s for s in want if s not in METHODS]
        if bad:
            print(f"unknown method(s) {bad}; choose from {list(METHODS)}", file=sys.stderr)
            return 2
        methods = [m for m in METHODS if m in want]
    os.makedirs(opts.out, exist_ok=True)

    t_start = perf_counter()
    results: Dict[str, Any] = {"meta": environment(device, opts), "methods": METHODS, "methods_run": methods,
                               "workloads": {}}
    print(f"gtransform benchmark on {results['meta']['device_name']} (torch {torch.__version__}, "
          f"jax {results['meta']['jax']}), {'quick' if opts.quick else 'full'} run", flush=True)
    results["process_warmup_s"] = warm_up_process(device, methods, opts)

    for w in workloads:
        t_w = perf_counter()
        wr: Dict[str, Any] = {"title": w.title, "bf16": w.bf16, "cells": {}}
        results["workloads"][w.name] = wr
        try:
            ctx = Ctx(w, device, opts)
        except Exception as e:  # eager itself fails: every cell reports it
            err = {"status": "error", "error": "eager reference failed: " + short_error(e),
                   "traceback": traceback.format_exc(limit=8)}
            wr["cells"] = {m: dict(err) for m in methods}
            print(f"[{w.name}] {err['error']}", flush=True)
            continue
        for m in methods:
            cell = run_cell(m, ctx, opts)
            wr["cells"][m] = cell
            if cell["status"] == "ok":
                msg = (f"{cell['us_median']:9.1f} us/call (±{100 * cell['spread']:.0f}%, n={cell['calls_per_repeat']})  "
                       f"first {cell['first_call_s'] if cell['first_call_s'] is not None else float('nan'):.3f} s  "
                       f"err {cell['rel_err']:.1e}{'' if cell['check_ok'] else ' CHECK FAILED'}")
            else:
                msg = cell["status"] + ": " + str(cell.get("reason") or cell.get("error"))
            print(f"[{w.name:11s}] {m:12s} {msg}", flush=True)
        wr["seconds"] = perf_counter() - t_w
        del ctx
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    results["meta"]["total_s"] = perf_counter() - t_start
    tables = markdown(results)
    json_path = os.path.join(opts.out, "results.json")
    md_path = os.path.join(opts.out, "results.md")
    png_path = os.path.join(opts.out, "results.png")
    with open(json_path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    with open(md_path, "w") as fh:
        m = results["meta"]
        fh.write(f"# gtransform benchmark\n\n{m['device_name']}, torch {m['torch']}, jax {m['jax']}, "
                 f"gtransform {m['gtransform']} (git {m['git']}, sources {m['gtransform_src_sha256']}), {m['date']}, "
                 f"{'quick' if m['quick'] else 'full'} run, {m['total_s']:.0f} s.\n\n")
        for key, title in (("per_call", "Per call"), ("targets", "Targets"), ("first_call", "First call"),
                           ("memory", "Memory")):
            fh.write(f"## {title}\n\n{tables[key]}\n\n")
    try:
        plot(results, png_path)
    except Exception as e:
        print(f"plot failed: {short_error(e)}", flush=True)
    print(f"\nwrote {json_path}, {md_path}, {png_path} in {results['meta']['total_s']:.0f} s\n", flush=True)
    print(tables["targets"] + "\n", flush=True)
    print(tables["per_call"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

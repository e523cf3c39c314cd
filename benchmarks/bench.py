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
    gt_views                      gt_held, and the loop also keeps a view of an output of each of
                                  the last 4 calls (`history.append(out[0])`, 4 kept)
    gt_fused                      gt.graphify(fn, fuse=True): inductor-fused kernels, recorded

Rows: the seven synthetic workloads, then seven real programs (resnet18,
a training step with Adam, GPT-2, GPT-2 as a module, a Llama decode step
with a StaticCache, per-sample gradients, an ensemble). Stateful rows build
a fresh copy of their program per column (Workload.factory).

Per-call time is the median over repeats of (wall time of N calls followed
by a device synchronisation) / N. Also recorded: the first call's time
(trace + record, or compile; every column compiles with cold caches, and the
fuse=True first call again with warm caches in a second process), memory,
and every variant's error against eager. float32 precision is the same for
every column (no TF32 unless --tf32).

Outputs in --out: results.json (every figure), results.md (tables),
results.png (per-call time per workload and method). The per-call table is
printed last on stdout.

Run `python benchmarks/bench.py --help` for the flags; benchmarks/README.md
for the exact commands.
"""

from __future__ import annotations

import os

# Before jax or torch are imported: keep jax from grabbing the GPU's memory,
# and make a fresh root for the compile caches (removed at exit): every cell
# then gets its own empty TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR under it
# (compile_caches), so every column's first call is a cold compile.
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
import contextlib
import cProfile
import gc
import itertools
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
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
    "gt_views": "gt: same, views of 4 calls held",
    "gt_fused": "gt fuse=True: same tensors",
}
CUDA_ONLY = {"graph_copy", "graph_replay", "mgc"}

TOL_FP32 = 1e-4
TOL_FP32_TF32 = 1e-2  # --tf32: float32 matmuls/convolutions on tensor cores, 10-bit mantissa
TOL_BF16 = 2e-2

# float32 precision, the same for every column (set in main() by set_precision):
# default "ieee": no TF32 anywhere (cuBLAS, cuDNN, inductor's matmul templates: torch
# defaults cuDNN convolutions to TF32, so this is set explicitly), jax at "highest";
# --tf32: TF32 everywhere, jax at "tensorfloat32".
PRECISION: Dict[str, Any] = {"tf32": False}


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
    fn: Optional[Callable[..., Any]]  # the torch function, fn(*args) (None: see factory)
    make_args: Callable[[torch.device], tuple]  # fresh random args (a tuple of pytrees)
    jax_fn: Optional[Callable[[Any, Any], Callable[..., Any]]] = None  # (jax, jnp) -> function of the same args
    jax_key: bool = False  # the jax function takes and returns a PRNG key (threaded through calls)
    mgc: bool = True  # make_graphed_callables applies
    compile_ok: bool = True
    bf16: bool = False
    n_sets: int = 8  # pre-made input sets (rotated through by the "new tensors" columns)
    check: Optional[Callable[[list, list, tuple], float]] = None  # custom (out, ref, args) -> error
    # Real programs with state (a closed-over model, optimizer, KV cache): factory(device) builds a
    # fresh Instance from the same initial state for every column; the check runs `steps` calls
    # (one per input set, in order) and compares each call's outputs with eager's, and the state
    # after them (Instance.state) with eager's. See "Stateful rows" below.
    factory: Optional[Callable[[torch.device], Instance]] = None
    steps: int = 4
    no_grad: bool = False  # build, check and time every column under torch.no_grad()
    state_tol: float = 1e-3  # for Instance.state, compared as updates (state_delta) or values
    state_delta: bool = True
    only_methods: Optional[tuple] = None  # other columns: n/a (to keep the run short)
    note: str = ""

    @property
    def tol(self) -> float:
        if self.bf16:
            return TOL_BF16
        return TOL_FP32_TF32 if PRECISION["tf32"] else TOL_FP32


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


# --------------------------------------------------------------------------
# Real programs (issues: resnet18, train_adam, gpt2, llama_decode,
# per_sample_grads, ensemble). Random init, no downloads. A missing package
# makes the row "skipped: <reason>".
# --------------------------------------------------------------------------


@dataclass
class Instance:
    """One column's own copy of a stateful program."""

    fn: Callable[..., Any]  # what every column calls, records or compiles (closes over the state)
    state: Optional[Callable[[], Any]] = None  # tensors compared with eager's after the check steps
    mgc_module: Optional[torch.nn.Module] = None  # make_graphed_callables graphs this module ...
    mgc_args: Optional[Callable[[tuple], tuple]] = None  # ... with these of the step's args (default: all)
    keep: Any = None  # anything else the instance must keep alive


def need(module: str, what: str = "") -> Any:
    """Import a package the row needs, or skip the row saying why."""
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as e:
        raise Skipped(f"{module} not importable{' (' + what + ')' if what else ''}: {short_error(e)}") from None


def _seeded(seed: int = 0):
    torch.manual_seed(seed)


# 8. resnet18 inference, batch 1 (eval, no_grad) --------------------------------


def resnet18_factory(dev):
    tv = need("torchvision.models", "torchvision")
    _seeded()
    model = tv.resnet18(weights=None).eval().to(dev)
    return Instance(model, mgc_module=model)  # gt: gt.graphify(model)


def resnet18_args(dev):
    return (torch.randn(1, 3, 224, 224, device=dev),)


# 9. training step: MLP + Adam(capturable=True), closed over -------------------

ADAM_SIZES, ADAM_BATCH = (128, 512, 512, 512, 10), 64


def train_adam_factory(dev):
    _seeded()
    layers: List[torch.nn.Module] = []
    for i in range(len(ADAM_SIZES) - 1):
        layers.append(torch.nn.Linear(ADAM_SIZES[i], ADAM_SIZES[i + 1]))
        if i < len(ADAM_SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    # capturable=True keeps the step count on the device (needed for capture); the CPU has no capturable Adam
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=dev.type == "cuda")

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return Instance(step, state=lambda: [p for p in model.parameters()], mgc_module=model,
                    mgc_args=lambda a: a[:1], keep=(model, opt))


def train_adam_args(dev):
    return (torch.randn(ADAM_BATCH, ADAM_SIZES[0], device=dev), torch.randn(ADAM_BATCH, ADAM_SIZES[-1], device=dev))


# 10. HF GPT-2 forward, batch 2, seq 32 ------------------------------------------

GPT2_LAYERS, GPT2_EMBD, GPT2_HEADS, GPT2_B, GPT2_T = 4, 256, 4, 2, 32


def _gpt2_model(dev):
    tr = need("transformers")
    _seeded()
    cfg = tr.GPT2Config(n_layer=GPT2_LAYERS, n_embd=GPT2_EMBD, n_head=GPT2_HEADS, n_positions=128, use_cache=False)
    return tr.GPT2LMHeadModel(cfg).eval().to(dev)  # vocabulary: GPT-2's 50257


def gpt2_factory(dev):
    model = _gpt2_model(dev)
    return Instance(lambda ids: model(ids).logits, keep=model)


def gpt2_module_factory(dev):
    model = _gpt2_model(dev)
    return Instance(model, mgc_module=model)  # gt.graphify(model): a ModelOutput comes back


def gpt2_args(dev):
    return (torch.randint(0, 50257, (GPT2_B, GPT2_T), device=dev),)


# 11. HF Llama: one decode step with a StaticCache ----------------------------

LLAMA_PROMPT, LLAMA_MAX_LEN, LLAMA_STEPS = 16, 64, 12
LLAMA_CFG = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=False)


def llama_factory(dev):
    """A fresh model and StaticCache, prefilled eagerly with the same prompt.

    The decode step is HF's recipe for CUDA graphs: model(input_ids=tok,
    past_key_values=cache, use_cache=True) with in-place cache updates. In
    transformers 5.x StaticCache has no cache_position: each layer writes at
    its own device-side counter (cumulative_length) and advances it. The step
    sets the counters to `pos` first, so a call is "decode tok at position
    pos" (4.x's cache_position semantics) and repeating a call rewrites the
    same slot instead of running past max_cache_len in the timing loop.
    """
    tr = need("transformers")
    import inspect

    _seeded()
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA_CFG)).eval().to(dev)
    cache = tr.StaticCache(config=model.config, max_cache_len=LLAMA_MAX_LEN)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, LLAMA_CFG["vocab_size"], (1, LLAMA_PROMPT), generator=g).to(dev)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    if "cache_position" in inspect.signature(model.forward).parameters:  # transformers 4.x
        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
    else:
        counters = [layer.cumulative_length for layer in cache.layers]

        def step(tok, pos):
            p = pos.reshape(())
            for c in counters:
                c.copy_(p)
            return model(input_ids=tok, past_key_values=cache, position_ids=pos.view(1, 1), use_cache=True).logits

    return Instance(step, keep=(model, cache))


def llama_args_factory():
    k = itertools.count()  # call i: token i of a fixed random sequence, at position prompt + i

    def make(dev):
        i = next(k)
        g = torch.Generator().manual_seed(100 + i)
        tok = torch.randint(0, LLAMA_CFG["vocab_size"], (1, 1), generator=g).to(dev)
        return (tok, torch.tensor([LLAMA_PROMPT + i % (LLAMA_MAX_LEN - LLAMA_PROMPT)], device=dev))

    return make


# 12. per-sample gradients: vmap(grad(loss)) -------------------------------------

PSG_SIZES, PSG_BATCH = (64, 128, 128, 10), 64


def psg_params(dev):
    p = {}
    for i in range(len(PSG_SIZES) - 1):
        p[f"w{i}"] = torch.randn(PSG_SIZES[i], PSG_SIZES[i + 1], device=dev) * PSG_SIZES[i] ** -0.5
        p[f"b{i}"] = 0.1 * torch.randn(PSG_SIZES[i + 1], device=dev)
    return p


def psg_loss(p, x, y):  # one sample: x (in,), y (out,)
    n = len(PSG_SIZES) - 1
    for i in range(n):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            x = torch.tanh(x)
    return ((x - y) ** 2).mean()


psg_fn = torch.func.vmap(torch.func.grad(psg_loss), in_dims=(None, 0, 0))


def psg_args(dev):
    return (psg_params(dev), torch.randn(PSG_BATCH, PSG_SIZES[0], device=dev),
            torch.randn(PSG_BATCH, PSG_SIZES[-1], device=dev))


def psg_jax(jax, jnp):
    n = len(PSG_SIZES) - 1

    def loss(p, x, y):
        for i in range(n):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            if i < n - 1:
                x = jnp.tanh(x)
        return jnp.mean((x - y) ** 2)

    return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))


# 13. ensemble of 8 MLPs: stack_module_state + vmap(functional_call) ------------

ENS_MODELS, ENS_SIZES, ENS_BATCH = 8, (64, 128, 128, 10), 64


def _ens_module(dev):
    return torch.nn.Sequential(torch.nn.Linear(ENS_SIZES[0], ENS_SIZES[1]), torch.nn.ReLU(),
                               torch.nn.Linear(ENS_SIZES[1], ENS_SIZES[2]), torch.nn.ReLU(),
                               torch.nn.Linear(ENS_SIZES[2], ENS_SIZES[3])).to(dev)


_ENS_BASE = _ens_module("meta")  # the stateless template of torch's model-ensembling recipe


def _ens_one(p, x):
    return torch.func.functional_call(_ENS_BASE, p, (x,))


ens_fn = torch.func.vmap(_ens_one, in_dims=(0, None))  # (stacked params, x) -> (models, batch, out)


def ens_args(dev):
    params, _ = torch.func.stack_module_state([_ens_module(dev) for _ in range(ENS_MODELS)])
    return ({k: v.detach() for k, v in params.items()}, torch.randn(ENS_BATCH, ENS_SIZES[0], device=dev))


def ens_jax(jax, jnp):
    def one(p, x):  # nn.Linear: x @ W.T + b; Sequential indices 0, 2, 4
        for i, k in enumerate((0, 2, 4)):
            x = x @ p[f"{k}.weight"].T + p[f"{k}.bias"]
            if i < 2:
                x = jax.nn.relu(x)
        return x

    return jax.vmap(one, in_axes=(0, None))


REAL_ROWS = ("resnet18", "train_adam", "gpt2", "gpt2_module", "llama_decode", "per_sample_grads", "ensemble")


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
        Workload("resnet18", "torchvision resnet18 inference, batch 1 (eval, no_grad)", None, resnet18_args,
                 factory=resnet18_factory, steps=4, no_grad=True),
        Workload("train_adam", f"training step: MLP {'-'.join(map(str, ADAM_SIZES))}, batch {ADAM_BATCH}, "
                 "MSE, backward, Adam(capturable)", None, train_adam_args, factory=train_adam_factory, steps=8,
                 note="mgc: the model's forward/backward graphed, loss and Adam eager (torch's partial-network "
                      "recipe); check: the loss of each of 8 steps, and the parameter updates after them"),
        Workload("gpt2", f"HF GPT-2 ({GPT2_LAYERS} layers, d {GPT2_EMBD}) forward, b{GPT2_B} s{GPT2_T}, logits",
                 None, gpt2_args, factory=gpt2_factory, steps=4, no_grad=True),
        Workload("gpt2_module", "the same, gt.graphify(model) (a ModelOutput out)", None, gpt2_args,
                 factory=gpt2_module_factory, steps=4, no_grad=True,
                 only_methods=("eager", "graph_copy", "graph_replay", "mgc", "gt_same", "gt_new", "gt_held"),
                 note="not run here: torch.compile, jax, fuse=True (they would repeat the gpt2 row's compiles)"),
        Workload("llama_decode", f"HF Llama ({LLAMA_CFG['num_hidden_layers']} layers, d {LLAMA_CFG['hidden_size']}) "
                 f"decode step, StaticCache({LLAMA_MAX_LEN}), batch 1", None, llama_args_factory(),
                 factory=llama_factory, steps=LLAMA_STEPS, no_grad=True,
                 note=f"check: the logits of {LLAMA_STEPS} consecutive decode steps after a {LLAMA_PROMPT}-token "
                      "prefill"),
        Workload("per_sample_grads", f"per-sample grads vmap(grad), MLP {'-'.join(map(str, PSG_SIZES))}, "
                 f"batch {PSG_BATCH}", psg_fn, psg_args, psg_jax),
        Workload("ensemble", f"ensemble of {ENS_MODELS} MLPs {'-'.join(map(str, ENS_SIZES))}, vmap(functional_call), "
                 f"batch {ENS_BATCH}", ens_fn, ens_args, ens_jax),
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


try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except Exception:  # pragma: no cover
    class _FakeTensor:  # type: ignore[no-redef]
        pass


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
            if isinstance(o, _FakeTensor):  # would fail later with a baffling DataDependentOutputException
                raise RuntimeError("an output leaf is a FakeTensor: a trace-time value came back instead of a real "
                                   f"tensor (output container {type(obj).__name__})")
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
        self.ref_state: Optional[List[torch.Tensor]] = None
        self.init_state: Optional[List[torch.Tensor]] = None
        self.kept: Dict[str, Any] = {}  # method -> (Prepared, calls per repeat), see time_interleaved
        with grad_mode(w):
            if w.factory is None:
                torch.manual_seed(1234)
                self.sets = [w.make_args(device) for _ in range(max(3, w.n_sets))]
                self.sync()
                self.refs = [f64_leaves(w.fn(*s), device) for s in self.sets[:3]]
                self.sync()
            else:  # eager reference: `steps` calls of a fresh instance, in order
                torch.manual_seed(1234)
                self.sets = [w.make_args(device) for _ in range(max(3, w.steps))]
                inst = self.instance()
                if inst.state is not None:
                    self.init_state = f64_leaves(inst.state(), device)
                self.refs = [f64_leaves(inst.fn(*s), device) for s in self.sets]
                if inst.state is not None:
                    self.ref_state = f64_leaves(inst.state(), device)
                del inst
                self.sync()

    def instance(self) -> Instance:
        """A fresh copy of the workload's program, from the same initial state."""
        inst = self.w.factory(self.device)
        self.sync()
        return inst

    def state_err(self, inst: Instance) -> Optional[float]:
        """Eager vs this instance after the check steps: the relative error of
        the state's updates (or values), max over tensors."""
        if self.ref_state is None or inst.state is None:
            return None
        cur = f64_leaves(inst.state(), self.device)
        if len(cur) != len(self.ref_state):
            return math.inf
        if self.w.state_delta:
            return max(rel_err(c - i, r - i) for c, r, i in zip(cur, self.ref_state, self.init_state))
        return max(rel_err(c, r) for c, r in zip(cur, self.ref_state))

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
    hold: Any = False  # True: keep each call's output alive until the next call; "views": and views of 4 calls
    sync: Optional[Callable[[Any], None]] = None  # default: the device synchronisation
    extra: Dict[str, Any] = field(default_factory=dict)
    after: Optional[Callable[[], Dict[str, Any]]] = None  # more figures, read after timing
    state_error: Optional[float] = None  # stateful rows: the state after the check steps vs eager's


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

            # float32 matmuls like torch's (see set_precision): full precision, or TF32 with --tf32
            jax.config.update("jax_default_matmul_precision", "tensorfloat32" if PRECISION["tf32"] else "highest")
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


def _gt_prepare(ctx: Ctx, new_tensors: bool, held: Any, fuse: bool = False) -> Prepared:
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


def method_gt_views(ctx: Ctx) -> Prepared:
    return _gt_prepare(ctx, new_tensors=False, held="views")


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
    "gt_views": method_gt_views,
    "gt_fused": method_gt_fused,
}

# --------------------------------------------------------------------------
# Stateful rows (Workload.factory): every column gets its own Instance, built
# from the same initial state, and its check is the row's `steps` calls in
# order (input set k at call k), each call's outputs against eager's call k,
# then the state against eager's. The timed calls that follow go on updating
# that column's own state (training goes on; the decode step rewrites its slot).
# --------------------------------------------------------------------------


def run_steps(ctx: Ctx, step: Callable[[int], Any], ks: Any) -> tuple:
    """Call step(k) for k in ks, comparing each output with eager's call k.
    Returns (errors, first call's seconds, second call's seconds)."""
    errors: List[float] = []
    times: List[float] = []
    for k in ks:
        out, t = timed_first_call(ctx, lambda k=k: step(k))
        times.append(t)
        errors.append(ctx.err(out, k))
        del out
    return errors, (times[0] if times else None), (times[1] if len(times) > 1 else None)


def st_eager(ctx: Ctx) -> Prepared:
    inst = ctx.instance()
    sets = ctx.sets
    errors, first, _ = run_steps(ctx, lambda k: inst.fn(*sets[k]), range(len(sets)))
    a0 = sets[0]
    return Prepared(lambda: inst.fn(*a0), errors, first, state_error=ctx.state_err(inst))


def _st_hand_graph(ctx: Ctx) -> Dict[str, Any]:
    """torch's documented whole-network capture: warm-up steps on a side
    stream (real steps: inputs 0..W-1), capture of step W, replays."""
    cache = getattr(ctx, "_hand_graph", None)
    if cache is not None:
        return cache
    if not ctx.cuda:
        raise Skipped("CUDA only")
    sets = ctx.sets
    inst = ctx.instance()
    W = min(3, len(sets) - 1)
    m0 = ctx.mem()
    t0 = perf_counter()
    static = clone_args(sets[0])
    outs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(W):
            copy_into(static, sets[k])
            outs.append(tree_map_tensors(lambda t: t.detach().clone(), inst.fn(*static)))
    torch.cuda.current_stream().wait_stream(side)
    copy_into(static, sets[W])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = inst.fn(*static)
    ctx.sync()
    setup = perf_counter() - t0
    errors = [ctx.err(o, k) for k, o in enumerate(outs)]
    del outs
    for k in range(W, len(sets)):
        if k > W:
            copy_into(static, sets[k])
        g.replay()
        errors.append(ctx.err(static_out, k))
    cache = {"graph": g, "static": static, "static_leaves": tree_tensors(static), "out": static_out,
             "setup_s": setup, "memory": Ctx.mem_delta(m0, ctx.mem()), "errors": errors,
             "state_error": ctx.state_err(inst), "inst": inst}
    ctx._hand_graph = cache
    return cache


def st_graph_copy(ctx: Ctx) -> Prepared:
    hg = _st_hand_graph(ctx)
    g, static_leaves, static_out = hg["graph"], hg["static_leaves"], hg["out"]
    it = itertools.cycle([tree_tensors(s) for s in ctx.sets])

    def call():
        for d, s in zip(static_leaves, next(it)):
            d.copy_(s)
        g.replay()
        return static_out

    return Prepared(call, list(hg["errors"]), hg["setup_s"], state_error=hg["state_error"],
                    extra={"memory": hg["memory"], "first_call_is": f"warm-up ({min(3, len(ctx.sets) - 1)} steps) + capture"})


def st_graph_replay(ctx: Ctx) -> Prepared:
    hg = _st_hand_graph(ctx)
    g, static_out = hg["graph"], hg["out"]

    def call():
        g.replay()
        return static_out

    return Prepared(call, list(hg["errors"]), hg["setup_s"], state_error=hg["state_error"],
                    extra={"memory": hg["memory"], "first_call_is": f"warm-up ({min(3, len(ctx.sets) - 1)} steps) + capture"})


def st_mgc(ctx: Ctx) -> Prepared:
    if not ctx.w.mgc:
        raise NotApplicable("not applicable")
    if not ctx.cuda:
        raise Skipped("CUDA only")
    inst = ctx.instance()
    own = clone_args(ctx.sets[0])  # make_graphed_callables writes into its sample inputs
    m0 = ctx.mem()

    def build_and_step():
        nonlocal gf
        if inst.mgc_module is not None:  # the module's forward is replaced; inst.fn calls it
            sample = inst.mgc_args(own) if inst.mgc_args else own
            torch.cuda.make_graphed_callables(inst.mgc_module, sample)
            gf = inst.fn
        else:
            gf = torch.cuda.make_graphed_callables(inst.fn, own)
        return gf(*own)

    gf: Any = None
    out, first = timed_first_call(ctx, build_and_step)
    errors = [ctx.err(out, 0)]
    del out
    mem = Ctx.mem_delta(m0, ctx.mem())

    def step(k):
        copy_into(own, ctx.sets[k])
        return gf(*own)

    more, _, _ = run_steps(ctx, step, range(1, len(ctx.sets)))
    return Prepared(lambda: gf(*own), errors + more, first, state_error=ctx.state_err(inst),
                    extra={"memory": mem, "first_call_is": "make_graphed_callables + first call"})


def st_compile(ctx: Ctx) -> Prepared:
    if not ctx.w.compile_ok:
        raise NotApplicable("not applicable")
    if not ctx.cuda and not ctx.opts.cpu_compile:
        raise Skipped("slow on CPU (--cpu-compile runs it)")
    inst = ctx.instance()
    own = clone_args(ctx.sets[0])
    m0 = ctx.mem()
    cf = torch.compile(inst.fn, mode="reduce-overhead")

    def step(k):
        copy_into(own, ctx.sets[k])
        return cf(*own)

    # cudagraph trees: call 1 warms up, call 2 records, later calls replay: the steps cover all three
    errors, first, second = run_steps(ctx, step, range(len(ctx.sets)))
    mem = Ctx.mem_delta(m0, ctx.mem())
    return Prepared(lambda: cf(*own), errors, first, state_error=ctx.state_err(inst),
                    extra={"memory": mem, "second_call_s": second, "first_call_is": "compile + first call"})


def _st_gt(ctx: Ctx, new_tensors: bool, held: Any, fuse: bool = False) -> Prepared:
    inst = ctx.instance()
    f = gt.graphify(inst.fn, fuse=fuse)
    m0 = ctx.mem()
    extra: Dict[str, Any] = {"first_call_is": "trace + record + first call"}
    if new_tensors:
        sets = ctx.sets
        errors, first, second = run_steps(ctx, lambda k: f(*sets[k]), range(len(sets)))
        it = itertools.cycle(sets)

        def call():
            return f(*next(it))
    else:
        own = clone_args(ctx.sets[0])

        def step(k):
            copy_into(own, ctx.sets[k])  # the same tensors, new values: gt must see them
            return f(*own)

        errors, first, second = run_steps(ctx, step, range(len(ctx.sets)))

        def call():
            return f(*own)

    extra["memory"] = Ctx.mem_delta(m0, ctx.mem())
    extra["second_call_s"] = second
    return Prepared(call, errors, first, hold=held, extra=extra, state_error=ctx.state_err(inst),
                    after=lambda: {"cache_info": f.cache_info()._asdict()})


def st_jax(ctx: Ctx) -> Prepared:
    raise NotApplicable("not written (stateful torch program)")


STATEFUL_METHOD_FNS: Dict[str, Callable[[Ctx], Prepared]] = {
    "eager": st_eager,
    "graph_copy": st_graph_copy,
    "graph_replay": st_graph_replay,
    "mgc": st_mgc,
    "compile": st_compile,
    "jax": st_jax,
    "gt_same": lambda ctx: _st_gt(ctx, new_tensors=False, held=False),
    "gt_new": lambda ctx: _st_gt(ctx, new_tensors=True, held=False),
    "gt_held": lambda ctx: _st_gt(ctx, new_tensors=False, held=True),
    "gt_views": lambda ctx: _st_gt(ctx, new_tensors=False, held="views"),
    "gt_fused": lambda ctx: _st_gt(ctx, new_tensors=False, held=False, fuse=True),
}


def grad_mode(w: Workload) -> Any:
    return torch.no_grad() if w.no_grad else contextlib.nullcontext()


# --------------------------------------------------------------------------
# Compile caches: every column starts cold
# --------------------------------------------------------------------------

# Per-column TorchInductor/Triton cache directories live under this root
# (removed at exit). None: the user set TORCHINDUCTOR_CACHE_DIR, and every
# column shares it (to measure warm-cache compiles on purpose).
_CACHE_ROOT: Optional[str] = None


def clear_compile_memory() -> None:
    """Forget what this process compiled: dynamo's code caches, inductor's
    in-memory caches (loaded kernel modules, compiled Triton kernels) and
    fuse=True's own matrix-product kernel (a Triton JIT function keeps the
    kernels it built in memory: a row would reuse another row's, write nothing
    to its own cache directory, and its warm-cache process would compile
    them), so the next compile reads only the (fresh or reused) cache directory."""
    gemm = sys.modules.get("gtransform.fuse._gemm")
    if gemm is not None:
        gemm._kernel.cache_clear()
    if "torch._dynamo" in sys.modules:
        try:
            torch._dynamo.reset()
        except Exception:
            pass
    if "torch._inductor.utils" in sys.modules:
        u = sys.modules["torch._inductor.utils"]
        clear = getattr(u, "clear_caches", None) or getattr(u, "clear_inductor_caches", None)
        if clear is not None:
            try:
                clear()
            except Exception:
                pass


@contextlib.contextmanager
def compile_caches(label: str, reuse: Optional[str] = None):
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for one column: a new empty
    directory (cold), or `reuse` (the warm-cache measurement). Yields the dir."""
    if _CACHE_ROOT is None and reuse is None:
        yield os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return
    d = reuse or tempfile.mkdtemp(prefix=label.replace("/", "_") + "-", dir=_CACHE_ROOT)
    keys = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    old = {k: os.environ.get(k) for k in keys}
    clear_compile_memory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    os.environ["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
    try:
        yield d
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v



# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def _a_view(out: Any) -> Optional[torch.Tensor]:
    """A view of the first tensor output (what `history.append(out[0])` keeps).

    Reached by indexing, as the user's loop would (`out[0]`, `out["k"]`): a generic pytree
    walk here would cost several us per call (32 leaves: ~10 us) and be charged to the
    "views" column.
    """
    while not isinstance(out, torch.Tensor):
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        elif isinstance(out, dict) and out:
            out = next(iter(out.values()))
        else:
            for leaf in torch.utils._pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    return leaf.unsqueeze(0)
            return None
    return out.unsqueeze(0)


def run_calls(call: Callable[[], Any], n: int, hold: Any) -> Any:
    if hold == "views":
        history: List[Any] = []
        out = None
        for _ in range(n):
            out = call()
            history.append(_a_view(out))
            if len(history) > 4:
                del history[0]
        return out
    if hold:
        out = None
        for _ in range(n):
            out = call()
        return out
    for _ in range(n):
        call()
    return None


def calls_per_repeat(p: Prepared, ctx: Ctx, opts: argparse.Namespace) -> int:
    """Warm ``p`` up and choose N, the calls per timed repeat (about opts.target_s of wall time)."""
    sync = p.sync or ctx.sync
    for _ in range(3):  # warm-up
        sync(run_calls(p.call, 1, True))
    if p.hold == "views":  # the output generations the held views need, made before timing
        sync(run_calls(p.call, 8, p.hold))
    t0 = perf_counter()
    sync(run_calls(p.call, 3, p.hold))
    est = max((perf_counter() - t0) / 3, 1e-7)
    return int(min(max(opts.target_s / est, opts.min_calls), opts.max_calls))


def time_block(p: Prepared, ctx: Ctx, n: int) -> float:
    """Seconds per call of one repeat: N calls and one synchronisation."""
    sync = p.sync or ctx.sync
    sync(None)
    t0 = perf_counter()
    out = run_calls(p.call, n, p.hold)
    sync(out)
    return (perf_counter() - t0) / n


def timing_summary(times: List[float], n: int) -> Dict[str, Any]:
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


def time_method(p: Prepared, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Median seconds per call over repeats of N calls + one synchronisation."""
    n = calls_per_repeat(p, ctx, opts)
    gc.collect()
    return timing_summary([time_block(p, ctx, n) for _ in range(opts.repeats)], n)


INTERLEAVED = ("graph_replay", "gt_same", "gt_held", "gt_views")
"""Columns whose ratios are targets (gt ÷ floor, views ÷ held): timed in turn, repeat by repeat.

On the lent GPU hosts the host's speed drifts within a process: the same torch call
(`fill_`, `cudaLaunchKernel`) was seen to cost 2.5x more from one second to the next
(benchmarks/NOTES.md). Host-bound rows timed column after column then compare different
moments of the host, not the columns; timed in turn, each drift falls on all of them.

torch.compile's column is not among them: timed in turn with CUDA graphs replayed between
its calls, its CUDA graph trees left the process with an illegal memory access by the next
row (torch 2.11, H100; jax.jit and fuse=True in turn were fine; NOTES, thirteenth session).
Its ratio to fuse=True is timed one column after the other; `benchmarks/_probe_llama.py`
times the two in turn on the row where they are closest.
"""


def time_interleaved(ctx: Ctx, wr: Dict[str, Any], opts: argparse.Namespace) -> None:
    """Time the kept INTERLEAVED columns of one row in turn (see INTERLEAVED); fill their cells."""
    kept = ctx.kept
    if not kept:
        return
    names = [m for m in INTERLEAVED if m in kept]
    times: Dict[str, List[float]] = {m: [] for m in names}
    gc.collect()
    rounds = opts.repeats if opts.quick else max(opts.repeats, 15)
    with grad_mode(ctx.w):
        for r in range(rounds):
            k = r % len(names)
            for m in names[k:] + names[:k]:  # each column first in turn
                if m not in kept:
                    continue
                p, n = kept[m]
                try:
                    times[m].append(time_block(p, ctx, n))
                except Exception as e:
                    cell = wr["cells"][m]
                    cell.update(status="error", error=short_error(e), traceback=traceback.format_exc(limit=8))
                    del kept[m]
        for m in names:
            if m not in kept:
                continue
            p, n = kept.pop(m)
            cell = wr["cells"][m]
            cell.update(timing_summary(times[m], n))
            cell["timed"] = "in turn with " + ", ".join(x for x in names if x != m)
            if p.after is not None:
                cell.update(p.after())
            cell["status"] = "ok"
    kept.clear()


def short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]


def run_cell(method: str, ctx: Ctx, opts: argparse.Namespace) -> Dict[str, Any]:
    """Build, check and time one method on one workload; never raises."""
    w = ctx.w
    if w.only_methods is not None and method not in w.only_methods:
        return {"status": "n/a", "reason": w.note or "not run on this row"}
    if not ctx.cuda and method in CUDA_ONLY:
        return {"status": "skipped", "reason": "CUDA only"}
    cell: Dict[str, Any] = {"tol": w.tol}
    if w.factory is not None and w.state_tol is not None:
        cell["state_tol"] = w.state_tol
    try:
        fns = STATEFUL_METHOD_FNS if w.factory is not None else METHOD_FNS
        # every column compiles with cold caches: its own new TorchInductor/Triton cache directory
        with compile_caches(f"{w.name}.{method}") as cache_dir, grad_mode(w):
            cell["cache_dir"] = cache_dir
            p = fns[method](ctx)
            cell["rel_err"] = max(p.errors) if p.errors else None
            cell["rel_errs"] = p.errors
            cell["check_ok"] = bool(p.errors) and all(e <= w.tol for e in p.errors)
            if p.state_error is not None:
                cell["state_rel_err"] = p.state_error
                cell["check_ok"] = cell["check_ok"] and p.state_error <= w.state_tol
            cell["first_call_s"] = p.first_call_s
            cell.update(p.extra)
            if method in INTERLEAVED:  # timed with the row's other such columns (time_interleaved)
                ctx.kept[method] = (p, calls_per_repeat(p, ctx, opts))
                cell["status"] = "pending"
            else:
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
    if "gt_fused" in methods:  # loads inductor (and its compile workers) for the fused path
        gf = gt.graphify(lambda a: (a @ a).relu() * 2, fuse=True)
        timed("gtransform fuse=True", lambda: [gf(x) for _ in range(3)])
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
            st = (f"; state (updates) rel err {cell['state_rel_err']:.2e}, tol {cell['state_tol']:.0e}"
                  if cell.get("state_rel_err") is not None else "")
            notes.append(f"{where}: result differs from eager, rel err {cell.get('rel_err'):.2e} (tol {cell['tol']:.0e})"
                         + st)
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
    by_reason: Dict[str, List[str]] = {}
    for name, wr in wls.items():
        cols = [m for m, c in wr["cells"].items() if c["status"] == "skipped"]
        if cols and len(cols) == len(wr["cells"]):  # the whole row
            by_reason.setdefault(str(wr["cells"][cols[0]].get("reason")), []).append(f"row {name}")
            continue
        for m in cols:
            r = str(wr["cells"][m].get("reason"))
            if m not in by_reason.setdefault(r, []):
                by_reason[r].append(m)
    foot = []
    if by_reason:
        foot.append("skipped: " + "; ".join(f"{', '.join(v)}: {r}" for r, v in by_reason.items()))
    foot += [f"- {name}: {wr['note']}" for name, wr in wls.items() if wr.get("note")]
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
    warm_methods = [m for m in methods if any("first_call_warm_s" in wr["cells"].get(m, {})
                                              or "first_call_warm_error" in wr["cells"].get(m, {})
                                              for wr in wls.values())]
    extra_heads = ["gt same: 2nd call"] + (["gt fuse=True: 2nd call"] if "gt_fused" in methods else []) \
        + [f"{ {'gt_fused': 'gt fuse=True', 'compile': 'torch.compile'}.get(m, METHODS[m]) }: warm caches, 2nd process"
           for m in warm_methods]
    lines = ["| workload | " + " | ".join(heads[m] for m in fc) + " | " + " | ".join(extra_heads) + " |",
             "|---|" + "---|" * (len(fc) + len(extra_heads))]
    warm_notes: List[str] = []
    for name, wr in wls.items():
        row = []
        for m in fc:
            c = wr["cells"][m]
            row.append(f"{c['first_call_s']:.3f}" if c["status"] == "ok" and c.get("first_call_s") is not None else "")
        for m in ("gt_same", "gt_fused")[: 2 if "gt_fused" in methods else 1]:
            sc = wr["cells"].get(m, {})
            row.append(f"{sc['second_call_s']:.3f}" if sc.get("status") == "ok" and sc.get("second_call_s") is not None
                       else "")
        for m in warm_methods:
            c = wr["cells"].get(m, {})
            if c.get("first_call_warm_s") is not None:
                row.append(f"{c['first_call_warm_s']:.3f}")
            elif c.get("first_call_warm_error"):
                row.append("error")
                warm_notes.append(f"- {name} / {m} (warm): {c['first_call_warm_error']}")
            else:
                row.append("")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    wp = results.get("warm_process") or {}
    warm_txt = ""
    if warm_methods:
        warm_txt = (" Warm caches: the same cells rebuilt in a second process (a fresh interpreter, one for all rows) "
                    "reusing each cell's TorchInductor/Triton cache directory from this run; that process's own "
                    "one-time costs: " + ", ".join(f"{k} {v:.2f} s" for k, v in (wp.get("process_warmup_s") or {}).items())
                    + (f"; it took {wp['seconds']:.0f} s in all" if wp.get("seconds") else "") + ".")
    tables["first_call"] = (
        "First call, seconds (eager: first call; CUDA graph: warm-up + capture; make_graphed_callables: it + "
        "first call; torch.compile: compile + first call; jax: trace + compile + first call; gt: trace + record "
        "+ first call; gt's second call with the same tensors re-records to read them in place). Every column "
        "compiles with cold caches (its own new cache directory, in-memory compile caches cleared). One-time "
        "process costs, paid before the first workload: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in results["process_warmup_s"].items()) + "." + warm_txt
        + "\n\n" + "\n".join(lines) + ("\n\n" + "\n".join(warm_notes) if warm_notes else ""))

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
    "gt_views": "gt: views of 4 calls held",
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
    for mod in ("transformers", "torchvision"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception:
            meta[mod] = None
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


def set_precision(tf32: bool) -> Dict[str, Any]:
    """float32 precision for every column, set once before anything runs.

    Through the legacy switches (torch.backends.cuda.matmul.allow_tf32,
    torch.backends.cudnn.allow_tf32) and set_float32_matmul_precision, which
    torch 2.9+ maps onto its new fp32_precision flags (read by inductor): using
    the new flags directly makes any later read of the legacy ones (by a library)
    raise. torch's own defaults differ between matmuls (no TF32) and cuDNN
    convolutions (TF32), hence both are set. jax: see import_jax."""
    PRECISION["tf32"] = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    got: Dict[str, Any] = {"tf32": tf32, "float32_matmul_precision": torch.get_float32_matmul_precision(),
                           "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                           "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                           "jax_default_matmul_precision": "tensorfloat32" if tf32 else "highest"}
    for name, obj in (("cuda.matmul.fp32_precision", getattr(torch.backends.cuda, "matmul", None)),
                      ("cudnn.conv.fp32_precision", getattr(torch.backends.cudnn, "conv", None))):
        try:
            got[name] = obj.fp32_precision
        except Exception:
            pass
    return got


def precision_text(p: Dict[str, Any]) -> str:
    if p.get("tf32"):
        return ("float32 precision: TF32 in every column (--tf32: cuda.matmul.allow_tf32 = cudnn.allow_tf32 = True, "
                "set_float32_matmul_precision('high'), jax_default_matmul_precision 'tensorfloat32')")
    return ("float32 precision: full (IEEE) in every column, no TF32: torch.backends.cuda.matmul.allow_tf32 = "
            "torch.backends.cudnn.allow_tf32 = False (torch defaults cuDNN convolutions to TF32), "
            "set_float32_matmul_precision('highest'), jax_default_matmul_precision 'highest'")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="output directory (default: benchmarks/results)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter repeats")
    ap.add_argument("--only", default=None,
                    help="comma-separated workloads: chain, mlp, mlp_grad, dict32, transformer, rl, matmul, "
                         + ", ".join(REAL_ROWS) + "; or 'real' for the last seven, 'synthetic' for the first seven")
    ap.add_argument("--methods", default=None, help="comma-separated methods (columns): " + ", ".join(METHODS))
    ap.add_argument("--cpu-compile", action="store_true", help="on the CPU, also run torch.compile (slow)")
    ap.add_argument("--tf32", action="store_true",
                    help="TF32 for float32 matmuls and convolutions in every column (default: off everywhere)")
    ap.add_argument("--warm-methods", default="gt_fused",
                    help="columns whose first call is measured again with warm compile caches, in a second "
                         "process reusing each cell's cache directory (default: gt_fused; '' for none)")
    ap.add_argument("--warm-child", default=None, help=argparse.SUPPRESS)  # internal: the second process
    opts = ap.parse_args(argv)
    opts.repeats = 3 if opts.quick else 9
    opts.target_s = 0.01 if opts.quick else 0.05  # wall time per repeat
    opts.min_calls = 3
    opts.max_calls = 200 if opts.quick else 5000
    return opts


def select_workloads(device: torch.device, only: Optional[str]) -> List[Workload]:
    workloads = make_workloads(device)
    names = [w.name for w in workloads]
    if not only:
        return workloads
    want: List[str] = []
    for s in only.split(","):
        s = s.strip()
        if s == "real":
            want += list(REAL_ROWS)
        elif s == "synthetic":
            want += [n for n in names if n not in REAL_ROWS]
        elif s:
            want.append(s)
    bad = [s for s in want if s not in names]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {names}")
    return [w for w in workloads if w.name in want]


def build_ctx(w: Workload, device: torch.device, opts: argparse.Namespace) -> tuple:
    """(Ctx, None), or (None, cell) where every cell of the row is that cell."""
    try:
        return Ctx(w, device, opts), None
    except Skipped as e:
        return None, {"status": "skipped", "reason": str(e)}
    except Exception as e:  # eager itself fails: every cell reports it
        return None, {"status": "error", "error": "eager reference failed: " + short_error(e),
                      "traceback": traceback.format_exc(limit=8)}


def _compile_counters(reset: bool = False) -> Optional[Dict[str, int]]:
    """TorchInductor's and AOTAutograd's cache hit/miss/bypass counters (dynamo's ``counters``)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return None
    if reset:
        for group in ("inductor", "aot_autograd"):
            counters[group].clear()
        return {}
    return {f"{group}.{k}": int(v) for group in ("inductor", "aot_autograd")
            for k, v in counters[group].items() if "cache" in k or "bypass" in k}


def warm_child(opts: argparse.Namespace, device: torch.device) -> int:
    """The second process of the warm-cache measurement: for each (row,
    method, cache directory) of the spec, the method's first call again, with
    the compile caches the first process left in that directory."""
    with open(opts.warm_child) as fh:
        spec = json.load(fh)
    out: Dict[str, Any] = {"process_warmup_s": warm_up_process(device, ["gt_fused", "compile"], opts), "cells": []}
    rows = {w.name: w for w in make_workloads(device)}
    for item in spec["cells"]:
        w, m = rows[item["row"]], item["method"]
        rec: Dict[str, Any] = dict(item)
        ctx, err = build_ctx(w, device, opts)
        if ctx is None:
            rec["error"] = err.get("reason") or err.get("error")
        else:
            try:
                fns = STATEFUL_METHOD_FNS if w.factory is not None else METHOD_FNS
                counters = _compile_counters(reset=True)
                prof_dir = os.environ.get("GT_BENCH_WARM_PROFILE")  # diagnosis: cProfile each warm cell
                prof = cProfile.Profile() if prof_dir else None
                with compile_caches("warm", reuse=item["cache_dir"]), grad_mode(w):
                    if prof is not None:
                        prof.enable()
                    p = fns[m](ctx)
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(os.path.join(prof_dir, f"{w.name}.{m}.prof"))
                    rec["first_call_s"] = p.first_call_s
                    rec["second_call_s"] = p.extra.get("second_call_s")
                    rec["check_ok"] = bool(p.errors) and all(e <= w.tol for e in p.errors)
                    if counters is not None:  # which compile caches hit (a miss here is a compile)
                        rec["cache_counters"] = _compile_counters()
                    del p
            except Exception as e:
                rec["error"] = short_error(e)
            del ctx
        gc.collect()
        out["cells"].append(rec)
        print(f"[warm {w.name}] {m}: " + (f"first call {rec['first_call_s']:.3f} s" if rec.get("first_call_s")
                                           is not None else f"error: {rec.get('error')}")
              + (f", second {rec['second_call_s']:.3f} s" if rec.get("second_call_s") is not None else "")
              + (f"  caches {rec['cache_counters']}" if rec.get("cache_counters") else ""), flush=True)
    with open(spec["out"], "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    return 0


def measure_warm(results: Dict[str, Any], device: torch.device, opts: argparse.Namespace) -> None:
    """First calls with warm compile caches: one second process (a fresh
    interpreter: nothing compiled in memory) rebuilds each selected cell with
    the cache directory its cold first call filled. One process for all rows
    (its one-time costs are paid by a tiny function first and reported apart);
    between rows it clears dynamo's and inductor's in-memory caches."""
    methods = [m.strip() for m in (opts.warm_methods or "").split(",") if m.strip()]
    cells = [{"row": name, "method": m, "cache_dir": wr["cells"][m].get("cache_dir")}
             for name, wr in results["workloads"].items() for m in methods
             if wr["cells"].get(m, {}).get("status") == "ok" and wr["cells"][m].get("cache_dir")]
    if not cells:
        return
    tmp = tempfile.mkdtemp(prefix="gt-bench-warm-", dir=_CACHE_ROOT)
    spec = {"cells": cells, "out": os.path.join(tmp, "warm.json")}
    with open(os.path.join(tmp, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    cmd = [sys.executable, os.path.abspath(__file__), "--warm-child", os.path.join(tmp, "spec.json"),
           "--device", device.type] + (["--tf32"] if opts.tf32 else []) + (["--quick"] if opts.quick else []) \
        + (["--cpu-compile"] if opts.cpu_compile else [])
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    print(f"\nwarm compile caches: {len(cells)} cell(s) again in a second process", flush=True)
    t0 = perf_counter()
    try:
        r = subprocess.run(cmd, env=env, timeout=opts.warm_timeout, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: " + (r.stderr.strip().splitlines() or [""])[-1][:300])
        with open(spec["out"]) as fh:
            warm = json.load(fh)
    except Exception as e:
        msg = short_error(e)
        print(f"warm-cache process failed: {msg}", flush=True)
        results["warm_process"] = {"error": msg, "seconds": perf_counter() - t0}
        for c in cells:
            results["workloads"][c["row"]]["cells"][c["method"]]["first_call_warm_error"] = msg
        return
    results["warm_process"] = {"seconds": perf_counter() - t0, "process_warmup_s": warm["process_warmup_s"]}
    for rec in warm["cells"]:
        cell = results["workloads"][rec["row"]]["cells"][rec["method"]]
        if rec.get("first_call_s") is not None:
            cell["first_call_warm_s"] = rec["first_call_s"]
            cell["second_call_warm_s"] = rec.get("second_call_s")
            cell["warm_check_ok"] = rec.get("check_ok")
            if rec.get("cache_counters") is not None:
                cell["warm_cache_counters"] = rec["cache_counters"]
        else:
            cell["first_call_warm_error"] = rec.get("error")


def print_cell(row: str, m: str, cell: Dict[str, Any]) -> None:
    if cell["status"] == "ok":
        st = f" state {cell['state_rel_err']:.1e}" if cell.get("state_rel_err") is not None else ""
        msg = (f"{cell['us_median']:9.1f} us/call (±{100 * cell['spread']:.0f}%, n={cell['calls_per_repeat']})  "
               f"first {cell['first_call_s'] if cell['first_call_s'] is not None else float('nan'):.3f} s  "
               f"err {cell['rel_err']:.1e}{st}{'' if cell['check_ok'] else ' CHECK FAILED'}"
               f"{'  (timed in turn)' if 'timed' in cell else ''}")
    else:
        msg = cell["status"] + ": " + str(cell.get("reason") or cell.get("error"))
    print(f"[{row:11s}] {m:12s} {msg}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    global _CACHE_ROOT
    opts = parse_args(argv)
    opts.warm_timeout = 300
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("CUDA is not available: use --device cpu", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    precision = set_precision(opts.tf32)
    _CACHE_ROOT = _INDUCTOR_DIR
    if opts.warm_child:
        return warm_child(opts, device)
    workloads = select_workloads(device, opts.only)
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
    results["meta"]["precision"] = precision
    results["meta"]["compile_caches"] = (
        "cold per column: a new TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR for every cell, and dynamo's and "
        "inductor's in-memory caches cleared before it" if _CACHE_ROOT is not None else
        f"shared, as set by the user: TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR')}")
    print(f"gtransform benchmark on {results['meta']['device_name']} (torch {torch.__version__}, "
          f"jax {results['meta']['jax']}), {'quick' if opts.quick else 'full'} run\n{precision_text(precision)}",
          flush=True)
    with compile_caches("process-warm-up"):
        results["process_warmup_s"] = warm_up_process(device, methods, opts)

    for w in workloads:
        t_w = perf_counter()
        wr: Dict[str, Any] = {"title": w.title, "bf16": w.bf16, "cells": {}, "note": w.note}
        results["workloads"][w.name] = wr
        ctx, row_cell = build_ctx(w, device, opts)
        if ctx is None:
            wr["cells"] = {m: dict(row_cell) for m in methods}
            print(f"[{w.name}] {row_cell['status']}: {row_cell.get('reason') or row_cell.get('error')}", flush=True)
            continue
        pending = []
        for m in methods:
            cell = run_cell(m, ctx, opts)
            wr["cells"][m] = cell
            if cell["status"] == "pending":
                pending.append(m)
            else:
                print_cell(w.name, m, cell)
        time_interleaved(ctx, wr, opts)
        for m in pending:
            print_cell(w.name, m, wr["cells"][m])
        wr["seconds"] = perf_counter() - t_w
        del ctx
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    results["meta"]["main_s"] = perf_counter() - t_start
    measure_warm(results, device, opts)
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
                 f"transformers {m.get('transformers')}, torchvision {m.get('torchvision')}, "
                 f"gtransform {m['gtransform']} (git {m['git']}, sources {m['gtransform_src_sha256']}), {m['date']}, "
                 f"{'quick' if m['quick'] else 'full'} run, {m['total_s']:.0f} s.\n\n"
                 f"{precision_text(m['precision'])}. Compile caches: {m['compile_caches']}.\n\n")
        for key, title in (("per_call", "Per call"), ("targets", "Targets"), ("first_call", "First call"),
                           ("memory", "Memory")):
            fh.write(f"## {title}\n\n{tables[key]}\n\n")
    try:
        plot(results, png_path)
    except Exception as e:
        print(f"plot failed: {short_error(e)}", flush=True)
    print(f"\nwrote {json_path}, {md_path}, {png_path} in {results['meta']['total_s']:.0f} s\n", flush=True)
    print(tables["targets"] + "\n", flush=True)
    print(tables["first_call"] + "\n", flush=True)
    print(tables["per_call"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

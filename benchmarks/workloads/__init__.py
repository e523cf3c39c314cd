"""The rows of the benchmark, by family, and the list the command line picks from.

- `synthetic`: the seven rows of DESIGN.md's performance table (functions of their
  arguments, with a jax twin each).
- real programs (issues: resnet18, train_adam, gpt2, llama_decode, per_sample_grads,
  ensemble): `vision` (torchvision resnet18), `training` (an Adam training step),
  `language` (Hugging Face GPT-2 and a Llama decode step), `func_transforms`
  (per-sample gradients and an ensemble through torch.func). Random init, no downloads;
  a missing package makes the row "skipped: <reason>".
- `host` (issue #35: programs that read values on the host): torchdiffeq rk4 and dopri5,
  PyG GCN and GAT, GPT-2 greedy decoding with a StaticCache, a training loop logging
  `loss.item()`, an RL episode stopping when done (`host.py`).
"""

from __future__ import annotations

from typing import List

import torch

from ..core import Workload
from .func_transforms import (
    ENS_BATCH,
    ENS_MODELS,
    ENS_SIZES,
    PSG_BATCH,
    PSG_SIZES,
    ens_args,
    ens_fn,
    ens_jax,
    psg_args,
    psg_fn,
    psg_jax,
)
from .host import (
    GREEDY_EMBD,
    GREEDY_LAYERS,
    GREEDY_NEW,
    HOST_METHODS,
    LOG_EVERY,
    LOG_SIZES,
    LOG_STEPS,
    ODE_BATCH,
    ODE_DIM,
    ODE_HIDDEN,
    ODE_POINTS,
    PYG_EDGES,
    PYG_NODES,
    RL_MAX_T,
    gat_factory,
    gcn_factory,
    gpt2_greedy_args,
    gpt2_greedy_factory,
    ode_args,
    ode_dopri5_factory,
    ode_rk4_factory,
    pyg_args,
    rl_episode_args,
    rl_episode_factory,
    train_log_args,
    train_log_factory,
)
from .language import (
    GPT2_B,
    GPT2_EMBD,
    GPT2_LAYERS,
    GPT2_T,
    LLAMA_CFG,
    LLAMA_MAX_LEN,
    LLAMA_PROMPT,
    LLAMA_STEPS,
    gpt2_args,
    gpt2_factory,
    gpt2_module_factory,
    llama_args_factory,
    llama_factory,
)
from .synthetic import (
    CHAIN_OPS,
    chain_args,
    chain_fn,
    chain_jax,
    dict_args,
    dict_fn,
    dict_jax,
    matmul_args_factory,
    matmul_fn,
    matmul_jax,
    mlp_args,
    mlp_fn,
    mlp_grad_fn,
    mlp_grad_jax,
    mlp_jax,
    rl_args,
    rl_check,
    rl_fn,
    rl_jax,
    transformer_args,
    transformer_fn,
    transformer_jax,
)
from .training import ADAM_BATCH, ADAM_SIZES, train_adam_args, train_adam_factory
from .vision import resnet18_args, resnet18_factory

REAL_ROWS = ("resnet18", "train_adam", "gpt2", "gpt2_module", "llama_decode", "per_sample_grads", "ensemble")
HOST_ROWS = ("ode_rk4", "ode_dopri5", "gcn", "gat", "gpt2_greedy", "train_log", "rl_episode")


def host_workloads() -> List[Workload]:
    """Issue #35's programs that read values on the host (`--only host`): stateful rows, the
    columns of HOST_METHODS only."""
    field = f"MLP field {ODE_DIM}-{ODE_HIDDEN}-{ODE_DIM}, batch {ODE_BATCH}"
    kw = dict(only_methods=HOST_METHODS, host_reads=True, no_grad=True)
    return [
        Workload("ode_rk4", f"torchdiffeq odeint rk4, {ODE_POINTS - 1} steps on a fixed grid, {field}", None, ode_args,
                 factory=ode_rk4_factory, steps=4, **kw,
                 note="reads of the closed-over grid only: frozen (one recording) by default"),
        Workload("ode_dopri5", f"torchdiffeq odeint dopri5 (adaptive, rtol 1e-5), {field}", None, ode_args,
                 factory=ode_dopri5_factory, steps=4, **kw,
                 note="step acceptance reads the call's own data: needs on_break=split"),
        Workload("gcn", f"PyG 2-layer GCNConv, {PYG_NODES} nodes, {PYG_EDGES} edges (fixed graph)", None, pyg_args,
                 factory=gcn_factory, steps=4, **kw,
                 note="the self-loop mask of the closed-over edge_index (nonzero): frozen by default"),
        Workload("gat", f"PyG 2-layer GATConv (4 heads), {PYG_NODES} nodes, {PYG_EDGES} edges (fixed graph)", None,
                 pyg_args, factory=gat_factory, steps=4, **kw,
                 note="the self-loop mask of the closed-over edge_index (nonzero): frozen by default"),
        Workload("gpt2_greedy", f"HF GPT-2 ({GREEDY_LAYERS} layers, d {GREEDY_EMBD}) greedy decoding, StaticCache, "
                 f"up to {GREEDY_NEW} tokens (one call = one generation)", None, gpt2_greedy_args,
                 factory=gpt2_greedy_factory, steps=3, **kw,
                 note=f"the eos check reads each token (split); µs per token = µs per call / {GREEDY_NEW} "
                      "(eos is not reached with these weights)"),
        Workload("train_log", f"{LOG_STEPS} Adam steps of an MLP {'-'.join(map(str, LOG_SIZES))} per call, "
                 f"loss.item() logged every {LOG_EVERY}", None, train_log_args, factory=train_log_factory, steps=3,
                 only_methods=HOST_METHODS, host_reads=True,
                 note="loss.item() (and, on the CPU, Adam's step count) read on the host: split; check: the last "
                      "loss of each call and the parameter updates"),
        Workload("rl_episode", f"cart-pole episode, greedy 4-64-2 policy, until done (at most {RL_MAX_T} steps; "
                 "one call = one episode)", None, rl_episode_args, factory=rl_episode_factory, steps=4, **kw,
                 note="done.item() every step: split"),
    ]


def make_workloads(device: torch.device) -> List[Workload]:
    """Every row, in the tables' order (synthetic first, then the real programs)."""
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
        *host_workloads(),
    ]

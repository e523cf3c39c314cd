"""Real programs built from torch.func: per-sample gradients (vmap of grad) and an ensemble
of MLPs (vmap of functional_call over stacked parameters, torch's model-ensembling recipe).
Both have a jax.vmap twin for the jax.jit column."""

from __future__ import annotations

import torch

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

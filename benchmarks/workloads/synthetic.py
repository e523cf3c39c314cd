"""The seven synthetic rows of DESIGN.md's performance table.

Each row is a function of its arguments alone (parameters passed in, no state), written
twice: in torch, and in jax.numpy for the jax.jit column. The sizes are fixed here so that
every session's figures compare: a chain of 200 elementwise ops, an 8-layer MLP and its
gradient, a dict of 32 tensors, a bf16 transformer block, an RL policy step, and a bf16
matmul large enough to be compute-bound.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..trees import rel_err

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

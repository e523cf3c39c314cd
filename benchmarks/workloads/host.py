"""Programs that read values on the host (issue #35): `--only host`.

Each row is a stateful program (`Workload.factory`: every column builds its own copy from
the same seed) whose Python reads tensor values:

- `ode_rk4`: torchdiffeq `odeint(func, y0, t, method="rk4")`, 20 steps on a fixed grid
  closed over; the reads are of the grid only (frozen: one recording);
- `ode_dopri5`: the same field, adaptive dopri5: step acceptance reads the call's own data
  (split);
- `gcn`, `gat`: PyG 2-layer GCNConv / GATConv on a fixed random graph (500 nodes, 4000
  edges) closed over: the self-loop masks of `edge_index` (`nonzero`) are frozen;
- `gpt2_greedy`: HF GPT-2 greedy decoding with a StaticCache: prefill, then up to
  `GREEDY_NEW` tokens, stopping at eos (`tok.item()` each token: split); one call is one
  whole generation;
- `train_log`: 10 Adam steps of an MLP per call, logging `loss.item()` every 10 steps (on the
  CPU Adam also reads its step count: split);
- `rl_episode`: a cart-pole episode from a start state, a greedy MLP policy, stopping when
  `done.item()` (split); one call is one episode.

The columns (`HOST_METHODS`): eager, torch.compile reduce-overhead, gt default (frozen reads),
gt `on_break="split"`, `torch.compile(backend="gtransform")`, gt `fuse=True` (frozen reads; the
split rows report the error the default raises), gt `on_break="split", fuse=True` (each piece
compiled by inductor, as torch.compile's are). Until the frozen-reads and
graph-break features land, the gt columns report the error they raise.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import Instance, need, seeded

HOST_METHODS = ("eager", "compile", "gt_same", "gt_split", "compile_gt", "gt_fused", "gt_split_fused")

# torchdiffeq: a small MLP vector field ----------------------------------------------------

ODE_DIM, ODE_HIDDEN, ODE_BATCH, ODE_POINTS = 16, 64, 64, 21


class _ODEFunc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ODE_DIM, ODE_HIDDEN), nn.Tanh(), nn.Linear(ODE_HIDDEN, ODE_DIM))

    def forward(self, t, y):
        return self.net(y)


def _ode_factory(method, **kw):
    def factory(dev):
        tdq = need("torchdiffeq")
        seeded()
        func = _ODEFunc().to(dev)
        t = torch.linspace(0, 1, ODE_POINTS, device=dev)

        def solve(y0):
            return tdq.odeint(func, y0, t, method=method, **kw)

        return Instance(solve, keep=(func, t))

    return factory


ode_rk4_factory = _ode_factory("rk4")
ode_dopri5_factory = _ode_factory("dopri5", rtol=1e-5, atol=1e-7)


def ode_args(dev):
    return (torch.randn(ODE_BATCH, ODE_DIM, device=dev),)


# PyG: 2-layer GCN and GAT on a fixed random graph --------------------------------------------

PYG_NODES, PYG_EDGES, PYG_FEAT = 500, 4000, 16


def _pyg_factory(conv):
    def factory(dev):
        pyg_nn = need("torch_geometric.nn", "PyTorch Geometric")
        seeded()
        if conv == "gcn":
            c1, c2, act = pyg_nn.GCNConv(PYG_FEAT, 32), pyg_nn.GCNConv(32, 8), F.relu
        else:
            c1, c2, act = pyg_nn.GATConv(PYG_FEAT, 8, heads=4), pyg_nn.GATConv(32, 8, heads=1), F.elu
        c1, c2 = c1.to(dev).eval(), c2.to(dev).eval()
        g = torch.Generator().manual_seed(1)
        edge_index = torch.randint(0, PYG_NODES, (2, PYG_EDGES), generator=g).to(dev)  # the same object every call

        def forward(x):
            return c2(act(c1(x, edge_index)), edge_index)

        return Instance(forward, keep=(c1, c2, edge_index))

    return factory


gcn_factory = _pyg_factory("gcn")
gat_factory = _pyg_factory("gat")


def pyg_args(dev):
    return (torch.randn(PYG_NODES, PYG_FEAT, device=dev),)


# HF GPT-2 greedy decoding with a StaticCache ----------------------------------------------------

GREEDY_LAYERS, GREEDY_EMBD, GREEDY_PROMPT, GREEDY_NEW = 4, 256, 16, 32


def gpt2_greedy_factory(dev):
    tr = need("transformers")
    seeded()
    cfg = tr.GPT2Config(n_layer=GREEDY_LAYERS, n_embd=GREEDY_EMBD, n_head=4, n_positions=128)  # eos: 50256
    model = tr.GPT2LMHeadModel(cfg).eval().to(dev)
    cache = tr.StaticCache(config=model.config, max_cache_len=GREEDY_PROMPT + GREEDY_NEW)
    eos = cfg.eos_token_id

    def generate(prompt):
        cache.reset()
        tok = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out = [tok]
        for i in range(GREEDY_NEW - 1):
            if tok.item() == eos:
                break
            pos = torch.full((1, 1), GREEDY_PROMPT + i, device=prompt.device)
            tok = model(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(tok)
        return torch.cat(out, 1)

    return Instance(generate, keep=(model, cache))


def gpt2_greedy_args(dev):
    return (torch.randint(0, 50256, (1, GREEDY_PROMPT), device=dev),)


# A training loop that logs loss.item() every 10 steps ------------------------------------------

LOG_SIZES, LOG_BATCH, LOG_STEPS, LOG_EVERY = (32, 128, 128, 1), 64, 10, 10


def train_log_factory(dev):
    seeded()
    layers = []
    for i in range(len(LOG_SIZES) - 1):
        layers.append(nn.Linear(LOG_SIZES[i], LOG_SIZES[i + 1]))
        if i < len(LOG_SIZES) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).to(dev)
    # capturable on CUDA (the step count on the device); on the CPU Adam reads its step count on the host
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=dev.type == "cuda")
    log = []

    def train(xs, ys):
        for i in range(LOG_STEPS):
            opt.zero_grad()
            loss = F.mse_loss(model(xs[i]), ys[i])
            loss.backward()
            opt.step()
            if i % LOG_EVERY == 0:
                log.append(loss.item())
        return loss

    return Instance(train, state=lambda: [p for p in model.parameters()], keep=(model, opt, log))


def train_log_args(dev):
    return (torch.randn(LOG_STEPS, LOG_BATCH, LOG_SIZES[0], device=dev),
            torch.randn(LOG_STEPS, LOG_BATCH, LOG_SIZES[-1], device=dev))


# An RL episode in a cart-pole torch environment ------------------------------------------------

RL_MAX_T = 200


def cartpole_step(s, action):
    """Cart-pole dynamics (Barto, Sutton & Anderson), an Euler step of 0.02 s; s = (x, x_dot, theta, theta_dot)."""
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass, polemass_length = masscart + masspole, masspole * length
    x, x_dot, theta, theta_dot = s.unbind(-1)
    force = torch.where(action == 1, force_mag, -force_mag)
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + polemass_length * theta_dot**2 * sin) / total_mass
    theta_acc = (gravity * sin - cos * temp) / (length * (4.0 / 3.0 - masspole * cos**2 / total_mass))
    x_acc = temp - polemass_length * theta_acc * cos / total_mass
    s = torch.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc], -1)
    done = (s[..., 0].abs() > 2.4) | (s[..., 2].abs() > 12 * 2 * math.pi / 360)
    return s, done


def rl_episode_factory(dev):
    seeded()
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).to(dev)

    def episode(s):
        states = [s]
        for _ in range(RL_MAX_T):
            s, done = cartpole_step(s, policy(s).argmax(-1))
            states.append(s)
            if done.item():
                break
        return torch.stack(states)

    return Instance(episode, keep=policy)


def rl_episode_args(dev):
    return (torch.rand(4, device=dev) * 0.1 - 0.05,)

"""Real programs that read values on the host (issue #35), written as their users write them
and compared with eager call by call.

Two features make them run (see docs/host-reads.md):

- **frozen host reads**: a host read (``.item()``, ``assert (t[1:] > t[:-1]).all()``, ``while
  t1 >= t[j]``) or a data-dependent shape (``nonzero``, boolean indexing) that depends only on
  tensors that are the same objects every call and not written becomes a constant of the
  ordinary recording, guarded by identity and version counter; a change traces again.
  Programs: torchdiffeq's fixed-grid ``odeint`` (reads of the time grid), PyG's ``GCNConv`` and
  ``GATConv`` (self-loop masks of ``edge_index``).
- **graph breaks**: ``gt.graphify(fn, on_break="split")`` for reads of the call's own data:
  torchdiffeq's adaptive ``dopri5`` (step acceptance), a greedy decoding loop that stops at
  eos, a training step that logs ``loss.item()`` (and reads Adam's step count on the CPU), an
  RL episode that ends when ``done.item()``.

Every program's eager side is deterministic (the same numbers on every run, checked when this
file was written) and small: each test's eager part runs in well under 5 s on a 2-core CPU.
Each test runs on the CPU and, under ``-m cuda``, on a GPU (the ``device`` fixture).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close

import gtransform as gt
from benchmarks.workloads.host import RL_MAX_T as MAX_T
from benchmarks.workloads.host import cartpole_step  # the benchmark's environment, as measured

# --------------------------------------------------------------------------------------------
# torchdiffeq: a neural ODE on a fixed grid (rk4) and adaptive (dopri5)

T_POINTS = 21  # a grid of 21 points: 20 rk4 steps


class ODEFunc(nn.Module):
    """A small MLP vector field, dy/dt = net(y)."""

    def __init__(self, dim: int = 4, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, t, y):
        return self.net(y)


def _ode(device):
    tdq = pytest.importorskip("torchdiffeq")
    torch.manual_seed(0)
    func = ODEFunc().to(device)
    g = torch.Generator().manual_seed(1)
    y0s = [torch.randn(16, 4, generator=g).to(device) for _ in range(4)]
    return tdq.odeint, func, torch.linspace(0, 1, T_POINTS, device=device), y0s


def _assert_one_recording(f, misses_after_warm_up):
    info = f.cache_info()
    assert info.misses == misses_after_warm_up, info  # no call after the first two traced again
    assert info.currsize == 1, info


@torch.no_grad()
def test_odeint_rk4_grid_closed_over_is_one_recording(device):
    """Frozen reads: torchdiffeq checks the grid is increasing and walks it with `while t1 >= t[j]`;
    `t` is closed over and never written, so those reads are constants of one recording."""
    odeint, func, t, y0s = _ode(device)
    f = gt.graphify(lambda y0: odeint(func, y0, t, method="rk4"))
    for k, y0 in enumerate(y0s):
        assert_close(f(y0), odeint(func, y0, t, method="rk4"))
        if k == 1:
            misses = f.cache_info().misses
    _assert_one_recording(f, misses)


@torch.no_grad()
def test_odeint_rk4_grid_passed_as_an_argument_names_the_fix_or_splits(device):
    """A floating-point argument is the call's data: its read is refused, naming the argument and
    the fix (close over the grid: then it is one recording, above); on_break="split" runs it."""
    odeint, func, t, y0s = _ode(device)
    f = gt.graphify(lambda y0, t: odeint(func, y0, t, method="rk4"))
    with pytest.raises(gt.GraphifyError, match=r"(?s)args\[1\].*close over it"):
        f(y0s[0], t)
    g = gt.graphify(lambda y0, t: odeint(func, y0, t, method="rk4"), on_break="split")
    for y0 in y0s:
        assert_close(g(y0, t), odeint(func, y0, t, method="rk4"))


def test_neural_ode_training_with_frozen_grid_trains_like_eager(device):
    """Training through the solve: the frozen forward recording and a recorded backward; Adam's
    updates equal eager's at every step, and later steps replay (no new trace)."""
    import copy

    odeint, func_e, t, y0s = _ode(device)
    func_g = copy.deepcopy(func_e)
    cap = torch.device(device).type == "cuda"
    opt_e = torch.optim.Adam(func_e.parameters(), lr=1e-2, capturable=cap)
    opt_g = torch.optim.Adam(func_g.parameters(), lr=1e-2, capturable=cap)
    solve = gt.graphify(lambda y0: odeint(func_g, y0, t, method="rk4"))
    for k in range(6):
        y0 = y0s[k % len(y0s)]
        for _f, o, s in ((func_e, opt_e, lambda y: odeint(func_e, y, t, method="rk4")), (func_g, opt_g, solve)):
            o.zero_grad()
            s(y0).square().mean().backward()
            o.step()
        assert_close(list(func_g.parameters()), list(func_e.parameters()))
        if k == 2:
            misses = solve.cache_info().misses
    assert solve.cache_info().misses == misses


def test_neural_ode_whole_training_step_is_one_recording(device):
    """The whole step graphified (forward through the solve, backward, the optimizer) with the grid
    closed over: one recording, the parameters equal to eager's after every step."""
    import copy

    odeint, func_e, t, y0s = _ode(device)
    func_g = copy.deepcopy(func_e)

    def make(func):
        opt = torch.optim.SGD(func.parameters(), lr=1e-2, momentum=0.9)

        def step(y0):
            opt.zero_grad()
            loss = odeint(func, y0, t, method="rk4").square().mean()
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    se, sg = make(func_e), gt.graphify(make(func_g))
    for k in range(6):
        y0 = y0s[k % len(y0s)]
        assert_close(sg(y0), se(y0))
        assert_close(list(func_g.parameters()), list(func_e.parameters()))
        if k == 2:
            misses = sg.cache_info().misses
    assert sg.cache_info().misses == misses


@pytest.mark.parametrize("change", ["in_place", "new_tensor"])
@pytest.mark.parametrize("grid", ["closed_over"])
@torch.no_grad()
def test_odeint_rk4_changed_grid_traces_again_with_eager_numbers(device, grid, change):
    """The guard of a frozen read: the grid written in place (`t.mul_(2)`: its version counter
    moves) or replaced by a new tensor traces again, and the numbers are eager's for the new grid."""
    odeint, func, t, y0s = _ode(device)
    if grid == "closed_over":
        f = gt.graphify(lambda y0: odeint(func, y0, t, method="rk4"))

        def call(y0):
            return f(y0)
    else:
        f = gt.graphify(lambda y0, t: odeint(func, y0, t, method="rk4"))

        def call(y0):
            return f(y0, t)

    for y0 in y0s[:3]:
        assert_close(call(y0), odeint(func, y0, t, method="rk4"))
    misses = f.cache_info().misses
    if change == "in_place":
        t.mul_(2)
    else:
        t = torch.linspace(0, 3, T_POINTS, device=device)  # the closure sees the new object too
    seen = []
    for y0 in y0s:
        assert_close(call(y0), odeint(func, y0, t, method="rk4"))
        seen.append(f.cache_info().misses)
    assert seen[0] > misses, (misses, seen)  # the changed grid traced again
    assert seen[-1] == seen[-2], seen  # and then replays


@torch.no_grad()
def test_odeint_dopri5_adaptive_splits_with_eager_numbers(device):
    """Split: dopri5 accepts or rejects each step by `error_ratio <= 1`, a read of the call's own
    data; `on_break="split"` runs the pieces between those reads as recordings."""
    odeint, func, t, y0s = _ode(device)

    def solve(y0):
        return odeint(func, y0, t, method="dopri5", rtol=1e-5, atol=1e-7)

    f = gt.graphify(solve, on_break="split")
    for y0 in y0s:
        assert_close(f(y0), solve(y0))


# --------------------------------------------------------------------------------------------
# PyTorch Geometric: 2-layer GCN and GAT on a fixed random graph

N_NODES, N_EDGES, N_FEAT = 500, 4000, 16


def _pyg(device, conv):
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    if conv == "gcn":
        c1, c2 = pyg_nn.GCNConv(N_FEAT, 32), pyg_nn.GCNConv(32, 8)
        act = F.relu
    else:
        c1, c2 = pyg_nn.GATConv(N_FEAT, 8, heads=4), pyg_nn.GATConv(32, 8, heads=1)
        act = F.elu

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = c1, c2

        def forward(self, x, edge_index):
            return self.conv2(act(self.conv1(x, edge_index)), edge_index)

    model = Net().to(device).eval()
    g = torch.Generator().manual_seed(1)
    edge_index = torch.randint(0, N_NODES, (2, N_EDGES), generator=g).to(device)
    xs = [torch.randn(N_NODES, N_FEAT, generator=g).to(device) for _ in range(4)]
    return model, edge_index, xs


@pytest.mark.parametrize("conv", ["gcn", "gat"])
@torch.no_grad()
def test_pyg_same_edge_index_is_one_recording(device, conv):
    """Frozen data-dependent shapes: GCNConv's `add_remaining_self_loops` and GATConv's
    `remove_self_loops` index `edge_index` with a mask of itself (`nonzero`); the same
    `edge_index` object every call makes them constants of one recording."""
    model, edge_index, xs = _pyg(device, conv)
    f = gt.graphify(model)
    for k, x in enumerate(xs):
        assert_close(f(x, edge_index), model(x, edge_index))
        if k == 1:
            misses = f.cache_info().misses
    _assert_one_recording(f, misses)


@pytest.mark.parametrize("conv", ["gcn", "gat"])
@torch.no_grad()
def test_pyg_new_edge_index_traces_again_with_eager_numbers(device, conv):
    model, edge_index, xs = _pyg(device, conv)
    f = gt.graphify(model)
    for x in xs[:3]:
        assert_close(f(x, edge_index), model(x, edge_index))
    misses = f.cache_info().misses
    g = torch.Generator().manual_seed(2)
    other = torch.randint(0, N_NODES, (2, N_EDGES), generator=g).to(device)  # same shape, new graph
    seen = []
    for x in xs:
        assert_close(f(x, other), model(x, other))
        seen.append(f.cache_info().misses)
    assert seen[0] > misses, (misses, seen)
    assert seen[-1] == seen[-2], seen
    assert_close(f(xs[0], edge_index), model(xs[0], edge_index))  # the first graph still gives its numbers


# --------------------------------------------------------------------------------------------
# Hugging Face GPT-2: greedy decoding with a StaticCache, stopping at eos or after MAX_NEW tokens

PROMPT, MAX_NEW, EOS, VOCAB = 8, 24, 7, 64


def _gpt2(device):
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                        initializer_range=0.3, bos_token_id=0, eos_token_id=EOS)  # 0.3: varied greedy tokens
    model = tr.GPT2LMHeadModel(cfg).to(device).eval()
    cache = tr.StaticCache(config=model.config, max_cache_len=PROMPT + MAX_NEW)
    g = torch.Generator().manual_seed(1)
    # prompt 1 reaches eos after 15 tokens; prompts 0, 2, 3 run to MAX_NEW (checked on the CPU)
    prompts = [torch.randint(0, VOCAB, (1, PROMPT), generator=g).to(device) for _ in range(4)]
    return model, cache, prompts


def _greedy(model, cache, prompt, step=None):
    """The user's loop: prefill, then one token at a time until eos or MAX_NEW tokens.
    `step(tok, pos)`, if given, is the per-token forward (graphified or not)."""
    if step is None:
        def step(tok, pos):
            return model(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1)
    cache.reset()
    tok = model(input_ids=prompt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    out = [tok]
    for i in range(MAX_NEW - 1):
        if tok.item() == EOS:  # the stopping criterion: a read of this call's own data
            break
        tok = step(tok, torch.full((1, 1), PROMPT + i, device=prompt.device))
        out.append(tok)
    return torch.cat(out, 1)


@torch.no_grad()
def test_gpt2_greedy_loop_splits_at_the_stopping_criterion(device):
    """Split: the whole decoding loop graphified; the eos check is a graph break between the
    per-token forwards."""
    model, cache, prompts = _gpt2(device)
    f = gt.graphify(lambda prompt: _greedy(model, cache, prompt), on_break="split")
    for prompt in prompts:
        want = _greedy(model, cache, prompt).clone()
        got = f(prompt).clone()
        assert torch.equal(got, want), (got, want)


@torch.no_grad()
def test_gpt2_per_token_step_graphified_with_the_loop_outside(device):
    """The recipe that needs neither feature: the per-token step graphified (no host read in
    it), the eos check in the caller's loop. The same tokens as eager."""
    model, cache, prompts = _gpt2(device)
    step = gt.graphify(
        lambda tok, pos: model(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits[:, -1:].argmax(-1))
    for prompt in prompts:
        want = _greedy(model, cache, prompt).clone()
        got = _greedy(model, cache, prompt, step=lambda tok, pos: step(tok, pos).clone())
        assert torch.equal(got, want), (got, want)
    assert step.cache_info().currsize == 1, step.cache_info()


# --------------------------------------------------------------------------------------------
# A training loop that logs loss.item() every 10 steps

TRAIN_STEPS, LOG_EVERY = 30, 10


def _trainer(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    # on the CPU Adam reads its step count on the host (split there); on CUDA capturable keeps it on the GPU
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=torch.device(device).type == "cuda")
    log = []

    def train_step(x, y, step):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % LOG_EVERY == 0:
            log.append((int(step), loss.item()))  # a read of this call's own result
        return loss

    return model, train_step, log


def test_training_loop_logging_loss_item_splits(device):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 8, generator=g).to(device), torch.randn(32, 1, generator=g).to(device))
            for _ in range(TRAIN_STEPS)]
    ref_model, ref_step, ref_log = _trainer(device)
    model, step_fn, log = _trainer(device)
    f = gt.graphify(step_fn, on_break="split")
    for i, (x, y) in enumerate(data):
        # the step as a tensor (as RerecordWarning's fix says: a Python int passed anew each call is
        # a new signature each call); `step % 10 == 0` is then a read of the call's own data
        assert_close(f(x, y, torch.tensor(i, device=device)).detach().clone(), ref_step(x, y, i).detach())
    assert [s for s, _ in log] == [s for s, _ in ref_log] == [0, 10, 20]
    assert [v for _, v in log] == pytest.approx([v for _, v in ref_log], rel=1e-5)
    assert_close([p.detach() for p in model.parameters()], [p.detach() for p in ref_model.parameters()])


# --------------------------------------------------------------------------------------------
# An RL rollout in a cartpole-like torch environment, stopping when the episode ends

def _rollout_setup(device):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2)).to(device)

    def episode(s):
        states = [s]
        for _ in range(MAX_T):
            action = policy(s).argmax(-1)  # greedy: the same actions in every column
            s, done = cartpole_step(s, action)
            states.append(s)
            if done.item():  # the episode ends: a read of this call's own data
                break
        return torch.stack(states)

    g = torch.Generator().manual_seed(1)
    starts = [(torch.rand(4, generator=g) * 0.1 - 0.05).to(device) for _ in range(4)]
    return episode, starts


@torch.no_grad()
def test_rl_rollout_until_done_splits(device):
    episode, starts = _rollout_setup(device)
    f = gt.graphify(episode, on_break="split")
    for s0 in starts:
        want = episode(s0)
        assert_close(f(s0).clone(), want)

"""Pure ops whose results nothing uses are not recorded (``_rewrite._drop_dead_ops``).

Eager runs them for nothing (torchdiffeq computes ``y.abs()`` for its dtype at every step;
a comparison whose value a frozen read replaced). A replay that skips them gives eager's
outputs; writes and random draws stay, so state and the generators move as in eager.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import gtransform as gt


def _ops(g, *args):
    return [str(n.target) for n in g.trace(*args).graph.nodes if n.op == "call_function"]


def test_an_unused_result_is_not_recorded(device):
    def f(x):
        x.abs().sum()  # (computed for nothing)
        t = x.to(x.exp().dtype)  # (a kernel for its dtype, as torchdiffeq does)
        return t * 2

    g = gt.graphify(f)
    x = torch.randn(5, device=device)
    assert_close(g(x), f(x))
    ops = _ops(g, x)
    assert "aten.abs.default" not in ops and "aten.exp.default" not in ops and "aten.sum.default" not in ops
    assert "aten.mul.Tensor" in ops


def test_unused_random_draws_stay_so_the_next_draws_are_eagers(device):
    def f(x):
        torch.rand_like(x)  # (unused, but it moves the generator)
        torch.nn.functional.dropout(x, 0.5)
        return x + torch.randn_like(x)

    g = gt.graphify(f)
    for seed in range(3):
        x = torch.randn(64, device=device)
        torch.manual_seed(seed)
        got, after = g(x), torch.rand(3, device=device)
        torch.manual_seed(seed)
        want, after_eager = f(x), torch.rand(3, device=device)
        assert_close(got, want)
        assert_close(after, after_eager)  # (the generator stands where eager's does)


def test_unused_writes_stay(device):
    buf = torch.zeros(3, device=device)

    def f(x):
        buf.add_(x.sum())  # (its result unused: a write to state)
        y = torch.empty_like(x)
        torch.mul(x, 2, out=y)  # (an out= write to a tensor nothing reads after)
        return x + 1

    g = gt.graphify(f)
    ref = torch.zeros(3, device=device)
    for _ in range(4):
        x = torch.randn(3, device=device)
        assert_close(g(x), x + 1)
        ref.add_(x.sum())
        assert_close(buf, ref)


def test_torchdiffeq_rk4_records_no_kernel_for_dtypes_or_frozen_comparisons():
    torchdiffeq = pytest.importorskip("torchdiffeq")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    t = torch.linspace(0, 1, 11)

    def solve(y0):
        return torchdiffeq.odeint(lambda s, y: net(y), y0, t, method="rk4")

    g = gt.graphify(solve)
    y0 = torch.randn(3, 4)
    for _ in range(3):
        assert_close(g(y0), solve(y0))
    ops = _ops(g, y0)
    assert not {"aten.abs.default", "aten.ge.Tensor", "aten.eq.Tensor", "aten.all.default"} & set(ops)
    assert ops.count("aten.addmm.default") == 2 * 4 * 10  # (two layers, four evaluations, ten steps)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(keep=st.lists(st.booleans(), min_size=4, max_size=4), seed=st.integers(0, 5))
def test_any_mix_of_used_and_unused_results_matches_eager(keep, seed):
    def f(x):
        parts = [x.sin(), x.cos() * 2, torch.rand_like(x), x.exp().mean()]
        out = x.clone()
        for p, k in zip(parts, keep):
            if k:
                out = out + p
        return out

    g = gt.graphify(f)
    x = torch.randn(6)
    for _ in range(2):
        torch.manual_seed(seed)
        got = g(x)
        torch.manual_seed(seed)
        assert_close(got, f(x))

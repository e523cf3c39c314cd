"""The caller's autocast around a graphified function, and autocast blocks inside it.

A trace holds the casts autocast made while tracing (and none inside an
``autocast(enabled=False)`` block): each replay, capture, re-trace of the forward and
backward must not cast its ops again under the caller's autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt

_LOW = {"cpu": torch.bfloat16, "cuda": torch.float16}


def _outer(device, dtype=None):
    return torch.autocast(device, dtype=dtype or _LOW[device])


def _parity(device, fn, *args, calls=3, dtype=None):
    g = gt.graphify(fn)
    for _ in range(calls):
        with _outer(device, dtype):
            want = fn(*args)
            got = g(*args)
        assert_close(got, want)
    return g


def test_an_autocast_disabled_block_inside_keeps_float32_under_the_callers_autocast(device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)

    def f(x):
        y = m(x)
        with torch.autocast(device, enabled=False):
            z = y.float() @ y.float().t()  # (HF's rotary embeddings do this)
        return y, z

    x = torch.randn(3, 8, device=device)
    _parity(device, f, x)
    with torch.no_grad():
        _parity(device, f, x)


@pytest.mark.parametrize("inner", ["decorator", "other_dtype", "custom_fwd"])
def test_an_autocast_inside_wins_over_the_callers(device, inner):
    a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    if inner == "decorator":
        @torch.autocast(device, enabled=False)
        def f(a, b):
            return a @ b
    elif inner == "other_dtype":
        def f(a, b):
            with torch.autocast(device, dtype=torch.bfloat16 if device == "cuda" else torch.float16):
                return (a @ b, torch.relu(a) @ b)
    else:
        @torch.amp.custom_fwd(device_type=device, cast_inputs=torch.float32)
        def f(a, b):
            return a @ b
    _parity(device, f, a, b)


def test_a_training_step_under_the_callers_autocast_steps_as_eager(device):
    def run(use):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(m(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        f = gt.graphify(step) if use else step
        losses = []
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(6, 8, generator=g).to(device), torch.randn(6, 1, generator=g).to(device)
            with torch.autocast(device, dtype=torch.float16):
                losses.append(f(x, y).clone())
        return torch.stack(losses), [p.detach().clone() for p in m.parameters()]

    assert_close(run(True), run(False))


def test_a_forward_under_autocast_then_backward_outside_gives_eagers_gradients(device):
    def run(use):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(device)
        f = gt.graphify(m) if use else m
        grads = []
        for i in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).to(device)
            with _outer(device):
                out = f(x)
            out.float().square().sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad()
        return grads

    assert_close(run(True), run(False))

"""graphify(fn, fuse=True): the traced graph is compiled by TorchInductor before
recording. Compilation takes seconds, so these run on the GPU only."""

import pytest
import torch
from conftest import assert_close, stale

import gtransform as gt

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def chain(x):
    for _ in range(30):
        x = (x * 1.01 + 0.1).sin()
    return {"y": x, "s": x.sum()}


def test_fused_matches_eager_and_follows_the_rules():
    f = gt.graphify(chain, fuse=True)
    for _ in range(3):
        x = torch.randn(1024, device="cuda")
        assert_close(f(x), chain(x))
    a = f(torch.randn(1024, device="cuda"))
    f(torch.randn(1024, device="cuda"))
    with pytest.raises(gt.OverwrittenOutputError, match=stale("chain")):
        a["y"] + 1
    assert f.cache_info().misses == 1


def test_fused_random_follows_manual_seed_and_mutation_reaches_caller():
    r = gt.graphify(lambda x: x + torch.randn_like(x), fuse=True)
    x = torch.zeros(16, device="cuda")
    torch.manual_seed(3)
    got = r(x).clone()
    torch.manual_seed(3)
    assert torch.equal(got, torch.randn(16, device="cuda"))
    assert not torch.equal(r(x).clone(), r(x).clone())
    m = gt.graphify(lambda p, g: p.sub_(0.5 * g), fuse=True)
    p = torch.ones(8, device="cuda")
    for _ in range(3):
        m(p, torch.ones(8, device="cuda"))
    assert_close(p, torch.full((8,), -0.5, device="cuda"))


def test_fused_grad_step():
    def loss(w, x):
        return (x @ w).tanh().pow(2).mean()

    step = gt.graphify(torch.func.grad_and_value(loss), fuse=True)
    w = torch.randn(32, 8, device="cuda")
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        assert_close(step(w, x), torch.func.grad_and_value(loss)(w, x))

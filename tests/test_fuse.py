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


def test_fused_state_with_autograd_history_is_refused_then_exact_under_no_grad():
    """A cache buffer that an eager call in grad mode left with autograd history: refused in
    grad mode (the trace once compiled a placeholder without memory into the fused graph),
    eager's numbers under no_grad."""
    from test_state import _Dec

    torch.manual_seed(0)
    d, ref = _Dec().cuda(), _Dec().cuda()
    ref.load_state_dict(d.state_dict())
    f = gt.graphify(d, fuse=True)
    xs = [torch.randn(1, 1, 8, device="cuda") for _ in range(4)]
    pos = [torch.tensor([t], device="cuda") for t in range(4)]
    assert_close(f(xs[0], pos[0]), ref(xs[0], pos[0]))
    with pytest.raises(gt.GraphifyError, match="carries autograd history"):
        f(xs[1], pos[1])
    with torch.no_grad():
        for t in range(1, 4):
            assert_close(f(xs[t], pos[t]), ref(xs[t], pos[t]))
    assert_close(d.k, ref.k)


def test_an_unrolled_loop_over_a_grid_compiles_one_kernel_per_step_shape(caplog):
    """Fixed-index reads of a closed-over grid are lifted (gtransform.fuse._lift): the steps' kernels
    are one source, and the numbers are eager's, also after the grid changes in place."""
    import logging

    t = torch.linspace(0, 1, 9, device="cuda")

    def solve(y):
        for t0, t1 in zip(t[:-1], t[1:]):
            y = y + (t1 - t0) * (y * t0).tanh()
        return y

    f = gt.graphify(solve, fuse=True)
    with caplog.at_level(logging.INFO, logger="gtransform"):
        for _ in range(3):
            y = torch.randn(64, 16, device="cuda")
            assert_close(f(y), solve(y))
    assert any("fixed-index reads" in r.getMessage() for r in caplog.records)
    t.mul_(2)  # the grid read in place: a frozen read of it (zip's bounds) is guarded; values follow
    y = torch.randn(64, 16, device="cuda")
    assert_close(f(y), solve(y))

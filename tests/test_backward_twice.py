"""A graphified function called more than once before one backward pass (a shared encoder).

Autograd keeps the gradients of a tensor used twice (and ``.grad``) in C++, where the
outputs' liveness check cannot see them: the backward's second replay must not write
over the first replay's gradients.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _siamese(make, device, loss, steps=4, set_to_none=True):
    """Eager and graphified copies of one module, trained by the same steps: their grads per step."""
    torch.manual_seed(0)
    eager = make().to(device)
    mod = copy.deepcopy(eager)
    g = gt.graphify(mod)
    a = torch.randn(4, 3, device=device)
    b = 3 * torch.randn(4, 3, device=device)
    out = []
    for step in range(steps):
        pair = []
        for m, f in ((eager, eager), (mod, g)):
            m.zero_grad(set_to_none=set_to_none)
            # each output is reduced before the next call (an output stays valid until then)
            loss(f(a + step), lambda f=f, step=step: f(b - step)).backward()
            pair.append(_grads(m))
        out.append(pair)
    return out, g


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(3, 1),
    lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)),
    # BatchNorm in training mode updates its buffers: the backward recomputes the forward
    lambda: nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)),
], ids=["linear", "mlp", "batchnorm"])
@pytest.mark.parametrize("loss", [
    lambda u, v: u.sum() + v().sum(),  # the same tangents for both calls
    lambda u, v: (lambda su: su * v().sum())(u.sum()),  # a product of the two
    lambda u, v: (lambda su: su * v().tanh().sum())(u.pow(2).sum()),
], ids=["sum", "product", "mixed"])
def test_a_module_called_twice_before_one_backward_gets_eagers_gradients(device, make, loss):
    if device == "cuda" and any(isinstance(x, nn.BatchNorm1d) for x in make().modules()):
        # not silent: autograd raises "modified by an inplace operation" on a [8] tensor
        # (a BatchNorm statistic) in the recompute path's backward; open, see NOTES
        pytest.xfail("CUDA: BatchNorm in training mode called twice before one backward raises")
    steps, _ = _siamese(make, device, loss)
    for want, got in steps:
        for w, gr in zip(want, got):
            assert_close(gr, w)


def test_gradients_kept_between_steps_accumulate_as_in_eager(device):
    steps, _ = _siamese(lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), device,
                        lambda u, v: (lambda su: (su - v().sum()).pow(2))(u.sum()), set_to_none=False)
    for want, got in steps:
        for w, gr in zip(want, got):
            assert_close(gr, w)


def test_a_function_of_explicit_weights_called_three_times_before_backward(device):
    def f(w, x):
        return torch.tanh(x @ w).sum(0)

    g = gt.graphify(f)
    torch.manual_seed(1)
    w0 = torch.randn(3, 5, device=device)
    xs = [torch.randn(4, 3, device=device) * (k + 1) for k in range(3)]
    for _ in range(3):
        ws = [w0.clone().requires_grad_() for _ in range(2)]
        for w, fn in zip(ws, (f, g)):
            s0 = fn(w, xs[0]).sum()
            s1 = fn(w, xs[1]).pow(2).sum()
            (s0 * s1 + fn(w, xs[2]).sum()).backward()
        assert_close(ws[1].grad, ws[0].grad)


def test_the_shared_encoder_does_not_record_on_every_step(device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
    g = gt.graphify(m)
    a, b = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)

    def step():
        m.zero_grad()
        su = g(a).sum()
        (su * g(b).sum()).backward()

    for _ in range(3):
        step()
    info = g.cache_info()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.RerecordWarning)  # no recording per call (the ring's cliff)
        for _ in range(5):
            step()
    assert g.cache_info().misses == info.misses
    assert g.cache_info().hits == info.hits + 10


def test_an_output_saved_by_an_eager_loss_survives_a_second_call_before_backward(device):
    """mse_loss(f(x), t) saves f(x) for its backward; calling f again must not write over it."""
    torch.manual_seed(2)
    eager = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(device)
    mod = copy.deepcopy(eager)
    g = gt.graphify(mod)
    xs = [torch.randn(5, 3, device=device) * (k + 1) for k in range(3)]
    ts = [torch.randn(5, 2, device=device) for _ in range(3)]
    F = torch.nn.functional
    for _ in range(3):
        for m, f in ((eager, eager), (mod, g)):
            m.zero_grad()
            sum(F.mse_loss(f(x), t) for x, t in zip(xs, ts)).backward()
        for p, q in zip(eager.parameters(), mod.parameters()):
            assert_close(q.grad, p.grad)


@pytest.mark.parametrize("partitioned", [True, False], ids=["partitioned", "recompute"])
def test_a_retained_graph_backpropagates_again_after_another_call(device, partitioned):
    """backward(retain_graph=True), another call, then the retained graph's backward again."""
    torch.manual_seed(3)
    eager = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(device)
    mod = copy.deepcopy(eager)
    # an output that is an input as it came in takes the recompute path
    g = gt.graphify(mod if partitioned else (lambda x: (mod(x), x)))
    call = g if partitioned else (lambda x: g(x)[0])
    F = torch.nn.functional
    for step in range(3):
        x, t = torch.randn(5, 3, device=device) + step, torch.randn(5, 2, device=device)
        for m, f in ((eager, eager), (mod, call)):
            m.zero_grad()
            loss = F.mse_loss(f(x), t)  # saves f(x) for its backward
            loss.backward(retain_graph=True)
            f(2 * x)  # another call, its output dropped
            loss.backward()
        for p, q in zip(eager.parameters(), mod.parameters()):
            assert_close(q.grad, p.grad)


def test_a_held_output_still_raises_on_the_autograd_path(device):
    torch.manual_seed(3)
    m = nn.Linear(3, 2).to(device)
    g = gt.graphify(m)
    x = torch.randn(4, 3, device=device)
    g(x), g(x)  # past the first calls (eager, then the recording)
    y1 = g(x)
    assert y1.requires_grad
    y2 = g(x + 1)
    with pytest.raises(gt.OverwrittenOutputError):
        y1 + 1
    assert_close(y2, m(x + 1))


@pytest.mark.parametrize("how", ["closure", "module"])
@pytest.mark.parametrize("T", [1, 3, 6])
def test_backpropagation_through_time_with_the_output_fed_back(device, how, T):
    """`h = step(h, x)` unrolled T times, then one backward: eager's gradients. Before, the
    fed-back output (poisoned when the next call began, while autograd kept it) raised
    OverwrittenOutputError in the forward (closure) or in .backward() (graphify(GRUCell))."""
    torch.manual_seed(0)
    if how == "closure":
        lin = nn.Linear(4, 4).to(device)
        ref_lin = copy.deepcopy(lin)
        step = gt.graphify(lambda h, x: torch.tanh(lin(h) + x))

        def ref(h, x):
            return torch.tanh(ref_lin(h) + x)

        params, ref_params = list(lin.parameters()), list(ref_lin.parameters())
    else:
        cell = nn.GRUCell(4, 4).to(device)
        ref_cell = copy.deepcopy(cell)
        g = gt.graphify(cell)

        def step(h, x):
            return g(x, h)

        def ref(h, x):
            return ref_cell(x, h)

        params, ref_params = list(cell.parameters()), list(ref_cell.parameters())
    for _round in range(2):
        xs = [torch.randn(2, 4, device=device) for _ in range(T)]
        h = hr = torch.zeros(2, 4, device=device)
        for p in params + ref_params:
            p.grad = None
        for x in xs:
            h, hr = step(h, x), ref(hr, x)
        w = torch.arange(4.0, device=device)
        (h * w).sum().backward()
        (hr * w).sum().backward()
        assert_close(h.detach(), hr.detach())
        for p, q in zip(params, ref_params):
            assert_close(p.grad, q.grad)


class _Carry(nn.Module):
    """An RNN that carries its hidden state in a plain attribute (self.h = out, set by the caller)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.h = torch.zeros(2, 4)

    def forward(self, x):
        return torch.tanh(self.lin(self.h) + x)


def test_state_carrying_an_earlier_calls_output_backpropagates_through_time():
    """m.h = out after each call: the next call reads state whose history is the graphified
    function's own node. Before: a GraphifyError about the custom autograd function GraphFn on
    call 3; now eager's outputs and gradients."""
    torch.manual_seed(0)
    m = _Carry()
    r = copy.deepcopy(m)
    f = gt.graphify(lambda x: m(x))
    torch.manual_seed(1)
    xs = [torch.randn(2, 4) for _ in range(5)]
    for x in xs:
        o = f(x)
        m.h = o
        ro = r(x)
        r.h = ro
        assert_close(o, ro)
    m.h.sum().backward()
    r.h.sum().backward()
    for p, q in zip(m.parameters(), r.parameters()):
        assert_close(p.grad, q.grad)

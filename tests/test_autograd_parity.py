"""Autograd inside the function (issue #10 §1): eager's gradients, requires_grad, None grads and RNG."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import gtransform as gt


class _STE(torch.autograd.Function):
    """Straight-through rounding: forward rounds, backward passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class _STEFunc(torch.autograd.Function):
    """The same, in the form torch.func transforms accept (setup_context)."""

    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


def _ste_func(x):
    return (_STEFunc.apply(x) * 3).sum()


def _nograd(x):
    with torch.no_grad():
        s = (x * x).sum()
    return (x * s).sum()


def _ste(x):
    return (_STE.apply(x) * 3).sum()


def _hooked(x):
    y = x * 2
    y.register_hook(lambda g: g * 10)
    return y.sum()


def _dropout(x):
    y = F.dropout(x, 0.5, training=True)
    return (y * y).sum()


CASES = {"no_grad": _nograd, "custom_function": _ste, "tensor_hook": _hooked, "dropout": _dropout}


def _backward_grads(fn, x, seed):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    fn(x).backward()
    return x.grad, torch.rand(3, device=x.device)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_backward_matches_eager(device, case):
    fn = CASES[case]
    g = gt.graphify(fn)
    x = torch.tensor([1.4, 2.6, -0.3, 0.8], device=device)
    for seed in range(3):  # recorded once, replayed after
        want, want_next = _backward_grads(fn, x, seed)
        got, got_next = _backward_grads(g, x, seed)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_next, want_next)  # the global RNG advanced as in eager


@pytest.mark.parametrize("case", ["no_grad", "custom_function", "dropout", "tensor_hook"])
def test_func_grad_of_graphify_matches_eager(device, case):
    fn = _ste_func if case == "custom_function" else CASES[case]
    x = torch.tensor([1.4, 2.6, -0.3, 0.8], device=device)
    g = gt.graphify(fn)
    for seed in range(2):
        torch.manual_seed(seed)
        want = torch.func.grad(fn)(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(torch.func.grad(g)(x), want)


def test_outputs_that_do_not_require_grad_in_eager(device):
    def f(x):
        with torch.no_grad():
            a = x * 2
        return a, x.detach() + 1, (x * 3).sum()

    x = torch.ones(3, device=device, requires_grad=True)
    a, b, s = gt.graphify(f)(x)
    ea, eb, es = f(x)
    assert (a.requires_grad, b.requires_grad, s.requires_grad) == (ea.requires_grad, eb.requires_grad, es.requires_grad)
    with pytest.raises(RuntimeError, match="does not require grad"):
        a.sum().backward()
    s.backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0, device=device))


def test_unused_input_gets_none_and_adamw_leaves_it(device):
    def f(x, z):
        return (x * 2).sum()

    x = torch.ones(2, device=device, requires_grad=True)
    z = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.AdamW([z], lr=0.1, weight_decay=0.5)
    g = gt.graphify(f)
    for _ in range(2):
        g(x, z).backward()
        assert z.grad is None
        opt.step()
    torch.testing.assert_close(z.detach(), torch.ones(2, device=device))


_OPS = st.lists(st.sampled_from(["mul", "sin", "nograd_scale", "detach_add", "ste", "dropout", "hook"]), min_size=1, max_size=6)


def _program(ops):
    def f(x):
        y = x
        for op in ops:
            if op == "mul":
                y = y * 1.5
            elif op == "sin":
                y = y.sin() + y
            elif op == "nograd_scale":
                with torch.no_grad():
                    s = y.abs().mean() + 1
                y = y * s
            elif op == "detach_add":
                y = y + y.detach() * 0.5
            elif op == "ste":
                y = _STE.apply(y * 3) / 3 + y * 0.1
            elif op == "dropout":
                y = F.dropout(y, 0.3, training=True)
            elif op == "hook":
                y = y * 1.0
                y.register_hook(lambda g: g * 2)
        return (y * y).sum()

    return f


@given(ops=_OPS, seed=st.integers(0, 2**16))
def test_random_programs_differentiate_like_eager(ops, seed):
    """Random programs mixing no_grad, detach, custom Functions, hooks and random ops."""
    f = _program(ops)
    g = gt.graphify(f)
    x = torch.linspace(-1.0, 1.0, 6)
    for k in range(2):
        want, want_next = _backward_grads(f, x, seed + k)
        got, got_next = _backward_grads(g, x, seed + k)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_next, want_next)


# -- the recompute backward (outputs that alias inputs, inputs updated in place) ----------


def _alias_dropout(x):
    return x[1:], F.dropout(x, 0.5, training=True) * 2


def test_an_output_aliasing_an_input_keeps_the_dropout_mask_in_the_backward(device):
    g = gt.graphify(_alias_dropout)
    for seed in range(3):
        grads, nexts = [], []
        for fn in (_alias_dropout, g):
            x = torch.ones(64, device=device, requires_grad=True)
            torch.manual_seed(seed)
            a, y = fn(x)
            (a.sum() + (y * y).sum()).backward()
            grads.append(x.grad)
            nexts.append(torch.rand(3, device=device))
        torch.testing.assert_close(grads[1], grads[0])
        torch.testing.assert_close(nexts[1], nexts[0])  # the global RNG advanced as in eager


def test_module_with_batchnorm_and_dropout_trains_like_eager(device):
    """BatchNorm updates its running statistics in place (the recompute path) while dropout draws."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)).to(device)
    mod = copy.deepcopy(ref)
    gmod = gt.graphify(mod)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(mod.parameters(), lr=0.1)
    x = torch.randn(32, 4, device=device)
    y = torch.randn(32, 1, device=device)
    for step in range(6):
        for f, opt in ((ref, opt_r), (gmod, opt_m)):
            torch.manual_seed(step)
            opt.zero_grad()
            F.mse_loss(f(x), y).backward()
            opt.step()
        for (n, a), b in zip(ref.state_dict().items(), mod.state_dict().values()):
            torch.testing.assert_close(b, a, msg=f"step {step}: {n}")


def test_an_input_the_outputs_do_not_depend_on_gets_no_gradient_on_the_recompute_path(device):
    f = gt.graphify(lambda a, b: (a * 2, a[1:]))  # a[1:] aliases an input: the recompute path
    a = torch.ones(3, device=device, requires_grad=True)
    b = torch.ones(3, device=device, requires_grad=True)
    for _ in range(2):
        o = f(a, b)
        (o[0].sum() + o[1].sum()).backward()
        assert b.grad is None
    torch.testing.assert_close(a.grad, torch.tensor([4.0, 6.0, 6.0], device=device))


def test_a_hook_that_a_recompute_would_lose_is_refused(device):
    def f(x):
        y = x * 2
        y.register_hook(lambda g: g * 10)  # HOOK-LINE
        return x[1:], y.sum()  # x[1:] aliases the input: the backward would be recomputed

    x = torch.ones(3, device=device, requires_grad=True)
    with pytest.raises(gt.GraphifyError, match=r"(?s)registers a tensor hook.*HOOK-LINE.*Fix: return a copy"):
        gt.graphify(f)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_with_dropout_trains_like_eager(device, dtype):
    """scaled_dot_product_attention with dropout saves its dropout seed for the backward.

    On CUDA the fused kernels keep that seed on the host in eager and on the
    device in a captured forward; the backward's warm-up read the device copy on
    the host and killed the process (HF GPT-2 in train mode).
    """
    torch.manual_seed(0)
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("half attention backward on CPU is not what this test is about")
    ref = torch.nn.MultiheadAttention(32, 4, dropout=0.25, batch_first=True).to(device, dtype)
    mod = copy.deepcopy(ref)

    def attn(m, x):
        q = m.in_proj_weight
        qkv = (x @ q.t() + m.in_proj_bias).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=0.25, is_causal=True)
        return m.out_proj(o.transpose(1, 2).reshape(2, 16, 32))

    g = gt.graphify(lambda x: attn(mod, x))
    x = torch.randn(2, 16, 32, device=device, dtype=dtype)
    for step in range(4):
        for m, f in ((ref, lambda x: attn(ref, x)), (mod, g)):
            torch.manual_seed(step)
            m.zero_grad()
            f(x).float().square().mean().backward()
        for (n, a), b in zip(ref.named_parameters(), mod.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=f"step {step}: {n}.grad")


@pytest.mark.parametrize("case", ["detach", "detach_and_product", "view_and_detached_product", "input_and_detached_view"])
def test_outputs_aliasing_inputs_require_grad_as_in_eager(device, case):
    """The recompute path (an output is an input or a view of one) hands out detached outputs detached."""
    fns = {
        "detach": lambda x: x.detach(),
        "detach_and_product": lambda x: (x.detach(), x * 2),
        "view_and_detached_product": lambda x: (x[1:], (x * 3).detach()),
        "input_and_detached_view": lambda x: (x, x[:1].detach()),
    }
    fn = fns[case]
    g = gt.graphify(fn)
    for _ in range(3):
        x = torch.ones(2, device=device, requires_grad=True)
        got, want = g(x), fn(x)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want]
        for t, w in zip(got, want):
            torch.testing.assert_close(t.detach(), w.detach())


def test_a_detached_input_returned_can_be_updated_in_place_as_in_eager(device):
    g = gt.graphify(lambda x: x.detach())
    for _ in range(3):
        x = torch.ones(2, device=device, requires_grad=True)
        g(x).add_(1)  # eager: allowed, and it changes x
        torch.testing.assert_close(x.detach(), torch.full((2,), 2.0, device=device))


def test_a_parameter_returned_as_is_under_autograd_is_that_parameter(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 2).to(device)
    fn = lambda x: (lin(x), lin.weight)  # noqa: E731
    g = gt.graphify(fn)
    for _ in range(3):
        x = torch.ones(1, 2, device=device)
        y, w = g(x)
        assert w is lin.weight  # eager returns the Parameter itself, not a view of it
        (y.sum() + w.sum()).backward()
        got = lin.weight.grad.clone()
        lin.zero_grad()
        y, w = fn(x)
        (y.sum() + w.sum()).backward()
        torch.testing.assert_close(got, lin.weight.grad)
        lin.zero_grad()


def test_backward_whose_fake_strides_differ_from_the_real_kernels_runs(device):
    """torch's fake softplus_backward gives other strides than the CPU kernel for a transposed
    gradient; the recorded backward's view of it (chosen on the fake strides) failed on every
    real call with "view size is not compatible" (Qwen3-Next training)."""
    import torch.nn.functional as F

    def f(w, inp, c):
        h = (inp @ w).view(2, 8, 4)
        return (F.softplus(h).transpose(1, 2) * c).sum()

    w = torch.randn(5, 4, requires_grad=True, device=device)
    g = gt.graphify(f)
    for _ in range(3):
        inp, c = torch.randn(16, 5, device=device), torch.randn(2, 4, 8, device=device)
        want, = torch.autograd.grad(f(w, inp, c), w)
        got, = torch.autograd.grad(g(w, inp, c), w)
        torch.testing.assert_close(got, want)


def _signed(x, w):
    return (torch.sgn(x) * w).sum()  # x's gradient is sgn's alone


def _signed_and_view(x, w):
    return _signed(x, w), w[1:]  # an output that is a view of an input: the backward recomputes


@pytest.mark.parametrize("fn", [_signed, _signed_and_view], ids=["partitioned", "recompute"])
def test_a_gradient_autograd_knows_is_zero_reads_as_zeros(device, fn):
    """torch.sgn's derivative of a real input is a ZeroTensor, which has no memory; handed out
    as pool memory, the recording's gradient was an alias of address 0 (a segfault)."""
    g = gt.graphify(fn)
    for seed in range(3):
        torch.manual_seed(seed)
        x, w = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
        grads = []
        for f in (fn, g):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = f(xx, ww)
            (out if fn is _signed else out[0] + out[1].sum()).backward()
            grads.append((xx.grad, ww.grad))
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want)


def test_graphified_grad_through_sgn_matches_eager(device):
    """The forward of graphify(torch.func.grad(f)) makes the ZeroTensor itself."""
    f = lambda x: (torch.sgn(x) * 3).sum()  # noqa: E731
    g = gt.graphify(torch.func.grad(f))
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(5, device=device)
        torch.testing.assert_close(g(x), torch.func.grad(f)(x))


# -- outputs that get no gradient: an input only they reach gets None, as in eager ------------


class _TwoHeads(torch.nn.Module):
    """Actor-critic / multi-task heads: one loss uses one head."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3, 4)
        self.a = torch.nn.Linear(4, 2)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h), self.b(h)


def test_parameters_only_the_unused_head_reaches_get_no_gradient_and_adamw_leaves_them(device):
    """From the second call the recording handed the unused head's parameters zeros, not None:
    AdamW then decayed them and made moments, and the weights left eager's."""
    torch.manual_seed(0)
    ref = _TwoHeads().to(device)
    mod = copy.deepcopy(ref)
    gmod = gt.graphify(mod)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (ref, mod)]
    for step in range(4):
        x = torch.randn(5, 3, device=device)
        head = step % 2 if step >= 2 else 0  # one head for two steps, then each in turn
        for f, m, opt in ((ref, ref, opts[0]), (gmod, mod, opts[1])):
            opt.zero_grad(set_to_none=True)
            f(x)[head].pow(2).sum().backward()
            other = m.b if head == 0 else m.a
            assert other.weight.grad is None and other.bias.grad is None, f"step {step}"
            opt.step()
        for (n, a), b in zip(ref.state_dict().items(), mod.state_dict().values()):
            torch.testing.assert_close(b, a, msg=f"step {step}: {n}")


def _scaled(w, y):
    return w * 2, y * 3


def _scaled_and_view(w, y):
    return w * 2, y * 3, y[1:]  # an output that is a view of an input: the backward recomputes


@pytest.mark.parametrize("fn", [_scaled, _scaled_and_view], ids=["partitioned", "recompute"])
def test_autograd_grad_of_one_output_leaves_the_other_inputs_unused_as_in_eager(device, fn):
    g = gt.graphify(fn)
    w = torch.randn(3, device=device, requires_grad=True)
    y = torch.randn(3, device=device, requires_grad=True)
    for _ in range(3):
        got = torch.autograd.grad(g(w, y)[1].sum(), [w, y], allow_unused=True)
        want = torch.autograd.grad(fn(w, y)[1].sum(), [w, y], allow_unused=True)
        assert got[0] is None and want[0] is None
        torch.testing.assert_close(got[1], want[1])
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(fn(w, y)[1].sum(), [w, y])
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(g(w, y)[1].sum(), [w, y])
    for _ in range(2):  # both outputs again: both gradients
        got = torch.autograd.grad(sum(o.sum() for o in g(w, y)), [w, y])
        want = torch.autograd.grad(sum(o.sum() for o in fn(w, y)), [w, y])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_an_input_that_an_output_with_a_gradient_reaches_gets_one(device):
    """Reached, the input gets its gradient even where it is zero (sgn's), not None."""
    g = gt.graphify(lambda x, y: (torch.sgn(x), x * y, y * 2))
    x = torch.randn(3, device=device, requires_grad=True)
    y = torch.randn(3, device=device, requires_grad=True)
    for _ in range(3):
        a, _, c = g(x, y)
        gx, gy = torch.autograd.grad(a.sum() + c.sum(), [x, y], allow_unused=True)
        torch.testing.assert_close(gx, torch.zeros(3, device=device))
        torch.testing.assert_close(gy, torch.full((3,), 2.0, device=device))


def _two(w, y):
    return torch.tanh(w) * 2, y.sin() * w.sum()


def _two_and_view(w, y):
    return torch.tanh(w) * 2, y.sin() * w.sum(), y[1:]


@pytest.mark.parametrize("fn", [_two, _two_and_view], ids=["partitioned", "recompute"])
def test_torch_func_and_jacrev_of_one_output_match_eager(device, fn):
    """torch.func hands the backward no gradient for outputs it does not differentiate."""
    g = gt.graphify(fn)
    w, y = torch.randn(3, device=device), torch.randn(3, device=device)
    for _ in range(3):
        for argnums in (0, 1, (0, 1)):
            got = torch.func.grad(lambda a, b: g(a, b)[0].sum(), argnums=argnums)(w, y)
            want = torch.func.grad(lambda a, b: fn(a, b)[0].sum(), argnums=argnums)(w, y)
            torch.testing.assert_close(got, want)
        got = torch.func.jacrev(lambda a: g(a, y)[1])(w)
        torch.testing.assert_close(got, torch.func.jacrev(lambda a: fn(a, y)[1])(w))


def test_a_function_under_no_grad_inside_is_a_plain_recording(device):
    """``@torch.no_grad()`` on the function (or ``with torch.no_grad():`` inside) over a module whose
    parameters require grad: nothing it returns needs grad, so the call is recorded and replayed
    as a plain call, not through the autograd wrapper (a joint forward and backward for nothing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(device)

    @torch.no_grad()
    def infer(x):
        return model(x)

    f = gt.graphify(infer)
    for _ in range(4):
        x = torch.randn(5, 8, device=device)
        got = f(x)
        assert not got.requires_grad
        torch.testing.assert_close(got, infer(x))
    assert "recorded, 3 replays" in f.describe()


def test_describe_of_a_differentiated_signature_names_its_forward_and_backward(device):
    model = torch.nn.Linear(4, 3).to(device)
    f = gt.graphify(lambda x: model(x).sum())
    for _ in range(3):
        f(torch.randn(2, 4, device=device)).backward()
    text = f.describe()
    assert "differentiated: a forward and a backward recorded" in text and "traced only" not in text
    assert "<lambda>)) (2 call(s)) and graphify(backward of " in text

"""Tensors with the conjugate (or negative) bit set keep their values through a recording.

``z.conj()`` and ``torch._neg_view(x)`` are lazy views: the bit says how to read the
memory. Outputs handed out by a recording, tensors its forward saves for its backward,
and inputs passed with the bit set must all read as eager's do.
"""

import pytest
import torch

import gtransform as gt


def _plain(t):
    return t.resolve_conj().resolve_neg()


def check(actual, expected):
    """Same tree, same values (as read through the bits), complex64 within rtol 1e-5."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, type(expected)) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            check(a, e)
        return
    assert isinstance(actual, torch.Tensor)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(_plain(actual), _plain(expected), rtol=1e-5, atol=1e-5)


def zs(k, n=4, device="cpu"):
    g = torch.Generator().manual_seed(k)
    return torch.randn(n, dtype=torch.complex64, generator=g).to(device)


def xs(k, n=4, device="cpu"):
    return torch.randn(n, generator=torch.Generator().manual_seed(k)).to(device)


def power(x):
    X = torch.fft.rfft(x)
    return (X * X.conj()).real.sum()


def test_rfft_power_backward_matches_eager(device):
    f = gt.graphify(power)
    for k in range(3):
        x0 = xs(k, 6, device)
        xe = x0.clone().requires_grad_(True)
        power(xe).backward()
        xg = x0.clone().requires_grad_(True)
        loss = f(xg)
        check(loss, power(x0))
        loss.backward()
        check(xg.grad, xe.grad)


def test_func_grad_of_conj_product_matches_eager(device):
    def h(z):
        return (z * z.conj()).real.sum()

    gh = torch.func.grad(gt.graphify(h))
    for k in range(3):
        z = zs(k, device=device)
        check(gh(z), torch.func.grad(h)(z))
        check(gh(z), 2 * z)


def test_conj_and_neg_outputs_match_eager(device):
    fns = {
        "conj of input": lambda z: z.conj(),
        "conj of intermediate": lambda z: (z * 2).conj(),
        "neg view of intermediate": lambda z: torch._neg_view(z * 2),
        "neg view of conj": lambda z: torch._neg_view((z + 1).conj()),
    }
    for name, fn in fns.items():
        g = gt.graphify(fn)
        for k in range(3):
            z = zs(k, device=device)
            out = g(z)
            assert not isinstance(out, tuple), name
            check(out, fn(z))


def test_neg_view_of_real_output_matches_eager(device):
    fn = lambda x: torch._neg_view(x * 2)  # noqa: E731
    g = gt.graphify(fn)
    for k in range(3):
        x = xs(k, 5, device)
        check(g(x), fn(x))


def test_tuple_mixing_conj_and_plain_outputs(device):
    def fn(z):
        y = z * 2
        return y.conj(), y, (z + 1).conj(), torch._neg_view(y.real), z.conj()[1:], z[::2]

    g = gt.graphify(fn)
    for k in range(3):
        z = zs(k, device=device)
        check(g(z), fn(z))


def test_conj_views_of_an_input_stay_views(device):
    def fn(z):
        return z.conj(), z.conj()[1:], z[::2].conj(), z

    g = gt.graphify(fn)
    for k in range(3):
        z = zs(k, device=device)
        out = g(z)
        want = fn(z)
        check(out, want)
        assert out[3] is z
        # views of the caller's tensor, as in eager: an update of it shows through
        z.mul_(1j)
        check(out, want)
        check(out[0], z.conj())


def test_inputs_with_the_conj_bit(device):
    fns = [
        lambda z: z * 2,
        lambda z: z.conj(),
        lambda z: (z + 1).conj(),
        lambda z: (z, z[1:], z.conj()[::2]),
        lambda z: z.clone(),
    ]
    for fn in fns:
        g = gt.graphify(fn)
        zc = zs(7, device=device).conj()
        for k in range(3):
            # the same conj tensor again (read in place), a new conj tensor, a plain one
            for z in (zc, zs(k, device=device).conj(), zs(k + 10, device=device)):
                check(g(z), fn(z))


def test_inputs_with_the_neg_bit(device):
    fns = [lambda x: x * 2, lambda x: torch._neg_view(x), lambda x: (x, torch._neg_view(x[1:]))]
    for fn in fns:
        g = gt.graphify(fn)
        xn = torch._neg_view(xs(7, device=device))
        for k in range(3):
            for x in (xn, torch._neg_view(xs(k, device=device)), xs(k + 10, device=device)):
                check(g(x), fn(x))


@pytest.mark.parametrize("how", ["backward", "func.grad"])
def test_grad_through_conj_input_and_output(how, device):
    def fn(z):
        return (z.conj() * (z * 3)).conj()

    def loss(f, z):
        return f(z.conj()).abs().sum()

    g = gt.graphify(fn)
    for k in range(3):
        z0 = zs(k, device=device)
        if how == "backward":
            ze = z0.clone().requires_grad_(True)
            loss(fn, ze).backward()
            zg = z0.clone().requires_grad_(True)
            loss(g, zg).backward()
            check(zg.grad, ze.grad)
        else:
            check(torch.func.grad(lambda z: loss(g, z))(z0), torch.func.grad(lambda z: loss(fn, z))(z0))


def test_inputs_with_the_bits_updated_in_place(device):
    def fn(z, x):
        z.mul_(2)
        x.add_(1)
        return z.sum() + x.sum()

    g = gt.graphify(fn)
    for k in range(3):
        a = zs(k, device=device)
        x = xs(k, 3, device)
        a2, x2 = a.clone(), x.clone()
        check(g(a.conj(), torch._neg_view(x)), fn(a2.conj(), torch._neg_view(x2)))
        check(a, a2)
        check(x, x2)


def test_conj_tensors_left_in_module_state():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = self.d = None

        def forward(self, z):
            self.c = (z * 2).conj()
            self.d = z.conj()
            return z.sum()

    m = M()
    g = gt.graphify(m)
    for k in range(4):
        z = zs(k)
        check(g(z), z.sum())
        check(m.c, (z * 2).conj())
        check(m.d, z.conj())


def test_a_function_branching_on_an_inputs_conjugate_bit_sees_the_callers(device):
    # the trace's stand-in had no conjugate bit: `x * (2 if x.is_conj() else 3)` took the
    # other branch for z.conj() (its signature is its own, but traced as if plain)
    f = gt.graphify(lambda x: x * (2 if x.is_conj() else 3) + (1 if x.is_neg() else 0))
    z = torch.tensor([1 + 2j, 3 - 1j], device=device)
    for inp in (z, z.conj(), torch._neg_view(z), z, z.conj()):
        torch.testing.assert_close(f(inp).resolve_conj().resolve_neg(), (inp * (2 if inp.is_conj() else 3) + (1 if inp.is_neg() else 0)).resolve_conj().resolve_neg())

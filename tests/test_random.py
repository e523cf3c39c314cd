"""Randomness (DESIGN semantics 5): random ops draw fresh numbers on every call
and follow ``torch.manual_seed`` exactly as eager does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

import gtransform as gt

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def noise_like(x):
    return x + torch.randn_like(x)


def rand_on_device(x):
    return x * torch.rand(4, 3, device=x.device)


def dropout(x):
    return F.dropout(x, p=0.5, training=True)


def mixed(x):
    a = torch.randn_like(x)
    b = torch.rand(x.shape, device=x.device, dtype=x.dtype)
    c = torch.randint(0, 10, x.shape, device=x.device)
    return {
        "a": a,
        "b": x * b,
        "c": c,
        "d": F.dropout(x, 0.3, training=True),
        "n": torch.empty_like(x).normal_(2.0, 3.0),
    }


RANDOM_FNS = [noise_like, rand_on_device, dropout, mixed]


def _x(device):
    return torch.ones(4, 3, device=device)


def _clone(out):
    if isinstance(out, dict):
        return {k: v.clone() for k, v in out.items()}
    return out.clone()


@pytest.mark.parametrize("fn", RANDOM_FNS, ids=lambda f: f.__name__)
def test_fresh_numbers_every_call(device, fn):
    g = gt.graphify(fn)
    x = _x(device)
    outs = [_clone(g(x)) for _ in range(4)]
    flat = [o["a"] if isinstance(o, dict) else o for o in outs]
    for i in range(len(flat)):
        for j in range(i):
            assert not torch.equal(flat[i], flat[j]), f"calls {j} and {i} drew the same numbers"
    assert g.cache_info().misses == 1


@pytest.mark.parametrize("fn", RANDOM_FNS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("seed", [0, 1234])
def test_follows_manual_seed_like_eager(device, fn, seed):
    x = _x(device)
    n = 4
    torch.manual_seed(seed)
    eager = [_clone(fn(x)) for _ in range(n)]
    eager_after = torch.rand(3, device=device)

    g = gt.graphify(fn)
    torch.manual_seed(seed)
    got = [_clone(g(x)) for _ in range(n)]  # the first call records
    got_after = torch.rand(3, device=device)
    for a, e in zip(got, eager, strict=True):
        assert_close(a, e)
    # the generator is left where eager leaves it
    assert_close(got_after, eager_after)

    # again, now that the recording exists
    torch.manual_seed(seed)
    got = [_clone(g(x)) for _ in range(n)]
    for a, e in zip(got, eager, strict=True):
        assert_close(a, e)
    assert g.cache_info().misses == 1


def test_interleaved_with_eager_random_ops(device):
    x = _x(device)

    def program(call):
        torch.manual_seed(7)
        res = []
        for _k in range(3):
            res.append(_clone(call(x)))
            res.append(torch.randn(2, device=device))
        return res

    want = program(mixed)
    g = gt.graphify(mixed)
    assert_close(program(g), want)
    assert_close(program(g), want)


def test_reseeding_with_other_seed_changes_numbers(device):
    g = gt.graphify(noise_like)
    x = _x(device)
    torch.manual_seed(1)
    a = g(x).clone()
    torch.manual_seed(2)
    b = g(x).clone()
    torch.manual_seed(1)
    c = g(x).clone()
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_trace_does_not_consume_random_numbers(device):
    x = _x(device)
    torch.manual_seed(3)
    want = torch.rand(5, device=device)
    g = gt.graphify(noise_like)
    torch.manual_seed(3)
    g.trace(x)
    assert_close(torch.rand(5, device=device), want)


def test_explicit_generator_draws_fresh_numbers_like_eager(device):
    f = gt.graphify(lambda x, g: x + torch.randn(x.shape, generator=g, device=x.device))
    x = torch.zeros(5, device=device)
    g1 = torch.Generator(device=device).manual_seed(7)
    g2 = torch.Generator(device=device).manual_seed(7)
    if _TORCH < (2, 13):  # older torch cannot trace a Generator argument: a clear error
        with pytest.raises(gt.GraphifyError, match=r"(?s)explicit torch\.Generator.*Fix:"):
            f(x, g1)
        return
    # torch 2.13 traces them: a GraphifyError here is a regression, not a skip
    got = f(x, g1).clone()
    for _ in range(3):
        want = x + torch.randn(x.shape, generator=g2, device=device)
        assert torch.equal(got, want)
        got = f(x, g1).clone()


class _Env:
    def __init__(self, gen):
        self.rng = gen


class _Noisy(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.gen = gen

    def forward(self, x):
        return x + torch.randn(x.shape, generator=self.inner.gen, device=x.device)


@pytest.mark.parametrize("where", ["closure", "list", "nested_object", "submodule"])
def test_a_reached_generator_draws_like_eager(device, where):
    # the random ops see a new Python object for the caller's generator: it is still the caller's
    if _TORCH < (2, 13):
        pytest.skip("this torch cannot trace an explicit Generator (see the test above)")
    gen = torch.Generator(device=device).manual_seed(7)
    twin = torch.Generator(device=device).manual_seed(7)
    holder = {"agent": _Env(None)}
    holder["agent"].env = _Env(gen)
    gens = [gen]
    fns = {
        "closure": lambda x: x + torch.randn(x.shape, generator=gen, device=x.device),
        "list": lambda x: x + torch.randn(x.shape, generator=gens[0], device=x.device),
        "nested_object": lambda x: x + torch.randn(x.shape, generator=holder["agent"].env.rng, device=x.device),
        "submodule": _Noisy(gen),
    }
    f = gt.graphify(fns[where])
    x = torch.zeros(5, device=device)
    for _ in range(4):
        got = f(x).clone()
        assert torch.equal(got, x + torch.randn(x.shape, generator=twin, device=device))
    assert gen.initial_seed() == 7


def test_a_generator_made_inside_the_function_is_refused(device):
    # eager makes and seeds it on every call (the same numbers every call); a recording would
    # go on drawing from the one the trace made
    if _TORCH < (2, 13):
        pytest.skip("this torch cannot trace an explicit Generator (see the test above)")

    def noisy(x):
        g = torch.Generator(device=x.device).manual_seed(0)
        return x + torch.randn(x.shape, generator=g, device=x.device)  # DRAW-LINE

    f = gt.graphify(noisy)
    x = torch.zeros(3, device=device)
    with pytest.raises(gt.GraphifyError, match=r"(?s)torch\.Generator that the function makes.*DRAW-LINE.*"
                       r"Fix: make the generator outside the function and pass it"):
        for _ in range(3):
            f(x)


def test_dropout_mask_of_a_transposed_activation_under_autograd_is_eagers(device):
    """Under autograd the forward is a functionalized, partitioned graph, where dropout's
    empty_like(x).bernoulli_(p) had become bernoulli(x, p): contiguous whatever x's strides,
    so the same random stream landed on other elements than in eager when x was a transpose
    (nn.MultiheadAttention with batch_first, a TransformerEncoderLayer in train mode)."""
    import torch.nn as nn

    x = torch.randn(2, 5, 8, device=device)
    w = torch.randn(8, 8, device=device, requires_grad=True)

    def f(x):
        return torch.nn.functional.dropout((x @ w).transpose(0, 1), 0.5, True)

    g = gt.graphify(f)
    for i in range(3):
        torch.manual_seed(i)
        want = f(x)
        want_next = torch.rand(3, device=device)
        torch.manual_seed(i)
        got = g(x)
        got_next = torch.rand(3, device=device)
        assert torch.equal(got, want)
        assert torch.equal(got_next, want_next)
        (gw,) = torch.autograd.grad(got.pow(2).sum(), w)
        (ew,) = torch.autograd.grad(want.pow(2).sum(), w)
        assert_close(gw, ew)

    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).to(device)
    gl = gt.graphify(layer)
    for i in range(3):
        torch.manual_seed(i)
        want = layer(x)
        torch.manual_seed(i)
        assert_close(gl(x), want)


def test_attention_backward_replaying_the_forwards_mask_is_not_a_draw():
    """CUDA's fused attention backward ops are tagged as seeded but take the forward's saved
    philox seed and offset: they repeat the forward's dropout mask and draw nothing. Counting
    them as draws refused every model with attention dropout trained through its recording."""
    from gtransform._watch import _no_dropout

    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_efficient_attention_backward.default,
               aten._scaled_dot_product_cudnn_attention_backward.default):
        assert torch.Tag.nondeterministic_seeded in op.tags
        assert _no_dropout(op, (), {"dropout_p": 0.1})
    fwd = aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(1, 1, 4, 8, device="meta")
    assert not _no_dropout(fwd, (q, q, q, None, False, 0.1), {})
    assert _no_dropout(fwd, (q, q, q, None, False, 0.0), {})


def test_random_low_high_in_place_follows_manual_seed(device):
    """`torch.empty(n, dtype=torch.long).random_(0, k)` (an epsilon-greedy idiom). Before, a raw
    SyntaxError from torch.fx (the op's overload is named `from`, a Python keyword)."""
    def act(q):
        a = torch.empty(q.shape[0], dtype=torch.long, device=q.device).random_(0, q.shape[1])
        noise = torch.empty(3, device=q.device).random_(2, 9)
        return q.gather(1, a[:, None]), noise

    g = gt.graphify(act)
    q = torch.randn(64, 5, device=device)
    for seed in range(4):
        torch.manual_seed(seed)
        e = act(q)
        after_e = torch.rand(1, device=device)
        torch.manual_seed(seed)
        o = g(q)
        after_o = torch.rand(1, device=device)
        assert_close(o, e)
        assert_close(after_o, after_e)  # the generator is left where eager leaves it
    assert g.cache_info().hits == 3


def test_a_seed_inside_fork_rng_that_draws_nothing_is_fine_and_one_left_behind_is_refused(device):
    # a library that seeds to initialise something deterministic, inside fork_rng: eager's
    # generator comes back as it was, so the recording's draws are eager's
    def h(x):
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
            torch.manual_seed(0)
            w = torch.ones(2, device=x.device)
        return torch.rand(2, device=x.device) + x + w

    g = gt.graphify(h)
    x = torch.zeros(2, device=device)
    for _ in range(3):
        state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
        want = h(x)
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state)
        assert torch.equal(g(x), want)

    def left(x):
        torch.manual_seed(0)  # LEFT-LINE
        return x + 1

    with pytest.raises(gt.GraphifyError, match=r"(?s)manual_seed\(\) seeds a default random generator inside "
                       r"the function.*leaves it seeded.*LEFT-LINE.*seed outside the function"):
        gt.graphify(left)(x)

"""fuse=True's small products x @ w.t() (gtransform/fuse/_gemv.py): the graph pass that groups
the products reading one input into one gtransform::gemv, and the op itself.

On the CPU the op is the same arithmetic in aten ops, so these tests check the graph
surgery (what is grouped, what is left, that the numbers stay eager's); under the
`cuda` marker the op runs the Triton kernel, and fuse=True programs use it."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

# the gemm tests' helpers, and their autouse fixture (full float32 precision, the kernels' mode)
from test_gemm import _ieee, cuda, traced  # noqa: F401

import gtransform as gt
from gtransform.fuse import _gemv


def gemv_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _gemv._op()]


def attention_inputs(device="cpu", m=1, d=32, kv=16, ffn=64, bias=False):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(device)  # noqa: E731
    p = {"q": r(d, d), "k": r(kv, d), "v": r(kv, d), "o": r(d, d), "gate": r(ffn, d), "up": r(ffn, d),
         "down": r(d, ffn)}
    if bias:
        p.update(bq=r(d), bk=r(kv), bv=r(kv))
    return p, r(1, m, d)


def block(p, x):
    """A decoder layer's products at batch 1: q, k, v of x; o; gate and up of h; down."""
    b = lambda n: p.get("b" + n)  # noqa: E731
    q, k, v = F.linear(x, p["q"], b("q")), F.linear(x, p["k"], b("k")), F.linear(x, p["v"], b("v"))
    h = x + F.linear(q * torch.cat([k, v], -1).mean(-1, keepdim=True), p["o"])
    return h + F.linear(F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"]), p["down"])


@pytest.mark.parametrize("bias", [False, True])
def test_products_of_one_input_become_one_op(bias):
    p, x = attention_inputs(bias=bias)
    gm = traced(block, p, x)
    ref = gm(p, x)
    counts = _gemv.rewrite(gm, "cpu")
    # q, k, v: one launch; o: one; gate and up: one; down: one
    assert counts == {"gemv": 7, "launches": 4}
    sizes = sorted(len(n.args[1]) for n in gemv_nodes(gm))
    assert sizes == [1, 1, 2, 3]
    assert not [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert_close(gm(p, x), ref)


def test_what_is_left_alone(monkeypatch):
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    cases = {
        "x @ w (not nn.Linear's)": (lambda x, w: x @ w.t().contiguous(), (x, w)),
        "too many rows": (lambda x, w: F.linear(x.expand(9, 16), w), (x, w)),
        "float64": (lambda x, w: F.linear(x, w), (x.double(), w.double())),
        "scaled addmm": (lambda x, w: torch.addmm(w[:, 0], x, w.t(), beta=2.0), (x, w)),
        "batched": (lambda x, w: torch.bmm(x[None], w.t()[None]), (x, w)),
    }
    for name, (fn, args) in cases.items():
        gm = traced(fn, *args)
        ref = gm(*args)
        assert _gemv.rewrite(gm, "cpu")["gemv"] == 0, name
        assert_close(gm(*args), ref)
    monkeypatch.setattr(_gemv, "MAX_WEIGHT", 8 * 16 - 1)
    assert _gemv.rewrite(traced(lambda x, w: F.linear(x, w), x, w), "cpu")["gemv"] == 0
    monkeypatch.setattr(_gemv, "MAX_WEIGHT", 1 << 22)
    torch.backends.cuda.matmul.allow_tf32 = True  # the fixture puts it back
    assert _gemv.rewrite(traced(lambda x, w: F.linear(x, w), x, w), "cpu")["gemv"] == 0
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setenv("GTRANSFORM_GEMM", "0")
    assert _gemv.rewrite(traced(lambda x, w: F.linear(x, w), x, w), "cpu")["gemv"] == 0


def test_more_products_than_a_launch_takes_are_split():
    ws = [torch.randn(4 + i, 16) for i in range(6)]
    x = torch.randn(2, 16)

    def f(x, ws):
        return [F.linear(x, w) for w in ws]

    gm = traced(f, x, ws)
    ref = gm(x, ws)
    assert _gemv.rewrite(gm, "cpu") == {"gemv": 6, "launches": 2}
    assert sorted(len(n.args[1]) for n in gemv_nodes(gm)) == [2, 4]
    assert_close(gm(x, ws), ref)


def test_a_weight_made_after_the_first_product_starts_another_launch():
    """The op runs where the group's first product was: a weight computed later (here from
    that product's result) cannot join it."""
    x, w = torch.randn(1, 16), torch.randn(16, 16)

    def f(x, w):
        y = F.linear(x, w)
        return y, F.linear(x, w * y.sum())

    gm = traced(f, x, w)
    ref = gm(x, w)
    assert _gemv.rewrite(gm, "cpu") == {"gemv": 2, "launches": 2}
    assert_close(gm(x, w), ref)


@st.composite
def groups(draw):
    m = draw(st.integers(1, _gemv.MAX_ROWS))
    k = draw(st.sampled_from([1, 3, 16, 100, 256, 300]))
    ns = draw(st.lists(st.integers(1, 70), min_size=1, max_size=6))
    bias = draw(st.lists(st.booleans(), min_size=len(ns), max_size=len(ns)))
    a_t = draw(st.booleans())
    return m, k, ns, bias, a_t


@settings(max_examples=25)
@given(c=groups())
def test_op_matches_eager(device, c):
    m, k, ns, bias, a_t = c
    g = torch.Generator().manual_seed(m * 1000 + k)
    a = torch.randn(k, m, generator=g).t() if a_t else torch.randn(m, k, generator=g)  # strided input too
    ws = [torch.randn(n, k, generator=g) for n in ns]
    bs = [torch.randn(n, generator=g) if b else None for n, b in zip(ns, bias)]
    a, ws = a.to(device), [w.to(device) for w in ws]
    bs = [b.to(device) if b is not None else None for b in bs]
    got = _gemv.gemv(a, ws, bs)
    for o, w, b in zip(got, ws, bs):
        want = F.linear(a, w, b)
        assert o.shape == want.shape and o.is_contiguous()
        torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_fused_decoder_products_on_the_cpu_match_eager():
    """fuse=True on the CPU: the pass runs only for CUDA products; the program is eager's."""
    p, x = attention_inputs()
    f = gt.graphify(block, fuse=True)
    for i in range(2):
        xi = x + i
        assert_close(f(p, xi), block(p, xi))


@pytest.mark.cuda
@cuda
def test_fused_decoder_uses_the_kernel_and_matches_eager(monkeypatch):
    count = [0]
    real = _gemv._launch

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_gemv, "_launch", counting)
    p, x = attention_inputs("cuda", m=1, d=256, kv=128, ffn=1024, bias=True)
    f = gt.graphify(block, fuse=True)
    for i in range(4):
        xi = x + i
        assert_close(f(p, xi), block(p, xi))
    # warm-up and capture launch it; replays do not come back to Python
    assert count[0] > 0
    assert f.cache_info().misses == 1


@pytest.mark.cuda
@cuda
def test_fused_llama_decode_matches_eager():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tr.LlamaForCausalLM(cfg).eval().cuda()
    f = gt.graphify(lambda ids: model(ids).logits, fuse=True)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, 1000, (1, 1), device="cuda")
            assert_close(f(ids), model(ids).logits)


def test_closed_over_linear_layers_are_grouped_and_match_eager(monkeypatch):
    """Weights a function reaches as state (lifted into placeholders of the trace): grouped
    too. The pass is pointed at the CPU here, so inductor's CPU code runs the op's aten
    arithmetic; a biased layer whose bias is state stays as it was (its value is not
    recorded in the graph)."""
    seen = []
    real = _gemv.rewrite

    def on_cpu(gm, device="cuda", launches=None):
        seen.append(real(gm, "cpu"))  # (no launches: nothing for Triton to precompile)
        return seen[-1]

    monkeypatch.setattr(_gemv, "rewrite", on_cpu)
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(16, n, bias=False) for n in (16, 8, 8))
    o = torch.nn.Linear(16, 16)  # biased: left alone

    def f(x):
        return o(q(x) * (k(x) + v(x)).sum(-1, keepdim=True))

    g = gt.graphify(f, fuse=True)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(1, 1, 16) + i
            assert_close(g(x), f(x))
    assert seen and seen[0] == {"gemv": 3, "launches": 1}


def test_precompile_plans_the_launch_s_very_arguments():
    """precompile builds the kernel variant from sizes and strides alone: the integers it
    plans must be the launch's (Triton keys its variants on them)."""
    a = torch.randn(8, 3).t()[:2]  # a strided input: (2, 8) with strides (1, 3)
    ws = [torch.randn(n, 8) for n in (5, 16, 7, 1, 9)]
    bs = [None, torch.randn(16), None, torch.randn(1), None]
    outs = [torch.empty(2, w.shape[0]) for w in ws]
    for s in (0, _gemv.SLOTS):
        part = range(s, min(s + _gemv.SLOTS, len(ws)))
        real = _gemv._plan(a, [ws[j] for j in part], [bs[j] for j in part], [outs[j] for j in part])
        spec = _gemv._plan(_gemv._Spec(a.shape, a.stride()), [_gemv._Spec(ws[j].shape, (8, 1)) for j in part],
                           [torch.float32 if bs[j] is not None else None for j in part],
                           [_gemv._Spec((2, ws[j].shape[0]), (ws[j].shape[0], 1)) for j in part])
        ints = lambda args: [v for v in args if isinstance(v, int)]  # noqa: E731
        assert real[0] == spec[0] and real[2] == spec[2] and ints(real[1]) == ints(spec[1])


@pytest.mark.parametrize("write", ["input", "input_view", "weight_view", "other"])
def test_a_write_in_place_between_two_products_keeps_them_apart(write):
    """The trace is not functional and a group runs where its first product was: a product
    after a write in place must not move before it (it would read the old input or weight).
    A write to the tensor itself shows in the graph (later uses read the write's result);
    one through a view does not (later uses read the same node): the pass ends its groups
    at every write."""
    x, w1, w2, c = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8, 16), torch.zeros(3)

    def f(x, w1, w2, c):
        y1 = F.linear(x, w1)
        if write == "input":
            x.mul_(2)
        elif write == "input_view":
            x[:, :4].mul_(2)
        elif write == "weight_view":
            w2[0].add_(1)
        else:
            c.add_(1)  # writes neither: still a barrier (the pass does not track aliasing)
        return y1, F.linear(x, w2)

    gm = traced(f, x, w1, w2, c)
    args = lambda: (x.clone(), w1.clone(), w2.clone(), c.clone())  # noqa: E731
    ref = gm(*args())
    assert _gemv.rewrite(gm, "cpu") == {"gemv": 2, "launches": 2}
    assert_close(gm(*args()), ref)

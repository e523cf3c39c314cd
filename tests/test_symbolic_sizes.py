"""A dimension seen to vary is traced once symbolically (issue #36 item 1).

A call that differs from an earlier signature only in the sizes of some dimensions is
traced once more with those sizes as symbols; every later size whose guards hold is
recorded from that trace without tracing. Each call is compared with eager; traces are
counted by wrapping ``gtransform._lookup.trace``; the suite turns warnings into errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close, stale
from hypothesis import given, settings
from hypothesis import strategies as hst

import gtransform as gt
import gtransform._lookup as lookup
import gtransform._partition as partition_mod


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list:
    """The ``dims`` of every trace of the user's function (``frozenset()``: traced as is).

    (Not those of the forward and backward halves of a differentiated call, graphified
    functions of their own: ``traces.halves`` has them.)
    """
    made = _Traces()
    real = lookup.trace

    def counting(*a, **kw):
        dims = a[9] if len(a) > 9 else kw.get("dims", frozenset())
        (made.halves if " of graphify(" in a[4] else made).append(dims)
        return real(*a, **kw)

    monkeypatch.setattr(lookup, "trace", counting)
    return made


class _Traces(list):
    def __init__(self) -> None:
        super().__init__()
        self.halves: list = []


@pytest.fixture
def joints(monkeypatch: pytest.MonkeyPatch) -> list:
    """Per joint forward-and-backward trace of a differentiated call: whether it was symbolic."""
    made: list = []
    real = partition_mod.build_partition

    def counting(*a, **kw):
        made.append(kw.get("symbolic", False))
        return real(*a, **kw)

    monkeypatch.setattr(partition_mod, "build_partition", counting)
    return made


def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device).eval()


def test_a_new_batch_size_is_recorded_without_a_trace(device, traces):
    m = _mlp(device)
    f = gt.graphify(lambda x: m(x).softmax(-1) * x.shape[0])
    with torch.no_grad():
        for n in (4, 4, 8, 8, 5, 5, 7, 12, 33, 12):
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), m(x).softmax(-1) * n)
    # 4: as is; 8: symbolic over args[0].size(0); 5, 7, 12, 33: recorded from it
    assert traces == [frozenset(), frozenset({(0, 0)})]
    assert f.cache_info().currsize == 6
    d = f.describe()
    assert "one symbolic trace for every size of args[0].size(0)" in d
    assert d.count("this signature was not traced, only recorded") == 4


def test_outputs_of_a_size_recorded_from_the_symbolic_trace_go_stale(device):
    m = _mlp(device)

    def head(x):
        return m(x)

    f = gt.graphify(head)
    with torch.no_grad():
        for n in (4, 4, 6, 6):
            f(torch.randn(n, 8, device=device))
        a = f(torch.randn(9, 8, device=device))  # recorded from the symbolic trace
        a2 = a.clone()
        b = f(torch.randn(9, 8, device=device))
        with pytest.raises(gt.OverwrittenOutputError, match=stale("head")):
            a + 1
        assert not torch.equal(a2, b)


def test_several_dimensions_vary(device, traces):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16).to(device)
    qkv = torch.nn.Linear(16, 48).to(device)

    def f(ids):  # causal self-attention, written out
        q, k, v = qkv(emb(ids)).chunk(3, dim=-1)
        n = ids.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=ids.device), 1)
        w = (q @ k.transpose(1, 2) / 4.0).masked_fill(causal, float("-inf")).softmax(-1)
        return (w @ v).mean(1)

    g = gt.graphify(f)
    with torch.no_grad():
        for b, s in ((2, 8), (2, 8), (3, 8), (3, 8), (5, 8), (4, 12), (4, 12), (6, 5), (7, 9)):
            ids = torch.randint(0, 50, (b, s), device=device)
            assert_close(g(ids), f(ids))
    # (2, 8) as is; (3, 8) symbolic over dim 0; (4, 12) over both; (6, 5), (7, 9) recorded
    assert traces == [frozenset(), frozenset({(0, 0)}), frozenset({(0, 0), (0, 1)})]


def test_a_branch_on_a_size_is_guarded(device, traces):
    def f(x):
        return x * 2 if x.shape[0] > 6 else x * 3

    g = gt.graphify(f)
    for n in (4, 5, 3, 9, 10, 6, 2):
        x = torch.randn(n, 3, device=device)
        assert_close(g(x), f(x))
    # 4 as is; 5 symbolic (guard: size <= 6), 3, 6 and 2 recorded from it; 9 fails the guard: a
    # second symbolic trace would not widen the dims, so it is traced as is, and so is 10
    assert traces[:2] == [frozenset(), frozenset({(0, 0)})]
    assert len(traces) == 4 and not traces[2] and not traces[3]


def test_a_size_the_function_pins_is_not_shared(device, traces):
    def f(x):
        if x.shape[0] == 5:
            return x + 100
        return x - 1

    g = gt.graphify(f)
    for n in (4, 5, 6, 7, 5, 8):
        x = torch.randn(n, 2, device=device)
        assert_close(g(x), f(x))
    # 5: the symbolic trace pins the size (kept for 5 alone); 6: a second symbolic trace
    # (guard: size != 5) serves 7 and 8
    assert traces == [frozenset(), frozenset({(0, 0)}), frozenset({(0, 0)})]
    assert "one symbolic trace for every size of args[0].size(0)" in g.describe()


def test_sizes_zero_and_one_are_traced_on_their_own(device, traces):
    f = gt.graphify(lambda x: x.sum(0) + x.shape[0])
    for n in (3, 4, 1, 0, 5, 1):
        x = torch.randn(n, 2, device=device)
        assert_close(f(x), x.sum(0) + n)
    assert traces == [frozenset(), frozenset({(0, 0)}), frozenset(), frozenset()]


def test_a_first_call_of_one_row_does_not_stop_the_symbolic_trace(device, traces):
    # a server's first request is often a single row (a warm-up): the sizes after it share one trace
    m = _mlp(device)
    f = gt.graphify(lambda x: m(x).softmax(-1))
    with torch.no_grad():
        for n in (1, 5, 7, 9, 1, 12, 0, 3):
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), m(x).softmax(-1))
    # 1: as is (its first call eager: it reads the module's state); 5: symbolic, recorded on its
    # first call; 7, 9, 12, 3: recorded from it; 0: a trace of its own
    assert traces == [frozenset(), frozenset({(0, 0)}), frozenset()]
    assert f.describe().count("this signature was not traced, only recorded") == 4


def test_returned_views_of_an_input_get_each_sizes_layout(device, traces):
    f = gt.graphify(lambda x: (x[:, :2], x.t(), x.chunk(2)[1], x.relu()))
    for n in (3, 4, 5, 6, 9):
        x = torch.randn(n, 4, device=device)
        v, t, c, r = f(x)
        assert v.data_ptr() == x.data_ptr() and torch.equal(v, x[:, :2])
        assert t.data_ptr() == x.data_ptr() and torch.equal(t, x.t())
        want = x.chunk(2)[1]
        assert c.data_ptr() == want.data_ptr() and c.shape == want.shape and torch.equal(c, want)
        assert_close(r, x.relu())
    # 3 as is, 4 symbolic; 5, 6 and 9 recorded from it, each with its views' own sizes
    assert traces == [frozenset(), frozenset({(0, 0)})]


def test_calls_differentiated_through_the_autograd_wrapper_share_one_symbolic_trace(device, traces, joints):
    m = _mlp(device)
    f = gt.graphify(lambda x: m(x).square().mean())
    for n in (4, 6, 7, 9, 16):
        x = torch.randn(n, 8, device=device, requires_grad=True)
        f(x).backward()
        g_ref = torch.autograd.grad(m(x).square().mean(), x)[0]
        assert_close(x.grad, g_ref)
    # 4: traced as is, run eagerly (the module is state: its first call); 6: traced
    # symbolically, forward and joint; 7, 9, 16: recorded from them, not traced
    assert traces == [frozenset(), frozenset({(0, 0)})]
    assert joints == [True]
    # the forward and backward halves are graphified functions of their own, traced once
    # symbolically at 6 (over the dimensions of the joint's symbols), then recorded per size
    assert len(traces.halves) == 2 and all(traces.halves)
    assert f.cache_info().currsize == 4


def _adam_training(device, sizes):
    """A closed-over MLP stepping Adam, graphified, run over batches of ``sizes`` and compared with
    an eager copy after each step (the loss and every parameter); the graphified step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    ref = copy.deepcopy(model)
    kw = {"capturable": True} if device == "cuda" else {"fused": True}  # (the step count on the device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kw)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2, **kw)

    def step(m, o, x, y):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss.detach()

    g = gt.graphify(lambda x, y: step(model, opt, x, y))
    for n in sizes:
        x, y = torch.randn(n, 8, device=device), torch.randn(n, 1, device=device)
        assert_close(g(x, y), step(ref, opt_ref, x, y))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q)
    return g


def test_a_training_step_with_a_varying_batch_matches_eager(device, traces):
    g = _adam_training(device, (4, 4, 6, 6, 5, 9, 7, 9))
    # 4: the optimizer's first call runs eagerly (it makes Adam's moments), and the next one
    # traces again; 6 is traced symbolically over x and y's dim 0 and recorded on its first call
    # (the moments exist: no eager call of its own); 5, 9 and 7 are recorded from that trace
    both = frozenset({(0, 0), (1, 0)})
    assert traces == [frozenset(), frozenset(), both]
    assert g.cache_info().currsize == 5


def test_a_training_steps_new_batch_sizes_are_recorded_on_their_first_call(device, traces):
    g = _adam_training(device, (12, 7, 5, 9, 11))  # no size twice: a server's or an RL learner's stream
    # 12 runs eagerly (Adam's moments are made then); 7 is traced symbolically and recorded on its
    # first call; 5, 9 and 11 are recorded from that trace: no eager call, no trace
    assert traces == [frozenset(), frozenset({(0, 0), (1, 0)})]
    assert g.cache_info().currsize == 4
    d = g.describe()  # (each signature's first call, as it went; 12's eager call left no signature)
    assert "first call: ran eagerly" not in d
    assert d.count("first call: recorded (the state it touches exists already") == 1
    assert d.count("this signature was not traced, only recorded") == 3


_OPTIMIZERS = {
    # state made lazily at the first step: momentum buffers, square averages, Adam's moments
    "sgd-nesterov": lambda ps, dev: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "rmsprop": lambda ps, dev: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, **({"capturable": True} if dev == "cuda" else {})),
    "adamw": lambda ps, dev: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                               **({"capturable": True} if dev == "cuda" else {"fused": True})),
}


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_optimizers_with_lazy_state_over_new_batch_sizes_match_eager_step_by_step(device, traces, opt):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(),
                                torch.nn.Linear(12, 2)).to(device)
    ref = copy.deepcopy(model)
    o, o_ref = _OPTIMIZERS[opt](model.parameters(), device), _OPTIMIZERS[opt](ref.parameters(), device)

    def step(m, optim, x, y):
        optim.zero_grad(set_to_none=False)  # (the gradients read and zeroed in place)
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        optim.step()
        return loss.detach()

    g = gt.graphify(lambda x, y: step(model, o, x, y))
    for k, n in enumerate((5, 3, 8, 2, 5, 13)):
        x, y = torch.randn(n, 6, device=device), torch.randn(n, 2, device=device)
        assert_close(g(x, y), step(ref, o_ref, x, y))
        for a, b in zip(list(model.parameters()) + list(model.buffers()), list(ref.parameters()) + list(ref.buffers())):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, n=n: f"step {k} (batch {n}): {m}")
    # the first size's trace and eager call make the state; one symbolic trace, recorded on its
    # first call, serves every other size (the first size's again included)
    assert traces == [frozenset(), frozenset({(0, 0), (1, 0)})]


def test_a_step_that_changes_python_values_still_runs_each_new_sizes_first_call_eagerly(device, traces):
    calls = {"n": 0}
    w = torch.ones(3, device=device)

    def f(x):
        calls["n"] += 1  # a Python value the function changes: its first call per signature is eager
        w.add_(x.sum(0))
        return w * 2

    g = gt.graphify(f)
    w_ref = torch.ones(3, device=device)
    for k, n in enumerate((4, 6, 5)):
        x = torch.full((n, 3), float(k), device=device)
        w_ref.add_(x.sum(0))
        assert_close(g(x), w_ref * 2)
    assert calls["n"] == 3


def test_cache_clear_forgets_the_symbolic_trace(device, traces):
    f = gt.graphify(lambda x: x * 2)
    for n in (3, 4, 5):
        f(torch.randn(n, device=device))
    f.cache_clear()
    for n in (6, 7):
        assert_close(f(torch.ones(n, device=device)), torch.full((n,), 2.0, device=device))
    assert traces == [frozenset(), frozenset({(0, 0)}), frozenset(), frozenset({(0, 0)})]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(sizes=hst.lists(hst.tuples(hst.integers(0, 9), hst.integers(1, 6)), min_size=1, max_size=10))
def test_any_sequence_of_sizes_matches_eager(sizes):
    torch.manual_seed(0)
    w = torch.randn(6, 3)

    def f(x, y):
        h = x @ w[: x.shape[-1]]
        return h.tanh().sum(0) * y.shape[0] + y.mean()

    g = gt.graphify(f)
    for n, k in sizes:
        x, y = torch.randn(n, k), torch.randn(k + 1)
        assert_close(g(x, y), f(x, y))


def _count_compiles(monkeypatch: pytest.MonkeyPatch, fail_symbolic: bool = False) -> list:
    """The ``dims`` of every fuse=True compile from now on (``fail_symbolic``: a symbolic one raises)."""
    from gtransform.fuse import _inductor

    compiles: list = []
    real = _inductor._Inductor._compile

    def counting(self, args, dims):
        compiles.append(dims)
        if dims and fail_symbolic:
            raise RuntimeError("inductor cannot compile these dynamic shapes")
        return real(self, args, dims)

    monkeypatch.setattr(_inductor._Inductor, "_compile", counting)
    return compiles


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuse_compiles_once_for_every_size(monkeypatch):
    compiles = _count_compiles(monkeypatch)

    def chain(x):
        for _ in range(10):
            x = (x * 1.01 + 0.1).sin()
        return x.sum(-1)

    f = gt.graphify(chain, fuse=True)
    for n in (16, 16, 24, 24, 40, 100, 40):
        x = torch.randn(n, 32, device="cuda")
        assert_close(f(x), chain(x))
    # 16: a static compile; 24: the symbolic one, which 40 and 100 reuse
    assert compiles == [frozenset(), frozenset({(0, 0)})]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuse_compiles_the_forward_and_backward_once_for_every_size_through_the_autograd_wrapper(monkeypatch):
    compiles = _count_compiles(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    ref = copy.deepcopy(model)
    f = gt.graphify(model, fuse=True)
    for n in (16, 16, 24, 40, 100, 40):
        x = torch.randn(n, 32, device="cuda")
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    # 16: the forward and backward compiled for that size; 24: each compiled once more, with
    # symbolic sizes, which 40 and 100 reuse
    assert [bool(d) for d in compiles] == [False, False, True, True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fuse_compiles_each_size_where_the_symbolic_compile_fails(monkeypatch):
    compiles = _count_compiles(monkeypatch, fail_symbolic=True)
    f = gt.graphify(lambda x: (x * 3).cos().sum(-1), fuse=True)
    for n in (8, 8, 12, 12, 20, 12):
        x = torch.randn(n, 16, device="cuda")
        assert_close(f(x), (x * 3).cos().sum(-1))
    # 8: static; 12: the symbolic compile fails once, then 12 and 20 each compile on their own
    assert compiles == [frozenset(), frozenset({(0, 0)}), frozenset(), frozenset()]


def test_many_sizes_through_the_autograd_wrapper_warn_with_the_whole_step_as_the_fix(device):
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 1).to(device)
    ref = torch.nn.Linear(6, 1).to(device)
    ref.load_state_dict(m.state_dict())
    f = gt.graphify(lambda x, y: torch.nn.functional.mse_loss(m(x), y))
    with pytest.warns(gt.RerecordWarning) as told:
        for n in range(2, 20):  # a learner's batch of another size each step, backward outside
            x, y = torch.randn(n, 6, device=device), torch.randn(n, 1, device=device)
            f(x, y).backward()
            torch.nn.functional.mse_loss(ref(x), y).backward()
    assert_close(m.weight.grad, ref.weight.grad)
    assert len(told) == 1  # (the function's own: its forward and backward halves warn of nothing)
    text = str(told[0].message)
    assert "differentiated through gtransform's autograd wrapper" in text
    assert "records a forward and a backward" in text and "graphify the whole training step" in text


def test_a_fixed_size_is_named_with_its_guard_and_line(device):
    def f(x):
        return x.reshape(int(x.shape[0]), -1) + 1  # int(): the symbolic size is fixed here

    g = gt.graphify(f)
    for n in (3, 4):
        x = torch.randn(n, 2, device=device)
        assert_close(g(x), f(x))
    d = g.describe()
    assert "a symbolic trace kept for one size: args[0].size(0) was fixed to its value (Eq(" in d
    assert ", at (" in d  # (where the guard was made, as torch's shape environment records it)


def test_many_sizes_warn_once_with_the_options_that_bound_them(device):
    f = gt.graphify(lambda x: x + 1)
    with pytest.warns(gt.RerecordWarning) as caught:
        for n in range(2, 20):
            f(torch.ones(n, device=device))
    text = str(caught[0].message)
    assert "a trace unless it differs from an earlier one only in sizes" in text
    assert "record_sizes=N" in text and "buckets=" in text


def test_explain_says_a_new_size_is_recorded_without_a_trace(device):
    f = gt.graphify(lambda x: x * 2)
    for n in (3, 4, 5):
        f(torch.ones(n, 2, device=device))
    assert f.explain(torch.ones(9, 2, device=device)).endswith(
        "args[0]: shape (3, 2) -> (9, 2) (recorded from the symbolic trace of its sizes, not traced)")
    assert "symbolic" not in f.explain(torch.ones(1, 2, device=device))  # (size 1: a trace of its own)


def test_sizes_returned_or_stored_are_this_calls_numbers(device):
    f = gt.graphify(lambda x: (x * 2, x.shape[0], x.shape, x.shape[0] / 2))
    cache: dict = {}

    def g(x):
        cache["n"] = x.shape[0]
        return x + 1

    h = gt.graphify(g)
    for n in (3, 4, 5, 6):
        x = torch.ones(n, 2, device=device)
        y, k, s, half = f(x)
        assert (k, s, half) == (n, torch.Size([n, 2]), n / 2)
        assert type(k) is int and all(type(d) is int for d in s) and type(half) is float
        h(x)
        assert cache["n"] == n and type(cache["n"]) is int


def test_a_size_inside_a_returned_or_stored_object_is_a_number(device):
    class Box:
        def __init__(self, n):
            self.n = n

    class Tagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.meta: dict = {}

        def forward(self, x):
            self.meta["shape"] = [x.shape[0], 2]
            return x + 1

    f = gt.graphify(lambda x: (x * 2, Box(x.shape[0])))
    m = Tagged()
    g = gt.graphify(m)
    for n in (3, 4, 5):
        x = torch.ones(n, device=device)
        assert f(x)[1].n == n and type(f(x)[1].n) is int
        assert_close(g(x), x + 1)
        assert m.meta["shape"] == [n, 2] and type(m.meta["shape"][0]) is int


def test_a_module_trained_through_the_autograd_wrapper_is_traced_once_for_its_sizes(device, traces, joints):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)
    ref = copy.deepcopy(m)
    f = gt.graphify(lambda x: m(x))
    for n in (3, 3, 4, 4, 5, 6, 6):
        x = torch.randn(n, 4, device=device)
        f(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    # 3: as is (its first call eager: the module is state); 4: symbolic; 5, 6: recorded from it
    assert traces == [frozenset(), frozenset({(0, 0)})]
    assert joints == [False, True]


def test_a_function_that_refuses_every_size_takes_at_most_two_symbolic_traces(device, traces):
    f = gt.graphify(lambda x: x * x.sum().item())  # (a host read of the call's data: refused)
    for n in (3, 4, 5, 6, 7):
        with pytest.raises(gt.GraphifyError, match="reads a tensor's value on the host"):
            f(torch.ones(n, device=device))
    assert traces.count(frozenset({(0, 0)})) == 2  # (then every size is traced as is, once)
    assert len(traces) == 5 + 2


@settings(max_examples=10, deadline=None, derandomize=True)
@given(sizes=hst.lists(hst.integers(1, 12), min_size=2, max_size=7))
def test_a_training_step_over_any_sequence_of_batch_sizes_matches_eager(sizes):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=True)

    def step(m, o, x, y):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss.detach()

    g = gt.graphify(lambda x, y: step(model, opt, x, y))
    for n in sizes:
        x, y = torch.randn(n, 5), torch.randn(n, 2)
        assert_close(g(x, y), step(ref, opt_ref, x, y))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(sizes=hst.lists(hst.tuples(hst.integers(2, 9), hst.integers(2, 9)), min_size=2, max_size=6),
       lo=hst.integers(0, 1), step=hst.integers(1, 2))
def test_returned_views_over_any_sequence_of_sizes_are_eagers(sizes, lo, step):
    def f(x):
        return x[lo::step], x.t()[:, lo:], x.unsqueeze(0).expand(2, -1, -1), x * 2

    g = gt.graphify(f)
    for n, k in sizes:
        x = torch.randn(n, k)
        got, want = g(x), f(x)
        for a, b in zip(got[:3], want[:3]):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        assert_close(got[3], want[3])


# -- calls differentiated through the autograd wrapper (loss.backward() outside) -----------
def test_an_optimizer_loop_with_the_backward_outside_matches_eager_over_new_batch_sizes(device, traces, joints):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    f = gt.graphify(model)
    for n in (8, 8, 12, 5, 9, 12, 31, 5, 2):
        x, y = torch.randn(n, 6, device=device), torch.randint(0, 3, (n,), device=device)
        for m, o, fn in ((model, opt, f), (ref, opt_ref, ref)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(fn(x), y)
            loss.backward()
            o.step()
            if m is model:
                got = loss.detach()
        assert_close(got, loss.detach())
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q)
    assert traces == [frozenset(), frozenset({(0, 0)})]
    # 8: its first call eager, its second recorded from that trace (its joint as is); 12:
    # traced symbolically, forward and joint, and every later size shares them
    assert joints == [False, True]


def test_an_output_without_a_gradient_gets_zeros_of_its_own_size(device, traces, joints):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).to(device)
    f = gt.graphify(lambda x: (lin(x).tanh(), lin(x).sigmoid()))
    for n in (3, 5, 7, 4, 11):
        x = torch.randn(n, 4, device=device, requires_grad=True)
        a, b = f(x)
        gx = torch.autograd.grad(a.sum() * 2, x, retain_graph=True)[0]  # (b gets none: its tangent is zeros)
        xr = x.detach().requires_grad_()
        want = torch.autograd.grad(lin(xr).tanh().sum() * 2, xr)[0]
        assert_close(gx, want)
        gb = torch.autograd.grad(b.square().sum(), x)[0]
        assert_close(gb, torch.autograd.grad(lin(xr).sigmoid().square().sum(), xr)[0])
    assert joints[-1] is True and len(joints) == 1


def test_dropout_through_the_autograd_wrapper_over_sizes_matches_eager(device, traces, joints):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)).to(device)
    ref = copy.deepcopy(model)
    f = gt.graphify(model)
    for n in (4, 4, 6, 9, 13):
        x = torch.randn(n, 5, device=device)
        torch.manual_seed(n)
        f(x).square().mean().backward()
        torch.manual_seed(n)
        ref(x).square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    assert traces == [frozenset(), frozenset({(0, 0)})] and joints == [False, True]


def test_a_backward_that_needs_a_size_no_tensor_has_is_partitioned_per_size(device, traces, joints):
    torch.manual_seed(0)
    w = torch.randn(3, device=device, requires_grad=True)

    def f(x):
        return x.sum(0) * w  # (its backward expands the gradient to x's size: a number, no tensor)

    g = gt.graphify(f)
    for n in (4, 6, 7, 9):
        x = torch.randn(n, 3, device=device, requires_grad=True)
        gx, gw = torch.autograd.grad(g(x).square().sum(), (x, w))
        xr = x.detach().requires_grad_()
        want = torch.autograd.grad(f(xr).square().sum(), (xr, w))
        assert_close((gx, gw), want)
    # (4's first call runs eagerly: w is state) the forward of 6 on is shared; the joint of 6 is
    # symbolic, but its backward takes x's size as a number: each size's joint is traced as is
    assert traces == [frozenset(), frozenset({(0, 0)})]
    assert joints == [True, False, False, False]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(steps=hst.lists(hst.tuples(hst.integers(1, 10), hst.booleans()), min_size=2, max_size=8))
def test_any_sequence_of_sizes_through_the_autograd_wrapper_matches_eager(steps):
    """Batch sizes with the input's gradient taken or not (two partitions), against eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    f = gt.graphify(model)
    for n, wrt_x in steps:
        x = torch.randn(n, 3, requires_grad=wrt_x)
        xr = x.detach().requires_grad_(wrt_x)
        out, want = f(x), ref(xr)
        assert_close(out, want)
        (out * torch.arange(2.0)).sum().backward()
        (want * torch.arange(2.0)).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
        if wrt_x:
            assert_close(x.grad, xr.grad)


def test_attention_trained_through_the_autograd_wrapper_over_new_lengths_is_not_traced_again(device, traces, joints):
    """Its backward takes transposed, flattened and broadcast activations: laid out as the joint traced them."""
    torch.manual_seed(0)
    emb, qkv, head = (torch.nn.Embedding(50, 16).to(device), torch.nn.Linear(16, 48).to(device),
                      torch.nn.Linear(16, 50).to(device))
    params = [*emb.parameters(), *qkv.parameters(), *head.parameters()]

    def lm(ids, labels):
        x = emb(ids)
        b, s, _ = x.shape
        q, k, v = qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        a = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~causal, float("-inf")).softmax(-1)
        y = (a @ v).transpose(1, 2).reshape(b, s, 16)
        return torch.nn.functional.cross_entropy(head(y).flatten(0, 1), labels.flatten())

    f = gt.graphify(lm)
    counts = []
    for b, s in ((2, 5), (2, 5), (2, 7), (2, 9), (3, 9), (4, 6), (3, 11), (2, 13), (5, 4)):
        ids, labels = torch.randint(0, 50, (b, s), device=device), torch.randint(0, 50, (b, s), device=device)
        before = len(traces) + len(traces.halves)
        got = torch.autograd.grad(f(ids, labels), params)
        counts.append(len(traces) + len(traces.halves) - before)
        assert_close(got, torch.autograd.grad(lm(ids, labels), params))
    # (2, 5): traced, its first call eager; (2, 7): the length traced symbolically, forward,
    # joint and halves; (3, 9): the batch too; every later size: recorded, no trace
    assert counts[-4:] == [0, 0, 0, 0]
    assert sum(bool(d) for d in traces) == 2 and joints.count(True) == 2


def test_record_sizes_with_the_backward_outside_records_the_chosen_sizes_only(device, traces):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2)).to(device)
    ref = copy.deepcopy(model)
    f = gt.graphify(model, record_sizes=(4, 8, 16))
    for n in (4, 4, 8, 3, 16, 5, 8, 4, 16, 7):
        x = torch.randn(n, 5, device=device)
        f(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    assert f.cache_info().currsize == 3  # (3, 5 and 7 ran eagerly: no signature, no trace)
    assert len(traces) == 2  # 4 as is, 8 symbolically; 16 recorded from it


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.scale = 1.0

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale


@pytest.mark.parametrize("change", ["attribute", "hook", "submodule", "train", "tensor_attr"])
def test_a_python_change_after_a_second_size_is_seen_at_every_size(device, change):
    # a symbolic plan holds the Python side it was traced with (module attributes, hooks, the
    # training flag, the tensors' attributes): a size recorded from it after a change computed
    # with the old values
    torch.manual_seed(0)
    m = _Scaled().to(device).eval()
    w = torch.ones(4, device=device)
    fn = lambda x, w: m(x) * getattr(w, "s", 1.0)  # noqa: E731
    g = gt.graphify(fn)
    changes = {
        "attribute": lambda: setattr(m, "scale", 3.0),
        "hook": lambda: m.lin.register_forward_hook(lambda mod, i, o: o * 10),
        "submodule": lambda: setattr(m, "lin", torch.nn.Linear(4, 4).to(device)),
        "train": lambda: m.train(),
        "tensor_attr": lambda: setattr(w, "s", 3.0),
    }
    with torch.no_grad():
        for n in (4, 5, 6):
            x = torch.randn(n, 4, device=device)
            assert_close(g(x, w), fn(x, w))
        changes[change]()
        em = copy.deepcopy(m)
        ew = torch.ones(4, device=device)
        if change == "tensor_attr":
            ew.s = 3.0
        ef = lambda x, w: em(x) * getattr(w, "s", 1.0)  # noqa: E731
        for n in (4, 7, 5, 4):
            x = torch.randn(n, 4, device=device)
            assert_close(g(x, w), ef(x, ew))
        assert_close(m.bn.running_mean, em.bn.running_mean)


def test_a_size_turned_into_text_is_its_number_and_pins_the_plan(device):
    """Before: once a size varied, str(n), f"b{n}" and repr(x.shape) in the symbolic trace gave
    the symbol's name ("s4"), and every later size replayed the branch and the text that made."""
    scale_for = {"4": 1.0, "8": 2.0, "6": 3.0}

    def f(x):
        n = x.shape[0]
        big = 10.0 if str(n) == "8" else 1.0
        return x * scale_for.get(f"{n}", -1.0) * big, f"batch{n:d}", repr(x.shape)

    g = gt.graphify(f)
    for n in (4, 4, 8, 6, 8, 5):
        x = torch.ones(n, 2, device=device)
        assert_close(g(x), f(x))


# -- Python values the function stores from sizes (found by a bug hunt) --------------------------

from hypothesis import given as _given  # noqa: E402
from hypothesis import strategies as _st  # noqa: E402


class _KeepsSizes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.last_batch = 4  # (a default equal to the first size)
        self.in_shape = (4, 4)

    def forward(self, x):
        self.last_batch = x.shape[0]
        self.in_shape = x.shape
        return self.lin(x)


@_given(_st.lists(_st.sampled_from([1, 2, 4, 5, 6]), min_size=1, max_size=10))
def test_sizes_stored_as_python_values_are_each_calls_own_in_any_order(sizes):
    """self.n = x.shape[0] and self.in_shape = x.shape: every replay sets its call's own (a torch.Size and a
    tuple were never set again, a size set where another call had left the same number was forgotten,
    and whether a size was refused depended on the order of the calls)."""
    torch.manual_seed(0)
    m, ref = _KeepsSizes(), _KeepsSizes()
    ref.load_state_dict(m.state_dict())
    f = gt.graphify(m)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 4)
            assert_close(f(x), ref(x))
            assert (m.last_batch, tuple(m.in_shape)) == (ref.last_batch, tuple(ref.in_shape))


def test_a_counter_of_sizes_is_refused_not_frozen():
    class Count(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.seen = 0

        def forward(self, x):
            self.seen += x.shape[0]
            return self.lin(x)

    m = Count()
    f = gt.graphify(m)
    seen = 0
    with torch.no_grad(), pytest.raises(gt.GraphifyError, match=r"module\.seen"):
        for n in (4, 6, 6, 5, 5, 6, 6):
            f(torch.randn(n, 4))
            seen += n
            assert m.seen == seen  # (exact until refused: never a frozen count)

"""Graph breaks (issue 35 item 2): on_break="split"/"eager" and torch.compile(backend="gtransform").

Written as users write code, compared with eager step by step. The `device` fixture runs each
test on the CPU and, under `-m cuda`, on the GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import gtransform as gt


@pytest.fixture(autouse=True)
def _quiet_dynamo():
    # dynamo logs each graph break as a warning-level log record; the tests look at results
    torch._logging.set_logs(graph_breaks=False)
    yield


def branchy(x, w):
    y = (x @ w).sin()
    if y.sum().item() > 0:
        y = y * 2
    else:
        y = y - 1
    return y.cos()


def test_error_is_default_and_names_both_options(device):
    f = gt.graphify(branchy)
    with pytest.raises(gt.GraphifyError) as info:
        f(torch.randn(2, 3, device=device), torch.randn(3, 3, device=device))
    msg = str(info.value)
    assert "item" in msg
    assert 'on_break="split"' in msg and 'on_break="eager"' in msg


@pytest.mark.parametrize("bad", ["Split", "graph", None, 1])
def test_invalid_on_break_raises(bad):
    with pytest.raises(ValueError, match="on_break.*'error', 'split', 'eager'"):
        gt.graphify(branchy, on_break=bad)


def test_split_branches_both_ways(device):
    f = gt.graphify(branchy, on_break="split")
    w = torch.randn(3, 3, device=device)
    signs = set()
    torch.manual_seed(0)
    for _ in range(12):
        x = torch.randn(2, 3, device=device)
        signs.add(bool((x @ w).sin().sum() > 0))
        assert_close(f(x, w), branchy(x, w))
    assert signs == {True, False}
    text = f.describe()
    assert 'on_break="split"' in text and "recorded piece(s)" in text
    assert "split by TorchDynamo" in f.explain(x, w)


def test_split_pieces_read_each_others_outputs_in_place():
    """The output of the piece before the read, passed to the piece after it, is not copied each call.

    (The piece before it records again on its second call, to read `w` in place, so its output
    moves then: the piece after it compares its third call's input with its second's.)
    """
    f = gt.graphify(branchy, on_break="split")
    w = torch.randn(3, 3)
    x = torch.ones(2, 3)  # one branch, every call
    for _ in range(6):
        assert_close(f(x.clone(), w), branchy(x, w))
    pieces = f._breaks.backend.live()
    after = [p for p in pieces if p.cache_info().hits >= 3]
    assert len(after) == 2  # the piece before the read and the one after it
    first, second = after
    rec_first = next(iter(first._tls.state.cache.values())).rec
    rec_second = next(iter(second._tls.state.cache.values())).rec
    assert len(rec_first.static_idx) == 1 and len(rec_first.copy_idx) == 1  # w in place, x copied
    assert len(rec_second.copy_idx) == 0  # the first piece's output: read in place


def test_training_loop_logging_loss_every_10_steps(device):
    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        # (capturable on CUDA: the step count on the GPU; see test_split_cpu_state_in_a_cuda_piece)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2, capturable=torch.device(device).type == "cuda")

    def build(model, opt, logs):
        def step(x, y, log):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if log:
                logs.append(loss.item())
            return loss.detach()
        return step

    m1, o1 = make()
    m2, o2 = make()
    logs1, logs2 = [], []
    eager, split = build(m1, o1, logs1), gt.graphify(build(m2, o2, logs2), on_break="split")
    for i in range(30):
        x, y = torch.randn(16, 4, device=device), torch.randn(16, 1, device=device)
        assert_close(split(x, y, i % 10 == 0), eager(x, y, i % 10 == 0))
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert_close(q, p)
    assert len(logs2) == 3
    assert logs2 == pytest.approx(logs1, rel=1e-4)


def test_adaptive_loop(device):
    def solve(y, tol):
        h = torch.ones((), device=y.device)
        err = (y * h).abs().max()
        steps = 0
        while err.item() > tol:
            h = h / 2
            err = (y * h).abs().max()
            steps += 1
        return y * h, steps

    f = gt.graphify(solve, on_break="split")
    for k in range(5):
        y = torch.randn(5, device=device) * (k + 1)
        out, n = f(y, 0.1)
        ref, n_ref = solve(y, 0.1)
        assert n == n_ref
        assert_close(out, ref)


def test_eager_warns_once_per_signature(device):
    f = gt.graphify(branchy, on_break="eager")
    w = torch.randn(3, 3, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(2, 3, device=device)
            assert_close(f(x, w), branchy(x, w))
        x4 = torch.randn(4, 3, device=device)  # a second signature
        for _ in range(2):
            assert_close(f(x4, w), branchy(x4, w))
    eager = [c for c in caught if issubclass(c.category, gt.EagerWarning)]
    assert len(eager) == 2
    assert 'on_break="eager"' in str(eager[0].message) and 'on_break="split"' in str(eager[0].message)
    assert "test_split.py:30 in branchy" in str(eager[0].message)  # the read's own line
    assert "5 call(s)" in f.describe()
    assert "runs eagerly" in f.explain(x4, w)


def test_split_leaves_recordable_signatures_alone():
    f = gt.graphify(lambda x: x * 2 + 1, on_break="split")
    for _ in range(3):
        f(torch.ones(3))
    assert f._breaks is None and f.cache_info().hits == 2


# -- torch.compile(fn, backend="gtransform") -----------------------------------------------------------


def test_backend_by_name_forward_and_pieces(device):
    cf = torch.compile(branchy, backend="gtransform")
    w = torch.randn(3, 3, device=device)
    for _ in range(6):
        x = torch.randn(2, 3, device=device)
        assert_close(cf(x, w), branchy(x, w))


def test_backend_backward_matches_eager(device):
    torch.manual_seed(0)
    w1 = torch.randn(3, 3, device=device, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()

    def loss_fn(x, w):
        return ((x @ w).tanh() ** 2).sum()

    cf = torch.compile(loss_fn, backend="gtransform")
    for _ in range(3):
        x = torch.randn(4, 3, device=device)
        loss_fn(x, w1).backward()
        cf(x, w2).backward()
        assert_close(w2.grad, w1.grad)


def test_backend_module_updated_by_optimizer_between_calls(device):
    def make():
        torch.manual_seed(1)
        m = torch.nn.Linear(3, 2).to(device)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m1, o1 = make()
    m2, o2 = make()
    cm = torch.compile(m2, backend="gtransform")
    for _ in range(5):
        x = torch.randn(4, 3, device=device)
        for m, o in ((m1, o1), (cm, o2)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        assert_close(m2.weight, m1.weight)
        assert_close(cm(x).detach().clone(), m1(x).detach())


def test_backend_held_output_keeps_its_values(device):
    """torch.compile(fn, backend="gtransform") sees no call of fn, only its graphs: an output held
    across its graph's next call is copied out of the pool and keeps its values (eager's)."""
    cf = torch.compile(lambda x: x.sin() + 1, backend="gtransform")
    a = cf(torch.ones(3, device=device))
    b = cf(torch.full((3,), 2.0, device=device))
    assert_close(a, torch.ones(3, device=device).sin() + 1)
    assert_close(b, torch.full((3,), 2.0, device=device).sin() + 1)


@pytest.mark.parametrize("hold", ["first", "second", "both", "view"])
def test_backend_outputs_held_over_many_calls_keep_their_values(device, hold):
    """Held outputs of a graph are taken back call after call (new objects take their places in
    the pool); what the caller let go is handed out again; a held view keeps its values too."""
    cf = torch.compile(lambda x: (x * 2, x + 1), backend="gtransform")
    kept = []
    for k in range(6):
        x = torch.full((4,), float(k), device=device)
        a, b = cf(x)
        if hold in ("first", "both"):
            kept.append((a, x * 2))
        if hold in ("second", "both"):
            kept.append((b, x + 1))
        if hold == "view":
            kept.append((a[1:], (x * 2)[1:]))
        for got, want in kept:
            assert_close(got, want)


def test_split_output_held_into_the_next_call_goes_stale(device):
    """on_break="split": outputs held within one call keep their values (a token list: see
    test_host_programs); the result held into the next call of the function follows graphify's
    output rule and raises when touched."""
    def f(x):
        y = x * 2
        if y.sum().item() > 0:
            return y + 1
        return y - 1

    g = gt.graphify(f, on_break="split")
    g(torch.ones(3, device=device))  # (dynamo compiles the piece after the read again on the next call)
    a = g(torch.full((3,), 2.0, device=device))
    b = g(torch.full((3,), 3.0, device=device))
    with pytest.raises(gt.OverwrittenOutputError):
        a + 1
    assert_close(b, torch.full((3,), 7.0, device=device))


def test_backend_options():
    cf = torch.compile(lambda x: x * 3, backend="gtransform", options={"maxsize": 2})
    assert_close(cf(torch.ones(2)), torch.full((2,), 3.0))
    bad = torch.compile(lambda x: x * 3, backend="gtransform", options={"fusee": True})
    with pytest.raises(Exception, match="unknown option"):
        bad(torch.ones(2))


def test_backend_piece_called_twice_in_one_call():
    def inner(x):
        y = x * 2
        if y.sum().item() > 0:
            return y + 1
        return y - 1

    def outer(x, z):
        return inner(x) + inner(z)

    co = torch.compile(outer, backend="gtransform")
    for _ in range(4):
        x, z = torch.randn(3), torch.randn(3)
        assert_close(co(x, z), outer(x, z))


@given(values=st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=6, max_size=6))
def test_split_branchy_matches_eager_on_random_inputs(values):
    f = _BRANCHY_SPLIT
    x = torch.tensor(values).reshape(2, 3)
    assert_close(f(x, _W), branchy(x, _W))


_W = torch.eye(3)
_BRANCHY_SPLIT = gt.graphify(branchy, on_break="split")


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_split_piece_that_cannot_be_recorded_runs_eagerly_with_one_warning():
    """A graph between reads that graphify refuses (a quantize op here) runs eagerly, warned once,
    and the rest of the function stays recorded: eager's numbers on every call."""
    def f(x):
        y = x * 2
        if y.sum().item() > 0:
            y = y + 1
        q = torch.quantize_per_tensor(y, 0.1, 0, torch.quint8).dequantize()
        return q * 3

    g = gt.graphify(f, on_break="split")
    xs = [torch.rand(5) for _ in range(4)]
    with pytest.warns(gt.EagerWarning, match="runs eagerly"):
        assert_close(g(xs[0]), f(xs[0]))
    for x in xs[1:]:
        assert_close(g(x), f(x))
    assert "runs eagerly" in g.describe()


@pytest.mark.cuda
def test_split_cpu_state_in_a_cuda_piece():
    """A CPU tensor read in a CUDA function (Adam without capturable=True keeps its step count on the
    host) is refused by default naming on_break; split runs the optimizer's piece eagerly, warned once."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    ref = torch.nn.Linear(4, 1).cuda()
    ref.load_state_dict(m.state_dict())
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def make(model, o):
        def step(x):
            loss = model(x).square().mean()
            o.zero_grad()
            loss.backward()
            o.step()
            return loss.detach()
        return step

    m0 = torch.nn.Linear(4, 1).cuda()
    f0 = gt.graphify(make(m0, torch.optim.Adam(m0.parameters(), lr=1e-2)))
    with pytest.raises(gt.GraphifyError, match="on_break"):
        for _ in range(2):  # (the first call of a function that touches state runs eagerly)
            f0(torch.randn(8, 4, device="cuda"))
    g = gt.graphify(make(m, opt), on_break="split")
    e = make(ref, ropt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gt.EagerWarning)
        for _ in range(5):
            x = torch.randn(8, 4, device="cuda")
            assert_close(g(x), e(x))
            assert_close(list(m.parameters()), list(ref.parameters()))


def test_python_attributes_of_tensors_the_code_reads_between_breaks_are_followed(device):
    # the pieces' own signatures leave tensor attributes to dynamo, which guards those the
    # Python reads: a changed attribute of closed-over state or of an argument is seen
    w = torch.randn(4, device=device)
    w.scale = 2.0

    def fn(x):
        y = x * w.scale + w * getattr(x, "k", 1.0)
        if y.sum().item() > 1e9:  # a read of the call's own data
            return y
        return y * w.scale

    f = gt.graphify(fn, on_break="split")
    for scale, k in [(2.0, 1.0), (2.0, 1.0), (3.0, 1.0), (3.0, 4.0), (3.0, 4.0), (5.0, 0.5)]:
        w.scale = scale
        x = torch.randn(4, device=device)
        x.k = k
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = f(x)
        assert_close(got, fn(x))


def test_a_read_inside_a_loop_body_written_inline_says_nothing_was_recorded(device):
    """TorchDynamo gives up on a function whose loop holds the read next to inline tensor work
    ("graph break in loop") and runs it eagerly: eager's numbers, and one warning saying that
    nothing is recorded and how to get pieces (the body in a function of its own)."""
    w = torch.randn(8, 8, device=device)

    def inline(x):
        out, h = [], x
        for _ in range(4):
            h = torch.tanh(h @ w)
            if h.sum().item() > 1e9:
                break
            out.append(h.mean(1))
        return torch.stack(out, 1)

    def body(h):
        return torch.tanh(h @ w)

    def called(x):
        out, h = [], x
        for _ in range(4):
            h = body(h)
            if h.sum().item() > 1e9:
                break
            out.append(h.mean(1))
        return torch.stack(out, 1)

    def run_split(fn):
        """Three calls of ``fn`` split, each against eager: the function and the EagerWarnings' texts."""
        f = gt.graphify(fn, on_break="split")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                x = torch.randn(3, 8, device=device)
                assert_close(f(x), fn(x))
        return f, [str(m.message) for m in seen if issubclass(m.category, gt.EagerWarning)]

    f, told = run_split(inline)
    assert len(told) == 1 and "recorded nothing" in told[0] and "function of its own" in told[0]
    assert "into 0 recorded piece(s)" in f.describe()

    g, told = run_split(called)
    assert not told
    assert "into 0 recorded piece(s)" not in g.describe()


def test_backend_held_outputs_of_a_differentiated_graph_keep_their_values(device):
    """In grad mode a graph goes through the autograd wrapper (a forward and a backward half): the
    halves' held outputs are copied out as the graph's own are (a siamese step holds two)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 1).to(device)
    cf = torch.compile(lambda x: net(x) * 2, backend="gtransform")
    xs = [torch.randn(4, 5, device=device) for _ in range(4)]
    outs = [cf(x) for x in xs]
    for o, x in zip(outs, xs):
        assert_close(o, net(x) * 2)
    z1, z2 = cf(xs[0]), cf(xs[1])
    (z1 - z2).pow(2).sum().backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ((net(xs[0]) * 2 - net(xs[1]) * 2).pow(2).sum()).backward()
    for a, b in zip(want, (p.grad for p in net.parameters())):
        assert_close(a, b)


def test_split_takes_over_reads_of_index_arguments_of_a_new_shape_every_call():
    """A read of an integer argument (a prompt) whose shape changes on every call: after the first
    call (eager: the read might be of a structure passed again), the calls run split; they do not
    run eagerly, traced, forever."""
    emb = torch.nn.Embedding(10, 4)

    def f(ids):
        h = emb(ids).sum()
        if ids[0, -1].item() == 3:
            return h * 2
        return h - 1

    g = gt.graphify(f, on_break="split")
    with torch.no_grad():
        for n in range(2, 9):
            ids = torch.randint(0, 10, (1, n))
            assert_close(g(ids), f(ids))
    assert "ran split by TorchDynamo" in g.describe()
    assert g.cache_info().misses <= 3


def _counted(x, n, k, m=2):
    y = x * 2
    if y.float().sum() > 0:  # a host read: a break
        y = y + 1
    # n (a step counter) only meets tensors in arithmetic; k also sizes a tensor; m divides (on
    # CUDA a division by a number multiplies by its reciprocal: it stays a value of the signature)
    return y * n + n, n - y, (x.float().sum() * n), torch.ones(k, device=x.device) * k, y / m


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool, torch.float16])
def test_a_step_counter_passed_to_a_piece_is_one_signature_not_one_per_value(device, dtype):
    # dynamo passes a Python number that changes as an input of the piece after the break: it
    # was a static value there, a trace and a capture for every value of the counter
    f = gt.graphify(_counted, on_break="split")
    base = (torch.arange(6, device=device) % 3).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.RerecordWarning)
        for n in range(1, 25):
            x = base.clone()  # (a new tensor each call: the read is the call's data, not frozen)
            got, want = f(x, n, 2), _counted(x, n, 2)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w), (n, g, w)
    counts = [h.cache_info().currsize for h in f._breaks.backend.live()]
    assert max(counts) <= 2, counts
    # a number that sizes a tensor stays a value of the signature (and is right)
    for k in (3, 4):
        x = base.clone()
        assert torch.equal(f(x, 5, k)[-1], _counted(x, 5, k)[-1])


def test_a_piece_that_records_per_loop_index_says_why_and_a_maxsize_above_its_own():
    lin = torch.nn.Linear(4, 4)

    def step(h, i):
        return torch.tanh(lin(h) + torch.full((1, 4), float(i)) * 1e-3)  # i: a fill value, static

    def loop(h, n=40):
        for i in range(n):
            h = step(h, i)
            if h.abs().max() > 50:
                break
        return h

    f = gt.graphify(loop, on_break="split", maxsize=16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            h0 = torch.randn(2, 4)
            assert_close(f(h0), loop(h0))
    msgs = [str(m.message) for m in w if issubclass(m.category, gt.RerecordWarning)]
    assert any("TorchDynamo passes this piece a number of your code" in m for m in msgs), msgs
    again = [m for m in msgs if "cycle through more signatures" in m]
    assert again and "seen so far" in again[0]
    size = int(again[0].split("maxsize=")[-1].split(")")[0])
    assert size > 16


class _GuardedGrad(torch.autograd.Function):
    """A gradient guard: its backward reads a value on the host."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if not torch.isfinite(g).all():
            return torch.zeros_like(g)
        return g


@pytest.mark.parametrize("on_break", ["error", "eager", "split"])
def test_a_custom_backward_that_reads_on_the_host_is_named_and_taken_by_on_break(on_break):
    """odeint_adjoint's backward walks its grid on the host, as this guard does: the refusal said to stop
    updating inputs in place, and on_break did not take it (found by a bug hunt). Now it names the read
    and on_break="eager"/"split" run such calls eagerly, with eager's gradients."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())

    def make(m):
        return lambda x: _GuardedGrad.apply(m(x)).tanh()

    f, eager = gt.graphify(make(lin), on_break=on_break), make(ref)
    for i in range(3):
        x = torch.randn(2, 4)
        if on_break == "error" and i > 0:
            with pytest.raises(gt.GraphifyError, match=r"(?s)_GuardedGrad\.backward reads a value on the host.*on_break"):
                f(x).sum().backward()
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gt.EagerWarning)
            f(x).sum().backward()
        eager(x).sum().backward()
        assert_close([p.grad for p in lin.parameters()], [p.grad for p in ref.parameters()])

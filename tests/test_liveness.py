"""Output liveness (DESIGN semantics 4).

An output stays valid until the next call of the same graphified function in
the same thread (or of any function sharing its pool). Touching a stale output
raises ``OverwrittenOutputError``; never does it show the new numbers.
"""

from __future__ import annotations

import gc
import io
import os
import traceback
import warnings

import numpy as np
import pytest
import torch
from conftest import assert_close, stale
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from strategies import tensor_leaves

import gtransform as gt

# -- functions under test ---------------------------------------------------------


def step_a(x, y):
    z = x * 2 + y
    return {"z": z, "tail": z[1:], "s": (x - y).sum(), "r": [x.relu(), 3]}


def step_b(x):
    return x.cos(), x[:2] * 3


def _inputs(device, seed, n=4):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)


# -- what "reading" an output means ------------------------------------------------


def _read(kind, t):
    """One way of touching a tensor's data; returns something comparable."""
    if kind == "add":
        return t + 1
    if kind == "radd":
        return 1 + t
    if kind == "sum":
        return t.sum()
    if kind == "method":
        return t.abs()
    if kind == "torch_fn":
        return torch.mul(t, 2)
    if kind == "index":
        return t[0] if t.dim() else t[()]
    if kind == "compare":
        return t > 0
    if kind == "tolist":
        return torch.tensor(t.tolist(), dtype=t.dtype)
    if kind == "numpy":
        if t.device.type == "cpu":
            return torch.from_numpy(t.numpy().copy())
        return t.cpu()
    if kind == "asarray":
        if t.device.type == "cpu":
            return torch.from_numpy(np.array(np.asarray(t)))
        return t.to("cpu", copy=True)
    if kind == "clone":
        return t.clone()
    raise AssertionError(kind)


READS = ["add", "radd", "sum", "method", "torch_fn", "index", "compare", "tolist", "numpy", "asarray", "clone"]


def _same_device(res, ref):
    return res.to(ref.device) if isinstance(res, torch.Tensor) else res


# -- the state machine ----------------------------------------------------------------


class _Held:
    __slots__ = ("obj", "fn", "call", "expected")

    def __init__(self, obj, fn, call, expected):
        self.obj = obj
        self.fn = fn
        self.call = call
        self.expected = expected


class LivenessMachine(RuleBasedStateMachine):
    """Two graphified functions (separate pools) called in any order while the
    test holds, drops, reads, clones and views their outputs."""

    def __init__(self, device, shared=False):
        super().__init__()
        self.device = device
        self.eager = [step_a, step_b]
        pool = gt.graph_pool() if shared else None
        self.fns = [gt.graphify(step_a, pool=pool), gt.graphify(step_b, pool=pool)]
        self.shared = shared  # one pool: any call overwrites both functions' outputs
        self.calls = [0, 0]
        self.total = 0
        self.held = []  # _Held
        self.clones = []  # (tensor, expected)
        self.views = []  # (view derived by the user, expected)

    def _stale(self, h):
        if self.shared:
            return h.call < self.total
        return h.call < self.calls[h.fn]

    @rule(fn=st.integers(0, 1), seed=st.integers(0, 10_000), keep=st.sampled_from(["all", "first", "last", "none"]))
    def call(self, fn, seed, keep):
        x, y = _inputs(self.device, seed)
        args = (x, y) if fn == 0 else (x,)
        expected = self.eager[fn](*[a.clone() for a in args])
        out = self.fns[fn](*args)
        self.calls[fn] += 1
        self.total += 1
        assert_close(out, expected)
        got, exp = tensor_leaves(out), tensor_leaves(expected)
        pairs = list(zip(got, exp, strict=True))
        if keep == "first":
            pairs = pairs[:1]
        elif keep == "last":
            pairs = pairs[-1:]
        elif keep == "none":
            pairs = []
        for g, e in pairs:
            self.held.append(_Held(g, fn, self.total if self.shared else self.calls[fn], e))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000), kind=st.sampled_from(READS))
    def read(self, i, kind):
        h = self.held[i % len(self.held)]
        if self._stale(h):
            with pytest.raises(gt.OverwrittenOutputError, match=stale(("step_a", "step_b")[h.fn])):
                _read(kind, h.obj)
        else:
            assert_close(_same_device(_read(kind, h.obj), _read(kind, h.expected)), _read(kind, h.expected))

    @precondition(lambda self: self.held)
    @rule(kind=st.sampled_from(READS))
    def read_all(self, kind):
        for i in range(len(self.held)):
            self.read(i, kind)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def drop(self, i):
        del self.held[i % len(self.held)]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def clone(self, i):
        h = self.held[i % len(self.held)]
        if self._stale(h):
            with pytest.raises(gt.OverwrittenOutputError, match=stale(("step_a", "step_b")[h.fn])):
                h.obj.clone()
        else:
            self.clones.append((h.obj.clone(), h.expected))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000), how=st.sampled_from(["flat", "slice", "unsqueeze"]))
    def derive_view(self, i, how):
        h = self.held[i % len(self.held)]
        if self._stale(h):
            return
        t, e = h.obj, h.expected
        if how == "flat":
            self.views.append((t.view(-1), e.view(-1)))
        elif how == "slice" and t.dim():
            self.views.append((t[1:], e[1:]))
        else:
            self.views.append((t.unsqueeze(0), e.unsqueeze(0)))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def write_in_place(self, i):
        """The caller writes an output it holds in place (its version counter moves; its values stay,
        so every expectation holds): gtransform must not hand it out again as if untouched."""
        h = self.held[i % len(self.held)]
        if not self._stale(h):
            h.obj.mul_(1)

    @precondition(lambda self: self.views)
    @rule(i=st.integers(0, 1000))
    def write_view_in_place(self, i):
        """The caller writes a view it derived in place (the output's version counter moves with it)."""
        self.views[i % len(self.views)][0].add_(0)

    @precondition(lambda self: self.views or self.clones)
    @rule(i=st.integers(0, 1000))
    def drop_view_or_clone(self, i):
        lst = self.views if (i % 2 and self.views) or not self.clones else self.clones
        del lst[i % len(lst)]

    @invariant()
    def clones_stay_right(self):
        for c, e in self.clones:
            assert_close(c, e)

    @invariant()
    def user_views_keep_their_values(self):
        for v, e in self.views:
            assert_close(v, e)


@pytest.mark.parametrize("shared", [False, True], ids=["own-pools", "shared-pool"])
def test_liveness_state_machine(device, shared):
    run_state_machine_as_test(
        lambda: LivenessMachine(device, shared),
        settings=settings(max_examples=int(os.environ.get("GT_LIVENESS_EXAMPLES", 25)), stateful_step_count=20,
                          deadline=None),
    )


# -- plain tests -------------------------------------------------------------------------


def my_step(x):
    return x * 2


def _stale_pair(device, fn=my_step):
    """(stale output, g): an output overwritten by the next call of g."""
    g = gt.graphify(fn)
    a = g(torch.arange(4.0, device=device))
    b = g(torch.arange(4.0, device=device) + 1)
    return a, b, g


ACCESS = {
    "op_add": lambda t: t + 1,
    "op_radd": lambda t: 1 + t,
    "op_mul_self": lambda t: t * t,
    "op_eq": lambda t: t == 1,
    "op_neg": lambda t: -t,
    "torch_add": lambda t: torch.add(t, 1),
    "torch_stack": lambda t: torch.stack([t, t]),
    "method_sum": lambda t: t.sum(),
    "method_mean": lambda t: t.mean(),
    "method_add_": lambda t: t.add_(1),
    "method_clone": lambda t: t.clone(),
    "method_to": lambda t: t.to(torch.float64),
    "method_cpu": lambda t: t.cpu(),
    "method_view": lambda t: t.view(2, 2),
    "index_get": lambda t: t[0],
    "index_slice": lambda t: t[1:],
    "index_set": lambda t: t.__setitem__(0, 5.0),
    "iterate": lambda t: list(t),
    "item": lambda t: t[0].item(),
    "float": lambda t: float(t.sum()),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t.any()),
}
CPU_ONLY_ACCESS = {
    "numpy": lambda t: t.numpy(),
    "np_asarray": lambda t: np.asarray(t),
    "np_array": lambda t: _np_array(t),
}


def _np_array(t):
    # numpy 2 warns that torch.Tensor.__array__ takes no copy keyword (a torch
    # matter, also for plain tensors); only the conversion itself is tested.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return np.array(t)


@pytest.mark.parametrize("kind", list(ACCESS))
def test_stale_output_raises_on_every_access(device, kind):
    a, b, _ = _stale_pair(device)
    with pytest.raises(gt.OverwrittenOutputError, match=stale("my_step")):
        ACCESS[kind](a)
    # the fresh output is right
    assert_close(b, (torch.arange(4.0, device=device) + 1) * 2)


@pytest.mark.parametrize("kind", list(CPU_ONLY_ACCESS))
def test_stale_output_raises_on_numpy_conversion(kind):
    a, _, _ = _stale_pair("cpu")
    with pytest.raises(gt.OverwrittenOutputError, match=stale("my_step")):
        CPU_ONLY_ACCESS[kind](a)


def test_stale_output_raises_when_passed_to_a_graphified_function(device):
    a, _, _ = _stale_pair(device)
    other = gt.graphify(lambda t: t + 1)
    with pytest.raises(gt.OverwrittenOutputError, match=stale("my_step")):
        other(a)
    # and the other function still works afterwards
    assert_close(other(torch.ones(4, device=device)), torch.full((4,), 2.0, device=device))


@pytest.mark.parametrize("how", ["repr", "str", "format", "print"])
def test_printing_a_stale_output_raises(device, how):
    """DESIGN: touching a stale output by printing raises OverwrittenOutputError."""
    a, _, _ = _stale_pair(device)
    with pytest.raises(gt.OverwrittenOutputError, match=r"(?s)overwritten.*Fix:"):
        if how == "repr":
            repr(a)
        elif how == "str":
            str(a)
        elif how == "format":
            f"{a:}"
        else:
            print(a, file=io.StringIO())


def test_stale_message_names_function_and_fix(device):
    a, _, _ = _stale_pair(device)
    with pytest.raises(gt.OverwrittenOutputError) as ei:
        a.sum()
    msg = str(ei.value)
    assert "my_step" in msg
    assert ".clone()" in msg


def test_stale_message_names_the_overwriting_call_of_a_shared_pool(device):
    pool = gt.graph_pool()

    def producer(x):
        return x + 1

    def overwriter(x):
        return x * 3

    f = gt.graphify(producer, pool=pool)
    g = gt.graphify(overwriter, pool=pool)
    a = f(torch.ones(3, device=device))
    g(torch.ones(3, device=device))
    with pytest.raises(gt.OverwrittenOutputError) as ei:
        a + 1
    msg = str(ei.value)
    assert "producer" in msg
    assert "overwriter" in msg
    assert ".clone()" in msg


def test_stale_output_metadata_still_reads(device):
    # gtransform documents (StaleOutput) that metadata reads stay legal on a
    # stale output; they touch no data.
    a, _, _ = _stale_pair(device)
    assert a.shape == (4,)
    assert a.dtype == torch.float32
    assert a.device.type == device
    assert a.ndim == 1
    assert a.size() == (4,)
    assert a.numel() == 4


@pytest.mark.parametrize("inputs", ["fresh", "same"])
def test_dropped_output_object_is_handed_out_again(device, inputs):
    def fn(x):
        return {"y": x * 2, "s": x.sum(), "n": 1}

    g = gt.graphify(fn)
    x0 = torch.arange(3.0, device=device)
    out = g(x0)
    ids = (id(out["y"]), id(out["s"]))
    del out
    for k in range(1, 4):
        x = x0 if inputs == "same" else torch.arange(3.0, device=device) + k
        out = g(x)
        assert (id(out["y"]), id(out["s"])) == ids
        assert_close(out, fn(x.clone()))
        del out


@pytest.mark.parametrize("inputs", ["fresh", "same"])
def test_held_output_is_poisoned_and_a_fresh_object_returned(device, inputs):
    g = gt.graphify(my_step)
    x0 = torch.arange(4.0, device=device)
    a = g(x0)
    x1 = x0 if inputs == "same" else x0 + 1
    b = g(x1)
    assert b is not a
    with pytest.raises(gt.OverwrittenOutputError, match=stale("my_step")):
        a.sum()
    assert_close(b, x1 * 2)
    c = g(x1 + 1)
    with pytest.raises(gt.OverwrittenOutputError, match=stale("my_step")):
        b.sum()
    assert_close(c, (x1 + 1) * 2)


def test_holding_some_outputs_hands_the_dropped_ones_out_again(device):
    # per object (output group), not per call: only what the caller holds changes
    def fn(x):
        return x * 2, x + 1, x.sum()

    g = gt.graphify(fn)
    x = torch.arange(3.0, device=device)
    a, b, c = g(x)
    ib, ic = id(b), id(c)
    del b, c
    for k in range(1, 5):
        a2, b2, c2 = g(x + k)
        assert (id(b2), id(c2)) == (ib, ic)
        assert a2 is not a
        with pytest.raises(gt.OverwrittenOutputError, match=stale("fn")):
            a.sum()
        assert_close((a2, b2, c2), fn(x + k))
        a = a2
        del a2, b2, c2


@pytest.mark.parametrize("keep", ["all", "first"])
def test_a_loop_holding_the_last_output_alternates_two_generations(device, keep):
    # `y = f(x)` holds the previous output during each call: the objects of two
    # calls ago, dropped since, come back (no new objects per call)
    def fn(x):
        return {"y": x * 2, "s": x.sum()}

    g = gt.graphify(fn)
    x = torch.arange(3.0, device=device)
    seen = set()
    out = None
    for k in range(8):
        out = g(x + k) if keep == "all" else g(x + k)["y"]
        if keep == "all":
            seen.add((id(out["y"]), id(out["s"])))
            assert_close(out, fn(x + k))
        else:
            seen.add(id(out))
            assert_close(out, (x + k) * 2)
    assert len(seen) == 2


def test_a_dropped_output_made_to_require_grad_is_not_handed_out_again(device):
    # split backward: `act.requires_grad_()`, a backward into act.grad, act dropped; the next
    # call's act must start with no .grad (the reused object accumulated across calls)
    w = torch.randn(3, 2, device=device)

    def f(x):
        return x.tanh()

    g = gt.graphify(f)
    for _ in range(4):
        x = torch.randn(2, 3, device=device)
        act, act_e = g(x), f(x.clone())
        act.requires_grad_()
        act_e.requires_grad_()
        (act @ w).square().sum().backward()
        (act_e @ w).square().sum().backward()
        assert_close(act.grad, act_e.grad)
        del act


@pytest.mark.parametrize("change", ["t_", "unsqueeze_", "resize_", "add_"])
def test_a_dropped_output_changed_in_place_is_not_handed_out_again(device, change):
    g = gt.graphify(lambda x: x * 10)
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]], device=device)
    out = g(x)
    {"t_": lambda t: t.t_(), "unsqueeze_": lambda t: t.unsqueeze_(0),
     "resize_": lambda t: t.resize_(1, 2), "add_": lambda t: t.add_(1)}[change](out)
    del out
    for k in range(3):
        got = g(x + k)
        assert got.shape == (2, 2)
        assert_close(got, (x + k) * 10)
        del got


def test_separate_functions_do_not_poison_each_other(device):
    f = gt.graphify(lambda x: x + 1)
    g = gt.graphify(lambda x: x * 3)
    x = torch.arange(3.0, device=device)
    a = f(x)
    for k in range(3):
        b = g(x + k)
        assert_close(b, (x + k) * 3)
    assert_close(a, x + 1)


def test_shared_pool_poisons_across_functions(device):
    pool = gt.graph_pool()
    f = gt.graphify(lambda x: x + 1, pool=pool)
    g = gt.graphify(lambda x: x * 3, pool=pool)
    x = torch.arange(3.0, device=device)
    a = f(x)
    assert_close(a, x + 1)
    b = g(x)
    with pytest.raises(gt.OverwrittenOutputError, match=stale("<lambda>")):
        a.sum()
    assert_close(b, x * 3)
    c = f(x + 1)
    with pytest.raises(gt.OverwrittenOutputError, match=stale("<lambda>")):
        b.sum()
    assert_close(c, x + 2)


def test_outputs_that_are_inputs_are_the_callers_tensors(device):
    def fn(x, y):
        return x, x[1:], x.t(), {"y": y}, y * 2

    g = gt.graphify(fn)
    x = torch.randn(3, 3, device=device)
    y = torch.randn(3, device=device)
    r1 = g(x, y)
    assert r1[0] is x
    assert r1[3]["y"] is y
    for _k in range(3):
        x2 = torch.randn(3, 3, device=device)
        r = g(x2, y)
        assert r[0] is x2
        assert r[3]["y"] is y
        assert_close(r[4], y * 2)
    r = g(x, y)
    # the earlier results that are the caller's tensors (or views of them) are never poisoned
    assert r1[0] is x
    assert_close(r1[0], x)
    assert_close(r1[1], x[1:])
    assert_close(r1[2], x.t())
    assert_close(r1[3]["y"], y)
    # while pool outputs of an earlier call do go stale
    prev = g(x, y)
    g(x, y)
    assert prev[0] is x
    assert_close(prev[1], x[1:])
    with pytest.raises(gt.OverwrittenOutputError, match=stale("fn")):
        prev[4].sum()


def test_views_of_inputs_returned_are_views_of_the_callers_tensor(device):
    def fn(x):
        return x[1:], x.t(), x.view(-1)[2:5], x[:, 0]

    g = gt.graphify(fn)
    for _ in range(3):
        x = torch.randn(3, 3, device=device)
        outs = g(x)
        for o, e in zip(outs, fn(x), strict=True):
            assert o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert (o.shape, o.stride(), o.storage_offset()) == (e.shape, e.stride(), e.storage_offset())
            assert_close(o, e)
        # they follow the caller's tensor
        x.add_(1)
        for o, e in zip(outs, fn(x), strict=True):
            assert_close(o, e)


@pytest.mark.parametrize("keep_output", [True, False])
def test_user_view_keeps_its_values(device, keep_output):
    g = gt.graphify(lambda x: x * 2 + 1)
    x = torch.arange(6.0, device=device)
    a = g(x)
    v1 = a[2:]
    v2 = a.view(2, 3)
    want1, want2 = (x * 2 + 1)[2:], (x * 2 + 1).view(2, 3)
    if not keep_output:
        del a
    for k in range(1, 4):
        b = g(x + 10 * k)
        assert_close(b, (x + 10 * k) * 2 + 1)
        assert_close(v1, want1)
        assert_close(v2, want2)
    if keep_output:
        with pytest.raises(gt.OverwrittenOutputError, match=stale("<lambda>")):
            a.sum()


def test_user_view_of_a_view_output_keeps_its_values(device):
    def fn(x):
        y = x * 2
        return y, y[1:]

    g = gt.graphify(fn)
    x = torch.arange(5.0, device=device)
    _, tail = g(x)
    v = tail[:2]
    del tail
    gc.collect()
    for k in range(1, 3):
        y, t = g(x + k)
        assert_close(y, (x + k) * 2)
        assert_close(t, ((x + k) * 2)[1:])
        del y, t
    assert_close(v, (x * 2)[1:3])


def _count_captures(monkeypatch):
    """A list that grows by one per CUDA graph capture."""
    n = []
    if torch.cuda.is_available():
        real = torch.cuda.CUDAGraph.capture_begin

        def counted(self, *a, **k):
            n.append("".join(traceback.format_stack(limit=9)[:-1]))  # who captured, for the failure message
            return real(self, *a, **k)

        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counted)
    return n


@pytest.mark.parametrize("keep", [1, 4])
def test_views_of_the_last_calls_keep_their_values_without_recapturing(device, monkeypatch, keep):
    # history.append(out[0]) with the last `keep` views kept: each view keeps its
    # own call's values, and the recording alternates between a few output
    # generations instead of capturing again on every call (DESIGN 4: holding
    # views must not make calls slow).
    g = gt.graphify(lambda x: (x * 2 + 1, x.sum()))
    x0 = torch.arange(6.0, device=device)
    xs = [x0 + 10 * k for k in range(24)]  # distinct tensors (no address reused)
    g(x0)  # recorded
    captures = _count_captures(monkeypatch)
    history = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.RerecordWarning)
        for k in range(24):
            x = xs[k]
            y, s = g(x)
            history.append((y[0], y[1:3], (x * 2 + 1)[0], (x * 2 + 1)[1:3]))
            history = history[-keep:]
            for v0, v1, w0, w1 in history:
                assert_close(v0, w0)
                assert_close(v1, w1)
            assert_close(s, x.sum())
    # one new output generation per extra view kept, then none
    assert len(captures) <= keep, f"{len(captures)} captures for {keep} kept call(s) of views:\n" + "\n---\n".join(captures)


def test_views_dropped_free_their_generation_for_reuse(device, monkeypatch):
    g = gt.graphify(lambda x: x * 3)
    x = torch.ones(8, device=device)
    xs = [x + k for k in range(3)]  # distinct tensors (no address reused)
    g(x)
    captures = _count_captures(monkeypatch)
    for _round in range(4):
        held = [g(xs[k])[:4] for k in range(3)]  # views of three calls
        for k, v in enumerate(held):
            assert_close(v, ((x + k) * 3)[:4])
        del held, v  # every view dropped
    assert len(captures) <= 2, "\n---\n".join(captures)


def test_views_of_more_calls_than_the_ring_warn_once_and_stay_right(device, monkeypatch):
    if device != "cuda":
        pytest.skip("the CPU backend moves outputs to new memory without a capture")
    from gtransform._record import RING_SLOTS

    g = gt.graphify(lambda x: x - 1)
    x = torch.zeros(4, device=device)
    history = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for k in range(RING_SLOTS + 6):
            history.append((g(x + k)[1:], (x + k - 1)[1:]))
    msgs = [str(m.message) for m in w if issubclass(m.category, gt.RerecordWarning)]
    assert len(msgs) == 1, msgs
    assert "<lambda>" in msgs[0] and ".clone()" in msgs[0] and "views" in msgs[0]
    for v, want in history:
        assert_close(v, want)


def test_views_held_across_calls_of_a_shared_pool_keep_their_values(device):
    pool = gt.graph_pool()
    f = gt.graphify(lambda x: x + 1, pool=pool)
    h = gt.graphify(lambda x: (x * 5, x * 7), pool=pool)
    x = torch.arange(4.0, device=device)
    views = []
    for k in range(10):
        views.append((f(x + k)[:2], (x + k + 1)[:2]))
        a, b = h(x - k)
        assert_close(a, (x - k) * 5)
        assert_close(b, (x - k) * 7)
        views = views[-3:]
        for v, want in views:
            assert_close(v, want)


def test_an_output_autograd_saved_and_then_overwritten_is_an_error_not_new_numbers():
    """`loss = (w * f(x)).sum()` saves f's output inside autograd, where reference counts cannot
    see it; the next call writes that memory again. Before: loss.backward() silently used the
    next call's numbers; now autograd raises, as eager does for a tensor changed in place."""
    g = gt.graphify(lambda x: x * 3)
    w = torch.ones(2, requires_grad=True)
    losses = []
    for b in (torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])):
        y = g(b)
        losses.append((w * y).sum())
        del y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses[0].backward()
    # the last call's loss is intact
    w.grad = None
    losses[1].backward()
    assert w.grad.tolist() == [30.0, 60.0]


def test_views_held_of_a_function_reading_its_inputs_in_place(device):
    """The same tensor objects every call (read where they are, no copy; updated in place
    between calls, as an optimizer does): the output generations that held views need are
    made from the fast path, on this call's tensors, and every view keeps its own call's
    values."""
    w = torch.arange(4.0, device=device)
    x = torch.ones(4, device=device)
    g = gt.graphify(lambda w, x: (w * x + 1, w.sum()))
    history = []
    for _ in range(12):
        w.add_(1)
        y, s = g(w, x)
        history.append((y[1:], (w * x + 1)[1:]))
        history = history[-5:]
        for v, want in history:
            assert_close(v, want)
        assert_close(s, w.sum())
    assert g.cache_info().hits >= 9


def test_views_held_of_a_recurrent_state_fed_back(device):
    """`h = g(h, w)` keeping views of the last calls' states: the fed-back output is the
    caller's argument while the next call poisons it."""
    w = torch.full((4,), 0.5, device=device)
    g = gt.graphify(lambda h, w: torch.tanh(h * w + 1))
    h = torch.zeros(4, device=device)
    he = h.clone()
    views = []
    for _ in range(12):
        h = g(h, w)
        he = torch.tanh(he * w + 1)
        views.append((h[:2], he[:2].clone()))
        views = views[-4:]
        for v, want in views:
            assert_close(v, want)

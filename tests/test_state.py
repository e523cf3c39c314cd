"""State (DESIGN semantics 10): modules, optimizers and caches give eager's numbers, or a clear error."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import gc
import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import HAS_CUDA, assert_close, line_of
from hypothesis import given
from hypothesis import strategies as st

import gtransform as gt


def _mlp(device, seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers).to(device)


def _batches(device, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)) for _ in range(n)]


def _whole_step_run(device, make_opt, graph, steps=20):
    model = _mlp(device)
    opt = make_opt(model.parameters())

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    f = gt.graphify(step) if graph else step
    losses = [f(x, y).detach().clone() for x, y in _batches(device, steps)]
    return losses, model, f


def _assert_models_close(a, b, atol=1e-5):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        if p.grad is None:
            assert q.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=1e-4)
    for p, q in zip(a.buffers(), b.buffers()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4)


_OPTS = {
    "sgd": lambda cuda: (lambda p: torch.optim.SGD(p, lr=0.05)),
    "sgd_momentum": lambda cuda: (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "sgd_momentum_loop": lambda cuda: (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False)),
    "adam_foreach": lambda cuda: (lambda p: torch.optim.Adam(p, lr=1e-2, capturable=cuda, foreach=True)),
    "adam_loop": lambda cuda: (lambda p: torch.optim.Adam(p, lr=1e-2, capturable=cuda, foreach=False)),
    "adamw_foreach": lambda cuda: (lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=cuda, foreach=True)),
    "adamw_loop": lambda cuda: (lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=cuda, foreach=False)),
}


@pytest.mark.parametrize("opt_name", list(_OPTS))
def test_whole_training_step_matches_eager(device, opt_name):
    """opt.zero_grad(); loss.backward(); opt.step() inside the function, 20 steps."""
    make = _OPTS[opt_name](device == "cuda")
    want_losses, want, _ = _whole_step_run(device, make, graph=False)
    if device == "cpu" and opt_name.startswith("adam"):
        # Adam reads its step count on the host unless capturable=True (GPU-only in torch):
        # refused with that fix; torch releases whose foreach Adam keeps it on the device
        # (2.15) are recorded, and must then give eager's numbers
        try:
            got_losses, got, f = _whole_step_run(device, make, graph=True)
        except gt.GraphifyError as e:
            assert "capturable=True" in str(e)
            return
    else:
        got_losses, got, f = _whole_step_run(device, make, graph=True)
    for a, b in zip(want_losses, got_losses):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    _assert_models_close(want, got)
    info = f.cache_info()
    assert info.misses == 2 and info.hits == 18  # first call eager, recorded once, replayed


def test_adam_refusal_leaves_optimizer_usable():
    model = _mlp("cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    (x, y), = _batches("cpu", 1)
    f = gt.graphify(step)
    f(x, y)  # eager first call
    with pytest.raises(gt.GraphifyError) as ei:
        f(x, y)
    msg = str(ei.value)
    assert "test_state.py" in msg  # the user's line
    assert "capturable=True" in msg and "opt.step() outside" in msg
    # nothing of the trace was left behind: state is real and eager keeps working
    for s in opt.state.values():
        for v in s.values():
            assert type(v) is torch.Tensor
    for p in model.parameters():
        assert type(p.grad) is torch.Tensor
    step(x, y)


def test_tensor_lr_with_scheduler_matches_eager(device):
    def run(graph):
        model = _mlp(device)
        lr = torch.tensor(0.01 if device == "cuda" else 0.1, device=device)
        if device == "cuda":
            opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=True)
        else:  # the foreach SGD takes a tensor lr without reading it on the host
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

        def step(x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        f = gt.graphify(step) if graph else step
        for x, y in _batches(device, 20):
            f(x, y)
            sched.step()
        return model, f

    want, _ = run(False)
    got, f = run(True)
    _assert_models_close(want, got)
    assert f.cache_info().misses == 2  # a tensor lr changes in place: no new signature


def test_python_float_lr_change_is_a_new_signature(device):
    """A Python hyperparameter is part of the signature: never frozen into a recording."""
    def run(graph):
        model = _mlp(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

        f = gt.graphify(step) if graph else step
        for i, (x, y) in enumerate(_batches(device, 12)):
            if i == 6:
                opt.param_groups[0]["lr"] = 0.01
            f(x, y)
        return model, f

    want, _ = run(False)
    got, f = run(True)
    _assert_models_close(want, got)
    assert "optimizer" in f.describe()


@pytest.mark.parametrize("bn", [False, True])
def test_graphified_module_with_backward_outside(device, bn):
    """gmodel = graphify(model); loss(gmodel(x)).backward(); opt.step() outside: like eager."""
    def run(graph):
        model = _mlp(device, bn=bn)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = gt.graphify(model) if graph else model
        losses = []
        for x, y in _batches(device, 20):
            opt.zero_grad()
            loss = F.mse_loss(g(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
        return model, losses

    want, lw = run(False)
    got, lg = run(True)
    for a, b in zip(lw, lg):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    _assert_models_close(want, got)


def test_closed_over_parameters_get_gradients(device):
    lin = nn.Linear(4, 2).to(device)
    ref = nn.Linear(4, 2).to(device)
    ref.load_state_dict(lin.state_dict())
    g = gt.graphify(lambda x: lin(x).tanh())
    x = torch.randn(3, 4, device=device)
    for _ in range(3):
        g(x).sum().backward()
        ref(x).tanh().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


class _Counter(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.register_buffer("n", torch.zeros((), device=device))

    def forward(self, x):
        self.n += 1
        return x * self.n


def test_counter_buffer_updates_once_per_call(device):
    m = _Counter(device)
    f = gt.graphify(m)
    x = torch.ones(2, device=device)
    got = [f(x)[0].item() for _ in range(5)]
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert m.n.item() == 5.0


def test_replaced_state_is_seen(device):
    lin = nn.Linear(2, 1).to(device)
    nn.init.constant_(lin.weight, 1.0)
    nn.init.constant_(lin.bias, 1.0)
    f = gt.graphify(lambda x: lin(x))
    x = torch.ones(2, device=device)
    with torch.no_grad():
        assert f(x).item() == 3.0
        assert f(x).item() == 3.0
        lin.weight.data = torch.zeros(1, 2, device=device)
        assert f(x).item() == 1.0
        lin.weight = nn.Parameter(torch.full((1, 2), 2.0, device=device))
        assert f(x).item() == 5.0
        lin.load_state_dict({"weight": torch.full((1, 2), 3.0, device=device), "bias": torch.zeros(1, device=device)}, assign=True)
        assert f(x).item() == 6.0
        lin.double()
        assert f(x.double()).item() == 6.0
        assert f(x.double()).dtype == torch.float64


def test_training_flag_and_hooks_are_in_the_signature(device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(device)
    g = gt.graphify(m)
    x = torch.ones(1, 64, device=device)
    with torch.no_grad():
        g(x)
        g(x)
        m.eval()
        assert torch.equal(g(x), m(x))
        h = m[0].register_forward_hook(lambda mod, i, o: o * 0)
        assert g(x).abs().sum().item() == 0
        h.remove()
        assert torch.equal(g(x), m(x))
        m.train()
        y = g(x)
        assert (y == 0).sum() > 8  # dropout is on again (P(fewer) < 1e-9)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


# (build the module, change one of its plain Python attributes, the attribute's path)
_ATTR_CASES = {
    "user float": (lambda: _Scaled(), lambda m: setattr(m, "scale", 5.0), "scale"),
    "BatchNorm momentum": (lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)),
                           lambda m: setattr(m[1], "momentum", 0.7), "1.momentum"),
    "LeakyReLU slope (no tensors)": (lambda: nn.LeakyReLU(0.1), lambda m: setattr(m, "negative_slope", 0.5),
                                     "negative_slope"),
    "GELU approximate (a string)": (lambda: nn.GELU(), lambda m: setattr(m, "approximate", "tanh"), "approximate"),
    "Conv1d padding (a tuple)": (lambda: nn.Conv1d(6, 6, 3, padding=1), lambda m: setattr(m, "padding", (0,)),
                                 "padding"),
}


@pytest.mark.parametrize("case", list(_ATTR_CASES))
def test_a_module_attribute_changed_between_calls_is_seen(device, case, caplog):
    """The trace reads `bn.momentum`, `self.scale`... as constants: a new value must be a new
    trace (eager's numbers), never the recorded old value, and then replays again."""
    make, change, path = _ATTR_CASES[case]
    torch.manual_seed(0)
    m = make().to(device)
    ref = make().to(device)
    ref.load_state_dict(m.state_dict())
    g = gt.graphify(lambda x: m(x))
    x = torch.randn(4, 6, 5, device=device) if "Conv" in case else torch.randn(4, 6, device=device)
    for _ in range(3):
        assert_close(g(x), ref(x))
    owner, name = (m[1], "momentum") if "." in path else (m, path)
    ref_owner = ref[1] if "." in path else ref
    old = getattr(owner, name)
    change(m)
    change(ref)
    with caplog.at_level("INFO", logger="gtransform"):
        for _ in range(3):
            assert_close(g(x), ref(x))
    assert any(f"module attribute m.{path}:" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    assert_close(m.state_dict(), ref.state_dict())  # BatchNorm: running stats with the new momentum
    misses = g.cache_info().misses
    for _ in range(3):  # recorded again: replays from now on
        assert_close(g(x), ref(x))
    assert g.cache_info().misses == misses
    setattr(owner, name, old)  # and back
    setattr(ref_owner, name, old)
    for _ in range(3):
        assert_close(g(x), ref(x))
    assert_close(m.state_dict(), ref.state_dict())


@given(values=st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, -3.0]), st.sampled_from([0.0, 0.1, 0.9]),
                                   st.booleans()), min_size=1, max_size=8))
def test_module_attributes_changed_in_any_order_follow_eager(values):
    """Any sequence of (scale, momentum, training) settings between calls: every call gives
    eager's output and leaves eager's running statistics."""
    torch.manual_seed(0)

    def make():
        m = nn.Sequential(_Scaled(), nn.BatchNorm1d(6))
        return m

    m, ref = make(), make()
    ref.load_state_dict(m.state_dict())
    g = gt.graphify(lambda x: m(x))
    x = torch.randn(4, 6)
    for scale, momentum, training in values:
        for mod in (m, ref):
            mod[0].scale = scale
            mod[1].momentum = momentum
            mod.train(training)
        for _ in range(2):
            assert_close(g(x), ref(x))
        assert_close(m.state_dict(), ref.state_dict())


def test_a_module_attribute_the_function_does_not_read_may_change_freely(device):
    """`model.step = i` set by the training loop on every call is not read by forward: no new
    trace (a retrace per call would be a cliff), and the module keeps its own class."""
    m = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)).to(device)
    cls = type(m[1])
    g = gt.graphify(lambda x: m(x))
    x = torch.randn(4, 6, device=device)
    for i in range(10):
        m.step = i
        m[1].seen = float(i)
        g(x)
    assert g.cache_info().misses == 2  # the eager first call and the recorded one
    assert type(m[1]) is cls and type(m) is nn.Sequential
    m[1].momentum = 0.3  # read by forward: seen
    ref = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)).to(device)
    ref.load_state_dict(m.state_dict())
    ref[1].momentum = 0.3
    for _ in range(2):
        assert_close(g(x), ref(x))
    assert_close(m.state_dict(), ref.state_dict())


def test_batchnorm_momentum_set_to_none_is_refused_not_replayed(device):
    """momentum=None (a cumulative average: 1 / num_batches_tracked, read on the host) cannot
    be recorded: after the change the call must raise, not replay the old momentum."""
    m = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)).to(device)
    g = gt.graphify(lambda x: m(x))
    x = torch.randn(4, 6, device=device)
    for _ in range(3):
        g(x)
    m[1].momentum = None
    with pytest.raises(gt.GraphifyError, match="reads a tensor's value on the host") as info:
        for _ in range(2):
            g(x)
    # the message says which read, and the fix for it
    assert "batchnorm.py" in str(info.value) and "momentum=0.1" in str(info.value)


def test_a_batchnorm_graphified_directly_with_momentum_none_names_its_line():
    g = gt.graphify(nn.BatchNorm1d(4, momentum=None))
    with pytest.raises(gt.GraphifyError) as info:
        for _ in range(2):
            g(torch.randn(8, 4))
    msg = str(info.value)
    assert "<string>" not in msg and "batchnorm.py" in msg and "momentum=0.1" in msg


def test_escape_into_a_list_is_an_error(device):
    log = []

    def f(x):
        y = x * 2
        log.append(y)
        return y + 1

    g = gt.graphify(f)
    with pytest.raises(gt.GraphifyError, match=r"escapes into Python state: log") as ei:
        g(torch.ones(2, device=device))
    assert "Fix:" in str(ei.value)
    assert log == []  # nothing of the trace was left in it
    log.clear()


class _Holder:
    pass


class _Stash:
    def __init__(self, t):
        self.t = t


@dataclasses.dataclass
class _Pair:
    t: torch.Tensor
    n: int


_NT = collections.namedtuple("_NT", ["t", "n"])


def _shown(v):
    """``v`` as plain Python values (tensors as lists), to compare state; a FakeTensor fails."""
    if isinstance(v, torch.Tensor):
        assert type(v) in (torch.Tensor, nn.Parameter), f"a {type(v).__name__} was left in state"
        return ("tensor", v.tolist())
    if isinstance(v, dict):
        return {k: _shown(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_shown(x) for x in v])
    if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, type)):
        return (type(v).__name__, _shown(vars(v)))
    return v


# a new object holding a tensor made inside the function, stored into state it reaches: the
# container it lives in, and the store
_STORES = {
    "object in a dict": (dict, lambda s, y: s.__setitem__("b", _Stash(y))),
    "namespace in a dict": (dict, lambda s, y: s.__setitem__("b", types.SimpleNamespace(t=y))),
    "dataclass in a dict": (dict, lambda s, y: s.__setitem__("b", _Pair(y, 1))),
    "namedtuple in a dict": (dict, lambda s, y: s.__setitem__("b", _NT(y, 1))),
    "list in an attribute": (types.SimpleNamespace, lambda s, y: setattr(s, "t", [y])),
    "tuple in an attribute": (_Holder, lambda s, y: setattr(s, "t", (y, 2))),
    "dict in a list": (lambda: [None], lambda s, y: s.__setitem__(0, {"t": y})),
    "tuple appended to a list": (list, lambda s, y: s.append((y,))),
}


@pytest.mark.parametrize("reads_state", [False, True], ids=["pure", "reads-state"])
@pytest.mark.parametrize("how", list(_STORES))
def test_a_new_object_holding_a_traced_tensor_stored_in_state_is_refused_untouched(device, how, reads_state):
    """Before: recorded as if pure, so replays stored nothing (the first call's value stayed:
    [4, 8, 12] where eager gives [4, 8, 14]), and the caller's object held a FakeTensor or had
    its attributes emptied. Now eager's values on the calls made, then a GraphifyError with the
    fix, and the state as the caller left it before the refused call."""
    make, store = _STORES[how]
    w = torch.ones(1, device=device)

    def fn_of(state):
        def fn(x):
            y = x * 2 * w if reads_state else x * 2
            store(state, y)
            return x + 1
        return fn

    state, ref = make(), make()
    g, eager = gt.graphify(fn_of(state)), fn_of(ref)
    refused = None
    for k, v in enumerate([2.0, 4.0, 7.0]):
        x = torch.tensor([v], device=device)
        before = _shown(state)
        try:
            out = g(x)
        except gt.GraphifyError as e:
            refused = k, str(e)
            assert _shown(state) == before  # the caller's object exactly as before the call
            break
        assert_close(out, eager(x))
        assert _shown(state) == _shown(ref)  # eager's (a first call that ran eagerly)
    assert refused is not None and refused[0] <= 1, refused
    msg = refused[1]
    assert "test_state.py" in msg and "Fix:" in msg  # where the tensor was made, and the fix
    if how == "tuple appended to a list":
        assert "escapes into Python state: state[0] (appended: a new tuple" in msg
        assert "Fix: return the tensor from the function" in msg
    else:
        assert "stores a new" in msg and "holding a tensor made inside it" in msg
        assert "Fix: store the tensor itself in the slot" in msg and "return the tensor" in msg


class _Memo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.memo = types.SimpleNamespace(t=torch.zeros(1, 3))

    def forward(self, x):
        return self.lin(x)


def test_a_new_object_stored_on_a_module_the_function_calls_is_refused_after_an_eager_first_call(device):
    """`mod.memo = SimpleNamespace(t=y)` in a step that calls mod: before, the trace's object (a
    FakeTensor inside) stayed on the module, and the first call, eager, then failed on it."""
    torch.manual_seed(0)
    model, ref = _Memo().to(device), _Memo().to(device)
    ref.load_state_dict(model.state_dict())

    def step_of(mod):
        def step(x):
            y = mod(x)
            mod.memo = types.SimpleNamespace(t=y)
            return y.sum()
        return step

    g, eager = gt.graphify(step_of(model)), step_of(ref)
    x = torch.randn(1, 3, device=device)
    assert_close(g(x), eager(x))  # the first call reads state: eager, exactly
    assert type(model.memo.t) is torch.Tensor
    assert_close(model.memo.t, ref.memo.t)
    kept = model.memo
    with pytest.raises(gt.GraphifyError, match=r"(?s)stores a new SimpleNamespace holding a tensor made inside it "
                       r"in mod\.memo \(the tensor: mod\.memo\.t\).*test_state\.py.*Fix: store the tensor itself"):
        g(x * 2)
    assert model.memo is kept and _shown(vars(model.memo)) == _shown(vars(ref.memo))
    assert_close(model(x), ref(x))  # the module stays usable


def test_an_object_made_once_on_first_use_and_updated_in_place_is_eagers(device):
    """A cache object made lazily by the first call, then updated in place: the first call runs
    eagerly (making it for real), the next ones are recorded. Before: the trace's object, holding
    a FakeTensor, was left in the dict and the first call failed on it."""
    memo, ref = {}, {}

    def fn_of(m):
        def fn(x):
            if "acc" not in m:
                m["acc"] = _Stash(torch.zeros(2, device=x.device))
            m["acc"].t.add_(x)
            return m["acc"].t * 2
        return fn

    g, eager = gt.graphify(fn_of(memo)), fn_of(ref)
    for v in [1.0, 2.0, 5.0, -1.0]:
        x = torch.full((2,), v, device=device)
        assert_close(g(x), eager(x))
        assert _shown(memo) == _shown(ref)
    assert g.cache_info().currsize == 1


class _LazyCacheAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.cache = None

    def forward(self, x):
        if self.cache is None:  # made on first use
            self.cache = {"acc": torch.zeros(3, device=x.device)}
        self.cache["acc"].add_(self.lin(x).sum(0))
        return self.cache["acc"] * 1


def test_a_module_attribute_made_on_first_use_holding_a_tensor_is_eagers(device):
    """`self.cache = {"acc": torch.zeros(3)}` where it was None: before, the trace left its dict
    (a FakeTensor inside) on the module, as only a new attribute or a bare tensor was put back,
    and the eager first call then failed on it ("used after the trace")."""
    torch.manual_seed(0)
    m, ref = _LazyCacheAttr().to(device), _LazyCacheAttr().to(device)
    ref.load_state_dict(m.state_dict())
    g = gt.graphify(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 3, device=device)
            assert_close(g(x), ref(x))
            assert_close(m.cache["acc"], ref.cache["acc"])
    assert g.cache_info().currsize == 1


def test_traced_tensor_used_after_the_trace_raises(device):
    deep = {"a": {"b": {"c": {"d": {"e": _Holder()}}}}}

    def f(x):
        y = x * 2
        deep["a"]["b"]["c"]["d"]["e"].y = y  # deeper than gtransform looks
        return y + 1

    g = gt.graphify(f)
    g(torch.ones(2, device=device))
    leaked = deep["a"]["b"]["c"]["d"]["e"].y
    with pytest.raises(gt.GraphifyError, match="used after the trace") as ei:
        leaked + 1
    assert "test_state.py" in str(ei.value)  # where it was made


@dataclasses.dataclass
class _Out:
    a: torch.Tensor
    b: int


def test_output_containers(device):
    x = torch.ones(2, device=device)
    o = gt.graphify(lambda x: _Out(x * 2, 3))(x)
    assert type(o) is _Out and type(o.a) is torch.Tensor and o.b == 3
    assert_close(o.a, x * 2)


def test_distribution_output_is_rebuilt_on_every_call(device):
    """A plain object made inside (torch.distributions.Normal) comes back as a new object of its
    class on every call, holding real tensors with eager's values; it was refused."""
    g = gt.graphify(lambda x: torch.distributions.Normal(x, x.exp(), validate_args=False))
    seen = []
    for _ in range(3):
        x = torch.randn(4, device=device)
        d = g(x)
        assert type(d) is torch.distributions.Normal and type(d.loc) is torch.Tensor
        assert_close(d.log_prob(x), torch.distributions.Normal(x, x.exp()).log_prob(x))
        assert_close(d.scale, x.exp())
        assert all(d is not s for s, _ in seen)
        seen.append((d, x))
    assert g.cache_info().currsize == 1
    # an older call's object is an output like any other: its own call's numbers, or the
    # overwritten error, never the latest call's numbers
    for d, x in seen:
        try:
            loc = d.loc + 0
        except gt.OverwrittenOutputError:
            continue
        assert_close(loc, x)


def test_torch_pytree_registered_output():
    """Types registered with torch.utils._pytree (e.g. Hugging Face's ModelOutput) come back real."""
    import collections

    import torch.utils._pytree as tp

    class Pair(collections.OrderedDict):
        pass

    tp.register_pytree_node(Pair, lambda p: (list(p.values()), list(p.keys())),
                            lambda vals, keys: Pair(zip(keys, vals)))
    out = gt.graphify(lambda x: Pair(a=x + 1, b=x * 2))(torch.ones(2))
    assert type(out) is Pair and type(out["a"]) is torch.Tensor
    assert_close(out["b"], torch.full((2,), 2.0))


class _Layer:
    def __init__(self, k: torch.Tensor):
        self.keys = k


class _Cache:
    """Like Hugging Face's DynamicCache: its tensors two levels down (``.layers[i].keys``)."""

    def __init__(self):
        self.layers: list = []


class _WithCache(collections.OrderedDict):
    pass


def test_output_object_holding_tensors_deeper_down_is_rebuilt(device):
    """An opaque output object whose tensors sit in a list of objects (a DynamicCache returned
    with the logits) is rebuilt on every call from its attributes, at every depth; before, it
    came back holding the trace's placeholders, and then it was refused."""
    import torch.utils._pytree as tp

    if _WithCache not in tp.SUPPORTED_NODES:
        tp.register_pytree_node(_WithCache, lambda p: (list(p.values()), list(p.keys())),
                                lambda vals, keys: _WithCache(zip(keys, vals)))

    def fn(x):
        c = _Cache()
        c.layers.append(_Layer(x * 2))
        c.layers.append(_Layer(x * 3))
        c.seen = 7
        return _WithCache(logits=x + 1, cache=c)

    g = gt.graphify(fn)
    for k in range(3):
        x = torch.full((2,), float(k), device=device)
        out = g(x)
        c = out["cache"]
        assert type(c) is _Cache and type(c.layers) is list and c.seen == 7
        assert [type(layer) for layer in c.layers] == [_Layer, _Layer]
        assert_close(c.layers[0].keys, x * 2)
        assert_close(c.layers[1].keys, x * 3)
        assert_close(out["logits"], x + 1)
        c.layers.append("mine")  # the caller's own object: the next call's is a new one
    assert g.cache_info().currsize == 1
    # an object holding no tensor is returned as is
    marker = object()
    g = gt.graphify(lambda x: _WithCache(logits=x + 1, cache=marker))
    for _ in range(2):
        out = g(x)
        assert out["cache"] is marker
        assert_close(out["logits"], x + 1)


class _Slotted:
    __slots__ = ("keys",)

    def __init__(self, k: torch.Tensor):
        self.keys = k


class _OwnCopy:
    def __init__(self, k: torch.Tensor):
        self.k = k

    def __reduce__(self):
        return (_OwnCopy, (self.k,))


class _Box:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Scaler:
    def __init__(self, w: torch.Tensor):
        self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def test_objects_inside_a_returned_object_are_new_on_every_call_unless_shared(device):
    """What the function made (a set, a Counter, an object without tensors, a TanhTransform and
    its sample cache) is new in every call's object, as in eager: one call's changes never
    show in the next call's. What the function only refers to (a config, a parameter) stays
    the same object."""
    import collections

    config = _Box(name="cfg")
    lin = torch.nn.Linear(2, 2).to(device)

    def fn(x):
        return _Box(t=x * 2, tags=set(), meta=_Box(step=0), cnt=collections.Counter(), config=config,
                    w=lin.weight, scale=_Scaler(x + 1))

    g = gt.graphify(fn)
    for k in range(3):
        x = torch.full((2,), float(k), device=device)
        o = g(x)
        assert o.tags == set() and o.meta.step == 0 and dict(o.cnt) == {}, (k, o.tags, o.meta.step, o.cnt)
        assert o.config is config and o.w is lin.weight
        assert type(o.scale) is _Scaler and type(o.scale.w) is torch.Tensor  # a callable object, rebuilt
        assert_close(o.scale(x), x * (x + 1))
        o.tags.add(k)
        o.meta.step += 1
        o.cnt["a"] += 1

    # the SAC pattern: a tanh-squashed Normal whose transform caches its last sample
    D = torch.distributions

    def policy(mu):
        return D.TransformedDistribution(D.Normal(mu, mu.exp(), validate_args=False),
                                         [D.transforms.TanhTransform(cache_size=1)], validate_args=False)

    g = gt.graphify(policy)
    x1, x2 = torch.full((4,), 3.0, device=device), torch.zeros(4, device=device)
    d1, e1 = g(x1), policy(x1)
    torch.manual_seed(1)
    a = d1.rsample()
    torch.manual_seed(1)
    assert_close(a, e1.rsample())
    d2, e2 = g(x2), policy(x2)
    assert d2.transforms[0] is not d1.transforms[0]
    torch.testing.assert_close(d2.log_prob(a), e2.log_prob(a), equal_nan=True)  # no cache hit from call 1's sample


def test_trace_tensor_found_at_any_position(device):
    """The search for the trace's tensors does not stop after a few hundred items."""
    g = gt.graphify(lambda x: _Box(items=[None] * 300 + [x * 2], d={f"k{i}": i for i in range(300)} | {"t": x + 1}))
    for k in range(3):
        x = torch.full((2,), float(k), device=device)
        o = g(x)
        assert type(o.items[-1]) is torch.Tensor and type(o.d["t"]) is torch.Tensor
        assert_close(o.items[-1], x * 2)
        assert_close(o.d["t"], x + 1)


def test_output_object_that_cannot_be_rebuilt_is_refused(device):
    """Objects whose state is not all in __dict__, that copy themselves their own way, or that
    hold themselves are refused, naming where the tensor is and the fix."""
    x = torch.ones(2, device=device)

    def cyclic(x):
        c = _Cache()
        c.layers.append(_Layer(x * 2))
        c.layers[0].owner = c
        return c

    import weakref

    def closure(x):
        y = x * 2
        return _Box(f=lambda: y)

    cases = [
        (lambda x: {"c": [_Slotted(x * 2)]}, "output['c'][0] is a _Slotted object", "output['c'][0].keys", "__slots__"),
        (lambda x: _OwnCopy(x * 2), "output is a _OwnCopy object", "output.k", "__reduce__"),
        (cyclic, "is a _Cache object", ".layers[0].keys", "holds itself"),
        (closure, "output.f is a function object", "output.f.<closure y>", "closure"),
        (lambda x: _Box(t=(t := x * 2), r=weakref.ref(t)), "output.r is a ReferenceType", "output.r()", "weak reference"),
    ]
    for fn, what, where, why in cases:
        with pytest.raises(gt.GraphifyError) as ei:
            gt.graphify(fn)(x)
        msg = str(ei.value)
        assert what in msg and where in msg and why in msg, msg
        assert "register_pytree_node" in msg, msg


def test_traced_tensor_made_in_generated_code_names_the_users_line():
    """A tensor made in code without a file (exec, a dataclass's __init__) and leaked is located at
    the user's line that called that code, not at <string>:1."""
    ns: dict = {}
    exec("def make(x, box):\n    box.append(x * 3)\n", ns)
    box: list = []

    def fn(x):
        ns["make"](x, box)  # MAKE
        return x + 1

    with pytest.raises(gt.GraphifyError, match="appended") as ei:  # refused when traced
        gt.graphify(fn)(torch.ones(2))
    assert f"made at {__file__}:{line_of(fn, '# MAKE')}" in str(ei.value), str(ei.value)


class _Dec(nn.Module):
    """A decoder step with a KV cache in buffers, updated in place."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(8, 8)
        self.register_buffer("k", torch.zeros(1, 16, 8))
        self.register_buffer("v", torch.zeros(1, 16, 8))

    def forward(self, x, pos):
        k, v = self.kv(x).chunk(2, -1)
        self.k.index_copy_(1, pos, k)
        self.v.index_copy_(1, pos, v)
        mask = (torch.arange(16, device=x.device) <= pos).view(1, 1, 16)
        att = (self.q(x) @ self.k.transpose(1, 2)).masked_fill(~mask, -1e9).softmax(-1)
        return self.o(att @ self.v)


def test_kv_cache_decoder_matches_eager(device):
    outs = []
    for graph in (False, True):
        torch.manual_seed(0)
        d = _Dec().to(device)
        f = gt.graphify(d) if graph else d
        x = torch.randn(1, 1, 8, device=device)
        steps = []
        with torch.no_grad():
            for t in range(12):
                x = f(x, torch.tensor([t], device=device)).clone()
                steps.append(x)
        outs.append(torch.cat(steps))
    torch.testing.assert_close(outs[0], outs[1])


def test_kv_cache_with_autograd_history_is_refused_in_grad_mode_and_exact_under_no_grad(device, recwarn):
    """A decode step run outside no_grad writes tensors that require grad into the cache: the
    buffers then carry autograd history (grad_fn) that eager grows from call to call. That
    cannot be recorded: a clear error, not a trace that reads a placeholder (which crashed
    fuse=True) or a silently plain cache. Under no_grad the history plays no part: eager's
    numbers, on the same (already touched) buffers."""
    torch.manual_seed(0)
    d, ref = _Dec().to(device), _Dec().to(device)
    ref.load_state_dict(d.state_dict())
    f = gt.graphify(d)
    xs = [torch.randn(1, 1, 8, device=device) for _ in range(6)]
    pos = [torch.tensor([t], device=device) for t in range(6)]
    assert_close(f(xs[0], pos[0]), ref(xs[0], pos[0]))  # first call: eager
    assert d.k.grad_fn is not None
    with pytest.raises(gt.GraphifyError, match="carries autograd history") as ei:
        f(xs[1], pos[1])
    msg = str(ei.value)
    assert "torch.no_grad()" in msg and ".k" in msg and "IndexCopyBackward" in msg
    with torch.no_grad():
        for t in range(1, 6):
            got = f(xs[t], pos[t])
            want = ref(xs[t], pos[t])
            assert not got.requires_grad
            assert_close(got, want)
    assert_close(d.k, ref.k)
    assert_close(d.v, ref.v)
    assert f.cache_info().misses >= 1 and f.cache_info().hits >= 3
    assert not [(w.filename, w.lineno, str(w.message)[:80]) for w in recwarn if "not a leaf Tensor" in str(w.message)]


class _GrowingCache:
    """A KV cache that grows, as Hugging Face's DynamicCache: lists of tensors, made longer with torch.cat."""

    def __init__(self):
        self.keys, self.values = [], []

    def update(self, k, v, i):
        if len(self.keys) <= i:
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[i] = torch.cat([self.keys[i], k])
            self.values[i] = torch.cat([self.values[i], v])
        return self.keys[i], self.values[i]


class _KV:
    def __init__(self):
        self.k = self.v = None


class _LayeredCache:
    """The same with DynamicCache's layout: layer objects appended on first use, holding the tensors."""

    def __init__(self):
        self.layers = []

    def update(self, k, v, i):
        while len(self.layers) <= i:
            self.layers.append(_KV())
        layer = self.layers[i]
        layer.k = k if layer.k is None else torch.cat([layer.k, k])
        layer.v = v if layer.v is None else torch.cat([layer.v, v])
        return layer.k, layer.v


def _attend(x, cache, proj):
    for i in range(2):
        k, v = cache.update(proj(x), x, i)
        x = x + (torch.softmax(x @ k.T, -1) @ v)
    return x


@pytest.mark.parametrize("passed", [True, False], ids=["argument", "closed-over"])
@pytest.mark.parametrize("kind", [_GrowingCache, _LayeredCache], ids=["lists", "layers"])
def test_a_cache_that_grows_is_refused_and_left_as_it_was(device, kind, passed):
    """Before: a cache whose containers got new objects holding traced tensors (the layered one)
    was left holding them (FakeTensors, then used by the caller), and the message blamed a store
    of the user's. Now the cache is as it was, and for an argument the message says the cache
    grows, with the fix."""
    proj = nn.Linear(4, 4).to(device)
    cache, ref = kind(), kind()
    if passed:
        g = gt.graphify(lambda x, c: _attend(x, c, proj))
        call = lambda x: g(x, cache)  # noqa: E731
    else:
        g = gt.graphify(lambda x: _attend(x, cache, proj))
        call = g
    x = torch.randn(1, 4, device=device)
    with torch.no_grad():
        with pytest.raises(gt.GraphifyError, match="escapes into Python state") as ei:
            call(x)
        assert _shown(cache) == _shown(kind())  # as it was: empty, no layer, no FakeTensor
        msg = str(ei.value)
        assert "test_state.py" in msg and "Fix:" in msg
        if passed:
            assert "an object passed in, and the function appends to it: a cache that grows" in msg
            assert "Fix: preallocate the cache at its full size" in msg and "StaticCache" in msg
            assert "args[1] was left as it was before the call" in msg
        for _ in range(3):  # the cache stays usable: eager decoding gives eager's numbers
            x = torch.randn(1, 4, device=device)
            assert_close(_attend(x, cache, proj), _attend(x, ref, proj))
        assert _shown(cache) == _shown(ref)


def test_closed_over_tensor_with_autograd_history_passes_gradients_on(device):
    """W = base * 2 closed over: read-only state with a grad_fn is an input of the autograd
    node (like a parameter), and the gradient flows on into base, every call, as in eager."""
    base = torch.randn(3, 3, device=device, requires_grad=True)
    W = base * 2
    f = lambda x: (x @ W).tanh().sum()  # noqa: E731
    g = gt.graphify(f)
    for _ in range(4):
        x = torch.randn(2, 3, device=device)
        got = g(x)
        assert got.requires_grad
        (gb,) = torch.autograd.grad(got, base, retain_graph=True)
        (want,) = torch.autograd.grad(f(x), base, retain_graph=True)
        assert_close(got, f(x))
        assert_close(gb, want)
    assert g.cache_info().hits >= 2
    with torch.no_grad():
        x = torch.randn(2, 3, device=device)
        assert_close(g(x), f(x))


def test_grad_accumulation_with_zero_grad_between_some_calls_matches_eager(device):
    """backward() inside, no zero_grad inside: eager accumulates into .grad; the caller
    sets it to None now and then. A recording traced while .grad was None creates it; when
    a .grad is there again (the one the last call left) it must accumulate, not replace."""
    x, y = torch.randn(8, 4, device=device), torch.randn(8, 2, device=device)
    plan = ["call", "call", "none", "call", "call", "call", "zero", "call", "call", "none", "call", "call"]
    got = []
    for graph in (False, True):
        torch.manual_seed(0)
        m = nn.Linear(4, 2).to(device)

        def step(x, y, m=m):
            ((m(x) - y) ** 2).mean().backward()
            return m.weight.grad

        f = gt.graphify(step) if graph else step
        seen = []
        for what in plan:
            if what == "none":
                m.zero_grad(set_to_none=True)
            elif what == "zero":
                m.zero_grad(set_to_none=False)
            else:
                out = f(x, y)
                seen.append((out.clone(), m.weight.grad.clone(), m.bias.grad.clone()))
        got.append(seen)
    for (a, b, c), (d, e, g) in zip(*got):
        assert_close(d, a)
        assert_close(e, b)
        assert_close(g, c)


def test_forward_that_updates_a_parameter_in_place_keeps_outputs_differentiable_or_refuses(device):
    """Embedding(max_norm=...) renormalises its weight in place (under no_grad) in forward.
    Such a call once ran as a plain call (like an optimizer step), and its output came back
    without requires_grad: the weight silently got no gradient. In grad mode it is now a
    clear error; under no_grad, eager's numbers; an update that returns nothing (an EMA of
    parameters) stays a plain call."""
    torch.manual_seed(0)
    m, ref = nn.Embedding(10, 4, max_norm=1.0).to(device), nn.Embedding(10, 4, max_norm=1.0).to(device)
    ref.load_state_dict(m.state_dict())
    f = gt.graphify(m)
    i = torch.tensor([[1, 2, 3], [3, 4, 1]], device=device)
    out = f(i)  # first call: eager
    assert out.requires_grad
    with pytest.raises(gt.GraphifyError, match="updates tensors it reaches that require grad") as ei:
        f(i)
    assert "torch.no_grad()" in str(ei.value) and "embedding_renorm_" in str(ei.value)
    ref(i)
    with torch.no_grad():
        for _ in range(3):
            assert_close(f(i), ref(i))
    assert_close(m.weight, ref.weight)

    src, ema, ref_ema = nn.Linear(3, 2).to(device), nn.Linear(3, 2).to(device), nn.Linear(3, 2).to(device)
    ref_ema.load_state_dict(ema.state_dict())

    def update(e=ema):
        with torch.no_grad():
            for pe, ps in zip(e.parameters(), src.parameters()):
                pe.mul_(0.9).add_(ps, alpha=0.1)

    u = gt.graphify(update)
    for _ in range(4):
        u()
        update(ref_ema)
    assert_close(ema.weight, ref_ema.weight)
    assert_close(ema.bias, ref_ema.bias)
    assert u.cache_info().hits >= 2


def test_inputs_are_real_before_any_kernel_runs(device):
    """Embedding, gather, index_select, cross_entropy targets: never uninitialised memory."""
    if device == "cuda":
        # leave free blocks of the buffers' size full of out-of-range indices
        junk = [torch.full((64,), 10**9, dtype=torch.int64, device=device) for _ in range(16)]
        del junk
    emb = nn.Embedding(10, 4).to(device)

    def f(idx, tgt, logits):
        e = emb(idx)
        g = torch.gather(logits, 1, tgt.view(-1, 1))
        s = torch.index_select(logits, 0, tgt)
        return e.sum() + g.sum() + s.sum() + F.cross_entropy(logits, tgt)

    g = gt.graphify(f)
    for _ in range(3):
        idx = torch.randint(0, 10, (8,), device=device)
        tgt = torch.randint(0, 5, (8,), device=device)
        logits = torch.randn(8, 5, device=device)
        with torch.no_grad():
            torch.testing.assert_close(g(idx, tgt, logits), f(idx, tgt, logits))


def test_host_read_of_state_names_the_lines():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            return x * float(self.scale)

    # DESIGN semantics 12: a host read of unwritten state is a guarded constant (it was a
    # GraphifyError); written in place between calls, it is traced again
    m = M()
    g = gt.graphify(m)
    for k in range(4):
        if k == 2:
            m.scale.fill_(3.0)
        assert_close(g(torch.ones(2)), m(torch.ones(2)))
    assert "float(self.scale)" in g.describe() or "module.scale" in g.describe()


def test_host_read_of_state_the_function_writes_stays_an_error():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.tensor(1.0))

        def forward(self, x):
            y = x * float(self.n)
            self.n.add_(1)  # written after the read: not unchanged
            return y

    g = gt.graphify(M())
    g(torch.ones(2))  # the first call of a signature that touches state runs eagerly
    with pytest.raises(gt.GraphifyError, match="reads a tensor's value on the host") as ei:
        g(torch.ones(2))
    assert "float(self.n)" in str(ei.value)


def test_describe_shows_state_and_first_call_policy():
    lin = nn.Linear(3, 2)
    g = gt.graphify(lambda x: lin(x))
    with torch.no_grad():
        g(torch.ones(3))
        g(torch.ones(3))
    d = g.describe()
    assert "lin.weight" in d and "state" in d and "eagerly" in d


def _count_traces(monkeypatch):
    import gtransform._lookup as api  # (where the call path traces a signature)

    n = {"n": 0}
    orig = api.trace

    def counted(*a, **k):
        n["n"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(api, "trace", counted)
    return n


def test_second_call_of_a_stateful_signature_records_the_first_calls_trace(device, monkeypatch):
    """A decode step with a KV cache in buffers (state, updated in place), under no_grad: the
    first call runs eagerly, the second records the first call's trace instead of tracing
    again (most of a model's first call on a GPU host), and every call is eager's."""
    n = _count_traces(monkeypatch)
    torch.manual_seed(0)
    d, ref = _Dec().to(device), _Dec().to(device)
    ref.load_state_dict(d.state_dict())
    f = gt.graphify(d)
    with torch.no_grad():
        for t in range(6):
            x, pos = torch.randn(1, 1, 8, device=device), torch.tensor([t], device=device)
            assert_close(f(x, pos), ref(x, pos))
    assert n["n"] == 1
    assert f.cache_info().misses == 2 and f.cache_info().hits == 4  # as before: call 2 is a miss
    assert_close(d.k, ref.k)
    assert_close(d.v, ref.v)


class _LazyAcc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = None

    def forward(self, x):
        if self.acc is None:  # allocated on first use
            self.acc = torch.zeros(4, device=x.device)
        self.acc.add_(self.lin(x).sum(0))
        return self.acc * 1


@pytest.mark.parametrize("between", ["nothing", "eval", "new_buffer"])
def test_what_the_eager_first_call_or_the_caller_changed_is_traced_again(device, monkeypatch, between):
    """The first call's trace is kept for the second only when nothing it read changed: state
    the eager call allocated (an attribute set on first use), the training flag flipped, a
    buffer replaced between the calls: traced again, and eager's numbers on every call."""
    n = _count_traces(monkeypatch)
    torch.manual_seed(0)
    if between == "nothing":
        m = _LazyAcc().to(device)
    else:
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(device)
    ref = type(m)() if between == "nothing" else nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref = ref.to(device)
    ref.load_state_dict(m.state_dict())
    if between != "nothing":
        m.eval()
        ref.eval()
    f = gt.graphify(m)
    xs = [torch.randn(3, 4, device=device) for _ in range(5)]
    with torch.no_grad():
        assert_close(f(xs[0]), ref(xs[0]))
        if between == "eval":
            m.train()
            ref.train()
        elif between == "new_buffer":
            m[1].running_mean = torch.full((4,), 0.5, device=device)
            ref[1].running_mean = torch.full((4,), 0.5, device=device)
        for x in xs[1:]:
            assert_close(f(x), ref(x))
    assert n["n"] == 2
    assert_close(m.state_dict(), ref.state_dict())
    if between == "nothing":
        assert_close(m.acc, ref.acc)


class _ActNorm(nn.Module):
    """Data-dependent initialisation on the first call, guarded by a bool flag."""

    def __init__(self):
        super().__init__()
        self.register_buffer("off", torch.zeros(4))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            self.off.copy_(x.mean(0))
            self.initialized = True
        return x - self.off


@pytest.mark.parametrize("holder", ["module", "namespace", "dict"])
def test_a_flag_set_by_the_first_call_is_eagers(device, holder):
    """A bool flag set while tracing (ActNorm's `self.initialized = True`, or a flag next to a
    tensor in a plain object or dict) is undone like a changed number: the first call runs
    eagerly and initialises, the next ones skip it, as in eager. (A flag left set by the trace
    made the eager first call skip the initialisation; kept in a plain object, the first
    call's trace, initialisation included, was replayed on every call.)"""
    torch.manual_seed(0)
    xs = [torch.randn(5, 4, device=device) for _ in range(5)]
    if holder == "module":
        m, ref = _ActNorm().to(device), _ActNorm().to(device)
        f = gt.graphify(m)
        with torch.no_grad():
            for x in xs:
                assert_close(f(x), ref(x))
        assert_close(m.off, ref.off)
        assert m.initialized and ref.initialized
        return

    def make():
        if holder == "dict":
            d = {"shift": torch.zeros(4, device=device), "ready": False}

            def fn(x):
                if not d["ready"]:
                    d["shift"] = d["shift"] + x.mean(0)
                    d["ready"] = True
                return x - d["shift"]
            return fn, lambda: d["shift"]
        ns = types.SimpleNamespace(shift=torch.zeros(4, device=device), ready=False)

        def fn(x):
            if not ns.ready:
                ns.shift = ns.shift + x.mean(0)
                ns.ready = True
            return x - ns.shift
        return fn, lambda: ns.shift

    (fg, shift_g), (fe, shift_e) = make(), make()
    f = gt.graphify(fg)
    for x in xs:
        assert_close(f(x), fe(x))
    assert_close(shift_g(), shift_e())


class _PingPong(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("a", torch.zeros(2, 4))
        self.register_buffer("b", torch.ones(2, 4))

    def forward(self, x):
        torch.add(self.fc(x), self.a, out=self.b)
        self.a, self.b = self.b, self.a
        return self.a * 1


def test_double_buffers_swapped_every_call_are_refused_after_an_exact_first_call(device):
    """Swapping two buffers (`self.a, self.b = self.b, self.a`) binds state to other tensors on
    every call, which a replay cannot do (it gave wrong numbers from the third call): the
    first call runs eagerly and is eager's, the next is a clear error with the fix."""
    torch.manual_seed(0)
    m, ref = _PingPong().to(device), _PingPong().to(device)
    ref.load_state_dict(m.state_dict())
    f = gt.graphify(m)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        assert_close(f(x), ref(x))
        with pytest.raises(gt.GraphifyError, match=r"(?s)binds state to other tensors.*module\.a: bound to another "
                                                   r"tensor.*PingPong\.forward.*Fix: keep module\.a bound to one tensor"):
            f(x)
    assert_close(m.a, ref.a)
    assert_close(m.b, ref.b)


def test_pure_functions_are_still_recorded_on_the_first_call():
    f = gt.graphify(lambda x: x * 2)
    a = f(torch.ones(2))
    f(torch.ones(2))
    with pytest.raises(gt.OverwrittenOutputError):
        a + 1


def test_failed_trace_leaves_modules_untouched():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = None

        def forward(self, x):
            if self.cache is None:
                self.cache = x * 0 + 1
            if x.sum() > 0:  # data-dependent: the trace fails
                return x
            return x + self.cache

    m = Lazy()
    with pytest.raises(gt.GraphifyError):
        gt.graphify(m)(torch.ones(2))
    assert m.cache is None or type(m.cache) is torch.Tensor


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_held_grad_of_an_earlier_step_is_poisoned_on_cuda():
    model = _mlp("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    f = gt.graphify(step)
    batches = _batches("cuda", 4)
    for x, y in batches[:3]:
        f(x, y)
    kept = model[0].weight.grad
    f(*batches[3])
    with pytest.raises(gt.OverwrittenOutputError):
        kept + 1
    assert type(model[0].weight.grad) is torch.Tensor  # the slot itself holds the current one


_OPS = st.lists(st.sampled_from(["call", "call", "call", "eval", "train", "data", "rebind", "hook", "unhook", "nograd"]),
                min_size=1, max_size=12)


@given(ops=_OPS)
def test_state_changes_between_calls_follow_eager(ops):
    """Any sequence of calls and state changes: graphify(model) gives what eager gives."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.0), nn.BatchNorm1d(4), nn.Linear(4, 2))
    import copy

    ref = copy.deepcopy(base)
    g = gt.graphify(base)
    models = [(ref, ref), (base, g)]
    hooks: list = []
    x = torch.randn(5, 3)
    for k, op in enumerate(ops):
        outs = []
        for m, call in models:
            if op == "call":
                with torch.no_grad():
                    outs.append(call(x + k).clone())
            elif op == "nograd":
                with torch.no_grad():
                    outs.append(call(x - k).clone())
            elif op == "eval":
                m.eval()
            elif op == "train":
                m.train()
            elif op == "data":
                m[0].weight.data = m[0].weight.data * 0.5
            elif op == "rebind":
                m[3].bias = nn.Parameter(m[3].bias.detach() + 1.0)
            elif op == "hook":
                hooks.append(m[3].register_forward_hook(lambda mod, i, o: o * 2))
            elif op == "unhook" and hooks:
                for h in hooks:
                    h.remove()
        if op == "unhook":
            hooks.clear()
        if outs:
            torch.testing.assert_close(outs[1], outs[0])
    for h in hooks:
        h.remove()
    del models
    gc.collect()


def test_host_read_inside_a_library_names_both_lines(tmp_path, monkeypatch):
    """Like torchdiffeq's odeint reading a step size: the user's line and the library's line."""
    lib = tmp_path / "site-packages" / "fakeode"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(
        "def odeint(f, y0, t):\n"
        "    dt = float(t[1] - t[0])  # a host read, inside the library\n"
        "    return y0 + dt * f(y0)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    import fakeode

    g = gt.graphify(lambda y, t: fakeode.odeint(torch.tanh, y, t))
    with pytest.raises(gt.GraphifyError) as ei:
        g(torch.ones(3), torch.tensor([0.0, 0.1]))
    msg = str(ei.value)
    assert "test_state.py" in msg and "fakeode.odeint" in msg  # the user's line
    assert "read at" in msg and "fakeode" in msg and "float(t[1] - t[0])" in msg  # the library's


class _CallCounter(torch.nn.Module):
    """A module that counts its calls in a Python int and uses the count."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_python_number_a_module_changes_on_every_call_is_refused(device):
    torch.manual_seed(0)
    m = _CallCounter().to(device)
    ref = _CallCounter().to(device)
    ref.load_state_dict(m.state_dict())
    g = gt.graphify(m)
    x = torch.ones(1, 2, device=device)
    assert_close(g(x), ref(x))  # the first call runs eagerly: exactly eager's
    assert m.calls == ref.calls == 1  # the trace's own increment was undone
    with pytest.raises(gt.GraphifyError, match=r"(?s)changes Python numbers in the state it reaches \(module\.calls: 1 -> 2\)"
                       r".*Fix: keep the value in a tensor updated in place"):
        g(x)
    assert m.calls == 1  # refused: nothing happened
    assert_close(m(x), ref(x))  # the module stays usable


def test_a_python_number_set_once_by_a_module_is_recorded(device):
    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.scale = 0.0

        def forward(self, x):
            if self.scale == 0.0:
                self.scale = 3.0  # set on the first call only
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    m = Lazy().to(device)
    g = gt.graphify(m)
    x = torch.ones(1, 2, device=device)
    for _ in range(4):
        assert_close(g(x), m.lin(x) * 3.0)
    assert m.scale == 3.0
    assert g.cache_info().currsize == 1


def test_an_optimizer_hyperparameter_changed_in_the_step_is_refused(device):
    lin = torch.nn.Linear(2, 1).to(device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        lin(x).sum().backward()
        opt.step()
        opt.param_groups[0]["lr"] *= 0.5  # a decay inside the step: eager halves it every call

    g = gt.graphify(step)
    x = torch.ones(1, 2, device=device)
    g(x)
    assert opt.param_groups[0]["lr"] == 0.05
    with pytest.raises(gt.GraphifyError, match=r"param_groups\[0\]\['lr'\]: 0\.05 -> 0\.025"):
        g(x)
    assert opt.param_groups[0]["lr"] == 0.05


def test_a_counter_of_traces_in_a_plain_dict_counts_traces(device):
    """As in JAX: Python side effects on plain containers happen when the function is traced."""
    n = {"traces": 0}

    def f(x):
        n["traces"] += 1
        return x * 2

    g = gt.graphify(f)
    for _ in range(4):
        assert_close(g(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))
    assert n["traces"] == 1


def test_a_tensor_learning_rate_read_on_the_host_names_the_fix():
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=torch.tensor(0.1))

    def step(x):
        opt.zero_grad()
        lin(x).sum().backward()
        opt.step()

    # DESIGN semantics 12: the tensor learning rate is unwritten state, its host read a guarded
    # constant (it was a GraphifyError); a change in place traces again
    ref = torch.nn.Linear(2, 1)
    ref.load_state_dict(lin.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=torch.tensor(0.1))

    def ref_step(x):
        ref_opt.zero_grad()
        ref(x).sum().backward()
        ref_opt.step()

    g = gt.graphify(step)
    for k in range(5):
        if k == 3:
            opt.param_groups[0]["lr"].fill_(0.5)
            ref_opt.param_groups[0]["lr"].fill_(0.5)
        g(torch.ones(1, 2))
        ref_step(torch.ones(1, 2))
        assert_close(lin.weight.detach(), ref.weight.detach())


@pytest.mark.parametrize("kind", ["LSTM", "LSTM-proj", "GRU", "GRU-nobias", "RNN-tanh", "RNN-relu"])
def test_recurrent_layers_infer_as_in_eager(device, kind):
    """cuDNN's recurrent layers probe, inside the op, whether their weights sit in one packed
    buffer (a tensor pointed at the weights' storage object, which a graph cannot hold): a
    graphified module and a closed-over one give eager's outputs, and each recording is
    replayed. A packed sequence (its batch sizes are host values) is a clear error."""
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    if kind.startswith("RNN"):
        m = nn.RNN(4, 8, num_layers=2, nonlinearity=kind.split("-")[1], batch_first=True)
    elif kind == "LSTM-proj":
        m = nn.LSTM(4, 8, num_layers=2, proj_size=3, bidirectional=True, batch_first=True)
    elif kind == "GRU-nobias":  # cuDNN packs room for biases anyway
        m = nn.GRU(4, 8, num_layers=2, bias=False, bidirectional=True, batch_first=True)
    else:
        m = getattr(nn, kind)(4, 8, num_layers=2, bidirectional=True, batch_first=True)
    m = m.to(device).eval()
    g = gt.graphify(m)

    @gt.graphify
    def last(x):
        return m(x)[0][:, -1].tanh()

    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 5, 4, device=device)
            assert_close(g(x), m(x))
            assert_close(last(x), m(x)[0][:, -1].tanh())
        assert g.cache_info().hits >= 1 and last.cache_info().hits >= 1

        lengths = torch.tensor([5, 3, 2])
        packed = gt.graphify(lambda x: m(pack_padded_sequence(x, lengths, batch_first=True))[0].data)
        # the host's lengths: read on the host (CPU), or a CPU tensor in a CUDA function
        with pytest.raises(gt.GraphifyError, match=r"(?s)(_pack_padded_sequence.*batch sizes on the host"
                                                   r"|the CPU tensor lengths).*Fix:"):
            for _ in range(2):  # a first call that reaches state may run eagerly
                packed(x)


def _pack(module):
    """Make a module's parameters views of one flat buffer, as cuDNN's flatten_parameters does."""
    ps = list(module.parameters())
    flat = torch.empty(sum(p.numel() for p in ps), device=ps[0].device)
    off = 0
    with torch.no_grad():
        for p in ps:
            n = p.numel()
            flat[off:off + n].copy_(p.reshape(-1))
            p.set_(flat.untyped_storage(), off, p.shape, p.stride())
            off += n
    return module


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_parameters_packed_in_one_buffer_train_as_in_eager(device, momentum):
    """Parameters that are views of one buffer (an LSTM on cuDNN after flatten_parameters):
    an optimizer step inside the function updates each of them exactly once per call. The
    trace once marked only the first of them as updated, so on CUDA the recording's warm-up
    left its update in the others: every later loss was off (by 2-4% for an LSTM)."""
    import copy

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    m = _pack(copy.deepcopy(ref))
    assert len({p.untyped_storage().data_ptr() for p in m.parameters()}) == 1
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1, momentum=momentum) for mod in (m, ref)]

    def step(mod, opt, x):
        opt.zero_grad()
        loss = mod(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    g = gt.graphify(step)
    for _ in range(4):
        x = torch.randn(5, 4, device=device)
        assert_close(g(m, opts[0], x), step(ref, opts[1], x))
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_close(p, q)
    described = g.describe()
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert re.search(rf"state args\[0\]\.{re.escape(name)}: .*updated in place", described), described


def _recurrent_step(mod, opt, x):
    """A training step of a recurrent layer: squared outputs, backward, optimizer step."""
    opt.zero_grad()
    loss = mod(x)[0].pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_recurrent_dropout_follows_the_seed_or_is_refused_on_cudnn(device):
    """Dropout between the layers of nn.LSTM: on the CPU it draws from torch's generator and
    follows torch.manual_seed as eager does; cuDNN draws it from a random state of its own,
    which a recording cannot hold, so there it is a clear error that names the fix."""
    import copy

    torch.manual_seed(0)
    m = nn.LSTM(4, 8, num_layers=2, dropout=0.3, batch_first=True).to(device)
    ref = copy.deepcopy(m)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (m, ref)]

    step = _recurrent_step
    g = gt.graphify(step)
    if device == "cuda":
        with pytest.raises(gt.GraphifyError, match=r"(?s)dropout=0\.3 between its layers on cuDNN.*Fix: set"):
            for _ in range(2):  # a first call that reaches state may run eagerly
                g(m, opts[0], torch.randn(3, 5, 4, device=device))
        return
    for i in range(4):
        x = torch.randn(3, 5, 4, device=device)
        torch.manual_seed(10 + i)
        got = g(m, opts[0], x)
        torch.manual_seed(10 + i)
        assert_close(got, step(ref, opts[1], x))
    assert g.cache_info().hits >= 2
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_close(p, q)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("how", ["step", "module"])
def test_recurrent_layers_train_as_in_eager(device, kind, how):
    """The CPU's oneDNN LSTM makes the workspace its backward needs only with grad mode on,
    and recordings replay without it: a whole training step, and a graphified module whose
    backward runs later, still give eager's losses, gradients and parameters."""
    import copy

    torch.manual_seed(0)
    mk = getattr(nn, kind)
    m = mk(4, 8, batch_first=True, num_layers=2, bidirectional=True).to(device)
    ref = copy.deepcopy(m)
    if how == "step":
        opts = [torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9) for mod in (m, ref)]

        step = _recurrent_step
        g = gt.graphify(step)
        for _ in range(4):
            x = torch.randn(3, 5, 4, device=device)
            assert_close(g(m, opts[0], x), step(ref, opts[1], x))
        assert g.cache_info().hits >= 2
    else:
        g = gt.graphify(m)
        for _ in range(3):
            x = torch.randn(3, 5, 4, device=device)
            got, want = g(x), ref(x)
            assert_close(got, want)
            (got[0].sum() + got[1][0].sum() if kind == "LSTM" else got[0].sum() + got[1].sum()).backward()
            (want[0].sum() + want[1][0].sum() if kind == "LSTM" else want[0].sum() + want[1].sum()).backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_close(p, q)


@pytest.mark.parametrize("change", ["add_param_group", "load_state_dict", "state_clear", "remove_param",
                                    "swap_param_group_list"])
def test_optimizer_structure_changed_between_calls_is_seen(device, change):
    """Changing what an optimizer steps or the state it keeps between calls (a new param
    group for progressive unfreezing, restoring a checkpoint, resetting momentum, dropping a
    parameter) gives eager's losses, parameters and optimizer state on every later call."""
    import copy

    def build():
        torch.manual_seed(0)
        body, head = nn.Linear(3, 4), nn.Linear(4, 2)
        model = nn.Sequential(body, nn.Tanh(), head).to(device)
        opt = torch.optim.SGD(list(body.parameters()) + [head.weight], lr=0.1, momentum=0.9)
        return model, opt

    def step(model, opt, x, y):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    runs = [build(), build()]
    ckpts = [None, None]
    g = gt.graphify(step)
    torch.manual_seed(1)
    data = [(torch.randn(5, 3, device=device), torch.randn(5, 2, device=device)) for _ in range(7)]
    for i, (x, y) in enumerate(data):
        for k, (model, opt) in enumerate(runs):
            if i == 1:
                ckpts[k] = copy.deepcopy(opt.state_dict())
            if i == 4:
                if change == "add_param_group":
                    opt.add_param_group({"params": [model[2].bias], "lr": 0.05})
                elif change == "load_state_dict":
                    opt.load_state_dict(ckpts[k])
                elif change == "state_clear":
                    opt.state.clear()
                elif change == "remove_param":
                    opt.param_groups[0]["params"].pop()
                else:
                    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"][:2])
        got = g(*runs[0], x, y)
        want = step(*runs[1], x, y)
        assert_close(got, want)
    (m0, o0), (m1, o1) = runs
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert_close(p, q)
    for p, q in zip(m0.parameters(), m1.parameters()):
        a, b = o0.state.get(p, {}).get("momentum_buffer"), o1.state.get(q, {}).get("momentum_buffer")
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(a, b)


class _KeepsActivation(nn.Module):
    """Stores its hidden activation in forward (for logging, or a loss term later)."""

    def __init__(self, detach):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.detach = detach

    def forward(self, x):
        h = self.fc(x)
        self.last_h = h.detach() if self.detach else h
        return h.relu()


def test_a_tensor_stored_in_forward_keeps_the_call_differentiable(device):
    """`self.last_h = h.detach()` in forward is an escape, not a training step: the output
    still carries gradients to the parameters, as in eager (before, from the second call,
    it came back without grad_fn). Storing `h` itself (it requires grad) is refused: the
    stored tensor could not carry eager's autograd graph."""
    import copy

    torch.manual_seed(0)
    net = _KeepsActivation(detach=True).to(device)
    ref = copy.deepcopy(net)
    g = gt.graphify(net)
    for _ in range(4):
        x = torch.randn(5, 4, device=device)
        net.zero_grad()
        ref.zero_grad()
        g(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        assert_close(net.last_h, ref.last_h)
        for p, q in zip(net.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad)

    g = gt.graphify(_KeepsActivation(detach=False).to(device))
    with pytest.raises(gt.GraphifyError, match=r"(?s)stores a tensor that requires grad in module\.last_h"
                                               r".*Fix: return it as an output"):
        for _ in range(3):
            g(torch.randn(5, 4, device=device))


def _cell_fns(h0, carry):
    H = h0

    def read(x):
        return x + H

    def carried(x):
        nonlocal H
        H = torch.tanh(x + H)
        return H * 2

    def get():
        return H

    def put(v):
        nonlocal H
        H = v

    return (carried if carry else read), get, put


class _StateHolder:
    """A tensor ``h`` kept in one of the places a function reaches state through; ``fn``
    reads it (``x + h``) or carries it (``h = tanh(x + h)``, written back where it lives)."""

    def __init__(self, where, carry):
        h0 = torch.zeros(3)
        self.where = where
        if where in ("global", "cell"):
            ns = {"torch": torch, "H": h0}
            if where == "global":
                body = "    global H\n    H = torch.tanh(x + H)\n    return H * 2" if carry else "    return x + H"
                exec(f"def fn(x):\n{body}", ns)
                self.fn, self._get, self._set = ns["fn"], (lambda: ns["H"]), (lambda v: ns.__setitem__("H", v))
            else:
                self.fn, self._get, self._set = _cell_fns(h0, carry)
            return
        owner: object
        if where in ("module_attr", "buffer"):
            owner = nn.Module()
            if where == "buffer":
                owner.register_buffer("h", h0)
            else:
                owner.h = h0
            get, put = (lambda: owner.h), (lambda v: setattr(owner, "h", v))
        elif where == "dict":
            owner = {"h": h0}
            get, put = (lambda: owner["h"]), (lambda v: owner.__setitem__("h", v))
        else:
            owner = types.SimpleNamespace(h=h0)
            get, put = (lambda: owner.h), (lambda v: setattr(owner, "h", v))
        self._get, self._set = get, put

        def fn(x):
            if carry:
                put(torch.tanh(x + get()))
                return get() * 2
            return x + get()

        self.fn = fn

    def get(self):
        return self._get()

    def set(self, v):
        self._set(v)


@given(where=st.sampled_from(["global", "cell", "module_attr", "buffer", "dict", "object"]),
       carry=st.booleans(),
       changes=st.lists(st.sampled_from(["none", "none", "inplace", "rebind"]), min_size=3, max_size=6))
def test_state_held_anywhere_follows_eager_across_rebinding(where, carry, changes):
    """A tensor reached through a global, a closure cell, a module's plain attribute or
    buffer, a dict or an object: changed in place or rebound to a new tensor between calls,
    or carried by the function itself (an RNN's hidden state), every call sees its current
    value, as eager does (before, a rebound global or a module's plain tensor attribute kept
    being read from the tensor of the trace: silently stale)."""
    runs = [_StateHolder(where, carry), _StateHolder(where, carry)]
    g = gt.graphify(runs[0].fn)
    fns = [g, runs[1].fn]
    for i, change in enumerate(changes):
        for r in runs:
            if change == "inplace":
                r.get().add_(0.5)
            elif change == "rebind":
                r.set(torch.full((3,), float(i)))
        x = torch.full((3,), 0.1 * (i + 1))
        got, want = fns[0](x), fns[1](x)
        assert_close(got, want)
        assert_close(runs[0].get(), runs[1].get())


@pytest.mark.parametrize("memory", ["new", "same"])
@pytest.mark.parametrize("in_optimizer", [False, True])
def test_a_parameter_replaced_between_calls_is_traced_again(device, in_optimizer, memory):
    """`model.weight = nn.Parameter(...)` between calls of a whole training step: eager's
    losses, parameters and .grad on every later call, whether or not the optimizer is told
    (if not, eager's optimizer keeps stepping the old, orphaned parameter). A new Parameter
    over the old one's memory (`nn.Parameter(m.weight.data)`) passed the fast path's address
    check, and its .grad was left None while the recording wrote the old object's."""
    def run(graph):
        torch.manual_seed(0)
        m = nn.Linear(3, 2).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad()
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        f = gt.graphify(step) if graph else step
        gen = torch.Generator().manual_seed(1)
        losses = []
        for i in range(6):
            if i == 3:
                if memory == "same":
                    m.weight = nn.Parameter(m.weight.data)
                else:
                    m.weight = nn.Parameter(torch.full((2, 3), 0.1, device=device))
                if in_optimizer:
                    opt.param_groups[0]["params"][0] = m.weight
            x, y = torch.randn(5, 3, generator=gen).to(device), torch.randn(5, 2, generator=gen).to(device)
            losses.append(f(x, y).item())
        return losses, m

    (la, ma), (lb, mb) = run(True), run(False)
    assert la == pytest.approx(lb, rel=1e-5)
    assert_close(ma.weight, mb.weight)
    assert (ma.weight.grad is None) == (mb.weight.grad is None)
    if mb.weight.grad is not None:
        assert_close(ma.weight.grad, mb.weight.grad)


def _lazy_net():
    return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyBatchNorm1d(), nn.Linear(8, 2))


@pytest.mark.parametrize("how", ["closure", "module"])
def test_lazy_modules_create_their_parameters_eagerly_then_are_recorded(device, monkeypatch, how):
    """nn.LazyLinear / LazyBatchNorm1d create their parameters in their first forward. The
    trace used to run that forward: the parameters were made under the trace (no data), the
    module was left so, and every later call failed ("Cannot copy out of meta tensor"), eager
    included. Now the first call runs eagerly and the next one is traced, with eager's
    numbers on every call and the modules as eager leaves them."""
    n = _count_traces(monkeypatch)
    torch.manual_seed(0)
    m = _lazy_net().to(device)
    torch.manual_seed(0)
    ref = _lazy_net().to(device)
    f = gt.graphify(m) if how == "module" else gt.graphify(lambda x: m(x))
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        x = torch.randn(6, 5, generator=gen).to(device)
        torch.manual_seed(i)  # the first forward draws the initial parameters
        out = f(x)
        torch.manual_seed(i)
        assert_close(out, ref(x))
    assert n["n"] == 1
    # call 1: the lazy modules' first forward, eager; call 2: traced, run eagerly (BatchNorm's
    # running statistics are state); call 3 records that trace; calls 4-5 replay it
    assert f.cache_info().hits == 2 and f.cache_info().misses == 3
    assert type(m[0]) is nn.Linear and m[0].weight.shape == (8, 5)
    for (name, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert_close(a, b), name


def test_tracing_a_lazy_module_before_its_first_call_says_to_call_it_first():
    m = _lazy_net()
    f = gt.graphify(lambda x: m(x))
    with pytest.raises(gt.GraphifyError) as ei:
        f.trace(torch.randn(6, 5))
    msg = str(ei.value)
    assert "lazy modules" in msg and "m.0" in msg and "Fix: call the function once" in msg
    assert m[0].has_uninitialized_params()  # left untouched
    f(torch.randn(6, 5))  # the first call creates them
    assert type(m[0]) is nn.Linear  # materialized: no longer lazy
    assert "addmm" in f.trace(torch.randn(6, 5)).code


class _Ema(nn.Module):
    """A running mean of activations in state, where users keep it."""

    def __init__(self, where, device):
        super().__init__()
        self.where = where
        self.lin = nn.Linear(4, 4, device=device)
        if where == "buffer":
            self.register_buffer("ema", torch.zeros(4, device=device))
        elif where == "attribute":  # not moved by .to(): made where it lives
            self.ema = torch.zeros(4, device=device)
        elif where == "nested":
            self.cache = {"layers": [[torch.zeros(4, device=device)]]}
        else:  # a view of another buffer
            self.register_buffer("big", torch.zeros(8, device=device))
            self.register_buffer("ema", self.big[:4])

    def state(self):
        return self.cache["layers"][0][0] if self.where == "nested" else self.ema

    def forward(self, x):
        y = self.lin(x)
        self.state().mul_(0.9).add_(0.1 * y.mean(0))  # in grad mode: the state takes y's history
        return y + self.state()


@pytest.mark.parametrize("where", ["buffer", "attribute", "nested", "view"])
def test_a_trace_in_grad_mode_leaves_no_autograd_history_on_state(device, where):
    """Autograd runs above the trace: an in-place write of a grad-requiring value into state
    gave the real tensor a grad_fn over the trace's tensors. The first call (eager) extended
    that history, and its backward failed with "a tensor made while tracing it was used after
    the trace"; f.trace alone left the state requiring grad; on a view, the module failed from
    then on, eager included. Now the first call and its backward are eager's."""
    torch.manual_seed(0)
    m, ref = _Ema(where, device), _Ema(where, device)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 4, device=device)
    try:
        gt.graphify(m).trace(x)
    except gt.GraphifyError as e:  # a view: refused while tracing, before autograd saw it
        assert where == "view" and "a view of another tensor in state" in str(e) and "detach()" in str(e)
    assert not m.state().requires_grad and m.state().grad_fn is None
    f = gt.graphify(m)
    out, r = f(x), ref(x)
    out.sum().backward()
    r.sum().backward()
    assert_close(out, r)
    assert_close(m.state(), ref.state())
    assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    # the next call would extend the state's history, as eager does (whose backward then
    # fails): refused, with the fix
    with pytest.raises(gt.GraphifyError, match="carries autograd history"):
        f(x)


def test_a_lazy_module_the_calls_never_initialise_is_warned_about(caplog):
    """A reachable lazy module that the function never runs (an unused head) keeps every call
    eager: said once, with the fix, instead of a silent loss of the recording."""
    body, head = nn.Linear(5, 3), nn.LazyLinear(2)
    model = nn.ModuleDict({"body": body, "head": head})
    f = gt.graphify(lambda x: model["body"](x))
    with caplog.at_level("WARNING", logger="gtransform"):
        for _ in range(4):
            x = torch.randn(2, 5)
            assert_close(f(x), body(x))
    warned = [r for r in caplog.records if "still not initialised" in r.getMessage()]
    assert len(warned) == 1 and "model.head" in warned[0].getMessage() and "Fix:" in warned[0].getMessage()
    assert f.cache_info().hits == 0


@pytest.mark.parametrize("key", [True, 0, "new", None])
def test_a_key_the_function_adds_to_a_closed_over_dict(key):
    """A key added to a closed-over dict (a bool key, which hashes like 1; None, whose type is a
    Python number's kind) used to crash the state scan with KeyError; the dict ends as eager's."""
    memo_e, memo_g = {}, {}

    def make(memo):
        def f(x):
            memo[key] = 7
            return x * 2
        return f

    fe, fg = make(memo_e), gt.graphify(make(memo_g))
    for _ in range(3):
        x = torch.randn(3)
        assert_close(fg(x), fe(x))
    assert memo_g == memo_e == {key: 7}


def _lin(v, device="cpu"):
    m = torch.nn.Linear(2, 1).to(device)
    with torch.no_grad():
        m.weight.fill_(v)
        m.bias.zero_()
    return m


def test_a_module_replaced_in_a_container_or_object_the_function_reaches_is_seen(device):
    """A module (or optimizer) reached through a closed-over dict, list or plain object: another
    one put in its place, or appended, is read on the next calls (as a rebound global is)."""
    x = torch.ones(1, 2, device=device)
    reg = {"head": _lin(1.0, device)}
    layers = [_lin(1.0, device)]

    class Holder:
        pass

    holder = Holder()
    holder.model = _lin(1.0, device)

    def run_layers(x):
        out = x.sum() * 0
        for m in layers:
            out = out + m(x).sum()
        return out

    fns = {"dict": (gt.graphify(lambda x: reg["head"](x)), lambda x: reg["head"](x)),
           "list": (gt.graphify(run_layers), run_layers),
           "object": (gt.graphify(lambda x: holder.model(x)), lambda x: holder.model(x))}
    with torch.no_grad():
        for f, fn in fns.values():
            for _ in range(2):
                assert_close(f(x), fn(x))
        reg["head"], layers[0], holder.model = _lin(5.0, device), _lin(7.0, device), _lin(3.0, device)
        layers.append(_lin(2.0, device))
        for f, fn in fns.values():
            for _ in range(3):
                assert_close(f(x), fn(x))


def test_an_optimizer_swapped_on_self_of_a_graphified_method_is_seen():
    torch.manual_seed(0)

    class Trainer:
        def __init__(self):
            self.model = torch.nn.Linear(3, 1)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def step(self, x, y):
            loss = (self.model(x) - y).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            return loss.detach()

    a, b = Trainer(), Trainer()
    b.model.load_state_dict(a.model.state_dict())
    f = gt.graphify(a.step)
    for k in range(8):
        if k == 3:
            a.opt = torch.optim.SGD(a.model.parameters(), lr=0.5, momentum=0.9)
            b.opt = torch.optim.SGD(b.model.parameters(), lr=0.5, momentum=0.9)
        x, y = torch.randn(4, 3), torch.randn(4, 1)
        assert_close(f(x, y), b.step(x, y))
    assert_close(a.model.weight, b.model.weight)


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    lambda p: torch.optim.RMSprop(p, lr=1e-2),
], ids=["sgd-momentum", "adamw", "rmsprop"])
def test_a_graphified_update_sees_parameters_that_start_getting_gradients(device, make):
    """`update()` (opt.step(); opt.zero_grad()) graphified, backward outside: a layer unfrozen later
    gets its .grad then; its step (and its lazily made optimizer state) is eager's."""
    params = {}
    for use in (True, False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        opt = make(m.parameters())

        def update(opt=opt):
            opt.step()
            opt.zero_grad()

        up = gt.graphify(update) if use else update
        m[0].requires_grad_(False)
        torch.manual_seed(1)
        for step in range(7):
            if step == 3:
                m[0].requires_grad_(True)
            m(torch.randn(16, 4, device=device)).pow(2).mean().backward()
            up()
        params[use] = [p.detach().clone() for p in m.parameters()]
    for a, b in zip(params[True], params[False]):
        assert_close(a, b)


def test_a_number_counted_in_a_closed_over_list_is_seen_as_a_dicts_is():
    """`cnt[0] += 1` in a function that reaches state: undone after the trace, the first call
    runs eagerly (counted once), a change on every call is refused, as `ctr["i"] += 1` is."""
    lin = torch.nn.Linear(3, 3)
    cnt = [0]

    def step(x):
        cnt[0] += 1
        return lin(x)

    f = gt.graphify(step)
    with torch.no_grad():
        assert_close(f(torch.ones(3)), lin(torch.ones(3)))
        assert cnt == [1]
        with pytest.raises(gt.GraphifyError, match=r"cnt\[0\]: 1 -> 2"):
            f(torch.ones(3))
        assert cnt == [1]  # (undone: the refused call changed nothing)


def test_python_state_the_trace_makes_is_taken_away_after_it():
    """An attribute the first call makes (`getattr(self, "n", 0) + 1`) or values it appends to a
    list: the trace's own change is undone (the eager first call makes it once), and a change on
    every call is refused, as a changed number is."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            self.ncalls = getattr(self, "ncalls", 0) + 1
            if not hasattr(self, "history"):
                self.history = []
            self.history.append("called")
            return self.lin(x)

    m = Counting()
    f = gt.graphify(m)
    with torch.no_grad():
        f(torch.ones(3))
        assert m.ncalls == 1 and m.history == ["called"]
        with pytest.raises(gt.GraphifyError, match="changes Python"):
            f(torch.ones(3))
        assert m.ncalls == 1 and m.history == ["called"]


def test_an_optimizer_stepped_in_a_gradient_hook_is_state_the_step_reaches(device):
    """The "optimizer in backward" pattern: each parameter's optimizer steps in its
    post-accumulate-grad hook, the whole step (forward and backward) graphified."""
    import copy

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2).to(device)
    me = copy.deepcopy(m)

    def setup(mod):
        opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in mod.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in mod.parameters():
            p.register_post_accumulate_grad_hook(hook)

    setup(m)
    setup(me)

    def make(mod):
        def step(x):
            loss = mod(x).pow(2).sum()
            loss.backward()
            return loss.detach()

        return step

    g, e = gt.graphify(make(m)), make(me)
    for _ in range(4):
        x = torch.randn(3, 4, device=device)
        assert_close(g(x), e(x))
        for a, b in zip(m.parameters(), me.parameters()):
            assert_close(a, b)


def test_a_zero_grad_before_the_step_keeps_a_gradient_filled_outside_out_of_the_signature():
    """Which .grads a graphified step reads: zero_grad() first clears what the caller filled (the
    recording is replayed); a step before zero_grad() reads it (a new signature: see
    test_a_graphified_update_sees_parameters_that_start_getting_gradients)."""
    torch.manual_seed(0)
    m = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])
    o = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        o.zero_grad()
        loss = m[0](x).pow(2).mean()  # the head is not used
        loss.backward()
        o.step()
        return loss.detach()

    f = gt.graphify(step)
    for i in range(6):
        if i >= 2:
            m[1](m[0](torch.randn(3, 4))).sum().backward()  # fills the head's .grad outside
        f(torch.randn(3, 4))
    assert f.cache_info().hits >= 3


class _CapturesOnFirstUse(torch.nn.Module):
    """Installs forward hooks on its layers the first time it is asked to (Hugging Face's output
    capturing: hooks on every layer, and an attribute marking the model as hooked)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x, capture=False):
        if capture and not getattr(self, "_hooks_installed", False):
            for layer in self.layers:
                layer.register_forward_hook(lambda mod, i, o: _COLLECTED[-1].append(o) if _COLLECTED else None)
            self._hooks_installed = True
        _COLLECTED.append([])  # (per call, as transformers' output collection)
        try:
            for layer in self.layers:
                x = layer(x).tanh()
            return x, tuple(_COLLECTED[-1]) if capture else ()
        finally:
            _COLLECTED.pop()


_COLLECTED: list = []


def test_hooks_a_library_installs_on_first_use_are_installed_once(device):
    # the trace installed them, the undo took the marking attribute away, the eager first call
    # installed them again: every layer captured twice, in graphify and in eager afterwards
    torch.manual_seed(0)
    m = _CapturesOnFirstUse().to(device)
    f = gt.graphify(lambda x, capture: m(x, capture), static_argnums=(1,))
    x = torch.randn(3, 4, device=device)
    for capture in (False, True, True, True):
        out, seen = f(x, capture)
        assert len(seen) == (2 if capture else 0)
    assert all(len(layer._forward_hooks) == 1 for layer in m.layers)
    out, seen = m(x, True)
    assert len(seen) == 2


def test_hugging_face_hidden_states_are_captured_once_when_graphify_calls_first():
    tr = pytest.importorskip("transformers")
    cfg = tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tr.BertModel(cfg).eval()
    ids = torch.randint(1, 50, (2, 7))
    f = gt.graphify(lambda ids, hs: model(input_ids=ids, output_hidden_states=hs).hidden_states,
                    static_argnums=(1,))
    for hs in (True, True, False, True):
        got = f(ids, hs)
        want = model(input_ids=ids, output_hidden_states=hs).hidden_states
        assert (got is None) == (want is None)
        if want is not None:
            assert len(got) == len(want) == 3
            for a, b in zip(got, want):
                assert_close(a, b)


@pytest.mark.parametrize("where", ["dict", "global", "namedtuple", "object"])
def test_a_tuple_of_tensors_rebound_in_state_is_read_again(device, where):
    # truncated BPTT: state["hc"] = (h, c) after each chunk; the replays kept the tuple's tensors
    # from the recording call (a tensor, list or dict in that place was read again)
    import collections

    NT = collections.namedtuple("NT", "h c")
    holder = {"hc": None}
    obj = types.SimpleNamespace(hc=None)
    global _HC

    def put(v):
        global _HC
        if where in ("dict", "namedtuple"):
            holder["hc"] = NT(*v) if where == "namedtuple" else v
        elif where == "global":
            _HC = v
        else:
            obj.hc = v

    def get():
        return holder["hc"] if where in ("dict", "namedtuple") else _HC if where == "global" else obj.hc

    f = gt.graphify(lambda x: x * get()[0] + get()[1])
    x = torch.ones(2, device=device)
    for i in range(4):
        put((torch.full((2,), float(i), device=device), torch.full((2,), 10.0 * i, device=device)))
        assert_close(f(x), x * i + 10.0 * i)


_HC = None


@pytest.mark.parametrize("kind", ["deque", "list_of_tuples"])
def test_a_replay_buffer_filled_between_calls_is_read_again(device, kind):
    import collections

    torch.manual_seed(0)
    losses = {}
    for use in (False, True):
        q = torch.nn.Linear(2, 1).to(device)
        torch.nn.init.constant_(q.weight, 0.1)
        torch.nn.init.zeros_(q.bias)
        opt = torch.optim.SGD(q.parameters(), lr=0.01)
        buf = collections.deque(maxlen=4) if kind == "deque" else []
        step = _buffer_step(buf, q, opt)
        f = gt.graphify(step) if use else step
        out = []
        for i in range(6):
            buf.append((torch.tensor([float(i), 1.0], device=device), torch.tensor([2.0 * i], device=device)))
            out.append(f().clone())
        losses[use] = torch.stack(out)
    assert_close(losses[True], losses[False])


def _buffer_step(buf, q, opt):
    def step():
        obs = torch.stack([t[0] for t in buf])
        tgt = torch.stack([t[1] for t in buf])
        loss = torch.nn.functional.mse_loss(q(obs), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


_MICRO = 0


class _Trainer:
    global_step = 0


@pytest.mark.parametrize("where", ["global", "nonlocal", "class"])
def test_a_counter_in_a_global_closure_or_class_that_the_step_changes_is_refused(where):
    # gradient accumulation on a global count: the trace incremented it (the eager first call saw
    # 2 and stepped) and replays never did: the branch was frozen, silently wrong training
    global _MICRO
    _MICRO = 0
    _Trainer.global_step = 0
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def bump():
        global _MICRO
        if where == "global":
            _MICRO += 1
            return _MICRO
        _Trainer.global_step += 1
        return _Trainer.global_step

    def make():
        micro = 0

        def step(x):
            nonlocal micro
            if where == "nonlocal":
                micro += 1
                n = micro
            else:
                n = bump()
            loss = m(x).pow(2).mean()
            loss.backward()
            if n % 2 == 0:
                opt.step()
                opt.zero_grad()
            return loss

        return step

    f = gt.graphify(make())
    with pytest.raises(gt.GraphifyError, match=r"(?s)changes Python numbers.*static argument"):
        for i in range(4):
            f(torch.full((2, 4), float(i + 1)))


class _Registry:  # a "global registry" class holding the model and its optimizer
    model = None
    opt = None


class _TrainsItself(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.1, fused=True)

    def train_step(self, x):
        self.opt.zero_grad()
        loss = self.lin(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss.detach()


class _Wrapping(torch.optim.Optimizer):  # SAM / Lookahead style: an optimizer around another
    def __init__(self, params, **kw):
        super().__init__(params, {})
        self.base_optimizer = torch.optim.SGD(self.param_groups, **kw)

    @torch.no_grad()
    def step(self, closure=None):
        self.base_optimizer.step()


@pytest.mark.parametrize("how", ["class_attribute", "module_attribute", "wrapped", "weakref"])
def test_an_optimizer_reached_indirectly_is_state_or_refused_without_leaving_placeholders(how):
    # its lazily made state was made while tracing and left in opt.state as placeholders: the
    # call failed with a misleading message and the optimizer was broken for eager use too
    import weakref

    def build():
        torch.manual_seed(0)
        if how == "module_attribute":
            net = _TrainsItself()
            return net, net.opt, net.train_step
        m = torch.nn.Linear(4, 2)
        opt = (_Wrapping(m.parameters(), lr=0.1, momentum=0.9) if how == "wrapped"
               else torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        _Registry.model, _Registry.opt = m, (None if how == "weakref" else opt)
        ref = weakref.ref(opt)

        def step(x):
            o = ref() if how == "weakref" else _Registry.opt
            o.zero_grad()
            loss = _Registry.model(x).pow(2).mean()
            loss.backward()
            o.step()
            return loss.detach()

        return m, opt, step

    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    m, opt, step = build()
    want = [step(x).item() for x in xs]
    m, opt, step = build()
    f = gt.graphify(step)
    if how == "weakref":
        with pytest.raises(gt.GraphifyError, match=r"(?s)steps a SGD optimizer that gtransform does not find.*Fix:"):
            for x in xs:
                f(x)
        assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())
        return
    got = [f(x).item() for x in xs]
    assert_close(torch.tensor(got), torch.tensor(want))


@pytest.mark.parametrize("pattern", ["toggled_inside", "frozen_after_a_step"])
def test_requires_grad_set_inside_the_step_ends_as_in_eager(pattern):
    # the trace's requires_grad_(False) leaked into the eager first call (its update skipped),
    # and the trace's drop of history detached a parameter the function had re-enabled
    def build():
        torch.manual_seed(0)
        enc, head = nn.Linear(4, 4), nn.Linear(4, 1)
        opt = torch.optim.SGD(list(enc.parameters()) + list(head.parameters()), lr=0.1, momentum=0.9)

        def step(x):
            opt.zero_grad()
            if pattern == "toggled_inside":
                enc.requires_grad_(False)
                aux = head(enc(x)).pow(2).mean()  # trains the head only
                enc.requires_grad_(True)
                loss = head(enc(x)).mean() + aux
            else:
                loss = head(enc(x)).pow(2).mean()
            loss.backward()
            opt.step()
            if pattern == "frozen_after_a_step":
                enc.weight.requires_grad_(False)
            return loss.detach()

        return enc, head, step

    x = torch.ones(2, 4)
    runs = {}
    for use in (False, True):
        enc, head, step = build()
        f = gt.graphify(step) if use else step
        out = []
        for _ in range(3):
            out.append(f(x).clone())
            out.append(torch.tensor(float(enc.weight.requires_grad)))
        runs[use] = (torch.stack(out), enc.weight.detach().clone(), head.weight.detach().clone())
    for a, b in zip(runs[True], runs[False]):
        assert_close(a, b)


@functools.lru_cache(maxsize=8)
def _causal_mask(n):
    return torch.full((n, n), float("-inf")).triu(1)


@pytest.mark.parametrize("touches_state", [True, False])
def test_a_functools_cache_the_function_calls_keeps_real_tensors(touches_state):
    # a causal mask or RoPE table built by an lru_cache'd helper: the trace stored a placeholder
    # in the cache, and the next call (graphify's eager first one, or any eager code) got it back
    _causal_mask.cache_clear()
    lin = nn.Linear(4, 4)

    def attn(x):
        h = lin(x) if touches_state else x * 2
        return (h @ h.transpose(-1, -2) + _causal_mask(x.shape[1])).softmax(-1)

    f = gt.graphify(attn)
    with torch.no_grad():
        for n in (5, 5, 5, 6, 6):
            x = torch.randn(2, n, 4)
            assert_close(f(x), attn(x))
    assert all(type(_causal_mask(n)) is torch.Tensor for n in (5, 6))


def _mode_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_model_train_in_the_step_with_an_eager_validation_between_steps():
    # `def train_step(): model.train(); ...` and an eager model.eval() validation every few steps:
    # the step after each validation was refused ("switches ... on every call"); its replays now
    # set the flags as eager does
    runs = {}
    for use in (False, True):
        model = _mode_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def train_step(x, y, model=model, opt=opt):
            model.train()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        f = gt.graphify(train_step) if use else train_step
        g = torch.Generator().manual_seed(1)
        out = []
        for step in range(9):
            out.append(f(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)).clone())
            out.append(torch.tensor(float(model.training)))
            if step % 3 == 2:
                model.eval()
                with torch.no_grad():
                    out.append(model(torch.randn(4, 4, generator=g)).sum())
        runs[use] = (torch.stack(out), [p.detach().clone() for p in model.parameters()], model[1].running_mean.clone())
        if use:
            assert f.cache_info().hits >= 3
    assert_close(runs[True][0], runs[False][0])
    for a, b in zip(runs[True][1], runs[False][1]):
        assert_close(a, b)
    assert_close(runs[True][2], runs[False][2])


def test_two_graphified_steps_that_each_set_their_mode_replay_and_leave_it_as_eager():
    models = [_mode_model(), _mode_model()]
    fns = []
    for m in models:
        def train_step(x, m=m):
            m.train()
            return m(x).sum()

        def eval_step(x, m=m):
            m.eval()
            return m(x).sum()

        fns.append((train_step, eval_step))
    ft, fe = gt.graphify(fns[1][0]), gt.graphify(fns[1][1])
    et, ee = fns[0]
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 4)
            assert_close(ft(x), et(x))
            assert models[1].training and models[0].training
            assert_close(fe(x), ee(x))
            assert not models[1].training and not models[0].training
            assert_close(models[1][1].running_mean, models[0][1].running_mean)
    assert ft.cache_info().hits >= 3 and fe.cache_info().hits >= 3


class _StoresItsSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.n = 0
        self.mode = None

    def forward(self, x, mode="a"):
        self.n = x.shape[0]
        self.mode = mode
        return self.lin(x) * 2


def test_python_values_the_forward_sets_are_left_as_eager_leaves_them():
    # self.n = x.shape[0] and self.mode = mode: a replay of one signature left the values the
    # last traced call of another signature set
    m, ref = _StoresItsSize(), _StoresItsSize()
    ref.load_state_dict(m.state_dict())
    g = gt.graphify(m, static_argnums=(1,))
    with torch.no_grad():
        for n, mode in [(3, "a"), (3, "a"), (3, "a"), (4, "b"), (4, "b"), (4, "b"), (3, "a"), (3, "b"), (4, "a"), (3, "a")]:
            x = torch.randn(n, 2)
            assert_close(g(x, mode), ref(x, mode))
            assert (m.n, m.mode) == (ref.n, ref.mode)


@pytest.mark.parametrize("kind", ["list_iterator", "generator", "dataloader", "cycle"])
def test_a_step_that_takes_its_batch_from_an_iterator_is_refused(kind):
    # `x, y = next(it)` inside the step: the replays reused the trace's batch forever
    import itertools

    data = [(torch.full((2, 4), float(i)), torch.full((2, 1), float(i))) for i in range(20)]
    if kind == "list_iterator":
        it = iter(data)
    elif kind == "cycle":  # (itertools' iterators: their position is what pickling them keeps)
        it = itertools.cycle(data)
    elif kind == "generator":
        it = (b for b in data)
    else:
        it = iter(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])), batch_size=None))
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step():
        x, y = next(it)
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        return loss

    f = gt.graphify(step)
    with pytest.raises(gt.GraphifyError, match=r"(?s)takes items from the iterator it.*Fix: take the items outside"):
        for _ in range(3):
            f()


def test_grad_scaler_step_outside_replays_and_inside_names_the_fix():
    # the fix the refusal gave (fused=True) led to a second refusal about GradScaler's internals;
    # and the working split (scale and backward inside, step and update outside) traced again on
    # every call: scaler.update() rebinds a dict the signature checked
    def build():
        torch.manual_seed(0)
        m = nn.Linear(4, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, fused=True)
        sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

        def fwd_bwd(x):
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            sc.scale(loss).backward()
            return loss.detach()

        def whole(x):
            loss = fwd_bwd(x)
            sc.step(opt)
            sc.update()
            return loss

        return m, opt, sc, fwd_bwd, whole

    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    out = {}
    for use in (False, True):
        m, opt, sc, fwd_bwd, _ = build()
        f = gt.graphify(fwd_bwd) if use else fwd_bwd
        losses = []
        for x in xs:
            losses.append(f(x).clone())
            sc.step(opt)
            sc.update()
        out[use] = (torch.stack(losses), m.weight.detach().clone(), sc.get_scale())
        if use:
            assert f.cache_info().hits >= 3
    assert_close(out[True][0], out[False][0])
    assert_close(out[True][1], out[False][1])
    assert out[True][2] == out[False][2]
    *_, whole = build()
    g = gt.graphify(whole)
    with pytest.raises(gt.GraphifyError, match=r"(?s)GradScaler.*Fix: keep scaler.step\(optimizer\) and "
                                               r"scaler.update\(\) outside"):
        for x in xs:
            g(x)


# -- a replay's in-place writes move version counters, as eager's ops do ---------------------------


def test_a_replay_moves_the_version_of_state_it_writes_so_another_functions_frozen_read_sees_it(device):
    """One function advances a counter in place, another reads it on the host (a frozen read,
    guarded by the counter's version): a CUDA replay runs no op that would bump the version, so
    the call bumps it, or the reader would keep the first value it froze."""
    cnt = torch.zeros((), device=device)
    step = gt.graphify(lambda x: (cnt.add_(1), x * 2)[1])
    read = gt.graphify(lambda x: x * cnt.item())
    x = torch.ones(3, device=device)
    for i in range(1, 6):
        v = cnt._version
        step(x)
        assert cnt._version > v, f"call {i}: the write left the version at {v}"
        assert_close(read(x), x * i)


def test_a_replay_moves_the_version_of_an_argument_it_writes_in_place(device):
    ptr = torch.zeros((), dtype=torch.long, device=device)
    buf = torch.arange(10.0, device=device)
    advance = gt.graphify(lambda p: p.add_(1))
    at = gt.graphify(lambda b: b[ptr.item()] * 1)
    for i in range(1, 5):
        v = ptr._version
        advance(ptr)
        assert ptr._version > v
        assert float(at(buf)) == float(i)


def test_autograd_sees_a_saved_tensor_written_by_a_replay(device):
    """Eager raises when a tensor saved for backward was written in place since; so must a
    graphified write of it (a replay that bumped no version would let backward run on new values)."""
    state = torch.ones(3, device=device)
    scale = gt.graphify(lambda: state.mul_(2))
    scale()
    scale()  # (recorded: the first call of a function that touches state runs eagerly)
    w = torch.ones(3, device=device, requires_grad=True)
    y = (w * state).sum()
    scale()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_a_graphified_training_step_and_a_graphified_pruned_inference_match_eager(device):
    """The inference freezes a mask of the weights (a read under no_grad): each optimizer step the
    training graph replays must trace it again, as eager recomputes it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(device)
    ref = copy.deepcopy(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)

    def train(m, o, x, y):
        o.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        o.step()
        return loss

    def pruned(m, x):
        with torch.no_grad():
            keep = m.weight.abs().sum(0) > 1.2
            return x[:, keep] @ m.weight[:, keep].t()

    step = gt.graphify(lambda x, y: train(lin, opt, x, y))
    infer = gt.graphify(lambda x: pruned(lin, x))
    for _ in range(6):
        x, y = torch.randn(16, 8, device=device), torch.randn(16, 4, device=device) * 4
        assert_close(step(x, y), train(ref, ref_opt, x, y))
        with torch.no_grad():  # (inference: a read of the weights is frozen, see docs/host-reads.md)
            assert_close(infer(x), pruned(ref, x))


# -- a tensor left in state and returned is one tensor, as in eager --------------------------------


def test_a_tensor_stored_in_state_and_returned_is_the_same_object_every_call(device):
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.last = None

        def forward(self, x):
            h = self.lin(x).detach()
            self.last = h
            return h

    torch.manual_seed(0)
    m = Keeps().to(device)
    f = gt.graphify(m)
    with torch.no_grad():
        for _ in range(4):
            out = f(torch.ones(1, 3, device=device))
            assert out is m.last
            out.zero_()  # an in-place edit of the output is an edit of the state, as in eager
            assert float(m.last.abs().sum()) == 0.0
        prev = f(torch.ones(1, 3, device=device))
        f(torch.ones(1, 3, device=device))
    with pytest.raises(gt.OverwrittenOutputError):  # (the output rule: valid until the next call)
        prev.sum()


def test_returned_gradients_scaled_in_place_reach_the_optimizer(device):
    """A step returns the gradients backward() made (zero_grad set them to None), the caller
    scales them in place and steps outside: eager's p.grad is the returned tensor."""
    def run(graphify):
        torch.manual_seed(0)
        p = nn.Parameter(torch.ones(4, device=device))
        opt = torch.optim.SGD([p], lr=0.1)

        def grads(x):
            opt.zero_grad()
            (p * x).sum().backward()
            return p.grad

        g_fn = gt.graphify(grads) if graphify else grads
        for _ in range(5):
            g = g_fn(torch.full((4,), 0.5, device=device))
            g.mul_(2)
            opt.step()
        return p.detach().clone()

    assert_close(run(True), run(False))


# -- state behind library decorators (found by a bug hunt) ---------------------------------

_WRAPPED_MODEL = None
_WRAPPED_W = None


def _wrapped_fns():
    @torch.no_grad()
    @torch.autocast("cpu", enabled=False)
    def infer(x):
        return _WRAPPED_MODEL(x * _WRAPPED_W)

    def loss(w, x):
        return (_WRAPPED_MODEL(x * w) ** 2).sum()

    return {
        "no_grad+autocast": (infer, lambda x: (x,)),
        "vmap(grad)": (torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0)), lambda x: (_WRAPPED_W, x)),
        "vmap(vmap)": (torch.func.vmap(torch.func.vmap(lambda x: _WRAPPED_MODEL(x * _WRAPPED_W))),
                       lambda x: (x.reshape(3, 1, 4),)),
    }


@pytest.mark.parametrize("which", ["no_grad+autocast", "vmap(grad)", "vmap(vmap)"])
@pytest.mark.parametrize("change", ["model", "w", "parameter"])
def test_state_behind_two_library_decorators_is_read_again_when_rebound(device, which, change):
    """torch.no_grad() over autocast, vmap over grad: the walk goes through functools.wraps wrappers,
    so a global rebound (a new model, a new tensor, a new nn.Parameter) is seen, as with one wrapper."""
    global _WRAPPED_MODEL, _WRAPPED_W
    torch.manual_seed(0)
    _WRAPPED_MODEL, _WRAPPED_W = nn.Linear(4, 2).to(device), torch.ones(4, device=device)
    fn, args = _wrapped_fns()[which]
    f = gt.graphify(fn)
    x = torch.randn(3, 4, device=device)
    try:
        for i in range(4):
            if i == 2:
                if change == "model":
                    _WRAPPED_MODEL = nn.Linear(4, 2).to(device)
                elif change == "w":
                    _WRAPPED_W = torch.full((4,), 3.0, device=device)
                else:
                    _WRAPPED_MODEL.weight = nn.Parameter(torch.randn(2, 4, device=device))
            assert_close(f(*args(x)), fn(*args(x)))
    finally:
        _WRAPPED_MODEL = _WRAPPED_W = None


# -- Python side effects inside a module's forward (found by a bug hunt) ------------------------

import functools  # noqa: E402


@functools.lru_cache(None)
def _causal_bias(n, device):
    return torch.full((n, n), float("-inf"), device=device).triu(1)


class _CachedAttn(nn.Module):
    _tables: dict = {}  # a memo the class keeps for all its instances

    def __init__(self, d=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def table(self, n, device):
        if n not in _CachedAttn._tables:
            t = torch.arange(n, dtype=torch.float32, device=device)[:, None] * 0.01
            _CachedAttn._tables[n] = t.cos()
        return _CachedAttn._tables[n]

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2) + _causal_bias(x.shape[1], x.device)).softmax(-1)
        return (a @ v) * self.table(x.shape[1], x.device)


@pytest.mark.parametrize("how", ["module", "lambda", "train_step"])
def test_caches_a_modules_forward_fills_keep_no_placeholder(device, how):
    """An lru_cache'd mask and a class-level memo filled inside forward: the trace's placeholder
    was left there (the model failed eagerly for the rest of the process); the methods of the
    user's module classes and their class-level containers are walked like the function's own."""
    _causal_bias.cache_clear()
    _CachedAttn._tables.clear()
    torch.manual_seed(0)
    m = _CachedAttn().to(device)
    ref = _CachedAttn().to(device)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 3, 4, device=device)
    if how == "train_step":
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)

        def make(model, o):
            def step(x):
                o.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                o.step()
                return loss.detach()
            return step

        f, eager = gt.graphify(make(m, opt)), make(ref, opt_ref)
        for _ in range(4):
            assert_close(f(x), eager(x))
    else:
        f = gt.graphify(m) if how == "module" else gt.graphify(lambda x: m(x))
        with torch.no_grad():
            for _ in range(3):
                assert_close(f(x), ref(x))
    assert all(type(t) is torch.Tensor for t in _CachedAttn._tables.values())
    with torch.no_grad():
        assert_close(m(x), ref(x))  # (eager calls of the model still work)


_FORWARD_CALLS = 0


class _Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        global _FORWARD_CALLS
        _FORWARD_CALLS += 1
        return self.lin(x)


def test_a_global_counter_bumped_in_a_modules_forward_is_refused_not_frozen():
    global _FORWARD_CALLS
    _FORWARD_CALLS = 0
    m = _Counting()
    f = gt.graphify(m)
    x = torch.randn(2, 3)
    with torch.no_grad():
        f(x)  # (the first call of a signature that touches state runs eagerly: exact)
        assert _FORWARD_CALLS == 1
        with pytest.raises(gt.GraphifyError, match="_FORWARD_CALLS"):
            f(x)


# a module-level name that the function below uses only as an attribute name (`.logits`)
logits = None


class _ModelOutput:
    def __init__(self, logits):
        self.logits = logits


def test_a_global_named_like_an_attribute_the_function_reads_is_not_its_state(device):
    """`model(x).logits` names the attribute `logits`, not the global: a stale output held in a
    global `logits` was taken as state, and the next new size raised OverwrittenOutputError
    about a tensor the call never touches (found by a bug hunt)."""
    global logits
    torch.manual_seed(0)
    lin = nn.Linear(8, 4).to(device)
    f = gt.graphify(lambda x: _ModelOutput(lin(x)).logits.softmax(-1))
    try:
        with torch.no_grad():
            f(torch.randn(4, 8, device=device))
            logits = f(torch.randn(4, 8, device=device))
            f(torch.randn(4, 8, device=device))  # (the global is stale now: nobody reads it)
            x = torch.randn(6, 8, device=device)
            assert_close(f(x), lin(x).softmax(-1))
    finally:
        logits = None


@pytest.mark.parametrize("kind", ["OrderedDict", "defaultdict", "list subclass", "dict reordered", "module deque"])
def test_containers_of_any_list_or_dict_type_are_keyed_when_they_change(device, kind):
    """An OrderedDict of task heads, a defaultdict, a list subclass, a deque kept on a module (a MoCo queue)
    that grows between calls, and a plain dict whose keys are reordered: eager reads the new contents; the
    exact-type checks had left them unkeyed, replaying the old entries (found by a bug hunt)."""
    import collections

    class Mem(list):
        pass

    def t(v):
        return torch.tensor([v], device=device)

    holder = nn.Module()
    if kind == "OrderedDict":
        bank = collections.OrderedDict(a=t(1.0))
    elif kind == "defaultdict":
        bank = collections.defaultdict(lambda: t(0.0), a=t(1.0))
    elif kind == "list subclass":
        bank = Mem([t(1.0)])
    elif kind == "dict reordered":
        bank = {"a": t(1.0), "b": t(2.0), "c": t(3.0)}
    else:
        holder.queue = collections.deque([t(1.0)], maxlen=3)
        bank = holder.queue

    def fn(x):
        vals = list(bank.values()) if isinstance(bank, dict) else list(holder.queue if kind == "module deque" else bank)
        return x * torch.cat(vals) * torch.arange(1, len(vals) + 1, device=device)

    f = gt.graphify(fn)
    x = torch.ones(1, device=device)
    for i in range(5):
        if i:
            if kind == "dict reordered":
                k = next(iter(bank))
                bank[k] = bank.pop(k)
            elif isinstance(bank, dict):
                bank[f"k{i}"] = t(float(i + 1))
            else:
                bank.append(t(float(i + 1)))
        assert_close(f(x), fn(x))


_PRIOR = None


def test_a_torch_distribution_the_function_reaches_is_state():
    """A global Normal rebound between calls, its loc replaced, and a Categorical whose lazy .probs
    the trace computes: the distribution was taken for one of torch's own objects and not walked
    (the old prior replayed; the lazy attribute kept the trace's placeholder); found by a bug hunt."""
    global _PRIOR
    from torch.distributions import Categorical, Normal

    _PRIOR = Normal(torch.zeros(2), torch.ones(2), validate_args=False)

    def f(x):
        return _PRIOR.log_prob(x).sum()

    g = gt.graphify(f)
    try:
        for i in range(5):
            if i == 2:
                _PRIOR = Normal(torch.full((2,), 3.0), torch.ones(2), validate_args=False)
            if i == 3:
                _PRIOR.loc = torch.full((2,), -2.0)
            x = torch.randn(2)
            assert_close(g(x), f(x))
    finally:
        _PRIOR = None
    d = Categorical(logits=torch.tensor([0.0, 1.0, 2.0]))

    def h(x):
        return d.probs * x + d.entropy()

    gh = gt.graphify(h)
    for _ in range(3):
        x = torch.randn(3)
        assert_close(gh(x), h(x))
    assert type(d.__dict__.get("probs", torch.zeros(()))) is torch.Tensor

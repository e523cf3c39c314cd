"""Host reads of unchanged tensors are guarded constants (DESIGN semantics 12).

Each program runs graphified and eagerly side by side, step by step: a closed-over time
grid read on the host (a torchdiffeq-like rk4 loop, and torchdiffeq itself), an index-like
argument passed as the same tensor (PyG-like message passing, and PyG's GCNConv / GATConv),
a closed-over flag buffer; then the tensors change (written in place, or another object
passed) and the calls give eager's numbers again, traced again. Reads of the call's own
data stay GraphifyErrors.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import gtransform as gt


def _rk4(t):
    def step(y):
        assert (t[1:] > t[:-1]).all()
        for i in range(len(t) - 1):
            dt = t[i + 1].item() - t[i].item()
            f = lambda v: torch.tanh(v) - 0.5 * v  # noqa: E731
            k1 = f(y)
            k2 = f(y + dt / 2 * k1)
            k3 = f(y + dt / 2 * k2)
            k4 = f(y + dt * k3)
            y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return y

    return step


def test_closed_over_time_grid_is_frozen_and_guarded():
    t = torch.linspace(0, 1, 21)
    step = _rk4(t)
    g = gt.graphify(step)
    for k in range(6):
        if k == 3:
            t.mul_(2)  # written in place: traced again
        y = torch.randn(5)
        assert_close(g(y), step(y))
    assert g.cache_info().hits >= 2
    d = g.describe()
    assert "frozen host read" in d and "hangs on t" in d and "test_frozen.py" in d


def test_time_grid_argument_float_is_the_calls_data():
    """A floating-point argument read on the host is the call's data: an error, as before."""
    step = lambda y, t: y * t[1].item()  # noqa: E731
    with pytest.raises(gt.GraphifyError, match="reads a tensor's value on the host"):
        gt.graphify(step)(torch.ones(2), torch.linspace(0, 1, 3))


def test_torchdiffeq_rk4_on_a_closed_over_grid():
    torchdiffeq = pytest.importorskip("torchdiffeq")
    torch.manual_seed(0)
    w = torch.randn(4, 4) * 0.3
    t = torch.linspace(0, 1, 11)
    func = lambda s, y: torch.tanh(y @ w) - 0.1 * y * s  # noqa: E731
    solve = lambda y0: torchdiffeq.odeint(func, y0, t, method="rk4")  # noqa: E731
    g = gt.graphify(solve)
    for k in range(7):
        if k == 3:
            t.mul_(0.5)
        y0 = torch.randn(3, 4)
        assert_close(g(y0), solve(y0))
    assert g.cache_info().hits >= 2


def _message_passing(n):
    def layer(x, edge_index):
        keep = edge_index[0] != edge_index[1]
        ei = edge_index[:, keep]  # a data-dependent shape (nonzero)
        nodes = torch.unique(ei[0])
        deg = torch.bincount(ei[1], minlength=n).clamp(min=1)
        agg = torch.zeros_like(x).index_add_(0, ei[1], x[ei[0]])
        return agg / deg[:, None], nodes, deg.max().item()

    return layer


def test_same_edge_index_argument_is_frozen_and_a_new_one_traced_again():
    torch.manual_seed(0)
    n = 30
    layer = _message_passing(n)
    g = gt.graphify(layer)
    ei = torch.randint(0, n, (2, 120))
    for k in range(7):
        if k == 4:
            ei = torch.randint(0, n, (2, 120))  # another object: eager once, then frozen again
        x = torch.randn(n, 3)
        assert_close(g(x, ei), layer(x, ei))
    assert g.cache_info().hits >= 3
    assert "hangs on args[1]" in g.describe()


def test_an_argument_passed_anew_on_every_call_is_the_calls_data():
    f = gt.graphify(lambda x, idx: x[idx[idx > 0]])
    x = torch.arange(4.0)
    assert_close(f(x, torch.tensor([0, 1, 2])), x[torch.tensor([1, 2])])  # runs eagerly
    # (a second object may be another structure passed in turn, a validation graph: eagerly too)
    assert_close(f(x, torch.tensor([0, 3, 2])), x[torch.tensor([3, 2])])
    with pytest.raises(gt.GraphifyError, match="depends on the data|reads a tensor's value"):
        f(x, torch.tensor([1, 0, 2]))


def test_closed_over_flag_buffer_read_with_item():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("enabled", torch.tensor(True))

        def forward(self, x):
            if self.enabled.item():
                return self.lin(x) * 2
            return self.lin(x)

    m = M()
    g = gt.graphify(m)
    with torch.no_grad():
        for k in range(6):
            if k == 3:
                m.enabled.fill_(False)
            x = torch.randn(2, 3)
            assert_close(g(x), m(x))


def test_read_of_fresh_data_stays_an_error():
    g = gt.graphify(lambda x: x * x.sum().item())
    with pytest.raises(gt.GraphifyError, match=r"(?s)reads a tensor's value on the host.*x\.sum\(\)\.item\(\)"):
        g(torch.ones(2))


def test_pyg_gcn_and_gat_with_the_same_edge_index():
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    n, e = 500, 4000
    ei = torch.randint(0, n, (2, e))
    for conv in (pyg.GCNConv, pyg.GATConv):
        c1, c2 = conv(16, 32), conv(32, 4)

        def model(x, edge_index, c1=c1, c2=c2):
            return c2(torch.relu(c1(x, edge_index)), edge_index)

        g = gt.graphify(model)
        with torch.no_grad():
            for k in range(5):
                if k == 3:
                    ei = torch.randint(0, n, (2, e))
                x = torch.randn(n, 16)
                torch.testing.assert_close(g(x, ei), model(x, ei), atol=1e-4, rtol=1e-4)


@settings(deadline=None, derandomize=True, max_examples=25)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(0, 3))
def test_frozen_nonzero_and_masked_select_match_eager(bits, shift):
    mask = torch.tensor(bits)

    def f(x):
        return torch.masked_select(x, mask) + shift, torch.nonzero(mask).float().sum(), x[mask].sum()

    g = gt.graphify(f)
    for _ in range(3):
        x = torch.randn(len(bits))
        assert_close(g(x), f(x))
    mask.logical_not_()  # written in place: traced again
    x = torch.randn(len(bits))
    assert_close(g(x), f(x))


def test_frozen_read_of_state_given_new_memory_by_data_traces_again():
    """`w.data = other` keeps the object and its version counter: the guard also compares the data
    pointer, so the value frozen from the old memory is not replayed (it was, silently)."""
    w = torch.randn(20)

    def fn(x):
        return x * w.max().item()

    f = gt.graphify(fn)
    for _ in range(3):
        x = torch.randn(5)
        assert_close(f(x), fn(x))
    w.data = torch.randn(20) * 10
    for _ in range(3):
        x = torch.randn(5)
        assert_close(f(x), fn(x))


def test_a_closed_over_mask_changed_in_place_is_seen_where_it_indexes_state():
    """``w[mask]`` with both closed over: the mask's indices are frozen (guarded on the mask), not
    the indexed values (a change of the mask traces again; w's values follow)."""
    w = torch.arange(6.0)
    mask = torch.tensor([True, False, True, True, False, True])
    fn = lambda x: x * w[mask]  # noqa: E731
    f = gt.graphify(fn)
    for _ in range(3):
        assert_close(f(torch.ones(4)), fn(torch.ones(4)))
    assert "hangs on mask" in f.describe()
    mask.copy_(torch.tensor([False, True, True, True, True, False]))  # the same count, other rows
    assert_close(f(torch.ones(4)), fn(torch.ones(4)))
    w.add_(1)  # w read in place by the recording: no new trace needed
    assert_close(f(torch.ones(4)), fn(torch.ones(4)))


def test_a_parameter_indexed_by_a_frozen_mask_gets_its_gradient_every_call():
    w = torch.nn.Parameter(torch.arange(6.0))
    mask = torch.tensor([True, False, True, True, False, True])
    f = gt.graphify(lambda x: (x * w[mask]).sum())
    for _ in range(3):
        w.grad = None
        f(torch.ones(4)).backward()
        assert_close(w.grad, mask.float())


def test_a_mask_made_from_a_parameter_is_not_frozen_under_grad_mode():
    """A read of tensors being trained: an optimizer (or .data) changes them every step, and a
    constant would carry no gradient. The error says so; under no_grad (inference) it is frozen."""
    lin = torch.nn.Linear(6, 6)
    keep = lambda x: x[:, lin.bias > 0]  # noqa: E731
    f = gt.graphify(keep)
    x = torch.randn(3, 6)
    with pytest.raises(gt.GraphifyError) as info:
        for _ in range(2):
            f(x)
    msg = str(info.value)
    assert "bias" in msg and "require grad" in msg and 'on_break="split"' in msg
    with torch.no_grad():
        for _ in range(3):
            assert_close(f(x), keep(x))


def test_a_boolean_mask_argument_passed_again_is_frozen():
    m = torch.tensor([True, False, True, False])
    f = gt.graphify(lambda x, mask: x[:, mask] * 2)
    for _ in range(3):
        x = torch.randn(2, 4)
        assert_close(f(x, m), x[:, m] * 2)
    assert "frozen host read" in f.describe()


def test_a_new_graph_on_consecutive_calls_names_the_argument_and_the_fix():
    def f(x, ei):
        return x[ei[0][ei[0] != ei[1]]]

    g = gt.graphify(f)
    x = torch.randn(10, 3)
    graphs = [torch.randint(0, 10, (2, 12)) for _ in range(3)]
    with pytest.raises(gt.GraphifyError) as info:
        for ei in graphs:
            assert_close(g(x, ei), f(x, ei))
    msg = str(info.value)
    assert "args[1]" in msg and "same tensor" in msg and "on_break" in msg


def test_a_frozen_tensor_that_keeps_changing_warns_with_the_on_break_fix():
    t = torch.linspace(0, 1, 5)

    def f(y):
        for i in range(len(t) - 1):
            y = y + (t[i + 1] - t[i]).item() * y.tanh()
        return y

    g = gt.graphify(f)
    y = torch.randn(3)
    with pytest.warns(gt.RerecordWarning) as rec:
        for _ in range(40):
            assert_close(g(y), f(y))
            t.mul_(1.01)  # the grid changes every call: every call traces again
    msg = "\n".join(str(w.message) for w in rec if issubclass(w.category, gt.RerecordWarning))
    assert "frozen from it" in msg and 'on_break="split"' in msg


def test_a_read_of_state_the_function_writes_names_it():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.n += 1
            if self.n % 100 == 0:
                return x * 0
            return x * 2

    f = gt.graphify(Counter())
    with pytest.raises(gt.GraphifyError) as info:
        for _ in range(2):
            f(torch.randn(3))
    assert "module.n, which the function writes in place" in str(info.value)


@pytest.mark.parametrize("how", ["same", "view"])
def test_a_read_of_state_the_call_writes_through_an_argument_is_not_frozen(how):
    # the argument is the closed-over tensor (or its base): a write through the argument is a
    # write of the state, whose read was frozen from its value before the write (silently wrong)
    def make(state, seen):
        def step(x):
            x.mul_(2) if how == "same" else x.add_(1)
            n = int((seen > (3 if how == "same" else 1.5)).sum())
            return x[:n] + 0
        return step

    def start():
        return torch.tensor([1.0, 2.0, 3.0]) if how == "same" else torch.zeros(6)

    te, tg = start(), start()
    eager = make(te, te if how == "same" else te[:3])
    f = gt.graphify(make(tg, tg if how == "same" else tg[:3]))
    with pytest.raises(gt.GraphifyError, match=r"(?s)reads a tensor's value on the host.*which the function writes"):
        for _ in range(3):
            assert_close(f(tg), eager(te))
    s = gt.graphify(make(tg, tg if how == "same" else tg[:3]), on_break="split")
    te.copy_(tg)
    for _ in range(3):
        assert_close(s(tg), eager(te))


def test_a_parameter_read_in_a_no_grad_block_of_a_training_call_is_not_frozen():
    # magnitude pruning: the threshold read under no_grad inside a training forward. Updated
    # through .data (no version counter moves), a frozen threshold went stale silently
    class Pruned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                thr = float(self.lin.weight.abs().flatten().kthvalue(32).values)
            w = self.lin.weight * (self.lin.weight.abs() > thr)
            return torch.nn.functional.linear(x, w, self.lin.bias)

    torch.manual_seed(0)
    m = Pruned()
    f = gt.graphify(m)
    x = torch.randn(16, 8)
    with pytest.raises(gt.GraphifyError, match=r"(?s)module\.lin\.weight, which require grad.*no_grad\(\) block"):
        for _ in range(2):
            f(x).sum().backward()
    with torch.no_grad():  # inference: the weights do not change, the read is frozen and recorded
        for _ in range(3):
            assert_close(f(x), m(x))
    assert f.cache_info().hits >= 1


def test_a_read_of_a_tensor_made_under_inference_mode_is_refused_with_the_fix():
    # an inference tensor has no version counter: freezing it raised torch's internal
    # "Inference tensors do not track version counter"
    lin = torch.nn.Linear(4, 4)
    with torch.inference_mode():
        mask = torch.tensor([True, False, True, False])
    f = gt.graphify(lambda y: lin(y)[:, mask] * 1)
    with torch.inference_mode():
        y = torch.randn(2, 4)
        with pytest.raises(gt.GraphifyError, match=r"(?s)depends on mask, which was made under torch\.inference_mode"
                                                   r".*Fix: make it outside inference mode"):
            for _ in range(3):  # (the first call, which reads state, runs eagerly)
                f(y)
    mask = mask.clone()  # (outside inference mode: a normal tensor, frozen and guarded)
    g = gt.graphify(lambda y: lin(y)[:, mask] * 1)
    with torch.inference_mode():
        for _ in range(3):
            assert_close(g(y), lin(y)[:, mask])


def test_a_train_and_a_validation_graph_passed_in_turn_are_each_frozen_and_replayed():
    # each kept as one object and passed again, as the docs advise: nothing was ever recorded,
    # and every validation call raised
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = pyg.GCNConv(8, 16), pyg.GCNConv(16, 4)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    m = Net().eval()
    f = gt.graphify(m)
    graphs = [torch.randint(0, 30, (2, 60)), torch.randint(0, 30, (2, 60))]
    x = torch.randn(30, 8)
    with torch.no_grad():
        for _ in range(4):
            for ei in graphs:
                assert_close(f(x, ei), m(x, ei))
    assert f.cache_info().hits >= 4


@pytest.mark.parametrize("sizes", ["same", "varying"])
def test_a_new_graph_on_every_call_keeps_being_refused_when_the_function_reaches_state(sizes):
    # a DataLoader of graphs: after the two calls that probe for a fixed graph, every call with a
    # new graph is refused; it was run eagerly two calls out of three, silently (a failed first
    # trace that reached state ran eagerly and forgot the graphs seen)
    lin = torch.nn.Linear(3, 3)

    def f(x, ei):
        h = lin(x)
        return h[ei[0][ei[0] != ei[1]]].sum(0)

    g = gt.graphify(f)
    outcomes = []
    with torch.no_grad():
        for i in range(8):
            n = 10 if sizes == "same" else 10 + i
            x, ei = torch.randn(n, 3), torch.randint(0, n, (2, 2 * n))
            try:
                assert_close(g(x, ei), f(x, ei))
                outcomes.append("ran")
            except gt.GraphifyError as e:
                assert "on_break" in str(e)
                outcomes.append("refused")
    assert outcomes[2:] == ["refused"] * 6, outcomes


def test_a_read_through_a_tensor_the_function_writes_in_place_says_why_it_is_not_frozen():
    # torchdiffeq's step_size grid: t_infer[-1] = t[-1], then `assert time_grid[0] == t[0]`
    t = torch.linspace(0, 1, 5)

    def f(y):
        grid = torch.arange(0, 1.01, 0.25)
        grid[-1] = t[-1]
        assert bool(grid[-1] == t[-1])
        return y * grid.sum()

    with pytest.raises(gt.GraphifyError, match=r"(?s)The read depends on t, unchanged, but the value read is "
                       r"computed through a tensor the function.*writes in place.*on_break=\"split\""):
        g = gt.graphify(f)
        for _ in range(3):
            g(torch.ones(2))


# -- whole-tensor reads of state: tolist(), numpy(), np.asarray(), f"{t:d}" ------------------------


@pytest.mark.parametrize("how", ["tolist", "numpy", "asarray", "format"])
def test_value_reads_of_a_closed_over_tensor_are_frozen_and_guarded(device, how):
    """Before: on the CPU, tolist() touched the memory with no op the trace saw (frozen with no
    guard: an in-place write went unseen) and numpy() read the stand-in's placeholder memory."""
    import numpy as np

    idx = torch.tensor([3, 1, 2], device=device)

    def read():
        if how == "tolist":
            return idx.tolist()
        if how == "numpy":
            return idx.cpu().numpy().tolist() if device == "cpu" else idx.tolist()
        if how == "asarray":
            return np.asarray(idx).tolist() if device == "cpu" else idx.tolist()
        return [int(f"{idx[k]:d}") for k in range(3)]

    def fn(x):
        return torch.stack([x[i] for i in read()])

    f = gt.graphify(fn)
    x = torch.arange(10.0, device=device)
    for _ in range(3):
        assert_close(f(x), fn(x))
    idx.copy_(torch.tensor([0, 9, 4]))  # a write the guard must see
    for _ in range(2):
        assert_close(f(x), torch.tensor([0.0, 9.0, 4.0], device=device))
    assert "frozen host read" in f.describe()


def test_a_read_of_trained_values_in_a_step_over_index_arguments_is_refused_at_once_naming_them():
    """Before: a gradient-norm check (clip_grad_norm_(error_if_nonfinite=True)) in a step over
    token ids made the ids candidates to freeze: two calls ran eagerly, then the third raised
    naming only the ids, with a fix (close over them) that cannot freeze a gradient norm."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    def step(ids):
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(emb.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()

    f = gt.graphify(step)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(gt.GraphifyError, match=r"(?s)The read depends on .*emb\.weight") as ei:
        for _ in range(3):
            f(ids)
    assert "close over it" not in str(ei.value)


def test_a_pyg_data_object_whose_graph_is_replaced_traces_again():
    """A PyG Data's module is torch_geometric, not torch: it is walked like any object the function
    reaches, so a new edge_index (or x) set on it is seen (found by a bug hunt: it replayed the old graph)."""
    pyg = pytest.importorskip("torch_geometric.nn")
    from torch_geometric.data import Data

    torch.manual_seed(0)
    n = 12
    data = Data(x=torch.randn(n, 4), edge_index=torch.randint(0, n, (2, 30)))
    conv = pyg.GCNConv(4, 4).eval()

    def fn(scale):
        return conv(data.x * scale, data.edge_index)

    f = gt.graphify(fn)
    s = torch.tensor(2.0)
    with torch.no_grad():
        for i in range(5):
            if i == 2:
                data.edge_index = torch.randint(0, n, (2, 30))
            if i == 4:
                data.x = torch.randn(n, 4)
            assert_close(f(s), fn(s))


_LOGGING_SCRIPT = r"""
import logging, torch, gtransform as gt
log = logging.getLogger(__name__)
W = torch.randn(4, 4)
def step(x):
    log.debug("step called")
    return x @ W
f = gt.graphify(step)
x = torch.randn(2, 4)
for _ in range(3):
    torch.testing.assert_close(f(x), x @ W)
log.setLevel(logging.INFO)
torch.testing.assert_close(f(x), x @ W)
print("recorded", f.cache_info().currsize)
"""


def test_a_function_that_logs_through_a_module_logger_is_recorded():
    """logging.getLogger(__name__) at module level, used in a traced function: the logger is not
    state (its manager reaches every logger of the process, gtransform's own filter on torch's
    fake-tensor logger included: it was refused from the second call on). In a fresh interpreter:
    pytest's own logging plugin changes what the manager holds."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(gt.__file__)))
    r = subprocess.run([sys.executable, "-c", _LOGGING_SCRIPT], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recorded 1" in r.stdout

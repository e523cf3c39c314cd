"""Sizes that vary (issue #36 item 1): ``record_sizes=`` and ``buckets=``/``pad=``.

Every call is compared with eager; recordings are counted with ``cache_info()``; the suite
turns warnings into errors, so a RerecordWarning or EagerWarning fails the test.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as hst

import gtransform as gt
from gtransform._sized import TOLERANCE


def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device).eval()


class SmallConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv1(x)).relu()
        h = self.conv2(h).relu()
        return self.head(h.mean(dim=(2, 3)))


POW2 = (1, 2, 4, 8, 16, 32, 64)


# -- record_sizes=(...)

def test_record_sizes_list_serves_200_random_batches(device):
    model = _mlp(device)
    f = gt.graphify(model, record_sizes=POW2)
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(200):
            x = torch.randn(rng.randint(1, 64), 8, device=device)
            assert_close(f(x), model(x))
    info = f.cache_info()
    assert 1 <= info.currsize <= len(POW2)
    assert info.misses <= 2 * len(POW2)  # (a module's first call per signature runs eagerly, then records)
    text = f.describe()
    assert "record_sizes=(1, 2, 4, 8, 16, 32, 64): ran eagerly, not recorded (size not selected)" in text
    odd = next(n for n in range(3, 64) if n not in POW2)
    assert "not in record_sizes" in f.explain(torch.randn(odd, 8, device=device))
    assert "not in record_sizes" not in f.explain(torch.randn(8, 8, device=device))


def test_record_sizes_list_replays_the_listed_sizes(device):
    model = _mlp(device)
    f = gt.graphify(model, record_sizes=(4, 8))
    with torch.no_grad():
        for n in [4, 4, 4, 8, 8, 8, 5, 5, 5, 4]:
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), model(x))
    info = f.cache_info()
    assert info.currsize == 2 and info.hits >= 3
    assert "size 5: 3" in f.describe()


def test_record_sizes_functional_batch_is_the_leaf_that_varies(device):
    torch.manual_seed(0)
    params = {"w": torch.randn(8, 8, device=device), "b": torch.randn(8, device=device)}

    def step(p, x):
        return (x @ p["w"] + p["b"]).tanh()

    f = gt.graphify(step, record_sizes=(8,))
    for n in [8, 3, 8, 3, 8, 8, 5]:  # (the first call: x, the last leaf, stands for the batch)
        x = torch.randn(n, 8, device=device)
        assert_close(f(params, x), step(params, x))
    assert f.cache_info().currsize == 1
    assert "size 3: 2, size 5: 1" in f.describe()


def test_many_listed_sizes_do_not_warn(device):
    f = gt.graphify(lambda x: x * 2 + 1, record_sizes=range(1, 41))
    for n in range(1, 41):
        x = torch.randn(n, 3, device=device)
        assert_close(f(x), x * 2 + 1)
    assert f.cache_info().currsize == 40


# -- record_sizes=N

def test_record_sizes_int_records_the_most_frequent(device):
    model = _mlp(device)
    f = gt.graphify(model, record_sizes=4)
    rng = random.Random(1)
    sizes = [8] * 50 + [16] * 40 + [4] * 30 + [2] * 20 + rng.sample(range(17, 64), 30)
    rng.shuffle(sizes)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), model(x))
    assert f.cache_info().currsize == 4  # sizes seen once are never recorded
    assert f.cache_info().hits > 100
    text = f.describe()
    assert "record_sizes=4 (the most frequent sizes seen twice or more" in text
    assert "not among the 4 most frequent" in f.explain(torch.randn(33, 8, device=device))
    assert "not among" not in f.explain(torch.randn(8, 8, device=device))


def test_record_sizes_int_follows_a_shift(device):
    f = gt.graphify(lambda x: x.sin(), record_sizes=1, maxsize=4)
    for n in [3] * 5 + [7] * 30:
        x = torch.randn(n, 2, device=device)
        assert_close(f(x), x.sin())
    assert "not among" not in f.explain(torch.randn(7, 2, device=device))
    assert "not among" in f.explain(torch.randn(3, 2, device=device))


def test_record_sizes_int_keeps_n_recordings_under_uniform_traffic(device):
    # a server's batch sizes drawn uniformly: the top N would change at every call; the
    # recorded sizes stay (no recording churn) and never exceed N (memory bounded)
    f = gt.graphify(lambda x: x.cos() * 2, record_sizes=3)
    rng = random.Random(5)
    for _ in range(300):
        x = torch.randn(rng.randint(1, 12), 3, device=device)
        assert_close(f(x), x.cos() * 2)
        assert f.cache_info().currsize <= 3
    assert f.cache_info().misses <= 4  # 3 sizes recorded once each (a 4th would be churn)
    assert f.cache_info().hits > 40


def test_record_sizes_int_closes_the_recording_of_a_size_that_gives_way(device):
    f = gt.graphify(lambda x: x + 1, record_sizes=1)
    for n in [3] * 5 + [5] * 10:
        f(torch.randn(n, device=device))
    first = f._tls.state.last.rec
    assert f.cache_info().currsize == 1 and "recorded: [3]" in f.describe()
    f(torch.randn(5, device=device))  # 11 calls of 5 against 5 of 3: more than twice, 5 takes its place
    assert f.cache_info().currsize == 1 and "recorded: [5]" in f.describe()
    assert first.groups == []  # 3's recording was closed, its memory given back
    x = torch.randn(5, device=device)
    assert_close(f(x), x + 1)


def test_record_sizes_int_gives_way_without_closing_another_sizes_recording(device):
    # a closed-over model: each size's first recorded call runs eagerly (it touches state), a call
    # after which the thread's last signature is still another size's
    model = _mlp(device)
    f = gt.graphify(model, record_sizes=2)
    with torch.no_grad():
        for n in [3] * 10 + [4] * 3 + [7] * 7:
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), model(x))
        assert "recorded: [3, 7]" in f.describe()
        misses = f.cache_info().misses
        x = torch.randn(3, 8, device=device)
        assert_close(f(x), model(x))  # 3's recording survived 4 giving way to 7
        assert f.cache_info().misses == misses


# -- buckets=, pad=

def test_buckets_mlp_every_size_equals_eager(device):
    model = _mlp(device)
    f = gt.graphify(model, buckets=POW2, pad={"input": 0})
    with torch.no_grad():
        for n in list(range(1, 65)) + [random.Random(2).randint(1, 64) for _ in range(40)]:
            x = torch.randn(n, 8, device=device)
            assert_close(f(x), model(x))
    assert f.cache_info().currsize <= len(POW2)
    assert "checked against eager: [4, 8, 16, 32, 64]" in f.describe()
    assert "padded to bucket 8" in f.explain(torch.randn(5, 8, device=device))


def test_buckets_small_conv_net_in_eval_mode(device):
    torch.manual_seed(0)
    net = SmallConvNet().to(device).eval()
    net.bn.running_mean.uniform_(-0.5, 0.5)
    net.bn.running_var.uniform_(0.5, 2.0)
    f = gt.graphify(net, buckets=(2, 4, 8, 16), pad=0)
    with torch.no_grad():
        for n in [1, 3, 5, 2, 7, 9, 16, 11, 3, 6]:
            x = torch.randn(n, 3, 8, 8, device=device)
            assert_close(f(x), net(x))
    assert f.cache_info().currsize <= 4


def test_buckets_pad_keyword_arguments_and_values(device):
    def masked(x, *, mask, scale):
        return torch.where(mask[:, None], x * scale, torch.zeros_like(x)), x.sum(1)

    f = gt.graphify(masked, buckets=(4, 8), pad={"x": 0.0, "mask": False})
    for n in [3, 5, 8, 1, 6]:
        x = torch.randn(n, 2, device=device)
        mask = torch.rand(n, device=device) > 0.5
        assert_close(f(x, mask=mask, scale=2.0), masked(x, mask=mask, scale=2.0))


def test_buckets_above_the_largest_run_eagerly(device):
    f = gt.graphify(lambda x: x.cos(), buckets=(2, 4), pad=0)
    for n in [3, 9, 9, 4]:
        x = torch.randn(n, device=device)
        assert_close(f(x), x.cos())
    assert "ran eagerly above the largest bucket, not recorded: 2 call(s) (size 9: 2)" in f.describe()
    assert "above the largest bucket (4)" in f.explain(torch.randn(10, device=device))


def test_buckets_outputs_are_the_callers_to_keep(device):
    f = gt.graphify(lambda x: x * 3, buckets=(4,), pad=0)
    a = f(torch.ones(3, device=device))
    b = f(torch.ones(2, device=device) * 2)
    assert_close(a, torch.full((3,), 3.0, device=device))  # (a sliced output is a copy: never stale)
    assert_close(b, torch.full((2,), 6.0, device=device))


def test_buckets_gradients_flow_to_the_true_rows(device):
    lin = torch.nn.Linear(4, 2).to(device)
    f = gt.graphify(lin, buckets=(4, 8), pad=0)
    x = torch.randn(3, 4, device=device, requires_grad=True)
    f(x).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    lin.zero_grad()
    lin(x2).pow(2).sum().backward()
    assert_close(x.grad, x2.grad)


# -- refusals

def _refused(f, x, *words):
    with pytest.raises(gt.GraphifyError) as info:
        f(x)
    msg = str(info.value)
    for w in ("bucket 4", "Why:", "Fix:", "without buckets=", "record_sizes=") + words:
        assert w in msg, (w, msg)


def test_refuses_batchnorm_in_training_mode(device):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).to(device).train()
    _refused(gt.graphify(net, buckets=(4, 8), pad=0), torch.randn(3, 4, device=device), "running_mean",
             "BatchNorm in training mode")


def test_refuses_batchnorm_without_running_stats_in_training_mode(device):
    net = torch.nn.BatchNorm1d(4, track_running_stats=False).to(device).train()
    _refused(gt.graphify(net, buckets=(4, 8), pad=0), torch.randn(3, 4, device=device) + 1, "max difference",
             "output")


@pytest.mark.parametrize("how", ["attribute", "forward hook"])
def test_refuses_a_tensor_stored_in_state(device, how):
    """self.last = h, or a forward hook keeping features: the stored tensor would hold the padded rows
    (eager's holds the call's own); found by a bug hunt, it was silently padded."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).to(device)
    feats = {}
    if how == "attribute":
        class Keep(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin

            def forward(self, x):
                self.last = self.lin(x)
                return self.last * 2

        net = Keep()
    else:
        net = torch.nn.Sequential(lin, torch.nn.ReLU())
        net[0].register_forward_hook(lambda m, i, o: feats.__setitem__("lin", o))
    with torch.no_grad():
        net(torch.randn(3, 3, device=device))  # (the state exists before, as after a first eager call)
        _refused(gt.graphify(net, buckets=(4, 8), pad=0), torch.randn(3, 3, device=device),
                 "stores a tensor in Python state", "return the tensor instead")


def test_refuses_a_sum_over_the_batch(device):
    _refused(gt.graphify(lambda x: x.sum(0), buckets=(4, 8), pad=0), torch.randn(3, 6, device=device) + 1,
             "dim 0 is not the batch", "[6]")


def test_refuses_a_sum_over_the_batch_whose_shape_matches(device):
    f = gt.graphify(lambda x: x.sum(0), buckets=(4, 8), pad=0)
    _refused(f, torch.randn(3, 4, device=device) + 1)


def test_refuses_softmax_over_dim_0(device):
    f = gt.graphify(lambda x: {"p": x.softmax(0)}, buckets=(4, 8), pad=0)
    _refused(f, torch.randn(3, 2, device=device), "output['p']", "max difference", "softmax over dim 0")


def test_refuses_a_scalar_output(device):
    lin = torch.nn.Linear(4, 1).to(device)
    f = gt.graphify(lambda x: (lin(x).squeeze(1), lin(x).mean()), buckets=(4, 8), pad=0)
    _refused(f, torch.randn(3, 4, device=device), "output[1]", "shape []", "scalar loss")


def test_refuses_an_input_updated_in_place(device):
    def f(x):
        x.mul_(2)
        return x + 1

    _refused(gt.graphify(f, buckets=(4, 8), pad=0), torch.randn(3, device=device), "args[0]", "in place")


def test_a_bucket_size_itself_is_not_padded_or_checked(device):
    f = gt.graphify(lambda x: x.sum(0), buckets=(4, 8), pad=0)
    x = torch.randn(4, 2, device=device)
    assert_close(f(x), x.sum(0))


def test_every_signature_of_a_bucket_is_checked(device):
    """A bucket checked for one signature is checked again for another (a static argument, train())."""
    def f(x, center=False):
        return x - x.mean(0) if center else x * 2

    g = gt.graphify(f, buckets=(8,), pad=0, static_argnames="center")
    x = torch.randn(5, 3, device=device)
    assert_close(g(x), x * 2)
    with pytest.raises(gt.GraphifyError, match="differs from an unpadded eager run"):
        g(x, center=True)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).to(device).eval()
    h = gt.graphify(net, buckets=(8,), pad=0)
    assert_close(h(x), net(x))
    stats = net[1].running_mean.clone()
    net.train()
    with pytest.raises(gt.GraphifyError, match="running_mean"):
        h(x)
    assert torch.equal(net[1].running_mean, stats)  # refused before anything ran


def test_padded_rows_that_are_not_finite_are_refused_where_gradients_flow(device):
    lin = torch.nn.Linear(3, 2).to(device)
    f = gt.graphify(lambda x: lin(torch.log(x)), buckets=(4, 8), pad=0)
    x = torch.rand(5, 3, device=device) + 0.5
    with torch.no_grad():
        assert_close(f(x), lin(torch.log(x)))  # (no gradient: the padded rows' -inf reach nothing)
    with pytest.raises(gt.GraphifyError, match="not finite") as info:
        f(x)
    assert "pad=" in str(info.value) and "Fix:" in str(info.value)
    g = gt.graphify(lambda x: lin(torch.log(x)), buckets=(4, 8), pad={0: 1.0})
    g(x).sum().backward()
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    lin(torch.log(x)).sum().backward()
    for a, b in zip(want, (p.grad for p in lin.parameters())):
        assert_close(a, b)


@pytest.mark.parametrize("how", ["branch", "sliced_table", "returned_size"])
def test_a_function_that_depends_on_the_batch_size_is_refused_at_the_size_that_differs(device, how):
    # each signature's first padded call was checked, at one size: if that size agreed by chance,
    # the bucket's other sizes gave wrong numbers silently
    table = torch.arange(16.0, device=device)

    def fn(x):
        if how == "branch":
            return x * 2 if x.shape[0] > 6 else x * 3
        if how == "sliced_table":
            return x * float(table[: x.shape[0]].sum())
        return x * 2, x.shape[0]

    f = gt.graphify(fn, buckets=(8, 16), pad={"x": 0})
    x7 = torch.randn(7, 3, device=device)
    if how == "returned_size":
        with pytest.raises(gt.GraphifyError, match=r"(?s)output\[1\] of the padded call is 8 where an unpadded.*7"):
            f(x7)
        return
    if how == "branch":
        assert_close(f(x7), fn(x7))  # (7 and its bucket, 8, take the same branch)
    with pytest.raises(gt.GraphifyError, match=r"(?s)differs from an unpadded eager run.*depends on the batch size"):
        for n in (5, 3):
            x = torch.randn(n, 3, device=device)
            assert_close(f(x), fn(x))


def test_an_output_stacking_something_else_on_dim_0_names_its_layout(device):
    # (layers, batch, d) with as many layers as the bucket's rows: the refusal blamed interacting rows
    f = gt.graphify(lambda x: torch.stack([x * i for i in range(4)]), buckets=(4, 8), pad=0)
    with pytest.raises(gt.GraphifyError, match=r"(?s)its dim 0 is not the batch \(3 rows\)"):
        f(torch.randn(3, 2, device=device))


def test_outputs_of_a_batch_of_a_buckets_own_size_are_copies_too(device):
    f = gt.graphify(lambda x: x + 1, buckets=(4, 8), pad=0)
    a = f(torch.zeros(4, device=device))  # exactly bucket 4
    f(torch.ones(4, device=device))
    assert_close(a, torch.ones(4, device=device))  # (held across the next call: never stale)


def test_cache_info_counts_each_buckets_first_call_as_a_miss(device):
    f = gt.graphify(lambda x: x * 2, buckets=(2, 4, 8), pad=0)
    for n in (3, 5, 7, 3):
        x = torch.randn(n, device=device)
        assert_close(f(x), x * 2)
    info = f.cache_info()
    assert (info.misses, info.hits, info.currsize) == (2, 2, 2)
    # a function that reads state counts each padded call once too, as an unpadded one would
    lin = torch.nn.Linear(1, 1).to(device)
    g = gt.graphify(lambda x: lin(x), buckets=(4,), pad=0)
    h = gt.graphify(lambda x: lin(x))
    with torch.no_grad():
        for k in range(3):
            g(torch.randn(3, 1, device=device))
            h(torch.randn(4, 1, device=device))
            assert g.cache_info().hits + g.cache_info().misses == k + 1
    assert g.cache_info()[:2] == h.cache_info()[:2]


def test_input_buffers_are_refused_for_sizes_no_recording_of_their_own_serves(device):
    f = gt.graphify(lambda x: x * 2, record_sizes=(4,))
    with pytest.raises(gt.GraphifyError, match="not among record_sizes"):
        f.input_buffers(torch.zeros(3, 2, device=device))
    assert f.cache_info().currsize == 0
    g = gt.graphify(lambda x: x * 2, buckets=(4, 8), pad=0)
    with pytest.raises(gt.GraphifyError, match="padded to bucket 4"):
        g.input_buffers(torch.zeros(3, 2, device=device))
    with torch.no_grad():
        buf = g.input_buffers(torch.zeros(4, 2, device=device))[0]
        buf.copy_(torch.arange(8.0, device=device).view(4, 2))
        assert_close(g(buf), torch.arange(8.0, device=device).view(4, 2) * 2)


def test_a_batch_argument_pad_does_not_name_is_named_in_the_error(device):
    f = gt.graphify(lambda x, y: x * y, buckets=(4, 8), pad="x")
    with pytest.raises(gt.GraphifyError, match=r"args\[1\] also has 5 rows") as info:
        f(torch.randn(5, 2, device=device), torch.randn(5, 2, device=device))
    assert "pad=" in str(info.value) and "Fix:" in str(info.value)


# -- options

@pytest.mark.parametrize("kw, err, words", [
    (dict(record_sizes="8"), TypeError, "sequence of positive ints"),
    (dict(record_sizes=(1, 2.5)), TypeError, "sequence of positive ints"),
    (dict(record_sizes=()), TypeError, "non-empty"),
    (dict(record_sizes=0), ValueError, "most frequent"),
    (dict(record_sizes=(0, 4)), ValueError, "positive"),
    (dict(record_sizes=True), TypeError, "sequence of positive ints"),
    (dict(buckets=4, pad=0), TypeError, "sequence of positive ints"),
    (dict(buckets=(4, -1), pad=0), ValueError, "positive"),
    (dict(buckets=(4,)), ValueError, "pad={'x': 0}"),
    (dict(pad=0), ValueError, "buckets=(1, 2, 4"),
    (dict(buckets=(4,), pad={0: 0.0, "x": 7.0}), ValueError, "name the same argument"),
    (dict(record_sizes=(4,), buckets=(4,), pad=0), ValueError, "pass one of them"),
    (dict(buckets=(4,), pad="y"), ValueError, "names no parameter"),
    (dict(buckets=(4,), pad=3), ValueError, "out of range"),
    (dict(buckets=(4,), pad={"x": torch.zeros(())}), TypeError, "Python number"),
    (dict(buckets=(4,), pad=1.5), TypeError, "name or position"),
    (dict(buckets=(4,), pad=[]), ValueError, "empty"),
    (dict(buckets=(4,), pad=1, static_argnums=1), ValueError, "static argument"),
])
def test_options_are_checked(kw, err, words):
    with pytest.raises(err, match=None) as info:
        gt.graphify(lambda x, k=1: x * k, **kw)
    assert words in str(info.value)


def test_defaults_keep_todays_behaviour_and_copies_keep_the_options():
    assert gt.graphify(lambda x: x)._sizes is None
    f = gt.graphify(lambda x: x + 1, buckets=[8, 2, 4], pad={"x": 0})
    assert f._options.buckets == (2, 4, 8)
    for h in (copy.copy(f), copy.deepcopy(f)):
        assert h._options.buckets == (2, 4, 8) and h._options.pad == {"x": 0}
        assert_close(h(torch.ones(3)), torch.full((3,), 2.0))
    g = gt.graphify(record_sizes=[2, 1])(lambda x: x + 1)
    assert g._options.record_sizes == (1, 2)


def test_pad_arguments_disagreeing_on_the_batch_are_refused():
    f = gt.graphify(lambda x, y: x + y, buckets=(4, 8), pad=("x", "y"))
    with pytest.raises(ValueError, match="must agree on dim 0"):
        f(torch.ones(3, 2), torch.ones(5, 2))


# -- property: padded outputs equal eager's

@settings(deadline=None, max_examples=25)
@given(buckets=hst.lists(hst.integers(1, 24), min_size=1, max_size=5),
       sizes=hst.lists(hst.integers(1, 30), min_size=1, max_size=8))
def test_padded_outputs_equal_eager(buckets, sizes):
    torch.manual_seed(0)
    w, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def rowwise(x, scale):
        h = (x @ w + b).tanh()
        return {"h": h * scale, "n": h.norm(dim=1), "i": x.argmax(1)}

    f = gt.graphify(rowwise, buckets=buckets, pad={"x": 0.0, "scale": 1.0})
    for n in sizes:
        x = torch.randn(n, 5, dtype=torch.float64)
        scale = torch.rand(n, 1, dtype=torch.float64)
        assert_close(f(x, scale), rowwise(x, scale))
    assert f.cache_info().currsize <= len(set(buckets))


def test_tolerances_cover_the_float_dtypes():
    assert {torch.float16, torch.bfloat16, torch.float32, torch.float64} <= set(TOLERANCE)


def test_describe_and_explain_count_fast_path_calls(device):
    f = gt.graphify(lambda x: x + 1, record_sizes=2)
    for _ in range(20):
        f(torch.ones(3, device=device))
    assert "calls so far: size 3: 20" in f.describe()
    g = gt.graphify(lambda x: x * 2, buckets=(4, 8), pad=0)
    assert "made by the first such call" in g.explain(torch.ones(3, 1, device=device))


def test_record_sizes_int_closes_another_threads_recording_of_a_size_that_gave_way(device):
    import queue
    import threading

    f = gt.graphify(lambda x: x.sin() * 2, record_sizes=1)
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def calls(n, k):
        for _ in range(k):
            x = torch.randn(n, 2, device=device)
            assert_close(f(x), x.sin() * 2)

    def serve():  # a long-lived serving thread (its recordings live while it does)
        for n, k in iter(todo.get, None):
            calls(n, k)
            done.put(None)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        todo.put((3, 4))  # size 3 recorded in the worker's thread
        done.get()
        assert f.cache_info().currsize == 1
        calls(5, 30)  # size 5, far more frequent, takes size 3's place: recorded in this thread
        assert f.cache_info().currsize == 2  # (the worker closes its own at its next call)
        hits = f.cache_info().hits
        todo.put((3, 3))
        done.get()
        assert f.cache_info().hits == hits  # size 3 runs eagerly now, in every thread
        assert f.cache_info().currsize == 1
        assert "recorded: [5]" in f.describe()
    finally:
        todo.put(None)
        worker.join()


def test_a_refusal_of_a_padded_call_is_not_taken_for_an_unpadded_argument(device):
    def f(x, y):
        if x.sum() > 0:  # a read of the call's own data: gtransform's refusal, as unbucketed
            return x * 2
        return x

    g = gt.graphify(f, buckets=(4, 8), pad="x")
    with pytest.raises(gt.GraphifyError) as info:
        g(torch.ones(5, 2, device=device), torch.ones(5, 2, device=device))
    assert "reads a tensor's value" in str(info.value) and "not padded" not in str(info.value)


def _module_with_graphified_forward(pad):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        @gt.graphify(buckets=(4, 8), pad=pad)
        def forward(self, x):
            return self.lin(x)

    return M


def test_pad_naming_self_of_a_method_is_refused_with_the_fix():
    M = _module_with_graphified_forward(pad=0)
    with pytest.raises(ValueError, match=r"pad= names args\[0\], which is the module itself.*Fix: name the batched"):
        with torch.no_grad():
            M()(torch.randn(3, 3))

    N = _module_with_graphified_forward(pad=1)  # (self counted: the input is argument 1)
    n = N()
    with torch.no_grad():
        for b in (3, 2, 3, 4, 1):
            x = torch.randn(b, 3)
            torch.testing.assert_close(n(x), n.lin(x))
    assert N.forward.cache_info().currsize == 1


@pytest.mark.parametrize("reduce", ["amax", "amin", "sort", "cummax"])
def test_rows_that_interact_only_for_some_values_are_refused_on_the_first_call(device, reduce):
    """Before: with positive data and pad 0 the padded rows were never picked by a max over the
    batch, so the first call's check passed, and a later call with negative data was wrong."""
    ops = {
        "amax": lambda x: x - x.amax(0),
        "amin": lambda x: x - x.amin(0),
        "sort": lambda x: x.sort(0, descending=True).values,
        "cummax": lambda x: x.flip(0).cummax(0).values.flip(0),
    }
    f = gt.graphify(ops[reduce], pad={"x": 0.0}, buckets=(4, 8))
    x = torch.rand(5, 3, device=device) + 1.0  # (positive: pad 0 is never the max)
    with pytest.raises(gt.GraphifyError, match="rows interact"):
        f(x)


def test_an_unpadded_batch_argument_is_named_whatever_the_functions_error(device):
    """Before: only a RuntimeError got the hint; an IndexError (an index tensor of the true rows
    into the padded ones) or a library's ValueError came out raw, about rows the caller never passed."""
    def check(x, mask):
        if x.shape[0] != mask.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but mask has {mask.shape[0]}")
        return x * mask[:, None]

    f = gt.graphify(check, pad={"x": 0.0}, buckets=(4,))
    with pytest.raises(gt.GraphifyError, match=r"args\[1\] also has 3 rows") as ei:
        f(torch.ones(3, 2, device=device), torch.ones(3, device=device))
    assert isinstance(ei.value.__cause__, ValueError)

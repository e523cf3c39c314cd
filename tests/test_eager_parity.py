"""Issue #10 §3-§5 ("exactly eager"): each case gives eager's behaviour, or a
GraphifyError that names the operation, the user's line and the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gtransform as gt
from gtransform import GraphifyError, OverwrittenOutputError

# -- §3: operations the replay model cannot follow ---------------------------


def test_manual_seed_inside_fn_is_refused(device):
    def fn(x):
        torch.manual_seed(0)  # SEED-LINE
        return torch.rand(2, device=x.device) + x

    f = gt.graphify(fn)
    state = torch.get_rng_state()
    with pytest.raises(GraphifyError, match=r"(?s)manual_seed.*SEED-LINE.*seed outside the function.*torch\.Generator"):
        f(torch.zeros(2, device=device))
    assert torch.equal(torch.get_rng_state(), state)  # the trace left the generator alone
    # the function stays usable once fixed, and seeding outside follows eager
    g = gt.graphify(lambda x: torch.rand(2, device=x.device) + x)
    x = torch.zeros(2, device=device)
    torch.manual_seed(0)
    a = g(x).clone()
    torch.manual_seed(0)
    assert torch.equal(a, torch.rand(2, device=device))


def test_default_generator_reseeded_inside_fn_is_refused(device):
    def fn(x):
        torch.default_generator.manual_seed(3)
        return x + 1

    with pytest.raises(GraphifyError, match=r"(?s)default random generator.*torch\.Generator"):
        gt.graphify(fn)(torch.zeros(2, device=device))


def test_data_assignment_on_input_is_refused(device):
    def fn(p):
        p.data = p.data.clamp(-0.5, 0.5)  # DATA-LINE
        return p + 0.6

    p = torch.tensor([2.0], device=device)
    with pytest.raises(GraphifyError, match=r"(?s)\.data = .*DATA-LINE.*clamp_\(-0\.5, 0\.5\).*copy_"):
        gt.graphify(fn)(p)
    assert p.item() == 2.0
    # the fix the message gives matches eager
    f = gt.graphify(lambda p: p.clamp_(-0.5, 0.5) + 0.6)
    q = torch.tensor([2.0], device=device)
    out = f(q)
    torch.testing.assert_close(out, torch.tensor([1.1], device=device))
    assert q.item() == 0.5


def test_storage_offset_and_as_strided_of_views(device):
    base = torch.arange(10.0, device=device)
    f = gt.graphify(lambda x: x.as_strided((2,), (1,)) + 0)
    with pytest.raises(GraphifyError, match=r"(?s)as_strided.*args\[0\].*contiguous\(\)"):
        f(base[::2])  # eager reads [0, 1]; a dense buffer would give [0, 2]
    g = gt.graphify(lambda x: x + x.storage_offset())
    with pytest.raises(GraphifyError, match=r"(?s)storage_offset.*args\[0\].*contiguous\(\)"):
        g(base[4:6])  # eager adds 4
    # plain inputs (own their storage) are exact, and a later view with the same
    # shape and strides is not replayed from the plain recording
    h = gt.graphify(lambda x: x.as_strided((2,), (1,), 0) * 1 + x.storage_offset())
    x = torch.tensor([5.0, 6.0], device=device)
    torch.testing.assert_close(h(x), torch.tensor([5.0, 6.0], device=device))
    torch.testing.assert_close(h(x.clone()), torch.tensor([5.0, 6.0], device=device))
    with pytest.raises(GraphifyError, match="storage_offset|as_strided"):
        h(base[4:6])


@pytest.mark.parametrize(
    "op,args,shape",
    [("t_", (), (2, 3)), ("transpose_", (0, 1), (2, 3)), ("unsqueeze_", (0,), (2, 3)),
     ("squeeze_", (0,), (1, 6)), ("as_strided_", ((3, 2), (1, 3)), (2, 3))],
)
def test_inplace_metadata_change_of_input_is_refused(device, op, args, shape):
    def fn(x):
        getattr(x, op)(*args)  # META-LINE
        return x * 2

    x = torch.arange(6.0, device=device).reshape(shape)
    with pytest.raises(GraphifyError, match=rf"(?s){op}.*changes the shape or strides of input args\[0\].*META-LINE.*out-of-place"):
        gt.graphify(fn)(x)
    assert x.shape == shape  # the caller's tensor is untouched


def test_inplace_update_of_overlapping_input_is_refused(device):
    f = gt.graphify(lambda x: x.add_(1))  # OVERLAP-LINE
    x = torch.arange(6.0, device=device).unfold(0, 3, 1)
    with pytest.raises(GraphifyError, match=r"(?s)add_.*args\[0\] in place.*overlaps itself.*OVERLAP-LINE.*contiguous\(\) or \.clone\(\)"):
        f(x)
    torch.testing.assert_close(x.contiguous().flatten()[:3], torch.arange(3.0, device=device))
    # non-overlapping strided inputs are fine
    y = torch.arange(8.0, device=device)[::2]
    f(y)
    torch.testing.assert_close(y, torch.tensor([1.0, 3.0, 5.0, 7.0], device=device))


# -- §4: composition ---------------------------------------------------------


def test_graphified_inside_graphified_is_inlined(device):
    inner = gt.graphify(lambda x: x * 2)
    outer = gt.graphify(lambda x: inner(x) + 1)
    for v in (1.0, 2.0, 3.0):
        x = torch.full((3,), v, device=device)
        out = outer(x)
        torch.testing.assert_close(out, x * 2 + 1)
        assert out.dtype == x.dtype
    assert outer.cache_info().misses == 1
    torch.testing.assert_close(inner(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))


def test_output_fed_back_into_inplace_function(device):
    @gt.graphify
    def step(s):
        s.mul_(2)
        return s + 1

    def eager(s):
        s.mul_(2)
        return s + 1

    s, e = torch.ones(2, device=device), torch.ones(2, device=device)
    prev = None
    for _ in range(5):
        old = s
        s, e = step(s), eager(e)
        torch.testing.assert_close(s, e)
        if prev is not None:
            # the caller's previous output was updated in place, as in eager
            torch.testing.assert_close(old, (e - 1))
        prev = old
    # returning the updated input itself works too
    f = gt.graphify(lambda s: s.mul_(2))
    t = torch.ones(2, device=device)
    for _ in range(3):
        t = f(t)
    torch.testing.assert_close(t, torch.full((2,), 8.0, device=device))


def test_output_handed_to_inplace_function_of_same_pool(device):
    pool = gt.graph_pool()
    f = gt.graphify(lambda x: x + 1, pool=pool)
    g = gt.graphify(lambda y: y.mul_(2), pool=pool)
    for v in (1.0, 2.0, 3.0):
        a = f(torch.full((2,), v, device=device))
        b = g(a)
        torch.testing.assert_close(b, torch.full((2,), (v + 1) * 2, device=device))
        torch.testing.assert_close(a, torch.full((2,), (v + 1) * 2, device=device))
        assert b is a
    # liveness still holds for f's outputs
    a = f(torch.ones(2, device=device))
    f(torch.ones(2, device=device))
    with pytest.raises(OverwrittenOutputError):
        a + 0


# -- §5: rough edges ---------------------------------------------------------


def test_as_subclass_of_stale_output_raises(device):
    f = gt.graphify(lambda x: x + 1)
    a = f(torch.ones(2, device=device))
    f(torch.zeros(2, device=device))
    with pytest.raises(OverwrittenOutputError, match=r"(?s)\.clone\(\).*as_subclass"):
        a.as_subclass(torch.Tensor)


def test_numpy_nan_static_leaf_hits(device):
    f = gt.graphify(lambda x, k: x * k)
    x = torch.ones(2, device=device)
    for k in (np.float64("nan"), np.float64("nan"), np.float32("nan"), np.float32("nan")):
        assert torch.isnan(f(x, k)).all()
    assert f.cache_info().misses == 2 and f.cache_info().hits == 2


# -- §2: attributes of input tensors ---------------------------------------------


def _sgd_if_grad(p):
    if p.grad is not None:  # GRAD-LINE
        p.sub_(0.1 * p.grad)
    return p * 1


def test_reading_the_grad_of_an_input_that_has_one_is_refused_with_the_fix(device):
    f = gt.graphify(_sgd_if_grad)
    p = torch.ones(3, device=device)
    p.grad = torch.full((3,), 2.0, device=device)
    with pytest.raises(GraphifyError, match=r"(?s)reads args\[0\]\.grad.*GRAD-LINE.*Fix: pass the gradient as an argument"):
        f(p)
    assert torch.equal(p, torch.ones(3, device=device))  # nothing ran
    # the function stays usable with inputs that have no gradient
    q = torch.ones(3, device=device)
    assert torch.equal(f(q), torch.ones(3, device=device))


@pytest.mark.parametrize("calls_before", [1, 3])
def test_an_input_grad_read_as_none_is_part_of_the_signature(device, calls_before):
    f = gt.graphify(_sgd_if_grad)
    p = torch.ones(3, device=device)
    for _ in range(calls_before):  # recorded (and read in place) while p.grad is None
        assert torch.equal(f(p), torch.ones(3, device=device))
    p.grad = torch.full((3,), 2.0, device=device)
    # eager would now update p: the recording must not replay the no-gradient branch
    with pytest.raises(GraphifyError, match=r"reads args\[0\]\.grad"):
        f(p)
    assert torch.equal(p, torch.ones(3, device=device))


def test_functions_that_never_read_grad_take_inputs_with_grads(device):
    lin = torch.nn.Linear(3, 2).to(device)
    lin(torch.ones(1, 3, device=device)).sum().backward()  # every parameter has a .grad
    f = gt.graphify(lambda x, w, b: torch.nn.functional.linear(x, w, b))
    x = torch.ones(4, 3, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert torch.allclose(f(x, lin.weight, lin.bias), lin(x))


def test_python_attributes_of_inputs_are_read_and_keyed(device):
    def fn(q):
        return q * getattr(q, "lr_scale", 1.0)

    f = gt.graphify(fn)
    q = torch.ones(3, device=device)
    q.lr_scale = 3.0
    for _ in range(3):
        assert torch.equal(f(q), fn(q))
    q.lr_scale = 5.0
    assert torch.equal(f(q), torch.full((3,), 5.0, device=device))
    r = torch.ones(3, device=device)
    for _ in range(3):
        assert torch.equal(f(r), r)
    r.lr_scale = 7.0  # an attribute set after the recording
    assert torch.equal(f(r), torch.full((3,), 7.0, device=device))
    del r.lr_scale
    assert torch.equal(f(r), r)


def test_unchanged_attributes_keep_hitting_the_recording(device):
    f = gt.graphify(lambda q: q * q.scale)
    q = torch.ones(3, device=device)
    q.scale = 2.0
    for _ in range(6):
        f(q)
    assert f.cache_info().misses == 1


@pytest.mark.parametrize("use", ["operand", "reflected", "method", "index", "torch_fn"])
def test_a_tensor_attribute_of_an_input_is_refused_with_the_fix(device, use):
    uses = {
        "operand": lambda p: p * p.mask,  # ATTR-LINE
        "reflected": lambda p: p.mask * p,  # ATTR-LINE
        "method": lambda p: p + p.mask.sum(),  # ATTR-LINE
        "index": lambda p: p + p.mask[0],  # ATTR-LINE
        "torch_fn": lambda p: torch.where(p.mask > 0, p, 0.0),  # ATTR-LINE
    }
    p = torch.ones(3, device=device)
    p.mask = torch.tensor([1.0, 0.0, 1.0], device=device)
    with pytest.raises(gt.GraphifyError, match=r"(?s)uses args\[0\]\.mask, a tensor set as a Python attribute.*ATTR-LINE"
                       r".*Fix: pass args\[0\]\.mask as an argument of its own"):
        gt.graphify(uses[use])(p)


def test_a_tensor_attribute_the_function_does_not_use_is_fine(device):
    f = gt.graphify(lambda p: p * p.scale * (p.mask is not None))
    p = torch.ones(3, device=device)
    p.mask, p.scale = torch.zeros(3, device=device), 2.0
    for _ in range(3):
        torch.testing.assert_close(f(p), torch.full((3,), 2.0, device=device))


# -- §5: a tensor returned as the function reached it ------------------------------


def test_a_closed_over_tensor_returned_as_is_is_that_tensor(device):
    W = torch.ones(2, device=device)
    f = gt.graphify(lambda x: (W, x + W))
    for _ in range(3):
        w, y = f(torch.ones(2, device=device))
        assert w is W  # eager returns W itself: never poisoned, never a copy
        torch.testing.assert_close(y, torch.full((2,), 2.0, device=device))
    W.mul_(2)
    w, y = f(torch.ones(2, device=device))
    assert w is W
    torch.testing.assert_close(y, torch.full((2,), 3.0, device=device))
    g = gt.graphify(lambda x: W)  # never used in an operation
    outs = [g(torch.ones(1, device=device)) for _ in range(3)]
    assert all(o is W for o in outs)


def test_a_module_attribute_returned_follows_rebinding(device):
    lin = torch.nn.Linear(2, 2).to(device)
    f = gt.graphify(lambda x: (lin(x), lin.weight))
    with torch.no_grad():
        for _ in range(3):
            assert f(torch.ones(1, 2, device=device))[1] is lin.weight
        lin.weight = torch.nn.Parameter(torch.zeros(2, 2, device=device))
        y, w = f(torch.ones(1, 2, device=device))
    assert w is lin.weight
    torch.testing.assert_close(y, lin.bias.detach().unsqueeze(0))

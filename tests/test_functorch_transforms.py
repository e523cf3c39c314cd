"""torch.func transforms over a graphified function.

vmap is recorded, as jax.jit inside jax.vmap: ``vmap(graphify(f))`` replays a recording of
``vmap(f)``. Forward-mode transforms (jvp, jacfwd, hessian, linearize) run the function
eagerly, with one EagerWarning per function that says how to record them, and describe()
counts those calls. The fix the warning gives records."""

import warnings

import pytest
import torch
import torch.func as tf
from conftest import assert_close

import gtransform as gt


def f(x):
    return (x.sin() * 2).exp()


def _calls(device):
    x = torch.randn(3, device=device)
    return {
        "jacfwd": (lambda g: tf.jacfwd(g)(x), "vmap, jvp", "gt.graphify(torch.func.jacfwd(f))"),
        "hessian": (lambda g: tf.hessian(lambda y: g(y).sum())(x), "vmap, jvp", "gt.graphify(torch.func.hessian(f))"),
        "jvp": (lambda g: tf.jvp(g, (x,), (torch.ones_like(x),)), "torch.func.jvp", "torch.func.jvp(f, (x,), (t,))"),
        "linearize": (lambda g: tf.linearize(g, x)[1](torch.ones_like(x)), "forward-mode dual tensors", "gt.graphify(jvp_fn)"),
    }


@pytest.mark.parametrize("how", ["jacfwd", "hessian", "jvp", "linearize"])
def test_transforms_run_eagerly_with_one_warning_naming_the_fix(device, how):
    call, what, fix = _calls(device)[how]
    g = gt.graphify(f)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")  # (torch's own warnings of these transforms pass too)
        got = call(g)
    msgs = [str(w.message) for w in rec if issubclass(w.category, gt.EagerWarning)]
    assert len(msgs) == 1 and what in msgs[0] and fix in msgs[0] and "runs eagerly" in msgs[0], msgs
    torch.manual_seed(0)
    assert_close(got, call(f))  # eager's numbers
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.EagerWarning)  # once per function
        for _ in range(2):
            call(g)
    assert "ran eagerly, not recorded: " in g.describe()
    if how != "linearize":  # (linearize calls the function plainly too, first: recorded)
        assert g.cache_info().hits == 0


def test_the_fix_records_the_transformed_function(device):
    x = torch.randn(4, 3, device=device)
    for transformed, arg in ((tf.vmap(f), x), (tf.jacfwd(lambda y: f(y).sum()), x[0]),
                             (tf.hessian(lambda y: f(y).sum()), x[0])):
        g = gt.graphify(transformed)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gt.EagerWarning)
            for _ in range(3):
                assert_close(g(arg), transformed(arg))
        assert g.cache_info().hits == 2
    # a graphified function inside the graphified transform is inlined, not warned of
    inner = gt.graphify(f)
    outer = gt.graphify(tf.vmap(inner))
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.EagerWarning)
        for _ in range(3):
            assert_close(outer(x), tf.vmap(f)(x))
    assert outer.cache_info().hits == 2


def _no_eager_warning():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", gt.EagerWarning)
    return ctx


@pytest.mark.parametrize("in_dims", [0, 1, (0, None), (None, 0)], ids=str)
def test_vmap_over_a_graphified_function_is_recorded(device, in_dims):
    w = torch.randn(5, 2, device=device)

    def f(x, v):
        return {"y": (x @ w).tanh() + v.sum(), "z": x.relu()}

    g = gt.graphify(f)
    dims = in_dims if isinstance(in_dims, tuple) else (in_dims, in_dims)
    ctx = _no_eager_warning()
    try:
        for _ in range(3):
            x = torch.randn(4, 3, 5, device=device) if dims[0] == 0 else torch.randn(3, 4, 5, device=device) \
                if dims[0] == 1 else torch.randn(3, 5, device=device)
            v = torch.randn(4, 2, device=device) if dims[1] == 0 else torch.randn(2, 4, device=device) \
                if dims[1] == 1 else torch.randn(2, device=device)
            got = tf.vmap(g, in_dims=in_dims)(x, v)
            assert_close(got, tf.vmap(f, in_dims=in_dims)(x, v))
    finally:
        ctx.__exit__(None, None, None)
    assert g.cache_info().hits >= 1 and g.cache_info().currsize == 1  # (it reads state: the first call ran eagerly)
    assert "recorded as graphify(vmap(f))" in g.describe()


def test_vmap_of_a_graphified_module_nested_and_in_place(device):
    lin = torch.nn.Linear(3, 4).to(device)
    g = gt.graphify(lambda x: lin(x).relu())
    ctx = _no_eager_warning()
    try:
        for _ in range(3):
            x = torch.randn(2, 5, 3, device=device)
            with torch.no_grad():
                assert_close(tf.vmap(tf.vmap(g))(x), lin(x).relu())
        # an in-place update of a batched argument reaches the caller's tensor
        h = gt.graphify(lambda a, b: a.mul_(b))
        for _ in range(3):
            a, b = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
            a0 = a.clone()
            tf.vmap(h)(a, b)
            assert_close(a, a0 * b)
    finally:
        ctx.__exit__(None, None, None)
    assert g.cache_info().hits >= 1 and h.cache_info().hits == 2  # (g reads state: its first call ran eagerly)


def test_vmap_randomness_follows_the_seed_as_eager(device):
    f = lambda x: x + torch.rand_like(x)  # noqa: E731
    g = gt.graphify(f)
    for _ in range(3):
        x = torch.zeros(4, 3, device=device)
        torch.manual_seed(5)
        got = tf.vmap(g, randomness="different")(x).clone()
        torch.manual_seed(5)
        assert_close(got, tf.vmap(f, randomness="different")(x))
    with pytest.raises(RuntimeError, match="randomness"):
        tf.vmap(gt.graphify(f))(torch.zeros(4, 3, device=device))  # vmap's default, as eagerly


def test_vmap_with_what_it_cannot_record_runs_eagerly_with_a_warning(device):
    g = gt.graphify(lambda x, k: x * k, static_argnums=1)
    with pytest.warns(gt.EagerWarning, match="torch.func.vmap"):
        got = tf.vmap(g, in_dims=(0, None))(torch.ones(4, 3, device=device), 2.0)
    assert_close(got, torch.full((4, 3), 2.0, device=device))

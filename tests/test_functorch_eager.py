"""torch.func transforms that a recording does not take part in (vmap, jvp, jacfwd, hessian,
linearize): the graphified function runs eagerly, with one EagerWarning per function that says
how to record it, and describe() counts those calls. The fix the warning gives records."""

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
        "vmap": (lambda g: tf.vmap(g)(torch.randn(4, 3, device=device)), "torch.func.vmap", "gt.graphify(torch.func.vmap(f))"),
        "jacfwd": (lambda g: tf.jacfwd(g)(x), "vmap, jvp", "gt.graphify(torch.func.jacfwd(f))"),
        "hessian": (lambda g: tf.hessian(lambda y: g(y).sum())(x), "vmap, jvp", "gt.graphify(torch.func.hessian(f))"),
        "jvp": (lambda g: tf.jvp(g, (x,), (torch.ones_like(x),)), "torch.func.jvp", "torch.func.jvp(f, (x,), (t,))"),
        "linearize": (lambda g: tf.linearize(g, x)[1](torch.ones_like(x)), "forward-mode dual tensors", "gt.graphify(jvp_fn)"),
    }


@pytest.mark.parametrize("how", ["vmap", "jacfwd", "hessian", "jvp", "linearize"])
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

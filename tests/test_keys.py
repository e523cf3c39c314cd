"""Values that compare equal in Python but compute differently are different signatures:
2 / 2.0 / True, 0.0 / -0.0 (numpy's too), and tuples and frozensets of them, as static
arguments (static_argnums / static_argnames) and as non-tensor leaves."""

import numpy as np
import pytest
import torch
from conftest import assert_close

import gtransform as gt


def _full(x, v):
    return torch.full((2,), v[0] if isinstance(v, tuple) else next(iter(v)) if isinstance(v, frozenset) else v) + x * 0


PAIRS = [(2, 2.0), (1, True), (0.0, -0.0), ((2,), (2.0,)), (frozenset({2}), frozenset({2.0})),
         (np.float64(0.0), np.float64(-0.0)), (np.float32(0.0), np.float32(-0.0))]


def _div(x, v):
    return x / v


@pytest.mark.parametrize("how", ["argnums", "argnames", "leaf"])
@pytest.mark.parametrize("pair", PAIRS, ids=[repr(p) for p in PAIRS])
def test_equal_but_different_values_are_different_signatures(how, pair):
    fn = _div if pair[0] == 0 and not isinstance(pair[0], tuple) else _full
    x = torch.ones(2)
    if how == "argnums":
        g = gt.graphify(fn, static_argnums=1)
    elif how == "argnames":
        g = gt.graphify(lambda x, v: fn(x, v), static_argnames="v")
    else:
        g = gt.graphify(fn)
    for _ in range(2):
        for v in pair:
            got = g(x, v=v) if how == "argnames" else g(x, v)
            want = fn(x, v)
            assert got.dtype == want.dtype, (v, got.dtype, want.dtype)
            assert_close(got, want)


def test_a_nan_static_argument_is_one_signature():
    g = gt.graphify(lambda x, v: x + v, static_argnums=1)
    for _ in range(4):
        g(torch.ones(2), float("nan"))
    assert g.cache_info().currsize == 1


@pytest.mark.parametrize("static", [False, True], ids=["leaf", "argnum"])
def test_infinite_static_floats_replay(static):
    # the fast path's generated code wrote repr(inf), `inf`: a NameError from the third call
    g = gt.graphify(lambda x, p: torch.linalg.vector_norm(x, ord=p), static_argnums=1 if static else ())
    for p in (float("inf"), float("-inf"), float("inf"), float("-inf"), 2.0):
        for _ in range(3):
            x = torch.randn(5)
            assert_close(g(x, p), torch.linalg.vector_norm(x, ord=p))
    assert g.cache_info().currsize == 3
    # a different float is a different signature, inf and -inf included
    assert g.cache_info().misses == 3


def test_a_dataclass_input_is_taken_apart_whatever_the_process_met_first():
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        n: int

    @dataclasses.dataclass
    class Outer:
        b: Batch
        w: torch.Tensor

    f = gt.graphify(lambda o: o.b.x * o.b.n + o.w)
    for n in (3, 3, 4):
        o = Outer(Batch(torch.ones(2), n), torch.full((2,), 0.5))
        assert_close(f(o), torch.full((2,), n + 0.5))
    assert f.cache_info().hits == 1


def test_shape_outputs_come_back_as_torch_size():
    g = gt.graphify(lambda x: (x + 1, x.shape, x.size()))
    for _ in range(2):
        out = g(torch.ones(2, 3))
        assert type(out[1]) is torch.Size and type(out[2]) is torch.Size
        assert out[1].numel() == 6


def test_static_argnames_none_and_unknown_names():
    g = gt.graphify(lambda x: x + 1, static_argnames=None, static_argnums=None)
    assert_close(g(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(TypeError, match=r"static_argnames=\.\.\.\): expected a string or strings, got 3"):
        gt.graphify(lambda x: x, static_argnames=3)
    # a misspelt name is an error, as in jax.jit (it left the argument traced, silently)
    with pytest.raises(ValueError, match=r"(?s)static_argnames \['nope'\] name no parameter.*Fix: name a parameter"):
        gt.graphify(lambda x: x, static_argnames="nope")
    with pytest.raises(ValueError, match=r"\['typo'\]"):
        gt.graphify(lambda x, k: x * k, static_argnames=("k", "typo"))
    # **kwargs takes any name
    g = gt.graphify(lambda x, **kw: x * kw["k"], static_argnames="k")
    assert_close(g(torch.ones(2), k=3), torch.full((2,), 3.0))


def test_the_fast_path_sees_an_argument_that_is_or_views_state_written_in_place(device):
    """The fast path checks sharing only for the inputs it copies (those read in place are at their
    recorded addresses): an argument that is the state tensor, or a view of it, still records anew."""
    w = torch.zeros(6, device=device)
    w_ref = torch.zeros(6, device=device)

    def f(x):
        w.add_(x)
        return w * 1 + x

    def ref(x):
        w_ref.add_(x)
        return w_ref * 1 + x

    g = gt.graphify(f)
    for k in range(6):  # settled on the fast path
        x = torch.full((6,), float(k), device=device)
        assert_close(g(x), ref(x))
    for x, xr in ((w, w_ref), (w[:], w_ref[:]), (torch.ones(6, device=device), torch.ones(6, device=device)),
                  (w, w_ref)):
        assert_close(g(x), ref(xr))
        assert_close(w, w_ref)

    def h(a, b):
        a.mul_(2)
        return a + b

    gh = gt.graphify(h)
    for k in range(6):
        a, b = torch.full((3,), float(k), device=device), torch.ones(3, device=device)
        want = h(a.clone(), b)
        assert_close(gh(a, b), want)
    a, a_ref = torch.ones(3, device=device), torch.ones(3, device=device)
    assert_close(gh(a, a), h(a_ref, a_ref))  # the same object twice: 4, not 2 + 1
    assert_close(a, a_ref)


def test_describe_shows_static_values_and_paths_count_static_arguments():
    # f(n, x) with n static: x is args[1] in describe() and in errors, as the caller passed it
    def f(n, x, y=None, scale=1.0):
        return x * n * scale + (0 if y is None else y["b"])

    g = gt.graphify(f, static_argnums=(0,), static_argnames=("scale",))
    x = torch.ones(2)
    for n in (2, 3):
        assert_close(g(n, x, {"b": 7, "c": torch.ones(2)}, scale=0.5), f(n, x, {"b": 7}, scale=0.5))
    text = g.describe()
    assert "in    args[1]: torch.float32 [2]" in text and "in    args[2]['c']" in text
    assert "static args[0]: 2" in text and "static args[0]: 3" in text
    assert "static kwargs['scale']: 0.5" in text and "static args[2]['b']: 7" in text
    with pytest.raises(gt.GraphifyError, match=r"input args\[1\] is a torch.sparse_coo tensor"):
        g(2, torch.ones(2).to_sparse())

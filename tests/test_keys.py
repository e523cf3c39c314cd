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

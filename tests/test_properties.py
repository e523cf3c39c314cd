"""Property tests: ``graphify(f)(*args) == f(*args)`` over generated pytrees.

Also: the signature cache. Calls with new values (same signature) replay one
recording; a new shape, dtype or static value records a new one.
"""

from __future__ import annotations

import dataclasses
import math

import optree
import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import DTYPES, Pair, TensorSpec, build, clone_tree, pytrees, tensor_leaves

import gtransform as gt

NS = "gtransform"


def _map(fn, tree):
    return optree.tree_map(fn, tree, none_is_leaf=False, namespace=NS)


def leaf_op(x):
    """An elementwise op valid for the leaf's dtype (bool: not, int: affine, float: sin)."""
    if x.dtype == torch.bool:
        return ~x
    if x.dtype.is_floating_point:
        return (x * 2).sin() + 1
    return x * 3 - 1


# -- the pure functions under test --------------------------------------------


def f_map(tree):
    """Maps every tensor leaf; returns tensors, statics and None."""
    mapped = _map(lambda x: leaf_op(x) if isinstance(x, torch.Tensor) else x, tree)
    return {"mapped": mapped, "n": 3, "s": "const", "none": None, "pair": Pair(1.5, None)}


def f_reduce(tree):
    """Reductions per dtype kind, plus a Python count (a static output)."""
    ts = tensor_leaves(tree)
    fl = [x.double().sum() for x in ts if x.dtype.is_floating_point]
    it = [x.sum() for x in ts if not x.dtype.is_floating_point]
    out = {"count": len(ts)}
    if fl:
        out["float"] = torch.stack(fl).sum()
    if it:
        out["int"] = torch.stack(it).sum()
        out["any"] = torch.stack([(x != 0).any() for x in ts if not x.dtype.is_floating_point]).all()
    return out


def f_shapes(tree):
    """Views and shape ops (outputs that are views of inputs, of intermediates, concatenations)."""
    out = []
    floats = []
    for x in tensor_leaves(tree):
        out.append(x.reshape(-1))  # a view of the input
        y = leaf_op(x)
        out.append(y.unsqueeze(0))  # a view of an intermediate
        if x.dim() >= 1:
            out.append(x.flip(0))
            out.append(x.transpose(0, -1))  # a view of the input
            out.append(y[..., :1])
        if x.dtype.is_floating_point:
            floats.append(x.reshape(-1).double())
    if floats:
        out.append(torch.cat(floats))
    return out


def f_passthrough(tree):
    """Returns the input tree itself next to a mapped copy."""
    return tree, _map(lambda x: leaf_op(x) if isinstance(x, torch.Tensor) else x, tree)


FUNCTIONS = [f_map, f_reduce, f_shapes, f_passthrough]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@given(spec=pytrees())
def test_matches_eager(device, fn, spec):
    g = gt.graphify(fn)
    args = build(spec, device)
    expected = fn(clone_tree(args))
    assert_close(g(args), expected)
    # a second call with the same inputs replays the recording
    assert_close(g(args), expected)
    assert g.cache_info().misses == 1


@given(spec=pytrees(special=True, statics=False))
@settings(max_examples=20)
def test_nan_inf_values_match_eager(device, spec):
    g = gt.graphify(f_map)
    for salt in range(2):
        args = build(spec, device, salt)
        assert_close(g(args), f_map(clone_tree(args)))


@given(spec=pytrees())
@settings(max_examples=25)
def test_returned_inputs_are_the_callers_tensors(device, spec):
    g = gt.graphify(f_passthrough)
    for salt in range(3):
        args = build(spec, device, salt)
        same, _ = g(args)
        for a, b in zip(tensor_leaves(same), tensor_leaves(args), strict=True):
            assert a is b


@pytest.mark.parametrize("fn", [f_map, f_shapes], ids=lambda f: f.__name__)
@given(spec=pytrees())
@settings(max_examples=25)
def test_new_values_same_signature_hit_the_cache(device, fn, spec):
    g = gt.graphify(fn)
    for salt in range(4):
        args = build(spec, device, salt)
        expected = fn(clone_tree(args))
        assert_close(g(args), expected)
    info = g.cache_info()
    assert info.misses == 1
    assert info.hits == 3
    assert info.currsize == 1


def f_kwargs(tree, *, scale, shift=0.5, extra=None):
    out = _map(lambda x: x * scale + shift if isinstance(x, torch.Tensor) else x, tree)
    if extra is not None:
        out = (out, _map(lambda x: leaf_op(x) if isinstance(x, torch.Tensor) else x, extra))
    return out


@given(
    spec=pytrees(statics=False),
    extra=pytrees(),
    scale=st.integers(-3, 3),
    shift=st.sampled_from([0.5, -1.25, 2.0]),
)
@settings(max_examples=25)
def test_kwargs_match_eager(device, spec, extra, scale, shift):
    g = gt.graphify(f_kwargs)
    for salt in range(2):
        args = build(spec, device, salt)
        ex = build(extra, device, salt)
        expected = f_kwargs(clone_tree(args), scale=scale, shift=shift, extra=clone_tree(ex))
        assert_close(g(args, scale=scale, shift=shift, extra=ex), expected)
        # keyword order does not matter for the result
        assert_close(g(args, extra=ex, shift=shift, scale=scale), expected)
        expected = f_kwargs(clone_tree(args), scale=scale)
        assert_close(g(args, scale=scale), expected)


# -- changing one leaf of the signature -----------------------------------------


def _change_leaf(leaf, how):
    if isinstance(leaf, TensorSpec):
        # the same layout (transposed, sliced...) with one thing changed
        if how == 3 and leaf.effective_layout() == "contiguous" and leaf.shape:
            return dataclasses.replace(leaf, layout="sliced")  # other strides, same shape and dtype
        if how in (0, 3):
            shape = leaf.shape[:-1] + (leaf.shape[-1] + 1,) if leaf.shape else (1,)
            return dataclasses.replace(leaf, shape=shape)
        if how == 1:
            return dataclasses.replace(leaf, shape=leaf.shape + (1,))
        i = DTYPES.index(leaf.dtype)
        return dataclasses.replace(leaf, dtype=DTYPES[(i + 1) % len(DTYPES)])
    if isinstance(leaf, bool):  # pragma: no cover - not generated
        return not leaf
    if isinstance(leaf, int):
        return leaf + 1
    if isinstance(leaf, float):
        assert not math.isnan(leaf)
        return leaf + 1.0
    if isinstance(leaf, str):
        return leaf + "q"
    raise AssertionError(f"unexpected leaf {leaf!r}")


@given(spec=pytrees(), data=st.data())
@settings(max_examples=30)
def test_new_shape_dtype_or_static_records_again(device, spec, data):
    leaves, treespec = optree.tree_flatten(spec, none_is_leaf=False, namespace=NS)
    if not leaves:
        spec2 = [spec, 1]  # another structure
    else:
        i = data.draw(st.integers(0, len(leaves) - 1), label="leaf")
        how = data.draw(st.integers(0, 3), label="how")
        leaves2 = list(leaves)
        leaves2[i] = _change_leaf(leaves[i], how)
        spec2 = optree.tree_unflatten(treespec, leaves2)

    g = gt.graphify(f_map)
    a1 = build(spec, device)
    a2 = build(spec2, device)
    assert_close(g(a1), f_map(clone_tree(a1)))
    assert g.cache_info().misses == 1
    assert_close(g(a2), f_map(clone_tree(a2)))
    assert g.cache_info().misses == 2
    # both recordings are kept: going back is a hit
    assert_close(g(build(spec, device, salt=1)), f_map(build(spec, device, salt=1)))
    assert_close(g(build(spec2, device, salt=1)), f_map(build(spec2, device, salt=1)))
    info = g.cache_info()
    assert info.misses == 2
    assert info.hits == 2
    assert info.currsize == 2


@given(spec=pytrees(statics=False, dtype_choices=(torch.float32, torch.float64)))
@settings(max_examples=15)
def test_tree_structure_change_records_again(device, spec):
    g = gt.graphify(f_map)
    a = build(spec, device)
    wrapped = {"inner": a}
    assert_close(g(a), f_map(clone_tree(a)))
    assert_close(g(wrapped), f_map(clone_tree(wrapped)))
    assert g.cache_info().misses == 2
    assert_close(g([a]), f_map([clone_tree(a)]))
    assert g.cache_info().misses == 3

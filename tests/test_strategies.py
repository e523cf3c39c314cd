"""The generators themselves: hypothesis must draw real tensors (several
elements, several dimensions, non-contiguous layouts, every dtype), or the
property tests only ever see scalars and pass for the wrong reason."""

from __future__ import annotations

import collections
import math

import optree
from hypothesis import given, settings
from strategies import DTYPES, LAYOUTS, TensorSpec, build, pytrees, tensor_leaves


def test_pytrees_draw_real_shapes_layouts_and_dtypes():
    seen = collections.Counter()
    dtypes = set()
    layouts = set()

    @settings(max_examples=100, database=None)  # cheap: no graphify; deterministic under the ci profile
    @given(spec=pytrees())
    def draw(spec):
        specs = [
            x for x in optree.tree_leaves(spec, none_is_leaf=False, namespace="gtransform") if isinstance(x, TensorSpec)
        ]
        seen["examples"] += 1
        if not specs:
            return
        seen["with_tensors"] += 1
        ts = tensor_leaves(build(spec, "cpu"))
        if any(t.numel() >= 4 for t in ts):
            seen["several_elements"] += 1
        if any(t.dim() >= 2 and t.numel() >= 4 for t in ts):
            seen["multi_dim"] += 1
        if any(not t.is_contiguous() for t in ts):
            seen["non_contiguous"] += 1
        for s, t in zip(specs, ts):
            dtypes.add(t.dtype)
            layouts.add(s.effective_layout())
            assert tuple(t.shape) == s.shape and t.dtype == s.dtype
            assert math.prod(s.shape) == t.numel()

    draw()
    n = seen["with_tensors"]
    assert n >= seen["examples"] // 2, seen
    assert seen["several_elements"] >= 0.6 * n, seen
    assert seen["multi_dim"] >= 0.4 * n, seen
    assert seen["non_contiguous"] >= 0.2 * n, seen
    assert dtypes == set(DTYPES), dtypes
    assert layouts == set(LAYOUTS), layouts


def test_layouts_are_what_they_say():
    for layout in LAYOUTS:
        t = TensorSpec((3, 4), DTYPES[0], 1, layout=layout).make("cpu")
        assert t.shape == (3, 4)
        if layout == "contiguous":
            assert t.is_contiguous() and t.storage_offset() == 0
        elif layout == "offset":
            assert t.is_contiguous() and t.storage_offset() > 0
        elif layout == "expanded":
            assert t.stride(0) == 0
        else:
            assert not t.is_contiguous()
    # salted rebuilds keep the layout and change the values
    s = TensorSpec((3, 4), DTYPES[0], 1, layout="transposed")
    a, b = s.make("cpu"), s.make("cpu", salt=1)
    assert a.stride() == b.stride() and not bool((a == b).all())

"""fuse=True: elements of an input read at fixed indices (an unrolled loop over a grid) are
passed to inductor as inputs of their own, so the steps' kernels have one source (gtransform.fuse._lift).

The pass is checked on traced graphs directly (no compile: CPU); the compiled path on the GPU
is in test_fuse.py."""

import pytest
import torch
from conftest import assert_close
from torch.fx.experimental.proxy_tensor import make_fx

from gtransform.fuse import _lift


def steps(y, t):
    for t0, t1 in zip(t[:-1], t[1:]):
        dt = t1 - t0
        y = y + dt * (y * t0).tanh()
    return y


def test_fixed_index_reads_become_inputs_and_the_graph_computes_the_same():
    y, t = torch.randn(4, 3), torch.linspace(0, 1, 6)
    gm = make_fx(steps)(y, t)
    lifted = _lift.lift_indexed_views(gm, [y, t])
    assert len(lifted) == 10  # t0 and t1 of 5 steps
    indexing = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.ops.aten.select.int,)]
    assert not indexing
    got = gm(y, t, *_lift.views_of(lifted, [y, t]))
    assert_close(got, steps(y, t))
    # the views follow the input's values (no copy): a changed grid is read as changed
    t2 = t * 2
    assert_close(gm(y, t2, *_lift.views_of(lifted, [y, t2])), steps(y, t2))


def test_with_lifted_makes_the_views_again_when_an_input_moves():
    y, t = torch.randn(4, 3), torch.linspace(0, 1, 6)
    gm = make_fx(steps)(y, t)
    lifted = _lift.lift_indexed_views(gm, [y, t])
    call = _lift.with_lifted(gm, lifted)
    assert_close(call(y, t), steps(y, t))
    t.mul_(3)  # same memory: the views made before read it
    assert_close(call(y, t), steps(y, t))
    other = torch.linspace(0, 2, 6)  # another tensor: views made over it
    assert_close(call(y, other), steps(y, other))


def written(y, t):
    a = t[0] * y
    t.add_(1)  # the graph writes t: its elements are not lifted (the read's order matters)
    return a + t[1]


@pytest.mark.parametrize("fn", [written, lambda y, t: (t.t().add_(1), y * t[0, 0])[1]])
def test_inputs_the_graph_writes_are_not_lifted(fn):
    y, t = torch.randn(2), torch.ones(2, 2)
    gm = make_fx(fn)(y, t.clone())
    assert _lift.lift_indexed_views(gm, [y, t]) == []


def test_large_views_and_plain_slices_stay():
    def f(y, big):
        return y * big[0] + big[1:].sum()

    y, big = torch.randn(100), torch.randn(3, 100)
    gm = make_fx(f)(y, big)
    assert _lift.lift_indexed_views(gm, [y, big]) == []  # big[0] has 100 elements: read in its kernel

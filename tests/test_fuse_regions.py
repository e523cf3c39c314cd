"""fuse=True: repeated calls (an ODE solver's steps, a model's identical layers) compiled once.

The outlining itself (``gtransform.fuse._regions``) is checked on the CPU against the traced
graph it rewrites; the compiled result against eager on the GPU.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt
from gtransform.fuse import _regions


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def _outlined(fn, *args, inputs):
    gm = gt.graphify(fn).trace(*args)
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    n = _regions.outline(out, inputs)
    return gm, out, n


def _invokes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]


def test_the_steps_of_a_loop_become_calls_of_one_subgraph_with_the_same_numbers():
    net = _net()

    def step(y, h):  # (Heun's method: a call of its own, as a solver's step is)
        k1 = net(y)
        k2 = net(y + h * k1)
        return y + h * (k1 + k2) / 2

    def solve(y, h):
        for _ in range(5):
            y = step(y, h)
        return y

    y, h = torch.randn(4, 8), torch.tensor(0.1)
    gm, out, n = _outlined(solve, y, h, inputs=[y, h] + [p.detach() for p in net.parameters()])
    ins = [y, h] + [p.detach() for p in net.parameters()]
    assert n == 5  # the steps (two field evaluations each), not the ten evaluations
    assert len({i.args[0].target for i in _invokes(out)}) == 1
    assert_close(out(*ins), gm(*ins))


def test_calls_that_differ_in_a_constant_are_outlined_one_level_down():
    net = _net()

    def solve(y):
        for i in range(4):
            y = y + 0.1 * (i + 1) * net(y)  # each step its own constant: the net's calls repeat
        return y

    y = torch.randn(4, 8)
    ins = [y] + [p.detach() for p in net.parameters()]
    gm, out, n = _outlined(solve, y, inputs=ins)
    assert n == 4
    assert_close(out(*ins), gm(*ins))


def test_a_call_that_writes_or_is_called_once_is_left_inline():
    net = _net()

    def writes(y, buf):
        for _ in range(3):
            y = net(y)
            buf.add_(1)  # (between the calls: each call stays pure)
            y = (y + buf).relu_().tanh().sin()
        return y

    y, buf = torch.randn(4, 8), torch.zeros(4, 8)
    ins = [y, buf] + [p.detach() for p in net.parameters()]
    gm, out, n = _outlined(writes, y, buf, inputs=ins)
    assert n == 3  # the net's calls (pure); the steps write in place
    for node in _invokes(out):
        sub = getattr(out, str(node.args[0].target))
        assert not any(getattr(m.target, "_schema", None) is not None and m.target._schema.is_mutable
                       for m in sub.graph.nodes if m.op == "call_function")

    gm, out, n = _outlined(lambda y: net(y), y, inputs=[y] + [p.detach() for p in net.parameters()])
    assert n == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_repeated_layers_compile_once_and_give_eagers_numbers(caplog):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda().eval()
    f = gt.graphify(enc, fuse=True)
    # (the layers' composite path: in eval mode without grad each layer is otherwise one native
    # kernel, as in eager, and there is nothing to outline)
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with caplog.at_level(logging.INFO, logger="gtransform"), torch.no_grad():
            for _ in range(3):
                x = torch.randn(2, 16, 64, device="cuda")
                assert_close(f(x), enc(x))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    assert any("repeated calls compiled as" in r.getMessage() for r in caplog.records)

"""torch's own fast paths are taken where eager takes them.

``nn.TransformerEncoderLayer``, ``nn.TransformerEncoder`` and ``nn.MultiheadAttention`` in eval
mode without grad run one native kernel (``_transformer_encoder_layer_fwd``,
``_native_multi_head_attention``, which torch keeps make_fx traces off) unless a
torch-function override is active, and
``nn.TransformerEncoder`` given a padding mask runs its layers on a nested tensor and pads the
result with zeros, unless it is compiling. A trace runs under torch-function modes and answers
``torch.compiler.is_compiling()`` with True, so it used to take the other paths: other kernels,
and no zeros at the padded positions (a difference of 2.6 at those rows). The trace now takes
eager's path: the same kernels, or, for the nested-tensor path, which a recording cannot hold,
eager calls with an EagerWarning saying how to record it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt


def _encoder(device, nested, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested).to(device).eval()


def _ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_an_encoder_layer_in_eval_mode_runs_eagers_native_kernel(device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(device).eval()
    x = torch.randn(2, 6, 32, device=device)
    f = gt.graphify(layer)
    with torch.no_grad():
        assert "aten._transformer_encoder_layer_fwd.default" in _ops(f.trace(x))
        for _ in range(3):
            torch.testing.assert_close(f(x), layer(x), rtol=0, atol=0)


def test_a_padding_mask_without_nested_tensors_is_recorded_as_eager_runs_it(device):
    model = _encoder(device, nested=False)
    x = torch.randn(3, 7, 32, device=device)
    mask = torch.zeros(3, 7, dtype=torch.bool, device=device)
    mask[0, 4:] = True
    mask[2, 6:] = True

    def fn(x, mask):
        with torch.no_grad():
            return model(x, src_key_padding_mask=mask)

    f = gt.graphify(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gt.EagerWarning)
        for _ in range(3):
            torch.testing.assert_close(f(x, mask), fn(x, mask), rtol=0, atol=0)
    assert f.cache_info().currsize == 1


def test_the_nested_tensor_path_gives_eagers_zeros_and_says_how_to_record(device):
    model = _encoder(device, nested=True)  # (nn.TransformerEncoder's default)
    x = torch.randn(2, 8, 32, device=device)
    mask = torch.zeros(2, 8, dtype=torch.bool, device=device)
    mask[0, 5:] = True

    def fn(x, mask):
        with torch.no_grad():
            return model(x, src_key_padding_mask=mask)

    f = gt.graphify(fn)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        outs = [f(x, mask) for _ in range(3)]
    want = fn(x, mask)
    assert bool((want[0, 5:] == 0).all())  # eager's padded rows
    for out in outs:
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    texts = [str(m.message) for m in w if issubclass(m.category, gt.EagerWarning)]
    assert texts and "enable_nested_tensor=False" in texts[0]


def test_multihead_attention_in_eval_mode_gives_eagers_numbers(device):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).to(device).eval()
    q = torch.randn(2, 5, 32, device=device)
    kpm = torch.zeros(2, 5, dtype=torch.bool, device=device)
    kpm[1, 3:] = True

    def fn(q, kpm):
        with torch.no_grad():
            return mha(q, q, q, key_padding_mask=kpm, need_weights=False)[0]

    f = gt.graphify(fn)
    # (torch itself keeps make_fx traces off this kernel: the composite path, within tolerance)
    for _ in range(3):
        assert_close(f(q, kpm), fn(q, kpm))


@pytest.mark.parametrize("train", [True, False])
def test_with_grad_or_in_training_the_composite_path_stays(device, train):
    model = _encoder(device, nested=False, layers=1)
    model.train(train)
    x = torch.randn(2, 4, 32, device=device)
    f = gt.graphify(model)
    ops = _ops(f.trace(x))
    assert "aten._transformer_encoder_layer_fwd.default" not in ops  # (grad enabled: eager's slow path too)
    out = f(x)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_other_threads_see_torchs_own_functions():
    import gtransform._patches as patches

    assert torch.overrides.has_torch_function is torch._C._has_torch_function
    with patches.trace_scope():
        assert patches.tracing()
        # (installed while a trace runs: routed in this thread, torch's answer in any other)
        import threading

        seen = {}

        def other():
            seen["compiling"] = torch.compiler.is_compiling()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen["compiling"] is False
    assert torch.overrides.has_torch_function is torch._C._has_torch_function

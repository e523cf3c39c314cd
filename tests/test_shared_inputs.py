"""A function's signatures share their static input buffers' memory (issue #36 item 2; see gtransform/_sharing.py).

A call copies its inputs into its recording's buffers just before the replay reads them, so
one block per input position serves every batch size: a server that sees 64 sizes of an
image batch keeps about one batch of input memory, not 64. The promises: every call gives
eager's numbers, an input the function updates in place is updated as in eager, buffers handed
out by ``f.input_buffers`` are the caller's alone (another size's call never writes them).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as hst

import gtransform as gt

MiB = 2 ** 20


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).to(device).eval()


def test_sizes_share_input_memory_and_match_eager(device):
    model = _model(device)
    f = gt.graphify(lambda x, t: model(x) * t)
    with torch.no_grad():
        for n in (5, 7, 3, 12, 7, 5, 20, 3, 12, 20, 7):
            x, t = torch.randn(n, 8, device=device), torch.randn(n, 1, device=device, dtype=torch.float64)
            assert_close(f(x, t), model(x) * t)
    assert "over memory shared with the pool's other signatures" in f.describe()


def test_an_input_updated_in_place_is_updated_as_in_eager_over_sizes(device):
    def step(acc, x):
        acc.add_(x.sum(0))  # acc: a new tensor each call, written back to the caller's
        return acc * 2, x.mean(0)

    f = gt.graphify(step)
    for n in (4, 6, 4, 9, 6, 4, 9):
        acc, x = torch.randn(n, 3, device=device), torch.randn(n, n, 3, device=device)
        acc_ref = acc.clone()
        want = step(acc_ref, x)
        got = f(acc, x)
        assert_close(got[0], want[0])
        assert_close(got[1], want[1])
        assert_close(acc, acc_ref)


def test_buffers_handed_out_are_not_written_by_another_sizes_call(device):
    w = torch.randn(8, 3, device=device)
    f = gt.graphify(lambda x, y: (x @ w).relu() + y)
    for n in (5, 7, 3, 7, 5):  # 7's recording first lies over the shared memory
        x, y = torch.randn(n, 8, device=device), torch.randn(n, 3, device=device)
        assert_close(f(x, y), (x @ w).relu() + y)
    bx, by = f.input_buffers(torch.zeros(7, 8, device=device), torch.zeros(7, 3, device=device))
    bx.copy_(torch.ones(7, 8))
    by.fill_(2.0)
    for n in (5, 3, 9):  # other sizes' calls copy their inputs in between
        x, y = torch.randn(n, 8, device=device), torch.randn(n, 3, device=device)
        assert_close(f(x, y), (x @ w).relu() + y)
    assert_close(f(bx, by), (torch.ones(7, 8, device=device) @ w).relu() + 2)
    # a size asked before it is recorded gets buffers of its own as well
    cx, cy = f.input_buffers(torch.zeros(11, 8, device=device), torch.zeros(11, 3, device=device))
    cx.fill_(-1.0)
    cy.fill_(0.5)
    f(torch.randn(5, 8, device=device), torch.randn(5, 3, device=device))
    assert_close(f(cx, cy), (torch.full((11, 8), -1.0, device=device) @ w).relu() + 0.5)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(sizes=hst.lists(hst.integers(1, 9), min_size=1, max_size=12),
       channels_last=hst.booleans())
def test_any_stream_of_sizes_and_layouts_matches_eager(sizes, channels_last):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    f = gt.graphify(lambda x, b: conv(x).relu().mean((2, 3)) + b)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 3, 5, 5)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            b = torch.randn(n, 4).t().contiguous().t()  # column-major: strides (1, n)
            assert_close(f(x, b), conv(x).relu().mean((2, 3)) + b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_serving_loop_over_many_sizes_holds_about_one_batch_of_inputs():
    conv = torch.nn.Conv2d(3, 8, 3, padding=1).cuda().eval()
    f = gt.graphify(lambda x: conv(x).amax((1, 2, 3)))
    sizes = list(range(1, 33))
    torch.manual_seed(0)
    order = [sizes[i] for i in torch.randperm(len(sizes)).tolist()]
    per_row = 3 * 64 * 64 * 4
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", gt.RerecordWarning)  # (more than 16 sizes: said once, expected)
        for n in order + order:  # each size recorded on its second call
            x = torch.randn(n, 3, 64, 64, device="cuda")
            assert_close(f(x), conv(x).amax((1, 2, 3)))
    del x
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    every = sum(sizes) * per_row  # one buffer per size: 25.8 MiB
    assert held < every / 4, f"{held / MiB:.1f} MiB held; one buffer per size: {every / MiB:.1f} MiB"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=hst.lists(hst.tuples(hst.sampled_from(["new", "same", "buffers"]), hst.integers(1, 6)),
                     min_size=1, max_size=14))
def test_any_mix_of_new_tensors_same_tensors_and_handed_buffers_matches_eager(ops):
    """Calls with new tensors, with the same tensors again (read in place from then on), and with
    buffers handed out and filled, over sizes in any order: each call gives eager's numbers and
    updates its in-place argument as eager does."""
    torch.manual_seed(0)
    w = torch.randn(4, 3)

    def fn(x, acc):
        acc.mul_(0.5)
        return torch.tanh(x @ w) + acc.sum()

    f = gt.graphify(fn)
    kept = {}  # size -> the tensors passed before (for "same")
    handed = {}  # size -> the buffers handed out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gt.RerecordWarning)
        for step, (how, n) in enumerate(ops):
            if how == "same" and n in kept:
                x, acc = kept[n]
            elif how == "buffers":
                if n not in handed:
                    f(torch.randn(n, 4), torch.randn(n))  # (recorded: its first call may run eagerly)
                    handed[n] = f.input_buffers(torch.randn(n, 4), torch.randn(n))
                x, acc = handed[n]
                x.copy_(torch.full((n, 4), float(step)))
                acc.copy_(torch.arange(n, dtype=torch.float32))
            else:
                x, acc = torch.randn(n, 4), torch.randn(n)
                kept[n] = (x, acc)
            acc_ref = acc.clone()
            want = fn(x.clone(), acc_ref)
            assert_close(f(x, acc), want)
            assert_close(acc, acc_ref)

"""The signatures of a CUDA function share its pool's memory (issue #36 item 2; see gtransform/_sharing.py).

The promises: a server that sees many batch sizes holds about one set of outputs, not one per
size (in a function's own pool; a pool shared across threads keeps each signature's); every call
still gives eager's numbers; views the caller derived from an output keep their
values whichever signature runs next; an output held when its recording is closed keeps its
values; state a function leaves in Python is never written by another signature's replay.
"""

from __future__ import annotations

import gc

import pytest
import torch

import gtransform as gt

MiB = 2 ** 20

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fn(x):
    a = x * 2 + 1
    b = a.sin() * 3
    return (b.exp() - a).cos() + 7


def _sizes(n=8, base=1 << 20):
    return [base + k * 4096 for k in range(n)]  # ~4 MiB of float32 each, one size class


def test_a_functions_sizes_share_output_memory_and_match_eager():
    f = gt.graphify(_fn)
    xs = [torch.randn(n, device="cuda") for n in _sizes()]
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for x in xs:  # each size recorded (its second call reads x in place)
        for _ in range(2):
            y = f(x)
            torch.testing.assert_close(y, _fn(x))
            del y
    torch.cuda.synchronize()
    gc.collect()
    held = torch.cuda.memory_allocated() - before
    out_bytes = xs[-1].numel() * 4
    # 8 sizes of ~4 MiB outputs: without sharing 8 sets of outputs stay allocated (~32 MiB)
    assert held < 3 * out_bytes, f"{held / MiB:.1f} MiB held after 8 sizes, outputs {out_bytes / MiB:.1f} MiB each"
    assert "shared with the pool" in f.describe()
    # every size again, in turn and in a loop that holds the previous output: eager's numbers
    for _ in range(2):
        for x in reversed(xs):
            torch.testing.assert_close(f(x), _fn(x))
    prev = None
    for x in xs + xs[::-1]:
        out = f(x)
        torch.testing.assert_close(out, _fn(x))
        if prev is not None:
            with pytest.raises(gt.OverwrittenOutputError):
                prev + 1
        prev = out


def test_views_of_one_sizes_output_keep_their_values_through_other_sizes_calls():
    f = gt.graphify(_fn)
    xs = [torch.randn(n, device="cuda") for n in _sizes(4)]
    for x in xs:
        for _ in range(2):
            f(x)
    for i, x in enumerate(xs):
        out = f(x)
        view = out[:1000]
        want = _fn(x)[:1000].clone()
        del out
        for j, other in enumerate(xs):  # every other size runs, some over this output's memory
            if j != i:
                torch.testing.assert_close(f(other), _fn(other))
        torch.cuda.synchronize()
        assert torch.equal(view, want), f"size {i}: a view changed after other sizes ran"
        del view
    # the views are gone: every size still matches eager
    for x in xs:
        torch.testing.assert_close(f(x), _fn(x))


def test_an_output_held_when_its_recording_is_closed_keeps_its_values():
    f = gt.graphify(_fn)
    a, b = (torch.randn(n, device="cuda") for n in _sizes(2))
    for x in (a, b, a, b):
        f(x)
    ya = f(a)  # over memory given back to the pool (b's recording was captured over it)
    view = ya[5:50]
    want = _fn(a)
    f.cache_clear()
    for _ in range(3):
        torch.testing.assert_close(f(b), _fn(b))
        torch.testing.assert_close(f(a.clone()), _fn(a))
    torch.cuda.synchronize()
    torch.testing.assert_close(ya, want)
    torch.testing.assert_close(view, want[5:50])


def test_state_left_in_python_is_never_written_by_another_signatures_replay():
    state = {}

    def fn(x, write):
        if write:
            state["last"] = x * 3  # left in Python: that signature's escape
        return _fn(x)

    f = gt.graphify(fn, static_argnames="write")
    a, b, c = (torch.randn(n, device="cuda") for n in _sizes(3))
    for x in (a, b, a, b):  # a's outputs given back while b is captured
        f(x, write=False)
    for _ in range(3):
        f(c, write=True)
    want = c * 3
    for _ in range(3):
        for x in (a, b):
            torch.testing.assert_close(f(x, write=False), _fn(x))
            torch.cuda.synchronize()
            torch.testing.assert_close(state["last"], want)


def test_a_pool_shared_across_threads_keeps_each_signatures_outputs():
    # gt.graph_pool(): another thread may read an output while this one calls, so nothing is given back
    f = gt.graphify(_fn, pool=gt.graph_pool())
    a, b = (torch.randn(n, device="cuda") for n in _sizes(2))
    for x in (a, b, a, b):
        torch.testing.assert_close(f(x), _fn(x))
    assert "shared with the pool" not in f.describe()


def test_a_serving_loop_over_many_sizes_holds_about_one_set_of_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 4096)).cuda().eval()

    @gt.graphify
    def serve(x):
        with torch.no_grad():
            return model(x).softmax(-1)

    def allocated():
        # after an eager call: its stream's cuBLAS workspace (32 MiB on Hopper, which a capture
        # frees as torch.cuda.graph does) is counted on both sides
        with torch.no_grad():
            model(torch.randn(1, 256, device="cuda"))
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    sizes = [1, 3, 8, 17, 32, 5, 64, 48, 2, 40, 64, 1, 17]
    before = allocated()
    for n in sizes:
        x = torch.randn(n, 256, device="cuda")
        with torch.no_grad():
            want = model(x).softmax(-1)
        torch.testing.assert_close(serve(x), want)
    del x, want
    held = allocated() - before
    largest = 64 * 4096 * 4
    distinct = sorted(set(sizes))
    all_outputs = sum(n * 4096 * 4 for n in distinct)
    assert held < all_outputs / 2, (f"{held / MiB:.1f} MiB held; every size's outputs: {all_outputs / MiB:.1f} MiB, "
                                    f"the largest: {largest / MiB:.1f} MiB")

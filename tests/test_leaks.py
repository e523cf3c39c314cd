"""Leaks: dropped functions and cleared or evicted recordings are collected;
outputs the user still holds stay valid and keep their values."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from conftest import assert_close

import gtransform as gt


def _make_fn():
    # a fresh closure each time, so nothing at module level refers to it
    scale = 2.0

    def fn(x, p):
        return {"y": x * scale + p, "s": (x * p).sum()}

    return fn


def _collected(*refs):
    gc.collect()
    return [r() is None for r in refs]


def test_dropped_function_and_its_recordings_are_collected(device):
    fn = _make_fn()
    g = gt.graphify(fn)
    p = torch.randn(3, device=device)
    for _k in range(3):
        g(torch.randn(3, device=device), p)  # p passed again: read in place
    g(torch.randn(5, device=device), torch.randn(5, device=device))  # a second signature
    gm = g.trace(torch.randn(3, device=device), p)
    refs = [weakref.ref(g), weakref.ref(fn), weakref.ref(gm), weakref.ref(p)]
    del g, fn, gm, p
    assert _collected(*refs) == [True, True, True, True]


def test_held_output_survives_the_function(device):
    fn = _make_fn()
    g = gt.graphify(fn)
    x = torch.randn(3, device=device)
    p = torch.randn(3, device=device)
    g(x + 1, p)
    out = g(x, p)
    want = fn(x, p)
    wr = weakref.ref(g)
    del g, fn
    assert _collected(wr) == [True]
    assert_close(out, want)
    # other work that allocates does not change it
    for _ in range(3):
        junk = torch.randn(3, device=device) * 7
        del junk
    gc.collect()
    assert_close(out, want)
    y = out["y"] + 1
    assert_close(y, want["y"] + 1)


def test_dropped_function_in_a_shared_pool_is_collected(device):
    pool = gt.graph_pool()
    fn = _make_fn()
    g = gt.graphify(fn, pool=pool)
    other = gt.graphify(lambda x: x - 1, pool=pool)
    x = torch.randn(3, device=device)
    other(x)
    out = g(x, x)  # g made the pool's latest call
    want = fn(x, x)
    gm = g.trace(x, x)
    refs = [weakref.ref(g), weakref.ref(fn), weakref.ref(gm)]
    del g, fn, gm
    assert _collected(*refs) == [True, True, True]
    assert_close(out, want)
    # the pool and the other function keep working
    assert_close(other(x), x - 1)


def test_recordings_made_in_other_threads_are_collected(device):
    fn = _make_fn()
    g = gt.graphify(fn)
    gms = []

    def work(f):
        x = torch.randn(3, device=device)
        f(x, x)
        gms.append(weakref.ref(f.trace(x, x)))

    threads = [threading.Thread(target=work, args=(g,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refs = [weakref.ref(g), weakref.ref(fn)] + gms
    del g, fn
    assert all(_collected(*refs))


def test_cache_clear_releases_recordings_and_keeps_outputs(device):
    fn = _make_fn()
    g = gt.graphify(fn)
    p = torch.randn(3, device=device)
    x = torch.randn(3, device=device)
    g(x, p)
    out = g(x + 1, p)
    want = fn(x + 1, p)
    wr_gm = weakref.ref(g.trace(x, p))
    wr_p = weakref.ref(p)
    g.cache_clear()
    del p
    assert _collected(wr_gm, wr_p) == [True, True]
    assert_close(out, want)
    # the next calls of g do not overwrite (or poison) what cache_clear left to the user
    for _k in range(3):
        z = torch.randn(3, device=device)
        assert_close(g(z, z), fn(z, z))
    assert_close(out, want)


def test_evicted_recordings_are_released(device):
    g = gt.graphify(lambda x: x * 2, maxsize=1)
    x = torch.randn(3, device=device)
    a = g(x)
    wr = weakref.ref(g.trace(x))
    y = torch.randn(4, device=device)
    b = g(y)  # evicts the first signature
    assert g.cache_info().currsize == 1
    assert _collected(wr) == [True]
    assert_close(b, y * 2)
    del a


def test_cuda_graphs_collected_during_a_capture_do_not_break_it(device, monkeypatch):
    # Python's cyclic collector can run at any allocation; if it frees a CUDA
    # graph (a dead recording's, or the user's own) while a recording is being
    # captured on the same thread, the driver invalidates that capture.
    # Here dead graphs in reference cycles become garbage just as the capture
    # starts, and the collector runs at every allocation.
    if device != "cuda":
        pytest.skip("CUDA graph capture")
    x = torch.randn(32, device=device)
    side = torch.cuda.Stream()
    graphs = []
    for i in range(4):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            g.capture_begin()
            _ = x * i
            g.capture_end()
        graphs.append(g)
    torch.cuda.synchronize()
    real_begin = torch.cuda.CUDAGraph.capture_begin

    def begin_then_allocate(self, *args, **kwargs):
        for g in graphs:  # young cycles, the graphs' only owners from here on
            cycle = [g]
            cycle.append(cycle)
        graphs.clear()
        real_begin(self, *args, **kwargs)
        _ = [{} for _ in range(64)]  # with threshold 1 the collector runs here when enabled

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", begin_then_allocate)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        f = gt.graphify(lambda t: (t * 3).sin() + 1)
        out = f(x)
    finally:
        gc.set_threshold(*old)
    assert_close(out, (x * 3).sin() + 1)
    gc.collect()


@pytest.mark.filterwarnings("ignore::gtransform.RerecordWarning")
def test_signatures_beyond_maxsize_do_not_keep_their_traces_or_argument_objects():
    """Many signatures that read state (un-bucketed lengths; a new cache object per request):
    before, the first-call traces and the marks of every signature ever seen were kept
    whatever maxsize said (200 lengths: 200 graph modules alive, memory growing without end),
    and the storm detector kept the argument objects (a KV cache per request) even after
    cache_clear()."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    g = gt.graphify(model, maxsize=4)
    with torch.no_grad():
        for n in range(1, 61):
            g(torch.randn(n, 8))
    st = g._tls.state
    assert len(st.pending) <= 4 and len(st.warmed) <= 8 and len(st.cache) <= 4

    class Cache:  # an object argument, keyed by identity
        def __init__(self):
            self.k = torch.zeros(2, 8)

    f = gt.graphify(lambda x, c: x + c.k, maxsize=4)
    refs = []
    with torch.no_grad():
        for _ in range(30):
            c = Cache()
            refs.append(weakref.ref(c))
            f(torch.ones(2, 8), c)
            del c
    gc.collect()
    # (those of the cached signatures, the first-call traces and the marks of the latest)
    assert sum(r() is not None for r in refs) <= 4 + 4 + 8
    f.cache_clear()
    gc.collect()
    assert all(r() is None for r in refs)

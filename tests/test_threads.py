"""Threads (DESIGN semantics 7): each thread has its own recordings and outputs;
concurrent calls never produce wrong numbers or poison another thread's outputs."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from conftest import assert_close, stale

import gtransform as gt

N_THREADS = 8
N_CALLS = 200


def _run_threads(target, n=N_THREADS):
    errors = []
    barrier = threading.Barrier(n, timeout=60)

    def wrap(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: B036 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise AssertionError(f"{len(errors)} thread(s) failed; first: thread {errors[0][0]}") from errors[0][1]


def mlp(p, x):
    h = (x @ p["w1"]).tanh()
    return {"y": h @ p["w2"] + p["b"], "norm": h.pow(2).sum()}


def elementwise(x, y):
    return (x * y).sin() + x.cos(), x - y


def reduce_(x):
    return x.sum(0), x.amax(1)


def test_one_function_many_threads(device):
    g = gt.graphify(mlp)
    p = {
        "w1": torch.randn(6, 8, device=device),
        "w2": torch.randn(8, 3, device=device),
        "b": torch.randn(3, device=device),
    }

    def work(i):
        gen = torch.Generator().manual_seed(i)
        for _k in range(N_CALLS):
            x = torch.randn(4, 6, generator=gen).to(device)
            out = g(p, x)
            assert_close(out, mlp(p, x))

    _run_threads(work)
    info = g.cache_info()
    assert info.misses == N_THREADS  # each thread records its own, once
    assert info.hits + info.misses == N_THREADS * N_CALLS


def test_several_functions_many_threads(device):
    fns = [elementwise, reduce_, lambda x: x * 3]
    gs = [gt.graphify(f) for f in fns]

    def work(i):
        gen = torch.Generator().manual_seed(100 + i)
        for k in range(N_CALLS):
            j = (i + k) % 3
            x = torch.randn(5, 4, generator=gen).to(device)
            if j == 0:
                y = torch.randn(5, 4, generator=gen).to(device)
                assert_close(gs[0](x, y), fns[0](x, y))
            else:
                assert_close(gs[j](x), fns[j](x))

    _run_threads(work)


def test_shapes_per_thread(device):
    # threads use different signatures of one function at the same time
    g = gt.graphify(lambda x: x.softmax(-1) * 2)

    def work(i):
        gen = torch.Generator().manual_seed(i)
        for k in range(N_CALLS // 2):
            n = 1 + (i + k) % 4
            x = torch.randn(n, 3, generator=gen).to(device)
            assert_close(g(x), x.softmax(-1) * 2)

    _run_threads(work)


def test_outputs_held_by_one_thread_are_not_poisoned_by_another(device):
    # all threads call g in lock step; after each round every thread checks
    # its own output, which the other threads' calls of that round must not touch
    g = gt.graphify(lambda x: x * 2 + 1)
    called = threading.Barrier(N_THREADS, timeout=60)
    checked = threading.Barrier(N_THREADS, timeout=60)

    def work(i):
        for k in range(50):
            x = torch.full((4,), float(100 * i + k), device=device)
            out = g(x)
            called.wait()
            assert_close(out, x * 2 + 1)
            checked.wait()

    _run_threads(work)


def test_held_output_survives_other_threads_calls(device):
    g = gt.graphify(lambda x: x * 2 + 1)
    held_ready = threading.Barrier(N_THREADS, timeout=60)
    others_done = threading.Barrier(N_THREADS, timeout=60)

    def work(i):
        x = torch.full((4,), float(i), device=device)
        if i == 0:
            held = g(x)
            held_ready.wait()
            others_done.wait()
            # no call of g in this thread since: still valid and right
            assert_close(held, x * 2 + 1)
            assert_close(g(x + 1), (x + 1) * 2 + 1)
            with pytest.raises(gt.OverwrittenOutputError, match=stale("<lambda>")):
                held.sum()  # own next call poisoned it
        else:
            held_ready.wait()
            for k in range(N_CALLS // 4):
                y = torch.full((4,), float(100 * i + k), device=device)
                assert_close(g(y), y * 2 + 1)
            others_done.wait()

    _run_threads(work)


# -- a pool shared across threads --------------------------------------------------------------

_inside = {"now": 0, "max": 0}
_inside_lock = threading.Lock()


@torch.library.custom_op("gt_tests::occupy", mutates_args=())
def _occupy(x: torch.Tensor) -> torch.Tensor:
    """Counts how many replays run inside a shared pool at once (runs at replay on the CPU)."""
    with _inside_lock:
        _inside["now"] += 1
        _inside["max"] = max(_inside["max"], _inside["now"])
    time.sleep(0.0005)  # widen the window in which an unserialised replay would overlap
    with _inside_lock:
        _inside["now"] -= 1
    return x.clone()


@_occupy.register_fake
def _(x):
    return torch.empty_like(x)


def shared_a(x):
    return _occupy(x) * 2 + 1


def shared_b(x):
    return (_occupy(x) - 1).sin()


def test_shared_pool_serialises_calls_across_threads():
    # GraphPool: calls of functions sharing a pool run one at a time across
    # threads. CPU only: there the replay runs the traced graph, so the probe
    # op's Python body runs inside every replay (a CUDA replay runs no Python).
    pool = gt.graph_pool()
    fa = gt.graphify(shared_a, pool=pool)
    fb = gt.graphify(shared_b, pool=pool)
    _inside.update(now=0, max=0)

    def work(i):
        gen = torch.Generator().manual_seed(i)
        for k in range(40):
            x = torch.randn(16, generator=gen)
            # outputs are not read here: another thread's call may already have
            # overwritten them (the next test checks the numbers)
            (fa if (i + k) % 2 else fb)(x)

    _run_threads(work)
    assert _inside["max"] == 1, f"{_inside['max']} replays ran at once in one shared pool"
    # the probe does see overlap when nothing serialises (eager calls from the threads)
    _inside.update(now=0, max=0)
    _run_threads(lambda i: [_occupy(torch.ones(16)) for _ in range(20)])
    assert _inside["max"] > 1, "the probe never ran concurrently: the check above proves nothing"


def test_shared_pool_across_threads_never_shows_wrong_numbers(device):
    # Any call in the pool, from any thread, overwrites the pool's earlier outputs:
    # a read is either right or an OverwrittenOutputError, never other numbers.
    pool = gt.graph_pool()
    fa = gt.graphify(lambda x: x * 2 + 1, pool=pool)
    fb = gt.graphify(lambda x: (x - 1) * 3, pool=pool)
    n_stale = [0] * N_THREADS
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many thread switches inside calls
    try:

        def work(i):
            prev = None
            for k in range(N_CALLS):
                x = torch.full((64,), float(1000 * i + k), device=device)
                f, want = (fa, x * 2 + 1) if (i + k) % 2 else (fb, (x - 1) * 3)
                out = f(x)
                for got, exp in ((out, want), prev or (None, None)):
                    if got is None:
                        continue
                    try:
                        val = got.clone()
                    except gt.OverwrittenOutputError as e:
                        assert ".clone()" in str(e), str(e)
                        n_stale[i] += 1
                        continue
                    assert torch.equal(val, exp), f"thread {i} call {k}: an output shows other numbers"
                prev = (out, want)  # held across this thread's next call

        _run_threads(work)
    finally:
        sys.setswitchinterval(old)
    # the previous output is always held across the next call of the pool: stale
    assert sum(n_stale) >= N_THREADS * (N_CALLS - 1)

"""gt.disable() and GTRANSFORM_DISABLE=1: graphified functions run their Python eagerly."""

import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import assert_close

import gtransform as gt


def test_disable_runs_the_python_on_every_call_and_records_nothing(device):
    seen = []

    @gt.graphify
    def f(x):
        seen.append(float(x.sum()))  # a host read: refused when recorded, fine eagerly
        return x * 2

    with gt.disable():
        for v in (1.0, 2.0, 3.0):
            assert_close(f(torch.full((2,), v, device=device)), torch.full((2,), 2 * v, device=device))
    assert seen == [2.0, 4.0, 6.0]  # the Python ran each time, with real values
    assert f.cache_info() == gt.CacheInfo(0, 0, 64, 0)
    with pytest.raises(gt.GraphifyError, match="item|reads a tensor's value"):
        f(torch.ones(2, device=device))  # outside the block: recorded again (and refused here)


def test_disable_nests_restores_after_an_exception_and_decorates(device):
    g = gt.graphify(lambda x: x + 1)
    x = torch.ones(2, device=device)
    with gt.disable():
        with gt.disable():
            g(x)
        g(x)  # still off after the inner block
        assert g.cache_info().misses == 0
    with pytest.raises(ValueError), gt.disable():
        raise ValueError
    g(x)
    assert g.cache_info().misses == 1  # on again

    @gt.disable()
    def debug(y):
        return g(y)

    debug(x)
    assert g.cache_info().misses == 1 and g.cache_info().hits == 0


def test_disable_acts_in_its_own_thread_only():
    g = gt.graphify(lambda x: x + 1)
    x = torch.ones(2)
    entered, release = threading.Event(), threading.Event()

    def debugging():
        with gt.disable():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=debugging)
    t.start()
    entered.wait(10)
    try:
        for _ in range(2):
            g(x)
    finally:
        release.set()
        t.join()
    assert g.cache_info().misses == 1 and g.cache_info().hits == 1


def test_environment_variable_disables_every_graphified_function():
    code = (
        "import torch, gtransform as gt\n"
        "f = gt.graphify(lambda x: x * float(x.sum()))\n"  # a host read: fine eagerly
        "print(f(torch.ones(2)).tolist(), f.cache_info().misses)\n"
    )
    env = dict(os.environ, GTRANSFORM_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[2.0,", "2.0]", "0"]
    env["GTRANSFORM_DISABLE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "GraphifyError" in out.stderr


def test_disable_decorates_without_parentheses_and_explain_says_calls_run_eagerly():
    f = gt.graphify(lambda x: x * 2)

    @gt.disable
    def plain(x):
        return f(x)

    assert torch.equal(plain(torch.ones(2)), torch.full((2,), 2.0))
    assert f.cache_info().misses == 0
    with gt.disable():
        assert "runs eagerly here" in f.explain(torch.ones(2))
    with pytest.raises(TypeError, match="expected a function to decorate"):
        gt.disable(3)

"""torch's global settings changed inside a graphified function.

A block that switches the default dtype for a few lines is traced under each dtype in
turn: its factory ops name the dtype they used. A function that leaves a setting
changed when it returns is refused (eager changes it on every call, a replay never).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import assert_close

import gtransform as gt


@contextlib.contextmanager
def _default_dtype(dt):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def test_a_block_that_switches_the_default_dtype_inside_makes_its_tensors_in_that_dtype(device):
    def f(x):
        with _default_dtype(torch.float64):
            grid = torch.linspace(0, 1, 7, device=device) ** 3 + torch.full((7,), 1e-9, device=device)
            ones = torch.ones(7, device=device)
        return x + grid.to(x.dtype), grid.dtype, (grid * ones).sum()

    g = gt.graphify(f)
    x = torch.randn(7, device=device)
    for _ in range(3):
        assert_close(g(x), f(x))


def test_the_default_dtype_set_part_way_and_put_back_gives_eagers_dtypes(device):
    def f(x):
        r = x.view(1, 3) @ torch.ones(3, 3, device=device)
        with _default_dtype(torch.float64):
            s = torch.ones(1, device=device)
        return r, s, torch.zeros(2, device=device)

    g = gt.graphify(f)
    x = torch.randn(3, device=device)
    for _ in range(3):
        assert_close(g(x), f(x))


_SETTERS = {
    "default_dtype": (lambda: torch.set_default_dtype(torch.float64), "torch.set_default_dtype(torch.float64)"),
    "grad": (lambda: torch.set_grad_enabled(False), "torch.set_grad_enabled(False)"),
    "deterministic": (lambda: torch.use_deterministic_algorithms(True), "torch.use_deterministic_algorithms(True"),
    "autocast": (lambda: torch.set_autocast_enabled("cpu", True), "torch.set_autocast_enabled('cpu'"),
}


@pytest.mark.parametrize("setting", sorted(_SETTERS))
def test_a_function_that_leaves_a_global_setting_changed_is_refused_and_the_setting_put_back(setting):
    setter, named = _SETTERS[setting]
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
              torch.is_autocast_enabled("cpu"))

    def f(x):
        y = x * 2
        setter()
        return y + 1

    try:
        with pytest.raises(gt.GraphifyError, match=r"(?s)leaves " + __import__("re").escape(named)
                           + r".*Why: eager sets it on every call.*Fix: set it outside"):
            gt.graphify(f)(torch.randn(3))
        after = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled(),
                 torch.is_autocast_enabled("cpu"))
        assert after == before
    finally:
        torch.set_default_dtype(before[0])
        torch.set_grad_enabled(before[1])
        torch.use_deterministic_algorithms(before[2])
        torch.set_autocast_enabled("cpu", before[3])


def test_a_setting_the_first_eager_call_left_is_not_refused_when_the_caller_keeps_it():
    # a function touching state runs eagerly first (which sets the dtype, as eager does); the
    # next call starts under that dtype, so the function changes nothing any more
    lin = torch.nn.Linear(3, 3)
    old = torch.get_default_dtype()

    def f(x):
        torch.set_default_dtype(torch.float64)
        return lin(x) + torch.ones(3, dtype=torch.float32)

    try:
        g = gt.graphify(f)
        x = torch.randn(2, 3)
        for _ in range(3):
            assert_close(g(x), f(x))
    finally:
        torch.set_default_dtype(old)


def test_the_attention_kernels_sdpa_kernel_allows_are_part_of_the_signature(device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    g = gt.graphify(f)
    q, k, v = (torch.randn(2, 4, 16, 32, device=device) for _ in range(3))
    backends = [None, SDPBackend.MATH, None, SDPBackend.MATH]
    for b in backends:
        with contextlib.ExitStack() as stack:
            if b is not None:
                stack.enter_context(sdpa_kernel(b))
            want, got = f(q, k, v), g(q, k, v)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # (the very kernel eager picks)
    with sdpa_kernel(SDPBackend.MATH):
        g(q, k, v)
    assert "scaled_dot_product_attention's" in g.explain(q, k, v)  # (called outside the block now)

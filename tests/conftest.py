"""Shared fixtures: devices (CPU always, CUDA under the `cuda` marker), tolerances,
and a deterministic hypothesis profile."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import gtransform._fastpath

# a fast path that cannot be built is a bug, not a slow path: fail the test that meets it
gtransform._fastpath.STRICT = True

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def tol(dtype: torch.dtype) -> dict:
    """rtol/atol for comparing against eager, per dtype (exact for ints and bools)."""
    rtol, atol = _TOL.get(dtype, (0.0, 0.0))
    return {"rtol": rtol, "atol": atol}


def assert_close(actual, expected) -> None:
    """Structural + numerical equality of two pytrees (tensors within dtype tolerance)."""
    import optree

    la, sa = optree.tree_flatten(actual, none_is_leaf=False, namespace="gtransform")
    le, se = optree.tree_flatten(expected, none_is_leaf=False, namespace="gtransform")
    assert sa == se, f"tree structure differs: {sa} vs {se}"
    for a, e in zip(la, le):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a)}"
            assert a.shape == e.shape and a.dtype == e.dtype and a.device == e.device, (a, e)
            torch.testing.assert_close(a, e, equal_nan=True, **tol(e.dtype))
        else:
            assert a == e or (a != a and e != e), (a, e)


def stale(name: str = "") -> str:
    """A ``pytest.raises(..., match=)`` pattern for an OverwrittenOutputError.

    The message names the function whose output went stale (``name``, if given)
    and the fix (``.clone()`` it), as DESIGN semantics 4 requires.
    """
    import re

    return "(?s)" + (re.escape(name) + ".*" if name else "") + r"\.clone\(\)"


def line_of(fn, marker: str) -> int:
    """Absolute line number of the source line of ``fn`` that contains ``marker``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if marker in line:
            return start + i
    raise AssertionError(f"{marker!r} not in {fn.__name__}")


def pytest_report_header(config):  # noqa: D103 - which gtransform is under test (planted copies via PYTHONPATH)
    import gtransform

    return f"gtransform: {os.path.dirname(gtransform.__file__)}"

"""Python values bound to the names a function reaches are part of its signature.

A number, string or None in a global, a closure cell, a ``functools.partial`` keyword or an
attribute of the user's own class, read by the function (or by the user-written ``forward``
of a module it reaches), is what eager reads at every call: rebinding it between calls must
give eager's numbers, as TorchDynamo's guards do, never the value the trace froze.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import gtransform as gt

TEMPERATURE = 1.0
MODE = "sum"
CALLS = 0


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) / TEMPERATURE


class _Cfg:
    scale = 2.0

    @classmethod
    def apply(cls, x):
        return x * cls.scale


def test_a_global_number_rebound_between_calls_is_read_again(device):
    global TEMPERATURE
    torch.manual_seed(0)
    m = _Scaled().to(device)
    f = gt.graphify(m)
    x = torch.randn(2, 3, device=device)
    try:
        with torch.no_grad():
            for t in (1.0, 1.0, 2.0, 2.0, 0.5, 1.0):
                TEMPERATURE = t
                assert_close(f(x), m(x))
    finally:
        TEMPERATURE = 1.0
    assert "TEMPERATURE" in f.describe()


def test_a_global_string_picks_the_branch_eager_takes(device):
    global MODE

    def fn(x):
        return x.sum() if MODE == "sum" else x.mean()

    f = gt.graphify(fn)
    x = torch.arange(4.0, device=device)
    got, want = [], []
    try:
        for mode in ("sum", "sum", "mean", "mean", "sum"):
            MODE = mode
            got.append(f(x).clone())
            want.append(fn(x))
    finally:
        MODE = "sum"
    assert_close(got, want)


def test_a_closure_variable_rebound_with_nonlocal_and_a_partial_keyword(device):
    import functools

    shift = 0.0

    def fn(x, power=1):
        return (x + shift) ** power

    def set_shift(v):
        nonlocal shift
        shift = v

    p = functools.partial(fn, power=1)
    f = gt.graphify(p)
    x = torch.arange(3.0, device=device)
    out, want = [], []
    for s, power in ((0.0, 1), (1.0, 1), (1.0, 2), (-1.0, 3)):
        set_shift(s)
        p.keywords["power"] = power
        out += [f(x).clone(), f(x).clone()]
        want += [p(x), p(x)]
    assert_close(out, want)


def test_a_class_attribute_read_through_cls_in_a_classmethod(device):
    f = gt.graphify(_Cfg.apply)
    x = torch.ones(2, device=device)
    try:
        for s in (2.0, 3.0, 3.0):
            _Cfg.scale = s
            assert_close(f(x), _Cfg.apply(x))
    finally:
        _Cfg.scale = 2.0


def test_an_equal_value_of_another_type_is_another_signature(device):
    # 1.0 == True in Python, but int64 * 1.0 is float and int64 * True stays int64
    k = 1.0

    def fn(x):
        return x * k

    f = gt.graphify(fn)
    x = torch.arange(3, device=device)
    assert f(x).dtype == torch.float32
    k = True
    assert f(x).dtype == torch.int64
    assert_close(f(x), fn(x))


def test_a_counter_the_function_bumps_is_eagers_with_a_warning_naming_it(device):
    global CALLS
    CALLS = 0

    def fn(x):
        global CALLS
        CALLS += 1
        return x * 2

    f = gt.graphify(fn)
    x = torch.ones(2, device=device)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(12):
                assert_close(f(x), x * 2)
        assert CALLS == 12  # eager's count, not the trace's single increment
        texts = [str(m.message) for m in w if issubclass(m.category, gt.RerecordWarning)]
        assert texts and "CALLS" in texts[0] and "pass it as an argument" in texts[0]
    finally:
        CALLS = 0


def test_explain_names_the_value():
    k = 2.0

    def fn(x):
        return x * k

    f = gt.graphify(fn)
    x = torch.ones(2)
    f(x)
    k = 3.0
    assert "k is 3.0 now (traced with 2.0" in f.explain(x)
    assert_close(f(x), fn(x))


@given(st.lists(st.sampled_from([0.5, 1.0, 2.0, -1.0, 1, True, None]), min_size=1, max_size=8))
def test_any_sequence_of_rebindings_gives_eagers_numbers(values):
    c = None

    def fn(x):
        return x if c is None else x * c

    f = gt.graphify(fn)
    x = torch.arange(1, 4)
    for c in values:  # noqa: B007 (rebinds the closure variable fn reads)
        got, want = f(x), fn(x)
        assert got.dtype == want.dtype
        assert_close(got, want)


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_both_paths_check_the_value(path, monkeypatch):
    import gtransform._replay as replay

    if path == "generic":
        monkeypatch.setattr(replay, "_install_fast_path", lambda *a: None)
    k = 1.0

    def fn(x):
        return x + k

    f = gt.graphify(fn)
    x = torch.zeros(2)
    outs = []
    for k in (1.0, 1.0, 1.0, 5.0, 5.0, 1.0):  # noqa: B007
        outs.append(f(x).clone())
    assert [o[0].item() for o in outs] == [1.0, 1.0, 1.0, 5.0, 5.0, 1.0]


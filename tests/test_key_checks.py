"""Every check of the signature (``gtransform._key._checks.CHECKS``) guards something.

For each check, a scenario makes calls that differ only in what the check guards and
requires eager's numbers (or, where eager's would be unsafe to record, a GraphifyError),
through the generated fast path and through the generic path (fast paths off). Each
scenario is also run with its check's guard lines removed (a mutation of the code): it
must then fail on at least one path, so that no check is dead weight, and a new check
without a scenario fails ``test_every_check_has_a_scenario``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt
import gtransform._replay as replay
from gtransform._key import _checks
from gtransform._key._codegen import FAIL

_RAISED = "raised GraphifyError"


def _eager(fn=None, **_kw):
    return (lambda f: f) if fn is None else fn


def _graphify(fn, **kw):
    """gt.graphify, its outputs kept (a scenario compares every call's outputs at the end)."""
    import optree

    g = gt.graphify(fn, **kw)

    def call(*a, **k):
        out = g(*a, **k)
        return optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out,
                               none_is_leaf=True, namespace="gtransform")

    call.g = g
    return call


def _call(f, *a, **k):
    try:
        return f(*a, **k)
    except gt.GraphifyError:
        return _RAISED


def _structure(graphify, device):
    f = graphify(lambda d: [v * (i + 1) for i, v in enumerate(d.values())] + [d.get("b", 0) * 10])
    x, y = torch.ones(2, device=device), torch.full((2,), 2.0, device=device)
    out = [f({"a": x, "b": y}) for _ in range(3)]
    out.append(f({"a": x, "c": y}))  # another key
    out.append(f({"b": y, "a": x}))  # the same keys in another order
    return out


def _static_arguments(graphify, device):
    f = graphify(lambda x, k: x * k, static_argnums=1)
    x = torch.ones(2, device=device)
    return [f(x, 2) for _ in range(3)] + [f(x, 3)]


def _global_settings(graphify, device):
    f = graphify(lambda x: x * (2 if torch.is_grad_enabled() else 3))
    x = torch.ones(2, device=device)
    with torch.no_grad():
        out = [f(x) for _ in range(3)]
    return out + [f(x)]


def _static_values(graphify, device):
    f = graphify(lambda x, k: torch.full_like(x, 1) * k if k == k else x - 1)
    x = torch.ones(2, device=device)
    out = [f(x, float("nan")) for _ in range(3)] + [f(x, 5.0)]  # the inverted NaN guard
    out += [f(x, 2) for _ in range(3)] + [f(x, 2.0), f(x, True)]
    return [(o, o.dtype) for o in out]


def _state(graphify, device):
    torch.manual_seed(0)
    m = nn.Linear(3, 2).to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()

    f = graphify(step)
    x = torch.ones(4, 3, device=device)
    out = []
    for _ in range(3):
        f(x)
        out.append(m.weight.detach().clone())
    # a new parameter object the optimizer does not hold: eager fills its .grad, steps the old one
    m.weight = nn.Parameter(torch.full((2, 3), 0.5, device=device))
    f(x)
    out += [m.weight.detach().clone(), m.weight.grad]
    return out


def _frozen_reads(graphify, device):
    # host reads of a closed-over tensor and of an argument passed as the same object: frozen
    # into the recording; written in place, or another object passed, they are read again
    t = torch.linspace(0, 1, 5, device=device)
    f = graphify(lambda x, idx: x * t.sum().item() + x[idx[idx > 0]].sum())
    x = torch.ones(4, device=device)
    idx = torch.tensor([0, 1, 2, 3], device=device)
    out = [f(x, idx) for _ in range(3)]
    t.mul_(2)
    out += [f(x, idx) for _ in range(3)]
    idx = torch.tensor([0, 0, 3, 0], device=device)
    out += [f(x, idx) for _ in range(3)]
    return out


SCALE = 2.0


def _python_values(graphify, device):
    # a global number, a closure cell and a partial keyword the function names, each rebound
    # between calls: eager reads them at every call (TorchDynamo guards them)
    global SCALE
    SCALE = 2.0
    shift = 1.0

    def fn(x, power=1):
        return x * SCALE + shift**power

    def set_shift(v):
        nonlocal shift
        shift = v

    import functools

    p = functools.partial(fn, power=1)
    f = graphify(p)
    x = torch.ones(3, device=device)
    out = [f(x) for _ in range(2)]
    SCALE = 3.0
    out += [f(x) for _ in range(2)]
    set_shift(2.0)
    out += [f(x) for _ in range(2)]
    p.keywords["power"] = 2
    out += [f(x) for _ in range(2)]
    i = torch.ones(3, device=device, dtype=torch.int64)
    SCALE = 1.0
    out += [f(i) for _ in range(2)]
    SCALE = True  # (equal to 1.0, another type: an int64 result in eager, not a float one)
    out += [f(i) for _ in range(2)]
    return out


def _absent_grads(graphify, device):
    torch.manual_seed(0)
    m = nn.Linear(3, 2).to(device)

    def step(x):
        m(x).square().sum().backward()  # accumulates into .grad

    f = graphify(step)
    x = torch.ones(4, 3, device=device)
    out = []
    for _ in range(3):
        m.zero_grad(set_to_none=True)
        f(x)
        out.append(m.weight.grad.clone())
    f(x)  # a .grad is there now: eager adds to it
    return out + [m.weight.grad.clone()]


def _same_objects(graphify, device):
    f = graphify(lambda a, b: a + b * 2 if a is b else a - b)
    x, y = torch.ones(2, device=device), torch.full((2,), 3.0, device=device)
    return [f(x, x) for _ in range(3)] + [f(x, y)]


def _aliasing(graphify, device):
    def fn(a, b):
        a.mul_(2)
        return a + b  # b sees a's update where they share memory

    f = graphify(fn)
    out = []
    for _ in range(3):
        a, b = torch.ones(3, device=device), torch.ones(3, device=device)
        out.append(f(a, b))
    x = torch.ones(4, device=device)
    out.append(f(x[:3], x[1:]))  # eager: [4, 4, 3]; a recording of distinct inputs: [3, 3, 3]
    return out + [x]


def _tensors(graphify, device):
    f = graphify(lambda x: x * 2)
    out = [f(torch.ones(2, device=device)) for _ in range(3)]
    g = f(torch.ones(2, device=device, dtype=torch.float64))
    return [(o, o.dtype) for o in out] + [(g, g.dtype)]


def _environment(graphify, device):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(device)
    f = graphify(lambda x: m(x))
    x = torch.randn(4, 3, device=device)
    m.eval()
    with torch.no_grad():
        out = [f(x) for _ in range(3)]
        m.train()
        out.append(f(x))
    return out


def _tensor_attributes(graphify, device):
    f = graphify(lambda x: x * x.scale)
    x = torch.ones(2, device=device)
    x.scale = 2.0
    out = [f(x) for _ in range(3)]
    x.scale = 3.0
    return out + [f(x)]


def _grads_read(graphify, device):
    f = graphify(lambda x: x * (2 if x.grad is None else 3))
    x = torch.ones(2, device=device, requires_grad=True)
    with torch.no_grad():
        out = [f(x) for _ in range(3)]
        x.grad = torch.ones(2, device=device)
        return out + [_call(f, x)]  # refused: the recording cannot read .grad (eager's: x * 3)


def _layouts_read(graphify, device):
    f = graphify(lambda x: x * x.storage_offset())
    base = torch.ones(8, device=device)
    out = [f(torch.ones(4, device=device)) for _ in range(3)]
    return out + [_call(f, base[2:6])]  # refused: a view of a larger storage (eager's: x * 2)


def _leafness_read(graphify, device):
    f = graphify(lambda x: x * (2 if x.is_leaf else 3))
    with torch.no_grad():
        leaf = torch.ones(2, device=device, requires_grad=True)
        out = [f(leaf) for _ in range(3)]
    nonleaf = torch.ones(2, device=device, requires_grad=True) * 1
    with torch.no_grad():
        out.append(f(nonleaf))
    return out


def _attention_backends(graphify, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q):  # (what the flags pick, made visible: the kernels themselves differ by rounding only)
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return o * (2 if not torch.backends.cuda.flash_sdp_enabled() else 1)

    f = graphify(fn)
    q = torch.ones(1, 1, 4, 8, device=device)
    out = [f(q) for _ in range(3)]
    with sdpa_kernel(SDPBackend.MATH):
        out.append(f(q))
    return out


SCENARIOS = {
    "attention backends": _attention_backends,
    "structure": _structure,
    "static arguments": _static_arguments,
    "global settings": _global_settings,
    "static values": _static_values,
    "state": _state,
    "frozen reads": _frozen_reads,
    "Python values": _python_values,
    "absent grads": _absent_grads,
    "same objects": _same_objects,
    "aliasing": _aliasing,
    "tensors": _tensors,
    "environment": _environment,
    "tensor attributes": _tensor_attributes,
    "grads read": _grads_read,
    "layouts read": _layouts_read,
    "leafness read": _leafness_read,
}
# refusal scenarios: where a call cannot be recorded, eager's numbers are replaced by the refusal
_REFUSED_LAST = {"grads read", "layouts read"}


def _expected(name, device):
    want = SCENARIOS[name](_eager, device)
    if name in _REFUSED_LAST:
        want[-1] = _RAISED
    return want


def _same(got, want) -> bool:
    try:
        assert_close(got, want)
        return True
    except AssertionError:
        return False


@pytest.fixture(params=["fast", "generic"])
def path(request, monkeypatch):
    if request.param == "generic":  # no fast path: every call matches through Entry.match
        monkeypatch.setattr(replay, "_install_fast_path", lambda *a: None)
    return request.param


def test_every_check_has_a_scenario():
    assert sorted(c.name for c in _checks.CHECKS) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_call_that_differs_only_in_what_a_check_guards_is_eagers(device, path, name):
    assert_close(SCENARIOS[name](_graphify, device), _expected(name, device))


def _without_guard(check):
    code = check.code

    def unguarded(e, names):
        return [line for line in code(e, names) if FAIL not in line]

    return dataclasses.replace(check, code=unguarded)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_check_is_what_keeps_its_scenario_right(device, name, monkeypatch):
    """Its guard lines removed, the check's scenario gives other numbers (or no refusal) on a path."""
    want = _expected(name, device)
    k = next(i for i, c in enumerate(_checks.CHECKS) if c.name == name)
    check = _checks.CHECKS[k]
    _checks.CHECKS[k] = _without_guard(check)
    wrong = []
    try:
        for p in ("fast", "generic"):
            with monkeypatch.context() as m:
                if p == "generic":
                    m.setattr(replay, "_install_fast_path", lambda *a: None)
                try:
                    wrong.append(not _same(SCENARIOS[name](_graphify, device), want))
                except Exception:
                    wrong.append(True)
    finally:
        _checks.CHECKS[k] = check
    assert any(wrong), f"the {name!r} check's scenario stays right without the check: it guards nothing there"

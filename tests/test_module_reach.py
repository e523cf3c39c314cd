"""What a module reaches besides its parameters and buffers: plain containers and objects
among its attributes, and the globals of a user-written forward. Tensors there are state
(a new tensor put there is seen); tensors the trace stores there are written back on every
call, never left as the trace's stand-ins. And inputs that overlap in memory."""

import types

import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt

MASK = torch.ones(3)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.masks = [torch.ones(3)]
        self.table = {"w": torch.ones(3)}
        self.ns = types.SimpleNamespace(scale=torch.ones(3))

    def forward(self, x):
        return self.lin(x) * MASK * self.masks[0] * self.table["w"] * self.ns.scale


def test_tensors_replaced_in_a_modules_containers_and_globals_are_seen(device):
    global MASK
    torch.manual_seed(0)
    m = Masked().to(device)
    MASK = torch.ones(3, device=device)
    m.masks[0] = m.masks[0].to(device)
    m.table["w"] = m.table["w"].to(device)
    m.ns.scale = m.ns.scale.to(device)
    g = gt.graphify(m)
    x = torch.randn(2, 3, device=device)
    try:
        with torch.no_grad():
            for _ in range(5):
                assert_close(g(x), m(x))
                MASK = MASK * 2
                m.masks[0] = m.masks[0] * 3
                m.table["w"] = m.table["w"] + 1
                m.ns.scale = m.ns.scale * 0.5
    finally:
        MASK = torch.ones(3)


class LazyPositions(nn.Module):
    """A cache filled inside forward (the pattern of rotary-embedding tables)."""

    def __init__(self):
        super().__init__()
        self.cache = {}

    def forward(self, x):
        n = x.shape[-1]
        if n not in self.cache:
            self.cache[n] = torch.arange(n, dtype=x.dtype, device=x.device)
        return x + self.cache[n]


def test_a_cache_filled_during_the_trace_holds_real_tensors(device):
    m = LazyPositions()
    g = gt.graphify(m)
    for n in (4, 4, 6, 4):
        x = torch.randn(2, n, device=device)
        assert_close(g(x), x + torch.arange(n, dtype=x.dtype, device=device))
        for v in m.cache.values():
            assert type(v) is torch.Tensor
        # the module still works eagerly
        assert_close(m(x), x + torch.arange(n, dtype=x.dtype, device=device))


class Running(nn.Module):
    """Running state kept in a plain list attribute, updated by assignment."""

    def __init__(self):
        super().__init__()
        self.state = [torch.zeros(3)]

    def forward(self, x):
        self.state[0] = self.state[0] * 0.5 + x
        return self.state[0] * 2


def test_running_state_in_a_list_attribute_follows_eager(device):
    a, b = Running(), Running()
    a.state[0] = a.state[0].to(device)
    b.state[0] = b.state[0].to(device)
    g = gt.graphify(b)
    for k in range(5):
        x = torch.full((3,), float(k), device=device)
        assert_close(g(x), a(x))
        assert_close(b.state[0], a.state[0])
        assert type(b.state[0]) is torch.Tensor


def test_inputs_that_overlap_only_on_some_calls_are_separate_signatures(device):
    def fn(a, b):
        a.mul_(2)
        return a + b

    g = gt.graphify(fn)
    t = torch.arange(6.0, device=device) + 1
    g(t[0:4], t[2:6].clone())  # recorded with inputs that do not share memory
    for _ in range(2):
        t1 = torch.arange(6.0, device=device) + 1
        t2 = t1.clone()
        want = fn(t1[0:4], t1[2:6])
        got = g(t2[0:4], t2[2:6])  # now they overlap: the update through a shows in b
        assert_close(got, want)
        assert_close(t2, t1)


def test_an_input_and_its_transpose_updated_in_place(device):
    def fn(a, b):
        a.add_(1)
        return b.clone()

    g = gt.graphify(fn)
    g(torch.zeros(3, 3, device=device), torch.zeros(3, 3, device=device))
    for _ in range(2):
        s1 = torch.zeros(3, 3, device=device)
        s2 = s1.clone()
        assert_close(g(s2, s2.T), fn(s1, s1.T))


class Cfg:
    scale = torch.ones(3)


class Helper:
    @staticmethod
    def mul(x):
        return x * MASK


NS = types.ModuleType("gt_test_namespace")
NS.W = torch.ones(3)


class Scaler:
    def __init__(self):
        self.fn = lambda x: x * MASK

    def __call__(self, x):
        return self.fn(x)


def test_tensors_replaced_in_classes_python_modules_and_helpers_are_seen(device):
    global MASK
    saved = (MASK, Cfg.scale, NS.W)
    cases = {
        "class attribute": lambda x: x * Cfg.scale,
        "python module attribute": lambda x: x * NS.W,
        "static method's global": lambda x: Helper.mul(x),
        "callable object's function's global": Scaler(),
    }
    try:
        for fn in cases.values():
            MASK, Cfg.scale, NS.W = (torch.ones(3, device=device) for _ in range(3))
            g = gt.graphify(fn)
            x = torch.randn(3, device=device)
            for _ in range(4):
                assert_close(g(x), fn(x))
                MASK, Cfg.scale, NS.W = MASK * 2, Cfg.scale * 3, NS.W + 1
    finally:
        MASK, Cfg.scale, NS.W = saved

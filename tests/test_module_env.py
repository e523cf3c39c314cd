"""What a module carries besides tensors, changed between calls: the next call records again
and matches eager, never replays the old value.

Attributes of any value type the trace read (enums, dtypes, functions, lists, complex and
numpy numbers, long tuples), attributes that were absent (``getattr(self, "x", default)``) and
class attributes; parameter and buffer slots that were None, or tied and then untied; container
attributes rebound; closed-over lists and dicts of tensors that grow; modules the function
calls without the roots leading to them; lists a forward hook appends to.
"""

import enum
import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close

import gtransform as gt


class Mode(enum.Enum):
    A = 1
    B = 2


class Knobs(nn.Module):
    cls_scale = 1.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mode = Mode.A
        self.dt = torch.float32
        self.act = F.relu
        self.perm = [0, 1]
        self.c = 1 + 0j
        self.npf = np.float32(1.0)
        self.long = tuple([1.0] * 20)

    def forward(self, x):
        y = self.lin(x).to(self.dt).float()
        y = self.act(y).permute(*self.perm)
        y = y * (3 if self.mode is Mode.B else 1) * self.c.real * float(self.npf) * self.long[-1]
        return y * getattr(self, "extra", 1.0) * self.cls_scale


CHANGES = {
    "enum": lambda m: setattr(m, "mode", Mode.B),
    "dtype": lambda m: setattr(m, "dt", torch.bfloat16),
    "function": lambda m: setattr(m, "act", torch.tanh),
    "list rebound": lambda m: setattr(m, "perm", [1, 0]),
    "complex": lambda m: setattr(m, "c", 2 + 0j),
    "numpy": lambda m: setattr(m, "npf", np.float32(2.0)),
    "long tuple": lambda m: setattr(m, "long", tuple([2.0] * 20)),
    "absent attribute set": lambda m: setattr(m, "extra", 2.0),
    "class attribute": lambda m: setattr(Knobs, "cls_scale", 2.0),
    "class attribute shadowed": lambda m: setattr(m, "cls_scale", 3.0),
    "forward replaced": lambda m: setattr(m, "forward", lambda x: m.lin(x) * 5),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("how", ["closure", "module"])
def test_a_module_attribute_of_any_value_type_changed_between_calls_records_again(change, how):
    torch.manual_seed(0)
    m = Knobs()
    g = gt.graphify(m) if how == "module" else gt.graphify(lambda x: m(x))
    x = torch.randn(4, 4)
    try:
        with torch.no_grad():
            for _ in range(3):
                assert_close(g(x), m(x))
            CHANGES[change](m)
            for _ in range(2):
                assert_close(g(x), m(x))
    finally:
        Knobs.cls_scale = 1.0


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.register_parameter("extra", None)
        self.register_buffer("mask", None)

    def forward(self, x):
        y = self.b(self.a(x))
        if self.extra is not None:
            y = y + self.extra
        if self.mask is not None:
            y = y * self.mask
        if hasattr(self, "late"):
            y = y - self.late
        return y


SLOT_CHANGES = {
    "untie": lambda m: setattr(m.b, "weight", nn.Parameter(m.a.weight.detach().clone() * 2)),
    "optional parameter set": lambda m: setattr(m, "extra", nn.Parameter(torch.full((3,), 10.0))),
    "optional buffer set": lambda m: setattr(m, "mask", torch.tensor([1.0, 0.0, 2.0])),
    "buffer registered later": lambda m: m.register_buffer("late", torch.ones(3)),
}


@pytest.mark.parametrize("change", list(SLOT_CHANGES))
def test_parameter_and_buffer_slots_set_or_untied_between_calls_record_again(change):
    torch.manual_seed(0)
    m = Tied()
    m.b.weight = m.a.weight  # tied
    g = gt.graphify(m)
    x = torch.randn(2, 3)
    for _ in range(3):
        out = g(x)
        out.sum().backward()
    SLOT_CHANGES[change](m)
    for _ in range(2):
        m.zero_grad()
        out = g(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        ref = m.forward(x)  # eager, the same module
        ref.sum().backward()
        assert_close(out, ref)
        for gr, p in zip(grads, m.parameters()):
            assert_close(gr, p.grad)


class Holder(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.c = self._make(torch.ones(3), torch.ones(3))

    def _make(self, a, b):
        return {"tuple": (a, b), "list": [a, b], "dict": {"a": a, "b": b}}[self.kind]

    def forward(self, x):
        a, b = (self.c["a"], self.c["b"]) if isinstance(self.c, dict) else self.c
        return x * a + b


@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_a_container_attribute_rebound_is_seen(kind):
    m = Holder(kind)
    g = gt.graphify(m)
    x = torch.ones(3)
    for _ in range(2):
        assert_close(g(x), m.forward(x))
    m.c = m._make(torch.full((3,), 2.0), torch.full((3,), -1.0))
    for _ in range(2):
        assert_close(g(x), m.forward(x))


def test_closed_over_containers_of_tensors_that_grow_are_seen():
    ts = [torch.ones(2)]
    d = {"a": torch.ones(2)}

    class Obj:
        pass

    o = Obj()
    o.ts = [torch.ones(2)]

    def f(x):
        return x * sum(ts) * sum(d.values()) * sum(o.ts)

    g = gt.graphify(f)
    x = torch.ones(2)
    for i in range(6):
        if i == 2:
            ts.append(torch.full((2,), 2.0))
        if i == 3:
            d["b"] = torch.full((2,), 3.0)
        if i == 4:
            o.ts = [torch.full((2,), 5.0)]
        assert_close(g(x), f(x))


def test_modules_the_roots_do_not_lead_to_keep_their_training_flag_in_the_signature():
    torch.manual_seed(0)
    drop = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval()
    held = functools.partial(lambda mod, x: mod(x), drop)  # the module is inside a partial
    deep = {"a": {"b": {"c": drop}}}

    for fn in (lambda x: held(x), lambda x: deep["a"]["b"]["c"](x)):
        g = gt.graphify(fn)
        x = torch.ones(4, 8)
        with torch.no_grad():
            for _ in range(2):
                assert_close(g(x), fn(x))
            drop.train()
            torch.manual_seed(3)
            out = g(x).clone()
            torch.manual_seed(3)
            assert_close(out, fn(x))
            assert (out == 0).any()  # dropout runs
            drop.eval()


def test_a_forward_hook_that_stores_activations_is_refused_and_leaves_the_list_as_it_was():
    acts = []
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    m[1].register_forward_hook(lambda mod, inp, out: acts.append(out.detach()))
    g = gt.graphify(lambda x: m(x))
    with pytest.raises(gt.GraphifyError, match=r"(?s)escapes into Python state: .*hook: acts.*Fix:"):
        g(torch.ones(2, 3))
    assert acts == []


def test_deterministic_algorithms_flag_is_part_of_the_signature():
    def f(x):
        return x * (2 if torch.are_deterministic_algorithms_enabled() else 3)

    g = gt.graphify(f)
    x = torch.ones(2)
    try:
        for i in range(6):
            torch.use_deterministic_algorithms(i % 4 >= 2)
            assert_close(g(x), f(x))
    finally:
        torch.use_deterministic_algorithms(False)
    assert g.cache_info().hits >= 2


def test_parameters_stay_swappable_after_graphify_and_the_swap_is_seen():
    """torch.utils.swap_tensors and module.to() with swap_module_params_on_conversion refuse a
    tensor with a weak reference: before, the trace's converter (and the hook wrapper) kept one."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    f = gt.graphify(lambda x: m(x))
    for _ in range(3):
        f(x)
    h = m.weight.register_hook(lambda g: g)
    torch.utils.swap_tensors(m.weight, nn.Parameter(torch.randn(2, 3)))
    for _ in range(2):
        assert_close(f(x), m(x))
    h.remove()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for _ in range(2):
        assert_close(f(x.double()), m(x.double()))


@pytest.mark.parametrize("table", ["parameter", "buffer"])
def test_a_parameter_or_buffer_registered_between_calls_is_seen_where_the_function_iterates_them(device, table):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            out = self.fc(x)
            if table == "parameter":  # a weight penalty over every parameter
                return out.sum() + 0.01 * sum(p.square().sum() for p in self.parameters())
            for _, b in self.named_buffers():  # every buffer scales the output
                out = out * b
            return out

    net = Net().to(device)
    f = gt.graphify(net)
    x = torch.randn(3, 4, device=device)
    for _ in range(2):
        assert_close(f(x), net(x))
    if table == "parameter":
        net.register_parameter("extra", nn.Parameter(torch.full((2,), 3.0, device=device)))
    else:
        net.register_buffer("scale", torch.full((2,), 3.0, device=device))
    for _ in range(3):
        assert_close(f(x), net(x))


def test_a_class_attribute_read_through_a_plain_object_is_part_of_the_signature():
    class Scaler:
        scale = 3.0  # (only the class sets it)

        def __init__(self):
            self.bias = torch.ones(2)

        def __call__(self, x):
            return x * self.scale + self.bias

    s = Scaler()
    f = gt.graphify(lambda x: s(x))
    x = torch.ones(2)
    for v in (3.0, 3.0, 5.0, 5.0, 2.0):
        Scaler.scale = v
        assert_close(f(x), s(x))


def test_a_dict_of_flags_in_a_reached_object_is_part_of_the_signature():
    # Hugging Face's EncoderDecoderCache.is_updated[layer]: the cross-attention keys are computed
    # on the first step after cache.reset(); the replays took the branch traced, silently
    class Cache:
        def __init__(self):
            self.is_updated = {0: False}
            self.buf = torch.zeros(3)

        def reset(self):
            self.is_updated[0] = False
            self.buf.zero_()

    def run(use):
        c = Cache()

        def step(x):
            if not c.is_updated[0]:
                c.buf.copy_(x * 10)
                c.is_updated[0] = True
            return x + c.buf

        f = gt.graphify(step) if use else step
        out = []
        for prompt in range(3):
            c.reset()
            for _ in range(3):
                out.append(f(torch.full((3,), float(prompt + 1))).clone())
        return out

    assert_close(run(True), run(False))

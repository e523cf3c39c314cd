"""Programs as users write them that a probe of the ninth session found wrong or refused.

Each test names what it did before: silent wrong numbers, an internal error, or a
refusal of something eager handles.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.testing import assert_close

import gtransform as gt


def test_backward_inside_filling_the_grad_of_an_argument_is_refused(device):
    """Before: `.grad` of a tensor argument stayed None on every call (SGD then skipped it)."""
    def step(w, x):
        loss = (x @ w).tanh().sum()
        loss.backward()
        return loss.detach()

    g = gt.graphify(step)
    w = nn.Parameter(torch.randn(4, 2, device=device))
    with pytest.raises(gt.GraphifyError) as ei:
        g(w, torch.randn(3, 4, device=device))
    msg = str(ei.value)
    assert "args[0].grad" in msg and "loss.backward()" in msg and "Fix: close over the parameters" in msg
    assert w.grad is None
    # closed over, the same step fills .grad as eager does
    g2 = gt.graphify(lambda x: step(w, x))
    we = nn.Parameter(w.detach().clone())
    for _ in range(3):
        x = torch.randn(3, 4, device=device)
        g2(x)
        step(we, x)
    assert_close(w.grad, we.grad)


def test_jacrev_of_jacrev_is_refused_not_zero(device):
    """Before: a zero Hessian, silently."""
    h = lambda x: (x.sin() * x.prod()).sum()  # noqa: E731
    g = gt.graphify(h)
    x = torch.randn(3, device=device)
    with pytest.raises(gt.GraphifyError, match="higher-order differentiation"):
        tf.jacrev(tf.jacrev(g))(x)
    assert_close(tf.jacrev(g)(x), tf.jacrev(h)(x))  # first order still works


def test_torch_func_grad_over_tensors_that_require_grad_stays_differentiable_or_refuses(device):
    """Before: tf.grad(graphify(f))(w) with w requiring grad gave a gradient that did not require
    grad: a backward through it (a gradient penalty) silently left its term out."""
    f = lambda w, x: ((x @ w) ** 2).sum()  # noqa: E731
    g = gt.graphify(f)
    w = torch.randn(3, requires_grad=True, device=device)
    for _ in range(3):
        x = torch.randn(4, 3, device=device)
        got, ref = tf.grad(g)(w, x), tf.grad(f)(w, x)
        assert_close(got, ref)
        assert got.requires_grad and ref.requires_grad
        with pytest.raises(gt.GraphifyError, match="higher-order differentiation"):
            got.sum().backward()
    # a closed-over parameter, grad over the input
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    pen = tf.grad(gt.graphify(lambda x: m(x).sum()))
    pen(torch.randn(2, 4, device=device)).pow(2).sum().backward()  # the first call runs eagerly
    for _ in range(2):
        out = pen(torch.randn(2, 4, device=device))
        assert out.requires_grad
        with pytest.raises(gt.GraphifyError, match="higher-order differentiation"):
            out.pow(2).sum().backward()


def test_a_gradient_penalty_inside_the_function_is_differentiated(device):
    """autograd.grad(create_graph=True) inside, parameters closed over (WGAN-GP). Before: from the
    second call the output no longer required grad and the penalty's term was left out of D's .grad."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    De = copy.deepcopy(D)

    def penalty(model, x):
        x = x.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        return gx.pow(2).sum()

    gp = gt.graphify(lambda x: penalty(D, x))
    for _ in range(4):
        x = torch.randn(2, 4, device=device)
        D.zero_grad()
        De.zero_grad()
        out = gp(x)
        assert out.requires_grad
        (D(x).sum() + out).backward()
        (De(x).sum() + penalty(De, x)).backward()
        for p, q in zip(D.parameters(), De.parameters()):
            assert_close(p.grad, q.grad)


@pytest.mark.parametrize("how", ["hook", "retain_grad"])
def test_hooks_on_a_reused_output_act_on_their_call(device, how):
    """Before: from the second call a hook registered on the handed-back object never ran, and
    retain_grad() kept the first call's gradient."""
    g = gt.graphify(lambda x: x.sin())
    for _ in range(4):
        x = torch.randn(3, device=device, requires_grad=True)
        xe = x.detach().clone().requires_grad_(True)
        outs = []
        for fn, inp in ((g, x), (torch.sin, xe)):
            o = fn(inp)
            if how == "hook":
                o.register_hook(lambda gr: -2 * gr)
            else:
                o.retain_grad()
            (o * o).sum().backward()
            outs.append(o.grad if how == "retain_grad" else None)
            del o
        assert_close(x.grad, xe.grad)
        if how == "retain_grad":
            assert_close(outs[0], outs[1])


def test_an_input_returned_after_being_fed_back_keeps_its_values(device):
    """`a, b = f(a, b)` with `return b, a + b`. Before: the returned `a` was the previous output,
    poisoned when the call began and overwritten by it (OverwrittenOutputError on touch)."""
    f = gt.graphify(lambda a, b: (b, a + b))
    ref = lambda a, b: (b, a + b)  # noqa: E731
    a = b = None
    a, b = torch.zeros(2, device=device), torch.ones(2, device=device)
    ra, rb = a.clone(), b.clone()
    for _ in range(6):
        a, b = f(a, b)
        ra, rb = ref(ra, rb)
        assert_close(a, ra)
        assert_close(b, rb)
    # the previous value kept next to the new one, and a view of a fed-back input
    s = {"x": torch.zeros(2, device=device)}
    step = gt.graphify(lambda s: {"x": s["x"] + 1, "prev": s["x"]})
    for k in range(4):
        s = step(s)
        assert_close(s["prev"], torch.full((2,), float(k), device=device))
    head = gt.graphify(lambda x: (x + 1, x[:1]))
    x = torch.zeros(2, device=device)
    for k in range(4):
        x, h = head(x)
        assert_close(h, torch.full((1,), float(k), device=device))


def test_one_output_fed_to_two_calls_of_another_function(device):
    """Before: from the second step every call of `dec` raised OverwrittenOutputError (CPU: the
    recording kept the first step's `z` object, read in place, which `enc` had poisoned)."""
    enc = gt.graphify(lambda x: x.tanh())
    dec = gt.graphify(lambda z, q: (z @ q).sum(-1))
    for _ in range(5):
        x = torch.randn(4, 4, device=device)
        q1, q2 = torch.randn(4, 2, device=device), torch.randn(4, 2, device=device)
        z = enc(x)
        assert_close(dec(z, q1), (x.tanh() @ q1).sum(-1))
        assert_close(dec(z, q2), (x.tanh() @ q2).sum(-1))
        del z


def test_a_tensor_read_in_place_is_the_one_at_the_recorded_address(device):
    """The recording reads the memory at the recorded address (a CUDA graph does): a tensor whose
    memory was swapped away (`w.data = ...`) and another one at its old address give eager's
    numbers. Before, on the CPU, the replay read the kept object's new memory."""
    f = gt.graphify(lambda w, x: x * w)
    x = torch.ones(64, device=device)
    w = torch.full((64,), 1.0, device=device)
    f(w, x)
    f(w, x)  # read in place from now on
    storage = w.untyped_storage()
    w.data = torch.full((64,), 5.0, device=device)
    v = torch.empty(0, device=device).set_(storage, 0, (64,), (1,))  # another tensor at the old address
    v.fill_(3.0)
    assert_close(f(v, x), x * v)
    assert_close(f(w, x), x * w)


def test_an_in_place_op_on_a_non_leaf_input_of_a_differentiated_call_says_what_to_do(device):
    """Before: torch's raw "a leaf Variable that requires grad is being used in an in-place
    operation" (the input is not a leaf) from inside the trace."""
    backbone = nn.Linear(4, 8).to(device)
    head = gt.graphify(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 2)).to(device))
    with pytest.raises(gt.GraphifyError) as ei:
        head(backbone(torch.randn(5, 4, device=device)))
    msg = str(ei.value)
    assert "in place" in msg and "args[0]" in msg and "inplace=False" in msg
    with torch.no_grad():  # still usable
        head(backbone(torch.randn(5, 4, device=device)))


def test_batched_gradients_through_a_graphified_function(device):
    """torch.autograd.grad(..., is_grads_batched=True). Before: NotImplementedError "Cannot access
    storage of BatchedTensorImpl" from gtransform's signature code."""
    h = lambda x: x.sin() * 2  # noqa: E731
    g = gt.graphify(h)
    for _ in range(3):
        x = torch.randn(3, device=device, requires_grad=True)
        v = torch.randn(5, 3, device=device)
        (got,) = torch.autograd.grad(g(x), x, v, is_grads_batched=True)
        (ref,) = torch.autograd.grad(h(x), x, v, is_grads_batched=True)
        assert_close(got, ref)


def test_cache_clear_while_other_threads_call(device):
    """Before: calls in other threads failed with an internal IndexError (their recording was
    closed under them). Now other threads release theirs at their next call."""
    f = gt.graphify(lambda x: (x @ x.T).sum(1))
    stop, errors = threading.Event(), []
    # (inputs drawn up front: an eager random op in one thread while another captures a CUDA
    # graph fails inside torch, "Offset increment outside graph capture")
    xs = [torch.randn(8, 8, device=device) for _ in range(16)]

    def work() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            x = xs[k % len(xs)]
            try:
                r = f(x)
                if not torch.allclose(r, (x @ x.T).sum(1), atol=1e-4):
                    errors.append("wrong numbers")
            except Exception as e:  # pragma: no cover - the failure this test is about
                errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            f.cache_clear()
            stop.wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    f.cache_clear()
    assert f.cache_info().currsize == 0


def test_an_adagrad_step_inside_names_the_step_count_not_the_learning_rate():
    """Before: "reads a tensor learning rate on the host. Pass lr as a Python float" for an lr
    that already was one (the line `value=-clr` matched "lr")."""
    m = nn.Linear(3, 1)
    opt = torch.optim.Adagrad(m.parameters(), lr=0.05)

    def step(x):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()

    g = gt.graphify(step)
    with pytest.raises(gt.GraphifyError) as ei:
        for _ in range(3):
            g(torch.randn(4, 3))
    msg = str(ei.value)
    assert "step count" in msg and "Pass lr as a Python float" not in msg


# -- tenth session -------------------------------------------------------------------------------


def test_enable_grad_inside_a_call_under_no_grad(device):
    """Before: the first call's output required grad (eager's does), later calls' silently not,
    so a backward through them failed or missed its gradients."""
    w = torch.randn(3, device=device, requires_grad=True)

    def fn(x):
        with torch.enable_grad():
            return (x * w).sin()

    g = gt.graphify(fn)
    x = torch.randn(3, device=device)
    with torch.no_grad(), pytest.raises(gt.GraphifyError) as ei:
        g(x)
    msg = str(ei.value)
    assert "enable_grad" in msg and "grad mode off" in msg and "Fix: call the function with grad mode on" in msg
    # with grad mode on, the same function is differentiated as eager
    out = g(x)
    out.sum().backward()
    ref = w.detach().clone().requires_grad_()
    (x * ref).sin().sum().backward()
    assert_close(w.grad, ref.grad)

    # gradients computed inside with torch.autograd.grad and returned stay fine under no_grad
    def force(x):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            e = (x ** 2 * w.detach()).sum()
            return -torch.autograd.grad(e, x)[0]

    gf = gt.graphify(force)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, device=device)
            assert_close(gf(x), force(x))
        info = gf.cache_info()
        assert info.currsize == 1 and info.hits >= 1  # (its first call runs eagerly: it reads w)


class _Scaler:
    def __init__(self, k):
        self.k = k

    @gt.graphify
    def __call__(self, x):
        return x * self.k


class _Cfg:
    def __init__(self):
        self.temperature = 1.0
        self.act = "exp"
        self.step = 0  # set by the loop, never read by the function


def test_plain_object_attributes_the_function_reads_are_part_of_the_signature(device):
    """Before: `self.k` of a graphified method, or `cfg.temperature` of a closed-over config,
    changed between calls was silently ignored (the first value stayed in the recording)."""
    x = torch.randn(4, device=device)
    s = _Scaler(3.0)
    assert_close(s(x), x * 3.0)
    assert_close(s(x), x * 3.0)
    s.k = 5.0
    assert_close(s(x), x * 5.0)
    assert_close(_Scaler(7.0)(x), x * 7.0)  # another object: another signature

    cfg = _Cfg()

    def f(x):
        y = x / cfg.temperature
        return y.exp() if cfg.act == "exp" else y.sin()

    g = gt.graphify(f)
    for i in range(8):
        cfg.step = i
        if i == 3:
            cfg.temperature = 2.0
        if i == 5:
            cfg.act = "sin"
        assert_close(g(x), f(x))
    # the unread `step` changing on every call records nothing again
    assert g.cache_info().hits >= 4

    import types
    ns = types.SimpleNamespace(t=1.0)  # a class that cannot be tracked: all its plain attributes
    h = gt.graphify(lambda x: x * ns.t)
    assert_close(h(x), x)
    ns.t = 4.0
    assert_close(h(x), x * 4.0)


def test_data_assignment_on_state_inside_is_refused_and_leaves_it_intact(device):
    """Before: `lin.weight.data = ...` inside the function left the parameter on the meta
    device for good (vector_to_parameters crashed the process)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to(device)
    before = lin.weight.detach().clone()

    def step(x):
        lin.weight.data = torch.renorm(lin.weight.data, 2, 0, 1.0)  # a max-norm constraint
        return lin(x)

    g = gt.graphify(step)
    x = torch.randn(3, 4, device=device)
    out = None
    with pytest.raises(gt.GraphifyError) as ei:
        for _ in range(3):  # (the first call of a signature that touches state runs eagerly)
            out = g(x)
    msg = str(ei.value)
    assert "lin.weight.data = ...` replaces the data of lin.weight" in msg and ".data.copy_(" in msg
    assert "test_user_patterns.py" in msg
    assert lin.weight.device == before.device and not lin.weight.is_meta
    assert_close(lin.weight.detach(), torch.renorm(before, 2, 0, 1.0))  # the eager call's update only
    del out
    # reading .data of an input is fine
    h = gt.graphify(lambda x: x.data * 2)
    assert_close(h(x), x * 2)


def test_a_model_and_optimizer_three_levels_below_self(device):
    """Before: unreached (depth 3), the optimizer kept the trace's momentum buffer (a placeholder):
    the first call failed with a message blaming the user, and eager steps failed afterwards."""
    import types

    class Trainer:
        def __init__(self):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(device)
            self.state = types.SimpleNamespace(nets={"g": m}, opts={"g": torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)})

        def step(self, x):
            m, o = self.state.nets["g"], self.state.opts["g"]
            o.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            return loss.detach()

    t, ref = Trainer(), Trainer()
    g = gt.graphify(t.step)
    for _ in range(4):
        x = torch.randn(5, 4, device=device)
        assert_close(g(x), ref.step(x))
    for p, q in zip(t.state.nets["g"].parameters(), ref.state.nets["g"].parameters()):
        assert_close(p, q)


def test_a_refused_grad_scaler_step_leaves_scaler_and_optimizer_usable(device):
    """Before: the refusal left the trace's found_inf placeholder in the scaler's per-optimizer
    state, so the eager step failed afterwards too."""
    m = nn.Linear(4, 2).to(device)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    sc = torch.amp.GradScaler(torch.device(device).type, init_scale=16.0)

    def step(x):
        o.zero_grad()
        sc.scale(m(x).pow(2).mean()).backward()
        sc.step(o)  # reads found_inf on the host
        sc.update()

    g = gt.graphify(step)
    x = torch.randn(3, 4, device=device)
    with pytest.raises(gt.GraphifyError):
        for _ in range(3):
            g(x)
    step(x)  # eager still works
    for v in o.state.values():
        assert all(type(t) is torch.Tensor for t in v.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("kw", [dict(static_argnums="10"), dict(static_argnums=(1.7,)), dict(static_argnums=(True,)),
                                dict(static_argnums=torch.tensor(1)), dict(maxsize=True), dict(maxsize=0)])
def test_invalid_graphify_arguments_are_refused(kw):
    """Before: "10" became (1, 0), 1.7 became 1, True and tensors were positions, maxsize=True was 1."""
    with pytest.raises((TypeError, ValueError)):
        gt.graphify(lambda x, n: x * n, **kw)


def test_static_argnums_out_of_range_or_keyword_only():
    with pytest.raises(ValueError, match="out of range"):
        gt.graphify(lambda x, n: x * n, static_argnums=5)
    with pytest.raises(ValueError, match="static_argnames='k'"):
        gt.graphify(lambda x, *, k: x * k, static_argnums=1)
    gt.graphify(lambda *xs: xs[0], static_argnums=3)  # *args: any position


def test_a_tensor_as_a_static_argument_is_a_clear_type_error(device):
    """Before: an internal "Boolean value of Tensor is ambiguous" on the second tensor, and 1-element
    tensors matched by value (tensor([True]) got the recording of tensor([1]): int64 out)."""
    g = gt.graphify(lambda x, s: x * s, static_argnums=1)
    x = torch.ones(2, device=device)
    with pytest.raises(TypeError, match="static argument args\\[1\\] is or holds a tensor"):
        g(x, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="holds a tensor"):
        g(x, (torch.tensor([1.0]), 2))


def test_static_namedtuples_and_frozen_dataclasses_are_keyed_by_type_and_sign(device):
    """Before: Cfg(2) and Cfg(2.0), DC(1) and DC(True), Cfg(0.0) and Cfg(-0.0) shared a recording."""
    import collections
    import dataclasses

    Cfg = collections.namedtuple("Cfg", "fill")

    @dataclasses.dataclass(frozen=True)
    class DC:
        fill: object

    x = torch.ones(2, device=device)
    for make in (Cfg, DC):
        fn = lambda x, c: torch.full((2,), c.fill, device=x.device)  # noqa: E731
        g = gt.graphify(fn, static_argnums=1)
        for v in (2, 2.0, True, 1, 0.0, -0.0):
            out, ref = g(x, make(v)), fn(x, make(v))
            assert out.dtype == ref.dtype, (make, v)
            assert_close(out, ref)
        h = gt.graphify(lambda x, c: x / c.fill, static_argnums=1)
        assert h(x, make(0.0))[0].item() == float("inf")
        assert h(x, make(-0.0))[0].item() == float("-inf")


def test_graphify_of_c_level_callables(device):
    """Before: AttributeError ('wrapper_descriptor' object has no attribute '__code__')."""
    import functools

    x = torch.ones(2, device=device)
    for fn in (functools.lru_cache(maxsize=None)(lambda x: x * 3), functools.cache(lambda x: x * 3)):
        g = gt.graphify(fn)
        assert_close(g(x), x * 3)
        assert_close(g(x + 1), (x + 1) * 3)

    class K:
        gs = gt.graphify(staticmethod(lambda x: x - 1))  # not bound to the instance

    assert_close(K.gs(x), x - 1)
    assert_close(K().gs(x), x - 1)


def test_a_format_spec_on_a_tensor_inside_is_a_graphify_error(device):
    """Before: TypeError: unsupported format string passed to FakeTensor.__format__."""
    def step(x):
        print(f"loss={x.sum():.3f}")
        return x * 2

    with pytest.raises(gt.GraphifyError, match="value on the host") as ei:  # (t.item(), the call's data)
        gt.graphify(step)(torch.ones(2, device=device))
    assert "test_user_patterns.py" in str(ei.value) and "Fix:" in str(ei.value)


@pytest.mark.parametrize("signature_switch", [False, True])
def test_zero_grad_inside_leaves_unused_parameters_without_grad(device, signature_switch):
    """Before: a parameter the step does not use kept the .grad something else gave it (the loop's
    other loss, another signature's replay) where eager's zero_grad() leaves None."""
    torch.manual_seed(0)
    me = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 1)]).to(device)
    oe = torch.optim.SGD(me.parameters(), lr=0.1, momentum=0.9)
    mg, og = copy.deepcopy((me, oe))

    def mk(m, o):
        def step(x, use_head):
            o.zero_grad()
            h = m[0](x)
            loss = (m[1](h) if use_head else h).pow(2).mean()
            loss.backward()
            o.step()
            return loss.detach()
        return step

    fe, fg = mk(me, oe), gt.graphify(mk(mg, og))
    uses = [True, False, False, True, False, False] if signature_switch else [False] * 6
    for use in uses:
        x = torch.randn(3, 4, device=device)
        if not signature_switch:  # another loss outside fills the head's .grad
            me[1](me[0](x)).sum().backward()
            mg[1](mg[0](x)).sum().backward()
        assert_close(fg(x, use), fe(x, use))
        assert (mg[1].weight.grad is None) == (me[1].weight.grad is None)
        for p, q in zip(mg.parameters(), me.parameters()):
            assert_close(p, q)


def test_train_and_eval_switched_inside_two_functions_sharing_a_model(device):
    """Before: refused (the mode each function sets happened once, while tracing); the replays
    now set the flags as the function does, and each mode is recorded once."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).to(device)

    def train_step(x):
        m.train()
        return m(x).sum()

    def eval_step(x):
        m.eval()
        return m(x).sum()

    tr, ev = gt.graphify(train_step), gt.graphify(eval_step)
    x = torch.randn(3, 4, device=device)
    for _ in range(4):
        for f, fn, mode in ((tr, train_step, True), (ev, eval_step, False)):
            torch.manual_seed(2)
            out = f(x)
            assert m.training is mode
            torch.manual_seed(2)
            assert_close(out, fn(x))
    assert tr.cache_info().hits >= 2 and ev.cache_info().hits >= 2
    # switched outside, both modes are recorded once and replayed (before: every switch ran
    # eagerly and recorded again)
    g = gt.graphify(lambda x: m(x).sum())
    for mode in (True, False) * 4:
        m.train(mode)
        torch.manual_seed(1)
        out = g(x)
        torch.manual_seed(1)
        assert_close(out, m(x).sum())
    info = g.cache_info()
    assert info.currsize == 2 and info.misses == 3 and info.hits == 5, info


def test_objects_equal_by_value_but_holding_other_tensors_are_other_signatures(device):
    """Before: b.f(x) replayed a's recording (a == b by name), reading a's tensor."""
    class M:
        def __init__(self, name, w):
            self.name, self.w = name, w

        def __eq__(self, o):
            return isinstance(o, M) and o.name == self.name

        def __hash__(self):
            return hash(self.name)

        @gt.graphify
        def f(self, x):
            return x * self.w

    a = M("m", torch.full((2,), 2.0, device=device))
    b = M("m", torch.full((2,), 3.0, device=device))
    x = torch.ones(2, device=device)
    for _ in range(3):
        assert_close(a.f(x), x * 2)
        assert_close(b.f(x), x * 3)


def test_printing_a_tensor_inside_warns_once_at_the_users_line(device):
    """Before: print(t) inside showed `FakeTensor(..., size=(2,))` once, silently."""
    def f(x):
        y = x * 2
        print(y)  # PRINT
        return y

    g = gt.graphify(f)
    with pytest.warns(gt.PrintWarning, match="prints a tensor") as rec:
        for _ in range(3):
            assert_close(g(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))
    assert len(rec) == 1 and rec[0].filename == __file__


def test_seeding_an_own_generator_inside_is_refused(device):
    """Before: g.manual_seed(5) inside ran once, while tracing: eager gave the same numbers on every
    call, the replays new ones."""
    gen = torch.Generator(device=device).manual_seed(7)

    def f(x):
        gen.manual_seed(5)
        return torch.rand(x.shape, generator=gen, device=x.device) + x

    g = gt.graphify(f)
    x = torch.zeros(4, device=device)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        # older torch cannot trace a Generator argument of an op: a clear error, and the seed undone
        with pytest.raises(gt.GraphifyError, match=r"(?s)explicit torch\.Generator.*Fix:"):
            g(x)
        assert gen.initial_seed() == 7
        return
    with pytest.raises(gt.GraphifyError, match="seeds or sets the state of the torch.Generator gen") as ei:
        g(x)
    assert "Fix: seed gen outside the function" in str(ei.value)
    assert gen.initial_seed() == 7  # the trace's seed was undone
    # seeded outside, before each call: eager's numbers
    h = gt.graphify(lambda x, gen: torch.rand(x.shape, generator=gen, device=x.device) + x)
    for _ in range(3):
        gen.manual_seed(5)
        out = h(x, gen)
        gen.manual_seed(5)
        assert_close(out, torch.rand(x.shape, generator=gen, device=x.device) + x)


def test_the_rerecord_warning_points_at_the_users_call():
    """Before: it pointed into gtransform/_api.py (its stacklevel was one frame short)."""
    import warnings

    f = gt.graphify(lambda x, lr: x * lr)
    x = torch.ones(2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(20):
            f(x, float(i))  # CALL
    rec = [a for a in w if a.category is gt.RerecordWarning]
    assert len(rec) == 1 and rec[0].filename == __file__


def test_mutable_non_tensor_outputs_are_new_on_every_call(device):
    """`return y, {"seen": set(), "hist": np.zeros(3)}`: eager makes a new set and array on
    every call. Before, every call returned the same objects, so a change the caller made to
    one call's set showed in the next call's output."""
    np = pytest.importorskip("numpy")

    def f(x):
        return x * 2, {"seen": {"a"}, "hist": np.zeros(3), "raw": bytearray(b"ab"), "n": 3}

    g = gt.graphify(f)
    x = torch.ones(2, device=device)
    for i in range(4):
        y, meta = g(x)
        assert meta["seen"] == {"a"} and meta["raw"] == bytearray(b"ab") and meta["n"] == 3
        assert (meta["hist"] == 0).all()
        meta["seen"].add(i)
        meta["hist"][0] += 1
        meta["raw"].append(1)
    assert g.cache_info().hits == 3


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam_fused"])
def test_an_update_that_reaches_the_parameters_through_the_optimizer_only_matches_eager(device, kind):
    """`def update(): opt.step(); opt.zero_grad()` with the backward done outside (torch's
    "compile the optimizer step" recipe). Before, the trace's zero_grad() left the parameters'
    .grad None (nothing gave them back: no module was reached), so the eager first call stepped
    nothing and made no optimizer state: momentum and Adam's moments were lost for good."""
    make = {"sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True)}[kind]
    torch.manual_seed(0)
    m = nn.Linear(4, 3).to(device)
    me = copy.deepcopy(m)
    opt, oe = make(m.parameters()), make(me.parameters())

    def make_update(o):
        def update():
            o.step()
            o.zero_grad()
        return update

    ug, ue = gt.graphify(make_update(opt)), make_update(oe)
    for _ in range(5):
        x = torch.randn(8, 4, device=device)
        m(x).pow(2).sum().backward()
        me(x).pow(2).sum().backward()
        ug()
        ue()
        assert_close(m.weight, me.weight)
        assert len(opt.state) == len(oe.state) == 2
        assert m.weight.grad is None and me.weight.grad is None
    assert ug.cache_info().hits >= 2


_REBIND_SRC = '''
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Linear(4, 3).to(DEV)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def step(x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss
'''


@pytest.mark.parametrize("what", ["opt", "model"])
@pytest.mark.parametrize("where", ["global", "closure"])
def test_a_module_or_optimizer_name_rebound_between_calls_is_seen(device, what, where):
    """`opt = torch.optim.Adam(...)` (or a new model) after some steps, as a notebook cell run
    again or a switch of optimizer after warm-up does. Before, every call replayed the old
    optimizer (or trained the old model): all hits, the new optimizer's state empty."""
    if where == "global":
        ns = {"DEV": device}
        exec(_REBIND_SRC, ns)  # a module's globals
        g = gt.graphify(ns["step"])

        def rebind(name, value):
            ns[name] = value

        def get(name):
            return ns[name]
    else:
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        g = gt.graphify(step)

        def rebind(name, value):
            nonlocal model, opt
            if name == "opt":
                opt = value
            else:
                model = value

        def get(name):
            return opt if name == "opt" else model
    for _ in range(3):
        g(torch.randn(8, 4, device=device), torch.randn(8, 3, device=device))
    if what == "model":
        torch.manual_seed(5)
        rebind("model", nn.Linear(4, 3).to(device))
        rebind("opt", torch.optim.SGD(get("model").parameters(), lr=0.1))
    else:
        rebind("opt", torch.optim.Adam(get("model").parameters(), lr=0.01, fused=True))
    ref = copy.deepcopy(get("model"))
    ref_opt = (torch.optim.SGD(ref.parameters(), lr=0.1) if what == "model"
               else torch.optim.Adam(ref.parameters(), lr=0.01, fused=True))
    for _ in range(4):
        x, y = torch.randn(8, 4, device=device), torch.randn(8, 3, device=device)
        loss = g(x, y)
        ref_opt.zero_grad()
        r = torch.nn.functional.mse_loss(ref(x), y)
        r.backward()
        ref_opt.step()
        assert_close(loss, r)
        assert_close(get("model").weight, ref.weight)
        assert len(get("opt").state) == len(ref_opt.state)
    assert g.cache_info().hits >= 2  # the new objects are recorded and replayed


def test_state_rebound_or_growing_before_every_call_warns_once_with_the_fix():
    """model.h = h.detach() before every call (truncated BPTT), or a KV cache that grows: the
    same signature traced again on every call (an eager call, a trace and a recording each).
    Before, nothing said so, and the log said the slot "holds no tensor now"."""
    import warnings

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.h = torch.zeros(2, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x) + self.h)

    m = M()
    g = gt.graphify(m)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(10):
            x = torch.randn(2, 4)
            with torch.no_grad():
                out = g(x)
                assert_close(out, torch.tanh(m.lin(x) + m.h))
                m.h = out.clone()
    msgs = [str(x.message) for x in w if issubclass(x.category, gt.RerecordWarning)]
    assert len(msgs) == 1, msgs
    assert "state module.h is another tensor now (rebound between calls)" in msgs[0]
    assert "copy_" in msgs[0]



@pytest.mark.parametrize("change", ["requires_grad", "dtype"])
def test_state_whose_metadata_keeps_changing_warns_with_what_changed(change):
    """The warning names the field that changed (it printed `float32[8, 4] -> float32[8, 4]`
    for a requires_grad toggle) and the fix for that field, not the growing cache's."""
    import warnings

    m = nn.Linear(4, 3)
    fn = lambda x: m(x.to(m.weight.dtype)).float()  # noqa: E731 (the argument's dtype stays)
    g = gt.graphify(fn)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(12):
            if change == "requires_grad":
                m.weight.requires_grad_(step % 2 == 0)
            else:
                m.to(torch.float64 if step % 2 else torch.float32)
            x = torch.randn(2, 4)
            assert_close(g(x), fn(x))
    msgs = [str(x.message) for x in w if issubclass(x.category, gt.RerecordWarning)]
    assert msgs
    if change == "requires_grad":
        assert "state m.weight: requires_grad " in msgs[0] and "frozen and unfrozen" in msgs[0]
    else:
        assert "state m.weight: dtype torch.float" in msgs[0] and "convert it once" in msgs[0]
    assert "KV cache" not in msgs[0]


def test_a_growing_kv_cache_argument_warns_with_the_static_cache_fix():
    import warnings

    class Cache:  # a DynamicCache-like object: the same object, its tensors grow every step
        def __init__(self):
            self.k = torch.zeros(1, 4)

    lin = nn.Linear(4, 4)

    def step(q, cache):
        cache.k = torch.cat([cache.k, lin(q)])
        return (cache.k @ q.T).sum(0)

    g = gt.graphify(step)
    cache, ref = Cache(), Cache()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(10):
                q = torch.randn(1, 4)
                try:
                    out = g(q, cache)
                except gt.GraphifyError:
                    break  # refused (a binding on every call) is as good as warned
                assert_close(out, step(q, ref))
    msgs = [str(x.message) for x in w if issubclass(x.category, gt.RerecordWarning)]
    assert len(msgs) <= 1, msgs
    if msgs:
        assert "StaticCache" in msgs[0] or "same object" in msgs[0]


def _tiny_llama():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return tr, tr.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "after-a-prompt"])
def test_a_dynamic_cache_is_refused_with_the_static_cache_fix_and_left_as_it_was(filled):
    """Before: an empty DynamicCache gave "the function stored a traced tensor in Python state"
    (the user's code blamed), and the caller's cache was left holding FakeTensors in half-made
    layers. Now the message names the cause (it grows every call) and the fix, and the cache is
    as it was: the same layers holding the same tensors."""
    tr, model = _tiny_llama()

    def step(ids, cache):
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits

    g = gt.graphify(step)
    cache, ref = tr.DynamicCache(), tr.DynamicCache()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        if filled:  # a prompt run eagerly, then the decode step graphified
            step(ids, cache)
            step(ids, ref)
            ids = torch.tensor([[4]])
        before = [(layer, layer.keys, layer.values, layer.is_initialized) for layer in cache.layers]
        with pytest.raises(gt.GraphifyError) as ei:
            g(ids, cache)
        msg = str(ei.value)
        assert "args[1] is a transformers DynamicCache, which grows by one step on every call" in msg
        assert "Fix: use a fixed-size cache written in place: transformers.StaticCache" in msg
        assert "keep the DynamicCache outside the graphified function" in msg
        assert "test_user_patterns.py" in msg  # the user's line
        assert "args[1] was left as it was before the call" in msg
        after = [(layer, layer.keys, layer.values, layer.is_initialized) for layer in cache.layers]
        assert len(after) == len(before) and all(a is b for x, y in zip(after, before) for a, b in zip(x, y))
        for nxt in ([[5]], [[6]]):  # the cache stays usable: eager decoding gives eager's numbers
            assert_close(step(torch.tensor(nxt), cache), step(torch.tensor(nxt), ref))
        assert all(type(layer.keys) is torch.Tensor for layer in cache.layers)


def test_calls_alternating_inference_mode_and_no_grad_keep_both_recordings(device):
    """Before: every switch traced and recorded again (40 misses in 40 calls), as the tensors'
    dispatch keys differ under inference mode, which the signature did not include."""
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    g = gt.graphify(m)
    x = torch.randn(3, 4, device=device)
    for i in range(12):
        with (torch.inference_mode() if i % 2 else torch.no_grad()):
            assert_close(g(x), m(x))
    assert g.cache_info().misses <= 4


def test_a_parametrized_module_called_inside_parametrize_cached(device):
    """Before: the first call crashed ("a tensor made while tracing it was used after the
    trace"): the trace left its placeholder weight in torch's parametrize cache."""
    import torch.nn.utils.parametrize as P

    class Sym(nn.Module):
        def forward(self, X):
            return X.triu() + X.triu(1).T

    lin = nn.Linear(4, 4).to(device)
    P.register_parametrization(lin, "weight", Sym())
    g = gt.graphify(lin)
    x = torch.randn(2, 4, device=device)
    for _ in range(3):
        with P.cached():
            y = g(x)
            assert_close(y, lin(x))
    assert g.cache_info().hits >= 1


def test_library_code_sees_one_is_compiling_in_forward_and_differentiated_recordings():
    """The joint forward-backward trace of a differentiated call ran without
    torch.compiler.is_compiling() set, the forward's trace with it: library code branching on
    it (Hugging Face's MoE picks torch._grouped_mm) took one branch under no_grad and the other
    in grad mode."""
    class Lib(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w * (2.0 if torch.compiler.is_compiling() else 3.0)

    m = Lib()
    g = gt.graphify(m)
    x = torch.ones(3)
    with torch.no_grad():
        for _ in range(3):
            plain = g(x).clone()
    for i in range(4):
        y = g(x)
        if i > 0:  # (the first call of a signature that reads state runs eagerly)
            assert_close(y.detach(), plain)  # the recordings agree (3.0 before)
        y.sum().backward()


def test_deepcopy_of_a_graphified_function_and_of_a_module_holding_one(device):
    # copy.deepcopy raised "cannot pickle '_thread._local' object"
    w = torch.randn(3, device=device)
    f = gt.graphify(lambda x: x * w + 1)
    x = torch.randn(3, device=device)
    f(x)
    g = copy.deepcopy(f)
    assert g is not f and g.cache_info().currsize == 0  # a copy records for itself
    for _ in range(3):
        assert_close(g(x), x * w + 1)  # (the copy closes over a copy of w: equal values)
    assert copy.copy(f).__wrapped__ is f.__wrapped__

    m = nn.Linear(3, 2).to(device)
    m.forward = gt.graphify(m.forward)
    m2 = copy.deepcopy(m)
    with torch.no_grad():
        m2.weight.add_(1.0)  # the copy's forward reads the copy's parameters
    for _ in range(3):
        assert_close(m2(x), torch.nn.functional.linear(x, m2.weight, m2.bias))
        assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


def test_averaged_model_of_a_module_with_a_graphified_forward(device):
    # torch.optim.swa_utils.AveragedModel deep-copies the model: an EMA of a graphified model
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    m = copy.deepcopy(ref)
    m.forward = gt.graphify(m.forward)
    ema = torch.optim.swa_utils.AveragedModel(m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ema_ref = torch.optim.swa_utils.AveragedModel(ref, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(5, 4, device=device)
        for model, o, e in ((m, opt, ema), (ref, opt_ref, ema_ref)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
            e.update_parameters(model)
        assert_close(ema(x), ema_ref(x))


def test_a_module_with_a_graphified_forward_pickles(device):
    import io

    m = nn.Linear(3, 2).to(device)
    m.forward = gt.graphify(m.forward, static_argnames=())
    x = torch.randn(4, 3, device=device)
    m(x)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    assert isinstance(m2.forward, gt.Graphified) and m2.forward.cache_info().currsize == 0
    for _ in range(2):
        assert_close(m2(x), torch.nn.functional.linear(x, m.weight, m.bias))


def test_global_module_hooks_see_the_users_modules_only(device):
    """Before: a hook of register_module_forward_hook (FLOP counters, activation statistics) also
    ran on gtransform's own graph at every replay, with its flat output tuple, and one that
    returned a value replaced the recording's outputs."""
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU()).to(device)
    seen = []

    def hook(m, args, out):
        seen.append(type(m).__name__)
        return out.clamp(max=100.0)  # (a hook written for the user's modules: tensors out)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        f = gt.graphify(lambda x: seq(x) * 2)
        x = torch.ones(2, 3, device=device, requires_grad=True)
        for _ in range(3):
            out = f(x)
            out.sum().backward()
        with torch.no_grad():
            for _ in range(3):
                f(x)
    finally:
        handle.remove()
    assert set(seen) <= {"Linear", "ReLU", "Sequential"}, set(seen)

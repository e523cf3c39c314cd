"""No global changes that others can see (DESIGN semantics 14, issue 34).

Importing gtransform changes nothing in torch; what a trace changes (``gtransform/_patches.py``
lists all of it) is changed while the trace runs, for the tracing thread only, and put back
after it: another thread running eager code meanwhile sees stock torch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch._dynamo  # noqa: F401  (torch itself rebinds torch.manual_seed when it first loads dynamo, as traces do)
from conftest import assert_close
from torch import nn

import gtransform as gt
from gtransform import _patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_IMPORT_CHECK = r"""
import json, sys, types
import torch, torch.optim, torch.random, torch.cuda, torch.cuda.random, torch.compiler, torch.autograd, torch.nn
import torch.nn.modules.module, torch.nn.modules.rnn, torch.utils.hooks
try:
    import torch.distributed.distributed_c10d as c10d
except Exception:
    c10d = None
objs = {"torch": torch, "torch.Tensor": torch.Tensor, "torch._C.TensorBase": torch._C.TensorBase,
        "torch.nn.Module": torch.nn.Module, "torch.optim.Optimizer": torch.optim.Optimizer,
        "torch.random": torch.random, "torch.cuda": torch.cuda, "torch.cuda.random": torch.cuda.random,
        "torch.compiler": torch.compiler, "torch.autograd": torch.autograd, "torch._C": torch._C,
        "torch.nn.modules.module": torch.nn.modules.module, "RNNBase": torch.nn.modules.rnn.RNNBase,
        "RemovableHandle": torch.utils.hooks.RemovableHandle}
if c10d is not None:
    objs["torch.distributed"] = sys.modules["torch.distributed"]
    objs["distributed_c10d"] = c10d

def snap():
    out = {}
    for k, o in objs.items():
        d = dict(vars(o))
        out[k] = (d, {n: v.__code__ for n, v in d.items() if isinstance(v, types.FunctionType)})
    return out

before = snap()
hooks = {n: dict(v) for n, v in vars(torch.nn.modules.module).items() if n.startswith("_global_") and isinstance(v, dict)}
log = logging = __import__("logging")
fake_log = logging.getLogger("torch._subclasses.fake_tensor")
log_state = (fake_log.level, list(fake_log.filters))
import gtransform
after = snap()
diffs = []
for k, o in objs.items():
    (b, bc), (a, ac) = before[k], after[k]
    for n in sorted(set(b) | set(a)):
        if n not in b:
            v = a[n]
            # importing one of torch's own modules binds it on its package: not a change
            if isinstance(v, types.ModuleType) and v.__name__ == f"{getattr(o, '__name__', '')}.{n}":
                continue
            diffs.append(f"{k}.{n} added")
        elif n not in a:
            diffs.append(f"{k}.{n} removed")
        elif b[n] is not a[n]:
            diffs.append(f"{k}.{n} replaced")
        elif n in bc and bc[n] is not a[n].__code__:
            diffs.append(f"{k}.{n}.__code__ replaced")
for n, d in hooks.items():
    if dict(getattr(torch.nn.modules.module, n)) != d:
        diffs.append(f"torch.nn.modules.module.{n} changed")
if (fake_log.level, list(fake_log.filters)) != log_state:
    diffs.append("the fake-tensor logger changed")
print("DIFFS " + json.dumps(diffs))
"""


def test_importing_gtransform_changes_nothing_in_torch():
    """Every attribute of torch's namespaces and classes is the same object after ``import
    gtransform`` (and every function keeps its code). Before: Tensor.register_hook and
    register_post_accumulate_grad_hook were wrapped at import, and so was
    torch.distributed.destroy_process_group."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("DIFFS "))
    assert json.loads(line[len("DIFFS "):]) == []


def _patched_names():
    """(owner, name) of everything a trace may change, or that used to be changed."""
    import torch.cuda.random as cuda_random
    from torch.nn.modules.rnn import RNNBase

    names = [(torch, n) for n in ("get_rng_state", "set_rng_state", "manual_seed", "seed")]
    names += [(torch.random, n) for n in ("get_rng_state", "set_rng_state", "manual_seed", "seed")]
    names += [(m, n) for m in (torch.cuda, cuda_random)
              for n in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "seed", "seed_all")]
    names += [(torch.compiler, "is_compiling"), (torch.Tensor, "register_hook"),
              (torch.Tensor, "register_post_accumulate_grad_hook"), (torch.optim.Optimizer, "zero_grad"),
              (torch.nn.Module, "zero_grad"), (RNNBase, "flatten_parameters")]
    # (the jiterator's launch function of CUDA builds: see test_jiterator_launch_keeps_its_identity)
    return names


def _value(owner, name):
    return vars(owner)[name] if name in vars(owner) else getattr(owner, name)


def _code(v):
    return getattr(v, "__code__", None)


class _Gate:
    """Where the traced function waits (a class: not state the function reaches, so its trace
    neither snapshots nor restores what is set here)."""

    inside = threading.Event()
    done = threading.Event()
    seen: dict = {}

    @classmethod
    def pause(cls, codes):
        """Inside the trace: note what the tracing thread sees, and wait for the other thread."""
        if torch.compiler.is_compiling() and not cls.inside.is_set():  # (the trace, not an eager first call)
            cls.seen["compiling"] = torch.compiler.is_compiling()
            cls.seen["routed"] = torch.get_rng_state.__code__ is not codes[(torch, "get_rng_state")]
            cls.inside.set()
            assert cls.done.wait(120), "the second thread did not finish"


def test_another_thread_sees_stock_torch_while_a_trace_runs():
    """A first thread traces a function that waits, inside its trace, until a second thread
    has run eager code touching everything a trace changes: the second thread sees stock
    torch, and afterwards every patched name is the original again."""
    from torch.nn.modules.module import _global_forward_pre_hooks

    names = _patched_names()
    stock = {(o, n): _value(o, n) for o, n in names}
    codes = {(o, n): _code(v) for (o, n), v in stock.items()}
    hooks_before = dict(_global_forward_pre_hooks)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    log_before = (fake_log.level, list(fake_log.filters))
    torch.manual_seed(123)
    want_after_seed = torch.rand(5)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model.scale = 2.0
    inside, done = _Gate.inside, _Gate.done
    inside.clear()
    done.clear()
    _Gate.seen.clear()

    def fn(x):
        y = model(x) * model.scale
        _Gate.pause(codes)
        return y

    g = gt.graphify(fn)
    x = torch.randn(5, 3)
    errors = []
    got = {}

    def tracer():
        try:
            for _ in range(3):
                got["y"] = g(x).clone()
        except BaseException as e:  # noqa: B036 - reported below
            errors.append(("tracer", e))
            inside.set()

    def eager():
        try:
            assert inside.wait(120), "the trace did not start"
            assert not errors, errors
            # the trace's patches are in (so this checks what another thread sees of them)
            assert torch.compiler.is_compiling.__code__ is not codes[(torch.compiler, "is_compiling")]
            # every name of torch is the stock object (the routed functions keep their identity)
            for key, v in stock.items():
                assert _value(*key) is v, f"{key[0].__name__}.{key[1]} is not torch's in another thread"
            assert not torch.compiler.is_compiling()
            assert torch.compiler._is_compiling_flag is False
            # zero_grad (a real optimizer and a module)
            lin = nn.Linear(3, 3)
            opt = torch.optim.SGD(lin.parameters(), lr=0.1)
            lin(torch.ones(2, 3)).sum().backward()
            assert lin.weight.grad is not None
            opt.zero_grad()
            assert lin.weight.grad is None and lin.bias.grad is None
            lin(torch.ones(2, 3)).sum().backward()
            opt.zero_grad(set_to_none=False)
            assert torch.equal(lin.weight.grad, torch.zeros(3, 3))
            lin(torch.ones(2, 3)).sum().backward()
            lin.zero_grad()
            assert lin.weight.grad is None
            # the generators: seeding, state got and set back, fresh numbers
            torch.manual_seed(123)
            assert torch.equal(torch.rand(5), want_after_seed)
            s = torch.get_rng_state()
            a = torch.rand(4)
            torch.set_rng_state(s)
            assert torch.equal(torch.rand(4), a)
            torch.random.set_rng_state(s)
            assert torch.equal(torch.rand(4), a)
            torch.manual_seed(7)
            # gradient hooks on a tensor, and a backward that calls them
            t = torch.ones(3, requires_grad=True)
            calls = []
            h = t.register_hook(lambda gr: calls.append(1) or gr * 2)
            h2 = t.register_post_accumulate_grad_hook(lambda p: calls.append(2))
            (t * 3).sum().backward()
            assert calls == [1, 2] and torch.equal(t.grad, torch.full((3,), 6.0))
            h.remove()
            h2.remove()
            # the traced module: its attributes, its class as Python code asks for it, its results
            assert model.scale == 2.0 and model.training and isinstance(model, nn.Sequential)
            assert model.__class__ is nn.Sequential
            assert_close(model(x), torch.tanh(x @ model[0].weight.T + model[0].bias) @ model[2].weight.T + model[2].bias)
            # (the one difference left: type() of a module the trace reads is a subclass of its
            # own class, of the same name, while the trace runs; see gtransform/_patches.py)
            assert issubclass(type(model), nn.Sequential) and type(model).__name__ == "Sequential"
            assert type(lin) is nn.Linear  # a module the trace does not read: untouched
            # a recurrent module packs its weights as ever (a no-op on the CPU)
            lstm = nn.LSTM(3, 4)
            assert type(lstm).flatten_parameters is stock[(torch.nn.modules.rnn.RNNBase, "flatten_parameters")]
            lstm.flatten_parameters()
            assert lstm(torch.randn(2, 1, 3))[0].shape == (2, 1, 4)
            # torch's fake-tensor log is not silenced for this thread
            assert fake_log.level == log_before[0]
            rec = fake_log.makeRecord(fake_log.name, logging.ERROR, __file__, 0, "x", (), None)
            assert fake_log.filter(rec)
        except BaseException as e:  # noqa: B036 - reported below
            errors.append(("eager", e))
        finally:
            done.set()

    threads = [threading.Thread(target=tracer), threading.Thread(target=eager)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    if errors:
        raise AssertionError(f"{errors[0][0]} thread failed") from errors[0][1]
    # the tracing thread got what it needs, and the recording computes what eager does
    assert _Gate.seen == {"compiling": True, "routed": True}
    assert_close(got["y"], model(x) * 2.0)
    assert g.cache_info().hits == 1  # (recorded in the tracing thread, then replayed there)
    # another thread's seed is neither refused nor undone by the trace
    assert torch.initial_seed() == 7
    # after both threads end, every patched name is the original again, with its code
    for key, v in stock.items():
        assert _value(*key) is v and _code(v) is codes[key], f"{key[0].__name__}.{key[1]} not put back"
    assert dict(_global_forward_pre_hooks) == hooks_before
    assert (fake_log.level, list(fake_log.filters)) == log_before
    assert type(model) is nn.Sequential


def test_patches_are_put_back_after_a_failed_trace():
    names = _patched_names()
    stock = {(o, n): (_value(o, n), _code(_value(o, n))) for o, n in names}
    model = nn.Linear(3, 3)

    def fn(x):
        y = model(x)
        if torch.compiler.is_compiling():
            raise ValueError("the user's own error")
        return y

    g = gt.graphify(fn)
    with pytest.raises(ValueError, match="the user's own error"):
        g.trace(torch.ones(2, 3))
    for (o, n), (v, c) in stock.items():
        assert _value(o, n) is v and _code(v) is c
    assert type(model) is nn.Linear


def test_trace_scopes_count_across_threads_and_mark_only_their_own():
    """The shared patches go in with the first scope and out with the last, whichever thread
    leaves last; tracing() is true only in a thread inside a scope."""
    code = torch.compiler.is_compiling.__code__
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with _patches.trace_scope():
            seen["first"] = (_patches.tracing(), torch.compiler.is_compiling())
            first_in.set()
            second_in.wait(60)
        first_out.set()

    def second():
        first_in.wait(60)
        seen["second_before"] = (_patches.tracing(), torch.compiler.is_compiling())
        with _patches.trace_scope():
            second_in.set()
            first_out.wait(60)
            # the first scope is gone: still installed for this one
            seen["second"] = (_patches.tracing(), torch.compiler.is_compiling(),
                              torch.compiler.is_compiling.__code__ is not code)
            with _patches.trace_scope():  # nested
                pass
            seen["nested"] = torch.compiler.is_compiling.__code__ is not code

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert seen == {"first": (True, True), "second_before": (False, False), "second": (True, True, True),
                    "nested": True}
    assert torch.compiler.is_compiling.__code__ is code and not _patches.tracing()
    assert not torch.compiler.is_compiling()


def test_a_hook_on_a_parameter_registered_in_another_thread_records_again():
    """Gradient hooks are seen by comparing the parameters' hook dicts (no wrapped
    register_hook): wherever the hook is registered, the next call records again."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()

    g = gt.graphify(step)
    x = torch.ones(2, 3)
    for _ in range(3):
        g(x)
    before = m.weight.detach().clone()
    box = []
    th = threading.Thread(target=lambda: box.append(m.weight.register_hook(lambda gr: gr * 0)))
    th.start()
    th.join()
    g(x)  # the hook zeroes the weight's gradient: the weight stays
    assert torch.equal(m.weight.detach(), before)
    box[0].remove()
    g(x)
    assert not torch.equal(m.weight.detach(), before)


def test_recurrent_weights_are_not_packed_inside_a_trace_and_are_elsewhere(monkeypatch):
    """RNNBase.flatten_parameters is torch's own in every thread: the trace's modes answer its
    `is_cuda` question with False, so it leaves a trace's (CUDA) weights unpacked without
    reaching cuDNN; outside them it runs on as stock torch does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gtransform._watch import _RnnScope

    m = nn.LSTM(3, 4)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        m._flat_weights = [torch.empty_like(w, device="cuda") for w in m._flat_weights]
    asked = []
    monkeypatch.setattr(torch.backends.cudnn, "is_acceptable", lambda t: asked.append(t) or False)

    class _NoWatch:
        def _fail(self, *a):
            raise AssertionError(a)

    with _RnnScope(_NoWatch()):
        m.flatten_parameters()
    assert asked == []
    m.flatten_parameters()
    assert len(asked) == 1


def test_zero_grad_inside_is_seen_through_a_mode_the_function_enters():
    """zero_grad() is seen by the trace's TorchFunctionMode (its .grad reads), no wrapper of
    torch's: also when the function runs it under a mode of its own (`with torch.device`),
    which handles each call first and makes it again from its own frame."""
    torch.manual_seed(0)
    me = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 1)])
    oe = torch.optim.SGD(me.parameters(), lr=0.1)
    import copy

    mg, og = copy.deepcopy((me, oe))

    def mk(m, o):
        def step(x):
            with torch.device("cpu"):
                o.zero_grad()
                loss = m[0](x).pow(2).mean()  # the head is not used: eager leaves its .grad None
                loss.backward()
                o.step()
            return loss.detach()
        return step

    fe, fg = mk(me, oe), gt.graphify(mk(mg, og))
    for i in range(5):
        x = torch.randn(3, 4)
        if i >= 2:  # once recorded (the head's .grad was None while tracing, so no write was seen)
            me[1](me[0](x)).sum().backward()  # another loss outside fills the head's .grad
            mg[1](mg[0](x)).sum().backward()
        assert_close(fg(x), fe(x))
        assert me[1].weight.grad is None and mg[1].weight.grad is None
    assert fg.cache_info().hits >= 3


_JIT = "_cuda_jiterator_compile_and_launch_kernel"


@pytest.mark.skipif(not hasattr(torch._C, _JIT), reason="a CPU build of torch has no jiterator")
def test_jiterator_launch_keeps_its_identity_in_other_threads():
    from gtransform._patches import trace_scope

    stock = getattr(torch._C, _JIT)
    inside, seen, done = threading.Event(), [], threading.Event()

    def tracer():
        with trace_scope():
            inside.set()
            done.wait(60)

    th = threading.Thread(target=tracer)
    th.start()
    try:
        assert inside.wait(60)
        seen.append(getattr(torch._C, _JIT))
    finally:
        done.set()
        th.join(60)
    assert getattr(torch._C, _JIT) is stock
    assert seen[0] is stock, "another thread sees a replaced jiterator launch function during a trace"

"""Random generator states set inside the function (DESIGN semantics 5).

``torch.set_rng_state``, ``torch.random.fork_rng`` and ``torch.utils.checkpoint``'s
recompute (``preserve_rng_state=True``) move a generator on the host, once, while
tracing; a recording draws from wherever the generator stands on every replay. Where
that would make eager repeat random numbers the recording does not, the function is a
GraphifyError naming the user's line and the fix; where the state set changes nothing
(no draw between saving and setting it back), the function gives eager's numbers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from conftest import assert_close, line_of
from torch.utils.checkpoint import checkpoint

import gtransform as gt

THIS_FILE = os.path.basename(__file__)


def _model(device, p=0.5, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Dropout(p), nn.Linear(16, 1)).to(device)


def rewind(x):
    s = torch.get_rng_state()
    a = torch.rand(3)
    torch.set_rng_state(s)  # SET
    b = torch.rand(3)  # DRAW
    return x + a - b


def test_setting_the_rng_state_back_then_drawing_is_graphify_error():
    assert torch.equal(rewind(torch.zeros(3)), torch.zeros(3))  # eager draws the same numbers twice
    g = gt.graphify(rewind)
    for _ in range(2):  # the failure is not cached as a half-made entry
        before = torch.get_rng_state()
        with pytest.raises(gt.GraphifyError) as ei:
            g(torch.zeros(3))
        msg = str(ei.value)
        assert msg.startswith("graphify(rewind): aten.rand.default draws random numbers from the CPU generator"), msg
        assert f"{THIS_FILE}:{line_of(rewind, '# DRAW')}" in msg, msg
        assert f"{THIS_FILE}:{line_of(rewind, '# SET')}" in msg, msg
        assert "torch.set_rng_state()" in msg and "Why:" in msg
        # (no checkpoint here: the fix does not send the user to one)
        assert "Fix: draw the random numbers outside the graphified function" in msg, msg
        assert "checkpoint" not in msg.split("Fix:")[1], msg
        assert "call the function eagerly" in msg
        # the failed trace left the generator where it was
        assert torch.equal(torch.get_rng_state(), before)


def test_error_leaves_the_function_usable_and_the_generator_like_eager():
    orig = (torch.set_rng_state, torch.get_rng_state, torch.random.set_rng_state, torch.cuda.set_rng_state)
    mode = {"rewind": True}

    def fn(x):
        s = torch.get_rng_state()
        a = torch.rand(3)
        if mode["rewind"]:
            torch.set_rng_state(s)
        return x + a - torch.rand(3)

    g = gt.graphify(fn)
    torch.manual_seed(5)
    with pytest.raises(gt.GraphifyError, match=r"(?s)set_rng_state.*Fix:"):
        g(torch.zeros(3))
    after_error = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after_error, torch.rand(4))  # the failed call drew nothing
    # the wrappers are gone once the trace is over (nothing is paid per call)
    assert (torch.set_rng_state, torch.get_rng_state, torch.random.set_rng_state, torch.cuda.set_rng_state) == orig

    mode["rewind"] = False  # the fixed function traces and gives eager's numbers
    x = torch.zeros(3)
    torch.manual_seed(11)
    want = [fn(x) for _ in range(3)] + [torch.rand(4)]
    torch.manual_seed(11)
    got = [g(x).clone() for _ in range(3)] + [torch.rand(4)]
    assert_close(got, want)
    assert g.cache_info().hits == 2  # recorded once (after the failed trace), then replayed
    assert (torch.set_rng_state, torch.get_rng_state, torch.random.set_rng_state, torch.cuda.set_rng_state) == orig


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_with_dropout_preserving_rng_state_is_graphify_error(device, reentrant):
    m = _model(device)

    def step(x):
        m.zero_grad()
        y = checkpoint(m, x, use_reentrant=reentrant, preserve_rng_state=True)
        y.sum().backward()  # BACKWARD
        return m[0].weight.grad.norm()

    g = gt.graphify(step)
    x = torch.ones(2, 4, device=device, requires_grad=reentrant)
    torch.manual_seed(1)
    with pytest.raises(gt.GraphifyError) as ei:
        for _ in range(2):  # a first call that reads state may run eagerly
            g(x)
    msg = str(ei.value)
    assert "torch.utils.checkpoint's recompute (preserve_rng_state=True)" in msg, msg
    assert f"{THIS_FILE}:{line_of(step, '# BACKWARD')}" in msg, msg
    assert "Fix: set dropout to 0 in the checkpointed blocks" in msg, msg
    assert "preserve_rng_state=False to torch.utils.checkpoint" in msg and "new dropout masks" in msg, msg
    # and again, with the same message
    with pytest.raises(gt.GraphifyError, match=r"(?s)checkpoint's recompute.*Fix:"):
        g(x)


def _train(device, n=3, p=0.5, preserve=True, graphify=False):
    """Per call, the first layer's gradient norm (the backward runs inside the function)."""
    m = _model(device, p)

    def step(x):
        m.zero_grad()
        checkpoint(m, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
        return m[0].weight.grad.norm()

    f = gt.graphify(step) if graphify else step
    x = torch.ones(2, 4, device=device)
    torch.manual_seed(1)
    out = [f(x).clone() for _ in range(n)]
    return out + [torch.rand(4, device=device)], f


def test_checkpoint_without_random_ops_is_eagers(device):
    want, _ = _train(device, p=0.0)
    got, g = _train(device, p=0.0, graphify=True)
    assert_close(got, want)
    assert g.cache_info().currsize == 1


def test_checkpoint_not_preserving_rng_state_with_dropout_is_eagers(device):
    want, _ = _train(device, preserve=False)
    got, g = _train(device, preserve=False, graphify=True)
    assert_close(got, want)
    assert g.cache_info().currsize == 1
    assert len({round(float(v), 4) for v in want[:3]}) == 3  # the masks do change between calls


def test_checkpoint_with_dropout_in_a_graphified_model_gives_eagers_gradients(device):
    """Backward outside the function: its recompute is not replayed from a trace."""

    def run(graphify):
        m = _model(device)

        def fwd(x):
            return checkpoint(m, x, use_reentrant=False, preserve_rng_state=True)

        f = gt.graphify(fwd) if graphify else fwd
        x = torch.ones(2, 4, device=device)
        torch.manual_seed(1)
        res = []
        for _ in range(4):
            m.zero_grad()
            y = f(x)
            y.sum().backward()
            res += [y.detach().clone(), m[0].weight.grad.clone()]
        return res + [torch.rand(4, device=device)]

    assert_close(run(True), run(False))


def test_fork_rng_around_deterministic_code_is_eagers(device):
    def fn(x):
        with torch.random.fork_rng(devices=[]):
            y = (x * 2).tanh()
        return torch.nn.functional.dropout(y, 0.5) + torch.rand(3, device=x.device)

    x = torch.ones(3, device=device)
    torch.manual_seed(3)
    want = [fn(x) for _ in range(3)] + [torch.rand(4, device=device)]
    g = gt.graphify(fn)
    torch.manual_seed(3)
    got = [g(x).clone() for _ in range(3)] + [torch.rand(4, device=device)]
    assert_close(got, want)


def test_saving_and_setting_the_same_state_without_draws_is_eagers():
    def fn(x):
        s = torch.get_rng_state()
        y = x.exp()
        torch.set_rng_state(s)  # a no-op in eager: nothing drew in between
        return y + torch.randn(3)

    x = torch.zeros(3)
    torch.manual_seed(4)
    want = [fn(x) for _ in range(3)] + [torch.rand(4)]
    g = gt.graphify(fn)
    torch.manual_seed(4)
    got = [g(x).clone() for _ in range(3)] + [torch.rand(4)]
    assert_close(got, want)


def test_fork_rng_around_random_ops_is_graphify_error():
    def fn(x):
        with torch.random.fork_rng(devices=[]):  # FORK
            noise = torch.randn(3)
        return x + noise

    # eager draws the same noise on every call, and leaves the generator where it was
    assert torch.equal(fn(torch.zeros(3)), fn(torch.zeros(3)))
    with pytest.raises(gt.GraphifyError) as ei:
        gt.graphify(fn)(torch.zeros(3))
    msg = str(ei.value)
    assert "torch.random.fork_rng()" in msg and "leaves it there" in msg, msg
    assert f"{THIS_FILE}:{line_of(fn, '# FORK')}" in msg, msg
    assert "Fix:" in msg


def test_setting_a_state_saved_outside_the_function_is_graphify_error():
    saved = torch.get_rng_state()

    def fn(x):
        torch.set_rng_state(saved)  # MARK
        return x + torch.rand(3)

    with pytest.raises(gt.GraphifyError) as ei:
        gt.graphify(fn)(torch.zeros(3))
    msg = str(ei.value)
    assert "a state the function did not save from it during this call" in msg, msg
    assert f"{THIS_FILE}:{line_of(fn, '# MARK')}" in msg, msg


def test_a_graphified_model_whose_backward_draws_is_refused_not_replayed():
    """checkpoint(preserve_rng_state=False) around dropout in forward, backward outside: eager draws
    new numbers when .backward() runs; no recording can, so the call is refused (it was silently
    different from call 2 on)."""
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))

        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False, preserve_rng_state=False)

    torch.manual_seed(0)
    m = M()
    g = gt.graphify(m)
    x = torch.ones(2, 4)
    with pytest.raises(gt.GraphifyError, match="preserve_rng_state=True") as info:
        for _ in range(3):
            m.zero_grad()
            g(x).sum().backward()
    assert "backward pass of the function draws random numbers" in str(info.value)
    with torch.no_grad():  # not differentiated: no backward, nothing to refuse
        g(x)


def test_checkpointed_attention_without_dropout_is_not_a_draw():
    """scaled_dot_product_attention(dropout_p=0.0) under checkpoint(preserve_rng_state=True): eager's
    generator does not move, so nothing is replayed wrong. Before: refused as a draw after the
    recompute set the generator back (blocked gradient checkpointing of Llama-style models)."""
    import copy

    import torch.nn.functional as F

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True).transpose(1, 2).reshape(2, 5, 16)

    torch.manual_seed(0)
    models = [Attn()]
    models.append(copy.deepcopy(models[0]))
    steps = []
    for m in models:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, m=m, opt=opt):
            opt.zero_grad()
            loss = checkpoint(m, x, use_reentrant=False).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()

        steps.append(step)
    g = gt.graphify(steps[1])
    for i in range(4):
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(i))
        assert_close(g(x), steps[0](x))
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert_close(q, p)
    assert g.cache_info().hits >= 2


@pytest.mark.parametrize("source", ["numpy", "random", "random_instance", "numpy_generator", "numpy_randomstate"])
def test_host_random_numbers_are_refused_and_the_host_generator_left_as_it_was(source):
    """np.random / random inside the function, or a generator object it reaches (epsilon-greedy,
    stochastic depth, mixup): the trace's draws would be constants of every replay (Hugging Face's
    SpecAugment masks). Before: silently the same numbers on every call."""
    import random

    import numpy as np

    gens = {"random_instance": random.Random(0), "numpy_generator": np.random.default_rng(0),
            "numpy_randomstate": np.random.RandomState(0)}

    def step(x):
        if source == "numpy":
            k = np.random.randint(0, 4)
        elif source == "random":
            k = random.randint(0, 3)
        elif source == "random_instance":
            k = gens[source].randint(0, 3)
        else:
            k = int(gens[source].integers(0, 4) if source == "numpy_generator" else gens[source].randint(0, 4))
        return x * 2 + k

    np.random.seed(0)
    random.seed(0)

    def states():
        g = gens.get(source)
        own = None if g is None else (g.bit_generator.state if source == "numpy_generator" else
                                      g.get_state()[2] if source == "numpy_randomstate" else g.getstate())
        return np.random.get_state()[2], random.getstate(), own

    before = states()
    with pytest.raises(gt.GraphifyError, match=r"(?s)draws random numbers on the host.*Fix: draw them with torch"):
        gt.graphify(step)(torch.ones(2))
    assert states() == before


def test_reentrant_checkpoint_in_a_graphified_module_names_use_reentrant_false():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            return self.b(checkpoint(lambda h: torch.tanh(self.a(h)), x, use_reentrant=True))

    gm = gt.graphify(M())
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(gt.GraphifyError, match=r"(?s)CheckpointFunction.*Fix: pass use_reentrant=False"):
        for _ in range(3):
            gm(x).sum().backward()

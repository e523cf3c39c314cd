#!/usr/bin/env python3
"""The real programs of issue #9, each in its own process: eager's numbers, or a clear error.

    python benchmarks/real_programs.py --device cuda        # every program, a table at the end
    python benchmarks/real_programs.py --device cpu --only counter,kv_cache

Each program runs the same code eagerly and through ``gt.graphify`` from the same
initial state and prints one line: ``OK`` with the largest difference, ``REFUSED``
with the first line of the GraphifyError (where refusing is the documented answer),
or ``WRONG`` / ``CRASH``. Programs that need transformers are skipped without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import gtransform as gt
except ImportError:  # running from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gtransform as gt

PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


def _mlp(dev, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dev)


def _maxdiff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


@program
def gpt2_logits(dev):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)).to(dev).eval()
    ids = torch.randint(0, 500, (2, 16), device=dev)
    with torch.no_grad():
        ref = m(ids).logits
        f = gt.graphify(lambda ids: m(ids).logits)
        got = [f(ids).clone() for _ in range(3)]
        out = gt.graphify(m)(ids)
    assert type(out.logits) is torch.Tensor
    return _maxdiff([ref] * 4, got + [out.logits])


@program
def gpt2_dynamic_cache(dev):
    """graphify(model) returns the DynamicCache HF makes (use_cache on): eager's keys and values,
    and eager decoding goes on from it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64)).to(dev).eval()
    ids = torch.randint(0, 500, (2, 16), device=dev)
    g = gt.graphify(m)
    with torch.no_grad():
        ref = m(ids)
        for _ in range(3):
            out = g(ids)
        assert type(out.past_key_values) is type(ref.past_key_values)
        got = [out.logits] + [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        want = [ref.logits] + [t for layer in ref.past_key_values.layers for t in (layer.keys, layer.values)]
        nxt = ids[:, -1:]
        got.append(m(nxt, past_key_values=out.past_key_values).logits)
        want.append(m(nxt, past_key_values=ref.past_key_values).logits)
    return _maxdiff(want, got)


@program
def grad_step_int_targets(dev):
    """graphify(grad_and_value(loss)) with cross_entropy and int64 targets, after other CUDA work."""
    junk = [torch.full((256,), 10**9, dtype=torch.int64, device=dev) for _ in range(32)]
    del junk
    torch.manual_seed(0)
    params = {"w": torch.randn(16, 10, device=dev), "b": torch.zeros(10, device=dev)}

    def loss(p, x, y):
        return F.cross_entropy(x @ p["w"] + p["b"], y)

    g = gt.graphify(torch.func.grad_and_value(loss))
    diffs = []
    for _ in range(5):
        x = torch.randn(32, 16, device=dev)
        y = torch.randint(0, 10, (32,), device=dev)
        (gw, v), (ew, ev) = g(params, x, y), torch.func.grad_and_value(loss)(params, x, y)
        diffs.append(max(_maxdiff(list(gw.values()), list(ew.values())), (v - ev).abs().item()))
    return max(diffs)


def _whole_step(dev, make_opt, graph, steps=20):
    model = _mlp(dev)
    opt = make_opt(model.parameters())

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    f = gt.graphify(step) if graph else step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        f(torch.randn(8, 6, generator=g).to(dev), torch.randn(8, 3, generator=g).to(dev))
    return [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]


def _step_program(make):
    def run(dev):
        want = _whole_step(dev, make(dev), graph=False)
        got = _whole_step(dev, make(dev), graph=True)
        return _maxdiff(want, got)
    return run


for _name, _make in {
    "step_sgd": lambda dev: lambda p: torch.optim.SGD(p, lr=0.05),
    "step_sgd_momentum": lambda dev: lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "step_adam": lambda dev: lambda p: torch.optim.Adam(p, lr=1e-2),
    "step_adam_capturable": lambda dev: lambda p: torch.optim.Adam(p, lr=1e-2, capturable=dev == "cuda"),
    "step_adamw_capturable_foreach": lambda dev: lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=dev == "cuda", foreach=True),
}.items():
    PROGRAMS[_name] = _step_program(_make)


@program
def counter(dev):
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros((), device=dev))

        def forward(self, x):
            self.n += 1
            return x * self.n

    m = C()
    f = gt.graphify(m)
    got = [f(torch.ones(1, device=dev)).item() for _ in range(3)]
    assert got == [1.0, 2.0, 3.0], got
    return 0.0


@program
def data_assign_and_rebind(dev):
    lin = nn.Linear(2, 1).to(dev)
    nn.init.constant_(lin.weight, 1.0)
    nn.init.constant_(lin.bias, 1.0)
    f = gt.graphify(lambda x: lin(x))
    x = torch.ones(2, device=dev)
    with torch.no_grad():
        got = [f(x).item(), f(x).item()]
        lin.weight.data = torch.zeros(1, 2, device=dev)
        got.append(f(x).item())
        lin.weight = nn.Parameter(torch.zeros(1, 2, device=dev))
        got.append(f(x).item())
    assert got == [3.0, 3.0, 1.0, 1.0], got
    return 0.0


def _tiny_llama(dev):
    """A 2-layer HF Llama (random init) and its config, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).to(dev).eval()


@program
def llama_static_cache(dev):
    from transformers import StaticCache

    cfg, model = _tiny_llama(dev)

    def run(graph):
        cache = StaticCache(config=cfg, max_cache_len=32)

        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

        f = gt.graphify(step) if graph else step
        tok, outs = torch.tensor([[1]], device=dev), []
        with torch.no_grad():
            for t in range(12):
                lg = f(tok, torch.tensor([t], device=dev))
                outs.append(lg.clone())
                tok = lg[:, -1:].argmax(-1)
        return outs

    return _maxdiff(run(False), run(True))


@program
def llama_cache_after_grad_mode_call(dev):
    """A decode step called once outside no_grad (its StaticCache's tensors then carry
    autograd history), then decoding under no_grad: eager's logits on every step."""
    from transformers import StaticCache

    cfg, model = _tiny_llama(dev)

    def run(graph):
        cache = StaticCache(config=cfg, max_cache_len=32)

        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, position_ids=pos.view(1, 1), use_cache=True).logits

        f = gt.graphify(step) if graph else step
        tok = torch.tensor([[1]], device=dev)
        outs = [f(tok, torch.tensor([0], device=dev)).detach().clone()]  # grad mode: the first call
        with torch.no_grad():
            for t in range(1, 10):
                lg = f(tok, torch.tensor([t], device=dev))
                outs.append(lg.clone())
                tok = lg[:, -1:].argmax(-1)
        return outs

    return _maxdiff(run(False), run(True))


@program
def log_append(dev):
    log = []

    def f(x):
        y = x * 2
        log.append(y)
        return y + 1

    gt.graphify(f)(torch.ones(2, device=dev))
    raise AssertionError("no error")


@dataclasses.dataclass
class _Out:
    a: torch.Tensor


@program
def containers_out(dev):
    x = torch.ones(2, device=dev)
    o = gt.graphify(lambda x: _Out(x * 2))(x)
    assert type(o.a) is torch.Tensor
    d = gt.graphify(lambda x: torch.distributions.Normal(x, x.exp(), validate_args=False))(x)
    assert type(d) is torch.distributions.Normal
    return (d.log_prob(x) - torch.distributions.Normal(x, x.exp()).log_prob(x)).abs().max().item()


@program
def eval_and_hooks(dev):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(dev)
    g = gt.graphify(m)
    x = torch.ones(1, 64, device=dev)
    with torch.no_grad():
        g(x)
        g(x)
        m.eval()
        d1 = (g(x) - m(x)).abs().max().item()
        h = m[0].register_forward_hook(lambda mod, i, o: o * 0)
        d2 = g(x).abs().max().item()
        h.remove()
    return max(d1, d2)


def _train_like_eager(make_model, make_batch, loss_fn, steps=8):
    """Train a copy of a model through ``gt.graphify(model)`` (train mode: BatchNorm
    statistics, dropout) next to eager, with SGD momentum and the same seed per step;
    returns the largest difference of any parameter or buffer after any step."""
    import copy

    torch.backends.cudnn.deterministic = True  # eager's own convolutions may differ run to run
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    ref = make_model().train()
    mod = copy.deepcopy(ref)
    g = gt.graphify(mod)
    batch = make_batch()
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ref, mod)]
    worst = 0.0
    for step in range(steps):
        for f, opt in ((ref, opts[0]), (g, opts[1])):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            loss_fn(f(batch[0]), batch[1]).backward()
            opt.step()
        worst = max(worst, _maxdiff(list(ref.state_dict().values()), list(mod.state_dict().values())))
    assert g.cache_info().currsize == 1, g.cache_info()
    return worst


@program
def train_bn_dropout(dev):
    """Linear-BatchNorm-ReLU-Dropout trained through graphify(model)."""
    return _train_like_eager(
        lambda: nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1)).to(dev),
        lambda: (torch.randn(32, 16, device=dev), torch.randn(32, 1, device=dev)),
        F.mse_loss,
    )


@program
def train_resnet18(dev):
    """torchvision resnet18 (BatchNorm, in-place ReLU, residuals), int64 targets."""
    import torchvision

    return _train_like_eager(
        lambda: torchvision.models.resnet18(num_classes=10).to(dev),
        lambda: (torch.randn(8, 3, 64, 64, device=dev), torch.randint(0, 10, (8,), device=dev)),
        F.cross_entropy,
    )


@program
def train_gpt2(dev):
    """HF GPT-2 in train mode: dropout in attention (fused SDPA) and MLP."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return _train_like_eager(
        lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=500, n_positions=64)).to(dev),
        lambda: (torch.randint(0, 500, (2, 32), device=dev), None),
        lambda out, _: out.logits.float().pow(2).mean(),
    )


REFUSALS = {"log_append"}  # a GraphifyError is the documented answer
CPU_REFUSALS = {"step_adam", "step_adam_capturable", "step_adamw_capturable_foreach"}


def run_one(name: str, dev: str) -> int:
    try:
        diff = PROGRAMS[name](dev)
    except ImportError as e:
        print(f"{name:32s} SKIPPED ({e})")
        return 0
    except gt.GraphifyError as e:
        refused_ok = name in REFUSALS or (dev == "cpu" and name in CPU_REFUSALS) or (dev == "cuda" and name == "step_adam")
        print(f"{name:32s} {'REFUSED' if refused_ok else 'CRASH'}: {str(e).splitlines()[0][:150]}")
        return 0 if refused_ok else 1
    except Exception as e:
        print(f"{name:32s} CRASH: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")
        traceback.print_exc(limit=4)
        return 1
    ok = diff <= 1e-5
    print(f"{name:32s} {'OK' if ok else 'WRONG'} (max difference from eager {diff:.2e})")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        return run_one(a.one, a.device)
    names = [n for n in PROGRAMS if not a.only or n in a.only.split(",")]
    bad = 0
    for n in names:  # each program in its own process: a device-side assert cannot take the others down
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", n, "--device", a.device],
                           capture_output=True, text=True, timeout=300)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(n)]
        print(lines[-1] if lines else f"{n:32s} CRASH (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        bad += r.returncode != 0
    print(f"{len(names) - bad} of {len(names)} programs give eager's numbers or a clear error on {a.device}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

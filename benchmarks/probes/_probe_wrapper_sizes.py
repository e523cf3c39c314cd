#!/usr/bin/env python3
"""New batch sizes (and lengths: gpt2) of a model trained through the autograd wrapper (``loss.backward()`` outside the
graphified function): seconds per call, traces made, and the largest difference from eager's
gradients. Issue #36 item 1: a new size costs a capture (forward and backward), not a trace.
``python benchmarks/probes/_probe_wrapper_sizes.py [resnet18|gpt2|mlp] [cuda|cpu]``; each model in its own
process. See benchmarks/NOTES.md.
"""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import torch  # noqa: E402

import gtransform as gt  # noqa: E402
import gtransform._lookup as lookup  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "mlp"
dev = sys.argv[2] if len(sys.argv) > 2 else "cuda"
torch.manual_seed(0)
lm = which == "gpt2"
if lm:  # HF GPT-2 (4 layers) fine-tuned as a language model over (batch, length)
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).to(dev)
elif which == "resnet18":
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).to(dev).eval()  # (eval: BatchNorm's stats unchanged)
    shape = (3, 64, 64)
else:
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                torch.nn.GELU(), torch.nn.Linear(1024, 10)).to(dev)
    shape = (256,)
ref = copy.deepcopy(model)
made = []
real = lookup.trace


def counting(*a, **kw):
    made.append(a[4])
    return real(*a, **kw)


lookup.trace = counting
if lm:
    f = gt.graphify(lambda ids: model(input_ids=ids, labels=ids).loss)
    sizes = [(4, 32), (4, 32), (4, 48), (4, 40), (8, 40), (8, 64), (2, 24), (6, 80), (3, 33), (4, 48), (8, 64)]
else:
    f = gt.graphify(model)
    sizes = [8, 8, 12, 16, 20, 24, 32, 48, 64, 12, 16]


def batch(n):
    if lm:
        return (torch.randint(0, 50257, n, device=dev),)
    return torch.randn(n, *shape, device=dev), torch.randint(0, 10, (n,), device=dev)


def loss(fn, inputs):
    if lm:
        return fn(inputs[0]) if fn is f else fn(input_ids=inputs[0], labels=inputs[0]).loss
    return torch.nn.functional.cross_entropy(fn(inputs[0]), inputs[1])


rows = []
for n in sizes:
    inputs = batch(n)
    before = len(made)
    t = time.perf_counter()
    loss(f, inputs).backward()
    if dev == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    loss(ref, inputs).backward()
    err = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    rows.append((n, dt, len(made) - before, err))
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = q.grad = None
print(f"{which} on {dev}, torch {torch.__version__}")
print("| batch | seconds | traces | max grad diff |")
for n, dt, k, err in rows:
    print(f"| {n} | {dt:.3f} | {k} | {err:.1e} |")
print(f"total traces {len(made)}, total seconds {sum(r[1] for r in rows):.2f}")

"""Real program: a whole training step (forward, loss, backward, Adam) closed over a model.

What `gt.graphify(step)` must get right here is state: the model's parameters, their
gradients and Adam's moments are reached, not passed, and updated in place once per call.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from ..core import Instance, seeded

# 9. training step: MLP + Adam(capturable=True), closed over -------------------

ADAM_SIZES, ADAM_BATCH = (128, 512, 512, 512, 10), 64


def train_adam_factory(dev):
    seeded()
    layers: List[torch.nn.Module] = []
    for i in range(len(ADAM_SIZES) - 1):
        layers.append(torch.nn.Linear(ADAM_SIZES[i], ADAM_SIZES[i + 1]))
        if i < len(ADAM_SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    # capturable=True keeps the step count on the device (needed for capture); the CPU has no capturable Adam
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=dev.type == "cuda")

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return Instance(step, state=lambda: [p for p in model.parameters()], mgc_module=model,
                    mgc_args=lambda a: a[:1], keep=(model, opt))


def train_adam_args(dev):
    return (torch.randn(ADAM_BATCH, ADAM_SIZES[0], device=dev), torch.randn(ADAM_BATCH, ADAM_SIZES[-1], device=dev))

"""Real program: torchvision's resnet18 at batch 1, the module graphified whole."""

from __future__ import annotations

import torch

from ..core import Instance, need, seeded

# 8. resnet18 inference, batch 1 (eval, no_grad) --------------------------------


def resnet18_factory(dev):
    tv = need("torchvision.models", "torchvision")
    seeded()
    model = tv.resnet18(weights=None).eval().to(dev)
    return Instance(model, mgc_module=model)  # gt: gt.graphify(model)


def resnet18_args(dev):
    return (torch.randn(1, 3, 224, 224, device=dev),)

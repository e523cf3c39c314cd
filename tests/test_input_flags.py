"""An input the function makes require grad (``x.requires_grad_()`` inside) is left so, as eager leaves it.

The forces of a learned potential, ``-autograd.grad(E(x), x)``, are written this way. The
recording replays the values; the caller's tensor must come back requiring grad too, and an
output that eager would make differentiable through that input is refused with the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt


def _energy(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_forces_of_a_potential_leave_the_input_requiring_grad_as_eager_does(device, path, monkeypatch):
    import gtransform._replay as replay

    if path == "generic":
        monkeypatch.setattr(replay, "_install_fast_path", lambda *a: None)
    net = _energy(device)

    def forces(pos):
        pos.requires_grad_(True)
        e = net(pos).sum()
        (g,) = torch.autograd.grad(e, pos)
        return e.detach(), -g

    f = gt.graphify(forces)
    for _ in range(4):
        pos = torch.randn(5, 3, device=device)
        ref = pos.clone()
        assert_close(f(pos), forces(ref))
        assert pos.requires_grad and ref.requires_grad and pos.grad is None
    # the same tensor again, now requiring grad (another signature)
    assert_close(f(pos), forces(ref))


def test_an_output_differentiable_through_an_input_made_to_require_grad_is_refused():
    def fn(x):
        x.requires_grad_()
        return (x * 2).sum()

    f = gt.graphify(fn)
    with pytest.raises(gt.GraphifyError, match=r"(?s)makes its input args\[0\] require grad.*requires_grad_\(\) before"):
        f(torch.ones(3))
    x = torch.ones(3).requires_grad_()
    out = f(x)  # (what the message says: the recording differentiates through it)
    out.backward()
    assert_close(x.grad, torch.full((3,), 2.0))

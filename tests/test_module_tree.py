"""The module tree is part of a recording's environment: a replaced, added or removed
submodule, or a module whose class changed (parametrizations), records again."""

import copy

import pytest
import torch
import torch.nn as nn
from conftest import assert_close

import gtransform as gt


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 6), nn.ReLU())
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(self.body(x))


def _replace_fc(m):
    m.fc = nn.Linear(6, 2)


def _replace_in_sequential(m):
    m.body[1] = nn.GELU()


def _append(m):
    m.body.append(nn.Tanh())


def _delete_and_readd(m):
    del m.body[1]
    m.body.append(nn.Sigmoid())


CHANGES = {"replace-attribute": _replace_fc, "replace-in-sequential": _replace_in_sequential,
           "append": _append, "delete": _delete_and_readd}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("form", ["module", "closure"])
def test_a_submodule_changed_between_calls_is_seen(device, change, form):
    torch.manual_seed(0)
    m = Net().to(device)
    g = gt.graphify(m) if form == "module" else gt.graphify(lambda x: m(x))
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        for k in range(5):
            if k == 2:
                torch.manual_seed(k)
                CHANGES[change](m)
                m.to(device)
            assert_close(g(x), m(x))


def test_training_after_the_head_is_replaced_trains_the_new_head(device):
    torch.manual_seed(0)
    eager = Net().to(device)
    mod = copy.deepcopy(eager)
    g = gt.graphify(mod)
    x, y = torch.randn(8, 3, device=device), torch.randn(8, 2, device=device)
    for k in range(5):
        if k == 2:
            torch.manual_seed(5)
            eager.fc = nn.Linear(6, 2).to(device)
            torch.manual_seed(5)
            mod.fc = nn.Linear(6, 2).to(device)
        for m, f in ((eager, eager), (mod, g)):
            m.zero_grad()
            torch.nn.functional.mse_loss(f(x), y).backward()
        for p, q in zip(eager.parameters(), mod.parameters()):
            assert q.grad is not None
            assert_close(q.grad, p.grad)


def test_removing_a_parametrization_is_seen(device):
    from torch.nn.utils import parametrize

    class Sym(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).transpose(-1, -2)

    torch.manual_seed(0)
    lin = nn.Linear(3, 3).to(device)
    parametrize.register_parametrization(lin, "weight", Sym())
    g = gt.graphify(lin)
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        for k in range(4):
            if k == 2:
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
            assert_close(g(x), lin(x))


def test_the_retrace_explanation_names_the_changed_submodule(device, caplog):
    import logging

    torch.manual_seed(0)
    m = Net().to(device)
    g = gt.graphify(m)
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        g(x), g(x)
        m.fc = nn.Linear(6, 2).to(device)
        with caplog.at_level(logging.INFO, logger="gtransform"):
            g(x)
    assert "submodules of" in caplog.text


def test_an_unchanged_tree_does_not_record_again(device):
    torch.manual_seed(0)
    m = Net().to(device)
    g = gt.graphify(m)
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        for _ in range(3):
            g(x)
        misses = g.cache_info().misses
        m.fc = m.fc  # the same object put back
        m.body[1] = m.body[1]
        for _ in range(3):
            g(x)
    assert g.cache_info().misses == misses

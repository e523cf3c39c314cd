import torch
from conftest import assert_close

import gtransform as gt


def test_dict_mlp_matches_eager(device):
    def f(p, x):
        return {"y": (x @ p["w"]).relu() + p["b"], "n": 3}

    g = gt.graphify(f)
    p = {"w": torch.randn(4, 3, device=device), "b": torch.randn(3, device=device)}
    for _ in range(4):
        x = torch.randn(2, 4, device=device)
        assert_close(g(p, x), f(p, x))
    assert g.cache_info().misses == 1
    assert g.cache_info().hits == 3


def test_compiled_code_calls_a_graphified_function(device):
    """Under torch.compile a call of a graphified function is a graph break: it records
    once and replays, with eager's numbers; graphify over a compiled function works too."""
    f = lambda x: (x.sin() * 2).cos()  # noqa: E731
    g = gt.graphify(f)
    c = torch.compile(lambda x: g(x * 3) + 1, backend="eager")
    for _ in range(3):
        x = torch.randn(5, device=device)
        torch.testing.assert_close(c(x), f(x * 3) + 1)
    assert (g.cache_info().misses, g.cache_info().hits) == (1, 2)
    h = gt.graphify(torch.compile(f, backend="eager"))
    x = torch.randn(5, device=device)
    torch.testing.assert_close(h(x), f(x))

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

"""fuse=True keeps eager's precision casts (inductor's emulate_precision_casts).

On the CPU too: inductor compiles C++ there (a few seconds), so one test covers the casts.
"""

import pytest
import torch
from conftest import assert_close

import gtransform as gt


def casts(x):
    return {
        "round_trip": x.half().float(),  # was x itself: the cast was elided
        "bf16_mul": x.to(torch.bfloat16) * 3,  # multiplied the unrounded value
        "bf16_back": (x.to(torch.bfloat16) * 3).float() + 1,
        "mixed": (x.to(torch.bfloat16) * 3).float().sin() + x.half(),
    }


def test_fused_precision_casts_round_as_eager(device):
    f = gt.graphify(casts, fuse=True)
    for _ in range(2):
        x = torch.randn(1000, device=device) * 10
        got, want = f(x), casts(x)
        for k in ("round_trip", "bf16_mul", "bf16_back"):
            assert got[k].dtype == want[k].dtype
            assert torch.equal(got[k], want[k]), k  # a cast is exact: bit for bit
        assert_close(got["mixed"], want["mixed"])  # (sin: within float32 rounding)
    assert f.cache_info().hits == 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])

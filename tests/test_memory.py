"""What a recording costs in device memory (issue #36 item 2), against eager in the same process.

The promise: the first calls' peak (the eager first call, the warm-up, the capture) stays within
eager's peak plus the static buffers and outputs plus 10%, and what they leave reserved within
1.3x eager's; the warm-up's transient memory goes back. And ``describe()`` reports the bytes.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

import gtransform as gt

MiB = 2 ** 20

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _measure(f, args, calls, same=False):
    """Peak allocated and reserved above what was in use before ``calls`` calls; the last output.

    Each call gets a new batch (copies of ``args``, made beforehand), as in a training loop, or
    with ``same`` the very same tensors (their second call records again, to read them in place).
    """
    batches = [args if same else tuple(a.clone() for a in args) for _ in range(calls)]
    base_a, base_r = _settle()
    torch.cuda.reset_peak_memory_stats()
    out = None
    for batch in batches:
        out = f(*batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base_a, torch.cuda.memory_reserved() - base_r, out


def _adam_step(width=1024, depth=8, batch=256):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = torch.randn(batch, width, device="cuda"), torch.randn(batch, width, device="cuda")
    step(x, y)  # set-up: Adam's moments exist, as in a training loop's steady state
    return step, (x, y), model


_SAME_TENSORS_RESERVE_TWICE = pytest.mark.xfail(strict=True, reason=(
    "issue #36 item 2, not met: with the very same tensors each call the second call records the "
    "step again (to read them in place), and the pool then reserves 64 MiB against eager's 30 (H200). "
    "Releasing the first recording's references to its gradients before the second capture, and "
    "capturing the second without a warm-up, did not move it (tried, measured, taken out); the holder "
    "of the extra 32 MiB is not identified"))


@pytest.mark.parametrize("same", [False, pytest.param(True, marks=_SAME_TENSORS_RESERVE_TWICE)],
                         ids=["new-batches", "same-tensors"])
def test_a_training_steps_first_calls_stay_within_eagers_peak(same):
    step, args, model = _adam_step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    eager_peak, eager_reserved, _ = _measure(step, args, 3, same)
    f = gt.graphify(step)
    peak, reserved, out = _measure(f, args, 3, same)
    assert f.cache_info().currsize == 1 and out is not None
    bufs = sum(a.numel() * a.element_size() for a in args) + out.numel() * out.element_size()
    # without the warm-up's host snapshot, its device copies of the parameters and both moments
    # (3x the weights) came on top of eager's peak
    assert peak <= 1.10 * eager_peak + bufs + 2 * MiB, (peak / MiB, eager_peak / MiB, params / MiB)
    assert reserved <= 1.30 * max(eager_reserved, eager_peak) + bufs + 2 * MiB, (
        reserved / MiB, eager_reserved / MiB, _segments())


def _segments():
    """Reserved MiB by (memory pool, stream): what a failed bound is made of."""
    out: dict = {}
    for s in torch.cuda.memory_snapshot():
        k = (tuple(s.get("segment_pool_id", (0, 0))), s.get("stream", 0))
        out[k] = out.get(k, 0) + s["total_size"] // MiB
    return out


def test_the_warm_up_leaves_nothing_cached_outside_the_pool():
    lin = torch.nn.Linear(512, 512).cuda()
    x = torch.randn(64, 512, device="cuda")

    def fn(x):
        with torch.no_grad():
            return lin(x).relu().sum(0)

    fn(x)  # eager's own workspaces exist
    base_a, base_r = _settle()
    f = gt.graphify(fn)
    for _ in range(3):  # (the first call of a function that reaches state runs eagerly)
        f(x.clone())
    assert f._tls.state.last.rec is not None
    torch.cuda.synchronize()
    private = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                  if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    outside = torch.cuda.memory_reserved() - base_r - private
    # what is reserved beyond the graph pool: the static input buffer, in the caching allocator's
    # 2 MiB blocks at most (before: the warm-up's side-stream blocks and a second cuBLAS workspace)
    assert outside <= 2 * MiB, outside / MiB


def test_describe_reports_the_bytes_a_recording_holds():
    x = torch.randn(256, 1024, device="cuda")
    f = gt.graphify(lambda x: (x @ x.T).relu())
    f(x)
    line = next(ln for ln in f.describe().splitlines() if ln.strip().startswith("bytes:"))
    assert "static input buffers 1.0 MiB" in line
    assert "outputs 262144 B per generation, 1 generation(s)" in line
    pool = float(line.split("shared by its signatures: ")[1].split(" MiB")[0])
    assert pool >= 0.25  # the pool holds the output at least


_WARM_UP_RAISES = [True]


@torch.library.custom_op("gt_tests::raises_when_run", mutates_args=())
def _raises_when_run(x: torch.Tensor) -> torch.Tensor:
    if _WARM_UP_RAISES[0]:
        raise RuntimeError("raised by the function's own code when run")
    return x * 2


@_raises_when_run.register_fake
def _(x):
    return torch.empty_like(x)


def _pool_of(t):
    """The id of the memory pool ``t``'s memory was allocated in ((0, 0): the caching allocator's own)."""
    addr = t.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= addr < seg["address"] + seg["total_size"]:
            return tuple(seg.get("segment_pool_id", (0, 0)))
    raise AssertionError("no segment holds the tensor")


def test_a_warm_up_that_raises_leaves_the_pool_usable_and_allocations_back_outside_it():
    # the warm-up allocates in the graph pool: whatever it raises, the routing ends and the
    # pool stays held (before its keeper, a raising warm-up dropped the pool's use count to 0
    # and the next recording into it tripped the allocator's assert)
    f = gt.graphify(lambda x: _raises_when_run(x).relu() + 1)
    x = torch.randn(1024, device="cuda")
    _WARM_UP_RAISES[0] = True
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="raised by the function's own code"):
                f(x)
            # this thread's allocations are the caching allocator's again, not the pool's
            assert _pool_of(torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")) == (0, 0)
    finally:
        _WARM_UP_RAISES[0] = False
    for _ in range(3):
        assert torch.equal(f(x), (x * 2).relu() + 1)
    assert f.cache_info().currsize == 1
    y = f(x)
    assert _pool_of(y) != (0, 0)  # the output lives in the graph pool
    g = gt.graphify(lambda x: x.cos() * 3)
    assert torch.allclose(g(x), x.cos() * 3)

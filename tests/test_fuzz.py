"""Random call sequences mixing good and bad inputs on one graphified function:
every good call is right, every bad call raises the right error, and the
function keeps working."""

import pytest
import torch
from conftest import assert_close, stale
from hypothesis import given, settings
from hypothesis import strategies as st

import gtransform as gt


def body(x, cfg):
    mode = cfg["mode"]
    if mode == "item":
        return x * x.sum().item()  # data-dependent: GraphifyError
    if mode == "raise":
        raise ValueError("user error from fn")
    if mode == "mutate":
        x.mul_(cfg["k"])
        return x.sum()
    return {"y": (x * cfg["k"]).sin(), "n": cfg["k"]}


ACTIONS = st.one_of(
    st.tuples(st.just("good"), st.sampled_from([(3,), (2, 2), ()]), st.sampled_from([1.0, 2.0, -0.5])),
    st.tuples(st.just("mutate"), st.sampled_from([(3,), (4,)]), st.sampled_from([2.0, 3.0])),
    st.tuples(st.just("item"), st.just((3,)), st.just(1.0)),
    st.tuples(st.just("raise"), st.just((3,)), st.just(1.0)),
    st.tuples(st.just("unhashable"), st.just((3,)), st.just(1.0)),
    st.tuples(st.just("arity"), st.just((3,)), st.just(1.0)),
    st.tuples(st.just("stale"), st.just((3,)), st.just(1.0)),
)


@settings(max_examples=30, deadline=None)
@given(actions=st.lists(ACTIONS, min_size=1, max_size=25), seed=st.integers(0, 1000))
def test_mixed_good_and_bad_calls(actions, seed):
    _run(actions, seed, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=15, deadline=None)
@given(actions=st.lists(ACTIONS, min_size=1, max_size=25), seed=st.integers(0, 1000))
def test_mixed_good_and_bad_calls_cuda(actions, seed):
    _run(actions, seed, "cuda")


def _run(actions, seed, device):
    f = gt.graphify(body)
    gen = torch.Generator().manual_seed(seed)
    last = None
    for kind, shape, k in actions:
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
        if kind == "good":
            out = f(x, {"mode": "good", "k": k})
            assert_close(out, body(x.clone(), {"mode": "good", "k": k}))
            last = out
        elif kind == "mutate":
            xe = x.clone()
            want = body(xe, {"mode": "mutate", "k": k})
            got = f(x, {"mode": "mutate", "k": k})
            assert_close(got, want)
            assert_close(x, xe)
        elif kind == "item":
            with pytest.raises(gt.GraphifyError, match="Fix:"):
                f(x, {"mode": "item", "k": k})
        elif kind == "raise":
            with pytest.raises(ValueError, match="user error from fn"):
                f(x, {"mode": "raise", "k": k})
        elif kind == "unhashable":
            with pytest.raises(TypeError, match=r"args\[1\]\['k'\]"):
                f(x, {"mode": "good", "k": {1, 2}})
        elif kind == "arity":
            with pytest.raises(TypeError, match="missing 1 required positional argument: 'cfg'"):
                f(x)
        elif kind == "stale":
            if last is not None:
                f(x, {"mode": "good", "k": 1.0})
                with pytest.raises(gt.OverwrittenOutputError, match=stale("body")):
                    last["y"].sum()
                last = None
    # still usable afterwards
    x = torch.randn(3, generator=gen, dtype=torch.float64).to(device)
    assert_close(f(x, {"mode": "good", "k": 2.0}), body(x.clone(), {"mode": "good", "k": 2.0}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_failure_is_graphify_error_and_leaves_no_half_state():
    # an op whose CUDA kernel synchronises with the host: fine when traced
    # (fake implementation), fails inside the driver's stream capture
    @torch.library.custom_op("gt_tests::host_sync", mutates_args=())
    def host_sync(x: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return x * 2

    @host_sync.register_fake
    def _(x):
        return torch.empty_like(x)

    f = gt.graphify(lambda x: host_sync(x) + 1)
    ok = gt.graphify(lambda x: x.cos())
    x = torch.randn(8, device="cuda")
    x_host = x.cpu()
    ok(x)
    torch.manual_seed(0)
    want_rng = torch.randn(4, device="cuda")
    torch.manual_seed(0)
    with pytest.raises(gt.GraphifyError, match="CUDA graph capture failed") as ei:
        f(x)
    assert "Fix:" in str(ei.value)
    # RNG state untouched, eager CUDA, other functions and the same function's pool usable
    assert torch.equal(torch.randn(4, device="cuda"), want_rng)
    # eager CUDA work still computes right numbers (checked against the host)
    assert torch.equal(x.cpu(), x_host)
    assert_close((x * 3).cpu(), x_host * 3)
    assert_close((x.view(2, 4) @ x.view(4, 2)).cpu(), x_host.view(2, 4) @ x_host.view(4, 2))
    assert_close(ok(x).cpu(), x_host.cos())
    g = gt.graphify(lambda x: x + 1)
    assert_close(g(x).cpu(), x_host + 1)
    # a new recording with random ops still follows manual_seed exactly (graph-safe RNG intact)
    r = gt.graphify(lambda x: x + torch.randn_like(x))
    torch.manual_seed(5)
    want = [x + torch.randn_like(x) for _ in range(3)]
    torch.manual_seed(5)
    for w in want:
        assert torch.equal(r(x), w)
    with pytest.raises(gt.GraphifyError, match="(?s)CUDA graph capture failed.*Fix:") as again:
        f(x)  # same error again, no half-state
    # (torch's capture_end had left the pool's allocation routing on, and the second capture
    # failed on that: "beginAllocateToPool: already recording")
    assert "already recording" not in str(again.value)
    assert torch.equal(x.cpu(), x_host)  # the input was never written
    # the function's other signatures still record into its pool
    h = gt.graphify(lambda x: host_sync(x) + 1 if x.shape[0] == 8 else x * 2)
    with pytest.raises(gt.GraphifyError, match="CUDA graph capture failed"):
        h(x)
    x16 = torch.randn(16, device="cuda")
    for _ in range(2):
        assert_close(h(x16).cpu(), x16.cpu() * 2)


def test_a_function_that_keeps_failing_to_capture_takes_at_most_two_new_pools():
    # (the bookkeeping of _record._abandon_pool, without a GPU: each abandoned pool keeps its
    # memory, so a loop that catches the capture error must not take a new pool per call)
    from gtransform._liveness import PoolState
    from gtransform._record import _MAX_ABANDONED, _abandon_pool

    pool = PoolState()
    keepers = []
    for n in range(5):
        pool.cuda_pool, pool.keeper = (0, 100 + n), object()
        keepers.append(pool.keeper)
        _abandon_pool(pool, (0, 100 + n))
        if n < _MAX_ABANDONED:
            assert pool.cuda_pool is None and pool.keeper is None  # the next recording takes a new pool
        else:
            assert pool.cuda_pool == (0, 100 + n) and pool.keeper is keepers[-1]  # kept: no new pool
    assert pool.abandoned == keepers[:_MAX_ABANDONED]  # held with their memory, never dropped
    other = PoolState()
    other.cuda_pool, other.keeper = (0, 7), object()
    _abandon_pool(other, (0, 8))  # a private pool (an output generation's): the function's stays
    assert other.cuda_pool == (0, 7) and not other.abandoned


def test_the_warm_up_drops_only_the_grads_its_call_replaces_and_does_not_read():
    # (_record._drop_replaced_grads, without a GPU: before a CUDA warm-up the first call's eager
    # .grad tensors go, as zero_grad() drops them, so the warm-up and the capture do not hold
    # them beside the new ones; a .grad the graph reads, and other slots, stay)
    from gtransform._record import _drop_replaced_grads
    from gtransform._roots import Slot
    from gtransform._state import EscapeWriter

    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    a.grad, b.grad = torch.randn(3), torch.randn(3)
    holder = {"cache": torch.randn(2)}
    slots = [Slot("grad", a, None, "a.grad"), Slot("grad", b, None, "b.grad"),
             Slot("item", holder, "cache", "holder['cache']")]
    kept_b, kept_cache = b.grad, holder["cache"]
    args = [a.detach(), b.grad[1:]]  # the graph reads a's value and a view of b's gradient
    _drop_replaced_grads(EscapeWriter(slots, "f"), args)
    assert a.grad is None  # replaced by the call, not read: dropped
    assert b.grad is kept_b  # read by the graph: kept
    assert holder["cache"] is kept_cache  # not a .grad: untouched
    _drop_replaced_grads(None, args)  # no escapes: nothing to do

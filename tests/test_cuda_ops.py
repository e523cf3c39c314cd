"""Operations whose CUDA kernels a capture cannot hold as they are: recorded another way,
refused while tracing with their fix, or named (op and line) where the capture fails.

Found by the OpInfo sweep on an H100 (tests/opinfo_sweep.py --device cuda)."""

import pytest
import torch
from conftest import assert_close

import gtransform as gt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.cuda, cuda]
DEV = "cuda"


def test_a_jiterator_kernel_is_recorded():
    # it launched on the trace's placeholders: an illegal memory access, the CUDA context lost
    code = "template <typename T> T fused(T x, T y, T alpha) { return -x + alpha * y; }"
    jf = torch.cuda.jiterator._create_jit_fn(code, alpha=1.0)
    f = gt.graphify(lambda x, y: jf(x, y, alpha=3.0) * 2)
    for _ in range(3):
        x, y = torch.randn(5, device=DEV), torch.randn(5, device=DEV)
        assert_close(f(x, y), jf(x, y, alpha=3.0) * 2)
    assert f.cache_info().hits == 2
    x, y = torch.randn(4, 1, device=DEV, dtype=torch.float16), torch.randn(3, device=DEV)
    got, want = f(x, y), jf(x, y, alpha=3.0) * 2  # broadcast and promoted as jiterator does
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want)


@pytest.mark.parametrize("how", ["masked_fill", "masked_fill_", "index_fill", "index_fill_", "isin"])
def test_kernels_reading_a_value_on_the_host_are_recorded_another_way(how):
    # each synchronised inside its CUDA kernel (value.item(), torch.unique): the capture failed
    def fn(x, m, idx, v, table):
        if how == "masked_fill":
            return x.masked_fill(m, v)
        if how == "masked_fill_":
            return x.clone().masked_fill_(m, v)
        if how == "index_fill":
            return x.index_fill(1, idx, v)
        if how == "index_fill_":
            return x.clone().index_fill_(1, idx, v)
        return torch.isin(x.round(), table), torch.isin(x.round(), table, invert=True)

    g = gt.graphify(fn)
    for _ in range(3):
        x = torch.randn(4, 6, device=DEV) * 3
        x[0, 0] = float("nan")
        args = (x, torch.rand(4, 6, device=DEV) > 0.5, torch.randint(-6, 6, (3,), device=DEV),
                torch.randn((), device=DEV), torch.arange(-300.0, 300.0, device=DEV))
        got, want = g(*args), fn(*args)
        assert_close(got, want)
    assert g.cache_info().hits == 2


def test_linalg_checks_on_the_host_are_refused_with_the_ex_variant():
    f = gt.graphify(lambda A: torch.linalg.inv(A))
    with pytest.raises(gt.GraphifyError, match=r"(?s)torch\.linalg\.inv checks its result on the host.*Fix: use torch\.linalg\.inv_ex"):
        f(torch.randn(3, 3, device=DEV))
    g = gt.graphify(lambda A: torch.linalg.inv_ex(A))
    for _ in range(3):
        A = torch.randn(3, 3, device=DEV) + 3 * torch.eye(3, device=DEV)
        inv, info = g(A)
        assert_close(inv, torch.linalg.inv(A))
        assert info.item() == 0


def test_a_failed_capture_names_the_operation_and_the_line():
    f = gt.graphify(lambda A: torch.linalg.svd(A).S.sum())  # cuSOLVER copies to the host
    with pytest.raises(gt.GraphifyError, match=r"(?s)operation aten\._linalg_svd\.default at .*test_cuda_ops\.py:\d+.*Why: the singular value decomposition"):
        f(torch.randn(4, 4, device=DEV))
    # the function, its pool and eager CUDA work stay usable
    assert_close(torch.ones(2, device=DEV) + 1, torch.full((2,), 2.0, device=DEV))
    h = gt.graphify(lambda x: x * 2)
    for _ in range(2):
        assert_close(h(torch.ones(2, device=DEV)), torch.full((2,), 2.0, device=DEV))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex32, torch.uint64], ids=str)
def test_inputs_of_dtypes_the_foreach_copy_lacks(dtype):
    # torch._foreach_copy_ has no CUDA kernel for them: "not implemented for 'ComplexHalf'"
    if dtype is torch.complex32:
        f = gt.graphify(lambda x: x + x)
        make = lambda: torch.randn(8, device=DEV).to(torch.complex32)  # noqa: E731
    else:
        f = gt.graphify(lambda x: x.clone())
        make = lambda: torch.randint(0, 100, (8,), device=DEV).to(torch.uint64)  # noqa: E731
    for _ in range(3):
        x = make()
        assert torch.equal(f(x).cpu().view(torch.uint8), (x + x if dtype is torch.complex32 else x.clone()).cpu().view(torch.uint8))

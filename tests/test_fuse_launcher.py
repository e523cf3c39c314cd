"""Which code launches fuse=True's own Triton kernels (GTRANSFORM_FUSE_LAUNCHER): ours
(gtransform/fuse/_cubin.py, the default), torch's static launcher (_static.py) or Triton's.

Without a GPU: the choice, and which arguments torch's launcher is handed (the same as
_cubin.plan's, on the fake kernels of test_gemm). Under `cuda`: the kernels' numbers through
each launcher, and a fused program."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close
from test_gemm import _SIG, _FakeCompiled, _ieee, _operands, cuda, mlp, mlp_args  # noqa: F401

import gtransform as gt
from gtransform.fuse import _cubin, _gemm, _gemv, _static, _triton


def test_the_environment_picks_the_launcher(monkeypatch):
    monkeypatch.setattr(_cubin, "launcher", lambda compiled, device: ("cubin", compiled, device))
    monkeypatch.setattr(_static, "launcher", lambda compiled, device: ("torch", compiled, device))
    monkeypatch.delenv("GTRANSFORM_FUSE_LAUNCHER", raising=False)
    assert _triton.launcher("k", 1) == ("cubin", "k", 1)
    for which in ("cubin", "torch"):
        monkeypatch.setenv("GTRANSFORM_FUSE_LAUNCHER", which)
        assert _triton.launcher("k", 1) == (which, "k", 1)
    monkeypatch.setenv("GTRANSFORM_FUSE_LAUNCHER", "triton")
    assert _triton.launcher("k", 1) is None  # Triton's own launch
    monkeypatch.setenv("GTRANSFORM_FUSE_LAUNCHER", "nvrtc")
    with pytest.raises(ValueError, match="GTRANSFORM_FUSE_LAUNCHER='nvrtc'.*cubin, torch, triton"):
        _triton.launcher("k", 1)


class _Param:
    def __init__(self, num, is_constexpr):
        self.num, self.is_constexpr = num, is_constexpr


class _TorchFake(_FakeCompiled):
    launch_enter_hook = launch_exit_hook = None  # where no Triton knobs exist, torch reads these


def _for_torch(signature, constants, constexprs=(4,), **meta):
    """test_gemm's fake kernel, with the rest torch's StaticallyLaunchedCudaKernel reads."""
    compiled = _TorchFake(signature, constants, **meta)
    compiled.src.fn = type("_Fn", (), {"arg_names": compiled.src.fn.arg_names})()
    compiled.src.fn.__name__ = "k"
    compiled.src.fn.params = [_Param(i, i in constexprs) for i in range(len(compiled.src.fn.arg_names))]
    compiled.hash = "0" * 64
    compiled.asm = {"cubin": b"not a cubin"}
    return compiled


@pytest.fixture
def static_kernel(monkeypatch):
    """Torch's class, loading nothing and launching nothing (no GPU here): what it was handed."""
    cls = _static._static_kernel_class()
    seen = {}

    def load_kernel(self, device):
        with open(self.cubin_path, "rb") as f:
            seen.update(device=device, cubin=f.read(), path=self.cubin_path)

    monkeypatch.setattr(cls, "load_kernel", load_kernel)
    monkeypatch.setattr(cls, "run", lambda self, *args: seen.setdefault("runs", []).append(args))
    monkeypatch.setattr(_static, "_LAUNCHERS", {})
    return seen


def test_torch_s_launcher_gets_the_arguments_our_plan_takes(static_kernel):
    compiled = _for_torch(_SIG, {(2,): 1, (4,): 64}, global_scratch_size=0, profile_scratch_size=0)
    run = _static.launcher(compiled, 3)
    assert run is not None and _static.launcher(compiled, 3) is run  # kept per kernel and device
    assert static_kernel["device"] == 3 and static_kernel["cubin"] == b"not a cubin"
    assert not os.path.exists(static_kernel["path"]) and not hasattr(compiled, "_cubin_path")
    steps, _ = _cubin.plan(compiled)
    assert run.keep == [i for i, _ in steps] == [0, 1, 3]
    t = torch.zeros(3)
    run((5, 2), 77, (t, 7, 1, 0.5, 64))
    assert static_kernel["runs"] == [(5, 2, 1, 77, t, 7, 0.5)]
    run((0, 2), 77, (t, 7, 1, 0.5, 64))  # nothing to launch
    assert len(static_kernel["runs"]) == 1


def test_what_torch_s_launcher_refuses_goes_to_triton(static_kernel):
    """None: the caller launches through Triton, as with _cubin."""
    assert _static.launcher(_for_torch(_SIG, {(2,): 1, (4,): 64}, num_ctas=2), 0) is None
    assert _static.launcher(_for_torch(_SIG, {(2,): 1, (4,): 64}, global_scratch_size=128), 0) is None
    assert _static.launcher(object(), 0) is None  # not a compiled kernel at all
    assert "runs" not in static_kernel


# --- on the GPU: each launcher runs the kernels, with eager's numbers --------------------


@pytest.fixture
def launched(monkeypatch):
    """Which launcher classes ran (Triton's own launch counts under neither)."""
    count = {"cubin": 0, "torch": 0}
    for name, cls in (("cubin", _cubin.Launcher), ("torch", _static.Launcher)):
        def counting(self, *args, _name=name, _real=cls.__call__):
            count[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(cls, "__call__", counting)
    return count


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("which", ["cubin", "torch", "triton"])
def test_each_launcher_gives_eager_s_numbers(which, monkeypatch, launched):
    monkeypatch.setenv("GTRANSFORM_FUSE_LAUNCHER", which)
    c = dict(m=33, n=40, k=70, a_t=False, b_t=False, bias="row", act=_gemm.ACT_RELU, mask=True)
    a, b, bias, mask = _operands(c, "cuda")
    want = torch.ops.aten.threshold_backward(torch.addmm(bias, a, b).relu(), mask, 0.0)
    torch.testing.assert_close(_gemm.gemm(a, b, bias, mask, c["act"], 0.0), want, rtol=1e-5, atol=1e-4)
    x = torch.randn(2, 96, device="cuda")
    ws = [torch.randn(n, 96, device="cuda") for n in (64, 32, 32, 16, 8)]  # two launches
    bs = [torch.randn(n, device="cuda") if i % 2 else None for i, n in enumerate((64, 32, 32, 16, 8))]
    for got, w, bb in zip(_gemv.gemv(x, ws, bs), ws, bs):
        torch.testing.assert_close(got, F.linear(x, w, bb), rtol=1e-5, atol=1e-4)
    assert launched == {"cubin": 3 if which == "cubin" else 0, "torch": 3 if which == "torch" else 0}


@pytest.mark.cuda
@cuda
def test_a_fused_program_through_torch_s_launcher_matches_eager(monkeypatch, launched):
    monkeypatch.setenv("GTRANSFORM_FUSE_LAUNCHER", "torch")
    p, x = mlp_args("cuda", batch=64, width=512)
    f = gt.graphify(mlp, fuse=True)
    for i in range(3):
        xi = x + i
        assert_close(f(p, xi), mlp(p, xi))
    assert launched["torch"] > 0 and launched["cubin"] == 0

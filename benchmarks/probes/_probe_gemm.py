"""Probe: GPU time of small float32 products, cuBLAS against gtransform's gemm kernel
(gtransform/fuse/_gemm.py) for each tile configuration, full float32 precision (no TF32).

Each variant is captured in a CUDA graph of REPS back-to-back launches, replayed, and
timed with CUDA events (us per launch, median of 5). Also printed: each configuration's
first-call (compile) time and its largest error against a float64 product.
Run on the GPU machine: python3 benchmarks/probes/_probe_gemm.py (see NOTES.md, "Small float32
products"). `--full` times more configurations of the row-major products.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gputime  # noqa: E402

from gtransform.fuse import _gemm  # noqa: E402

REPS = 20

# round 1 (2026-11-24, H100) swept BM, BN in 16-64, BK 16-128, 1-4 warps: the best were
# (16, 16, 128, 4, 2) for 64-row products and (32, 32|64, 32|64, 4, 2) for 512-row ones
CONFIGS = [
    (16, 16, 64, 4, 2), (16, 16, 128, 4, 2), (16, 16, 128, 4, 3), (16, 16, 128, 8, 2), (16, 16, 256, 4, 2),
    (16, 16, 256, 8, 2), (16, 32, 128, 4, 2), (16, 32, 128, 8, 2), (32, 32, 64, 4, 2), (32, 32, 128, 4, 2),
    (32, 64, 32, 4, 2), (32, 64, 64, 4, 2), (32, 64, 64, 8, 2), (64, 64, 64, 8, 2),
]
# b K-contiguous (x @ w.t(), g @ w.t()): rewrite() leaves these to cuBLAS; timed for the record
# (2026-11-24, H100: 11.6 us at best against cuBLAS's 7.9; summing a (BM, BN, BK) block in
# registers instead of tl.dot: 22 us at best)
QUICK = [(16, 16, 128, 4, 3), (32, 32, 64, 4, 2), (32, 64, 64, 4, 2)]


def gpu_time(fn):
    """Median us per launch of fn() captured REPS times in one graph."""
    return _gputime.gpu_time(fn, n=20, reps=REPS)


def cases(dev):
    r = torch.randn

    def lin(m, n, k):  # act(x @ W + b), row-major operands (a forward layer)
        return dict(a=r(m, k, device=dev), b=r(k, n, device=dev) * k**-0.5, bias=r(n, device=dev), mask=None, act=1)

    def dx(m, n, k):  # threshold_backward(g @ W.t(), h): a backward layer's input gradient
        return dict(a=r(m, k, device=dev), b=r(n, k, device=dev).t(), bias=None, mask=r(m, n, device=dev), act=0)

    def dw(m, n, k):  # h.t() @ g: a backward layer's weight gradient
        return dict(a=r(k, m, device=dev).t(), b=r(k, n, device=dev), bias=None, mask=None, act=0)

    def lin_nt(m, n, k):  # F.linear: x @ w.t() + b, ReLU
        return dict(a=r(m, k, device=dev), b=r(n, k, device=dev).t() * k**-0.5, bias=r(n, device=dev), mask=None,
                    act=1)

    return [
        ("linear fwd 64x512x512", lin_nt(64, 512, 512)),
        ("linear fwd 16x64x64", lin_nt(16, 64, 64)),
        ("fwd 64x512x512", lin(64, 512, 512)),
        ("dx 64x512x512", dx(64, 512, 512)),
        ("dw 512x512x64", dw(512, 512, 64)),
        ("fwd 16x64x64 (RL)", lin(16, 64, 64)),
        ("fwd 512x512x512", lin(512, 512, 512)),
    ]


def main():
    full = "--full" in sys.argv
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for name, c in cases(dev):
        a, b, bias, mask, act = c["a"], c["b"], c["bias"], c["mask"], c["act"]
        ref = _gemm._reference(a.double(), b.double(), None if bias is None else bias.double(),
                               None if mask is None else mask.double(), act, 0.0)
        scale = ref.abs().max().item()

        def cublas(a=a, b=b, bias=bias, mask=mask, act=act):
            out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
            if act:
                out = torch.relu(out)
            if mask is not None:
                out = torch.ops.aten.threshold_backward(out, mask, 0.0)
            return out

        err = (cublas().double() - ref).abs().max().item() / scale
        t = gpu_time(cublas)
        t1 = gpu_time(lambda a=a, b=b, bias=bias: torch.mm(a, b) if bias is None else torch.addmm(bias, a, b))
        line = f"{name:22s} cuBLAS+epilogue {t:6.2f} us (product alone {t1:6.2f}, err {err:.1e})"
        if bias is not None and act:
            t2 = gpu_time(lambda a=a, b=b, bias=bias: torch._addmm_activation(bias, a, b))
            line += f", cuBLASLt relu epilogue {t2:6.2f}"
        print(line, flush=True)
        m, k = a.shape
        n = b.shape[1]
        best = None
        for cfg in (CONFIGS if full and m * n * k <= 2**24 else QUICK):
            t0 = time.perf_counter()
            try:
                out = _gemm._launch(a, b, bias, mask, act, 0.0, cfg)
                torch.cuda.synchronize()
            except Exception as e:  # a configuration Triton cannot build (shared memory...)
                print(f"    {cfg}: failed: {str(e).splitlines()[0][:100]}")
                continue
            first = time.perf_counter() - t0
            e = (out.double() - ref).abs().max().item() / scale
            tg = gpu_time(lambda c=(a, b, bias, mask, act, 0.0, cfg): _gemm._launch(*c))
            best = min(best or (1e9, None), (tg, cfg))
            print(f"    {str(cfg):22s} {tg:6.2f} us  first call {first:5.2f} s  err {e:.1e}", flush=True)
        th = gpu_time(lambda c=(a, b, bias, mask, act, 0.0): _gemm._launch(*c))
        print(f"  best {best[1]} {best[0]:.2f} us vs cuBLAS+epilogue {t:.2f}; heuristic "
              f"{_gemm.pick_config(m, n, k)} {th:.2f} us", flush=True)
    compile_times(dev)


def compile_times(dev):
    """Cold compiles of 4 kernel variants: one after the other, then (4 others) in threads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    with fake:
        a, b, bt = torch.empty(64, 96, device=dev), torch.empty(96, 80, device=dev), torch.empty(80, 96, device=dev).t()
        bias, mask = torch.empty(80, device=dev), torch.empty(64, 80, device=dev)
    # four layouts (row-major, a transposed, b transposed, both): four kernels; the epilogue
    # (bias, ReLU, mask) is chosen at run time and builds none of its own
    at = torch.empty(96, 64, device="meta").t()
    variants = [(a, b, bias, None, 1), (at, b, None, None, 0), (a, bt, None, mask, 0), (at, bt, bias, mask, 1)]
    for label, cfg in (("one after the other", (16, 16, 32, 2, 3)), ("in 4 threads", (16, 16, 32, 2, 4))):
        _gemm._FORCED = cfg
        t0 = time.perf_counter()
        if label.startswith("one"):
            for v in variants:
                for f in _gemm.precompile([v]):
                    f.result()
        else:
            for f in _gemm.precompile(variants):
                f.result()
        t1 = time.perf_counter()
        # the launches must find those kernels built: no compile here
        ra, rb, rbt = torch.randn(64, 96, device=dev), torch.randn(96, 80, device=dev), torch.randn(80, 96, device=dev).t()
        rbias, rmask = torch.randn(80, device=dev), torch.randn(64, 80, device=dev)
        rat = torch.randn(96, 64, device=dev).t()
        for x, y, z, w, act in ((ra, rb, rbias, None, 1), (rat, rb, None, None, 0), (ra, rbt, None, rmask, 0),
                                (rat, rbt, rbias, rmask, 1)):
            _gemm._launch(x, y, z, w, act, 0.0)
        torch.cuda.synchronize()
        print(f"compile 4 variants {label}: {t1 - t0:.2f} s; then 4 launches {time.perf_counter() - t1:.3f} s",
              flush=True)
    _gemm._FORCED = None


if __name__ == "__main__":
    main()

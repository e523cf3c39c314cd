#!/usr/bin/env python3
"""Grouped float32 GEMV (one kernel for several x @ w_i.t() sharing x) against cuBLAS's separate
products, inside CUDA graphs, at the Llama decode row's shapes (M=1: q/k/v 256->256,128,128;
gate/up 256->1024,1024). GPU time per replay (events, 2000 replays), error against float64.
CUDA only: `python benchmarks/probes/_probe_gemv.py`. See benchmarks/NOTES.md (thirteenth session).
"""
import torch, triton, triton.language as tl

@triton.jit
def _part(a_ptr, w_ptr, c_ptr, M, N, K, s_am, s_ak, s_wn, s_wk, pid, BN: tl.constexpr, BK: tl.constexpr):
    rn = pid * BN + tl.arange(0, BN)
    in_n = rn < N
    for m in range(0, M):
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            in_k = rk < K
            a = tl.load(a_ptr + m * s_am + rk * s_ak, mask=in_k, other=0.0)
            w = tl.load(w_ptr + rn[:, None] * s_wn + rk[None, :] * s_wk, mask=in_n[:, None] & in_k[None, :], other=0.0)
            acc += w * a[None, :]
        tl.store(c_ptr + m * N + rn, tl.sum(acc, axis=1), mask=in_n)

@triton.jit
def gemv_group(a_ptr, M, K, s_am, s_ak,
               w0, c0, n0, s0n, s0k, w1, c1, n1, s1n, s1k, w2, c2, n2, s2n, s2k,
               BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    b0 = tl.cdiv(n0, BN)
    b1 = tl.cdiv(n1, BN)
    if pid < b0:
        _part(a_ptr, w0, c0, M, n0, K, s_am, s_ak, s0n, s0k, pid, BN, BK)
    elif pid < b0 + b1:
        _part(a_ptr, w1, c1, M, n1, K, s_am, s_ak, s1n, s1k, pid - b0, BN, BK)
    else:
        _part(a_ptr, w2, c2, M, n2, K, s_am, s_ak, s2n, s2k, pid - b0 - b1, BN, BK)

def launch(x, ws, outs, BN, BK, warps):
    ws3 = list(ws) + [ws[-1]] * (3 - len(ws))
    os3 = list(outs) + [outs[-1]] * (3 - len(outs))
    ns = [w.shape[0] for w in ws] + [0] * (3 - len(ws))
    grid = (sum(triton.cdiv(n, BN) for n in ns),)
    args = []
    for w, o, n in zip(ws3, os3, ns):
        args += [w, o, n, w.stride(0), w.stride(1)]
    gemv_group[grid](x, x.shape[0], x.shape[1], x.stride(0), x.stride(1), *args, BN=BN, BK=BK, num_warps=warps)

def gtime(fn, n=2000):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): fn()
    for _ in range(5): g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); e0.record()
    for _ in range(n // 20): g.replay()
    e1.record(); e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
for name, K, Ns, M in [("qkv", 256, (256, 128, 128), 1), ("gate/up", 256, (1024, 1024), 1), ("qkv M=4", 256, (256, 128, 128), 4), ("gate/up K=1024", 1024, (1024, 1024), 1)]:
    x = torch.randn(M, K, device=dev)
    ws = [torch.randn(n, K, device=dev) * K ** -0.5 for n in Ns]
    ref = [(x.double() @ w.double().t()) for w in ws]
    cub = lambda: [x @ w.t() for w in ws]
    t_cub = gtime(cub)
    e_cub = max(((x @ w.t()).double() - r).norm().item() / r.norm().item() for w, r in zip(ws, ref))
    print(f"{name}: cuBLAS {len(Ns)} products {t_cub:.2f} us  err {e_cub:.1e}")
    for BN in (4, 8, 16, 32):
        for BK in (64, 128, 256):
            for warps in (2, 4):
                outs = [torch.empty(M, n, device=dev) for n in Ns]
                try:
                    launch(x, ws, outs, BN, BK, warps)
                    torch.cuda.synchronize()
                    err = max((o.double() - r).norm().item() / r.norm().item() for o, r in zip(outs, ref))
                    t = gtime(lambda: launch(x, ws, outs, BN, BK, warps))
                    print(f"   grouped BN={BN:2d} BK={BK:3d} warps={warps}: {t:.2f} us  err {err:.1e}")
                except Exception as e:
                    print(f"   grouped BN={BN} BK={BK} warps={warps}: {type(e).__name__} {str(e)[:80]}")

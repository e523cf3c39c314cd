"""#36 item 3: bf16 matmul 8192^3 with new inputs each call: copy-in against input_buffers against the floor.

Run: python benchmarks/probes/_probe_input_buffers.py
"""
import time, statistics, torch, gtransform as gt
dev = "cuda"; n = 8192
torch.manual_seed(0)
x = torch.randn(n, n, device=dev, dtype=torch.bfloat16); w = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
new = [(torch.randn_like(x), torch.randn_like(w)) for _ in range(3)]
def timeit(call, reps=7, n_calls=20):
    for _ in range(3): call(0)
    torch.cuda.synchronize()
    res = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(n_calls): call(i)
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / n_calls * 1e6)
    return statistics.median(res)
g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2): x @ w
torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
with torch.cuda.graph(g): sy = x @ w
print("floor (replay alone)      %.1f us" % timeit(lambda i: g.replay()))
print("eager                     %.1f us" % timeit(lambda i: x @ w))
f = gt.graphify(lambda a, b: a @ b)
print("gt same tensors           %.1f us" % timeit(lambda i: f(x, w)))
f2 = gt.graphify(lambda a, b: a @ b)
print("gt new tensors (copy-in)  %.1f us" % timeit(lambda i: f2(*new[i % 3])))
f3 = gt.graphify(lambda a, b: a @ b)
bufs = f3.input_buffers(*new[0])
print("gt f(*f.input_buffers())  %.1f us" % timeit(lambda i: f3(*bufs)))
out = f3(*bufs); ref = bufs[0].float() @ bufs[1].float()
print("max rel err vs fp32: %.2e" % ((out.float() - ref).abs().max() / ref.abs().max()).item())

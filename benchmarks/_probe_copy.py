import torch, sys
sys.path.insert(0, 'benchmarks'); import bench
dev = torch.device('cuda')
def gpu_time(fn, n=200):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    for _ in range(10): g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        for _ in range(n): g.replay()
        e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return sorted(ts)[2]
for name in ('mlp', 'transformer', 'dict32', 'rl'):
    w = [x for x in bench.make_workloads(dev) if x.name == name][0]
    src = bench.tree_tensors(w.make_args(dev)); dst = [t.clone() for t in src]
    mb = sum(t.numel() * t.element_size() for t in src) / 2**20
    f = gpu_time(lambda: torch._foreach_copy_(dst, src))
    p = gpu_time(lambda: [d.copy_(s) for d, s in zip(dst, src)])
    print(f'{name:12s} {len(src):3d} leaves {mb:6.2f} MiB  GPU us: _foreach_copy_ {f:6.1f}  per-leaf copy_ {p:6.1f}')

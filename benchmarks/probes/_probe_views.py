"""Host cost of holding outputs and views on a small CUDA row (issue #36 item 4): 64x64 matmul + relu.

Run: python benchmarks/probes/_probe_views.py [prof]  (prints per-mode medians and ratios)

"replay 5 in turn" is the floor of the views column: five graphs over memory of their own,
replayed one after another (a hand-written ring), with no bookkeeping.
"""
import time, torch, gtransform as gt, collections, statistics, sys
dev = "cuda"
x = torch.randn(64, 64, device=dev); w = torch.randn(64, 64, device=dev)
f = gt.graphify(lambda x: (x @ w).relu())
g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3): (x @ w).relu()
torch.cuda.synchronize()
with torch.cuda.graph(g): sy = (x @ w).relu()
def run(fn, mode, n=2000):
    q = collections.deque(maxlen=4)
    o = None
    for _ in range(60):
        o = fn(x); q.append(o[0])
    q.clear(); o = None
    torch.cuda.synchronize()
    t = time.perf_counter()
    if mode == "drop":
        for _ in range(n):
            o = fn(x); del o
    elif mode == "keep":
        for _ in range(n):
            o = fn(x)
    elif mode == "view-dropped":
        for _ in range(n):
            o = fn(x); v = o[0]; q.append(None); del o, v
    elif mode == "views":
        for _ in range(n):
            o = fn(x); q.append(o[0]); del o
    elif mode == "keep+views":
        for _ in range(n):
            o = fn(x); q.append(o[0])
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6
def replay(x):
    g.replay(); return sy
# the floor of holding views: five graphs of their own memory, replayed in turn (what the
# ring of output generations does, without the bookkeeping)
ring = []
for _ in range(5):
    gi = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gi, pool=torch.cuda.graph_pool_handle()): yi = (x @ w).relu()
    ring.append((gi, yi))
turn = [0]
def replay_ring(x):
    i = turn[0] = (turn[0] + 1) % 5
    gi, yi = ring[i]; gi.replay(); return yi
modes = ["drop", "keep", "view-dropped", "views", "keep+views"]
for name, fn in (("eager", lambda x: (x @ w).relu()), ("replay", replay), ("replay 5 in turn", replay_ring), ("gt", f)):
    res = {m: [] for m in modes}
    for k in range(9):
        for m in modes:
            res[m].append(run(fn, m))
    print(name, " ".join("%s %.2f" % (m, statistics.median(v)) for m, v in res.items()),
          "| ratio to drop:", " ".join("%s %.3f" % (m, statistics.median(a / b for a, b in zip(v, res["drop"]))) for m, v in res.items()), flush=True)
if len(sys.argv) > 1:
    import cProfile, pstats
    for m in ("view-dropped", "views"):
        pr = cProfile.Profile(); pr.enable(); run(f, m, 5000); pr.disable()
        print(m); pstats.Stats(pr).sort_stats("tottime").print_stats(14)

"""GPU time of a function, captured in a CUDA graph and timed by replay (for the probes)."""

import torch


def gpu_time(fn, n=200, reps=1):
    """Median us per call of fn(), captured `reps` times in one graph, timed over n replays x 5."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    for _ in range(10):
        g.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        for _ in range(n):
            g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n / reps)
    return sorted(ts)[2]


def capture_graphs(fn, args, k, shared=False):
    """fn(*args) warmed up on a side stream, then captured k times, each graph in a private pool
    (``shared``: all in one pool, in turn, so that each capture's intermediates reuse the memory
    the previous capture freed; its outputs stay apart as they are kept).

    Returns ``(graphs, outs)``: what replaying several graphs in turn costs (the output ring
    of gtransform's held views) is what the probes measure with these.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    graphs, outs = [], []
    pool = torch.cuda.graph_pool_handle()
    for _ in range(k):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool if shared else torch.cuda.graph_pool_handle()):
            outs.append(fn(*args))
        graphs.append(g)
    return graphs, outs

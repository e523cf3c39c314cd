#!/usr/bin/env python3
"""The first three calls of one benchmark row in a process of their own, cold caches.

    python benchmarks/probes/_probe_first3.py ROW HOW [--profile]

ROW: a row of bench.py (``ode_rk4``, ``per_sample_grads``, ``ensemble``, ...) or ``encoder``
(a 6-layer ``nn.TransformerEncoder``, d=256, batch 4x32). HOW: ``fused`` (``gt.graphify(fn,
fuse=True)``), ``fused-nogemm`` (the same with ``GTRANSFORM_GEMM=0``), ``compile``
(``torch.compile(fn, mode="reduce-overhead")``) or ``gt``. Nothing is warmed up first: every
one-time cost lands on the first calls, as in a user's process. Prints each call's seconds, the
per-call time after them, and the largest difference from eager; ``--profile`` prints the
slowest call's cProfile. benchmarks/NOTES.md (eleventh session) has the numbers.
"""
import time

T_START = time.perf_counter()  # (the process's own start: every import below counts)
import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ap = argparse.ArgumentParser()
ap.add_argument("row")
ap.add_argument("how", choices=["fused", "fused-nogemm", "compile", "gt"])
ap.add_argument("--profile", action="store_true")
ap.add_argument("--dump", default=None, help="with --profile: write the slowest call's stats to this file (pstats)")
opts = ap.parse_args()
if opts.how == "fused-nogemm":
    os.environ["GTRANSFORM_GEMM"] = "0"
cache = tempfile.mkdtemp()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
os.environ["TRITON_CACHE_DIR"] = cache + "/triton"

import torch  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def encoder_row():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(dev).eval()
    x = torch.randn(4, 32, 256, device=dev)

    def fn(x):
        with torch.no_grad():
            return model(x)
    return fn, (x,)


if opts.row == "encoder":
    fn, args = encoder_row()
else:
    from benchmarks.workloads import make_workloads
    w = {w.name: w for w in make_workloads(dev)}[opts.row]
    if w.factory is not None:  # (a stateful row: its program closes over a fresh instance)
        fn, args = w.factory(dev).fn, w.make_args(dev)
    else:
        fn, args = w.fn, w.make_args(dev)

torch.manual_seed(0)
ref = fn(*args)
if opts.row != "encoder" and w.factory is not None:  # (the reference call moved its state on)
    fn = w.factory(dev).fn
sync_ = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
sync_()
T_READY = time.perf_counter()  # (the program built and run once eagerly: the same for every HOW)
t0 = time.perf_counter()
import gtransform as gt  # noqa: E402

if opts.how == "compile":
    f = torch.compile(fn, mode="reduce-overhead")
else:
    f = gt.graphify(fn, fuse=opts.how != "gt")
print(f"import + wrap {time.perf_counter() - t0:.2f} s")


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


times, profiles = [], []
for _ in range(3):
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    if opts.profile:
        pr.enable()
    out = f(*args)
    sync()
    pr.disable()
    times.append(time.perf_counter() - t0)
    profiles.append(pr)
T_CALLS = time.perf_counter()
leaves = lambda o: [t for t in torch.utils._pytree.tree_leaves(o) if isinstance(t, torch.Tensor)]  # noqa: E731
err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(leaves(out), leaves(ref)))
n = 50
t0 = time.perf_counter()
for _ in range(n):
    out = f(*args)
sync()
per = (time.perf_counter() - t0) / n * 1e6
print(f"== {opts.row} {opts.how}: first calls {', '.join(f'{t:.2f}' for t in times)} s "
      f"(sum {sum(times):.2f}; with import and wrap {T_CALLS - T_READY:.2f}; process {T_CALLS - T_START:.2f}); "
      f"per call {per:.0f} us; max |diff| vs eager {err:.1e}")
if opts.profile:
    slow = profiles[max(range(3), key=times.__getitem__)]
    if opts.dump:
        slow.dump_stats(opts.dump)
    s = io.StringIO()
    st = pstats.Stats(slow, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(30)
    print("\n".join(line[:220] for line in s.getvalue().splitlines() if line.strip()))

#!/usr/bin/env python3
"""fuse=True first call of one benchmark row with a given cache directory, under cProfile. CUDA only.

    D=$(mktemp -d); python benchmarks/probes/_probe_warm.py mlp_grad $D cold; python benchmarks/probes/_probe_warm.py mlp_grad $D warm

The second process reuses the directory the first filled (see NOTES.md, "fuse=True with warm caches").
"""
import sys, time, os, cProfile, pstats, io, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
row, d, mode = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
from benchmarks.caches import clear_compile_memory
from benchmarks.workloads import make_workloads
import gtransform as gt
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# process warm-up in a directory of its own, as the bench does
w0 = tempfile.mkdtemp()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = w0; os.environ["TRITON_CACHE_DIR"] = os.path.join(w0, "triton")
x = torch.randn(64, 64, device=dev)
gf = gt.graphify(lambda a: (a @ a).relu() * 2, fuse=True); [gf(x) for _ in range(3)]
torch.cuda.synchronize()
os.environ["TORCHINDUCTOR_CACHE_DIR"] = d; os.environ["TRITON_CACHE_DIR"] = os.path.join(d, "triton")
clear_compile_memory()
w = {w.name: w for w in make_workloads(dev)}[row]
args = w.make_args(dev)
f = gt.graphify(w.fn, fuse=True)
pr = cProfile.Profile()
t0 = time.perf_counter(); pr.enable()
out = f(*args); torch.cuda.synchronize()
pr.disable(); t = time.perf_counter() - t0
print(f"== {row} {mode}: first call {t:.3f} s", flush=True)
if mode == "warm":
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative")
    st.print_callers("from_tensor")
    st.print_callees("meta_utils.py:.*\\(__call__\\)")
    st.print_stats(r"gtransform|compile_fx|codecache.py.*load|graphify|_capture|warmup|_init_handles|precompile", 30)
    print("\n".join(l[:170] for l in s.getvalue().splitlines() if l.strip() and "function calls" not in l))

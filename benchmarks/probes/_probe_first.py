#!/usr/bin/env python3
"""First call of one benchmark row (default: chain) in a process warmed up as bench.py's, with fresh
compile caches, under cProfile: `python benchmarks/probes/_probe_first.py fused|compile [row]`. Run each in
its own process. See benchmarks/NOTES.md (2026-11-24, third session).
"""
import sys, os, time, tempfile, cProfile, pstats, io, argparse
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
which = sys.argv[1]
row = sys.argv[2] if len(sys.argv) > 2 else "chain"
import torch
from benchmarks.caches import clear_compile_memory
from benchmarks.runner import warm_up_process
from benchmarks.workloads import make_workloads
import gtransform as gt
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
w0 = tempfile.mkdtemp(); os.environ["TORCHINDUCTOR_CACHE_DIR"] = w0; os.environ["TRITON_CACHE_DIR"] = w0 + "/triton"
opts = argparse.Namespace(cpu_compile=True)
print(warm_up_process(dev, ["gt_same", "gt_fused", "compile"], opts))
d = tempfile.mkdtemp(); os.environ["TORCHINDUCTOR_CACHE_DIR"] = d; os.environ["TRITON_CACHE_DIR"] = d + "/triton"
clear_compile_memory()
w = {w.name: w for w in make_workloads(dev)}[row]
x = w.make_args(dev)
f = gt.graphify(w.fn, fuse=True) if which == "fused" else torch.compile(w.fn, mode="reduce-overhead")
pr = cProfile.Profile(); t0 = time.perf_counter(); pr.enable()
f(*x)
if dev.type == "cuda": torch.cuda.synchronize()
pr.disable(); t = time.perf_counter() - t0
print(f"== {row} {which} first call {t:.2f} s")
s = io.StringIO(); st = pstats.Stats(pr, stream=s)
st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(r"gtransform/|compile_fx.py|aot_autograd.py|graph_compile.py|convert_frame.py|scheduler.py.*codegen|async_compile|codecache.py|cudagraph|make_fx|proxy_tensor.py.*(dispatch_trace|trace)|triton/compiler/compiler.py", 60)
print("\n".join(l[:200] for l in s.getvalue().splitlines() if l.strip()))

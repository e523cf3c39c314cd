"""First calls with warm compile caches, measured in a second process.

After all rows, the cells of `--warm-methods` are built again in a fresh interpreter (one
for all rows, started as `bench.py --warm-child SPEC`), each reusing the cache directory
its cold first call filled: what a user's next process pays for the same function.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import subprocess
import sys
import tempfile
from time import perf_counter
from typing import Any, Dict

import torch

from . import caches
from .caches import compile_caches, compile_counters
from .context import grad_mode
from .core import short_error
from .methods import METHOD_FNS, STATEFUL_METHOD_FNS
from .runner import build_ctx, warm_up_process
from .workloads import make_workloads

BENCH_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")  # the second process runs it


def warm_child(opts: argparse.Namespace, device: torch.device) -> int:
    """The second process of the warm-cache measurement: for each (row,
    method, cache directory) of the spec, the method's first call again, with
    the compile caches the first process left in that directory."""
    with open(opts.warm_child) as fh:
        spec = json.load(fh)
    out: Dict[str, Any] = {"process_warmup_s": warm_up_process(device, ["gt_fused", "compile"], opts), "cells": []}
    rows = {w.name: w for w in make_workloads(device)}
    for item in spec["cells"]:
        w, m = rows[item["row"]], item["method"]
        rec: Dict[str, Any] = dict(item)
        ctx, err = build_ctx(w, device, opts)
        if ctx is None:
            rec["error"] = err.get("reason") or err.get("error")
        else:
            try:
                fns = STATEFUL_METHOD_FNS if w.factory is not None else METHOD_FNS
                counters = compile_counters(reset=True)
                prof_dir = os.environ.get("GT_BENCH_WARM_PROFILE")  # diagnosis: cProfile each warm cell
                prof = cProfile.Profile() if prof_dir else None
                with compile_caches("warm", reuse=item["cache_dir"]), grad_mode(w):
                    if prof is not None:
                        prof.enable()
                    p = fns[m](ctx)
                    if prof is not None:
                        prof.disable()
                        prof.dump_stats(os.path.join(prof_dir, f"{w.name}.{m}.prof"))
                    rec["first_call_s"] = p.first_call_s
                    rec["second_call_s"] = p.extra.get("second_call_s")
                    rec["check_ok"] = bool(p.errors) and all(e <= w.tol for e in p.errors)
                    if counters is not None:  # which compile caches hit (a miss here is a compile)
                        rec["cache_counters"] = compile_counters()
                    del p
            except Exception as e:
                rec["error"] = short_error(e)
            del ctx
        gc.collect()
        out["cells"].append(rec)
        print(f"[warm {w.name}] {m}: " + (f"first call {rec['first_call_s']:.3f} s" if rec.get("first_call_s")
                                           is not None else f"error: {rec.get('error')}")
              + (f", second {rec['second_call_s']:.3f} s" if rec.get("second_call_s") is not None else "")
              + (f"  caches {rec['cache_counters']}" if rec.get("cache_counters") else ""), flush=True)
    with open(spec["out"], "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    return 0


def measure_warm(results: Dict[str, Any], device: torch.device, opts: argparse.Namespace) -> None:
    """First calls with warm compile caches: one second process (a fresh
    interpreter: nothing compiled in memory) rebuilds each selected cell with
    the cache directory its cold first call filled. One process for all rows
    (its one-time costs are paid by a tiny function first and reported apart);
    between rows it clears dynamo's and inductor's in-memory caches."""
    methods = [m.strip() for m in (opts.warm_methods or "").split(",") if m.strip()]
    cells = [{"row": name, "method": m, "cache_dir": wr["cells"][m].get("cache_dir")}
             for name, wr in results["workloads"].items() for m in methods
             if wr["cells"].get(m, {}).get("status") == "ok" and wr["cells"][m].get("cache_dir")]
    if not cells:
        return
    tmp = tempfile.mkdtemp(prefix="gt-bench-warm-", dir=caches.root())
    spec = {"cells": cells, "out": os.path.join(tmp, "warm.json")}
    with open(os.path.join(tmp, "spec.json"), "w") as fh:
        json.dump(spec, fh)
    cmd = [sys.executable, BENCH_PY, "--warm-child", os.path.join(tmp, "spec.json"),
           "--device", device.type] + (["--tf32"] if opts.tf32 else []) + (["--quick"] if opts.quick else []) \
        + (["--cpu-compile"] if opts.cpu_compile else [])
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    print(f"\nwarm compile caches: {len(cells)} cell(s) again in a second process", flush=True)
    t0 = perf_counter()
    try:
        r = subprocess.run(cmd, env=env, timeout=opts.warm_timeout, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: " + (r.stderr.strip().splitlines() or [""])[-1][:300])
        with open(spec["out"]) as fh:
            warm = json.load(fh)
    except Exception as e:
        msg = short_error(e)
        print(f"warm-cache process failed: {msg}", flush=True)
        results["warm_process"] = {"error": msg, "seconds": perf_counter() - t0}
        for c in cells:
            results["workloads"][c["row"]]["cells"][c["method"]]["first_call_warm_error"] = msg
        return
    results["warm_process"] = {"seconds": perf_counter() - t0, "process_warmup_s": warm["process_warmup_s"]}
    for rec in warm["cells"]:
        cell = results["workloads"][rec["row"]]["cells"][rec["method"]]
        if rec.get("first_call_s") is not None:
            cell["first_call_warm_s"] = rec["first_call_s"]
            cell["second_call_warm_s"] = rec.get("second_call_s")
            cell["warm_check_ok"] = rec.get("check_ok")
            if rec.get("cache_counters") is not None:
                cell["warm_cache_counters"] = rec["cache_counters"]
        else:
            cell["first_call_warm_error"] = rec.get("error")

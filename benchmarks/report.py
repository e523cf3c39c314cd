"""The report: the Markdown tables and the files of a run (results.json, .md, .png).

Four tables, each from the results dict alone (so a saved results.json can be tabled
again): per call (microseconds, every column), the targets (ratios of DESIGN.md), first
call (seconds, cold and warm caches) and memory (MiB, CUDA only).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .core import METHODS, short_error
from .environment import precision_text


def fmt_us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_mib(b: Optional[int]) -> str:
    return "" if b is None else f"{b / 2**20:.1f}"


def cell_text(cell: Dict[str, Any], notes: List[str], where: str) -> str:
    st = cell["status"]
    if st == "ok":
        txt = fmt_us(cell["us_median"])
        if not cell.get("check_ok", True):
            txt += " ✗"
            st = (f"; state (updates) rel err {cell['state_rel_err']:.2e}, tol {cell['state_tol']:.0e}"
                  if cell.get("state_rel_err") is not None else "")
            notes.append(f"{where}: result differs from eager, rel err {cell.get('rel_err'):.2e} (tol {cell['tol']:.0e})"
                         + st)
        return txt
    if st == "n/a":
        return "n/a"
    if st == "skipped":
        return "skip"
    notes.append(f"{where}: {cell.get('error')}")
    return "error"


def markdown(results: Dict[str, Any]) -> Dict[str, str]:
    """The tables: per-call (µs), targets (ratios), first call (s), memory (MiB)."""
    return {"per_call": per_call_table(results), "targets": targets_table(results),
            "first_call": first_call_table(results), "memory": memory_table(results)}


def per_call_table(results: Dict[str, Any]) -> str:
    """Microseconds per call, every column; under it what was skipped and why, and every failure."""
    methods = results["methods_run"]
    wls = results["workloads"]
    notes: List[str] = []
    lines = ["| workload | " + " | ".join(METHODS[m] for m in methods) + " |",
             "|---|" + "---|" * len(methods)]
    for name, wr in wls.items():
        cells = [cell_text(wr["cells"][m], notes, f"{name} / {m}") for m in methods]
        lines.append(f"| {wr['title']} | " + " | ".join(cells) + " |")
    by_reason: Dict[str, List[str]] = {}
    for name, wr in wls.items():
        cols = [m for m, c in wr["cells"].items() if c["status"] == "skipped"]
        if cols and len(cols) == len(wr["cells"]):  # the whole row
            by_reason.setdefault(str(wr["cells"][cols[0]].get("reason")), []).append(f"row {name}")
            continue
        for m in cols:
            r = str(wr["cells"][m].get("reason"))
            if m not in by_reason.setdefault(r, []):
                by_reason[r].append(m)
    foot = []
    if by_reason:
        foot.append("skipped: " + "; ".join(f"{', '.join(v)}: {r}" for r, v in by_reason.items()))
    foot += [f"- {name}: {wr['note']}" for name, wr in wls.items() if wr.get("note")]
    foot += [f"- {n}" for n in notes]
    return ("Microseconds per call, median of "
            f"{results['meta']['repeats']} repeats ({results['meta']['device_name']}).\n\n"
            + "\n".join(lines) + ("\n\n" + "\n".join(foot) if foot else ""))


def targets_table(results: Dict[str, Any]) -> str:
    """The ratios DESIGN.md sets targets for, per row."""
    methods = results["methods_run"]
    wls = results["workloads"]

    def us(wr, m):
        c = wr["cells"].get(m)
        return c["us_median"] if c and c["status"] == "ok" else None

    peers = [m for m in ("eager", "graph_copy", "mgc", "compile", "jax") if m in methods]
    lines = ["| workload | gt same ÷ replay alone (≤ 1.10) | gt new ÷ copy-in + replay | gt same ÷ best peer (< 1) | best peer | gt same ÷ eager |",
             "|---|---|---|---|---|---|"]
    for name, wr in wls.items():
        def ratio(a, b):
            return f"{a / b:.2f}" if a is not None and b else ""
        s = us(wr, "gt_same")
        peer_vals = [(us(wr, m), m) for m in peers if us(wr, m) is not None]
        best = min(peer_vals) if peer_vals else (None, "")
        lines.append(f"| {name} | {ratio(s, us(wr, 'graph_replay'))} | {ratio(us(wr, 'gt_new'), us(wr, 'graph_copy'))} | "
                     f"{ratio(s, best[0])} | {METHODS.get(best[1], '')} | {ratio(s, us(wr, 'eager'))} |")
    return "Ratios (targets from DESIGN.md in brackets).\n\n" + "\n".join(lines)


def first_call_table(results: Dict[str, Any]) -> str:
    """First calls in seconds: every column with cold caches, gt's second calls, and warm caches."""
    methods = results["methods_run"]
    wls = results["workloads"]
    fc = [m for m in methods if m != "graph_replay"]
    heads = {**METHODS, "graph_copy": "CUDA graph: warm-up + capture"}
    warm_methods = [m for m in methods if any("first_call_warm_s" in wr["cells"].get(m, {})
                                              or "first_call_warm_error" in wr["cells"].get(m, {})
                                              for wr in wls.values())]
    # the first three calls (compile, warm-up, record for torch.compile), where a column measured them
    three = [m for m in ("compile", "gt_split", "gt_split_fused", "compile_gt") if m in methods
             and any(wr["cells"].get(m, {}).get("first_calls_s") for wr in wls.values())]
    extra_heads = ["gt same: 2nd call"] + (["gt fuse=True: 2nd call"] if "gt_fused" in methods else []) \
        + [f"{METHODS[m]}: first 3 calls" for m in three] \
        + [f"{ {'gt_fused': 'gt fuse=True', 'compile': 'torch.compile'}.get(m, METHODS[m]) }: warm caches, 2nd process"
           for m in warm_methods]
    lines = ["| workload | " + " | ".join(heads[m] for m in fc) + " | " + " | ".join(extra_heads) + " |",
             "|---|" + "---|" * (len(fc) + len(extra_heads))]
    warm_notes: List[str] = []
    for name, wr in wls.items():
        row = []
        for m in fc:
            c = wr["cells"][m]
            row.append(f"{c['first_call_s']:.3f}" if c["status"] == "ok" and c.get("first_call_s") is not None else "")
        for m in ("gt_same", "gt_fused")[: 2 if "gt_fused" in methods else 1]:
            sc = wr["cells"].get(m, {})
            row.append(f"{sc['second_call_s']:.3f}" if sc.get("status") == "ok" and sc.get("second_call_s") is not None
                       else "")
        for m in three:
            c = wr["cells"].get(m, {})
            row.append(" / ".join(f"{t:.3f}" for t in c["first_calls_s"]) if c.get("status") == "ok"
                       and c.get("first_calls_s") else "")
        for m in warm_methods:
            c = wr["cells"].get(m, {})
            if c.get("first_call_warm_s") is not None:
                row.append(f"{c['first_call_warm_s']:.3f}")
            elif c.get("first_call_warm_error"):
                row.append("error")
                warm_notes.append(f"- {name} / {m} (warm): {c['first_call_warm_error']}")
            else:
                row.append("")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    wp = results.get("warm_process") or {}
    warm_txt = ""
    if warm_methods:
        warm_txt = (" Warm caches: the same cells rebuilt in a second process (a fresh interpreter, one for all rows) "
                    "reusing each cell's TorchInductor/Triton cache directory from this run; that process's own "
                    "one-time costs: " + ", ".join(f"{k} {v:.2f} s" for k, v in (wp.get("process_warmup_s") or {}).items())
                    + (f"; it took {wp['seconds']:.0f} s in all" if wp.get("seconds") else "") + ".")
    return (
        "First call, seconds (eager: first call; CUDA graph: warm-up + capture; make_graphed_callables: it + "
        "first call; torch.compile: compile + first call; jax: trace + compile + first call; gt: trace + record "
        "+ first call; gt's second call with the same tensors re-records to read them in place). Every column "
        "compiles with cold caches (its own new cache directory, in-memory compile caches cleared). One-time "
        "process costs, paid before the first workload: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in results["process_warmup_s"].items()) + "." + warm_txt
        + "\n\n" + "\n".join(lines) + ("\n\n" + "\n".join(warm_notes) if warm_notes else ""))


def memory_table(results: Dict[str, Any]) -> str:
    """Device memory in MiB: eager's transient peak, each graph column's pool and allocation change."""
    methods = results["methods_run"]
    wls = results["workloads"]
    mem_cols = [m for m in ("graph_copy", "mgc", "compile", "gt_same", "gt_new") if m in methods]
    heads = {**METHODS, "graph_copy": "CUDA graph"}
    lines = ["| workload | eager: peak beyond inputs | eager: output | "
             + " | ".join(f"{heads[m]}: peak / held / reserved / pool" for m in mem_cols) + " |",
             "|---|---|---|" + "---|" * len(mem_cols)]
    for name, wr in wls.items():
        e = wr["cells"].get("eager", {}).get("memory") or {}
        row = [fmt_mib(e.get("peak_extra_bytes")), fmt_mib(e.get("output_bytes"))]
        for m in mem_cols:
            mm = wr["cells"][m].get("memory") or {}
            row.append(" / ".join(fmt_mib(mm.get(k)) for k in
                                  ("peak_bytes", "allocated_delta_bytes", "reserved_delta_bytes", "new_pool_bytes"))
                       if mm else "")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return (
        "Memory, MiB (CUDA only). Eager: torch.cuda.max_memory_allocated during one call minus what was allocated "
        "before it, and its output. Others, measured before and after building and warming up the method (its "
        "first calls; each time after gc.collect() and torch.cuda.empty_cache()): peak = the most allocated "
        "in between, above what was allocated before (runs before 2026-11-28 did not record it: blank); held "
        "= change of torch.cuda.memory_allocated (static input buffers and live outputs, plus cuBLAS "
        "workspaces of new streams, 32 MiB each on Hopper; torch.compile's cudagraph trees free the existing "
        "cuBLAS workspaces, which can make it negative); reserved = change of torch.cuda.memory_reserved; "
        "pool = size of the private-pool segments (CUDA graph memory pools, from torch.cuda.memory_snapshot) "
        "that appeared. Inputs made beforehand are not counted.\n\n"
        + "\n".join(lines))


PLOT_LABELS: Dict[str, str] = {
    "eager": "eager",
    "graph_copy": "graph: copy-in+replay",
    "graph_replay": "graph: replay alone",
    "mgc": "make_graphed_callables",
    "compile": "torch.compile r-o",
    "jax": "jax.jit",
    "gt_same": "gt: same tensors",
    "gt_new": "gt: new tensors",
    "gt_held": "gt: same, out held",
    "gt_views": "gt: views of 4 calls held",
    "gt_fused": "gt fuse=True: same tensors",
}


def plot(results: Dict[str, Any], path: str) -> None:
    """Per-call time: one panel per workload, one bar per method (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    wls = results["workloads"]
    methods = results["methods_run"]
    n = len(wls)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, (0.3 * len(methods) + 1.1) * rows + 0.6),
                             squeeze=False, layout="constrained")
    colors = plt.get_cmap("tab10")
    for ax, wr in zip(axes.flat, wls.values()):
        cells = [wr["cells"][m] for m in methods]
        vals = [c["us_median"] if c["status"] == "ok" else math.nan for c in cells]
        y = np.arange(len(methods))
        ax.barh(y, vals, color=[colors(i % 10) for i in range(len(methods))])
        ax.set_yticks(y, [PLOT_LABELS[m] for m in methods], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(wr["title"], fontsize=9)
        ok = [v for v in vals if not math.isnan(v)]
        if ok:
            ax.set_xlim(min(ok) / 2, max(ok) * 8)
        x0 = ax.get_xlim()[0]
        for yi, (v, c) in enumerate(zip(vals, cells)):
            if math.isnan(v):
                ax.text(x0, yi, " " + c["status"], va="center", fontsize=7, color="gray")
            else:
                mark = "" if c.get("check_ok", True) else " (check failed)"
                ax.text(v, yi, " " + fmt_us(v) + mark, va="center", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("µs per call (median, log scale)", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    m = results["meta"]
    fig.suptitle(f"gtransform benchmark: {m['device_name']}, torch {m['torch']}, jax {m['jax']}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: Dict[str, Any], tables: Dict[str, str], out: str) -> Tuple[str, str, str]:
    """results.json (every figure), results.md (the tables) and results.png (the plot) in ``out``."""
    json_path = os.path.join(out, "results.json")
    md_path = os.path.join(out, "results.md")
    png_path = os.path.join(out, "results.png")
    with open(json_path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    with open(md_path, "w") as fh:
        m = results["meta"]
        fh.write(f"# gtransform benchmark\n\n{m['device_name']}, torch {m['torch']}, jax {m['jax']}, "
                 f"transformers {m.get('transformers')}, torchvision {m.get('torchvision')}, "
                 f"gtransform {m['gtransform']} (git {m['git']}, sources {m['gtransform_src_sha256']}), {m['date']}, "
                 f"{'quick' if m['quick'] else 'full'} run, {m['total_s']:.0f} s.\n\n"
                 f"{precision_text(m['precision'])}. Compile caches: {m['compile_caches']}.\n\n")
        for key, title in (("per_call", "Per call"), ("targets", "Targets"), ("first_call", "First call"),
                           ("memory", "Memory")):
            fh.write(f"## {title}\n\n{tables[key]}\n\n")
    try:
        plot(results, png_path)
    except Exception as e:
        print(f"plot failed: {short_error(e)}", flush=True)
    return json_path, md_path, png_path

"""The benchmark package (``benchmarks/``): its command line runs a row on the CPU and writes
every file, and its report reads the results of a saved GPU run. The GPU figures themselves
are the benchmark's business, on a GPU machine (benchmarks/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAVED_RUN = ROOT / "benchmarks" / "runs" / "results-2026-11-26-h100-synthetic-f794beb.json"


def test_command_line_runs_one_row_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--device", "cpu", "--quick", "--only", "chain",
           "--methods", "eager,gt_same,gt_new,gt_held,gt_views", "--warm-methods", "", "--out", str(out)]
    # from another directory: the script finds its package and this checkout's gtransform itself
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["methods_run"] == ["eager", "gt_same", "gt_new", "gt_held", "gt_views"]
    cells = results["workloads"]["chain"]["cells"]
    for method, cell in cells.items():
        assert cell["status"] == "ok", (method, cell)
        assert cell["check_ok"], (method, cell)
        assert cell["us_median"] > 0 and cell["repeats"] == 3
    # the target columns are timed in turn; the others one after the other
    assert cells["gt_held"]["timed"] == "in turn with gt_same, gt_views"
    assert "timed" not in cells["gt_new"]
    md = (out / "results.md").read_text()
    for title in ("## Per call", "## Targets", "## First call", "## Memory"):
        assert title in md
    # stdout ends with the per-call table
    assert r.stdout.rstrip().endswith("|"), r.stdout[-500:]
    assert "| chain of 200 elementwise ops, 1024 floats |" in r.stdout


def test_report_reads_a_saved_run(monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ)
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.report import markdown

    assert dict(os.environ) == env  # importing the package sets nothing (bench.py does, before torch)
    tables = markdown(json.loads(SAVED_RUN.read_text()))
    assert set(tables) == {"per_call", "targets", "first_call", "memory"}
    # 2026-11-26, H100: the chain row's floor 250.4 us, gt 249.9 (÷ floor 1.00), fuse=True 10.8
    row = next(line for line in tables["per_call"].splitlines() if line.startswith("| chain of 200"))
    assert "| 250.4 |" in row and "| 249.9 |" in row and "| 10.8 |" in row
    assert "| chain | 1.00 |" in tables["targets"]
    assert "warm caches, 2nd process" in tables["first_call"]


def test_only_host_selects_the_host_read_rows_and_their_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--only host` (issue #35): the seven programs that read values on the host, each declaring the
    six columns it runs; neither `synthetic` nor `real` picks them up."""
    monkeypatch.syspath_prepend(str(ROOT))
    import torch

    from benchmarks.runner import select_workloads
    from benchmarks.workloads import HOST_ROWS
    from benchmarks.workloads.host import HOST_METHODS

    cpu = torch.device("cpu")
    host = select_workloads(cpu, "host")
    assert [w.name for w in host] == list(HOST_ROWS) == [
        "ode_rk4", "ode_dopri5", "gcn", "gat", "gpt2_greedy", "train_log", "rl_episode"]
    assert HOST_METHODS == ("eager", "compile", "gt_same", "gt_split", "compile_gt", "gt_fused", "gt_split_fused")
    for w in host:
        assert w.host_reads and w.factory is not None and w.only_methods == HOST_METHODS, w.name
    others = {w.name for w in select_workloads(cpu, "synthetic,real")}
    assert not others & set(HOST_ROWS)
    assert not any(w.host_reads for w in select_workloads(cpu, "synthetic,real"))

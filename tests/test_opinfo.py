"""Every op of PyTorch's OpInfo database against eager, through graphify (tests/opinfo_sweep.py),
and at four sizes through one graphified function (tests/opinfo_sizes.py: one symbolic trace).

CI runs the first three samples of every op with float32 samples in every leg (forward,
non-contiguous, out=, in-place, gradient) on the CPU, in worker processes (a segfault is
a failure of one sample, not a dead run); ``pytest -m cuda`` runs the same on the GPU.
Each case must match eager or be refused with a GraphifyError that gives the fix: no
failure class. The whole database with every sample is a documented command
(docs/opinfo.md).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _results(out, script: str, *args: str) -> list:
    """Run a sweep script writing its per-sample results to ``out``; the results."""
    cmd = [sys.executable, os.path.join(HERE, script), *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-6000:])
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def _no_failure(results: list) -> None:
    failed = [r for r in results if r["cls"] not in ("match", "refused", "skip")]
    assert not failed, "\n".join(f"{r['cls']}: {r['op']} [{r.get('leg', 'sizes')} {r['i']}]: {r['note']}"
                                 for r in failed[:40])


def _sweep(tmp_path, device: str, samples: int = 3) -> list:
    return _results(tmp_path / f"opinfo-{device}.json", "opinfo_sweep.py", "--device", device, "--legs", "all",
                    "--samples", str(samples), "--jobs", str(min(12, max(1, os.cpu_count() or 1))))


def _check(results: list) -> None:
    _no_failure(results)
    ops = {r["op"] for r in results if r["cls"] != "skip"}
    matched = sum(r["cls"] == "match" for r in results)
    assert len(ops) > 600 and matched > 5000, (len(ops), matched)  # the database was swept, not skipped
    for r in results:
        if r["cls"] == "refused":
            assert "graphify(" in r["note"], r  # a GraphifyError of ours, whose message gives the fix


def test_opinfo_cpu(tmp_path):
    pytest.importorskip("expecttest")  # (torch's OpInfo module imports it)
    _check(_sweep(tmp_path, "cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_opinfo_cuda(tmp_path):
    pytest.importorskip("expecttest")
    _check(_sweep(tmp_path, "cuda"))


def _sizes(tmp_path, device: str) -> list:
    return _results(tmp_path / f"opinfo-sizes-{device}.json", "opinfo_sizes.py", "--device", device, "--samples", "1")


def _check_sizes(results: list) -> None:
    """Every op at its sample's size and three others matches eager (tests/opinfo_sizes.py), and most of
    the later sizes are recorded from one symbolic trace, not traced."""
    _no_failure(results)
    matched = [r for r in results if r["cls"] == "match"]
    assert len(matched) > 400, len(matched)
    shared = sum(r["shared"] for r in matched)
    assert shared > 0.6 * 2 * len(matched), (shared, len(matched))


def test_opinfo_sizes_cpu(tmp_path):
    pytest.importorskip("expecttest")
    _check_sizes(_sizes(tmp_path, "cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_opinfo_sizes_cuda(tmp_path):
    pytest.importorskip("expecttest")
    _check_sizes(_sizes(tmp_path, "cuda"))

"""The README's code runs as written (on this machine's device: the CPU in CI, a GPU under -m cuda)."""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch

import gtransform as gt

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_runs_as_written(capsys):
    quick, stale, train = _blocks()[:3]
    ns: dict = {}
    exec(compile(quick, "README.md (quick start)", "exec"), ns)
    assert ns["step"].cache_info() == gt.CacheInfo(hits=99, misses=1, maxsize=64, currsize=1)
    assert "CacheInfo(hits=99, misses=1, maxsize=64, currsize=1)" in capsys.readouterr().out
    # the stale-output example raises where it says it does
    *lines, last = [ln.split("#")[0].rstrip() for ln in stale.strip().splitlines()]
    exec(compile("\n".join(lines), "README.md (outputs)", "exec"), ns)
    with pytest.raises(gt.OverwrittenOutputError):
        exec(compile(last, "README.md (outputs)", "exec"), ns)
    exec(compile(train, "README.md (training step)", "exec"), ns)
    out = capsys.readouterr().out
    assert re.fullmatch(r"loss \d+\.\d{3}\n", out), out
    assert math.isfinite(ns["loss"].item())
    # 1st call eager, 2nd recorded, then replayed
    assert ns["train_step"].cache_info().hits >= 18


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_readme_runs_as_written_on_the_gpu(capsys):
    test_the_readme_runs_as_written(capsys)

"""Smoke tests: each script in examples/ runs on the CPU with a few steps and
passes its own check against eager (its main() returns 0)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"gtransform_example_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, steps",
    [("train_loop", 4), ("inference_loop", 4), ("rl_rollout", 6), ("data_parallel", 4)],
)
def test_example_runs_on_cpu(name: str, steps: int, capsys: pytest.CaptureFixture[str]) -> None:
    module = _load(name)
    rc = module.main(["--device", "cpu", "--steps", str(steps)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK:" in out, out


def test_every_example_is_tested() -> None:
    found = {p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert found == {"train_loop", "inference_loop", "rl_rollout", "data_parallel"}, found

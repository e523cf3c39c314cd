"""The fused backend (gtransform.fuse) is optional: the core reaches it only through its
entry points, imported when a fuse=True function is made (inductor's compiler with it, as
torch.compile(fn) loads it when it wraps), so a program that never asks for fuse=True loads neither the subpackage nor TorchInductor's compiler. Each check runs
in a fresh interpreter (this one has long since imported both). (The package torch._inductor
itself comes with torch._dynamo, which graphify() imports to keep dynamo out of its wrapper:
its compiler, compile_fx and all it imports, does not.)"""

import os
import subprocess
import sys

import gtransform as gt

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gt.__file__)))

_SCRIPT = r'''
import sys
import torch
import gtransform as gt

def loaded():
    return sorted(m for m in ("gtransform.fuse", "torch._inductor.compile_fx") if m in sys.modules)

assert gt.__file__.startswith(sys.argv[1]), gt.__file__  # this checkout's package, not another one
print("import", loaded())
f = gt.graphify(lambda x: x * 2 + 1)
x = torch.randn(8)
for _ in range(3):
    torch.testing.assert_close(f(x), x * 2 + 1)
f.trace(x)
print("plain", loaded())
g = gt.graphify(lambda x: x * 2 + 1, fuse=True)
print("wrapped", loaded())
torch.testing.assert_close(g(x), x * 2 + 1)
print("fused", loaded())
'''


def test_the_core_loads_the_fused_backend_and_inductor_only_for_fuse_true():
    r = subprocess.run([sys.executable, "-c", _SCRIPT, _ROOT], cwd=_ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": _ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("import", "plain", "wrapped", "fused"))
    assert lines["import"] == "[]", lines
    assert lines["plain"] == "[]", lines
    # (a fuse=True function loads inductor's compiler when it is made, as torch.compile(fn) does)
    assert lines["wrapped"] == "['gtransform.fuse', 'torch._inductor.compile_fx']", lines
    assert lines["fused"] == "['gtransform.fuse', 'torch._inductor.compile_fx']", lines

"""Private torch names live in one module, ``gtransform/_compat.py`` (issue 34).

(a) No other module of the package names a private torch attribute: each file is parsed and
every private name reached through torch is reported (``torch._C``, ``torch.Tensor._version``,
``from torch._subclasses... import``, ``from torch.x import _y``, ``torch.ops.aten._to_copy``
also through an alias such as ``_aten = torch.ops.aten``, ``getattr(torch..., "_x")`` also
over a tuple of names, ``torch...__dict__["_x"]``).
(b) Every name ``_compat`` binds is there in the installed torch, or is one of its documented
optional names (``_compat.OPTIONAL``: where ``None`` or a stand-in is a fallback the code takes).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import gtransform
from gtransform import _compat

PKG = Path(gtransform.__file__).parent
ROOT = PKG.parent

# Reads of torch state that changes at run time, made per call where a name bound at import
# would be stale and a function call from _compat would cost: listed in _compat's docstring.
LIVE_READS = {("_bind.py", "_current_level")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> Optional[List[str]]:
    """``a.b.c`` as ``["a", "b", "c"]`` (None: not a plain attribute chain over a name)."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


class _Scan(ast.NodeVisitor):
    """The private torch names one file reaches (line, text)."""

    def __init__(self) -> None:
        self.roots: Set[str] = set()  # names bound to torch or to something reached through it
        self.found: List[tuple] = []

    # -- what names torch objects -------------------------------------------------------
    def _torchy(self, node: ast.AST) -> bool:
        c = _chain(node)
        return c is not None and c[0] in self.roots

    def _flag(self, node: ast.AST, text: str) -> None:
        self.found.append((getattr(node, "lineno", 0), text))

    def collect_roots(self, tree: ast.AST) -> None:
        changed = True
        while changed:  # an alias of an alias (`c10d = torch.ops.c10d` after `import torch`)
            n0 = len(self.roots)
            for n in ast.walk(tree):
                if isinstance(n, ast.Import):
                    for a in n.names:
                        if a.name == "torch" or a.name.startswith("torch."):
                            self.roots.add(a.asname or "torch")
                elif isinstance(n, ast.ImportFrom) and n.module and (n.module == "torch"
                                                                      or n.module.startswith("torch.")):
                    for a in n.names:
                        self.roots.add(a.asname or a.name)
                elif isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None and self._torchy(n.value):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            self.roots.add(t.id)
            changed = len(self.roots) != n0

    # -- the checks ---------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("torch.") and any(_private(p) for p in a.name.split(".")):
                self._flag(node, f"import {a.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level == 0 and (mod == "torch" or mod.startswith("torch.")):
            for a in node.names:
                if any(_private(p) for p in mod.split(".")) or _private(a.name):
                    self._flag(node, f"from {mod} import {a.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        c = _chain(node)
        if c is not None and c[0] in self.roots:
            if any(_private(p) for p in c[1:]):  # the whole chain, once (its inner attributes are not visited)
                self._flag(node, ".".join(c))
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 \
                and self._torchy(node.args[0]):
            name = node.args[1]
            names = [name.value] if isinstance(name, ast.Constant) and isinstance(name.value, str) else \
                self._loop_names(node, name)
            for s in names:
                if _private(s):
                    self._flag(node, f"{f.id}({ast.unparse(node.args[0])}, {s!r})")
        if isinstance(f, ast.Attribute) and f.attr == "get" and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "__dict__" and self._torchy(f.value.value) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and _private(node.args[0].value):
            self._flag(node, f"{ast.unparse(f.value)}.get({node.args[0].value!r})")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        v, s = node.value, node.slice
        if isinstance(v, ast.Attribute) and v.attr == "__dict__" and self._torchy(v.value) \
                and isinstance(s, ast.Constant) and isinstance(s.value, str) and _private(s.value):
            self._flag(node, f"{ast.unparse(v)}[{s.value!r}]")
        self.generic_visit(node)

    def _loop_names(self, call: ast.Call, name: ast.AST) -> List[str]:
        """The strings a comprehension's loop variable ``name`` takes from a literal tuple or list."""
        if not isinstance(name, ast.Name):
            return []
        node = getattr(call, "_gt_parent", None)
        while node is not None:
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for g in node.generators:
                    if isinstance(g.target, ast.Name) and g.target.id == name.id \
                            and isinstance(g.iter, (ast.Tuple, ast.List)):
                        return [e.value for e in g.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            node = getattr(node, "_gt_parent", None)
        return []


def scan(path: Path) -> List[tuple]:
    tree = ast.parse(path.read_text(), str(path))
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._gt_parent = parent  # type: ignore[attr-defined]
    s = _Scan()
    s.collect_roots(tree)
    s.visit(tree)
    return s.found


def test_no_module_but_compat_names_a_private_torch_attribute():
    found: Dict[str, List[str]] = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel == "_compat.py":
            continue
        hits = [f"{rel}:{line}: {text}" for line, text in scan(p)
                if not any(rel == f and text.endswith("." + attr) for f, attr in LIVE_READS)]
        if hits:
            found[rel] = hits
    assert not found, "private torch names outside gtransform/_compat.py (import them from there):\n" + "\n".join(
        h for hits in found.values() for h in hits)


def test_the_scan_sees_each_form():
    src = '''
import torch
import torch._dynamo
import torch.utils._pytree as pt
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree
from torch.fx.passes.shape_prop import _extract_tensor_metadata
_aten = torch.ops.aten
c10d = torch.ops.c10d
a = torch._C._functorch.peek_interpreter_stack
b = _aten._to_copy.default
c = getattr(torch._C, "_x", None)
d = [getattr(torch.Tensor, n) for n in ("_nnz", "values")]
e = torch.Tensor.__dict__["_version"]
f = c10d._allgather_base_.default
g = torch.Tensor._version.__get__
ok = [torch.Tensor.data_ptr, _aten.view.default, torch.Tensor.__dict__["data"], getattr(torch.Tensor, "grad")]
'''
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text(src)
        texts = [t for _, t in scan(p)]
    assert texts == [
        "import torch._dynamo", "import torch.utils._pytree",
        "from torch._subclasses.fake_tensor import FakeTensor", "from torch.utils import _pytree",
        "from torch.fx.passes.shape_prop import _extract_tensor_metadata",
        "torch._C._functorch.peek_interpreter_stack", "_aten._to_copy.default", "getattr(torch._C, '_x')",
        "torch._C", "getattr(torch.Tensor, '_nnz')", "torch.Tensor.__dict__['_version']",
        "c10d._allgather_base_.default", "torch.Tensor._version.__get__",
    ], texts


def test_compat_is_the_bottom_of_the_import_graph():
    """``_compat`` imports torch only (no module of gtransform)."""
    tree = ast.parse((PKG / "_compat.py").read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            assert n.level == 0 and (n.module or "").split(".")[0] in ("__future__", "typing", "torch"), ast.unparse(n)
        elif isinstance(n, ast.Import):
            assert all(a.name.split(".")[0] in ("torch", "typing") for a in n.names), ast.unparse(n)


def _bound() -> Dict[str, object]:
    return {n: getattr(_compat, n) for n in _compat.__all__}


def test_compat_lists_every_name_it_binds():
    """``__all__`` is every public name ``_compat`` binds (what (b) checks), ``OPTIONAL`` a part of it."""
    tree = ast.parse((PKG / "_compat.py").read_text())
    stmts = list(tree.body)
    bound: Set[str] = set()
    while stmts:
        n = stmts.pop()
        if isinstance(n, ast.Try):
            stmts += n.body + [s for h in n.handlers for s in h.body] + n.orelse + n.finalbody
        elif isinstance(n, ast.Assign):
            bound |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            bound.add(n.target.id)
        elif isinstance(n, ast.FunctionDef):
            bound.add(n.name)
        elif isinstance(n, ast.ImportFrom) and n.module not in ("__future__", "typing"):
            bound |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Import):
            bound |= {a.asname or a.name for a in n.names if a.asname}
    public = {b for b in bound if not b.startswith("_")} - {"OPTIONAL"}
    assert public == set(_compat.__all__), (sorted(public - set(_compat.__all__)), sorted(set(_compat.__all__) - public))
    assert set(_compat.OPTIONAL) <= set(_compat.__all__), sorted(set(_compat.OPTIONAL) - set(_compat.__all__))


def test_every_bound_name_is_in_this_torch():
    """The names bound at import: each present (a documented optional one may be its fallback)."""
    missing = [n for n, v in _bound().items() if not _is_loader(v) and v is None and n not in _compat.OPTIONAL]
    assert not missing, f"not in torch {_torch_version()}: {missing}"


def _is_loader(v: object) -> bool:
    return inspect.isfunction(v) and v.__module__ == _compat.__name__ and not inspect.signature(v).parameters


def _torch_version() -> str:
    import torch

    return torch.__version__


_LOADERS_SCRIPT = r"""
import json, sys
from gtransform import _compat
out = {}
for n in _compat.__all__:
    f = getattr(_compat, n)
    if not (callable(f) and getattr(f, "__module__", "") == _compat.__name__ and getattr(f, "__code__", None) is not None
            and f.__code__.co_argcount == 0 and not isinstance(f, type)):
        continue
    try:
        v = f()
        out[n] = "None" if v is None else "ok"
    except Exception as e:
        out[n] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_loader_finds_its_names():
    """The names looked up on first use (heavy modules: dynamo, inductor, the partitioner), in a
    fresh interpreter so that this one's lazily imported modules stay as they were."""
    r = subprocess.run([sys.executable, "-c", _LOADERS_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got, "no loaders found"
    bad = {n: v for n, v in got.items() if v != "ok" and n not in _compat.OPTIONAL}
    assert not bad, f"torch {_torch_version()}: {bad}"

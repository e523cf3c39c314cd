"""The peers' methods: one module per column family, one builder per column.

A builder takes the row's `Ctx` and returns a `Prepared` (built, checked against eager,
ready to time), or raises `NotApplicable` / `Skipped`. `METHOD_FNS` holds the builders of
rows that are functions of their arguments, `STATEFUL_METHOD_FNS` those of rows with state
(`Workload.factory`: each column builds its own copy of the program).

- `eager`: the plain function, and eager's memory;
- `cuda_graph`: the hand-written `torch.cuda.graph` capture, copy-in + replay and replay
  alone (the floor);
- `graphed_callables`: `torch.cuda.make_graphed_callables`;
- `torch_compile`: `torch.compile(mode="reduce-overhead")`;
- `jax_jit`: `jax.jit` of the row's jax twin;
- `graphify`: gtransform, default and fused, with outputs dropped, held, or viewed; and
  `on_break="split"` (`gt_split`, and with `fuse=True`: `gt_split_fused`) on rows that read values on the host;
- `torch_compile` also has `compile_gt`, `torch.compile(backend="gtransform")`, on those rows.
"""

from __future__ import annotations

from typing import Callable, Dict

from ..context import Ctx, Prepared
from .cuda_graph import method_graph_copy, method_graph_replay, st_graph_copy, st_graph_replay
from .eager import method_eager, st_eager
from .graphed_callables import method_mgc, st_mgc
from .graphify import (
    method_gt_fused,
    method_gt_held,
    method_gt_new,
    method_gt_same,
    method_gt_split,
    method_gt_views,
    st_gt,
)
from .jax_jit import method_jax, st_jax
from .torch_compile import method_compile, method_compile_gt, st_compile, st_compile_gt

METHOD_FNS: Dict[str, Callable[[Ctx], Prepared]] = {
    "eager": method_eager,
    "graph_copy": method_graph_copy,
    "graph_replay": method_graph_replay,
    "mgc": method_mgc,
    "compile": method_compile,
    "jax": method_jax,
    "gt_same": method_gt_same,
    "gt_new": method_gt_new,
    "gt_held": method_gt_held,
    "gt_views": method_gt_views,
    "gt_fused": method_gt_fused,
    "gt_split": method_gt_split,
    "gt_split_fused": method_gt_split,
    "compile_gt": method_compile_gt,
}


STATEFUL_METHOD_FNS: Dict[str, Callable[[Ctx], Prepared]] = {
    "eager": st_eager,
    "graph_copy": st_graph_copy,
    "graph_replay": st_graph_replay,
    "mgc": st_mgc,
    "compile": st_compile,
    "jax": st_jax,
    "gt_same": lambda ctx: st_gt(ctx, new_tensors=False, held=False),
    "gt_new": lambda ctx: st_gt(ctx, new_tensors=True, held=False),
    "gt_held": lambda ctx: st_gt(ctx, new_tensors=False, held=True),
    "gt_views": lambda ctx: st_gt(ctx, new_tensors=False, held="views"),
    "gt_fused": lambda ctx: st_gt(ctx, new_tensors=False, held=False, fuse=True),
    "gt_split": lambda ctx: st_gt(ctx, new_tensors=False, held=False, on_break="split"),
    "gt_split_fused": lambda ctx: st_gt(ctx, new_tensors=False, held=False, fuse=True, on_break="split"),
    "compile_gt": st_compile_gt,
}

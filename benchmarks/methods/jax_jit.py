"""The `jax.jit` column: the row's jax.numpy twin, jitted, on the same device.

jax is imported on first use (a run without it reports the column as skipped), with
float32 matmuls at the precision every torch column uses. Its last output is kept and
blocked on to synchronise. Stateful torch programs have no jax twin (n/a).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from ..context import Ctx, Prepared
from ..core import PRECISION, NotApplicable, Skipped
from ..trees import tree_map_tensors

_JAX: Any = None


def import_jax() -> Any:
    """jax and jax.numpy, imported on first use; Skipped if jax is missing."""
    global _JAX
    if _JAX is None:
        try:
            import jax
            import jax.numpy as jnp

            # float32 matmuls like torch's (see set_precision): full precision, or TF32 with --tf32
            jax.config.update("jax_default_matmul_precision", "tensorfloat32" if PRECISION["tf32"] else "highest")
            _JAX = (jax, jnp)
        except Exception as e:  # not installed, or broken
            _JAX = e
    if isinstance(_JAX, Exception):
        raise Skipped(f"jax unavailable ({type(_JAX).__name__}: {str(_JAX).splitlines()[0] if str(_JAX) else ''})")
    return _JAX


def jax_device(jax: Any, cuda: bool) -> Any:
    if cuda:
        try:
            return jax.devices("gpu")[0]
        except RuntimeError as e:
            raise Skipped(f"jax has no GPU backend ({e})") from None
    return jax.devices("cpu")[0]


def to_jax(args: Any, jax: Any, jnp: Any, dev: Any) -> Any:
    def conv(t: torch.Tensor):
        if t.dtype == torch.bfloat16:
            return jax.device_put(jnp.asarray(t.float().cpu().numpy(), dtype=jnp.bfloat16), dev)
        return jax.device_put(t.cpu().numpy(), dev)

    return tree_map_tensors(conv, args)


def method_jax(ctx: Ctx) -> Prepared:
    w = ctx.w
    if w.jax_fn is None:
        raise NotApplicable("not written")
    jax, jnp = import_jax()
    dev = jax_device(jax, ctx.cuda)
    jf = jax.jit(w.jax_fn(jax, jnp))
    jargs = [to_jax(ctx.sets[k], jax, jnp, dev) for k in (0, 1)]
    if w.jax_key:
        key = [jax.device_put(jax.random.PRNGKey(0), dev)]

        def run(a):
            out = jf(*a, key[0])
            key[0] = out[-1]
            return out
    else:
        def run(a):
            return jf(*a)

    def block(out):
        jax.block_until_ready(out)
        ctx.sync()

    block(jargs)
    t0 = perf_counter()
    out = run(jargs[0])
    block(out)
    first = perf_counter() - t0
    errors = [ctx.err(out, 0), ctx.err(run(jargs[1]), 1)]
    del out
    a0 = jargs[0]
    return Prepared(lambda: run(a0), errors, first, hold=True, sync=block,
                    extra={"first_call_is": "trace + compile + first call"})


def st_jax(ctx: Ctx) -> Prepared:
    raise NotApplicable("not written (stateful torch program)")

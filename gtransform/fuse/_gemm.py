"""Small float32 matrix products with their epilogue in one kernel, for ``fuse=True``.

Launch-bound programs multiply small matrices: an MLP of width 512 at batch 64
makes 64x512x512 products. In full float32 precision (no TF32) cuBLAS runs such a
product on a handful of its SIMT tiles, a few of the GPU's ~130 multiprocessors
busy, in 8-10 us on an H100; inductor then adds a kernel for the bias and the
activation.
This module's Triton kernel tiles the product finely enough to fill the GPU and
applies the bias, a ReLU, or ``threshold_backward``'s mask (the ReLU of the
backward pass) before it stores: one kernel per layer instead of two, each
faster (benchmarks/NOTES.md, "Small float32 products").

:func:`rewrite` swaps the eligible ``mm``/``addmm`` nodes of a traced graph
(and the ``relu``, ``threshold_backward`` or bias ``add`` that is their only
use) for ``gtransform::gemm``, an op that inductor keeps as an extern kernel
while fusing everything around it. It touches only CUDA float32 products in
full precision (``torch.backends.cuda.matmul.allow_tf32`` off) whose size is
in the range where the kernel beats cuBLAS and whose right operand is not
K-contiguous (``x @ w.t()``, nn.Linear's forward, stays cuBLAS's: see
:func:`_transposed`); the rest stays as it was. ``GTRANSFORM_GEMM=0`` in the
environment switches the swap off.

The op computes ``act(a @ b + bias)`` with float32 accumulators, as cuBLAS
does, in another summation order: results match eager's to float32 rounding
(about as far from the exact product as cuBLAS's), not bit for bit. Its CPU
implementation is the same arithmetic in aten ops, so the rewrite is tested
where no GPU is. Triton is imported on the first CUDA launch only.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _triton
from ._operands import enabled, f32_on, product_operands, reach, val

__all__ = ["rewrite", "gemm", "precompile", "pick_config", "Config", "ACT_NONE", "ACT_RELU"]

ACT_NONE, ACT_RELU = 0, 1

Config = Tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""

MAX_FLOPS = 1 << 28
"""Largest M*N*K swapped for the kernel (256x1024x1024); past it cuBLAS fills the GPU by itself
(at 1024^3 cuBLAS is 10% faster on an H100)."""

_FORCED: Optional[Config] = None  # set by benchmarks/probes/_probe_gemm.py to time one configuration


def pick_config(m: int, n: int, k: int) -> Config:
    """Tile sizes for an (m, k) x (k, n) product: enough programs to occupy the GPU.

    Small tiles give many programs (a 64x512 output in 16x16 tiles is 128 of them),
    which is what these products lack under cuBLAS, and a long K step keeps each
    busy; the K loop stays in one program, so the sum is deterministic. Chosen from
    the H100 measurements of ``benchmarks/probes/_probe_gemm.py`` (NOTES.md).
    """
    if _FORCED is not None:
        return _FORCED
    if -(-m // 16) * -(-n // 16) <= 256:
        bm = bn = 16
    elif -(-m // 32) * -(-n // 32) < 256:
        bm = bn = 32
    else:
        bm, bn = 32, 64
    bk = min(128 if bm == 16 else 64, max(16, 1 << (k - 1).bit_length()))
    return (bm, bn, bk, 4, 3 if bk == 128 else 2)


@functools.cache
def _kernel() -> Any:
    _triton.use_inductors_ptxas()  # before Triton first computes a cache key in this process
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["has_bias", "has_mask", "act"])  # type: ignore[misc]
    def gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, mask_ptr, M, N, K,  # type: ignore[no-untyped-def]
                    s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_biasm, s_biasn, s_mm, s_mn,
                    has_bias, has_mask, act, threshold,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
        # The epilogue's choices are run-time flags: one compiled kernel serves every layer
        # of an MLP (a compile costs 0.3-0.8 s of the first call).
        # Each K step of BK is SPLIT sub-blocks, each summed into an accumulator of its
        # own, added at the end: float32 rounding then grows like a sum of K / SPLIT terms.
        # One accumulator over K=512 was 3x further from the exact product than eager's
        # cuBLAS, enough to flip a ReLU whose input was 1e-6 from 0 in a benchmark's
        # gradient (and tl.dot folds a separate `acc += dot` back into one chain).
        SK: tl.constexpr = BK // SPLIT
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, SK)
        in_m = rm[:, None] < M
        in_n = rn[None, :] < N
        a_rows = a_ptr + rm[:, None] * s_am
        b_cols = b_ptr + rn[None, :] * s_bn
        acc0 = tl.zeros((BM, BN), dtype=tl.float32)
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + rk
            a = tl.load(a_rows + k[None, :] * s_ak, mask=in_m & (k[None, :] < K), other=0.0)
            b = tl.load(b_cols + k[:, None] * s_bk, mask=(k[:, None] < K) & in_n, other=0.0)
            acc0 = tl.dot(a, b, acc0, input_precision="ieee")
            if SPLIT >= 2:
                k = k0 + SK + rk
                a = tl.load(a_rows + k[None, :] * s_ak, mask=in_m & (k[None, :] < K), other=0.0)
                b = tl.load(b_cols + k[:, None] * s_bk, mask=(k[:, None] < K) & in_n, other=0.0)
                acc1 = tl.dot(a, b, acc1, input_precision="ieee")
            if SPLIT >= 4:
                k = k0 + 2 * SK + rk
                a = tl.load(a_rows + k[None, :] * s_ak, mask=in_m & (k[None, :] < K), other=0.0)
                b = tl.load(b_cols + k[:, None] * s_bk, mask=(k[:, None] < K) & in_n, other=0.0)
                acc2 = tl.dot(a, b, acc2, input_precision="ieee")
                k = k0 + 3 * SK + rk
                a = tl.load(a_rows + k[None, :] * s_ak, mask=in_m & (k[None, :] < K), other=0.0)
                b = tl.load(b_cols + k[:, None] * s_bk, mask=(k[:, None] < K) & in_n, other=0.0)
                acc3 = tl.dot(a, b, acc3, input_precision="ieee")
        acc = (acc0 + acc1) + (acc2 + acc3)
        inside = in_m & in_n
        if has_bias != 0:
            acc += tl.load(bias_ptr + rm[:, None] * s_biasm + rn[None, :] * s_biasn, mask=inside, other=0.0)
        if act == 1:
            acc = tl.maximum(acc, 0.0)
        if has_mask != 0:
            # threshold_backward(acc, mask, threshold): 0 where mask <= threshold
            keep = tl.load(mask_ptr + rm[:, None] * s_mm + rn[None, :] * s_mn, mask=inside, other=0.0)
            acc = tl.where(keep <= threshold, 0.0, acc)
        tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc, mask=inside)

    return gemm_kernel


def _transposed(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a 2-D operand is stored column-major (its columns are contiguous, its rows not).

    A ``b`` stored so (``x @ w.t()``: nn.Linear's forward, and the input gradient of
    ``x @ w``) is K-contiguous: there the kernel is slower than cuBLAS (11.6 against
    7.9 us at 64x512x512 on an H100 with tl.dot, whatever the tile or load order; 22 us
    summing a 3-D block in registers), so such products stay cuBLAS's.
    """
    return stride[0] == 1 and stride[1] != 1 and shape[0] > 1


def _expanded(shape: Sequence[int], stride: Sequence[int], m: int, n: int) -> Tuple[int, int]:
    """The strides of a tensor of this size and strides expanded to (m, n) (0 where broadcast)."""
    dims = [(1, 0)] * (2 - len(shape)) + list(zip(shape, stride))
    return tuple(0 if size == 1 and full != 1 else st for (size, st), full in zip(dims, (m, n)))  # type: ignore[return-value]


def _plan(a: Any, b: Any, bias: Any, mask: Any, act: int, config: Optional[Config] = None
          ) -> Tuple[Tuple[int, int], Tuple[int, ...], Dict[str, Any]]:
    """The grid, integer arguments and compile-time constants of one launch.

    ``a``, ``b``, ``bias`` and ``mask`` are tensors or fake tensors (only their sizes and
    strides are read), so that :func:`precompile` builds the very kernel a launch will use.
    """
    m, k = a.shape
    n = b.shape[1]
    bm, bn, bk, warps, stages = config or pick_config(m, n, k)
    out_stride = (n, 1)
    bias_stride = _expanded(bias.shape, bias.stride(), m, n) if bias is not None else out_stride
    mask_stride = _expanded(mask.shape, mask.stride(), m, n) if mask is not None else out_stride
    ints = (m, n, k, *a.stride(), *b.stride(), *out_stride, *bias_stride, *mask_stride)
    ints = (*ints, int(bias is not None), int(mask is not None), act)
    split = 4 if bk >= 64 else 2 if bk >= 32 else 1
    consts = dict(BM=bm, BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
    return ((m + bm - 1) // bm, (n + bn - 1) // bn), ints, consts


def _launch(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
            act: int, threshold: float, config: Optional[Config] = None) -> torch.Tensor:
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    grid, ints, consts = _plan(a, b, bias, mask, act, config)
    args = (a, b, out, out if bias is None else bias, out if mask is None else mask, *ints, float(threshold))
    # current device and stream, as Triton's own launch; no C launcher built (_triton.launch)
    _triton.launch(_kernel(), grid, args, consts, torch.cuda.current_device())
    return out


def precompile(launches: Sequence[Tuple[Any, Any, Any, Any, int]]) -> List[Any]:
    """Start compiling, in threads, the kernels that these launches will need.

    Each launch is ``(a, b, bias, mask, act)`` of fake tensors (a graph node's values).
    The kernels build while inductor compiles the rest of the graph
    (:func:`gtransform.fuse._triton.precompile`); a launch whose kernel is not ready
    (or differs) compiles it then, as it would anyway.

    Returns:
        Futures to wait on (their failures are only logged: the launch reports them).
    """
    if not launches:
        return []
    kernel = _kernel()
    f32 = torch.float32
    seen, jobs = set(), []
    for a, b, bias, mask, act in launches:
        grid, ints, consts = _plan(a, b, bias, mask, act)
        # one build per kernel Triton would make (the epilogue flags, the last three,
        # are not specialized on)
        key = (_triton.specialization(ints[:-3]), tuple(sorted(consts.items())))
        if key not in seen:
            seen.add(key)
            jobs.append(((f32, f32, f32, f32, f32, *ints, 0.0), grid, consts))
    return _triton.precompile(kernel, jobs, launches[0][0].device.index, workers=8, name="gtransform-gemm")


def _reference(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
               act: int, threshold: float) -> torch.Tensor:
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    if act == ACT_RELU:
        out = torch.relu(out)
    if mask is not None:
        out = torch.ops.aten.threshold_backward(out, mask, threshold)
    return out.contiguous()


@functools.cache
def _op() -> Any:
    """``gtransform::gemm``, registered on first use."""

    @torch.library.custom_op("gtransform::gemm", mutates_args=())
    def gemm_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                act: int, threshold: float) -> torch.Tensor:
        if a.device.type == "cuda":
            return _launch(a, b, bias, mask, act, threshold)
        return _reference(a, b, bias, mask, act, threshold)

    @gemm_op.register_fake
    def _(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor],
          act: int, threshold: float) -> torch.Tensor:
        return a.new_empty((a.shape[0], b.shape[1]))

    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        a, b, bias, mask, out = ctx.saved_tensors
        g = grad
        if mask is not None:
            g = torch.where(mask <= ctx.threshold, 0.0, g)
        if ctx.act == ACT_RELU:
            g = torch.where(out <= 0, 0.0, g)
        ga = g @ b.t() if ctx.needs_input_grad[0] else None
        gb = a.t() @ g if ctx.needs_input_grad[1] else None
        gbias = None
        if bias is not None and ctx.needs_input_grad[2]:
            gbias = g.sum_to_size(bias.shape)
        return ga, gb, gbias, None, None, None

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: torch.Tensor) -> None:
        a, b, bias, mask, act, threshold = inputs
        ctx.act, ctx.threshold = act, threshold
        ctx.save_for_backward(a, b, bias, mask, output)

    gemm_op.register_autograd(backward, setup_context=setup_context)
    return torch.ops.gtransform.gemm.default


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
         act: int = ACT_NONE, threshold: float = 0.0) -> torch.Tensor:
    """``act(a @ b + bias)``, then zero where ``mask <= threshold`` (the op :func:`rewrite` inserts)."""
    return _op()(a, b, bias, mask, act, threshold)


# --------------------------------------------------------------------------
# The graph pass
# --------------------------------------------------------------------------

_aten = torch.ops.aten


def _eligible(a: Any, b: Any, device: str) -> bool:
    va, vb = val(a), val(b)
    if not (f32_on(va, device) and f32_on(vb, device) and va.dim() == 2 and vb.dim() == 2):
        return False
    if max(reach(va), reach(vb)) >= 2**31:
        return False
    m, k = va.shape
    n = vb.shape[1]
    if n > 1 and _transposed(tuple(vb.shape), vb.stride()):
        return False
    return 0 < m * n * k <= MAX_FLOPS and max(va.numel(), vb.numel(), m * n) < 2**31


def _bias_ok(bias: Any, m: int, n: int, device: str) -> bool:
    v = val(bias)
    if not f32_on(v, device) or v.dim() > 2 or reach(v) >= 2**31:
        return False
    try:
        return tuple(torch.broadcast_shapes(tuple(v.shape), (m, n))) == (m, n)
    except RuntimeError:
        return False


def _only_user(node: Any) -> Any:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def rewrite(gm: torch.fx.GraphModule, device: str = "cuda", launches: Optional[List[Any]] = None) -> Dict[str, int]:
    """Swap eligible products (and their epilogue) in ``gm`` for ``gtransform::gemm``, in place.

    Args:
        gm: a traced graph whose nodes carry their fake values (``meta["val"]``).
        device: the device type whose products are swapped (the tests swap CPU ones).
        launches: if given, each swap's ``(a, b, bias, mask, act)`` values are appended
            to it (for :func:`precompile`).

    Returns:
        How many products were swapped and how many epilogue ops went with them
        (``{"gemm": .., "relu": .., "mask": .., "bias": ..}``).
    """
    counts = {"gemm": 0, "relu": 0, "mask": 0, "bias": 0}
    if not enabled():
        return counts
    graph = gm.graph
    op = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        operands = product_operands(node)
        if operands is None:
            continue
        bias, a, b = operands
        if not _eligible(a, b, device):
            continue
        m, n = val(a).shape[0], val(b).shape[1]
        if bias is not None and not _bias_ok(bias, m, n, device):
            continue
        last, act, mask, threshold = node, ACT_NONE, None, 0.0
        user = _only_user(last)
        if bias is None and user is not None and user.target is _aten.add.Tensor and len(user.args) == 2 \
                and not user.kwargs and user.args[0] is last and user.args[1] is not last \
                and _bias_ok(user.args[1], m, n, device) and val(user.args[1]).dim() == 1:
            bias, last = user.args[1], user
            counts["bias"] += 1
            user = _only_user(last)
        if user is not None and user.target is _aten.relu.default and user.args[0] is last:
            last, act = user, ACT_RELU
            counts["relu"] += 1
            user = _only_user(last)
        if user is not None and user.target is _aten.threshold_backward.default and user.args[0] is last \
                and user.args[1] is not last and isinstance(user.args[2], (int, float)):
            mv = val(user.args[1])
            if f32_on(mv, device) and tuple(mv.shape) == (m, n) and reach(mv) < 2**31:
                last, mask, threshold = user, user.args[1], float(user.args[2])
                counts["mask"] += 1
        if op is None:
            op = _op()
        with graph.inserting_before(last):
            new = graph.call_function(op, (a, b, bias, mask, act, threshold))
        new.meta.update(last.meta)  # its value (a contiguous m x n float32) and gtransform's tags
        last.replace_all_uses_with(new)
        # the replaced chain, from its end: each had one user, now gone
        dead = last
        while dead is not node:
            prev = dead.args[0]
            graph.erase_node(dead)
            dead = prev
        graph.erase_node(node)
        counts["gemm"] += 1
        if launches is not None:
            launches.append((val(a), val(b), val(bias) if bias is not None else None,
                             val(mask) if mask is not None else None, act))
    if counts["gemm"]:
        graph.lint()
        gm.recompile()
    return counts


def describe(counts: Dict[str, int]) -> str:
    """One line for the log: what :func:`rewrite` swapped."""
    return (f"{counts['gemm']} float32 products as gtransform::gemm "
            f"({counts['relu']} with ReLU, {counts['mask']} with a ReLU mask, {counts['bias']} bias adds)")

"""Matrix-vector products of one input with several weights in one kernel, for ``fuse=True``.

A decoder at batch 1 multiplies one row (a token's hidden state) by the weights of
nn.Linear layers: ``x @ w.t()`` with ``x`` of 1 to 8 rows. In full float32 precision
cuBLAS runs each as a GEMV kernel of 2.2-2.5 us on an H100, almost all of it latency,
and inductor leaves them as they are. The projections that read the same input (a
Llama layer's q, k and v; its gate and up) then cost three and two such kernels. This
module's Triton kernel computes up to four of them in one launch: 1.7 us for q, k and
v against 6.7 for cuBLAS's three, 1.9 for gate and up against 5.4
(``benchmarks/probes/_probe_gemv.py``, NOTES.md, thirteenth session).

:func:`rewrite` finds the ``mm`` / ``addmm`` nodes of a traced graph whose right
operand is ``t(w)`` (nn.Linear's forward: ``w`` a contiguous ``(n, k)`` weight) and
whose left one has at most :data:`MAX_ROWS` rows, groups those that read the same
input (the same tensor, or views of one tensor with the same shape), and swaps each
group for ``gtransform::gemv``, an op inductor keeps as one extern kernel with
several outputs. It touches only float32 products in full precision on the given
device, with weights up to :data:`MAX_WEIGHT` elements (a vocabulary projection
stays cuBLAS's); ``GTRANSFORM_GEMM=0`` switches it off with the matrix-product swap.

Each output element is a float32 dot product, summed in another order than cuBLAS's:
results match eager's to float32 rounding, not bit for bit. The op's CPU
implementation is the same arithmetic in aten ops, so the rewrite is tested where no
GPU is. Triton is imported on the first CUDA launch only.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._compat import aten_unsafe_view
from . import _triton
from ._operands import enabled, f32_on, product_operands, reach, val

__all__ = ["rewrite", "gemv", "describe", "MAX_ROWS", "MAX_WEIGHT", "SLOTS"]

MAX_ROWS = 8
"""Largest number of rows of the input swapped (the kernel reads each weight once per row)."""

MAX_WEIGHT = 1 << 22
"""Largest weight (elements) swapped; a 32000 x 256 vocabulary projection stays cuBLAS's."""

SLOTS = 4
"""Products one launch computes; a larger group is split."""

BN = 4
"""Output elements per program: many programs even for 128 outputs (the H100 probe's best)."""

_aten = torch.ops.aten


def _block_k(k: int) -> int:
    return min(256, max(16, 1 << (k - 1).bit_length()))


@functools.cache
def _kernel() -> Any:
    _triton.use_inductors_ptxas()  # before Triton first computes a cache key in this process
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def part(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, s_am, s_ak, has_bias, pid,  # type: ignore[no-untyped-def]
             BN: tl.constexpr, BK: tl.constexpr):
        # BN outputs of one product, for every row of a: a (BN, BK) block of float32
        # partial sums over K, summed at the end
        rn = pid * BN + tl.arange(0, BN)
        in_n = rn < N
        for m in range(0, M):
            acc = tl.zeros((BN, BK), dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                in_k = rk < K
                a = tl.load(a_ptr + m * s_am + rk * s_ak, mask=in_k, other=0.0)
                w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
                acc += w * a[None, :]
            out = tl.sum(acc, axis=1)
            if has_bias != 0:
                out += tl.load(bias_ptr + rn, mask=in_n, other=0.0)
            tl.store(c_ptr + m * N + rn, out, mask=in_n)

    @triton.jit(do_not_specialize=["hb0", "hb1", "hb2", "hb3"])  # type: ignore[misc]
    def gemv_kernel(a_ptr, M, K, s_am, s_ak,  # type: ignore[no-untyped-def]
                    w0, b0, c0, n0, hb0, w1, b1, c1, n1, hb1, w2, b2, c2, n2, hb2, w3, b3, c3, n3, hb3,
                    BN: tl.constexpr, BK: tl.constexpr):
        # the programs of product 0 first, then 1, 2, 3 (an unused slot has n = 0)
        pid = tl.program_id(0)
        p0 = tl.cdiv(n0, BN)
        p1 = p0 + tl.cdiv(n1, BN)
        p2 = p1 + tl.cdiv(n2, BN)
        if pid < p0:
            part(a_ptr, w0, b0, c0, M, n0, K, s_am, s_ak, hb0, pid, BN, BK)
        elif pid < p1:
            part(a_ptr, w1, b1, c1, M, n1, K, s_am, s_ak, hb1, pid - p0, BN, BK)
        elif pid < p2:
            part(a_ptr, w2, b2, c2, M, n2, K, s_am, s_ak, hb2, pid - p1, BN, BK)
        else:
            part(a_ptr, w3, b3, c3, M, n3, K, s_am, s_ak, hb3, pid - p2, BN, BK)

    return gemv_kernel


def _launch(a: torch.Tensor, ws: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    m, k = a.shape  # (0 < m <= MAX_ROWS, 0 < k: see _match)
    outs = [torch.empty((m, w.shape[0]), dtype=torch.float32, device=a.device) for w in ws]
    kernel = _kernel()
    dev = torch.cuda.current_device()
    for s in range(0, len(ws), SLOTS):
        part = range(s, min(s + SLOTS, len(ws)))
        grid, args, consts = _plan(a, [ws[j].contiguous() for j in part], [biases[j] for j in part],
                                   [outs[j] for j in part])
        _triton.launch(kernel, grid, args, consts, dev)  # as _gemm's: no C launcher built
    return outs


def _plan(a: Any, ws: Sequence[Any], biases: Sequence[Any], outs: Sequence[Any]
          ) -> Tuple[Tuple[int], List[Any], Dict[str, Any]]:
    """The grid, arguments and compile-time constants of one launch (at most SLOTS products).

    The tensors may be :class:`_Spec` (sizes and strides alone: :func:`precompile`, which
    hands Triton dtypes in their place, and it builds the variant a launch will pick).
    """
    m, k = _shape(a)
    args: List[Any] = [a, m, k, *_strides(a)]
    progs = 0
    for j in range(SLOTS):
        if j < len(ws):
            n = _shape(ws[j])[0]
            args += [ws[j], outs[j] if biases[j] is None else biases[j], outs[j], n, int(biases[j] is not None)]
            progs += -(-n // BN)
        else:
            args += [a, a, outs[0], 0, 0]
    return (progs,), args, dict(BN=BN, BK=_block_k(k), num_warps=4, num_stages=2)


class _Spec:
    """A tensor's sizes and strides: what :func:`precompile` plans a launch from."""

    def __init__(self, shape: Sequence[int], strides: Sequence[int]):
        self.shape, self.strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)


def _shape(t: Any) -> Tuple[int, ...]:
    return t.shape if isinstance(t, _Spec) else tuple(t.shape)


def _strides(t: Any) -> Tuple[int, ...]:
    return t.strides if isinstance(t, _Spec) else tuple(t.stride())


def precompile(groups: Sequence[Tuple[Any, Sequence[Any], Sequence[bool]]]) -> List[Any]:
    """Start compiling, in threads, the kernel variants these groups' launches will need.

    Each group is ``(a, ns, has_bias)``: the input's fake tensor (a graph value), each
    product's output count and whether it adds a bias. As
    :func:`gtransform.fuse._gemm.precompile`: the kernels build while inductor compiles
    the rest of the graph (:func:`gtransform.fuse._triton.precompile`); a launch whose
    variant is not ready compiles it then.

    Returns:
        Futures to wait on (their failures are only logged: the launch reports them).
    """
    if not groups:
        return []
    kernel = _kernel()
    f32 = torch.float32
    seen, jobs = set(), []
    for a, ns, has_bias in groups:
        m, k = (int(x) for x in a.shape)
        for s in range(0, len(ns), SLOTS):
            part = range(s, min(s + SLOTS, len(ns)))
            grid, args, consts = _plan(_Spec(a.shape, a.stride()), [_Spec((ns[j], k), (k, 1)) for j in part],
                                       [f32 if has_bias[j] else None for j in part],
                                       [_Spec((m, ns[j]), (ns[j], 1)) for j in part])
            # one build per variant Triton would make (the bias flags are not specialized on)
            ints = tuple(v for v in args if isinstance(v, int))
            key = (_triton.specialization(ints), tuple(sorted(consts.items())))
            if key not in seen:
                seen.add(key)
                jobs.append(([f32 if isinstance(v, _Spec) or v is f32 else v for v in args], grid, consts))
    return _triton.precompile(kernel, jobs, groups[0][0].device.index, workers=4, name="gtransform-gemv")


def _reference(a: torch.Tensor, ws: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    return [(torch.mm(a, w.t()) if b is None else torch.addmm(b, a, w.t())).contiguous() for w, b in zip(ws, biases)]


@functools.cache
def _op() -> Any:
    """``gtransform::gemv``, registered on first use."""

    @torch.library.custom_op("gtransform::gemv", mutates_args=())
    def gemv_op(a: torch.Tensor, ws: List[torch.Tensor], biases: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        if a.device.type == "cuda":
            return _launch(a, ws, biases)
        return _reference(a, ws, biases)

    @gemv_op.register_fake
    def _(a: torch.Tensor, ws: List[torch.Tensor], biases: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
        return [a.new_empty((a.shape[0], w.shape[0])) for w in ws]

    return torch.ops.gtransform.gemv.default


def gemv(a: torch.Tensor, ws: Sequence[torch.Tensor], biases: Optional[Sequence[Optional[torch.Tensor]]] = None
         ) -> List[torch.Tensor]:
    """``[a @ w.t() + b for w, b in zip(ws, biases)]`` in one kernel (the op :func:`rewrite` inserts)."""
    return _op()(a, list(ws), list(biases) if biases is not None else [None] * len(ws))  # type: ignore[no-any-return]


# --------------------------------------------------------------------------
# The graph pass
# --------------------------------------------------------------------------

_VIEWS = (_aten.view.default, aten_unsafe_view(), _aten.reshape.default)


def _source(a: Any) -> Tuple[Any, Tuple[int, ...]]:
    """What a product's left operand reads: ``view(x, shape)`` of the same ``x`` and shape is one input."""
    shape = tuple(int(s) for s in val(a).shape)
    while getattr(a, "op", None) == "call_function" and a.target in _VIEWS:
        a = a.args[0]
    return a, shape


def _match(node: Any, device: str) -> Optional[Tuple[Any, Any, Any]]:
    """``(a, w, bias)`` if ``node`` is ``a @ t(w)`` (+ bias) the kernel takes, else None."""
    operands = product_operands(node)
    if operands is None:
        return None
    bias, a, b = operands
    if getattr(b, "op", None) != "call_function" or b.target is not _aten.t.default:
        return None
    w = b.args[0]
    # (the weight's own value may be missing: state lifted into placeholders has none;
    # its t() view has one)
    va, vb = val(a), val(b)
    if not (f32_on(va, device) and f32_on(vb, device) and va.dim() == 2 and vb.dim() == 2):
        return None
    m, k = va.shape
    n = vb.shape[1]
    if not (0 < m <= MAX_ROWS and 0 < n and 0 < k and n * k <= MAX_WEIGHT and vb.shape[0] == k):
        return None
    if tuple(vb.stride()) != (1, k) or reach(va) >= 2**31:  # w contiguous (n, k)
        return None
    if bias is not None:
        vb = val(bias)
        if not (f32_on(vb, device) and vb.dim() == 1 and vb.shape[0] == n and vb.stride()[0] == 1):
            return None
    return a, w, bias


def rewrite(gm: torch.fx.GraphModule, device: str = "cuda", launches: Optional[List[Any]] = None) -> Dict[str, int]:
    """Swap small products ``x @ w.t()`` in ``gm`` for ``gtransform::gemv``, those reading one input grouped.

    Args:
        gm: a traced graph whose nodes carry their fake values (``meta["val"]``).
        device: the device type whose products are swapped (the tests swap CPU ones).
        launches: if given, each group's ``(a, ns, has_bias)`` is appended to it (for
            :func:`precompile`).

    Returns:
        ``{"gemv": products swapped, "launches": kernels they became}``.
    """
    counts = {"gemv": 0, "launches": 0}
    if not enabled():
        return counts
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: List[List[Tuple[Any, Any, Any, Any]]] = []  # (mm node, a, w, bias), in graph order
    open_group: Dict[Tuple[Any, Tuple[int, ...]], List[Tuple[Any, Any, Any, Any]]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        hit = _match(node, device)
        if hit is None:
            # the trace is not functional: an op writing in place (the input, a weight, a
            # cache) between two products ends every group (a later product must not move
            # before it); calls of unknown effect too
            schema = getattr(node.target, "_schema", None)
            if (schema.is_mutable if schema is not None else node.target is not operator.getitem):
                open_group.clear()
            continue
        a, w, bias = hit
        key = _source(a)
        group = open_group.get(key)
        # one launch at the first product's place: the others' weights and biases must
        # exist there already (placeholders, in practice)
        if group is not None and len(group) < SLOTS and all(
            order[x] < order[group[0][0]] for x in (w, bias) if x is not None
        ):
            group.append((node, a, w, bias))
        else:
            group = open_group[key] = [(node, a, w, bias)]
            groups.append(group)
    if not groups:
        return counts
    op = _op()
    for group in groups:
        first, a = group[0][0], group[0][1]
        if launches is not None:
            launches.append((val(a), [int(val(g[0]).shape[1]) for g in group], [g[3] is not None for g in group]))
        with graph.inserting_before(first):
            new = graph.call_function(op, (a, [g[2] for g in group], [g[3] for g in group]))
            new.meta["val"] = [val(g[0]) for g in group]
            if "gt_calls" in first.meta:  # (the call it is part of: see _regions)
                new.meta["gt_calls"] = first.meta["gt_calls"]
            for i, (node, _a, _w, _b) in enumerate(group):
                item = graph.call_function(operator.getitem, (new, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node, a_k, _w, _b in group:
            t = node.args[-1]
            graph.erase_node(node)
            for dead in (t, a_k):  # the weight's t() and another product's view of the input
                if not dead.users and dead.op == "call_function" and dead.target in (_aten.t.default, *_VIEWS):
                    graph.erase_node(dead)
        counts["gemv"] += len(group)
        counts["launches"] += 1
    graph.lint()
    gm.recompile()
    return counts


def describe(counts: Dict[str, int]) -> str:
    """One line for the log: what :func:`rewrite` swapped."""
    return f"{counts['gemv']} small float32 products x @ w.t() as gtransform::gemv in {counts['launches']} kernels"

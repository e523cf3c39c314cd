"""cuDNN recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` on CUDA) in a trace.

Eager's ``torch._VF.lstm`` (and ``gru``, ``rnn_tanh``, ``rnn_relu``) is a C++ composite
that first probes whether the weights sit in one packed cuDNN buffer by pointing an
empty tensor at the weights' storage object (``set_(storage)``): no graph can hold that.
And when the weights are not packed, ``aten._cudnn_rnn`` packs them itself and returns
the packed buffer, which its backward needs; its fake (meta) version returns nothing in
that slot, so a traced backward would be handed no weights.

While tracing, such calls are routed to :func:`call`: the same ``aten._cudnn_rnn`` with
unpacked weights, inside an op of our own (``gtransform::cudnn_rnn``) whose fake version
returns a packed buffer of the real size and whose backward is ``aten._cudnn_rnn_backward``
with that buffer (in an op of ours too, ``gtransform::cudnn_rnn_backward``: aten's has no
fake version): the kernels, and so the numbers, of eager. The ops carry their autograd, so
a graph that holds them can also be differentiated by running it (the recompute path).

Not covered: packed sequences (their batch sizes are host values: a clear error before
this point) and dropout between layers in training mode (cuDNN keeps that random state to
itself: refused). ``torch.func`` transforms over these ops fail as they do in eager.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ._compat import VariableFunctions, aten_cudnn_rnn, aten_cudnn_rnn_backward

__all__: List[str] = []

# torch._VF function -> cuDNN's cudnnRNNMode_t
_MODES = {
    VariableFunctions.rnn_relu: 0,
    VariableFunctions.rnn_tanh: 1,
    VariableFunctions.lstm: 2,
    VariableFunctions.gru: 3,
}
FUNCS = frozenset(_MODES)


def applies(func: Any, args: Sequence[Any]) -> bool:
    """Whether eager would run this ``torch._VF`` call on cuDNN, padded (not packed) input."""
    if func not in _MODES or len(args) != 9:  # the packed-sequence overloads take 8
        return False
    x = args[0]
    return isinstance(x, torch.Tensor) and isinstance(args[1], (torch.Tensor, list, tuple)) \
        and bool(torch.backends.cudnn.is_acceptable(x))


def call(func: Any, args: Sequence[Any], fail: Callable[[str, str, str], None]) -> Any:
    """``func(*args)`` (a ``torch._VF`` recurrent layer on cuDNN) as ``gtransform::cudnn_rnn``."""
    x, hidden, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    lstm = func is VariableFunctions.lstm
    hx, cx = (hidden[0], hidden[1]) if lstm else (hidden, None)
    hidden_size, proj_size = hx.size(2), 0
    if cx is not None and cx.size(2) != hx.size(2):
        hidden_size, proj_size = cx.size(2), hx.size(2)
    if train and dropout > 0:
        fail(
            f"a multi-layer recurrent layer (torch._VF.{func.__name__}) applies dropout={dropout} "
            "between its layers on cuDNN, in training mode.",
            "cuDNN draws that dropout from a random state of its own, kept inside cuDNN and "
            "advanced on every call: a recording can neither hold it nor follow torch.manual_seed "
            "with it.",
            "set the layer's dropout to 0 and apply nn.Dropout to its output (or stack single-layer "
            "modules with nn.Dropout between them), or call it in eval mode.",
        )
    n_params = (4 if has_biases else 2) + (1 if proj_size else 0)
    out, hy, cy, _reserve, _buf = _op()(
        x, list(params), n_params, hx, cx, _MODES[func], hidden_size, proj_size, num_layers,
        batch_first, float(dropout), bool(train), bool(bidirectional))
    return (out, hy, cy) if lstm else (out, hy)


@functools.cache
def _op() -> Any:
    aten_fwd = aten_cudnn_rnn()

    @torch.library.custom_op("gtransform::cudnn_rnn", mutates_args=())
    def cudnn_rnn(input: torch.Tensor, weight: List[torch.Tensor], weight_stride0: int, hx: torch.Tensor,
                  cx: Optional[torch.Tensor], mode: int, hidden_size: int, proj_size: int, num_layers: int,
                  batch_first: bool, dropout: float, train: bool, bidirectional: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, hy, cy, reserve, buf = aten_fwd(input, weight, weight_stride0, None, hx, cx, mode, hidden_size,
                                             proj_size, num_layers, batch_first, dropout, train, bidirectional,
                                             [], None)
        n = _packed_numel(weight, weight_stride0, mode, hidden_size, num_layers, bidirectional)
        if buf.numel() != n:
            raise RuntimeError(
                f"gtransform: cuDNN packed the recurrent layer's weights into {buf.numel()} elements, "
                f"not the {n} its trace assumed; please report this (torch "
                f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}).")
        return out, hy, _defined(cy, hy), reserve, buf

    @cudnn_rnn.register_fake
    def _(input: torch.Tensor, weight: List[torch.Tensor], weight_stride0: int, hx: torch.Tensor,
          cx: Optional[torch.Tensor], mode: int, hidden_size: int, proj_size: int, num_layers: int,
          batch_first: bool, dropout: float, train: bool, bidirectional: bool) -> Any:
        out, hy, cy, reserve, _ = aten_fwd(input, weight, weight_stride0, None, hx, cx, mode, hidden_size,
                                           proj_size, num_layers, batch_first, dropout, train, bidirectional,
                                           [], None)
        return out, hy, _defined(cy, hy), reserve, weight[0].new_empty(
            (_packed_numel(weight, weight_stride0, mode, hidden_size, num_layers, bidirectional),))

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Any, ...]) -> None:
        input, weight, weight_stride0, hx, cx = inputs[:5]
        ctx.config = inputs[5:]
        ctx.weight_stride0 = weight_stride0
        ctx.n_weight = len(weight)
        ctx.has_cx = cx is not None
        out, _hy, _cy, reserve, buf = output
        ctx.save_for_backward(input, hx, cx, out, reserve, buf, *weight)

    def backward(ctx: Any, g_out: Any, g_hy: Any, g_cy: Any, _g_reserve: Any, _g_buf: Any) -> Any:
        input, hx, cx, out, reserve, buf, *weight = ctx.saved_tensors
        d_in, d_hx, d_cx, d_w = _backward_op()(
            input, weight, ctx.weight_stride0, buf, hx, cx, out, g_out, g_hy, g_cy if ctx.has_cx else None,
            reserve, *ctx.config)
        return d_in, list(d_w), None, d_hx, d_cx if ctx.has_cx else None, None, None, None, None, None, None, None, None

    cudnn_rnn.register_autograd(backward, setup_context=setup_context)
    return torch.ops.gtransform.cudnn_rnn.default


@functools.cache
def _backward_op() -> Any:
    """``aten._cudnn_rnn_backward`` as an op with a fake version (aten's has none)."""
    aten_bwd = aten_cudnn_rnn_backward()

    @torch.library.custom_op("gtransform::cudnn_rnn_backward", mutates_args=())
    def cudnn_rnn_backward(input: torch.Tensor, weight: List[torch.Tensor], weight_stride0: int, buf: torch.Tensor,
                           hx: torch.Tensor, cx: Optional[torch.Tensor], out: torch.Tensor, g_out: torch.Tensor,
                           g_hy: torch.Tensor, g_cy: Optional[torch.Tensor], reserve: torch.Tensor, mode: int,
                           hidden_size: int, proj_size: int, num_layers: int, batch_first: bool, dropout: float,
                           train: bool, bidirectional: bool
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
        # cuDNN's backward writes into its reserve: a copy keeps the saved one for a second backward
        d_in, d_hx, d_cx, d_w = aten_bwd(
            input, weight, weight_stride0, buf, hx, cx, out, g_out, g_hy, g_cy, mode, hidden_size, proj_size,
            num_layers, batch_first, dropout, train, bidirectional, [], None, reserve.clone(),
            [True, True, cx is not None, True])
        # the weights' gradients are views of one flat buffer: an op's outputs may not share memory
        d_in, d_hx, d_cx = _unshared([d_in, d_hx, _defined(d_cx, d_hx)], [input, hx, cx, out, g_out, g_hy, buf])
        return d_in, d_hx, d_cx, _unshared(list(d_w), list(weight), [d_in, d_hx, d_cx])

    @cudnn_rnn_backward.register_fake
    def _(input: torch.Tensor, weight: List[torch.Tensor], weight_stride0: int, buf: torch.Tensor,
          hx: torch.Tensor, cx: Optional[torch.Tensor], *rest: Any) -> Any:
        return (torch.empty_like(input), torch.empty_like(hx),
                torch.empty_like(cx) if cx is not None else hx.new_empty((0,)),
                [torch.empty_like(w) for w in weight])

    return torch.ops.gtransform.cudnn_rnn_backward.default


def _unshared(ts: List[torch.Tensor], inputs: Sequence[Optional[torch.Tensor]],
              others: Sequence[Optional[torch.Tensor]] = ()) -> Any:
    """``ts``, copying each tensor whose memory an input, an output or an earlier one holds."""
    seen = {t.untyped_storage().data_ptr() for t in list(inputs) + list(others) if t is not None and t.numel()}
    out = []
    for t in ts:
        key = t.untyped_storage().data_ptr()
        if t.numel() and key in seen:
            t = t.clone()
            key = t.untyped_storage().data_ptr()
        seen.add(key)
        out.append(t)
    return out


def _packed_numel(weight: Sequence[torch.Tensor], weight_stride0: int, mode: int, hidden_size: int,
                  num_layers: int, bidirectional: bool) -> int:
    """Elements of cuDNN's packed weight buffer.

    The weights, and room for two bias vectors per layer and direction even without biases
    (measured on an H100: GRU(5, 7, bias=False, num_layers=2) packs 630 = 546 + 84, a
    bidirectional LSTM without biases 532 = 420 + 112).
    """
    n = sum(w.numel() for w in weight)
    if weight_stride0 in (2, 3):  # no biases (3: with a projection)
        gates = {2: 4, 3: 3}.get(mode, 1)
        n += num_layers * (2 if bidirectional else 1) * 2 * gates * hidden_size
    return n


def _defined(cy: Optional[torch.Tensor], hy: torch.Tensor) -> torch.Tensor:
    # GRU and RNN have no cell state: an empty tensor stands in for it
    return cy if cy is not None else hy.new_empty((0,))

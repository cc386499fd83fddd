"""Gradients of :func:`grouped_mm`, :func:`grouped_mm_swiglu` and :func:`moe_ffn`.

A call whose tensors require grad (with grad mode on) runs here: eagerly through a
``torch.autograd.Function``, under ``torch.compile`` through functional custom ops (``moegemm::*_train``, each
returning its outputs) whose autograd is registered with ``torch.library.register_autograd`` and whose
backward is a custom op too, so a compiled training step traces with no graph break and runs the same
kernels. Both paths share the forward and backward implementations below. A call that needs no gradient
takes the inference path unchanged.

The backward GEMMs:

- dX = dY W_e^T, the forward's grouped GEMM through the other weight layout: an [E, N, K] weight is the
  [E, K', N'] = [E, N, K] operand of dY @ W^T (and the other way round), so no weight is copied, and the
  forward's tuned configs and TMA path serve it.
- dW_e = X_e^T dY_e (:func:`grouped_dw`), a grouped GEMM whose reduction length is each expert's own row
  count: one program per (expert, output tile), rows walked in order, fp32 accumulation. Bitwise
  deterministic (no atomics, no split), exact zeros for an expert with no rows, written in the weight's
  own layout.
- The SwiGLU backward. For moe_ffn (:func:`swiglu_grad`), over the permuted rows of the layer's output
  gradient: with 16-bit operands, the down projection's dX GEMM P = dY D_e^T through the forward's grouped
  GEMM, then one pointwise kernel that loads P and the gate and up pre-activations G, U and stores dG, dU
  over them, s A over P (the down projection's input as its weight gradient reads it) and the gating
  weights' gradient rowdot(P, A) as per-tile partials summed in a fixed order; in fp32, the same backward
  in the epilogue of a pointer kernel's dX GEMM. The two-launch form is the faster: the same backward in
  the 16-bit dX GEMM's epilogue runs at 0.68x torch._grouped_mm's speed on the plain GEMM, the two
  launches at 0.80x (docs/training.md). For grouped_mm_swiglu (:func:`swiglu_backward`), the gate/up
  product recomputed in a K loop whose epilogue applies the same backward to the upstream gradient.

What moe_ffn keeps from the forward for the backward (beyond x, the weights and topk_weights, which the
caller holds anyway), per token, for top_k routed copies:

- ``SAVE_GATE_UP = True`` (default, save): the routing's three int32 arrays and the [rows, 2I] gate/up
  pre-activations, ``12 * top_k + 2 * I * top_k * b`` bytes (b: bytes per element of x's dtype, 2 for
  bf16/fp16, 4 for fp32; plus 4 (E + 1) bytes per layer for the group offsets). The forward writes them
  (the gate/up GEMM and SiLU * up); the backward writes their gradient over them, so that a second backward
  through the same graph raises autograd's in-place error instead of reading them.
- ``SAVE_GATE_UP = False`` (recompute): the routing's arrays alone, ``12 * top_k`` bytes; the forward runs
  the fused SwiGLU kernel and the backward recomputes the gate/up product (the forward's grouped GEMM,
  2 * top_k * H * 2I flops per token) into a buffer of its own.

The default is the faster of the two on every cell the backward's probe measured
(probes/probe_backward.py); with the gradient written over the kept product, the two reach the same peak
memory within one layer's step. Recompute keeps 2 * I * top_k * b bytes per token and layer fewer between
forward and backward, for a model whose activations do not fit.

The backward's transient buffers (freed by the step's end): the rows of x and of dY in sorted order
[rows, H] each, P and then s A over it [rows, I], dX's rows [rows, H], fp32 partials
[rows, ceil(I / BLOCK_N)]; with recompute, the gate/up buffer [rows, 2I]. The torch._grouped_mm pipeline
keeps the permuted rows, gate/up, the activation and the down output for its backward: top_k * (2H + 3I) * b
bytes per token and more.

No host sync with the default arguments: every grid is a bound known from the shapes, each tile finds its
expert from the group offsets in-kernel, and the reductions are torch ops on the device.
"""

from __future__ import annotations

import torch

from ..epilogue import Epilogue
from .backward import ffn_backward, ffn_forward, mm_backward, mm_forward
from .call import FFNTrain, GroupedCall, register_op, split_op_args
from .routing import route

# moe_ffn's choice of what the backward reads: True keeps the gate/up product from the forward (the
# backward writes its gradient over it); False recomputes it in the backward (nothing of size [rows, 2I]
# kept between forward and backward).
SAVE_GATE_UP = True


def _no_double_backward(name: str) -> None:
    """A backward asked to build a graph of its own (create_graph=True: grad mode is on inside it) raises:
    these backwards are not differentiable, and a gradient of theirs (a gradient penalty, say) would
    otherwise lose its weight terms without a word."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: a gradient of its gradient (create_graph=True) is not supported; its backward is "
            "differentiable once"
        )


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group_offsets, row_scale, call):
        ctx.save_for_backward(x, w, group_offsets, row_scale)
        ctx.call = call
        return mm_forward(call, x, w, group_offsets, row_scale)

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward("grouped_mm")
        x, w, offsets, row_scale = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw, ds = mm_backward(ctx.call, dy, x, w, offsets, row_scale, (n[0], n[1], n[3]))
        return dx, dw, None, ds, None


# The functional ops' tensors (forward, backward); the call spec's fields follow them in their schemas.
_MM_TENSORS = "Tensor x, Tensor w, Tensor group_offsets, Tensor? row_scale"
_MM_BACKWARD = "Tensor dy, " + _MM_TENSORS


def _mm_fake(call, tensors):
    x, w = tensors[:2]
    n = w.shape[2] if call.w_layout == "kn" else w.shape[1]
    return x.new_empty((x.shape[0], n // 2 if call.swiglu else n))


grouped_mm_train_op = register_op(
    "moegemm::grouped_mm_train", GroupedCall, _MM_TENSORS, lambda call, *t: mm_forward(call, *t), (), "Tensor"
)
grouped_mm_train_op.register_fake(lambda *args: _mm_fake(*split_op_args(GroupedCall, _MM_TENSORS, args)[:2]))


grouped_mm_train_backward_op = register_op(
    "moegemm::grouped_mm_train_backward",
    GroupedCall,
    _MM_BACKWARD,
    lambda call, *args: _present(mm_backward(call, *args), args[1]),
    (),
    "(Tensor, Tensor, Tensor)",
    "bool[] needs",
)


def _present(grads, like: torch.Tensor) -> tuple:
    """A backward op's gradients, an empty tensor for each not computed (an op returns tensors only)."""
    return tuple(g if g is not None else like.new_empty(0) for g in grads)


def _mm_backward_fake(*args):
    _, (_, x, w, _, row_scale), (needs,) = split_op_args(GroupedCall, _MM_BACKWARD, args)
    return (
        x.new_empty(x.shape) if needs[0] else x.new_empty(0),
        w.new_empty(w.shape) if needs[1] else x.new_empty(0),
        row_scale.new_empty(row_scale.shape) if needs[2] and row_scale is not None else x.new_empty(0),
    )


grouped_mm_train_backward_op.register_fake(_mm_backward_fake)


def _mm_setup(ctx, inputs, output):
    ctx.call, tensors, _ = split_op_args(GroupedCall, _MM_TENSORS, inputs)
    ctx.save_for_backward(*tensors)
    ctx.n_inputs = len(inputs)


def _mm_grad(ctx, dy):
    x, w, offsets, row_scale = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [bool(n[0]), bool(n[1]), bool(n[3]) and row_scale is not None]
    dx, dw, ds = grouped_mm_train_backward_op(dy, x, w, offsets, row_scale, *ctx.call.op_args(), needs)
    grads = (dx if needs[0] else None, dw if needs[1] else None, None, ds if needs[2] else None)
    return grads + (None,) * (ctx.n_inputs - len(grads))


torch.library.register_autograd("moegemm::grouped_mm_train", _mm_grad, setup_context=_mm_setup)


def grouped_mm_train(call: GroupedCall, x_sorted, w, group_offsets, out, row_scale) -> torch.Tensor:
    """grouped_mm (``call.swiglu``: grouped_mm_swiglu) recording gradients for x_sorted, w and row_scale."""
    if Epilogue.parse(call.epilogue) != Epilogue.NONE:
        raise ValueError(f"epilogue: gradients are computed for epilogue='none' only, got {call.epilogue!r}")
    if out is not None:
        raise ValueError("out: not supported when gradients are recorded (the output is a new tensor)")
    if call.w_layout not in ("kn", "nk"):
        raise ValueError(f"w_layout: expected 'kn' ([E, K, N]) or 'nk' ([E, N, K]), got {call.w_layout!r}")
    for name, t in (("x_sorted", x_sorted), ("w", w), ("group_offsets", group_offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if row_scale is not None and not isinstance(row_scale, torch.Tensor):
        raise TypeError(f"row_scale: expected a torch.Tensor or None, got {type(row_scale).__name__}")
    if getattr(group_offsets, "requires_grad", False):
        raise TypeError("group_offsets: an int tensor, cannot require grad")
    if torch.compiler.is_compiling():
        return grouped_mm_train_op(x_sorted, w, group_offsets, row_scale, *call.op_args())
    return _GroupedMM.apply(x_sorted, w, group_offsets, row_scale, call)


# The training op's tensors: the layer's (x, topk_weights, w_gate_up, w_down) then its routing's (from
# moegemm.grouped.route: sorted_token_ids, sorted_slot, slot_rows, group_offsets).
_FFN_TENSORS = (
    "Tensor x, Tensor topk_weights, Tensor w_gate_up, Tensor w_down, Tensor tok, Tensor sorted_slot, "
    "Tensor slot_rows, Tensor offsets"
)
_FFN_BACKWARD = "Tensor dy, " + _FFN_TENSORS + ", Tensor(a!)? gu"


class _MoEFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, *tensors):
        y, gu = ffn_forward(call, *tensors)
        ctx.save_for_backward(*tensors, gu)
        ctx.call = call
        return y

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward("moe_ffn")
        saved = ctx.saved_tensors
        grads = ffn_backward(ctx.call, dy, *saved, ctx.needs_input_grad[1:5])
        if saved[-1] is not None:  # the kept gate/up product now holds its gradient: a second backward
            torch.autograd.graph.increment_version(saved[-1])  # through this graph raises, not misreads
        return (None, *grads) + (None,) * (len(saved) - 1 - len(grads))


def _ffn_forward_op(call, *tensors):
    y, gu = ffn_forward(call, *tensors)
    return y, (gu if gu is not None else tensors[0].new_empty(0))


def _ffn_fake(*args):
    call, (x, _, w_gate_up, *_), _ = split_op_args(FFNTrain, _FFN_TENSORS, args)
    two_i = w_gate_up.shape[1] if call.w_layout == "nk" else w_gate_up.shape[2]
    rows = args[4].shape[0]  # tok: one per permuted row
    return x.new_empty(x.shape), (x.new_empty((rows, two_i)) if call.save else x.new_empty(0))


moe_ffn_train_op = register_op(
    "moegemm::moe_ffn_train", FFNTrain, _FFN_TENSORS, _ffn_forward_op, (), "(Tensor, Tensor)"
)
moe_ffn_train_op.register_fake(_ffn_fake)

moe_ffn_train_backward_op = register_op(
    "moegemm::moe_ffn_train_backward",
    FFNTrain,
    _FFN_BACKWARD,
    lambda call, *args: _present(ffn_backward(call, *args), args[1]),
    ("gu",),
    "(Tensor, Tensor, Tensor, Tensor)",
    "bool[] needs",
)


def _ffn_backward_fake(*args):
    _, (dy, x, topk_weights, w_gate_up, w_down, *_), (needs,) = split_op_args(FFNTrain, _FFN_BACKWARD, args)
    like = (x, topk_weights, w_gate_up, w_down)
    return tuple(t.new_empty(t.shape) if need else x.new_empty(0) for t, need in zip(like, needs))


moe_ffn_train_backward_op.register_fake(_ffn_backward_fake)


def _ffn_setup(ctx, inputs, output):
    ctx.call, tensors, _ = split_op_args(FFNTrain, _FFN_TENSORS, inputs)
    ctx.save_for_backward(*tensors, output[1] if ctx.call.save else None)
    ctx.n_inputs = len(inputs)
    ctx.set_materialize_grads(False)


def _ffn_grad(ctx, dy, _dgu):
    saved = ctx.saved_tensors
    if dy is None:  # the output took no part in the loss
        return (None,) * ctx.n_inputs
    needs = [bool(v) for v in ctx.needs_input_grad[:4]]
    grads = moe_ffn_train_backward_op(dy, *saved, *ctx.call.op_args(), needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * (ctx.n_inputs - 4)


torch.library.register_autograd("moegemm::moe_ffn_train", _ffn_grad, setup_context=_ffn_setup)


def moe_ffn_train(call, x, topk_ids, topk_weights, w_gate_up, w_down) -> torch.Tensor:
    """moe_ffn recording gradients for x, topk_weights, w_gate_up and w_down (arguments checked by moe_ffn).
    ``call.save_gate_up``: keep the gate/up pre-activations for the backward (None: :data:`SAVE_GATE_UP`)."""
    save = SAVE_GATE_UP if call.save_gate_up is None else call.save_gate_up
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise TypeError(
            f"w_gate_up, w_down: dtypes {w_gate_up.dtype}, {w_down.dtype} differ from x's {x.dtype}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights: expected a float tensor, got {topk_weights.dtype}")
    plan = route(topk_ids, w_gate_up.shape[0], validate=call.validate)
    train = FFNTrain(call.w_layout, plan.top_k, save)
    routing = (plan.sorted_token_ids, plan.sorted_slot, plan.slot_rows, plan.group_offsets)
    if torch.compiler.is_compiling():
        return moe_ffn_train_op(x, topk_weights, w_gate_up, w_down, *routing, *train.op_args())[0]
    return _MoEFFN.apply(train, x, topk_weights, w_gate_up, w_down, *routing)

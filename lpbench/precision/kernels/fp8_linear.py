"""Native FP8 tensorwise / delayed linear for SM89+: compiler-fused casts and three ``torch._scaled_mm``.

Same arithmetic as the reference quantized linear (``lpbench.precision.linear``) for the
``tensor`` and ``delayed`` scalings — identical codes and scales, GEMMs equal up to
summation order (and, where the recipe asks it, the forward GEMM's fast accumulation):

    fprop  Y  = Xq · Wqᵀ        (X row-major, W row-major)
    dgrad  dX = dYq · (Wᵀq)ᵀ    (dY row-major, the transposed W copy)
    wgrad  dW = dYᵀq · (Xᵀq)ᵀ   (both transposed copies)

Tensorwise: the amax is a plain torch reduction, so torch.compile (on by default on CUDA)
fuses it into the operand's producer (RMSNorm, SwiGLU, the previous GEMM's epilogue); CUDA
operands (16-bit activations and gradients, FP32 master weights) are then cast by the tiled
Triton kernel of ``kernels/fp8_cast.py``, which writes the row-major and the transposed copy in
one read (inductor's own transposed write made the casts of an llama3-8b@16L step take 2.4x the
time of the delayed path's). The scales are the reference's own functions (``quantize.fp8_encode_scale`` /
``delayed_encode_scale`` / ``fp8_decode_scale``), whose division is exact eager or compiled,
so codes and scales are bit-exact with the reference. Delayed scaling needs no amax before
the cast (the scale comes from the history); for CUDA operands one Triton kernel
(``kernels/fp8_cast.py``) casts, writes the transposed copy and reduces the amax recorded for
the next step in a single read, which inductor cannot do.
"""

from __future__ import annotations

import torch

from lpbench.precision import capability, fp8_allgather
from lpbench.precision.formats import FloatFormat
from lpbench.precision.kernels import fp8_cast
from lpbench.precision.quantize import Scaling, fp8_decode_scale, fp8_encode_scale


def cast(t: torch.Tensor, amax: torch.Tensor, enc: torch.Tensor, fmt: FloatFormat, write_t: bool):
    """(codes, transposed codes or empty, FP32 decode scale): saturating round-to-nearest-even cast of t × enc.

    The decode scale is NaN when ``amax`` (of t) is not finite, as in the reference.
    """
    q = (t.float() * enc).clamp(-fmt.max, fmt.max).to(fmt.dtype).contiguous()
    return q, (q.t().contiguous() if write_t else q.new_empty((0,))), fp8_decode_scale(enc, amax)


def _quantize(mod, role: str, t: torch.Tensor, write_t: bool):
    """(codes, transposed codes, decode scale) of ``t`` for ``role`` under mod's recipe.

    ``mod.reduce_amax`` makes the amax the whole tensor's under tensor parallelism. Delayed
    scaling takes its scale from the amax history (the current amax only while the history
    is empty) and records the current amax.
    """
    recipe = mod.recipe
    fmt = recipe.element_format(role)
    if role == "weight" and (pre := fp8_allgather.gathered(mod, t)) is not None:  # FSDP all-gathered it in FP8
        return pre[0], pre[0].t().contiguous() if write_t else pre[0].new_empty((0,)), pre[1]
    if recipe.scaling is not Scaling.DELAYED:
        amax = mod.reduce_amax(role, t.detach().abs().amax().float())
        enc = fp8_encode_scale(amax, fmt)
        if capability.fp8_cast_kernel(t):  # one tiled pass writes both copies (inductor's transposed write is slow)
            q, qt, _ = fp8_cast.cast_transpose(t.detach(), enc, fmt, write_t)
            return q, qt, fp8_decode_scale(enc, amax)
        return cast(t, amax, enc, fmt, write_t)
    if capability.fp8_cast_kernel(t):  # one read of t; the current amax only while the history is empty
        first = mod.reduce_amax(role, fp8_cast.amax_unless(t.detach(), mod.amax_history(role).max() > 0))
        enc = mod.history_scale(role, first)
        q, qt, amax = fp8_cast.cast_transpose(t.detach(), enc, fmt, write_t)
        amax = mod.reduce_amax(role, amax)
        out = q, qt, fp8_decode_scale(enc, amax)
    else:
        amax = mod.reduce_amax(role, t.detach().abs().amax().float())
        out = cast(t, amax, mod.history_scale(role, amax), fmt, write_t)
    mod.record_amax(role, amax)
    return out


class Fp8TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod):
        x2 = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq, xt, x_dec = _quantize(mod, "input", x2, need_dw)
        wq, wt, w_dec = _quantize(mod, "weight", weight, need_dx)
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_dec, scale_b=w_dec, out_dtype=x.dtype,
                             use_fast_accum=mod.recipe.fast_accum_fprop)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xt, wt, x_dec, w_dec)
        ctx.mod, ctx.x_shape = mod, x.shape
        ctx.w_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        xt, wt, x_dec, w_dec = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gt, g_dec = _quantize(ctx.mod, "grad", dy2, need_dw)
        dx = dw = db = None
        if need_dx:
            dx = torch._scaled_mm(gq, wt.t(), scale_a=g_dec, scale_b=w_dec, out_dtype=dy.dtype).reshape(ctx.x_shape)
        if need_dw:
            dw = torch._scaled_mm(gt, xt.t(), scale_a=g_dec, scale_b=x_dec, out_dtype=ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None

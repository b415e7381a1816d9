"""Native FP8 tensorwise / delayed linear for SM89+: fused casts and three ``torch._scaled_mm``.

Same arithmetic as the reference quantized linear (``lpbench.precision.linear``) for the
``tensor`` and ``delayed`` scalings — identical codes and scales, GEMMs equal up to
summation order — with each operand read once for its amax (none for delayed scaling) and
once more to write both its row-major and transposed FP8 copies:

    fprop  Y  = Xq · Wqᵀ        (X row-major, W row-major)
    dgrad  dX = dYq · (Wᵀq)ᵀ    (dY row-major, the transposed W copy)
    wgrad  dW = dYᵀq · (Xᵀq)ᵀ   (both transposed copies)
"""

from __future__ import annotations

import torch

from lpbench.precision.formats import FORMATS
from lpbench.precision.kernels.fp8 import absmax, cast_transpose, update_amax_history


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes ``torch._scaled_mm`` takes: every GEMM dim a multiple of 16."""
    tokens = x.numel() // x.shape[-1]
    return x.is_cuda and tokens % 16 == 0 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def _quantize(mod, role: str, t: torch.Tensor, write_t: bool, primed: bool):
    """(codes, transposed codes, decode scale) of ``t`` for ``role`` under mod's recipe.

    Delayed scaling reads no amax of ``t`` once ``primed`` (its history holds a record); the
    first call measures it, as the reference's "current amax stands in for an empty history".
    """
    recipe = mod.recipe
    dtype = FORMATS[recipe.grad_format if role == "grad" else recipe.fwd_format].dtype
    if recipe.scaling != "delayed":
        q, qt, dec, _ = cast_transpose(t, absmax(t), None, dtype, write_t)
        return q, qt, dec
    history = getattr(mod, f"amax_history_{role}")
    first = torch.zeros((), device=t.device) if primed else absmax(t)
    q, qt, dec, amax = cast_transpose(t, first, history, dtype, write_t)
    update_amax_history(history, amax)
    return q, qt, dec


class Fp8TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod, primed: bool):
        x2 = x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq, xt, x_dec = _quantize(mod, "input", x2, need_dw, primed)
        wq, wt, w_dec = _quantize(mod, "weight", weight, need_dx, primed)
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_dec, scale_b=w_dec, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(xt, wt, x_dec, w_dec)
        ctx.mod, ctx.primed, ctx.x_shape = mod, primed, x.shape
        ctx.w_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        xt, wt, x_dec, w_dec = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gt, g_dec = _quantize(ctx.mod, "grad", dy2.contiguous(), need_dw, ctx.primed)
        dx = dw = db = None
        if need_dx:
            dx = torch._scaled_mm(gq, wt.t(), scale_a=g_dec, scale_b=w_dec, out_dtype=dy.dtype).reshape(ctx.x_shape)
        if need_dw:
            dw = torch._scaled_mm(gt, xt.t(), scale_a=g_dec, scale_b=x_dec, out_dtype=torch.float32).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.w_dtype)
        return dx, dw, db, None, None

"""The quantized Linear: three GEMMs, each quantizing its operands along its own reduction dim.

    fprop  Y  = X · Wᵀ    reduction over in_features   (X rows, W rows)
    dgrad  dX = dY · W    reduction over out_features  (dY rows, W columns)
    wgrad  dW = dYᵀ · X   reduction over tokens        (dY columns, X columns)

Every GEMM is written as ``A · Bᵀ`` with both operands quantized along their last dim; the
column-wise copies (Wᵀ, Xᵀ, dYᵀ) are quantized from the high-precision tensor, never from
the row-wise copy. Hand-written (not torchao / TE) so the same code emulates every recipe
exactly on any device:

* emulated path: operands are dequantized to values that BF16 holds exactly (E4M3/E5M2
  codes, codes × power-of-two or E4M3 block scales), multiplied with FP32 accumulation, and
  scales that are constant along the reduction dim (tensor, row, NVFP4 global) are applied
  to the FP32 output, as the hardware does. Equal to a native GEMM up to summation order.
* native path (CUDA, see ``NATIVE_SCALINGS``): ``torch._scaled_mm`` for FP8 tensorwise /
  delayed (SM89+; fused Triton casts, ``kernels/fp8_linear.py``) and rowwise (SM90+).

Autocast: inputs are cast to the autocast dtype, then all quantization and GEMMs run with
autocast disabled; the output has the input's compute dtype, dW the weight's dtype. Delayed
scaling keeps its amax histories as buffers (``amax_history_{input,weight,grad}``), so they
are checkpointed. The token dim is zero-padded for the wgrad GEMM when its block needs it
(MoE experts see any number of tokens); zeros change neither amax nor the product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lpbench.precision.formats import FORMATS
from lpbench.precision.quantize import (
    RHT_SIZE,
    QSpec,
    QTensor,
    apply_rht,
    delayed_encode_scale,
    quantize,
    scale_to_float,
    update_amax_history,
)
from lpbench.precision.recipes import Recipe

NATIVE_SCALINGS = ("tensor", "delayed", "row")  # scalings with a native GEMM in lpbench


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · bᵀ for operands exactly representable in BF16, accumulated in FP32."""
    if a.is_cuda:
        return torch.mm(a.bfloat16(), b.bfloat16().t(), out_dtype=torch.float32)
    return a.float() @ b.float().t()  # products of BF16 values are exact in FP32


def _operand(q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16-exact GEMM operand and the factor its GEMM output rows get ([rows, 1] or scalar)."""
    g = q.global_scale if q.global_scale is not None else torch.ones((), device=q.codes.device)
    if q.block[1] == q.codes.shape[1]:  # one scale across the reduction dim: apply to the output
        return q.values(), scale_to_float(q.scale).repeat_interleave(q.block[0], 0) * g
    return q.values() * q.block_scales(), g


def _scaled_mm(a: QTensor, b: QTensor) -> torch.Tensor:
    """Native FP8 a · bᵀ: tensorwise (scalar scales) or rowwise ([M, 1] and [1, N] scales)."""
    sa, sb = a.scale.float(), b.scale.float()
    if sa.numel() == 1 and sb.numel() == 1:
        sa, sb = sa.reshape(()), sb.reshape(())
    else:
        sb = sb.t().contiguous()
    return torch._scaled_mm(a.codes, b.codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def qgemm(a: QTensor, b: QTensor, *, native: bool = False) -> torch.Tensor:
    """FP32 a · bᵀ of two operands quantized along their last (reduction) dim."""
    if native:
        return _scaled_mm(a, b).float()
    (va, sa), (vb, sb) = _operand(a), _operand(b)
    return _mm_fp32(va, vb) * sa * (sb.t() if sb.dim() else sb)


def _hp_gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unquantized a · bᵀ in the compute dtype with FP32 accumulation (FP32 result)."""
    if a.is_cuda and dtype != torch.float32:
        return torch.mm(a.to(dtype), b.to(dtype).t(), out_dtype=torch.float32)
    return a.to(dtype).float() @ b.to(dtype).float().t()


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod):
        recipe = mod.recipe
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            enc_x = mod._delayed_scale("input", x2)
            enc_w = mod._delayed_scale("weight", weight)
            xq = quantize(x2, recipe.operand("input", "fprop"), encode_scale=enc_x)
            wq = quantize(weight, recipe.operand("weight", "fprop"), encode_scale=enc_w)
            y = qgemm(xq, wq, native=mod.native)
            if bias is not None:
                y = y + bias.float()
            ctx.mod, ctx.x_shape, ctx.x_dtype, ctx.has_bias = mod, x.shape, x.dtype, bias is not None
            ctx.w_dtype = weight.dtype
            ctx.wq_dgrad = ctx.xq_wgrad = None
            if ctx.needs_input_grad[0]:
                ctx.wq_dgrad = quantize(weight.t(), recipe.operand("weight", "dgrad"), encode_scale=enc_w)
            spec_x = recipe.operand("input", "wgrad")
            if ctx.needs_input_grad[1] and spec_x is not None:
                ctx.xq_wgrad = quantize(mod._wgrad_layout(x2, spec_x), spec_x, encode_scale=enc_x)
            elif ctx.needs_input_grad[1]:
                ctx.save_for_backward(x2)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        mod, recipe = ctx.mod, ctx.mod.recipe
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            enc_g = mod._delayed_scale("grad", dy2)
            if ctx.wq_dgrad is not None:
                gq = quantize(dy2, recipe.operand("grad", "dgrad"), encode_scale=enc_g)
                dx = qgemm(gq, ctx.wq_dgrad, native=mod.native).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                spec_g = recipe.operand("grad", "wgrad")
                if spec_g is None:
                    (x2,) = ctx.saved_tensors
                    dw = _hp_gemm(dy2.t(), x2.t(), ctx.x_dtype)
                else:
                    gq = quantize(mod._wgrad_layout(dy2, spec_g), spec_g, encode_scale=enc_g)
                    dw = qgemm(gq, ctx.xq_wgrad, native=mod.native)
                dw = dw.to(ctx.w_dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(ctx.w_dtype)
        ctx.wq_dgrad = ctx.xq_wgrad = None
        return dx, dw, db, None


class QuantizedLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs follow a precision recipe (same parameters and names)."""

    def __init__(self, in_features, out_features, bias=True, *, recipe: Recipe, native=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if not recipe.quantized:
            raise ValueError(f"recipe {recipe.name} has no quantized GEMMs")
        self.recipe, self.native = recipe, native
        self._fp8_primed = False  # fast delayed path: a history record exists (no amax pass needed)
        self._init_histories(self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, native: bool = False) -> QuantizedLinear:
        """A QuantizedLinear sharing ``linear``'s parameter objects."""
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe, native=native, device="meta")
        q.weight, q.bias = linear.weight, linear.bias
        q._init_histories(linear.weight.device)
        return q

    def _init_histories(self, device):
        if self.recipe.scaling == "delayed":
            for role in ("input", "weight", "grad"):
                self.register_buffer(f"amax_history_{role}", torch.zeros(self.recipe.amax_history_len, device=device))

    def _delayed_scale(self, role: str, t: torch.Tensor) -> torch.Tensor | None:
        """Delayed scaling: the encode scale from ``role``'s history, then record t's amax."""
        if self.recipe.scaling != "delayed":
            return None
        history = getattr(self, f"amax_history_{role}")
        amax = t.detach().abs().amax().float()
        fmt = FORMATS[self.recipe.grad_format if role == "grad" else self.recipe.fwd_format]
        scale = delayed_encode_scale(history, amax, fmt, self.recipe.margin)
        update_amax_history(history, amax)
        return scale

    def _wgrad_layout(self, t: torch.Tensor, spec: QSpec) -> torch.Tensor:
        """[tokens, C] → [C, tokens'] for the wgrad GEMM: zero-pad, transpose, optional RHT."""
        multiple = math.lcm(spec.block[1] or 1, RHT_SIZE if self.recipe.rht_wgrad else 1, 16 if self.native else 1)
        t = F.pad(t, (0, 0, 0, -t.shape[0] % multiple)).t()
        return apply_rht(t) if self.recipe.rht_wgrad else t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if x.numel() == 0:  # e.g. an MoE expert that got no tokens
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if self.native and self.recipe.scaling in ("tensor", "delayed"):
            from lpbench.precision.kernels import fp8_linear

            if fp8_linear.supported(x, self.weight):
                primed, self._fp8_primed = self._fp8_primed, True
                return fp8_linear.Fp8TensorwiseLinearFn.apply(x, self.weight, self.bias, self, primed)
        return _QuantizedLinearFn.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, path={'native' if self.native else 'emulated'}"

"""SwiGLU of a fused gate+up projection, ``silu(gate) * up``, with a hand-written backward on CUDA.

The model computes ``silu(gate) * up`` with torch ops (``lpbench.models.moe.silu_mul``); ``lpbench.convert.SwiGLU``
gives its MLPs :func:`swiglu_of` and its experts :func:`swiglu`, the same numbers with this backward.

The forward is plain torch ops, so torch.compile fuses into it what the next linear needs (down's FP8
amax or codes). The backward is a Triton kernel because inductor's is slow: it lowers the gradient of
``chunk`` as a concatenation whose one kernel computes, for every element of the [tokens, 2 x ffn]
gradient, the arithmetic of both halves (masked loads of gate, up and the output gradient, then a
select), twice the work of the pair; this kernel loads gate, up and the output gradient once per pair and
stores both halves (measurements: ``benchmarks/swiglu.py``, benchmarks/RESULTS.md).

The kernel computes what eager PyTorch computes, in the same order: ATen's ``silu`` (x / (1 + exp(-x)))
rounded to the input dtype as autograd saves it, the product rule's two gradients rounded likewise, and
ATen's ``silu_backward`` (dy · s · (1 + x · (1 - s)), s = 1 / (1 + exp(-x))) in FP32 with CUDA's
``expf``, IEEE division and the FMA nvcc contracts, so its gradient is eager autograd's bit for bit
(``gpu`` test). Elsewhere (CPU, a DTensor, no Triton) the backward is eager autograd's own ops.

:class:`Epilogue` is SwiGLU as the epilogue of the gate+up linear (:func:`swiglu_of`): the fused FP8 linear
(``precision/kernels/fp8_linear.py``) runs it inside its own autograd Function, so the gradient of gate_up,
which only that linear reads, is quantized in this kernel, as Transformer Engine's fused SwiGLU backward +
cast does: with delayed scaling (a known scale) the kernel stores the FP8 codes, row-major and transposed,
and their amax instead of the 16-bit gradient; with tensorwise scaling it stores the gradient and its amax,
so the cast that follows reads it once. Otherwise the gradient's amax or cast is a pass of its own, since
the kernel is opaque to inductor.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

LAUNCH = (32, 128, 4)  # tokens, columns of each half, warps per program; with FP8 codes too (benchmarks/swiglu.py)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [..., 2 x ffn] (gate first)."""
    return _SwiGLU.apply(gate_up)


def swiglu_of(linear, x: torch.Tensor) -> torch.Tensor:
    """``swiglu(linear(x))``; a linear that takes an epilogue (``takes_epilogue``: the quantized linear) is
    given :class:`Epilogue` to run inside its own autograd Function."""
    if getattr(linear, "takes_epilogue", False):
        return linear(x, epilogue=Epilogue)
    return swiglu(linear(x))


def reference_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gate_up`` by eager autograd's ops (the product rule, ``silu_backward``, the concatenation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def _kernel(gate_up: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        triton is not None
        and gate_up.is_cuda
        and gate_up.numel() > 0
        and not isinstance(gate_up, DTensor)
        and not isinstance(grad, DTensor)
        and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and grad.dtype == gate_up.dtype
    )


def _forward(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if not _kernel(gate_up, grad):
        return reference_backward(gate_up, grad)
    width = gate_up.shape[-1]
    return backward_kernel(
        gate_up.contiguous().view(-1, width),
        grad.contiguous().view(-1, width // 2),
    ).view(gate_up.shape)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _forward(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return _backward(gate_up, grad)


class Epilogue:
    """SwiGLU as a linear's epilogue: what the quantized linear's autograd Function calls on its output ``y``
    [tokens, 2 x ffn] and the gradient of the epilogue's output ``grad`` [tokens, ffn] (both 2-D)."""

    apply = staticmethod(swiglu)  # with autograd: for a linear that runs it after its own Function
    forward = staticmethod(_forward)
    backward = staticmethod(_backward)  # the gradient of y

    @staticmethod
    def fuses_cast(y: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether :meth:`backward_amax` and :meth:`backward_cast` take these tensors (the Triton kernel's)."""
        return _kernel(y, grad)

    @staticmethod
    def backward_amax(y: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient of y, its amax in FP32) from one kernel (and a reduction of its programs' maxima)."""
        g, partial = _backward_amax(y.contiguous(), grad.contiguous())
        return g, partial.amax()

    @staticmethod
    def backward_cast(y: torch.Tensor, grad: torch.Tensor, encode_scale: torch.Tensor, fmt, write_t: bool):
        """(codes, transposed codes or empty, partial amaxes: FP32, one per program, whose max is the gradient's
        amax) of the gradient of y × ``encode_scale``, cast as ``fp8_linear`` casts (saturating,
        round-to-nearest-even to ``fmt``, a FloatFormat), from one kernel that never stores the 16-bit gradient."""
        return _backward_cast(
            y.contiguous(), grad.contiguous(), encode_scale.float().reshape(()), fmt.max, fmt.dtype, write_t
        )


@kernel_op("lpbench::swiglu_backward", ())
def backward_kernel(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of contiguous ``gate_up`` [tokens, 2 x ffn] from ``grad`` [tokens, ffn] (the Triton kernel)."""
    out = torch.empty_like(gate_up)
    launch_backward(wrap_triton, gate_up, grad, out)
    return out


@kernel_op("lpbench::swiglu_backward_amax", ())
def _backward_amax(gate_up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(gate_up)
    return out, launch_backward(wrap_triton, gate_up, grad, out, amax=True).view(torch.float32)


@kernel_op("lpbench::swiglu_backward_cast", ())
def _backward_cast(
    gate_up: torch.Tensor,
    grad: torch.Tensor,
    encode_scale: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
    write_t: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, width = gate_up.shape
    q = torch.empty((tokens, width), dtype=dtype, device=gate_up.device)
    qt = torch.empty((width, tokens) if write_t else (0,), dtype=dtype, device=gate_up.device)
    partial = launch_backward(wrap_triton, gate_up, grad, q, amax=True, cast=(encode_scale, fp8_max, qt))
    return q, qt, partial.view(torch.float32)


def launch_backward(
    launcher, gate_up: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, launch=None, amax: bool = False, cast=None
) -> torch.Tensor | None:
    """Write the gradient of ``gate_up`` into ``out`` (``launch``: tokens, columns, warps; default :data:`LAUNCH`).
    ``cast``: (encode scale, FP8 max, transposed codes [2 x ffn, tokens] or empty): ``out`` then gets the
    saturated codes of the gradient × scale, in its dtype, and the transposed buffer the same codes transposed.
    With ``amax``: returns each program's max of the gradient's |values| as int32 bits [programs] (ordered as
    the floats, NaN above +inf), for the caller to reduce (one atomic max per program on one address would
    serialise the programs)."""
    tokens, ffn = grad.shape
    bt, bn, warps = launch or LAUNCH
    grid = (triton.cdiv(tokens, bt), triton.cdiv(ffn, bn))
    bits = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=out.device) if amax else out
    enc, fp8_max, qt = cast or (out, 0.0, out)  # (``out`` stands in for pointers the kernel does not touch)
    launcher(_backward_kernel)[grid](
        gate_up,
        grad,
        out,
        qt,
        enc,
        bits,
        tokens,
        ffn,
        FMAX=fp8_max,
        CAST=cast is not None,
        WRITE_T=cast is not None and qt.numel() > 0,
        AMAX=amax,
        BT=bt,
        BN=bn,
        num_warps=warps,
    )
    return bits if amax else None


if triton is not None:
    from triton.language.extra import libdevice

    from lpbench.precision.kernels.fp8_cast import _bits_of_abs, _saturate  # not renamed: inductor re-emits them

    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no libdevice: numpy's exp

        @triton.jit
        def _exp(x):
            return tl.exp(x)
    else:

        @triton.jit
        def _exp(x):
            """CUDA's ``expf``, which ATen's kernels call."""
            return libdevice.exp(x)

    @triton.jit
    def _backward_kernel(
        x_ptr,
        dy_ptr,
        dx_ptr,
        qt_ptr,
        enc_ptr,
        amax_ptr,
        T,
        N,
        FMAX: tl.constexpr,
        CAST: tl.constexpr,
        WRITE_T: tl.constexpr,
        AMAX: tl.constexpr,
        BT: tl.constexpr,
        BN: tl.constexpr,
    ):
        rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)[:, None]
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)[None, :]
        mask = (rt < T) & (rn < N)
        gate_at = x_ptr + rt * (2 * N) + rn
        dtype = x_ptr.dtype.element_ty
        g = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_at + N, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rt * N + rn, mask=mask, other=0.0).to(tl.float32)
        one_plus_e = 1.0 + _exp(-g)
        s = tl.div_rn(g, one_plus_e).to(dtype).to(tl.float32)  # silu(gate) as the forward stores it
        d_up = (dy * s).to(dtype)
        d_silu = (dy * u).to(dtype).to(tl.float32)
        sig = tl.div_rn(tl.full(g.shape, 1.0, tl.float32), one_plus_e)
        d_gate = (d_silu * sig * tl.fma(g, 1.0 - sig, 1.0)).to(dtype)
        if AMAX:  # this program's max (masked elements are 0: loads of 0 give 0 gradients)
            tl.store(
                amax_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                tl.max(tl.maximum(_bits_of_abs(d_gate), _bits_of_abs(d_up))),
            )
        if CAST:
            enc = tl.load(enc_ptr)
            out_gate = _saturate(d_gate.to(tl.float32) * enc, FMAX).to(dx_ptr.dtype.element_ty)
            out_up = _saturate(d_up.to(tl.float32) * enc, FMAX).to(dx_ptr.dtype.element_ty)
        else:
            out_gate, out_up = d_gate, d_up
        out_at = dx_ptr + rt * (2 * N) + rn
        tl.store(out_at, out_gate, mask=mask)
        tl.store(out_at + N, out_up, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn * T + rt, out_gate, mask=mask)
            tl.store(qt_ptr + (rn + N) * T + rt, out_up, mask=mask)

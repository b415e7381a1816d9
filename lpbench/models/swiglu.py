"""SwiGLU of a fused gate+up projection, ``silu(gate) * up``, with a hand-written backward on CUDA.

The forward is plain torch ops, so torch.compile fuses into it what the next linear needs (down's FP8
amax or codes). The backward is a Triton kernel because inductor's is slow: it lowers the gradient of
``chunk`` as a concatenation whose one kernel computes, for every element of the [tokens, 2 x ffn]
gradient, the arithmetic of both halves (masked loads of gate, up and the output gradient, then a
select), twice the work of the pair, and at llama3-8b's MLP (8192 tokens x 2 x 14336, BF16) that work,
not memory, bounds it: 510 us on an H200 through autograd compiled as ``lpbench run`` compiles, where
this kernel, which loads gate, up and the output gradient once per pair and stores both halves, takes 294
(a copy of the 470 MB gradient: 224; ``benchmarks/swiglu.py``). A llama3-8b@16L step is 0.6-1.1 % shorter
for it in BF16 and FP8 alike.

The kernel computes what eager PyTorch computes, in the same order: ATen's ``silu`` (x / (1 + exp(-x)))
rounded to the input dtype as autograd saves it, the product rule's two gradients rounded likewise, and
ATen's ``silu_backward`` (dy · s · (1 + x · (1 - s)), s = 1 / (1 + exp(-x))) in FP32 with CUDA's
``expf``, IEEE division and the FMA nvcc contracts, so its gradient is eager autograd's bit for bit
(``gpu`` test). Elsewhere (CPU, a DTensor, no Triton) the backward is eager autograd's own ops.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

LAUNCH = (32, 128, 4)  # tokens, columns of each half and warps per program (benchmarks/swiglu.py)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [..., 2 x ffn] (gate first)."""
    return _SwiGLU.apply(gate_up)


def reference_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gate_up`` by eager autograd's ops (the product rule, ``silu_backward``, the concatenation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)], dim=-1)


def _kernel(gate_up: torch.Tensor, grad: torch.Tensor) -> bool:
    return (triton is not None and gate_up.is_cuda and gate_up.numel() > 0
            and not isinstance(gate_up, DTensor) and not isinstance(grad, DTensor)
            and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32) and grad.dtype == gate_up.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        if not _kernel(gate_up, grad):
            return reference_backward(gate_up, grad)
        width = gate_up.shape[-1]
        return backward_kernel(gate_up.contiguous().view(-1, width), grad.contiguous().view(-1, width // 2),
                               ).view(gate_up.shape)


@kernel_op("lpbench::swiglu_backward", ())
def backward_kernel(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of contiguous ``gate_up`` [tokens, 2 x ffn] from ``grad`` [tokens, ffn] (the Triton kernel)."""
    out = torch.empty_like(gate_up)
    launch_backward(wrap_triton, gate_up, grad, out)
    return out


def launch_backward(launcher, gate_up: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, launch=None) -> None:
    """Write the gradient of ``gate_up`` into ``out`` (``launch``: tokens, columns, warps; default :data:`LAUNCH`)."""
    tokens, ffn = grad.shape
    bt, bn, warps = launch or LAUNCH
    launcher(_backward_kernel)[(triton.cdiv(tokens, bt), triton.cdiv(ffn, bn))](
        gate_up, grad, out, tokens, ffn, BT=bt, BN=bn, num_warps=warps)


if triton is not None:
    from triton.language.extra import libdevice

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
    def _backward_kernel(x_ptr, dy_ptr, dx_ptr, T, N, BT: tl.constexpr, BN: tl.constexpr):
        rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)[:, None]
        rn = (tl.program_id(1) * BN + tl.arange(0, BN))[None, :]
        mask = (rt < T) & (rn < N)
        gate_at = x_ptr + rt * (2 * N) + rn
        dtype = x_ptr.dtype.element_ty
        g = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_at + N, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rt * N + rn, mask=mask, other=0.0).to(tl.float32)
        one_plus_e = 1.0 + _exp(-g)
        s = tl.div_rn(g, one_plus_e).to(dtype).to(tl.float32)  # silu(gate) as the forward stores it
        d_up = dy * s
        d_silu = (dy * u).to(dtype).to(tl.float32)
        sig = tl.div_rn(tl.full(g.shape, 1.0, tl.float32), one_plus_e)
        d_gate = d_silu * sig * tl.fma(g, 1.0 - sig, 1.0)
        out_at = dx_ptr + rt * (2 * N) + rn
        tl.store(out_at, d_gate.to(dtype), mask=mask)
        tl.store(out_at + N, d_up.to(dtype), mask=mask)

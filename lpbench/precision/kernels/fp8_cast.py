"""Delayed-scaling FP8 cast in one pass: codes, transposed codes and the amax for the history.

Hand-written (Triton) because torch.compile cannot do it: the kernel that writes the
transposed copy is a tiled element-wise kernel, and inductor will not reduce a whole-tensor
amax inside it, so the compiled cast reads the operand twice (once to cast, once for the amax
the next step's scale needs). Here each tile is read once, cast with the scale from the amax
history, stored row-major and transposed, and its amax folded into one FP32 by an integer
atomic max on the bit patterns (for non-negative floats the integer order is the float order,
and NaN sorts above +inf, so a NaN anywhere gives NaN, as ``abs().amax()`` does).

The first step has no history: the current amax stands in (``delayed_encode_scale``), so a
separate amax kernel runs first; once the history holds an amax its loads are masked off by a
device-side flag (no host sync). Used for 16-bit and FP32 CUDA operands when Triton is present;
everything else takes the compiler-fused ops of ``fp8_linear.cast``, with which this is
bit-exact (``gpu`` tests). The kernels are ``triton_op``s: torch.compile launches them from
its generated code, without the Python dispatch of an opaque custom op on every call.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from lpbench.precision.capability import tl, triton  # None without Triton
from lpbench.precision.formats import FloatFormat

TILE = 64  # rows and columns per program of the cast
WARPS = 4  # warps per program


def _launch(launcher, x, q, qt, encode_scale, fp8_max, write_t, tile=None, warps=None) -> torch.Tensor:
    """Run the cast of ``x`` into ``q`` (and ``qt``); the amax of x (FP32)."""
    m, n = x.shape
    tile, warps = tile or TILE, warps or WARPS
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, tile))
    launcher(_cast_kernel)[grid](x, q, qt, encode_scale, amax_bits, m, n, FMAX=fp8_max, WRITE_T=write_t, BM=tile,
                                 BN=tile, num_warps=warps)
    return amax_bits.view(torch.float32)


@triton_op("lpbench::fp8_cast_transpose", mutates_args=())
def _cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                    write_t: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if write_t else (0,), dtype=dtype, device=x.device)
    return q, qt, _launch(wrap_triton, x, q, qt, encode_scale, fp8_max, write_t)


@triton_op("lpbench::amax_unless", mutates_args=())
def _amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    wrap_triton(_amax_kernel)[(triton.cdiv(numel, 8192),)](x, skip, amax_bits, numel, BLOCK=8192, num_warps=8)
    return amax_bits.view(torch.float32)


def cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, write_t: bool):
    """(codes, transposed codes or empty, amax of x): saturating round-to-nearest-even cast of
    x × encode_scale, in one read of x (CUDA; see :func:`lpbench.precision.capability.fp8_cast_kernel`)."""
    return _cast_transpose(x.contiguous(), encode_scale.float().reshape(()), fmt.max, fmt.dtype, write_t)


def cast_transpose_into(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, q: torch.Tensor,
                        qt: torch.Tensor, tile: int | None = None, warps: int | None = None) -> torch.Tensor:
    """:func:`cast_transpose` into given ``q`` [M, N] and ``qt`` [N, M] (eager only: a plain kernel launch,
    for buffers that outlive the call); returns the amax of x. ``tile``/``warps``: the launch shape
    (``benchmarks/fp8_cast.py`` times the choices)."""
    return _launch(lambda k: k, x.contiguous(), q, qt, encode_scale.float().reshape(()), fmt.max, True, tile, warps)


def amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """amax of |x| (FP32), or 0 without reading x where the boolean scalar ``skip`` is true."""
    return _amax_unless(x.contiguous(), skip.reshape(()).to(torch.int8))


if triton is not None:

    @triton.jit
    def _bits_of_abs(x):
        """|x| as int32 bits: ordered like the floats, NaN above +inf."""
        return tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)

    @triton.jit
    def _cast_kernel(x_ptr, q_ptr, qt_ptr, enc_ptr, amax_ptr, M, N, FMAX: tl.constexpr, WRITE_T: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * tl.load(enc_ptr)
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))  # saturate; NaN stays NaN
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(_bits_of_abs(x), axis=1), axis=0))

    @triton.jit
    def _amax_kernel(x_ptr, skip_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < numel) & (tl.load(skip_ptr) == 0)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.atomic_max(amax_ptr, tl.max(_bits_of_abs(x), axis=0))

"""The MoE experts' grouped GEMMs that torch lacks: one persistent Triton kernel for the forward and data-gradient
GEMMs (2-D x 3-D: each expert's rows of ``a`` times its weight) and the weight gradient (2-D x 2-D: each expert's
slice of the reduction), of FP8 codes with row-wise decode scales or of BF16 operands.

Hand-written for two things torch's grouped GEMMs do not do well or at all (measurements:
``benchmarks/grouped_gemm.py``, benchmarks/RESULTS.md):

* **Precise FP8 accumulation of small experts**, where torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``)
  is slow: :func:`takes` sends only experts of fewer than ``SMALL_EXPERT`` weight elements here; fast
  accumulation stays with torch.
* **The weight gradient added into an FP32 buffer** (:func:`wgrad_into`, gradient-accumulation fusion,
  :mod:`lpbench.convert.main_grads`): torch's grouped GEMMs write BF16 only, which autograd then casts and adds;
  here the epilogue adds the FP32 product to the buffer's tile, loaded before the main loop.

Precise accumulation is CUTLASS's rule: the tensor cores' partial sums are added into an FP32 accumulator
every ``PROMOTE`` (128) elements of the reduction (Triton's ``max_num_imprecise_acc``). The results are the
reference's (decoded codes, an FP32 matmul per expert, then the scales) but for the tensor cores' own summation
of each 128-long slice and BF16's rounding, and torch's precise kernel's bit for bit (the GPU tests assert both).
Into FP32 the weight gradient of FP8 codes is sliced at rows that are multiples of 128 (an expert's first and
last slice masked to its rows), so that slices do not straddle cache lines.

Layout (:class:`lpbench.models.moe.Groups`): ``offs`` [E] int32 are the experts' padded ends along the
grouped dimension, ascending multiples of 16. Forward / data gradient: ``a`` [R, K] row-major, ``b`` [E, N, K]
(each expert's ``[N, K]`` row-major), ``sa`` [R], ``sb`` [E, N]; out [R, N] BF16, rows after ``offs[-1]``
unwritten. Weight gradient: ``a`` [M, R] and ``b`` [N, R], ``sa`` [E, M], ``sb`` [E, N]; out [E, M, N] (BF16, zeros
for an expert without rows; or FP32 added into, an expert without rows left as it was). FP8 codes have the
reduction contiguous (the FP8 tensor cores' layout); BF16 operands may have any strides (autograd's dy and x,
read transposed).

Each program (one per SM) walks the experts in order and takes every ``PROGRAMS``-th output tile, the side with
fewer tiles fastest, so the programs at work together share the other side's tile: a weight tile (forward), the
smaller operand (weight gradient)."""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

PROMOTE = 128  # reduction elements between the FP32 promotions of precise accumulation (CUTLASS's interval)
CONFIG = (128, 128, 128, 8, 4)  # BM, BN, BK, warps, stages: the fastest of benchmarks/grouped_gemm.py's on an H200
BF16_CONFIG = (128, 128, 64, 8, 4)  # the same for 16-bit operands (the weight gradient into FP32)
SMALL_EXPERT = 1 << 24  # weight elements an expert under which this kernel runs the precise GEMMs (module doc)


def launch(launcher, a, b, sa, sb, offs, out, fast: bool, accumulate: bool = False, config=None) -> None:
    """Run the kernel into ``out`` (see the module doc for the shapes); ``launcher``: ``wrap_triton`` inside an
    op, the identity eagerly; ``sa``, ``sb`` None: 16-bit operands, no scales; ``fast``: fast accumulation (FP8
    operands); ``accumulate``: add into ``out`` (FP32) instead of writing it; ``config``: (BM, BN, BK, warps,
    stages), else :data:`CONFIG` (FP8) or :data:`BF16_CONFIG`."""
    wgrad, scaled = b.dim() == 2, sa is not None
    bm, bn, bk, warps, stages = config or (CONFIG if scaled else BF16_CONFIG)
    if wgrad:
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        s_bg = 0
    else:
        m, k = a.shape
        n, s_bg = b.shape[1], b.stride(0)
    # one program per SM (a few under Triton's interpreter, on the CPU)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    launcher(_grouped_kernel)[(programs,)](
        a,
        b,
        sa if scaled else offs,
        sb if scaled else offs,
        offs,
        out,
        offs.shape[0],
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        s_bg,
        b.stride(-2),
        b.stride(-1),
        out.stride(0) if wgrad else 0,
        out.stride(-2),
        WGRAD=wgrad,
        SCALED=scaled,
        FAST=fast or not scaled,
        ACCUMULATE=accumulate,
        PROMOTE=PROMOTE,
        BM=bm,
        BN=bn,
        BK=bk,
        PROGRAMS=programs,
        num_warps=warps,
        num_stages=stages,
    )


@kernel_op("lpbench::fp8_grouped_mm", ())
def _grouped_mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    shape = (offs.shape[0], a.shape[0], b.shape[0]) if b.dim() == 2 else (a.shape[0], b.shape[1])
    out = torch.empty(shape, dtype=torch.bfloat16, device=a.device)
    launch(wrap_triton, a, b, sa, sb, offs, out, False)
    return out


@kernel_op("lpbench::grouped_wgrad_into", ("out",))
def _wgrad_into(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    sa: torch.Tensor | None,
    sb: torch.Tensor | None,
    offs: torch.Tensor,
    fast: bool,
) -> None:
    launch(wrap_triton, a, b, sa, sb, offs, out, fast, accumulate=True)


def takes(a: torch.Tensor, b: torch.Tensor, fast: bool, out_dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM of E4M3 codes ``a``, ``b`` (the layouts of the module doc) runs here rather than in
    torch: precise accumulation into BF16 on SM 9.x, experts' weights of fewer than ``SMALL_EXPERT`` elements, the
    reduction contiguous and, for the forward and data gradient, a multiple of the reduction block (the zoo's
    hidden and FFN sizes are)."""
    if fast or out_dtype != torch.bfloat16 or not _hopper(a) or a.stride(-1) != 1 or b.stride(-1) != 1:
        return False
    if b.dim() == 2:  # weight gradient: [M, R] x [N, R] -> an [M, N] weight an expert
        return a.shape[0] * b.shape[0] < SMALL_EXPERT
    return b.shape[1] * b.shape[2] < SMALL_EXPERT and a.shape[1] % CONFIG[2] == 0


def takes_wgrad_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the weight gradient ``a`` [M, R] x ``b`` [N, R] can be added into FP32 ``out`` [E, M, N] here: SM 9.x,
    ``out`` contiguous; FP8 codes with the reduction contiguous (the FP8 tensor cores' layout), BF16 in any."""
    if not _hopper(a) or out.dtype != torch.float32 or not out.is_contiguous():
        return False
    return a.dtype == b.dtype == torch.bfloat16 or (a.stride(-1) == 1 and b.stride(-1) == 1)


def _hopper(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """Every expert's ``a_e · b_eᵀ`` x ``sa`` x ``sb`` in BF16, precisely accumulated (the module doc's layouts)."""
    return _grouped_mm(a, b, sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(), offs)


def wgrad_into(
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    sa: torch.Tensor | None = None,
    sb: torch.Tensor | None = None,
    fast: bool = False,
) -> None:
    """``out[e] += a_e · b_eᵀ`` (x ``sa`` x ``sb`` for FP8 codes; BF16 operands without) for every expert's slice of
    the rows, in FP32 and without rounding the product (the weight gradient into the FP32 gradient buffer)."""
    if sa is not None:
        sa, sb = sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous()
    _wgrad_into(out, a, b, sa, sb, offs, fast)


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, FAST: tl.constexpr, PROMOTE: tl.constexpr):
        """``acc + a · b``: the tensor cores' own accumulation (``FAST``), or promoted to FP32 every ``PROMOTE``."""
        if FAST:
            return tl.dot(a, b, acc)
        return tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)

    @triton.jit
    def _grouped_kernel(
        a_ptr,
        b_ptr,
        sa_ptr,
        sb_ptr,
        offs_ptr,
        out_ptr,
        G: tl.constexpr,
        M,
        N,
        K,
        s_am,
        s_ak,
        s_bg,
        s_bn,
        s_bk,
        s_og,
        s_om,
        WGRAD: tl.constexpr,
        SCALED: tl.constexpr,
        FAST: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        PROMOTE: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PROGRAMS: tl.constexpr,
    ):
        tile = tl.program_id(0)
        before = 0  # output tiles of the experts before g
        start = 0  # g's first row (forward) or reduction index (weight gradient)
        tiles_n = tl.cdiv(N, BN)
        for g in range(G):
            end = tl.multiple_of(tl.load(offs_ptr + g), 16)  # Groups pads every expert to ALIGN (16) rows
            if WGRAD:
                rows = M
            else:
                rows = end - start
            tiles_m = tl.cdiv(rows, BM)
            tiles = tiles_m * tiles_n
            while (tile >= before) & (tile < before + tiles):
                t = tile - before
                if tiles_m <= tiles_n:  # the side with fewer tiles fastest: the other side's tiles are shared
                    rm = (t % tiles_m) * BM + tl.arange(0, BM)  # rows of this expert's output
                    rn = (t // tiles_m) * BN + tl.arange(0, BN)
                else:
                    rm = (t // tiles_n) * BM + tl.arange(0, BM)
                    rn = (t % tiles_n) * BN + tl.arange(0, BN)
                rk = tl.arange(0, BK)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                m_ok = rm < rows
                n_ok = rn < N
                mask = m_ok[:, None] & n_ok[None, :]
                if WGRAD:
                    ptrs = out_ptr + tl.cast(g, tl.int64) * s_og + rm[:, None].to(tl.int64) * s_om + rn[None, :]
                    row_scales = sa_ptr + g * M + rm
                else:
                    ptrs = out_ptr + (start + rm)[:, None].to(tl.int64) * s_om + rn[None, :]
                    row_scales = sa_ptr + start + rm
                if ACCUMULATE:  # loaded before the main loop, so the read overlaps the GEMM
                    before_tile = tl.load(ptrs, mask=mask, other=0.0)
                if WGRAD:  # reduce over the expert's slice [start, end) of the rows
                    k_lo = start
                    if SCALED and ACCUMULATE:  # codes' rows contiguous: slices from a BK-aligned row (module doc)
                        k_lo = tl.multiple_of(start // BK * BK, BK)
                    first = (k_lo + rk).to(tl.int64)
                    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * s_am + first[None, :] * s_ak
                    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * s_bn + first[:, None] * s_bk
                    for k0 in range(k_lo, end, BK):
                        kk = k0 + rk
                        k_ok = (kk >= start) & (kk < end)
                        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                        acc = _dot(a, b, acc, FAST, PROMOTE)
                        a_ptrs += BK * s_ak
                        b_ptrs += BK * s_bk
                else:  # the expert's rows [start, end) of a, its weight g
                    a_rows = tl.minimum(start + rm, M - 1).to(tl.int64)
                    b_rows = tl.minimum(rn, N - 1).to(tl.int64)
                    a_ptrs = a_ptr + a_rows[:, None] * s_am + rk[None, :] * s_ak
                    b_ptrs = b_ptr + tl.cast(g, tl.int64) * s_bg + b_rows[None, :] * s_bn + rk[:, None] * s_bk
                    for _ in range(0, K, BK):
                        a = tl.load(a_ptrs)
                        b = tl.load(b_ptrs)
                        acc = _dot(a, b, acc, FAST, PROMOTE)
                        a_ptrs += BK * s_ak
                        b_ptrs += BK * s_bk
                y = acc
                if SCALED:
                    sa = tl.load(row_scales, mask=m_ok, other=0.0)
                    sb = tl.load(sb_ptr + g * N + rn, mask=n_ok, other=0.0)
                    y = acc * sa[:, None] * sb[None, :]
                if ACCUMULATE:
                    y += before_tile
                tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
                tile += PROGRAMS
            before += tiles
            start = tl.multiple_of(end, 16)

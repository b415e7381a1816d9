"""FP8 grouped GEMMs of the MoE experts with row-wise decode scales and precise accumulation: one persistent
Triton kernel for the forward and data-gradient GEMMs (2-D x 3-D: each expert's rows of ``a`` times its
weight) and the weight gradient (2-D x 2-D: each expert's slice of the reduction).

Hand-written because torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``, CUTLASS) pays for precise
accumulation very unevenly. On an H200 (``benchmarks/grouped_gemm.py``, 4,096 tokens a micro-batch), on
qwen3-30b-a3b's small experts (weights 1536 x 2048 and 2048 x 768, ~256 rows an expert) its precise
data-gradient GEMMs took 643 / 410 us (gate_up / down) where this kernel takes 311 / 158 and BF16's grouped GEMM
373 / 192, and its weight gradients 1035 / 691 us against 802 / 372; at 8,192 tokens (~512 rows an expert) still
about half; at 2,048 tokens about the same. On mixtral-8x7b's large experts (28672 x 4096 and 4096 x 14336)
torch's are the faster at 2,048 and 4,096 tokens (1817 against 2357 us, 2737 against 3085 at 4,096), so
:func:`takes` sends only experts of fewer than ``SMALL_EXPERT`` weight elements here. Fast accumulation stays
with torch (within a few percent of this kernel either way).

Precise accumulation is CUTLASS's rule: the tensor cores' partial sums are added into an FP32 accumulator
every ``PROMOTE`` (128) elements of the reduction (Triton's ``max_num_imprecise_acc``). The results are the
reference's (decoded codes, an FP32 matmul per expert, then the scales) but for the tensor cores' own summation
of each 128-long slice and BF16's rounding, and torch's precise kernel's bit for bit (the GPU tests assert both).

Layout (:class:`lpbench.precision.grouped.Groups`): ``offs`` [E] int32 are the experts' padded ends along the
grouped dimension, ascending multiples of 16. Forward / data gradient: ``a`` [R, K] row-major, ``b`` [E, N, K]
(each expert's ``[N, K]`` row-major), ``sa`` [R], ``sb`` [E, N]; out [R, N] BF16, rows after ``offs[-1]``
unwritten. Weight gradient: ``a`` [M, R] and ``b`` [N, R] (the operands transposed, the reduction contiguous),
``sa`` [E, M], ``sb`` [E, N]; out [E, M, N] BF16, zeros for an expert without rows.

Each program (one per SM) walks the experts in order and takes every ``PROGRAMS``-th output tile, rows
fastest, so the programs at work together share a weight tile (forward) or an input tile (weight gradient).
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

PROMOTE = 128  # reduction elements between the FP32 promotions of precise accumulation (CUTLASS's interval)
CONFIG = (128, 128, 128, 8, 4)  # BM, BN, BK, warps, stages: the fastest of benchmarks/grouped_gemm.py's on an H200
SMALL_EXPERT = 1 << 24  # weight elements an expert under which this kernel runs the precise GEMMs (module doc)


def launch(launcher, a, b, sa, sb, offs, out, fast: bool, config=CONFIG) -> None:
    """Run the kernel into ``out`` (see the module doc for the shapes); ``launcher``: ``wrap_triton`` inside an
    op, the identity eagerly; ``fast``: fast accumulation (for the benchmark's comparison)."""
    wgrad = b.dim() == 2
    bm, bn, bk, warps, stages = config
    if wgrad:
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        s_bg = 0
    else:
        m, k = a.shape
        n, s_bg = b.shape[1], b.stride(0)
    # one program per SM (a few under Triton's interpreter, on the CPU)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    launcher(_grouped_kernel)[(programs,)](
        a, b, sa, sb, offs, out, offs.shape[0], m, n, k, a.stride(0), s_bg, b.stride(-2),
        out.stride(0) if wgrad else 0, out.stride(-2),
        WGRAD=wgrad, FAST=fast, PROMOTE=PROMOTE, BM=bm, BN=bn, BK=bk, PROGRAMS=programs,
        num_warps=warps, num_stages=stages)


@kernel_op("lpbench::fp8_grouped_mm", ())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                offs: torch.Tensor) -> torch.Tensor:
    shape = (offs.shape[0], a.shape[0], b.shape[0]) if b.dim() == 2 else (a.shape[0], b.shape[1])
    out = torch.empty(shape, dtype=torch.bfloat16, device=a.device)
    launch(wrap_triton, a, b, sa, sb, offs, out, False)
    return out


def takes(a: torch.Tensor, b: torch.Tensor, fast: bool, out_dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM of E4M3 codes ``a``, ``b`` (the layouts of the module doc) runs here rather than in
    torch: precise accumulation into BF16 on SM 9.x, experts' weights of fewer than ``SMALL_EXPERT`` elements, the
    reduction contiguous and, for the forward and data gradient, a multiple of the reduction block (the zoo's
    hidden and FFN sizes are)."""
    if fast or out_dtype != torch.bfloat16 or triton is None or not a.is_cuda:
        return False
    if torch.cuda.get_device_capability(a.device)[0] != 9 or a.stride(-1) != 1 or b.stride(-1) != 1:
        return False
    if b.dim() == 2:  # weight gradient: [M, R] x [N, R] -> an [M, N] weight an expert
        return a.shape[0] * b.shape[0] < SMALL_EXPERT
    return b.shape[1] * b.shape[2] < SMALL_EXPERT and a.shape[1] % CONFIG[2] == 0


def grouped_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
               offs: torch.Tensor) -> torch.Tensor:
    """Every expert's ``a_e · b_eᵀ`` x ``sa`` x ``sb`` in BF16, precisely accumulated (the module doc's layouts)."""
    return _grouped_mm(a, b, sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(), offs)


if triton is not None:
    @triton.jit
    def _grouped_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, out_ptr, G: tl.constexpr, M, N, K,
                        s_am, s_bg, s_bn, s_og, s_om, WGRAD: tl.constexpr, FAST: tl.constexpr, PROMOTE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr):
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
                rm = (t % tiles_m) * BM + tl.arange(0, BM)  # rows of this expert's output
                rn = (t // tiles_m) * BN + tl.arange(0, BN)
                rk = tl.arange(0, BK)
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                if WGRAD:  # reduce over the expert's slice [start, end) of the rows
                    a_rows = tl.minimum(rm, M - 1).to(tl.int64)
                    b_rows = tl.minimum(rn, N - 1).to(tl.int64)
                    for k0 in range(start, end, BK):
                        kk = k0 + rk
                        a = tl.load(a_ptr + a_rows[:, None] * s_am + kk[None, :], mask=kk[None, :] < end, other=0.0)
                        b = tl.load(b_ptr + b_rows[None, :] * s_bn + kk[:, None], mask=kk[:, None] < end, other=0.0)
                        if FAST:
                            acc = tl.dot(a, b, acc)
                        else:
                            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
                else:  # the expert's rows [start, end) of a, its weight g
                    a_rows = tl.minimum(start + rm, M - 1).to(tl.int64)
                    b_rows = tl.minimum(rn, N - 1).to(tl.int64)
                    a_ptrs = a_ptr + a_rows[:, None] * s_am + rk[None, :]
                    b_ptrs = b_ptr + tl.cast(g, tl.int64) * s_bg + b_rows[None, :] * s_bn + rk[:, None]
                    for _ in range(0, K, BK):
                        a = tl.load(a_ptrs)
                        b = tl.load(b_ptrs)
                        if FAST:
                            acc = tl.dot(a, b, acc)
                        else:
                            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
                        a_ptrs += BK
                        b_ptrs += BK
                n_ok = rn < N
                sb = tl.load(sb_ptr + g * N + rn, mask=n_ok, other=0.0)
                if WGRAD:
                    m_ok = rm < M
                    sa = tl.load(sa_ptr + g * M + rm, mask=m_ok, other=0.0)
                    ptrs = out_ptr + tl.cast(g, tl.int64) * s_og + rm[:, None].to(tl.int64) * s_om + rn[None, :]
                else:
                    m_ok = rm < rows
                    sa = tl.load(sa_ptr + start + rm, mask=m_ok, other=0.0)
                    ptrs = out_ptr + (start + rm)[:, None].to(tl.int64) * s_om + rn[None, :]
                y = acc * sa[:, None] * sb[None, :]
                tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
                tile += PROGRAMS
            before += tiles
            start = tl.multiple_of(end, 16)

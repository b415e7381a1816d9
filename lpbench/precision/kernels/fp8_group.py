"""The weight gradient's FP8 operands of grouped experts in two reads: group-wise column amaxes, then the codes.

The weight gradient of grouped experts reduces over each expert's tokens, so its FP8 operands (the output
gradient and the input, rows sorted by expert in a :class:`lpbench.models.moe.Groups` buffer) take one
scale per expert and column: the amax of each column over the expert's rows; the grouped GEMM takes them
transposed. Hand-written (Triton) because the compiled ops read the operand more than once (a block reduction,
then a ``scatter_reduce`` by expert) and write the transposed copy slowly (benchmarks/RESULTS.md, issue 19).

:func:`group_amax`: each program walks down ``ROWS`` rows of ``COLS`` columns in blocks of the caller's
``block`` rows (ALIGN in a Groups buffer: no block straddles two experts, the reference's own assumption,
whose group is that of its first row), keeps the running column maxima in registers while the expert stays
the same, and folds them into the expert's row of the result by an integer atomic max on the bit patterns of
``|x|`` when the expert changes and at its end, as ``kernels/fp8_cast.py`` does for tensor amaxes. So a NaN in
an expert's column gives NaN there, as the definition (the dense quantizer's ``abs().amax()``) does, and the
result is the reference's bit for bit (up to a NaN's payload, which no scale carries). Experts with no rows
keep 0, as the reference's zero-initialised scatter does. For the output gradient, whose data-gradient codes
are row-wise, the same read also stores each block of columns' row maxima, which the op reduces.

:func:`group_cast`: ``kernels/fp8_cast.py``'s tiled cast with a scale per row's group and column (gathered from
the [groups, columns] encode scales): the transposed codes, and for the output gradient the row-wise codes of
the data gradient from the same read. The scales are the torch ops' (``fp8_encode_scale``), so the codes are
``encode``'s bit for bit (saturate, NaN kept, round to nearest even).
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

ROWS = 128  # rows per program (a multiple of the block)
COLS = 512  # columns per program
WARPS = 4


def launch_group_amax(
    launcher,
    x: torch.Tensor,
    group: torch.Tensor,
    bits: torch.Tensor,
    row_bits: torch.Tensor | None,
    block: int,
    rows: int = ROWS,
    cols: int = COLS,
    warps: int = WARPS,
) -> None:
    """Fold the group column amaxes of ``x`` [M, N] into ``bits`` [G, N] (int32 bit patterns of FP32 amaxes, zeros
    to start): the rows of each ``block`` (M a multiple of it) belong to the group ``group`` gives its first row;
    and, given ``row_bits`` [:func:`column_blocks`, M], store each block of ``cols`` columns' row maxima in its
    row (their maximum over the blocks is each row's amax). ``launcher``: ``wrap_triton`` inside an op, the
    identity eagerly."""
    m, n = x.shape
    rows = max(rows // block, 1) * block
    grid = (triton.cdiv(m, rows), triton.cdiv(n, cols))
    launcher(_group_amax_kernel)[grid](
        x,
        group,
        bits,
        bits if row_bits is None else row_bits,
        m,
        n,
        ROW_AMAX=row_bits is not None,
        ROWS=rows,
        BM=block,
        BN=cols,
        num_warps=warps,
    )


def column_blocks(n: int, cols: int = COLS) -> int:
    """How many blocks of ``cols`` columns :func:`launch_group_amax` splits ``n`` columns into."""
    return -(-n // cols)


@kernel_op("lpbench::fp8_group_amax", ())
def _group_amax(
    x: torch.Tensor, group: torch.Tensor, n_groups: int, block: int, row_amax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    bits = torch.zeros((n_groups, x.shape[1]), dtype=torch.int32, device=x.device)
    row_bits = (
        torch.empty((column_blocks(x.shape[1]), x.shape[0]), dtype=torch.int32, device=x.device) if row_amax else None
    )
    launch_group_amax(wrap_triton, x, group, bits, row_bits, block)
    rows = row_bits.amax(0) if row_amax else bits.new_zeros(0)
    return bits.view(torch.float32), rows.view(torch.float32)


def group_amax(
    x: torch.Tensor, group: torch.Tensor, n_groups: int, block: int, row_amax: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n_groups, N] FP32: the amax of |x| over each group's rows per column, [M] FP32: each row's amax, or empty
    unless ``row_amax``) in one read of ``x`` [M, N], a 2-D CUDA 16-bit or FP32 tensor
    (:func:`lpbench.precision.capability.fp8_cast_kernel`); ``group`` [M]: the group of each row, constant over
    each ``block`` rows (a power of two dividing M)."""
    return _group_amax(x.contiguous(), group.contiguous(), n_groups, block, row_amax)


CAST_TILE = 64  # rows and columns per program of the cast
CAST_WARPS = 4


def launch_group_cast(
    launcher,
    x: torch.Tensor,
    row_enc: torch.Tensor | None,
    group: torch.Tensor,
    group_enc: torch.Tensor,
    q: torch.Tensor,
    qt: torch.Tensor,
    fp8_max: float,
    tile: int = CAST_TILE,
    warps: int = CAST_WARPS,
) -> None:
    """Cast ``x`` [M, N] into ``qt`` [N, M]: the transposed codes of x x ``group_enc[group[i], j]`` (each row's
    group's column scales), and, given ``row_enc`` [M], into ``q`` [M, N] the codes of x x ``row_enc[i]``; both
    saturating, round to nearest even, in one read."""
    m, n = x.shape
    grid = (triton.cdiv(m, tile), triton.cdiv(n, tile))
    launcher(_group_cast_kernel)[grid](
        x,
        group_enc if row_enc is None else row_enc,
        group,
        group_enc,
        q,
        qt,
        m,
        n,
        FMAX=fp8_max,
        WRITE_ROWS=row_enc is not None,
        BM=tile,
        BN=tile,
        num_warps=warps,
    )


@kernel_op("lpbench::fp8_group_cast", ())
def _group_cast(
    x: torch.Tensor,
    row_enc: torch.Tensor | None,
    group: torch.Tensor,
    group_enc: torch.Tensor,
    fp8_max: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n) if row_enc is not None else (0,), dtype=dtype, device=x.device)
    qt = torch.empty((n, m), dtype=dtype, device=x.device)
    launch_group_cast(wrap_triton, x, row_enc, group, group_enc, q, qt, fp8_max)
    return q, qt


def group_cast(
    x: torch.Tensor, row_enc: torch.Tensor | None, group: torch.Tensor, group_enc: torch.Tensor, fmt
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row-wise codes [M, N] of ``x`` x ``row_enc`` [M] (empty without it), transposed group-wise codes [N, M] of
    ``x`` x ``group_enc[group]``) in ``fmt`` (a FloatFormat with a torch dtype), from one read of ``x`` [M, N]: the
    data- and weight-gradient operands that ``encode`` gives, the second stored as the grouped GEMM takes it."""
    return _group_cast(
        x.contiguous(),
        None if row_enc is None else row_enc.reshape(-1).contiguous(),
        group.contiguous(),
        group_enc.contiguous(),
        fmt.max,
        fmt.dtype,
    )


if triton is not None:
    from lpbench.precision.kernels.fp8_cast import _bits_of_abs, _saturate

    @triton.jit
    def _group_amax_kernel(
        x_ptr,
        group_ptr,
        bits_ptr,
        row_bits_ptr,
        M,
        N,
        ROW_AMAX: tl.constexpr,
        ROWS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        r0 = tl.program_id(0).to(tl.int64) * ROWS
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        cols = rn < N
        cur = tl.load(group_ptr + r0)  # the expert whose column maxima ``acc`` holds
        acc = tl.zeros((BN,), dtype=tl.int32)
        for i in range(0, ROWS, BM):
            rm = r0 + i + tl.arange(0, BM)
            tile = _bits_of_abs(
                tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=(rm < M)[:, None] & cols[None, :], other=0.0)
            )
            if ROW_AMAX:  # this column block's row maxima, reduced by the caller (one address per row, no atomics)
                tl.store(row_bits_ptr + tl.program_id(1) * M + rm, tl.max(tile, axis=1), mask=rm < M)
            g = tl.load(group_ptr + r0 + i, mask=r0 + i < M, other=cur)
            if g != cur:
                tl.atomic_max(bits_ptr + cur * N + rn, acc, mask=cols)
                acc = tl.zeros((BN,), dtype=tl.int32)
                cur = g
            acc = tl.maximum(acc, tl.max(tile, axis=0))
        tl.atomic_max(bits_ptr + cur * N + rn, acc, mask=cols)

    @triton.jit
    def _group_cast_kernel(
        x_ptr,
        row_enc_ptr,
        group_ptr,
        group_enc_ptr,
        q_ptr,
        qt_ptr,
        M,
        N,
        FMAX: tl.constexpr,
        WRITE_ROWS: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        rows = rm < M
        mask = rows[:, None] & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if WRITE_ROWS:  # x x its row's scale, row-major
            y = _saturate(x * tl.load(row_enc_ptr + rm, mask=rows, other=1.0)[:, None], FMAX)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
        g = tl.load(group_ptr + rm, mask=rows, other=0)
        y = _saturate(x * tl.load(group_enc_ptr + g[:, None] * N + rn[None, :], mask=mask, other=1.0), FMAX)
        tl.store(qt_ptr + rn[None, :] * M + rm[:, None], y.to(qt_ptr.dtype.element_ty), mask=mask)

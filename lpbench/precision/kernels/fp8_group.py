"""Group-wise column amaxes of a grouped-GEMM operand in one read (the weight-gradient GEMM's FP8 scaling).

The weight gradient of grouped experts reduces over each expert's tokens, so its FP8 operands (the
output gradient and the input, rows sorted by expert in a :class:`lpbench.precision.grouped.Groups`
buffer) take one scale per expert and column: the amax of each column over the expert's rows.
Hand-written (Triton) because the compiled ops cannot do it in one pass: inductor reduces blocks of
rows in one kernel and scatters the block maxima by expert in another (``scatter_reduce``), 2.7 ms a
micro-batch on mixtral-8x7b@2L (an H200), for what one read of the operand does here.

Each program reads a tile of rows and columns, reduces each expert's rows of the tile to one maximum
per column (a tile rarely spans more than one expert: they hold hundreds of rows each) and folds it into
the expert's row of the result by an integer atomic max on the bit patterns of ``|x|``, as
``kernels/fp8_cast.py`` does for tensor amaxes: for non-negative floats the integer order is the
float order, and NaN sorts above +inf, so a NaN in an expert's column gives NaN there, as the reference
(``abs``, ``amax`` and ``scatter_reduce(..., "amax")`` on the CPU) does. Max is exact in any order, so
the result is the reference's bit for bit (up to a NaN's payload, which no scale carries). Experts
with no rows keep 0, as the reference's zero-initialised scatter does.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton

TILE_ROWS = 128
TILE_COLS = 128
WARPS = 8


def launch_group_amax(launcher, x: torch.Tensor, group: torch.Tensor, bits: torch.Tensor,
                      tile_rows: int = TILE_ROWS, tile_cols: int = TILE_COLS) -> None:
    """Fold the group column amaxes of ``x`` [M, N] (row i in group ``group[i]``) into ``bits`` [G, N] (int32
    bit patterns of FP32 amaxes; zeros to start). ``launcher``: ``wrap_triton`` inside an op, identity eagerly."""
    m, n = x.shape
    grid = (triton.cdiv(m, tile_rows), triton.cdiv(n, tile_cols))
    launcher(_group_amax_kernel)[grid](x, group, bits, m, n, BM=tile_rows, BN=tile_cols, num_warps=WARPS)


@kernel_op("lpbench::fp8_group_amax", ())
def _group_amax(x: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    bits = torch.zeros((n_groups, x.shape[1]), dtype=torch.int32, device=x.device)
    launch_group_amax(wrap_triton, x, group, bits)
    return bits.view(torch.float32)


def group_amax(x: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[n_groups, N] FP32: the amax of |x| over each group's rows per column, ``x`` [M, N] 2-D CUDA 16-bit or
    FP32 (:func:`lpbench.precision.capability.fp8_cast_kernel`), ``group`` [M] the group of each row."""
    return _group_amax(x.contiguous(), group.contiguous(), n_groups)


if triton is not None:
    from lpbench.precision.kernels.fp8_cast import _bits_of_abs

    @triton.jit
    def _group_amax_kernel(x_ptr, group_ptr, bits_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        rows, cols = rm < M, rn < N
        bits = _bits_of_abs(tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=rows[:, None] & cols[None, :],
                                    other=0.0))
        first = tl.load(group_ptr + tl.program_id(0).to(tl.int64) * BM)
        g = tl.where(rows, tl.load(group_ptr + rm, mask=rows, other=0), first).to(tl.int64)
        last = tl.max(g, axis=0)
        e = tl.min(g, axis=0)
        while e <= last:  # each group in the tile, ascending (one trip where the tile is one expert's)
            col_max = tl.max(tl.where((g == e)[:, None], bits, 0), axis=0)
            tl.atomic_max(bits_ptr + e * N + rn, col_max, mask=cols)
            e = tl.min(tl.where(g > e, g, last + 1), axis=0)

"""Native MXFP8 and NVFP4 GEMMs (compute capability 10.x): lpbench's quantizer output, laid out as
cuBLAS reads it, multiplied by torch's ``F.scaled_mm``.

The operands are the codes and scales that :func:`lpbench.precision.quantize.quantize_mx` and
``quantize_nvfp4`` (or the fused NVFP4 quantizer) already produce for the emulated GEMM, so the
native and emulated paths differ only in who multiplies. What this module adds is layout:

* E2M1 codes packed two per byte, first element in the low nibble (``torch.float4_e2m1fn_x2``,
  :func:`lpbench.precision.formats.pack_e2m1`);
* one scale per 1x32 (MX, E8M0) or 1x16 (NVFP4, E4M3) block of every row: 16x16 weight blocks are
  repeated over their 16 rows;
* the block scales of an [R, C] operand (C = K / block) padded to a multiple of 128 rows and 4
  columns and stored as cuBLAS's block-scaling-factor layout (torch's ``SWIZZLE_32_4_4``): 128x4 tiles
  in row-major tile order, 512 bytes each, scale (r, c) of a tile at byte (r % 32)·16 + (r // 32)·4 + c;
* the reduction dim zero-padded (codes and scales) where the GEMM needs it: packed FP4 needs K a
  multiple of 32, FP8 a multiple of 16; zero codes add nothing to the product;
* NVFP4's FP32 global decode scales passed as the second (TensorWise) scale of each operand:
  cuBLAS multiplies the output by their product, as the emulation does.

Hand-written because the layout is the part that is ours to get right and to test on CPU
(``tests/test_block_scaled.py`` checks it against an independent index formula and against torch's
own shape checks on the meta device); the multiplication itself is torch's. MXFP4 stays emulated:
torch's CUDA MXFP4 GEMM needs a build with FBGEMM GenAI kernels, which the stock wheels lack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lpbench.precision.quantize import QTensor

TILE_ROWS, TILE_COLS = 128, 4  # scale tile of cuBLAS's block-scaling-factor layout
SCALE_DTYPES = {32: torch.float8_e8m0fnu, 16: torch.float8_e4m3fn}  # block length -> scale dtype


def k_multiple(q: QTensor) -> int:
    """What the GEMM needs the reduction dim to divide by: 32 for packed E2M1, 16 for FP8."""
    return 32 if q.codes.dtype == torch.uint8 else 16


def takes(a: QTensor, b: QTensor) -> bool:
    """Whether a · bᵀ is a block-scaled GEMM this module runs: both MX (1x32 E8M0) or both NVFP4 (1x16 E4M3,
    16x16 allowed), FP8 or both E2M1 elements, not E5M2 × E5M2 (cuBLAS lacks it), and N a multiple of 16.
    MX with E2M1 elements (MXFP4) is not taken (see the module docstring)."""
    (_, k), (n, k2) = a.codes.shape, b.codes.shape
    blocks = {a.block[1], b.block[1]}
    if k != k2 or len(blocks) != 1 or n % 16:
        return False
    block = blocks.pop()
    if block not in SCALE_DTYPES or a.scale.dtype != SCALE_DTYPES[block] or b.scale.dtype != SCALE_DTYPES[block]:
        return False
    fp4 = (a.codes.dtype == torch.uint8, b.codes.dtype == torch.uint8)
    if block == 16:
        return all(fp4) and a.global_scale is not None and b.global_scale is not None
    return not any(fp4) and (a.codes.dtype, b.codes.dtype) != (torch.float8_e5m2,) * 2


def row_scales(q: QTensor) -> torch.Tensor:
    """One scale per 1 x block of every row: [rows, ⌈K / block⌉] (2-D blocks repeated over their rows)."""
    return q.scale if q.block[0] == 1 else q.scale.repeat_interleave(q.block[0], 0)[: q.codes.shape[0]]


def swizzle(scale: torch.Tensor) -> torch.Tensor:
    """[R, C] block scales → the flat SWIZZLE_32_4_4 layout: padded to 128 x 4 tiles (zeros), tile-major,
    scale (r, c) of a tile at (r % 32)·16 + (r // 32)·4 + c. Size: ceil(R/128)·128 · ceil(C/4)·4."""
    if scale.dim() != 2 or scale.element_size() != 1:
        raise ValueError(f"swizzle takes 2-D one-byte scales, got {tuple(scale.shape)} {scale.dtype}")
    rows, cols = scale.shape
    raw = F.pad(scale.view(torch.uint8), (0, -cols % TILE_COLS, 0, -rows % TILE_ROWS))
    tr, tc = raw.shape[0] // TILE_ROWS, raw.shape[1] // TILE_COLS
    # row r = 128·tile_row + 32·i + j, column c = 4·tile_col + l  →  [tile_row, tile_col, j, i, l]
    tiles = raw.reshape(tr, 4, 32, tc, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(scale.dtype).flatten()


def pad_k(q: QTensor, multiple: int) -> QTensor:
    """``q`` with its reduction dim zero-padded to ``multiple`` (codes 0, block scales 0): the product is unchanged.
    A partial last block (NVFP4 pads those) keeps its scale; its missing codes become zeros."""
    k = q.codes.shape[1]
    kp = -(-k // multiple) * multiple
    if kp == k:
        return q
    if kp % q.block[1]:
        raise ValueError(f"cannot pad K={k} to a multiple of {multiple} in whole {q.block[1]}-blocks")
    codes = F.pad(q.codes.view(torch.uint8), (0, kp - k)).view(q.codes.dtype)
    scale = F.pad(q.scale.view(torch.uint8), (0, kp // q.block[1] - q.scale.shape[1])).view(q.scale.dtype)
    return QTensor(codes, scale, q.block, q.fmt, q.global_scale)


def _operand_bytes(q: QTensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]:
    """(data bytes, swizzled scale bytes, FP32 global scale or None, data dtype name) of ``q``, K padded to ``k``.
    Bytes, so that compiled code never holds FP4 tensors: E2M1 pairs packed as
    :func:`lpbench.precision.formats.pack_e2m1` packs them."""
    q = pad_k(q, k)
    if q.codes.dtype == torch.uint8:
        data, dtype = q.codes[:, 0::2] | (q.codes[:, 1::2] << 4), "float4_e2m1fn_x2"
    else:
        data, dtype = q.codes.view(torch.uint8), str(q.codes.dtype).removeprefix("torch.")
    g = None if q.global_scale is None else q.global_scale.float().reshape(())
    return data, swizzle(row_scales(q)).view(torch.uint8), g, dtype


def _operands_bytes(a: QTensor, b: QTensor) -> tuple:
    if not takes(a, b):
        raise ValueError(
            f"not a block-scaled GEMM this path runs: a {tuple(a.codes.shape)} {a.block} {a.scale.dtype}, "
            f"b {tuple(b.codes.shape)} {b.block} {b.scale.dtype}"
        )
    k = max(k_multiple(a), k_multiple(b))
    return _operand_bytes(a, k), _operand_bytes(b, k)


def operands(a: QTensor, b: QTensor) -> tuple[torch.Tensor, ...]:
    """(data a, scales a, data b, scales b, global a, global b) for a · bᵀ, typed as :func:`scaled_mm` takes them."""
    (da, sa, ga, ta), (db, sb, gb, tb) = _operands_bytes(a, b)
    scale_dtype = a.scale.dtype
    return da.view(getattr(torch, ta)), sa.view(scale_dtype), db.view(getattr(torch, tb)), sb.view(scale_dtype), ga, gb


def scaled_mm(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    global_a: torch.Tensor | None = None,
    global_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """BF16 a · bᵀ through ``F.scaled_mm``: row-major data [M, K] (or [M, K/2] packed E2M1) and [N, K], swizzled
    block scales, and for NVFP4 the FP32 global scales (BlockWise1x32 without them, BlockWise1x16 + TensorWise with)."""
    S, W = F.ScalingType, F.SwizzleType
    if global_a is None:
        sa, sb, kinds, sw = scale_a, scale_b, S.BlockWise1x32, W.SWIZZLE_32_4_4
    else:
        sa, sb = [scale_a, global_a], [scale_b, global_b]
        kinds, sw = [S.BlockWise1x16, S.TensorWise], [W.SWIZZLE_32_4_4, W.NO_SWIZZLE]
    return F.scaled_mm(a, b.t(), sa, kinds, sb, kinds, swizzle_a=sw, swizzle_b=sw, output_dtype=torch.bfloat16)


@torch.library.custom_op("lpbench::block_scaled_mm", mutates_args=())
def _block_scaled_mm_op(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    global_a: torch.Tensor | None,
    global_b: torch.Tensor | None,
    dtype_a: str,
    dtype_b: str,
) -> torch.Tensor:
    """:func:`scaled_mm` of bytes (data as ``dtype_a``/``dtype_b``, e.g. "float4_e2m1fn_x2"), as a custom op:
    torch.compile keeps the layouts (inductor has no lowering for these scalings) and traces no FP4 or E8M0
    tensors."""
    scale_dtype = torch.float8_e8m0fnu if global_a is None else torch.float8_e4m3fn
    a, b = a.view(getattr(torch, dtype_a)), b.view(getattr(torch, dtype_b))
    return scaled_mm(a, scale_a.view(scale_dtype), b, scale_b.view(scale_dtype), global_a, global_b)


@_block_scaled_mm_op.register_fake
def _(a, scale_a, b, scale_b, global_a, global_b, dtype_a, dtype_b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def mm(a: QTensor, b: QTensor) -> torch.Tensor:
    """Native BF16 a · bᵀ of two MX or NVFP4 operands quantized along K (see :func:`takes`)."""
    (da, sa, ga, ta), (db, sb, gb, tb) = _operands_bytes(a, b)
    return _block_scaled_mm_op(da, sa, db, sb, ga, gb, ta, tb)

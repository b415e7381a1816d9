"""NVFP4 emulation operands in two reads: the fused quantizer behind the emulated NVFP4 GEMMs.

Hand-written (Triton) because the compiler-fused reference costs more than the BF16 GEMMs it
feeds: inductor runs the global amax, the block amax, the E2M1 rounding (with its random
draws), the wgrad copy's transpose and its random Hadamard transform (RHT) as separate passes.
Here a 16-bit tensor is read twice, once for the global amaxes of both of its copies (the wgrad
copy's after the RHT, computed in registers on the tensor cores) and once to write both
emulation operands: the row-major copy for fprop or dgrad (1x16 blocks along its rows) and the
transposed, Hadamard-transformed copy for wgrad (1x16 blocks along tokens, tokens zero-padded
to a multiple of 16). An operand holds each element's code × E4M3 block scale in BF16 (exact);
the FP32 global decode scale is applied to the GEMM output, as the hardware does. A row whose
length 16 does not divide ends in a partial block, zero-padded as the reference pads it.

The arithmetic is :func:`lpbench.precision.quantize.quantize_nvfp4` step by step, which is
Transformer Engine's (correctly rounded division, round-to-nearest-even casts, saturation, NaN
handling), and the RHT is :func:`lpbench.precision.quantize.apply_rht`'s: FP32 tensor-core sums
rounded to BF16 before the amax and the quantization, as TE's kernels round them. So codes and
scales are bit-exact with the reference given the same RHT sums and the same uniform draws
(``gpu`` tests). Stochastic rounding draws 16-bit uniforms from Philox (``tl.randint4x``) keyed by
a seed tensor and each block's index in its copy; :func:`uniform` materializes them for the tests.
Rows and columns of a copy are independent streams (seed and seed + 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton
from lpbench.precision.quantize import _RHT, TE_RHT_SIGNS, _poison, nvfp4_global_scales, rht_matrix

BLOCK = 16  # NVFP4 block along the reduction dim (the kernels also take the RHT size to be 16)
# (rows, columns) of x per program and warps per program, without and with stochastic rounding (H100:
# benchmarks/nvfp4.py --tiles)
TILES = {False: (64, 64, 4), True: (32, 64, 4)}
_RHT_BF16 = _RHT.bfloat16()  # ±1/4: exact


class Copy(NamedTuple):
    """One NVFP4 copy of a tensor, as the emulated GEMM consumes it."""

    values: torch.Tensor  # code × E4M3 block scale, BF16 (exact)
    global_scale: torch.Tensor  # FP32 decode scale; NaN where the tensor held NaN or Inf
    codes: torch.Tensor | None = None  # uint8 E2M1 codes (``with_codes``)
    scale: torch.Tensor | None = None  # E4M3 block scales, one per 16 elements (``with_codes``)


def quantize(
    x: torch.Tensor,
    *,
    row: bool,
    col: bool,
    rht: bool,
    stochastic: bool,
    signs: tuple[int, ...] = TE_RHT_SIGNS,
    seed: torch.Tensor | None = None,
    with_codes: bool = False,
    reduce_amax=None,
) -> tuple[Copy | None, Copy | None]:
    """NVFP4 copies of ``x`` [M, N]: row-major ([M, N], 1x16 blocks along N, the last one partial
    if 16 does not divide N) if ``row``, and transposed ([N, M'], M' = M rounded up to 16; 1x16
    blocks along M; first Hadamard-transformed in chunks of 16 along M with ``signs`` if ``rht``)
    if ``col``; each quantized with its own global amax.

    ``stochastic``: stochastic rounding from ``seed`` (an int64 CUDA tensor of one element; drawn
    from torch's generator when None). ``with_codes`` also returns codes and block scales
    ([M, ⌈N/16⌉] and [N, M'/16]). ``reduce_amax``: where ``x`` is one rank's part of a tensor (TP's features,
    CP's tokens; blocks never straddle parts), maps the part's [row, col] amaxes to the whole tensor's, so the
    copies are the whole tensor's rows or columns (round-to-nearest only: stochastic draws follow local places).
    """
    x = x.contiguous()
    if seed is None:
        seed = torch.randint(2**31 - 1, (1,), device=x.device) if stochastic else x.new_zeros(1, dtype=torch.int64)
    h = (_RHT_BF16 if signs == TE_RHT_SIGNS else rht_matrix(signs).bfloat16()).to(x.device)
    tile = TILES[stochastic]
    amax = _amax(x, h, row, col, rht, *tile)
    if reduce_amax is not None:
        amax = reduce_amax(amax)
    block_enc, g_dec = nvfp4_global_scales(amax)
    scales = torch.cat([block_enc, g_dec])  # [row block factor, col block factor, row g_dec, col g_dec]
    mp = -(-x.shape[0] // BLOCK) * BLOCK
    out = _quantize(x, h, scales, seed.reshape(1), mp, row, col, rht, stochastic, with_codes, *tile)
    g = _poison(g_dec, amax)
    copies = []
    for i, wanted in enumerate((row, col)):
        values, codes, scale = out[i], out[2 + i], out[4 + i]
        copies.append(
            Copy(values, g[i], codes if with_codes else None, scale if with_codes else None) if wanted else None
        )
    return copies[0], copies[1]


@kernel_op("lpbench::nvfp4_amax", mutates_args=())
def _amax(
    x: torch.Tensor, h: torch.Tensor, row: bool, col: bool, rht: bool, bm: int, bn: int, warps: int
) -> torch.Tensor:
    """[amax of |x|, amax of |the wgrad copy|] (FP32; 0 for a copy not asked for)."""
    bits = torch.zeros(2, dtype=torch.int32, device=x.device)
    m, n = x.shape
    wrap_triton(_amax_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, h, bits, m, n, ROW=row, COL=col, RHT=rht, BM=bm, BN=bn, num_warps=warps
    )
    return bits.view(torch.float32)


@kernel_op("lpbench::nvfp4_quantize", mutates_args=())
def _quantize(
    x: torch.Tensor,
    h: torch.Tensor,
    scales: torch.Tensor,
    seed: torch.Tensor,
    mp: int,
    row: bool,
    col: bool,
    rht: bool,
    sr: bool,
    with_codes: bool,
    bm: int,
    bn: int,
    warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row values, column values, row codes, column codes, row scales, column scales); empty where not asked."""
    m, n = x.shape

    def empty(wanted, shape, dtype):
        return x.new_empty(shape if wanted else (0,), dtype=dtype)

    rv, cv = empty(row, (m, n), torch.bfloat16), empty(col, (n, mp), torch.bfloat16)
    rc, cc = empty(row and with_codes, (m, n), torch.uint8), empty(col and with_codes, (n, mp), torch.uint8)
    rs = empty(row and with_codes, (m, triton.cdiv(n, BLOCK)), torch.float8_e4m3fn)
    cs = empty(col and with_codes, (n, mp // BLOCK), torch.float8_e4m3fn)
    wrap_triton(_quantize_kernel)[(triton.cdiv(mp, bm), triton.cdiv(n, bn))](
        x,
        h,
        scales,
        seed,
        rv,
        cv,
        rc,
        cc,
        rs,
        cs,
        m,
        mp,
        n,
        ROW=row,
        COL=col,
        RHT=rht,
        SR=sr,
        CODES=with_codes,
        BM=bm,
        BN=bn,
        num_warps=warps,
    )
    return rv, cv, rc, cc, rs, cs


def uniform(seed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The uniform draws :func:`quantize` uses for a [rows, cols] copy keyed by ``seed`` (FP32)."""
    out = torch.empty((rows, cols), dtype=torch.float32, device=seed.device)
    _uniform_kernel[(triton.cdiv(rows, 64), triton.cdiv(cols, 64))](seed, out, rows, cols, BM=64, BN=64)
    return out


if triton is not None:
    from lpbench.precision.kernels.fp8_cast import _bits_of_abs  # not renamed: inductor re-emits it by name

    @triton.jit
    def _tile(x_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        """This program's [BM, BN] tile of x (zeros beyond its rows and columns) and its row and column indices."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        return tl.load(x_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], mask=mask, other=0.0), rm, rn

    @triton.jit
    def _columns(x, h_ptr, RHT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """The wgrad copy of a BF16 tile: [BN, BM] FP32, each 16 consecutive rows of x times the RHT matrix
        (BF16 products are exact; FP32 accumulation on the tensor cores), rounded to BF16 as TE rounds it."""
        xt = tl.trans(x)
        if RHT:
            k = tl.arange(0, 16)
            h = tl.load(h_ptr + k[:, None] * 16 + k[None, :])
            sums = tl.reshape(tl.dot(tl.reshape(xt, (BN * BM // 16, 16)), h), (BN, BM))
            return sums.to(tl.bfloat16).to(tl.float32)  # round to nearest even
        return xt.to(tl.float32)

    @triton.jit
    def _amax_kernel(
        x_ptr,
        h_ptr,
        amax_ptr,
        M,
        N,
        ROW: tl.constexpr,
        COL: tl.constexpr,
        RHT: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        x, rm, rn = _tile(x_ptr, M, N, BM, BN)
        if ROW:
            tl.atomic_max(amax_ptr, tl.max(tl.max(_bits_of_abs(x), axis=1), axis=0))
        if COL:
            tl.atomic_max(amax_ptr + 1, tl.max(tl.max(_bits_of_abs(_columns(x, h_ptr, RHT, BM, BN)), axis=1), axis=0))

    @triton.jit
    def _draws(seed, blocks, R: tl.constexpr, NB: tl.constexpr):
        """Uniform draws in [0, 1), multiples of 2^-16, for the 16 elements of each block (``blocks``: [R, NB]
        block indices in the copy): [R, NB, 16]. One Philox evaluation gives 4 x 32 random bits: 8 draws."""
        r0, r1, r2, r3 = tl.randint4x(seed, blocks[:, :, None] * 2 + tl.arange(0, 2)[None, None, :])
        bits = tl.join(tl.join(r0, r1), tl.join(r2, r3)).to(tl.uint32, bitcast=True)  # [R, NB, 2, 2, 2]
        halves = tl.join(bits >> 16, bits & 0xFFFF)  # [R, NB, 2, 2, 2, 2]
        return tl.reshape(halves.to(tl.float32), (R, NB, 16)) * (1.0 / 65536.0)

    @triton.jit
    def _fake_quantize(vb, block_enc, g_dec, seed, blocks, R: tl.constexpr, NB: tl.constexpr, SR: tl.constexpr):
        """NVFP4 of FP32 blocks vb [R, NB, 16] (``blocks``: their indices in the copy), as quantize_nvfp4
        computes it: (code × block scale [R, NB, 16] FP32, E2M1 codes [R, NB, 16] uint8, E4M3 scales [R, NB]).

        Per element it is ALU-bound, so the rounding takes few instructions: nearest-even by adding and
        subtracting 2^(22 + k) (FP32 addition rounds to a multiple of the E2M1 spacing 2^(k - 1) at |y|).
        """
        s = tl.max(_bits_of_abs(vb), axis=2).to(tl.float32, bitcast=True) * block_enc  # >= 0 or NaN
        scale = tl.where(s > 448.0, 448.0, s).to(tl.float8e4nv)  # saturating, round to nearest even
        sf = scale.to(tl.float32)
        enc = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * g_dec)
        enc = tl.where(enc > 3.4028234663852886e38, 3.4028234663852886e38, enc)  # 1/0 = inf -> FP32 max
        y = vb * enc[:, :, None]
        nan = y != y  # E2M1 has no NaN: code +0
        a = tl.minimum(tl.abs(y), 6.0)  # saturate
        big, mid = a >= 4.0, a >= 2.0
        if SR:
            ulp = tl.where(big, 2.0, tl.where(mid, 1.0, 0.5))  # E2M1 spacing at |y|
            q = a * tl.where(big, 0.5, tl.where(mid, 1.0, 2.0))  # a / ulp, exact
            lo = tl.floor(q)
            mag = tl.where(_draws(seed, blocks, R, NB) < q - lo, lo + 1.0, lo) * ulp
        else:
            c = tl.where(big, 16777216.0, tl.where(mid, 8388608.0, 4194304.0))
            mag = (a + c) - c
        mag = tl.where(nan, 0.0, mag)
        sign = tl.where(nan, 0, (y.to(tl.int32, bitcast=True) >> 31) << 31)
        val = (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * sf[:, :, None]
        idx = tl.where(mag < 2.0, mag * 2.0, tl.where(mag < 4.0, mag + 2.0, mag * 0.5 + 4.0)).to(tl.uint8)
        return val, idx + tl.where(sign != 0, 8, 0).to(tl.uint8), scale

    @triton.jit
    def _blocks(r, c0, COLS, R: tl.constexpr, C: tl.constexpr):
        """Indices of the 1x16 blocks at rows r and columns c0 .. c0 + C of a copy with COLS columns (⌈COLS/16⌉
        blocks a row): [R, C // 16]."""
        return (r[:, None].to(tl.int64) * tl.cdiv(COLS, 16) + (c0 // 16 + tl.arange(0, C // 16))[None, :]).to(tl.int32)

    @triton.jit
    def _store_copy(
        v_ptr, c_ptr, s_ptr, val, code, scale, blocks, r, c, ROWS, COLS, CODES: tl.constexpr, C: tl.constexpr
    ):
        """Store a quantized tile at rows r and columns c of a [ROWS, COLS] copy, and its codes and block scales."""
        mask = (r[:, None] < ROWS) & (c[None, :] < COLS)
        offs = r[:, None].to(tl.int64) * COLS + c[None, :]
        tl.store(v_ptr + offs, val.to(tl.bfloat16), mask=mask)
        if CODES:
            tl.store(c_ptr + offs, code, mask=mask)
            first = tl.min(tl.reshape(c, (C // 16, 16)), axis=1)  # each block's first column
            tl.store(s_ptr + blocks, scale, mask=(r[:, None] < ROWS) & (first[None, :] < COLS))

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        h_ptr,
        scales_ptr,
        seed_ptr,
        rv_ptr,
        cv_ptr,
        rc_ptr,
        cc_ptr,
        rs_ptr,
        cs_ptr,
        M,
        MP,
        N,
        ROW: tl.constexpr,
        COL: tl.constexpr,
        RHT: tl.constexpr,
        SR: tl.constexpr,
        CODES: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        x, rm, rn = _tile(x_ptr, M, N, BM, BN)
        seed = tl.load(seed_ptr)
        if ROW:
            blocks = _blocks(rm, tl.program_id(1) * BN, N, BM, BN)
            val, code, scale = _fake_quantize(
                tl.reshape(x.to(tl.float32), (BM, BN // 16, 16)),
                tl.load(scales_ptr),
                tl.load(scales_ptr + 2),
                seed,
                blocks,
                BM,
                BN // 16,
                SR,
            )
            _store_copy(
                rv_ptr,
                rc_ptr,
                rs_ptr,
                tl.reshape(val, (BM, BN)),
                tl.reshape(code, (BM, BN)),
                scale,
                blocks,
                rm,
                rn,
                M,
                N,
                CODES,
                BN,
            )
        if COL:
            blocks = _blocks(rn, tl.program_id(0) * BM, MP, BN, BM)
            val, code, scale = _fake_quantize(
                tl.reshape(_columns(x, h_ptr, RHT, BM, BN), (BN, BM // 16, 16)),
                tl.load(scales_ptr + 1),
                tl.load(scales_ptr + 3),
                seed + 1,
                blocks,
                BN,
                BM // 16,
                SR,
            )
            _store_copy(
                cv_ptr,
                cc_ptr,
                cs_ptr,
                tl.reshape(val, (BN, BM)),
                tl.reshape(code, (BN, BM)),
                scale,
                blocks,
                rn,
                rm,
                N,
                MP,
                CODES,
                BM,
            )

    @triton.jit
    def _uniform_kernel(seed_ptr, out_ptr, ROWS, COLS, BM: tl.constexpr, BN: tl.constexpr):
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        c = tl.program_id(1) * BN + tl.arange(0, BN)
        u = tl.reshape(
            _draws(tl.load(seed_ptr), _blocks(r, tl.program_id(1) * BN, COLS, BM, BN), BM, BN // 16), (BM, BN)
        )
        mask = (r[:, None] < ROWS) & (c[None, :] < COLS)
        tl.store(out_ptr + r[:, None].to(tl.int64) * COLS + c[None, :], u, mask=mask)

"""Number formats of optimizer states and master weights: 8-bit dynamic quantization, blockwise E4M3, BF16
stochastic rounding.

* **8-bit** (``8bit``): bitsandbytes' blockwise dynamic quantization (Dettmers et al., "8-bit Optimizers via
  Block-wise Quantization", arXiv 2110.02861), as torchao's ``AdamW8bit`` stores its states. Each block of
  :data:`BLOCK` consecutive elements along the last dimension is divided by its absolute maximum
  (``absmax``, at least 1e-12) and each quotient is stored as the index (uint8) of the nearest entry of a
  256-value dynamic map (:func:`dynamic_map`: signed for the first moment, unsigned for the second); a quotient
  exactly halfway between two entries takes the larger. Decoding is ``map[code] * absmax``.
* **FP8** (``fp8``): E4M3 codes with one FP32 scale per block of :data:`BLOCK` along the last dimension,
  lpbench's reference E4M3 quantizer (:func:`lpbench.precision.quantize.quantize_fp8`: encode scale
  448 / block amax, saturating round-to-nearest-even cast, decode scale its reciprocal).
* **BF16 stochastic rounding** (:func:`bf16_stochastic_round`): an FP32 value rounds away from zero to the
  next BF16 value with probability (its lower 16 bits) / 2**16, else towards zero, so its expectation is the
  FP32 value (torchao's ``_fp32_to_bf16_sr``). The 16 random bits per element are an argument, so a seeded
  generator makes the rounding reproducible.

Written here rather than taken from torchao (``torchao.optim``, ``torchao.optim.quant_utils``): torchao is an
optional dependency that neither lpbench's CPU environment nor its GPU image installs, and its low-bit states are
tensor subclasses that torch's optimizer ``load_state_dict`` and distributed checkpointing do not round-trip;
plain code and scale tensors do. The formats are the same (and tested against references written from their
definitions).
"""

from __future__ import annotations

import math

import torch

from lpbench.precision.formats import E4M3
from lpbench.precision.quantize import quantize_fp8

BLOCK = 256  # elements per scale, along the last dimension (torchao's AdamW8bit and AdamWFp8)
MIN_ABSMAX = 1e-12  # an all-zero block divides by this, not by 0
MIN_BLOCKWISE = 4096  # smaller tensors keep FP32 states (bitsandbytes' and torchao's rule)


def blockwise(shape: tuple[int, ...], numel: int | None = None) -> bool:
    """Whether a tensor of (local) ``shape`` (``numel`` elements in all, if sharded) has its fp8/8bit states
    stored blockwise: a matrix of at least :data:`MIN_BLOCKWISE` elements whose last dimension holds whole
    blocks, so that no block spans two rows (or two shards of rows); others keep FP32 states."""
    return (
        len(shape) >= 2
        and (numel if numel is not None else math.prod(shape)) >= MIN_BLOCKWISE
        and shape[-1] % BLOCK == 0
    )


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map``: 256 sorted FP32 values in [-1, 1] (signed) or [0, 1].

    For exponent i = 0 .. 6 the map holds the midpoints of an evenly spaced grid of 0.1 .. 1 (2**i intervals
    signed, 2**(i + 1) unsigned) times 10**(i - 6), with their negatives when signed, then 0 and 1. The grids are
    built in FP32 (``torch.linspace``), the products in Python floats, the map stored in FP32, as bitsandbytes does.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        n = (
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        grid = torch.linspace(0.1, 1, n)
        means = ((grid[:-1] + grid[1:]) / 2.0).tolist()
        data += [10 ** (-(max_exponent_bits - 1) + i) * m for m in means]
        if signed:
            data += [-(10 ** (-(max_exponent_bits - 1) + i)) * m for m in means]
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _thresholds(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 255 midpoints between neighbouring map entries as FP32 thresholds ``t`` and whether each is exact.

    A FP32 quotient x is at or above the exact midpoint m iff x >= t when m is representable (t = m), else iff
    x > t, with t the largest FP32 value below m (no FP32 value lies between)."""
    q = qmap.double()
    mid = (q[:-1] + q[1:]) / 2  # exact: sums of two FP32 values fit FP64
    t = mid.float()
    t = torch.where(t.double() > mid, torch.nextafter(t, torch.full_like(t, -torch.inf)), t)
    return t, t.double() == mid


QMAP_SIGNED = dynamic_map(signed=True)
QMAP_UNSIGNED = dynamic_map(signed=False)
_TABLES: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(map, thresholds, exact) of the signed or unsigned map on ``device``, copied there once."""
    key = (signed, device)
    if key not in _TABLES:
        qmap = QMAP_SIGNED if signed else QMAP_UNSIGNED
        _TABLES[key] = tuple(t.to(device) for t in (qmap, *_thresholds(qmap)))
    return _TABLES[key]


def blocks_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last dimension a multiple of :data:`BLOCK`) as rows of one block each."""
    return x.reshape(-1, BLOCK)


def quantize_8bit(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes of ``x``'s shape, FP32 absmax per block of shape ``x.shape[:-1] + (cols / BLOCK,)``)."""
    x = x.float()
    rows = blocks_of(x)
    absmax = rows.abs().amax(dim=1).clamp(min=MIN_ABSMAX)
    normed = rows / absmax[:, None]
    _, t, exact = tables(signed, x.device)
    below = torch.searchsorted(t, normed, side="left", out_int32=True)  # thresholds strictly below
    at = t[below.clamp(max=t.numel() - 1)] == normed
    codes = below + (at & exact[below.clamp(max=t.numel() - 1)] & (below < t.numel())).int()
    return codes.to(torch.uint8).reshape(x.shape), absmax.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def dequantize_8bit(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """FP32 values: ``map[code] * absmax`` of the code's block."""
    qmap = tables(signed, codes.device)[0]
    rows = qmap[blocks_of(codes).int()] * absmax.reshape(-1, 1)
    return rows.reshape(codes.shape)


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes of ``x``'s shape, FP32 decode scale per block, shaped as :func:`quantize_8bit`'s)."""
    q = quantize_fp8(blocks_of(x), E4M3, block=(1, BLOCK))
    return q.codes.reshape(x.shape), q.scale.reshape(*x.shape[:-1], x.shape[-1] // BLOCK)


def dequantize_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 values: code × decode scale of its block."""
    return (blocks_of(codes).float() * scale.reshape(-1, 1)).reshape(codes.shape)


def random_bits(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """16 uniformly random bits per element (int32 in [0, 2**16)) from ``generator``."""
    return torch.randint(0, 1 << 16, shape, generator=generator, device=device, dtype=torch.int32)


def bf16_stochastic_round(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (FP32) rounded to BF16: away from zero where ``bits`` (int32 in [0, 2**16), x's shape) is below x's
    lower 16 bits, else towards zero (truncated); exact values stay. Infinities and NaNs are cast as they are."""
    x = x.float()
    word = x.view(torch.int32)
    truncated = word & -65536  # 0xFFFF0000: the upper 16 bits
    rounded = torch.where(bits < (word & 0xFFFF), truncated + 65536, truncated).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)

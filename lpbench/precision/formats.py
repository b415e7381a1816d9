"""Low-precision number formats: E4M3, E5M2 and E2M1 elements, E8M0 scales.

Hand-written from each format's definition (OCP FP8, OCP MX v1.0) instead of relying on
torch's casts, whose overflow and NaN behaviour differs across versions and devices: here
rounding (nearest-even or stochastic) and saturation are computed exactly in FP32, and
torch's float8 dtypes only *store* values that are already representable.

NaN / Inf policy (tested):

* every cast saturates: finite values beyond the format's max and ±Inf become ±max;
* NaN stays NaN in E4M3, E5M2 and E8M0 (0xFF);
* E2M1 has no NaN: NaN encodes as +0. The quantizers never rely on this: a block holding
  NaN or Inf gets a NaN scale, so the whole block dequantizes to NaN (see quantize.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A sign/exponent/mantissa format with IEEE-style bias and subnormals."""

    name: str
    ebits: int
    mbits: int
    max: float  # largest finite value
    dtype: torch.dtype | None  # torch storage dtype; None: 4-bit codes in uint8

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal (subnormals share it)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal (``emax_elem`` of OCP MX)."""
        return math.floor(math.log2(self.max))


E4M3 = FloatFormat("e4m3", 4, 3, 448.0, torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, 57344.0, torch.float8_e5m2)
E2M1 = FloatFormat("e2m1", 2, 1, 6.0, None)
FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 = sign
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact FP32 2**k for integer k in [-149, 127], built from the bit pattern."""
    k = k.to(torch.int32)
    normal = (k + 127) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def round_to_format(
    x: torch.Tensor,
    fmt: FloatFormat,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round to the nearest value of ``fmt`` (ties to even), saturating at ±max; FP32 result.

    With ``stochastic=True`` rounds up with probability equal to the distance from the lower
    neighbour over the gap, so the result is unbiased and always one of the two neighbours
    (values beyond max still saturate). The uniform [0, 1) draws come from ``generator``, or
    are ``noise`` (x's shape) when given.
    """
    if fmt.dtype is not None and not stochastic:
        return encode(x, fmt).float()
    x = x.float()
    a = x.abs().clamp(max=fmt.max)  # saturate; NaN stays NaN
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    # ulp = 2**k with k >= emin - mbits >= -16: a normal FP32 power of two, built from its bits.
    ulp = ((((e - 1).clamp(min=fmt.emin) - fmt.mbits) + 127) << 23).view(torch.float32)
    v = a / ulp  # exact: ulp is a power of two
    if stochastic:
        lo = v.floor()
        u = torch.rand(v.shape, generator=generator, device=v.device) if noise is None else noise
        r = lo + (u < v - lo).float()
    else:
        r = torch.round(v)  # half to even
    return torch.copysign(r * ulp, x)


def encode(
    x: torch.Tensor,
    fmt: FloatFormat,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Saturating cast to ``fmt``: a float8 tensor, or uint8 E2M1 codes (sign in bit 3)."""
    if fmt.dtype is not None and not stochastic:
        # torch's FP32 -> float8 cast rounds to nearest even on finite values; saturating first
        # makes it exact for every input (the tests check it against the definition).
        return x.float().clamp(-fmt.max, fmt.max).to(fmt.dtype)
    r = round_to_format(x, fmt, stochastic=stochastic, generator=generator, noise=noise)
    if fmt.dtype is not None:
        return r.to(fmt.dtype)  # exact: r is representable
    # index of |r| in E2M1_VALUES by arithmetic (elementwise, so torch.compile fuses it)
    a = r.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a * 0.5 + 4))
    code = idx.to(torch.uint8) + 8 * torch.signbit(r).to(torch.uint8)
    return torch.where(torch.isnan(r), 0, code).to(torch.uint8)


def decode(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Exact FP32 values of ``fmt`` codes (float8 tensor or uint8 E2M1 codes)."""
    if fmt.dtype is not None:
        return codes.float()
    mag = (codes & 7).float()  # E2M1_VALUES[mag] by arithmetic
    v = torch.where(mag < 4, mag * 0.5, torch.where(mag < 6, mag - 2, mag * 2 - 8))
    return torch.where(codes >= 8, -v, v)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte, first element in the low nibble (torch.float4_e2m1fn_x2 layout)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}")
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: uint8 codes, last dimension doubled."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def e8m0_from_exponent(k: torch.Tensor) -> torch.Tensor:
    """E8M0 scale 2**k (k clamped to [-127, 127]); NaN in ``k`` gives the NaN code 0xFF."""
    k = k.float()
    biased = (k.nan_to_num(0.0).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return biased.masked_fill(torch.isnan(k), E8M0_NAN).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Exact FP32 value of E8M0 codes: 2**(code - 127), NaN for 0xFF."""
    c = scale.view(torch.uint8).to(torch.int32)
    return pow2(c - E8M0_BIAS).masked_fill(c == E8M0_NAN, float("nan"))

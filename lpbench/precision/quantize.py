"""Reference quantizers: the exact scale rule of every recipe, on any device.

Hand-written rather than borrowed from Transformer Engine or torchao so that each scale rule
is visible in one place, runs on CPU, and is bit-exact with its definition; fast kernels are
tested against these functions.

Conventions:

* quantizers take a 2-D tensor and scale blocks of ``(rows, cols)`` elements; ``None`` in a
  block means the whole dimension (``(None, None)`` tensorwise, ``(1, None)`` rowwise).
  A shape that the block does not divide raises ``ValueError``.
* a :class:`QTensor` stores *decode* scales: value = code × block scale [× global scale].
* amax == 0 gives zeros. A scaling group (tensor, row or block) whose amax is NaN or Inf
  gets a NaN scale, so all of it dequantizes to NaN and a NaN guard sees it.
* a tensor split across ranks (tensor parallelism) is quantized as the whole tensor would be:
  ``amax_group`` all-reduces (MAX) the amaxes of scaling groups that span the split, and
  ``noise`` supplies stochastic rounding's uniform draws for this rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from lpbench.precision.formats import (
    E2M1,
    E4M3,
    FloatFormat,
    decode,
    e8m0_from_exponent,
    e8m0_to_float,
    encode,
    pow2,
)

FP32_MAX = torch.finfo(torch.float32).max
RHT_SIZE = 16
RHT_SEED = 1234  # fixed: the same sign vector on every rank and every step
Block = tuple[int | None, int | None]


@dataclass(frozen=True)
class QTensor:
    """A quantized 2-D tensor: codes, one decode scale per block, optional FP32 global scale."""

    codes: torch.Tensor  # float8 tensor, or uint8 E2M1 codes (one per element)
    scale: torch.Tensor  # [rows // block[0], cols // block[1]]: float32, float8_e8m0fnu or float8_e4m3fn
    block: tuple[int, int]
    fmt: FloatFormat
    global_scale: torch.Tensor | None = None  # FP32 scalar (NVFP4)

    def values(self) -> torch.Tensor:
        """The element values before scaling (FP32, exact)."""
        return decode(self.codes, self.fmt)

    def block_scales(self) -> torch.Tensor:
        """The decode scale of every element (FP32, the shape of ``codes``)."""
        return _expand(scale_to_float(self.scale), self.block)

    def t(self) -> QTensor:
        """The transpose, codes contiguous: what quantizing the transposed tensor gives when the blocks
        are square (or the whole tensor) and rounding is to nearest."""
        return QTensor(self.codes.t().contiguous(), self.scale.t().contiguous(), self.block[::-1], self.fmt,
                       self.global_scale)

    def dequantize(self) -> torch.Tensor:
        """FP32 value: code × block scale (exact for power-of-two and E4M3 scales) × global scale."""
        out = self.values() * self.block_scales()
        return out if self.global_scale is None else out * self.global_scale


@dataclass(frozen=True)
class QSpec:
    """How one GEMM operand is quantized along its last dimension (derived from a Recipe)."""

    scaling: str  # "tensor" | "row" | "block" | "mx" | "nvfp4"
    fmt: FloatFormat
    block: Block = (None, None)
    pow2: bool = False  # FP32 scales rounded down to a power of two (tensor/row/block)
    mx_rounding: str = "rceil"  # "rceil" | "floor" (mx)
    stochastic: bool = False  # stochastic rounding of the elements


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    return e8m0_to_float(scale) if scale.dtype == torch.float8_e8m0fnu else scale.float()


def _resolve(x: torch.Tensor, block: Block) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"quantizers take 2-D tensors, got shape {tuple(x.shape)}")
    br, bc = (d if b is None else b for b, d in zip(block, x.shape))
    if x.shape[0] % br or x.shape[1] % bc:
        raise ValueError(f"shape {tuple(x.shape)} is not divisible by the {br}x{bc} quantization block")
    return br, bc


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Elementwise max of ``t`` over ``group`` (``t`` itself without one); traceable by torch.compile."""
    return t if group is None else funcol.wait_tensor(funcol.all_reduce(t, "max", group))


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    (m, k), (br, bc) = x.shape, block
    return x.abs().reshape(m // br, br, k // bc, bc).amax(dim=(1, 3))


def _expand(s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block values to per-element values (shape [rows, cols])."""
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def _floor_pow2(s: torch.Tensor) -> torch.Tensor:
    """Round positive FP32 values down to a power of two (zero the mantissa, as TE does)."""
    _, e = torch.frexp(s)
    return pow2(e - 1)


def _div(numerator: torch.Tensor | float, denominator: torch.Tensor | float) -> torch.Tensor:
    """FP32 numerator / denominator, correctly rounded, on every device, eager or compiled.

    Divided in FP64 and rounded once to FP32, which equals the correctly rounded FP32 quotient of
    FP32 operands (FP64 carries more than 2·24 + 2 bits). A plain ``/`` is not the definition:
    torch evaluates ``scalar / tensor`` (and, on CUDA, ``tensor / scalar``) through a reciprocal
    (two roundings), and compiled Triton code may divide approximately.
    """
    like = numerator if isinstance(numerator, torch.Tensor) else denominator
    n, d = (v.double() if isinstance(v, torch.Tensor) else torch.full_like(like, v, dtype=torch.float64)
            for v in (numerator, denominator))
    return (n / d).float()


def _poison(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return scale.masked_fill(~torch.isfinite(amax), float("nan"))


def fp8_decode_scale(encode_scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """1 / ``encode_scale`` (correctly rounded), NaN where the group's ``amax`` is not finite."""
    return _poison(_div(1.0, encode_scale), amax)


def fp8_encode_scale(amax: torch.Tensor, fmt: FloatFormat, *, pow2: bool = False) -> torch.Tensor:
    """``fmt.max / amax`` in FP32 (1 where amax is 0; capped at the FP32 max for tiny amax)."""
    s = torch.where(amax > 0, _div(fmt.max, amax), torch.ones_like(amax)).clamp(max=FP32_MAX)
    return _floor_pow2(s) if pow2 else s


def quantize_fp8(
    x: torch.Tensor,
    fmt: FloatFormat = E4M3,
    block: Block = (None, None),
    *,
    pow2: bool = False,
    encode_scale: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> QTensor:
    """FP8 with FP32 scales: tensorwise, rowwise ``(1, None)`` or blockwise ``(1, 128)`` / ``(128, 128)``.

    Encode scale per block = FP8_MAX / amax (rounded down to a power of two with ``pow2``:
    DeepSeek-V3, TE Float8BlockScaling, torchao rowwise); codes = saturating cast of x × scale;
    decode scale = 1 / encode scale. ``encode_scale`` overrides the current-amax rule
    (delayed scaling). ``amax_group``: the block amaxes are all-reduced (MAX) over it first.
    """
    x = x.float().contiguous()
    blk = _resolve(x, block)
    amax = _block_amax(x, blk)
    if encode_scale is None:
        amax = all_reduce_max(amax, amax_group)
    enc = fp8_encode_scale(amax, fmt, pow2=pow2) if encode_scale is None else encode_scale.float().expand_as(amax)
    codes = encode(x * _expand(enc, blk), fmt, stochastic=stochastic, generator=generator, noise=noise)
    return QTensor(codes, fp8_decode_scale(enc, amax), blk, fmt)


def delayed_encode_scale(
    history: torch.Tensor, amax: torch.Tensor, fmt: FloatFormat, margin: int = 0
) -> torch.Tensor:
    """Delayed scaling: FP8_MAX / max(history) / 2**margin (TE DelayedScaling, algo "max").

    Before any amax has been recorded (all zeros) the current ``amax`` stands in.
    """
    ref = history.max()
    ref = torch.where(ref > 0, ref, amax.float())
    return fp8_encode_scale(ref, fmt) / 2**margin


def update_amax_history(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Record ``amax`` at index 0 of ``history`` (in place; the oldest entry drops out).

    A non-finite amax is recorded as 0 so one bad step does not poison 1024 scales.
    """
    amax = amax.float()
    history.copy_(torch.roll(history, 1))
    history[0] = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2 v) for positive FP32 v (round v up to a power of two)."""
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, e - 1, e)


def quantize_mx(
    x: torch.Tensor,
    fmt: FloatFormat = E4M3,
    *,
    block: int = 32,
    rounding: str = "rceil",
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> QTensor:
    """OCP MX: 1 × ``block`` blocks along the last dim, E8M0 scale 2**k per block.

    ``rceil`` (default; cuBLAS / TE / torchao RCEIL): k = ceil(log2(amax / fmt.max)), so no
    element saturates. ``floor`` (OCP MX v1.0): k = floor(log2 amax) - emax_elem (8 for
    E4M3, 2 for E2M1); elements beyond max saturate. k is clamped to [-127, 127].
    """
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"unknown MX scale rounding {rounding!r}; valid: rceil, floor")
    x = x.float().contiguous()
    blk = _resolve(x, (1, block))
    amax = _block_amax(x, blk)
    if rounding == "rceil":
        k = _ceil_log2(_div(amax, fmt.max))
    else:
        k = torch.frexp(amax)[1] - 1 - fmt.emax
    k = torch.where(amax > 0, k, -127).clamp(-127, 127)
    codes = encode(x * _expand(pow2(-k), blk), fmt, stochastic=stochastic, generator=generator, noise=noise)
    scale = e8m0_from_exponent(_poison(k.float(), amax))
    return QTensor(codes, scale, blk, fmt)


def nvfp4_global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's FP32 scales from the tensor amax: (factor taking a block amax to its E4M3 scale, global
    decode scale). Global encode scale = 6·448 / amax (1 for amax 0, capped at the FP32 max), the
    factor is it times fp32(1/6) (TE's order); global decode scale = amax / (6·448)."""
    top = E4M3.max * E2M1.max
    g_enc = torch.where(amax > 0, _div(top, amax), torch.ones_like(amax)).clamp(max=FP32_MAX)
    g_dec = torch.where(amax > 0, _div(amax, top), torch.ones_like(amax))
    return g_enc * torch.tensor(1 / E2M1.max), g_dec


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block: Block = (1, 16),
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> QTensor:
    """NVFP4: E2M1 elements, E4M3 scale per 1×16 (or 16×16 weight) block, FP32 global scale.

    global decode scale = amax / (6·448); per-block E4M3 scale = block_amax / 6 over the
    global scale, computed as block_amax × (global encode scale × fp32(1/6)) in TE's order.
    ``amax_group``: the global amax is all-reduced (MAX) over it first.
    """
    x = x.float().contiguous()
    blk = _resolve(x, block)
    amax = all_reduce_max(x.abs().amax(), amax_group)
    block_enc, g_dec = nvfp4_global_scales(amax)
    scale = encode(_block_amax(x, blk) * block_enc, E4M3)
    enc = _div(1.0, scale.float() * g_dec).clamp(max=FP32_MAX)
    codes = encode(x * _expand(enc, blk), E2M1, stochastic=stochastic, generator=generator, noise=noise)
    return QTensor(codes, scale, blk, E2M1, global_scale=_poison(g_dec, amax))


def quantize(x: torch.Tensor, spec: QSpec, *, encode_scale=None, generator=None, noise=None,
             amax_group=None) -> QTensor:
    """Quantize a 2-D tensor as ``spec`` says (``encode_scale``: delayed FP8 scaling only).

    ``amax_group`` (FP8 and NVFP4 scalings; MX blocks never need it): all-reduce the amaxes
    over it, for a tensor split across its ranks along a dim that a scaling group spans.
    """
    sr = {"stochastic": spec.stochastic, "generator": generator, "noise": noise}
    if spec.scaling in ("tensor", "row", "block"):
        return quantize_fp8(x, spec.fmt, spec.block, pow2=spec.pow2, encode_scale=encode_scale,
                            amax_group=amax_group, **sr)
    if spec.scaling == "mx":
        return quantize_mx(x, spec.fmt, block=spec.block[1], rounding=spec.mx_rounding, **sr)
    if spec.scaling == "nvfp4":
        return quantize_nvfp4(x, block=spec.block, amax_group=amax_group, **sr)
    raise ValueError(f"unknown scaling {spec.scaling!r}")


def hadamard(n: int = RHT_SIZE) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix (orthogonal, entries ±1/sqrt(n)); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rht_matrix(n: int = RHT_SIZE, seed: int = RHT_SEED) -> torch.Tensor:
    """diag(s) · H with a fixed random sign vector s drawn from ``seed`` (orthogonal)."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs.float()[:, None] * hadamard(n)


def apply_rht(x: torch.Tensor, n: int = RHT_SIZE, seed: int = RHT_SEED) -> torch.Tensor:
    """Random Hadamard transform of every chunk of ``n`` along the last dim (FP32 result).

    Applied to both operands of a GEMM along its reduction dim it leaves the product
    unchanged: (A·R)(B·R)ᵀ = A·R·Rᵀ·Bᵀ = A·Bᵀ.

    A BF16 tensor on CUDA is multiplied on the tensor cores with FP32 output: its products with
    the ±1/sqrt(16) entries are exact and accumulate in FP32, so this equals the FP32 matmul up
    to summation order, at a third of its cost (a 16-wide FP32 matmul runs on CUDA cores;
    benchmarks/rht.py). Everything else takes the FP32 matmul.
    """
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the Hadamard size {n}")
    m = (_RHT if (n, seed) == (RHT_SIZE, RHT_SEED) else rht_matrix(n, seed)).to(x.device)
    rows = x.reshape(-1, n)
    if x.is_cuda and x.dtype == torch.bfloat16 and n == RHT_SIZE:  # ±1/4: exact in BF16
        return torch.mm(rows, m.bfloat16(), out_dtype=torch.float32).reshape(x.shape)
    return (rows.float() @ m).reshape(x.shape)


_RHT = rht_matrix()  # built once: torch.compile cannot trace a torch.Generator

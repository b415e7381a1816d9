"""Reference quantizers: the exact scale rule of every recipe, on any device.

Hand-written rather than borrowed from Transformer Engine or torchao so that each scale rule
is visible in one place, runs on CPU, and is bit-exact with its definition; fast kernels are
tested against these functions.

Conventions:

* quantizers take a 2-D tensor and scale blocks of ``(rows, cols)`` elements; ``None`` in a
  block means the whole dimension (``(None, None)`` tensorwise, ``(1, None)`` rowwise).
  NVFP4 zero-pads a shape that its block does not divide (as Transformer Engine does: a
  partial block is scaled by the amax of its own elements; codes keep the tensor's shape, scales
  the padded one's); the other block scalings raise ``ValueError`` on such a shape.
* a :class:`QTensor` stores *decode* scales: value = code × block scale [× global scale].
* amax == 0 gives zeros. A scaling group (tensor, row or block) whose amax is NaN or Inf
  gets a NaN scale, so all of it dequantizes to NaN and a NaN guard sees it.
* a tensor split across ranks (tensor or context parallelism) is quantized as the whole tensor would be:
  ``amax_group`` (a group, or a tuple of groups) all-reduces (MAX) the amaxes of scaling groups that span
  the split, and
  ``noise`` supplies stochastic rounding's uniform draws for this rank's part.

NVFP4 follows Transformer Engine's arithmetic (``NVFP4BlockScaling``: its CUDA quantizers and
its reference ``NVFP4QuantizerRef``) operation by operation, all in FP32 with round-to-nearest-even:

* global encode scale S = min(6·448 / amax, FP32 max), and S = 1 where amax is 0 or S is 0
  (amax Inf); global decode scale = 1 / S (correctly rounded), *not* amax / (6·448): the two
  differ by an ulp for about a quarter of amaxes, which flips E2M1 ties;
* block decode scale = E4M3(block_amax × (S × fp32(1/6))), saturating at 448;
* block encode scale = min(1 / (block decode scale × global decode scale), FP32 max);
* code = E2M1(x × block encode scale), saturating at ±6.
* random Hadamard transform (:func:`apply_rht`): diag(signs) · H16 / 4 with TE's fixed sign
  vector by default. A BF16 tensor's transform is rounded to BF16 (its FP32 sum, then
  round-to-nearest-even), and that BF16 tensor is what the amax and the quantizer see, as in
  TE's kernels (the Hadamard kernel's amax and the fused RHT-cast kernel both round the FP32
  tensor-core sums to BF16). An FP32 tensor's transform stays FP32 (TE takes only BF16).

Remaining choices, where TE's implementations disagree with each other or are undefined:

* −0.0: a negative value that rounds to zero gets code 8 (−0), as ``cvt.rn.satfinite.e2m1``
  keeps the sign; TE's Python reference gives code 0 for an input of exactly −0.0. Both decode
  to zero, so products and sums are unaffected.
* amax below 2688 / FP32 max (≈ 7.9e−36): S is capped at the FP32 max, so block scales use less
  than E4M3's range (the global decode scale is then 1 / FP32 max, subnormal); TE caps alike.
* NaN or Inf anywhere: our NaN policy above (global decode scale NaN), where TE would keep
  S = 1 (Inf) or the FP32 max (NaN, through ``fminf``) and quantize the finite elements.
* stochastic rounding draws uniforms (``noise`` / ``generator``) and rounds up with probability
  equal to the fraction; TE's ``cvt.rs`` adds Philox bits to the truncated mantissa. Both are
  unbiased; the draws themselves cannot match TE's.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
# Transformer Engine's fixed random signs for the wgrad Hadamard transform (the NVFP4 recipe's default)
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
Block = tuple[int | None, int | None]


class Scaling(str, Enum):
    """How a recipe scales its quantized operands. A ``str``: recipes, rows and reports hold the value."""

    TENSOR = "tensor"  # one FP32 scale per tensor from its current amax
    DELAYED = "delayed"  # one FP32 scale per tensor from an amax history (an operand's QSpec says TENSOR)
    ROW = "row"  # one FP32 scale per row along the reduction dim
    BLOCK = "block"  # one FP32 scale per block (1 x N, or N x N weight tiles)
    MX = "mx"  # E8M0 scales of 1 x 32 blocks (OCP MX)
    NVFP4 = "nvfp4"  # E4M3 scales of 1 x 16 blocks and an FP32 global scale

    def __str__(self) -> str:
        return self.value

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (tensor or delayed): what FSDP's FP8 all-gather and the fused FP8 linear serve."""
        return self in (Scaling.TENSOR, Scaling.DELAYED)


@dataclass(frozen=True)
class QTensor:
    """A quantized 2-D tensor: codes, one decode scale per block, optional FP32 global scale."""

    codes: torch.Tensor  # float8 tensor, or uint8 E2M1 codes (one per element)
    scale: torch.Tensor  # [⌈rows / block[0]⌉, ⌈cols / block[1]⌉]: float32, float8_e8m0fnu or float8_e4m3fn
    block: tuple[int, int]
    fmt: FloatFormat
    global_scale: torch.Tensor | None = None  # FP32 scalar (NVFP4)

    def values(self) -> torch.Tensor:
        """The element values before scaling (FP32, exact)."""
        return decode(self.codes, self.fmt)

    def block_scales(self) -> torch.Tensor:
        """The decode scale of every element (FP32, the shape of ``codes``)."""
        return _expand(scale_to_float(self.scale), self.block, self.codes.shape)

    def t(self) -> QTensor:
        """The transpose, codes contiguous: what quantizing the transposed tensor gives when the blocks
        are square (or the whole tensor) and rounding is to nearest."""
        return QTensor(
            self.codes.t().contiguous(), self.scale.t().contiguous(), self.block[::-1], self.fmt, self.global_scale
        )

    def dequantize(self) -> torch.Tensor:
        """FP32 value: code × block scale (exact for power-of-two and E4M3 scales) × global scale."""
        out = self.values() * self.block_scales()
        return out if self.global_scale is None else out * self.global_scale


@dataclass(frozen=True)
class QSpec:
    """How one GEMM operand is quantized along its last dimension (derived from a Recipe)."""

    scaling: Scaling  # never DELAYED: a delayed operand is TENSOR with an encode scale given
    fmt: FloatFormat
    block: Block = (None, None)
    pow2: bool = False  # FP32 scales rounded down to a power of two (tensor/row/block)
    mx_rounding: str = "rceil"  # "rceil" | "floor" (mx)
    stochastic: bool = False  # stochastic rounding of the elements


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    return e8m0_to_float(scale) if scale.dtype == torch.float8_e8m0fnu else scale.float()


def _resolve(x: torch.Tensor, block: Block, *, pad: bool = False) -> tuple[int, int]:
    """The block's (rows, cols) for ``x``; a shape it does not divide raises unless ``pad``."""
    if x.dim() != 2:
        raise ValueError(f"quantizers take 2-D tensors, got shape {tuple(x.shape)}")
    br, bc = (d if b is None else b for b, d in zip(block, x.shape))
    if not pad and (x.shape[0] % br or x.shape[1] % bc):
        raise ValueError(f"shape {tuple(x.shape)} is not divisible by the {br}x{bc} quantization block")
    return br, bc


def _pad(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` zero-padded at the end of each dim to a multiple of the block (itself if it divides)."""
    rows, cols = -x.shape[0] % block[0], -x.shape[1] % block[1]
    return F.pad(x, (0, cols, 0, rows)) if rows or cols else x


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | tuple | None) -> torch.Tensor:
    """Elementwise max of ``t`` over ``group`` (``t`` itself without one; a tuple of groups, None among them
    skipped: over each in turn, the max over their product); traceable by torch.compile."""
    for g in group if isinstance(group, tuple) else (group,):
        if g is not None:
            t = funcol.wait_tensor(funcol.all_reduce(t, "max", g))
    return t


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    (m, k), (br, bc) = x.shape, block
    return x.abs().reshape(m // br, br, k // bc, bc).amax(dim=(1, 3))


def _times_blocks(x: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x * _expand(s, block)`` without the per-element copy of ``s`` (broadcast over each block)."""
    (m, k), (br, bc) = x.shape, block
    return (x.reshape(m // br, br, k // bc, bc) * s[:, None, :, None]).reshape(m, k)


def _expand(s: torch.Tensor, block: tuple[int, int], shape: torch.Size | None = None) -> torch.Tensor:
    """Per-block values to per-element values (shape [rows, cols]; cut to ``shape`` if given)."""
    out = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return out if shape is None else out[: shape[0], : shape[1]]


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
    n, d = (
        v.double() if isinstance(v, torch.Tensor) else torch.full_like(like, v, dtype=torch.float64)
        for v in (numerator, denominator)
    )
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
    amax_group: dist.ProcessGroup | tuple | None = None,
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
    scaled = _times_blocks(x, enc, blk)
    del x  # an FP32 copy of a 16-bit input: freed before the cast's own copies (a frozen weight's build peak)
    codes = encode(scaled, fmt, stochastic=stochastic, generator=generator, noise=noise)
    return QTensor(codes, fp8_decode_scale(enc, amax), blk, fmt)


def delayed_scaled_max(fmt: FloatFormat, margin: int = 0) -> float:
    """Delayed scaling's target: FP8_MAX × 2**-margin (exact in FP32)."""
    return fmt.max * 2.0**-margin


def delayed_update(
    history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, scaled_max: float, algo: str = "max"
) -> None:
    """Record ``amax`` and recompute the encode ``scale`` from ``history`` (both in place), by Transformer
    Engine's DelayedScaling rule (its default, fused update: ``amax_and_scale_update_after_reduction``;
    its unfused Python update, for custom algorithms, records a zero amax too):

    * amax == 0 records nothing and keeps the scale (a tensor of zeros says nothing about the range);
    * otherwise amax enters ``history`` at index 0 (the oldest entry drops out; NaN and Inf are kept);
    * the reference amax is the max over the history ("max", NaN entries ignored as ``fmaxf`` does) or
      the recorded amax ("most_recent");
    * scale = ``scaled_max`` (:func:`delayed_scaled_max`: FP8_MAX·2**-margin) / reference, correctly
      rounded in FP32, kept at its previous value where the reference is 0 or not finite, and the FP32
      max where the quotient overflows.

    The scale a cast uses is the one this update left the step before; it starts at 1.0.
    """
    amax = amax.float().reshape(())
    recorded = amax != 0
    history.copy_(torch.where(recorded, torch.cat([amax.reshape(1), history[:-1]]), history))
    if algo == "max":
        ref = torch.where(torch.isnan(history), torch.zeros_like(history), history).max()
        ref = torch.where(recorded, ref, torch.zeros_like(ref))
    else:
        ref = amax
    new = _div(scaled_max, ref)
    new = torch.where(torch.isfinite(ref) & (ref > 0), new, scale.reshape(()))
    scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, FP32_MAX), new).reshape(scale.shape))


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
    """NVFP4's FP32 scales from the tensor amax, in Transformer Engine's arithmetic: (factor taking a
    block amax to its E4M3 scale, global decode scale).

    Global encode scale S = min(6·448 / amax, FP32 max), 1 where amax is 0 or S is 0; the factor is
    S × fp32(1/6) and the global decode scale is the FP32 reciprocal 1 / S, both rounded once.
    """
    s = _div(E4M3.max * E2M1.max, amax).clamp(max=FP32_MAX)
    s = torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)
    return s * torch.tensor(1 / E2M1.max), _div(1.0, s)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block: Block = (1, 16),
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | tuple | None = None,
) -> QTensor:
    """NVFP4: E2M1 elements, E4M3 scale per 1×16 (or 16×16 weight) block, FP32 global scale.

    TE's arithmetic (module docstring): global decode scale = 1 / S with S = 6·448 / amax; block
    scale = E4M3(block_amax × S × fp32(1/6)); code = E2M1(x / (block scale × global decode scale)).
    A shape the block does not divide is zero-padded (``noise``: x's shape). ``amax_group``: the
    global amax is all-reduced (MAX) over it first.
    """
    x = x.float().contiguous()
    blk = _resolve(x, block, pad=True)
    xp = _pad(x, blk)
    amax = all_reduce_max(x.abs().amax(), amax_group)
    block_enc, g_dec = nvfp4_global_scales(amax)
    scale = encode(_block_amax(xp, blk) * block_enc, E4M3)
    enc = _div(1.0, scale.float() * g_dec).clamp(max=FP32_MAX)
    noise = None if noise is None else _pad(noise, blk)
    codes = encode(xp * _expand(enc, blk), E2M1, stochastic=stochastic, generator=generator, noise=noise)
    return QTensor(codes[: x.shape[0], : x.shape[1]].contiguous(), scale, blk, E2M1, global_scale=_poison(g_dec, amax))


def quantize(
    x: torch.Tensor, spec: QSpec, *, encode_scale=None, generator=None, noise=None, amax_group=None
) -> QTensor:
    """Quantize a 2-D tensor as ``spec`` says (``encode_scale``: delayed FP8 scaling only).

    ``amax_group`` (FP8 and NVFP4 scalings; MX blocks never need it): all-reduce the amaxes
    over it, for a tensor split across its ranks along a dim that a scaling group spans.
    """
    sr = {"stochastic": spec.stochastic, "generator": generator, "noise": noise}
    if spec.scaling in (Scaling.TENSOR, Scaling.ROW, Scaling.BLOCK):
        return quantize_fp8(
            x, spec.fmt, spec.block, pow2=spec.pow2, encode_scale=encode_scale, amax_group=amax_group, **sr
        )
    if spec.scaling is Scaling.MX:
        return quantize_mx(x, spec.fmt, block=spec.block[1], rounding=spec.mx_rounding, **sr)
    if spec.scaling is Scaling.NVFP4:
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


def rht_matrix(signs: tuple[int, ...] = TE_RHT_SIGNS) -> torch.Tensor:
    """diag(signs) · H / sqrt(n), n = len(signs) (orthogonal; FP32, entries exact in BF16 for n = 16)."""
    if any(v not in (1, -1) for v in signs):
        raise ValueError(f"Hadamard signs must be +1 or -1, got {signs}")
    return torch.tensor(signs, dtype=torch.float32)[:, None] * hadamard(len(signs))


def apply_rht(x: torch.Tensor, signs: tuple[int, ...] = TE_RHT_SIGNS) -> torch.Tensor:
    """Random Hadamard transform of every chunk of ``len(signs)`` along the last dim.

    Applied to both operands of a GEMM along its reduction dim it leaves the product
    unchanged: (A·R)(B·R)ᵀ = A·R·Rᵀ·Bᵀ = A·Bᵀ.

    A BF16 tensor gives BF16, as in Transformer Engine: each 16-term sum in FP32, rounded to
    nearest-even BF16. On CUDA the FP32 sums come from the tensor cores (BF16 products with the
    ±1/4 entries are exact; a third of an FP32 matmul's cost, benchmarks/rht.py), elsewhere from an
    FP64 matmul rounded to FP32 (the exact sum correctly rounded, in every order alike). Any other
    dtype gives the FP32 matmul.
    """
    n = len(signs)
    if x.shape[-1] % n:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the Hadamard size {n}")
    m = (_RHT if signs == TE_RHT_SIGNS else rht_matrix(signs)).to(x.device)
    rows = x.reshape(-1, n)
    if x.dtype != torch.bfloat16:
        return (rows.float() @ m).reshape(x.shape)
    if x.is_cuda and n == RHT_SIZE:  # ±1/4: exact in BF16
        sums = torch.mm(rows, m.bfloat16(), out_dtype=torch.float32)
    else:
        sums = (rows.double() @ m.double()).float()
    return sums.bfloat16().reshape(x.shape)


_RHT = rht_matrix()  # built once: the default, moved to the device per call

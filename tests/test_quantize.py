"""Quantizers: the exact scale rule of each recipe, NaN/zero handling, shapes, RHT."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lpbench.precision import RECIPES, ROLES, quant_error_table, quantize_dequantize, sample_tensor
from lpbench.precision.formats import E2M1, E4M3, E5M2, decode, e8m0_to_float, encode
from lpbench.precision.quantize import (
    QTensor,
    apply_rht,
    delayed_scaled_max,
    delayed_update,
    hadamard,
    quantize,
    quantize_fp8,
    quantize_mx,
    quantize_nvfp4,
    rht_matrix,
)


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def is_pow2(t):
    m, _ = torch.frexp(t)
    return bool((m == 0.5).all())


def all_specs():
    for r in RECIPES.values():
        for role in ROLES:
            for gemm in ("fprop", "dgrad", "wgrad"):
                spec = r.operand(role, gemm)
                if spec is not None:
                    yield f"{r.name}-{role}-{gemm}", spec


SPECS = dict(all_specs())


def test_tensorwise_current_scaling():
    x = randn(64, 96, scale=3.0)
    q = quantize_fp8(x, E4M3)
    amax = x.abs().max()
    enc = torch.tensor(448.0) / amax
    assert q.scale.shape == (1, 1) and q.block == (64, 96)
    assert q.scale.item() == (1 / enc).item()
    assert torch.equal(q.codes, encode(x * enc, E4M3))
    assert q.values().abs().max().item() == 448.0  # the amax element lands on FP8_MAX
    assert torch.allclose(q.dequantize(), x, rtol=2**-4, atol=amax.item() * 2**-9 / 448)
    q5 = quantize_fp8(x, E5M2)
    assert q5.values().abs().max().item() == 57344.0


def test_rowwise_power_of_two_scales():
    x = randn(32, 64) * torch.logspace(-3, 3, 32)[:, None]
    q = quantize_fp8(x, E4M3, (1, None), pow2=True)
    assert q.scale.shape == (32, 1) and is_pow2(q.scale)
    row_max = q.values().abs().amax(dim=1)  # amax × scale in (224, 448], then rounded
    assert (row_max <= 448).all() and (row_max >= 224).all() and (row_max < 448).any()
    exact = quantize_fp8(x, E4M3, (1, None))
    assert (exact.values().abs().amax(dim=1) == 448).all()


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_power_of_two_scales(block):
    x = randn(256, 384) * torch.logspace(-2, 2, 384)
    q = quantize_fp8(x, E4M3, block, pow2=True)
    assert q.scale.shape == (256 // block[0], 384 // block[1]) and is_pow2(q.scale)
    m = q.values().abs().reshape(256 // block[0], block[0], 3, 128).amax(dim=(1, 3))
    assert (m <= 448).all() and (m >= 224).all()
    assert torch.equal(q.dequantize(), q.values() * q.block_scales())


def exact_ceil_log2(v: Fraction) -> int:
    k = math.floor(math.log2(v))
    while Fraction(2) ** k < v:
        k += 1
    while Fraction(2) ** (k - 1) >= v:
        k -= 1
    return k


@pytest.mark.parametrize("fmt", [E4M3, E2M1], ids=lambda f: f.name)
def test_mx_rceil_scale(fmt):
    amaxes = [fmt.max * 2.0**k for k in (-3, 0, 5)] + [0.37, 1.0, 449.0, 1e-3, 123456.0, 5.999]
    x = torch.zeros(len(amaxes), 32)
    x[:, 7] = torch.tensor(amaxes)
    x[:, 8] = -torch.tensor(amaxes) / 3
    q = quantize_mx(x, fmt)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (len(amaxes), 1)
    k = torch.log2(e8m0_to_float(q.scale)).flatten()
    ref = [exact_ceil_log2(Fraction(float(torch.tensor(a))) / Fraction(fmt.max)) for a in amaxes]
    assert k.tolist() == ref
    assert (q.values().abs() <= fmt.max).all()  # RCEIL never saturates


def test_mx_floor_scale_saturates():
    amaxes = [448.0, 500.0, 1.0, 0.01]
    x = torch.zeros(4, 32)
    x[:, 0] = torch.tensor(amaxes)
    q = quantize_mx(x, E4M3, rounding="floor")
    k = torch.log2(e8m0_to_float(q.scale)).flatten()
    assert k.tolist() == [math.floor(math.log2(a)) - 8 for a in amaxes]
    assert q.values()[1, 0].item() == 448.0  # 500 / 2**0 = 500 saturates
    with pytest.raises(ValueError, match="rounding"):
        quantize_mx(x, rounding="up")


def test_nvfp4_scales():
    x = randn(32, 64, scale=5.0)
    q = quantize_nvfp4(x)
    amax = x.abs().max()
    g_enc = torch.tensor(2688.0) / amax
    assert q.global_scale.item() == (torch.ones(()) / g_enc).item()  # TE: the reciprocal of the encode scale
    block_amax = x.abs().reshape(32, 4, 16).amax(-1)
    ref_scale = (block_amax * (g_enc * torch.tensor(1 / 6))).to(torch.float8_e4m3fn)  # torch's RNE cast
    assert q.scale.dtype == torch.float8_e4m3fn and torch.equal(q.scale.float(), ref_scale.float())
    enc = 1 / (ref_scale.float() * q.global_scale)
    assert torch.equal(q.codes, encode(x * enc.repeat_interleave(16, 1), E2M1))
    assert torch.equal(q.dequantize(), decode(q.codes, E2M1) * q.block_scales() * q.global_scale)
    rel = (q.dequantize() - x).norm() / x.norm()
    assert rel < 0.15


def test_nvfp4_2d_weight_blocks_are_transpose_invariant():
    w = randn(64, 48)
    q2 = quantize_nvfp4(w, block=(16, 16)).dequantize()
    assert torch.equal(q2.t(), quantize_nvfp4(w.t(), block=(16, 16)).dequantize())
    q1 = quantize_nvfp4(w).dequantize()  # 1x16 blocks: W and Wᵀ quantize differently
    assert not torch.equal(q1.t(), quantize_nvfp4(w.t()).dequantize())


def test_nvfp4_stochastic_rounding_is_unbiased():
    x = randn(16, 32)
    g = torch.Generator().manual_seed(0)
    mean = torch.stack([quantize_nvfp4(x, stochastic=True, generator=g).dequantize() for _ in range(2000)]).mean(0)
    rne = quantize_nvfp4(x).dequantize()
    assert (mean - x).abs().mean() < 0.2 * (rne - x).abs().mean()


@pytest.mark.parametrize("name", list(SPECS))
def test_zero_tensor_gives_zeros(name):
    spec = SPECS[name]
    q = quantize(torch.zeros(256, 256), spec).dequantize()
    assert torch.equal(q, torch.zeros(256, 256))


def test_tiny_amax_has_finite_scales():
    x = torch.full((32, 32), 1e-38)
    for q in (quantize_fp8(x), quantize_mx(x), quantize_nvfp4(x)):
        d = q.dequantize()
        assert torch.isfinite(d).all() and (d > 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_poisons_its_scaling_group(bad):
    x = randn(32, 256)
    x[3, 40] = bad  # row 3, block 1 of 128 / block 1 of 32
    assert torch.isnan(quantize_fp8(x).dequantize()).all()  # tensorwise: one group
    row = quantize_fp8(x, E4M3, (1, None)).dequantize()
    assert torch.isnan(row[3]).all() and torch.isfinite(row[torch.arange(32) != 3]).all()
    blk = quantize_fp8(x, E4M3, (1, 128), pow2=True).dequantize()
    assert torch.isnan(blk[3, 0:128]).all() and torch.isfinite(blk).sum() == 32 * 256 - 128
    mx = quantize_mx(x).dequantize()
    assert torch.isnan(mx[3, 32:64]).all() and torch.isfinite(mx).sum() == 32 * 256 - 32
    assert torch.isnan(quantize_nvfp4(x).dequantize()).all()  # global amax is non-finite


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: quantize_fp8(x, E4M3, (1, 128), pow2=True),
        lambda x: quantize_fp8(x, E4M3, (128, 128), pow2=True),
        lambda x: quantize_mx(x),
    ],
)
def test_non_dividing_shapes_raise(fn):
    """Only NVFP4 pads (tests/test_nvfp4_te.py)."""
    with pytest.raises(ValueError, match="not divisible"):
        fn(torch.ones(24, 136))
    with pytest.raises(ValueError, match="2-D"):
        fn(torch.ones(2, 128, 128))


class TEDelayedScaling:
    """Transformer Engine's DelayedScaling state, written from its fused update kernel
    (``common/recipe/delayed_scaling.cu``, ``kernel_bulk``) in its own layout: slot 0 of the history is
    the current step's amax, slots 1..L-1 the past ones, oldest first; scale starts at 1.0."""

    def __init__(self, length, fp8_max, margin, algo):
        self.h = np.zeros(length, np.float32)
        self.scale = np.float32(1.0)
        self.scaled_max = np.float32(fp8_max * 2.0**-margin)
        self.algo = algo

    def update(self, amax):
        last, amax_ref = np.float32(amax), np.float32(0)
        if last != 0:
            window = np.append(self.h[1:], last)  # a = h[i + 1], the last one the current amax
            for a in window:
                amax_ref = np.fmax(amax_ref, a)  # fmaxf: NaN ignored
            self.h = np.append(np.float32(0), window[1:])
        if self.algo == "most_recent":
            amax_ref = last
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            scale = self.scaled_max / amax_ref if np.isfinite(amax_ref) and amax_ref > 0 else self.scale
        self.scale = np.float32(np.finfo(np.float32).max) if np.isinf(scale) else np.float32(scale)


AMAXES = [0.0, 3.0, 10.0, 0.0, 5.0, math.inf, 2.0, math.nan, 7.5, 1e-38, 0.5, 6.0, 0.25, 3e38, 1.5]


@pytest.mark.parametrize(
    "length,margin,algo,fmt",
    [
        (1024, 0, "max", E4M3),
        (4, 0, "max", E4M3),
        (3, 2, "max", E5M2),
        (1, 0, "max", E4M3),
        (4, 1, "most_recent", E4M3),
    ],
)
def test_delayed_update_is_transformer_engines_rule(length, margin, algo, fmt):
    hist, scale = torch.zeros(length), torch.ones(())
    te = TEDelayedScaling(length, fmt.max, margin, algo)
    for step, a in enumerate(AMAXES):
        delayed_update(hist, scale, torch.tensor(a), delayed_scaled_max(fmt, margin), algo)
        te.update(a)
        assert scale.numpy().tobytes() == te.scale.tobytes(), (step, a, scale.item(), te.scale)
        # the same amaxes, newest first (TE keeps L - 1 of them between updates)
        assert np.array_equal(hist[: length - 1].numpy(), te.h[1:][::-1], equal_nan=True), step


def test_delayed_update_cases():
    hist, scale = torch.zeros(4), torch.ones(())
    delayed_update(hist, scale, torch.tensor(0.0), 448.0)  # a zero amax: nothing recorded, scale kept (1.0)
    assert hist.tolist() == [0.0] * 4 and scale.item() == 1.0
    for a in (3.0, 10.0, 5.0):
        delayed_update(hist, scale, torch.tensor(a), 448.0)
    assert hist.tolist() == [5.0, 10.0, 3.0, 0.0] and scale.item() == pytest.approx(44.8)
    delayed_update(hist, scale, torch.tensor(math.inf), 448.0)  # Inf enters the history: the scale is held
    assert hist[0].item() == math.inf and scale.item() == pytest.approx(44.8)
    for a in (1.0, 1.0, 1.0):  # ... until it leaves it
        delayed_update(hist, scale, torch.tensor(a), 448.0)
    assert scale.item() == pytest.approx(44.8)
    delayed_update(hist, scale, torch.tensor(1.0), 448.0)
    assert scale.item() == 448.0
    delayed_update(hist, scale, torch.tensor(math.nan), delayed_scaled_max(E4M3, 1))  # NaN: ignored by the max
    assert math.isnan(hist[0].item()) and scale.item() == 224.0
    delayed_update(torch.zeros(1), scale, torch.tensor(1e-38), 448.0)  # the quotient overflows: the FP32 max
    assert scale.item() == torch.finfo(torch.float32).max
    x = randn(8, 8, scale=100)  # a cast with scale 448 / 10 saturates an amax well above 10
    q = quantize_fp8(x, E4M3, encode_scale=torch.tensor(44.8))
    assert q.scale.item() == pytest.approx(10 / 448) and q.values().abs().max().item() == 448.0


def test_hadamard_orthogonal():
    h = hadamard(16)
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    assert set(h.abs().unique().tolist()) == {0.25}
    r = rht_matrix()
    assert torch.allclose(r @ r.t(), torch.eye(16), atol=1e-6)
    assert not torch.equal(r, h)  # the signs are not all +1
    with pytest.raises(ValueError):
        hadamard(12)


def test_rht_on_both_operands_leaves_product_unchanged():
    a, b = randn(48, 64, seed=1), randn(32, 64, seed=2)
    assert torch.allclose(apply_rht(a) @ apply_rht(b).t(), a @ b.t(), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(apply_rht(a), a, atol=0.1)
    with pytest.raises(ValueError, match="Hadamard"):
        apply_rht(torch.ones(4, 24))


@pytest.mark.gpu
def test_rht_of_bf16_on_cuda_equals_the_cpu_reference():
    """The tensor-core path (BF16 in, FP32 sums, BF16 out) rounds as the CPU's exact sums do, but where a
    sum's FP32 rounding in another order crosses a BF16 rounding boundary (rare)."""
    x = randn(256, 512, seed=3, scale=3.0).bfloat16()
    want = apply_rht(x)
    got = apply_rht(x.cuda())
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.cpu() != want).float().mean() < 1e-4
    assert torch.equal(torch.compile(apply_rht)(x.cuda()), got)


def test_qtensor_dequantize_definition():
    x = randn(32, 64)
    q = quantize_mx(x)
    manual = decode(q.codes, E4M3) * e8m0_to_float(q.scale).repeat_interleave(32, 1)
    assert torch.equal(q.dequantize(), manual)
    assert isinstance(q, QTensor) and q.block == (1, 32)


def test_quantize_dequantize_public_api():
    x = randn(4, 8, 64)
    y = quantize_dequantize(x, "mxfp8", "input")
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(y.reshape(32, 64), quantize_mx(x.reshape(32, 64)).dequantize())
    w = randn(32, 64)
    assert torch.equal(quantize_dequantize(w, "nvfp4", "weight"), quantize_nvfp4(w, block=(16, 16)).dequantize())
    assert torch.equal(quantize_dequantize(x, "bf16", "input"), x.bfloat16().float())
    g1 = quantize_dequantize(w, "nvfp4", "grad", generator=torch.Generator().manual_seed(0))
    g2 = quantize_dequantize(w, "nvfp4", "grad", generator=torch.Generator().manual_seed(1))
    assert not torch.equal(g1, g2)  # grads are stochastically rounded
    assert torch.equal(quantize_dequantize(w, "fp8-tensorwise", "grad"), quantize_fp8(w, E5M2).dequantize())
    with pytest.raises(ValueError, match="role"):
        quantize_dequantize(x, "mxfp8", "activation")


def test_quant_error_table():
    rows = quant_error_table(["bf16", "fp8-tensorwise", "mxfp8", "nvfp4"], shape=(128, 256))
    assert len(rows) == 3 * 4 * 3
    by = {(r["distribution"], r["recipe"], r["role"]): r for r in rows}
    for dist in ("gaussian", "student-t", "outlier-channel"):
        assert by[(dist, "bf16", "input")]["sqnr_db"] > by[(dist, "mxfp8", "input")]["sqnr_db"]
        assert by[(dist, "mxfp8", "input")]["sqnr_db"] > by[(dist, "nvfp4", "input")]["sqnr_db"] + 5
        r = by[(dist, "nvfp4", "weight")]
        assert r["sqnr_db"] == pytest.approx(-20 * math.log10(r["rel_error"]))
    # E5M2 grads have one mantissa bit fewer than E4M3 inputs
    assert (
        by[("gaussian", "fp8-tensorwise", "grad")]["rel_error"]
        > 1.5 * by[("gaussian", "fp8-tensorwise", "input")]["rel_error"]
    )
    t = sample_tensor("student-t", (64, 64))
    assert t.abs().max() > 4 * sample_tensor("gaussian", (64, 64)).abs().max()
    with pytest.raises(ValueError):
        sample_tensor("uniform")

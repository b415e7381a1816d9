"""NVFP4 element by element against Transformer Engine's arithmetic.

``te_nvfp4`` below is an independent reference written from TE's NVFP4 quantizer (the CUDA kernels
and ``NVFP4QuantizerRef``) in NumPy float32, whose every operation is one IEEE rounding: global
encode scale S = min(2688 / amax, FP32 max) (1 for amax 0), global decode scale 1 / S, block
scale E4M3(block_amax × (S × fp32(1/6))) by round-to-nearest-even over the table of E4M3 values,
block encode scale min(1 / (block scale × 1 / S), FP32 max), codes by TE's E2M1 thresholds;
blocks that do not fit are zero-padded. The RHT is TE's: its fixed sign vector, Hadamard entries
(−1)^popcount(i & j) / 4, FP32 sums rounded to BF16. lpbench must give identical E2M1 codes,
E4M3 block scales and FP32 global scales.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lpbench.precision import sample_tensor
from lpbench.precision.formats import E2M1, encode
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.quantize import TE_RHT_SIGNS, apply_rht, quantize_nvfp4, rht_matrix
from lpbench.precision.recipes import get_recipe

F32_MAX = np.float32(np.finfo(np.float32).max)
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]  # TE's get_wgrad_sign_vector()


def _e4m3_table() -> np.ndarray:
    """Every finite non-negative E4M3 value, in code order (0x00 .. 0x7E)."""
    vals = [(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7) for e in range(16) for m in range(8)]
    return np.array(vals[:-1], dtype=np.float64)  # 0x7F is NaN


E4M3_TABLE = _e4m3_table()


def e4m3_rne(v: np.ndarray) -> np.ndarray:
    """Non-negative float32 values to E4M3 (nearest, ties to the even code; saturating at 448)."""
    v = np.minimum(v.astype(np.float64), 448.0)
    hi = np.clip(np.searchsorted(E4M3_TABLE, v), 1, len(E4M3_TABLE) - 1)
    lo = hi - 1
    d_lo, d_hi = v - E4M3_TABLE[lo], E4M3_TABLE[hi] - v
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.isnan(v), np.nan, E4M3_TABLE[pick]).astype(np.float32)


def e2m1_te(y: np.ndarray) -> np.ndarray:
    """TE's E2M1 thresholds (``cast_to_fp4x2``) on |y| clipped to 6; the sign bit of y sets bit 3."""
    a = np.abs(y)
    mag = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0], [0, 1, 2, 3, 4, 5, 6], 7)
    return (mag + 8 * np.signbit(y)).astype(np.uint8)


def te_nvfp4(x: np.ndarray, tile=(1, 16)):
    """TE's NVFP4 of a float32 [M, N] array: (codes [M, N], block scales [⌈M/ty⌉·ty or M, ⌈N/16⌉], 1/S)."""
    x = x.astype(np.float32)
    m, n = x.shape
    ty, tx = tile
    xp = np.pad(x, ((0, -m % ty), (0, -n % tx)))
    with np.errstate(divide="ignore", over="ignore"):
        amax = np.float32(np.abs(x).max())
        s = np.minimum(np.float32(2688.0) / amax, F32_MAX)
        s = np.float32(1.0) if amax == 0 or s == 0 else np.float32(s)
        g_dec = np.float32(1.0) / s
        mult = s * np.float32(1.0 / 6.0)
        mp, np_ = xp.shape
        vec_max = np.abs(xp).reshape(mp // ty, ty, np_ // tx, tx).max(axis=(1, 3)).astype(np.float32)
        scale = e4m3_rne(vec_max * mult)
        enc = np.minimum(np.float32(1.0) / (scale * g_dec), F32_MAX)
        y = xp * np.repeat(np.repeat(enc, ty, 0), tx, 1)
    codes = e2m1_te(np.clip(y, -6.0, 6.0))[:m, :n]
    return codes, scale, g_dec


def bf16_rne(v: np.ndarray) -> np.ndarray:
    """float32 to the nearest BF16 (ties to even), as float32."""
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def te_rht_matrix() -> np.ndarray:
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], dtype=np.float64) / 4
    return np.diag(np.array(TE_SIGNS, dtype=np.float64)) @ h


def te_rht_bf16(x: np.ndarray) -> np.ndarray:
    """TE's RHT of BF16 values along the last dim in chunks of 16: FP32 sums (here exact, then rounded once)
    rounded to BF16."""
    sums = (x.astype(np.float64).reshape(-1, 16) @ te_rht_matrix()).astype(np.float32)
    return bf16_rne(sums).reshape(x.shape)


def assert_same(q, ref):
    codes, scale, g_dec = ref
    np.testing.assert_array_equal(q.codes.numpy(), codes)
    np.testing.assert_array_equal(q.scale.float().numpy(), scale)
    assert q.scale.dtype == torch.float8_e4m3fn
    assert q.global_scale.dtype == torch.float32 and q.global_scale.item() == g_dec


def tie_heavy(shape=(32, 64), j=0, seed=0) -> torch.Tensor:
    """Values that land exactly on E2M1 ties: blocks of (0.25 | 0.75 | 1.25 | 1.75 | 2.5 | 3.5 | 5) × 2^k with
    block amax 6 × 2^k and global amax 2688 (all times 2^j), so every scale is a power of two."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    k = torch.randint(-9, 9, (m, n // 16), generator=g).float().repeat_interleave(16, 1)
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    x = ties[torch.randint(0, 7, shape, generator=g)] * sign * 2**k
    x[:, ::16] = 6 * 2 ** k[:, ::16]
    x[0, 0] = 2688.0
    return x * 2.0**j


def inputs():
    for dist in ("gaussian", "student-t", "outlier-channel"):
        yield dist, sample_tensor(dist, (64, 128), seed=1)
    yield "tie-heavy", tie_heavy()
    yield "tie-heavy-2^-20", tie_heavy(j=-20, seed=1)
    yield "tie-heavy-2^30", tie_heavy(j=30, seed=2)
    yield "tiny", sample_tensor("gaussian", (32, 64), seed=3) * 1e-37
    yield "odd-37x100", sample_tensor("student-t", (37, 100), seed=4)
    yield "odd-1x17", sample_tensor("gaussian", (1, 17), seed=5)
    yield "zeros", torch.zeros(16, 32)


CASES = dict(inputs())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_te_without_rht(case, tile, bf16):
    x = CASES[case].bfloat16().float() if bf16 else CASES[case]
    assert_same(quantize_nvfp4(x, block=tile), te_nvfp4(x.numpy(), tile))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_te_with_rht_of_bf16(case):
    """The wgrad operand: tokens zero-padded to 16, transposed, Hadamard-transformed (BF16-rounded), 1x16."""
    x = CASES[case].bfloat16()
    t = F.pad(x, (0, 0, 0, -x.shape[0] % 16)).t().contiguous()
    rht = apply_rht(t)
    assert rht.dtype == torch.bfloat16
    want = te_rht_bf16(t.float().numpy())
    np.testing.assert_array_equal(rht.float().numpy(), want)
    assert_same(quantize_nvfp4(rht), te_nvfp4(want))


def test_rht_is_te_fixed_sign_hadamard():
    np.testing.assert_array_equal(rht_matrix().numpy(), te_rht_matrix().astype(np.float32))
    assert list(TE_RHT_SIGNS) == TE_SIGNS
    other = (1,) * 8 + (-1,) * 8
    r = rht_matrix(other)
    assert torch.allclose(r @ r.t(), torch.eye(16), atol=1e-6) and not torch.equal(r, rht_matrix())
    x = torch.randn(8, 32)
    assert torch.equal(apply_rht(x, other), (x.reshape(-1, 16) @ r).reshape(8, 32))
    with pytest.raises(ValueError, match="signs"):
        rht_matrix((1, 0) * 8)


def test_global_decode_scale_is_the_reciprocal_of_the_encode_scale():
    """1 / S and amax / 2688 differ by an ulp for many amaxes; TE (and lpbench) use 1 / S."""
    amax = np.linspace(1, 2, 4097, dtype=np.float32)[:-1]
    s = np.float32(2688.0) / amax
    recip, naive = np.float32(1.0) / s, amax / np.float32(2688.0)
    differ = recip != naive
    assert 0.1 < differ.mean() < 0.5
    for a in amax[differ][:20]:
        q = quantize_nvfp4(torch.tensor([[a] + [0.0] * 15]))
        assert q.global_scale.item() == np.float32(1.0) / (np.float32(2688.0) / a)


def test_a_tie_rounds_as_te_rounds_it():
    """An element whose scaled value lands on an E2M1 tie with TE's decode scale and just off it with
    amax / 2688 (or the reverse): the two rules give different codes; lpbench gives TE's."""
    amax = np.linspace(1, 2, 4097, dtype=np.float32)[:-1]
    for a in amax:
        s = np.float32(2688.0) / a
        recip, naive = np.float32(1.0) / s, a / np.float32(2688.0)
        if recip == naive:
            continue
        scale = e4m3_rne(np.array([a * (s * np.float32(1.0 / 6.0))], dtype=np.float32))[0]
        enc_te, enc_naive = np.float32(1.0) / (scale * recip), np.float32(1.0) / (scale * naive)
        for tie in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            up = down = np.float32(tie) / enc_te
            candidates = [up]
            for _ in range(3):
                up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
                candidates += [up, down]
            for x in candidates:
                te, old = e2m1_te(np.array([x * enc_te])), e2m1_te(np.array([x * enc_naive]))
                if te[0] != old[0]:
                    row = np.array([[a, x] + [0.0] * 14], dtype=np.float32)
                    q = quantize_nvfp4(torch.from_numpy(row))
                    assert q.codes[0, 1].item() == te[0]
                    assert_same(q, te_nvfp4(row))
                    return
    pytest.fail("no amax and element found whose code depends on the decode-scale rule")


def test_padded_blocks_scale_by_their_own_elements():
    x = sample_tensor("gaussian", (20, 40), seed=7)
    q = quantize_nvfp4(x)
    assert q.codes.shape == (20, 40) and q.scale.shape == (20, 3)
    padded = quantize_nvfp4(F.pad(x, (0, 8)))  # zeros change neither amax
    assert torch.equal(q.codes, padded.codes[:, :40]) and torch.equal(q.scale.float(), padded.scale.float())
    assert torch.equal(q.dequantize(), padded.dequantize()[:, :40])
    q2 = quantize_nvfp4(x, block=(16, 16))
    assert q2.codes.shape == (20, 40) and q2.scale.shape == (2, 3)
    assert q2.dequantize().shape == (20, 40) and torch.equal(
        q2.t().dequantize(), quantize_nvfp4(x.t(), block=(16, 16)).dequantize()
    )
    noise = torch.rand(20, 40, generator=torch.Generator().manual_seed(0))
    sr = quantize_nvfp4(x, stochastic=True, noise=noise)
    assert sr.codes.shape == (20, 40) and not torch.equal(sr.codes, q.codes)


def test_linear_operands_are_te_operands():
    """The emulated Linear's operands (CPU reference path) are TE's, including BF16 RHT and odd widths."""
    recipe = get_recipe("nvfp4-no-sr")
    torch.manual_seed(0)
    mod = QuantizedLinear.from_linear(nn.Linear(40, 24), recipe)
    t = sample_tensor("student-t", (37, 40), seed=8).bfloat16()
    row, col = mod._operands(t, "input", "fprop", True, True)
    assert_same(row, te_nvfp4(t.float().numpy()))
    tp = F.pad(t, (0, 0, 0, 11)).t().contiguous()
    assert_same(col, te_nvfp4(te_rht_bf16(tp.float().numpy())))
    wq, _ = mod._weight_operands(mod.weight.detach(), dgrad=False)
    assert_same(wq, te_nvfp4(mod.weight.detach().numpy(), (16, 16)))


def test_linear_of_odd_width_computes_the_padded_product():
    recipe = get_recipe("nvfp4-no-sr")
    torch.manual_seed(0)
    lin = nn.Linear(33, 20)
    mod = QuantizedLinear.from_linear(lin, recipe)
    x = torch.randn(5, 33, requires_grad=True)
    y = mod(x)
    xq, wq = quantize_nvfp4(x.detach()), quantize_nvfp4(lin.weight.detach(), block=(16, 16))
    want = xq.dequantize() @ wq.dequantize().t() + lin.bias
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert x.grad.shape == (5, 33) and lin.weight.grad.shape == (20, 33)
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()


def test_e2m1_thresholds_agree_with_round_to_nearest_even():
    """TE's threshold table is the format's round-to-nearest-even (lpbench's ``encode``)."""
    y = torch.linspace(-7, 7, 14001)
    y = torch.cat([y, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 1e-30, -1e-30])])
    np.testing.assert_array_equal(encode(y, E2M1).numpy(), e2m1_te(y.numpy()))


def test_e4m3_table_rounding_agrees_with_the_cast():
    """The test's E4M3 rounding (nearest table value, ties to the even code) is the format's."""
    mid = (E4M3_TABLE[1:] + E4M3_TABLE[:-1]) / 2  # every tie, exact in FP32
    v = torch.cat([torch.logspace(-12, 10, 20001, base=2.0), torch.tensor(mid)]).float()
    np.testing.assert_array_equal(v.clamp(max=448).to(torch.float8_e4m3fn).float().numpy(), e4m3_rne(v.numpy()))
    assert e4m3_rne(np.array([1e30, 464.0], dtype=np.float32)).tolist() == [448.0, 448.0]


def test_policy_quantizes_nvfp4_linears_of_any_width():
    from dataclasses import replace

    from lpbench.convert.quantize import apply_recipe

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 40)) for _ in range(2))

    recipe = replace(get_recipe("nvfp4"), last_bf16_layers=0)
    out = apply_recipe(Model(), recipe, device="cpu", emulate=True)
    assert out["skipped"] == [] and len(out["quantized"]) == 4


def test_frozen_nvfp4_weight_of_odd_width():
    from lpbench.precision.frozen import FrozenQuantizedLinear

    torch.manual_seed(0)
    quantized = QuantizedLinear.from_linear(nn.Linear(33, 20).requires_grad_(False), get_recipe("nvfp4-no-sr"))
    frozen = FrozenQuantizedLinear.from_linear(quantized)
    x = torch.randn(5, 33)
    assert torch.equal(frozen(x), quantized(x))
    assert torch.equal(
        frozen.weight_operand("fprop", frozen.kernel).codes, quantize_nvfp4(quantized.weight, block=(16, 16)).codes
    )

"""Formats against references written from each format's definition."""

import math

import pytest
import torch

from lpbench.precision.formats import (
    E2M1,
    E4M3,
    E5M2,
    decode,
    e8m0_from_exponent,
    e8m0_to_float,
    encode,
    pack_e2m1,
    pow2,
    round_to_format,
    unpack_e2m1,
)


def reference_value(code: int, ebits: int, mbits: int, special: str) -> float:
    """Value of a code from sign/exponent/mantissa (special: 'fn' E4M3, 'ieee' E5M2, 'none' E2M1)."""
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    e = code >> mbits & (2**ebits - 1)
    m = code & (2**mbits - 1)
    bias = 2 ** (ebits - 1) - 1
    if special == "fn" and e == 2**ebits - 1 and m == 2**mbits - 1:
        return math.nan
    if special == "ieee" and e == 2**ebits - 1:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m / 2**mbits * 2.0 ** (1 - bias)
    return sign * (1 + m / 2**mbits) * 2.0 ** (e - bias)


CASES = [(E4M3, 256, "fn"), (E5M2, 256, "ieee"), (E2M1, 16, "none")]


def codes_of(fmt, n):
    c = torch.arange(n, dtype=torch.uint8)
    return c.view(fmt.dtype) if fmt.dtype is not None else c


def code_bits(t, fmt):
    return (t.view(torch.uint8) if fmt.dtype is not None else t).long()


@pytest.mark.parametrize("fmt,n,special", CASES, ids=lambda v: getattr(v, "name", None))
def test_every_code_decodes_to_its_definition(fmt, n, special):
    ref = torch.tensor([reference_value(c, fmt.ebits, fmt.mbits, special) for c in range(n)])
    got = decode(codes_of(fmt, n), fmt)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got[ok], ref[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(ref[ok]))  # -0 included
    assert ref[torch.isfinite(ref)].abs().max().item() == fmt.max


@pytest.mark.parametrize("fmt,n,special", CASES, ids=lambda v: getattr(v, "name", None))
def test_every_finite_value_round_trips(fmt, n, special):
    ref = torch.tensor([reference_value(c, fmt.ebits, fmt.mbits, special) for c in range(n)])
    finite = torch.isfinite(ref)
    assert torch.equal(round_to_format(ref[finite], fmt), ref[finite])
    back = code_bits(encode(ref[finite], fmt), fmt)
    assert torch.equal(back, torch.arange(n)[finite])


def positive_values(fmt, n, special):
    vals = sorted({reference_value(c, fmt.ebits, fmt.mbits, special) for c in range(n // 2)})
    return torch.tensor([v for v in vals if math.isfinite(v)])


@pytest.mark.parametrize("fmt,n,special", CASES, ids=lambda v: getattr(v, "name", None))
def test_ties_round_to_even(fmt, n, special):
    vals = positive_values(fmt, n, special)
    mid = (vals[:-1] + vals[1:]) / 2
    for sign in (1.0, -1.0):
        codes = code_bits(encode(sign * mid, fmt), fmt)
        assert (codes % 2 == 0).all()  # the mantissa LSB is the code LSB
        got = round_to_format(sign * mid, fmt).abs()
        assert ((got == vals[:-1]) | (got == vals[1:])).all()


@pytest.mark.parametrize("fmt,n,special", CASES, ids=lambda v: getattr(v, "name", None))
def test_rounds_to_nearest(fmt, n, special):
    vals = positive_values(fmt, n, special)
    x = (torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * fmt.max
    x = torch.cat([x, x * 2.0**-12])  # subnormal range too
    got = round_to_format(x, fmt)
    best = (x.abs()[:, None] - vals[None, :]).abs().min(dim=1).values
    assert torch.equal((got.abs() - x.abs()).abs(), best)
    assert torch.equal(torch.signbit(got), torch.signbit(x))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_agrees_with_torch_cast_within_range(fmt):
    x = torch.randn(50000, generator=torch.Generator().manual_seed(1)) * fmt.max / 4
    x = x.clamp(-fmt.max, fmt.max)
    assert torch.equal(round_to_format(x, fmt), x.to(fmt.dtype).float())


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_saturates_beyond_max_and_inf(fmt):
    x = torch.tensor([fmt.max * 1.01, fmt.max * 1000, math.inf, -math.inf, -fmt.max * 3])
    assert torch.equal(round_to_format(x, fmt), torch.tensor([1, 1, 1, -1, -1]) * fmt.max)
    assert torch.equal(decode(encode(x, fmt), fmt), torch.tensor([1, 1, 1, -1, -1]) * fmt.max)


def test_e4m3_just_below_the_nan_code_saturates():
    # 464 is halfway between 448 and 480 (which would be the NaN code): must give 448
    assert round_to_format(torch.tensor([464.0, 479.0]), E4M3).tolist() == [448.0, 448.0]


def test_nan_behaviour():
    nan = torch.tensor([math.nan])
    assert torch.isnan(decode(encode(nan, E4M3), E4M3)).all()
    assert torch.isnan(decode(encode(nan, E5M2), E5M2)).all()
    assert encode(nan, E2M1).item() == 0  # E2M1 has no NaN: +0
    assert torch.isnan(round_to_format(nan, E2M1)).all()


def test_subnormals():
    tiny = 2.0**-9  # smallest E4M3 subnormal
    x = torch.tensor([tiny / 2, tiny * 0.75, tiny * 1.5, tiny * 2.5])
    assert round_to_format(x, E4M3).tolist() == [0.0, tiny, 2 * tiny, 2 * tiny]  # ties to even
    assert round_to_format(torch.tensor([0.25, 0.26]), E2M1).tolist() == [0.0, 0.5]


@pytest.mark.parametrize("fmt,n,special", CASES, ids=lambda v: getattr(v, "name", None))
def test_stochastic_rounding_unbiased_and_two_neighbours(fmt, n, special):
    vals = positive_values(fmt, n, special)
    lo, hi = vals[len(vals) // 2], vals[len(vals) // 2 + 1]
    x = torch.tensor([lo + 0.3 * (hi - lo), -(lo + 0.8 * (hi - lo))])
    draws = round_to_format(x.repeat(40000, 1), fmt, stochastic=True, generator=torch.Generator().manual_seed(0))
    for j in range(2):
        assert set(draws[:, j].abs().unique().tolist()) == {lo.item(), hi.item()}
        assert abs(draws[:, j].mean().item() - x[j].item()) < 0.01 * (hi - lo).item()
    # representable values never move; the same seed gives the same draws
    same = round_to_format(vals, fmt, stochastic=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(same, vals)
    a = round_to_format(x, fmt, stochastic=True, generator=torch.Generator().manual_seed(5))
    b = round_to_format(x, fmt, stochastic=True, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_pack_e2m1_layout_matches_float4_e2m1fn_x2():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2
    # first element in the low nibble (torch's Float4_e2m1fn_x2 layout: val1 bits 7-4, val0 bits 3-0)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_e2m1(packed), codes)
    all_codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)
    assert torch.equal(unpack_e2m1(pack_e2m1(all_codes)), all_codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


def test_e8m0_codes():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = e8m0_to_float(codes)
    ref = torch.tensor([math.ldexp(1.0, c - 127) if c < 255 else math.nan for c in range(256)])
    assert torch.equal(got[:255], ref[:255]) and torch.isnan(got[255])
    assert torch.equal(got[:255], codes.float()[:255])  # torch's own decoding agrees
    k = torch.tensor([-300.0, -127, -1, 0, 5, 127, 300, math.nan])
    assert e8m0_from_exponent(k).view(torch.uint8).tolist() == [0, 0, 126, 127, 132, 254, 254, 255]


def test_pow2_exact():
    k = torch.arange(-149, 128)
    assert pow2(k).tolist() == [math.ldexp(1.0, int(i)) for i in k]

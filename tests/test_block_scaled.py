"""Native MXFP8 / NVFP4 GEMM operands (``kernels/block_scaled.py``) verified without a Blackwell GPU.

The scale layout is checked against an independent implementation written from cuBLAS's
block-scaling-factor layout description (128x4 tiles of 512 bytes, row-major tile order, scale (r, c)
of a tile at offset 16·(r mod 32) + 4·(r div 32 mod 4) + c), the operands against torch's own shape
checks (``F.scaled_mm`` on the meta device), and a GEMM that reads the packed operands back as cuBLAS
would (unpack, un-swizzle, drop the padding, dequantize) against the emulated GEMM, bit for bit.
"""

import pytest
import torch

from lpbench.errors import UsageError
from lpbench.convert.quantize import apply_recipe
from lpbench.precision import get_recipe
from lpbench.precision.formats import E2M1, decode, encode, pack_e2m1, unpack_e2m1
from lpbench.precision.kernels import block_scaled
from lpbench.precision.linear import Emulated, NativeBlockScaled, QuantizedLinear
from lpbench.precision import capability as caps
from lpbench.precision.capability import why_emulated
from lpbench.precision.quantize import QTensor, apply_rht, quantize, scale_to_float

pytestmark = pytest.mark.skipif(
    caps.block_scaled_unavailable() is not None, reason=str(caps.block_scaled_unavailable())
)


# ---------------------------------------------------------------- independent layout (cuBLAS's description)


def cublas_offset(r: torch.Tensor, c: torch.Tensor, cols: int) -> torch.Tensor:
    """Byte offset of scale (r, c) of an operand with ``cols`` scale columns in cuBLAS's layout."""
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def cublas_layout(scale: torch.Tensor) -> torch.Tensor:
    """Scatter [R, C] one-byte scales into a zeroed buffer of ceil(R/128)·128 · ceil(C/4)·4 bytes."""
    rows, cols = scale.shape
    out = torch.zeros(-(-rows // 128) * 128 * -(-cols // 4) * 4, dtype=torch.uint8)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    out[cublas_offset(r, c, cols).flatten()] = scale.view(torch.uint8).flatten()
    return out


def read_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] scales gathered from the flat layout, as cuBLAS reads them (same dtype)."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return flat.view(torch.uint8)[cublas_offset(r, c, cols)].view(flat.dtype)


def read_operand(data, flat_scale, global_scale, rows: int, k: int, block: int):
    """FP32 (code × block scale) values [rows, k] and the global factor, read from F.scaled_mm's operand."""
    fp4 = data.dtype == torch.float4_e2m1fn_x2
    codes = unpack_e2m1(data) if fp4 else data
    kp = codes.shape[1]
    scales = read_scales(flat_scale, rows, kp // block)
    # what lies beyond k is padding: zero codes (zero scales), so it adds nothing to the product
    pad_codes = codes[:, k:].view(torch.uint8) if not fp4 else codes[:, k:]
    assert not pad_codes.any()
    values = decode(codes[:, :k], E2M1) if fp4 else codes[:, :k].float()
    values = values * scale_to_float(scales).repeat_interleave(block, 1)[:, :k]
    return values, (torch.ones(()) if global_scale is None else global_scale)


def gemm_of_packed(a: QTensor, b: QTensor) -> torch.Tensor:
    """a · bᵀ computed from exactly what the native path hands F.scaled_mm, in the emulation's arithmetic."""
    da, sa, db, sb, ga, gb = block_scaled.operands(a, b)
    (m, k), n, block = a.codes.shape, b.codes.shape[0], a.block[1]
    (va, fa), (vb, fb) = read_operand(da, sa, ga, m, k, block), read_operand(db, sb, gb, n, k, block)
    return (va @ vb.t()) * fa * fb


def _tensor(rows, cols, seed, spread=6):
    """Gaussian values whose 16-wide blocks span 2^-spread..2^spread, so a misplaced scale shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    e = torch.randint(-spread, spread + 1, (rows, -(-cols // 16)), generator=g).float()
    return (x * 2.0 ** e.repeat_interleave(16, 1)[:, :cols]).bfloat16()


# ---------------------------------------------------------------- packing


def test_e2m1_pairs_pack_first_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 3)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(unpack_e2m1(packed), codes)
    # the values: 0.5, 1.0 | -6.0, -0.0 | 0.0, 6.0
    assert decode(unpack_e2m1(packed), E2M1).tolist() == [[0.5, 1.0, -6.0, -0.0, 0.0, 6.0]]


def test_quantized_rows_pack_to_half_the_bytes_in_order():
    x = torch.tensor([[0.5, -1.5, 3.0, 6.0, -0.5, 4.0, 2.0, 1.0]])
    packed = pack_e2m1(encode(x, E2M1))
    assert packed.view(torch.uint8).tolist() == [[0xB1, 0x75, 0x69, 0x24]]


# ---------------------------------------------------------------- swizzle


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (256, 8), (300, 3), (32, 12)])
@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn])
def test_swizzle_matches_cublas_layout_description(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    scale = torch.randint(1, 255, shape, dtype=torch.uint8, generator=g).view(dtype)
    got = block_scaled.swizzle(scale)
    assert got.dtype == dtype and got.dim() == 1 and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), cublas_layout(scale))
    assert torch.equal(read_scales(got, *shape).view(torch.uint8), scale.view(torch.uint8))


def test_swizzle_refuses_what_is_not_a_one_byte_matrix():
    with pytest.raises(ValueError, match="one-byte"):
        block_scaled.swizzle(torch.ones(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        block_scaled.swizzle(torch.ones(16, dtype=torch.uint8))


# ---------------------------------------------------------------- operands, padding, torch's checks


def _ops(recipe, gemm, m, n, k, seed=0):
    """Operands a [m, k] and b [n, k] of ``gemm`` as the recipe quantizes them (RHT on wgrad where it has it)."""
    r = get_recipe(recipe)
    role_a, role_b = {"fprop": ("input", "weight"), "dgrad": ("grad", "weight"), "wgrad": ("grad", "input")}[gemm]
    x, y = _tensor(m, k, seed), _tensor(n, k, seed + 1)
    if gemm == "wgrad" and r.rht_wgrad:
        x, y = apply_rht(x), apply_rht(y)
    g = torch.Generator().manual_seed(seed + 2)
    return (quantize(x, r.operand(role_a, gemm), generator=g), quantize(y, r.operand(role_b, gemm), generator=g))


def _meta(t):
    return None if t is None else t.to("meta")


CASES = [
    ("mxfp8", "fprop", 200, 96, 64),
    ("mxfp8", "dgrad", 64, 160, 96),
    ("mxfp8", "wgrad", 96, 64, 288),
    ("nvfp4", "fprop", 200, 96, 48),
    ("nvfp4", "dgrad", 64, 160, 96),
    ("nvfp4", "wgrad", 96, 64, 48),
    ("nvfp4-no-2d", "fprop", 130, 32, 80),
    ("nvfp4", "fprop", 50, 96, 40),
    ("nvfp4", "dgrad", 64, 160, 40),
]  # NVFP4 pads a partial last block


@pytest.mark.parametrize("recipe,gemm,m,n,k", CASES)
def test_operands_are_what_torchs_scaled_mm_accepts(recipe, gemm, m, n, k):
    a, b = _ops(recipe, gemm, m, n, k)
    assert block_scaled.takes(a, b)
    da, sa, db, sb, ga, gb = block_scaled.operands(a, b)
    block = a.block[1]
    kp = -(-k // block_scaled.k_multiple(a)) * block_scaled.k_multiple(a)
    fp4 = recipe.startswith("nvfp4")
    assert da.dtype == db.dtype == (torch.float4_e2m1fn_x2 if fp4 else torch.float8_e4m3fn)
    assert da.shape == (m, kp // 2 if fp4 else kp) and db.shape == (n, kp // 2 if fp4 else kp)
    assert sa.dtype == sb.dtype == (torch.float8_e4m3fn if fp4 else torch.float8_e8m0fnu)
    assert sa.numel() == -(-m // 128) * 128 * -(-(kp // block) // 4) * 4  # cuBLAS's padded scale count
    assert (ga is not None) == fp4 and (ga is None or ga.dtype == torch.float32)
    out = block_scaled.scaled_mm(*map(_meta, (da, sa, db, sb, ga, gb)))  # torch's own layout checks
    assert out.shape == (m, n) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("recipe,gemm,m,n,k", CASES)
def test_gemm_over_packed_operands_equals_emulated_gemm_bit_for_bit(recipe, gemm, m, n, k):
    a, b = _ops(recipe, gemm, m, n, k, seed=7)
    want = Emulated.gemm(a, b)
    assert torch.equal(gemm_of_packed(a, b), want)


def test_padding_k_adds_zero_codes_and_scales_only():
    a, _ = _ops("nvfp4", "fprop", 32, 32, 48)
    p = block_scaled.pad_k(a, 32)
    assert p.codes.shape == (32, 64) and p.scale.shape == (32, 4)
    assert not p.codes[:, 48:].any() and not p.scale[:, 3:].view(torch.uint8).any()
    assert torch.equal(p.dequantize()[:, :48], a.dequantize()) and not p.dequantize()[:, 48:].any()
    assert block_scaled.pad_k(a, 16) is a
    mx, _ = _ops("mxfp8", "fprop", 32, 32, 64)
    with pytest.raises(ValueError, match="whole 32-blocks"):
        block_scaled.pad_k(mx, 80)


def test_a_bad_scale_layout_fails():
    a, b = _ops("mxfp8", "fprop", 200, 96, 64)
    da, sa, db, sb, _, _ = block_scaled.operands(a, b)
    # plain row-major [M, K/32] scales, not padded to 128 x 4 tiles: torch refuses them
    with pytest.raises(RuntimeError, match="scale_a must have"):
        block_scaled.scaled_mm(*map(_meta, (da, a.scale.contiguous().flatten(), db, sb)))
    # each 128x4 tile stored row-major instead of 32x4x4-interleaved: the right size, scales on the wrong blocks
    r, c = torch.meshgrid(torch.arange(200), torch.arange(2), indexing="ij")
    tile_major = (r // 128) * 512 + (r % 128) * 4 + c
    wrong = torch.zeros(sa.numel(), dtype=torch.uint8)
    wrong[tile_major.flatten()] = a.scale.view(torch.uint8).flatten()
    wrong = wrong.view(sa.dtype)
    block_scaled.scaled_mm(*map(_meta, (da, wrong, db, sb)))  # torch cannot tell: only the values can
    va, _ = read_operand(da, wrong, None, 200, 64, 32)
    vb, _ = read_operand(db, sb, None, 96, 64, 32)
    assert not torch.equal(va @ vb.t(), Emulated.gemm(a, b))
    # operands of two different formats, or an MXFP4 pair, are not a GEMM this path runs
    n4, _ = _ops("nvfp4", "fprop", 32, 32, 64)
    with pytest.raises(ValueError, match="not a block-scaled GEMM"):
        block_scaled.operands(a, n4)
    x4, y4 = _ops("mxfp4", "fprop", 32, 32, 64)
    assert not block_scaled.takes(x4, y4)


def fake_scaled_mm(a, scale_a, b, scale_b, global_a=None, global_b=None):
    """block_scaled.scaled_mm's arguments multiplied as cuBLAS reads them (all of K, padding included)."""
    block = 32 if global_a is None else 16
    assert scale_a.dtype == scale_b.dtype == (torch.float8_e8m0fnu if block == 32 else torch.float8_e4m3fn)
    k = a.shape[1] * (2 if a.dtype == torch.float4_e2m1fn_x2 else 1)
    (va, fa), (vb, fb) = (
        read_operand(a, scale_a, global_a, a.shape[0], k, block),
        read_operand(b, scale_b, global_b, b.shape[0], k, block),
    )
    return ((va @ vb.t()) * fa * fb).bfloat16()


@pytest.mark.parametrize("replace,tokens", [("mm", 40), ("scaled_mm", 64)])
def test_native_linear_hands_the_quantizers_codes_to_the_gemm(monkeypatch, replace, tokens):
    """A native QuantizedLinear (RHT, stochastic rounding, 16x16 weight blocks) computes each of its three GEMMs from
    F.scaled_mm's operands: here a GEMM that reads them back, so the linear equals the emulated one bit for bit.
    ``mm`` replaced: 40 tokens, padded for wgrad; ``scaled_mm`` replaced: the bytes through the custom op too."""
    if replace == "mm":
        monkeypatch.setattr(block_scaled, "mm", lambda a, b: gemm_of_packed(a, b).bfloat16())
    else:
        monkeypatch.setattr(block_scaled, "scaled_mm", fake_scaled_mm)
    for name in ("mxfp8", "nvfp4"):
        recipe = get_recipe(name)
        torch.manual_seed(0)
        base = torch.nn.Linear(64, 96, bias=False)
        outs = []
        for native in (True, False):
            mod = QuantizedLinear.from_linear(base, recipe, native=native)
            x = _tensor(tokens, 64, 3).float().requires_grad_()
            torch.manual_seed(1)  # the same stochastic-rounding draws for both
            y = mod(x)
            (y.float() * _tensor(tokens, 96, 4).float()).sum().backward()
            outs.append((y.detach(), x.grad, base.weight.grad.clone()))
            base.weight.grad = None
        for got, want in zip(*outs):  # native: each GEMM's output rounded to BF16, as F.scaled_mm returns it
            assert torch.equal(got, want.bfloat16().float())


# ---------------------------------------------------------------- dispatch


@pytest.fixture
def capability(monkeypatch):
    def fake(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return fake


def _toy():
    from tests.test_policy import Toy

    return Toy()


def test_dispatch_on_a_faked_blackwell_picks_native(capability):
    capability((10, 0))
    assert why_emulated(get_recipe("mxfp8"), "cuda") is None and why_emulated(get_recipe("nvfp4"), "cuda") is None
    assert "FBGEMM" in why_emulated(get_recipe("mxfp4"), "cuda")
    assert "Hopper" in why_emulated(get_recipe("fp8-blockwise"), "cuda")
    model = _toy()
    info = apply_recipe(model, "mxfp8", device="cuda", emulate=False)
    assert info["path"] == "native" and info["why_emulated"] is None
    assert all(m.native for m in model.modules() if isinstance(m, QuantizedLinear))


def test_dispatch_on_a_faked_hopper_emulates_with_the_reason(capability):
    capability((9, 0))
    for name in ("mxfp8", "nvfp4"):
        reason = why_emulated(get_recipe(name), "cuda")
        assert reason == "it needs compute capability 10.0, this GPU has 9.0"
        with pytest.raises(UsageError, match=f"precision {name} cannot run natively on cuda: {reason}; pass --emulate"):
            apply_recipe(_toy(), name, device="cuda", emulate=False)
        model = _toy()
        info = apply_recipe(model, name, device="cuda", emulate=True)
        assert info["path"] == "emulated" and info["why_emulated"] == reason
        assert not any(m.native for m in model.modules() if isinstance(m, QuantizedLinear))


def test_dispatch_names_a_torch_without_block_scaled_gemms(capability, monkeypatch):
    capability((10, 0))
    monkeypatch.setattr(caps, "block_scaled_unavailable", lambda: "torch 2.9 has no F.scaled_mm block scaling")
    info = apply_recipe(_toy(), "nvfp4", device="cuda", emulate=True)
    assert info == {**info, "path": "emulated", "why_emulated": "torch 2.9 has no F.scaled_mm block scaling"}


# ---------------------------------------------------------------- on a Blackwell GPU (not yet run: none is lent)


def _blackwell():
    if torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("the block-scaled GEMMs need compute capability 10.x")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,gemm,m,n,k", CASES)
def test_native_gemm_matches_emulated_gemm_on_blackwell(recipe, gemm, m, n, k):
    _blackwell()
    a, b = _ops(recipe, gemm, m, n, k, seed=11)
    a, b = (
        QTensor(
            q.codes.cuda(), q.scale.cuda(), q.block, q.fmt, None if q.global_scale is None else q.global_scale.cuda()
        )
        for q in (a, b)
    )
    got, want = NativeBlockScaled.gemm(a, b), Emulated.gemm(a, b)
    # the same operands: BF16 output and the summation order only
    assert got.dtype == torch.bfloat16
    got = got.float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_native_linear_matches_emulated_linear_on_blackwell(name, precise_casts):
    _blackwell()
    torch.manual_seed(0)
    base = torch.nn.Linear(512, 1024, device="cuda")
    outs = []
    for native in (True, False):
        mod = torch.compile(QuantizedLinear.from_linear(base, get_recipe(name), native=native))
        x = _tensor(1000, 512, 3).cuda().requires_grad_()
        torch.manual_seed(1)  # the same stochastic-rounding seeds for both
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(x)
        y.float().pow(2).mean().backward()
        outs.append((y.float(), x.grad.float(), base.weight.grad.clone()))
        base.weight.grad = None
    for got, want in zip(*outs):  # the same codes and scales: BF16 outputs and the summation order only
        assert ((got - want).norm() / want.norm()).item() < 1e-2

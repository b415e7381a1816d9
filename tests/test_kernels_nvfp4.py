"""The fused NVFP4 quantizer (``kernels/nvfp4.py``) against the reference ``quantize_nvfp4``
(itself checked against Transformer Engine's arithmetic in tests/test_nvfp4_te.py).

Codes, E4M3 block scales, global scales and the BF16 emulation operands must be bit-exact for
the same RHT sums and the same uniform draws, on any shape (a partial last block is zero-padded).
The RHT's FP32 sums come from the tensor cores, whose summation order is not the reference's
(exact sums rounded once), so the bit-exact RHT cases use inputs whose Hadamard sums are exact in
any order (small integers times a power of two per column); general inputs, whose sums are then
rounded to BF16 as TE rounds them, must agree on at least 99.99 % of codes and scales.
"""

import pytest
import torch
import torch.nn.functional as F

from lpbench.precision.quantize import TE_RHT_SIGNS, apply_rht, quantize_nvfp4

pytestmark = pytest.mark.gpu

SHAPES = [(256, 512), (1000, 304), (64, 4096), (4097, 128), (37, 100), (130, 17)]


def _general(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[1])).bfloat16()


def _exact_sums(shape, seed=0):
    """Values whose 16-term Hadamard sums are exact in FP32: k/8 (|k| ≤ 64) times 2^e per column."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-64, 65, shape, generator=g).float() / 8
    return (k * 2.0 ** torch.randint(-20, 21, (shape[1],), generator=g).float()).bfloat16()


def _wgrad_input(x, rht, signs=TE_RHT_SIGNS):
    """The reference's wgrad operand: tokens zero-padded to 16, transposed, optionally Hadamard-transformed
    (BF16 x: the transform rounded to BF16)."""
    t = F.pad(x, (0, 0, 0, -x.shape[0] % 16)).t().contiguous()
    return apply_rht(t, signs) if rht else t


def _assert_copy(got, ref):
    torch.testing.assert_close(got.codes.cpu(), ref.codes, rtol=0, atol=0)
    torch.testing.assert_close(got.scale.cpu().float(), ref.scale.float(), rtol=0, atol=0, equal_nan=True)
    want = (ref.values() * ref.block_scales()).bfloat16()
    torch.testing.assert_close(got.values.cpu(), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.global_scale.cpu(), ref.global_scale, rtol=0, atol=0, equal_nan=True)


def _both(x, rht, stochastic, signs=TE_RHT_SIGNS):
    from lpbench.precision.kernels import nvfp4

    seed = torch.tensor([20261122], device="cuda")
    row, col = nvfp4.quantize(
        x.cuda(), row=True, col=True, rht=rht, stochastic=stochastic, signs=signs, seed=seed, with_codes=True
    )
    t = _wgrad_input(x, rht, signs)
    noise_row = nvfp4.uniform(seed, *x.shape).cpu() if stochastic else None
    noise_col = nvfp4.uniform(seed + 1, *t.shape).cpu() if stochastic else None
    return (
        row,
        quantize_nvfp4(x.float(), stochastic=stochastic, noise=noise_row),
        col,
        quantize_nvfp4(t, stochastic=stochastic, noise=noise_col),
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("rht", [False, True])
def test_fused_copies_are_bit_exact(shape, stochastic, rht):
    x = _exact_sums(shape) if rht else _general(shape)
    row, row_ref, col, col_ref = _both(x, rht, stochastic)
    _assert_copy(row, row_ref)
    _assert_copy(col, col_ref)
    assert col.values.shape == (shape[1], -(-shape[0] // 16) * 16)
    assert row.scale.shape == (shape[0], -(-shape[1] // 16))


def test_fused_rht_takes_the_recipe_signs():
    signs = (1, -1) * 8
    x = _exact_sums((256, 128))
    _, _, col, ref = _both(x, True, False, signs)
    _assert_copy(col, ref)
    _, _, default, _ = _both(x, True, False)
    assert not torch.equal(col.codes, default.codes)


@pytest.mark.parametrize("stochastic", [False, True])
def test_fused_rht_copy_of_general_input_is_close(stochastic):
    """Only the RHT's FP32 summation order differs, and the BF16 rounding hides it but where an FP32 sum
    lands next to a BF16 rounding boundary: at least 99.99 % of codes and scales agree."""
    x = _general((2048, 1024))
    _, _, col, ref = _both(x, True, stochastic)
    assert (col.codes.cpu() != ref.codes).float().mean() < 1e-4
    assert (col.scale.cpu().float() != ref.scale.float()).float().mean() < 1e-4
    torch.testing.assert_close(col.global_scale.cpu(), ref.global_scale, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["zeros", "nan", "inf", "huge", "tiny"])
def test_fused_edge_cases_match_reference(case):
    x = _general((128, 64))
    if case == "zeros":
        x = x * 0
    elif case in ("nan", "inf"):
        x[37, 21] = float(case)
    elif case == "huge":
        x[5, 5] = 3e38
    else:
        x = x * 1e-30
    row, row_ref, col, col_ref = _both(x, False, False)
    _assert_copy(row, row_ref)
    _assert_copy(col, col_ref)


def test_stochastic_rounding_draws_from_the_seed():
    from lpbench.precision.kernels import nvfp4

    x = _general((256, 256)).cuda()
    a, b, c = (
        nvfp4.quantize(x, row=True, col=False, rht=False, stochastic=True, seed=torch.tensor([s], device="cuda"))[
            0
        ].values
        for s in (1, 1, 2)
    )
    assert torch.equal(a, b) and not torch.equal(a, c)
    rounded = nvfp4.quantize(x, row=True, col=False, rht=False, stochastic=False)[0].values
    assert not torch.equal(a, rounded)


@pytest.mark.parametrize("dims", [(512, 384), (520, 312)], ids=["dividing", "odd"])
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_with_fused_quantizer_matches_reference_path(monkeypatch, precise_casts, compiled, dims):
    """The emulated NVFP4 Linear gives the same results through the fused quantizer as through the
    reference ops (without stochastic rounding; the RHT's summation order aside), also for widths
    that 16 does not divide."""
    from lpbench.precision import capability
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    torch.manual_seed(0)
    torch._dynamo.reset()
    recipe = get_recipe("nvfp4-no-sr")
    k, n = dims
    mods = [QuantizedLinear.from_linear(torch.nn.Linear(k, n, device="cuda"), recipe) for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    x = torch.randn(4, 256, k, device="cuda")
    dy = torch.randn(4, 256, n, device="cuda").bfloat16()
    outs = []
    for i, mod in enumerate(mods):
        if i == 1:
            monkeypatch.setattr(capability, "nvfp4_kernel", lambda t: False)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = (torch.compile(mod) if compiled else mod)(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), mod.weight.grad.float()))
    for got, want in zip(*outs):
        assert (got - want).norm() / want.norm() < 1e-3

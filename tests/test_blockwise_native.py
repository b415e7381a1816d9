"""fp8-blockwise's native GEMM (``F.scaled_mm``, Hopper) against the emulated GEMM of the same codes."""

import pytest
import torch

from lpbench.precision.capability import blockwise_shape
from lpbench.precision.linear import Emulated, NativeBlockwise, QuantizedLinear
from lpbench.precision.quantize import quantize
from lpbench.precision.recipes import get_recipe

RECIPE = get_recipe("fp8-blockwise")


def _operand(rows: int, cols: int, role: str, gemm: str, device: str = "cpu", seed: int = 0):
    """Quantized operand whose 128-wide blocks span 2^-6..2^6 in magnitude, so a misplaced scale shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x = (
        x
        * 2.0
        ** torch.randint(-6, 7, (rows // 128 + 1, cols // 128 + 1), generator=g)
        .float()
        .repeat_interleave(128, 0)
        .repeat_interleave(128, 1)[:rows, :cols]
    )
    return quantize(x.bfloat16().to(device), RECIPE.operand(role, gemm))


def test_native_shapes_are_the_ones_cublas_takes():
    act, wt = _operand(256, 512, "input", "fprop"), _operand(1024, 512, "weight", "fprop")
    assert (act.block, wt.block) == ((1, 128), (128, 128))
    assert blockwise_shape(act, wt)
    assert blockwise_shape(act, _operand(256, 512, "input", "wgrad"))  # 1x128 x 1x128
    # 128x128 operand with K/128 = 3 scale columns: cuBLAS pads them to 4, so not the plain layout
    assert not blockwise_shape(_operand(256, 384, "input", "fprop"), _operand(1024, 384, "weight", "fprop"))
    assert not blockwise_shape(_operand(200, 512, "input", "fprop"), wt)  # M not a multiple of 128


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_native_blockwise_gemm_matches_emulated(gemm):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("F.scaled_mm's blockwise FP8 GEMM runs on Hopper")
    role_b = "input" if gemm == "wgrad" else "weight"
    a = _operand(512, 1024, "grad" if gemm != "fprop" else "input", gemm, "cuda", seed=1)
    b = _operand(768, 1024, role_b, gemm, "cuda", seed=2)
    assert blockwise_shape(a, b)
    got, want = NativeBlockwise.gemm(a, b), Emulated.gemm(a, b)
    # same codes and scales: BF16 output and another summation order only
    assert got.dtype == torch.bfloat16
    got = got.float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_native_blockwise_linear_matches_emulated(precise_casts, compiled):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("F.scaled_mm's blockwise FP8 GEMM runs on Hopper")
    torch.manual_seed(0)
    fast = QuantizedLinear.from_linear(torch.nn.Linear(512, 1024, device="cuda"), RECIPE, native=True)
    ref = QuantizedLinear.from_linear(torch.nn.Linear(512, 1024, device="cuda"), RECIPE, native=False)
    ref.load_state_dict(fast.state_dict())
    torch._dynamo.reset()
    outs = []
    for mod in (torch.compile(fast) if compiled else fast, ref):
        x = torch.randn(2, 256, 512, generator=torch.Generator().manual_seed(3)).cuda().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).cuda().to(y.dtype))
        outs.append(
            (y.float(), x.grad.float(), fast.weight.grad.float() if mod is not ref else ref.weight.grad.float())
        )
    for got, want in zip(*outs):
        assert ((got - want).norm() / want.norm()).item() < 5e-3

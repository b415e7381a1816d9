"""The fused FP8 kernels against the reference quantizer: identical codes and scales (CUDA only)."""

import pytest
import torch

from lpbench.precision.formats import E4M3, E5M2
from lpbench.precision.quantize import delayed_encode_scale, quantize_fp8, update_amax_history

pytestmark = pytest.mark.gpu


def _kernels():
    from lpbench.precision.kernels import fp8

    return fp8


@pytest.mark.parametrize("shape", [(256, 512), (1000, 300), (64, 4096), (4097, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_transpose_matches_reference(shape, dtype, fmt):
    k = _kernels()
    x = (torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).to(dtype)
    amax = k.absmax(x)
    assert amax.item() == x.float().abs().max().item()
    q, qt, dec, _ = k.cast_transpose(x, amax, None, fmt.dtype, True)
    ref = quantize_fp8(x.cpu(), fmt)  # the CPU reference: IEEE arithmetic throughout
    assert torch.equal(q.cpu().view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(qt.cpu().view(torch.uint8), ref.codes.t().contiguous().view(torch.uint8))
    assert dec.item() == ref.scale.item()


def test_delayed_scale_and_history_match_reference():
    k = _kernels()
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * 3
    history = torch.rand(1024, device="cuda") * 5
    ref_history = history.clone()
    q, qt, dec, amax = k.cast_transpose(x, torch.zeros((), device="cuda"), history, E4M3.dtype, False)
    enc = delayed_encode_scale(ref_history.cpu(), x.cpu().float().abs().max(), E4M3)
    ref = quantize_fp8(x.cpu(), E4M3, encode_scale=enc)
    assert torch.equal(q.cpu().view(torch.uint8), ref.codes.view(torch.uint8)) and dec.item() == ref.scale.item()
    assert amax.item() == x.float().abs().max().item()
    k.update_amax_history(history, amax)
    update_amax_history(ref_history, amax)
    assert torch.equal(history, ref_history)


def test_empty_history_uses_the_given_amax():
    k = _kernels()
    x = torch.randn(128, 128, device="cuda")
    q, _, dec, _ = k.cast_transpose(x, k.absmax(x), torch.zeros(16, device="cuda"), E4M3.dtype, False)
    assert dec.item() == quantize_fp8(x.cpu(), E4M3).scale.item()


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_fast_linear_matches_emulated_reference(recipe):
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    torch.manual_seed(0)
    base = torch.nn.Linear(256, 384, bias=True, device="cuda")
    fast = QuantizedLinear.from_linear(base, get_recipe(recipe), native=True)
    ref = QuantizedLinear.from_linear(torch.nn.Linear(256, 384, device="cuda"), get_recipe(recipe), native=False)
    ref.load_state_dict(fast.state_dict())
    outs = []
    for mod in (fast, ref):
        x = torch.randn(4, 64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mod(x)
        dy = torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        y.backward(dy.to(y.dtype))
        outs.append((y.float(), x.grad.float(), mod.weight.grad.float(), mod.bias.grad.float()))
        mod.weight.grad = mod.bias.grad = None
    for a, b in zip(*outs):
        assert (a - b).norm() / b.norm() < 5e-3  # same codes and scales; BF16 outputs, other summation order

"""CPU BF16 GEMM routes: the FP32 route equals the BF16 route up to summation order."""

import pytest
import torch

from lpbench.errors import UsageError
from lpbench.models import build_model
from lpbench.models.decoder import Linear
from lpbench.models.registry import get_model_config, with_overrides
from lpbench import gemm
from lpbench.precision import RECIPES
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.quantize import quantize

QUANTIZED = [n for n, r in RECIPES.items() if r.quantized]


@pytest.fixture
def use_route(monkeypatch):
    def set_route(name):
        monkeypatch.setattr(gemm, "_route", name)

    return set_route


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of BF16 values at |t| (8 significant bits)."""
    _, e = torch.frexp(t.double().abs().clamp(min=2.0**-126))
    return torch.ldexp(torch.ones_like(t, dtype=torch.float64), e - 8)


def within_one_ulp(a, b):
    """BF16 results that differ at most by the rounding of a last bit (the sums' order differs)."""
    return bool(((a.double() - b.double()).abs() <= bf16_ulp(torch.maximum(a.double().abs(), b.double().abs()))).all())


def linear_run(route, use_route, x, w, b, autocast=True):
    use_route(route)
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = gemm.linear(x, w, b)
    y.backward(randn(*y.shape, seed=9).to(y.dtype))
    return y, x.grad, w.grad, b.grad


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "bf16-tensors"])
def test_linear_fp32_route_equals_bf16_route(use_route, autocast):
    dtype = torch.float32 if autocast else torch.bfloat16
    x, w, b = (
        randn(2, 48, 96, seed=1).to(dtype),
        randn(80, 96, seed=2, scale=0.1).to(dtype),
        randn(80, seed=3).to(dtype),
    )
    bf, fp = linear_run("bf16", use_route, x, w, b, autocast), linear_run("fp32", use_route, x, w, b, autocast)
    for a, c in zip(bf, fp):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert within_one_ulp(a, c)
    y = fp[0]
    assert y.dtype == torch.bfloat16
    exact = x.bfloat16().double() @ w.bfloat16().double().t() + b.bfloat16().double()
    assert within_one_ulp(y, exact)  # the FP32 route rounds the exact result, but for summation order
    assert torch.equal(fp[2], fp[2].bfloat16().to(fp[2].dtype))  # dW is rounded to BF16, as the BF16 GEMM rounds it


def test_fp32_route_off_for_fp32_compute_and_other_devices(use_route):
    use_route("fp32")
    x, w = randn(4, 8), randn(3, 8)
    assert torch.equal(gemm.linear(x, w), torch.nn.functional.linear(x, w))  # no autocast: FP32 as before
    assert gemm.fp32_route(x.bfloat16()) and not gemm.fp32_route(x)
    assert not gemm.fp32_route(torch.empty(1, device="meta", dtype=torch.bfloat16))
    use_route("bf16")
    assert not gemm.fp32_route(x.bfloat16())


def test_attention_fp32_route_close_to_bf16_route(use_route):
    q, k, v = (randn(2, 4, 32, 16, seed=s).bfloat16() for s in (1, 2, 3))
    outs = []
    for route in ("bf16", "fp32"):
        use_route(route)
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gemm.attention(*args, is_causal=True)
        out.backward(torch.ones_like(out))
        outs.append((out, *(a.grad for a in args)))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    for a, c in zip(*outs):
        assert a.dtype == c.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2)  # the BF16 kernel rounds P
    # the FP32 route is the exact attention rounded once
    assert within_one_ulp(outs[1][0], ref)


def model_step(route, use_route, precision=None):
    use_route(route)
    cfg = with_overrides(get_model_config("tiny"), n_layers=2, vocab_size=256)
    model = build_model(cfg, device="cpu", seed=0)
    if precision:
        from lpbench.convert.quantize import apply_recipe

        apply_recipe(model, RECIPES[precision], device="cpu")
    ids = randn(2, 32).abs().mul(100).long() % 256
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_decoder_under_autocast_same_on_both_routes(use_route):
    (loss_bf, g_bf), (loss_fp, g_fp) = model_step("bf16", use_route), model_step("fp32", use_route)
    assert isinstance(build_model(get_model_config("tiny"), device="meta").lm_head, Linear)
    assert abs(loss_bf.item() - loss_fp.item()) <= 1e-3 * loss_bf.item()
    for name in g_bf:
        a, c = g_bf[name].double().flatten(), g_fp[name].double().flatten()
        assert torch.nn.functional.cosine_similarity(a, c, dim=0) > 0.995, name


@pytest.mark.parametrize("name", QUANTIZED)
def test_emulated_recipe_gemms_same_on_both_routes(use_route, name):
    """Emulated GEMMs multiply BF16-exact operands in FP32 on both routes: bit-identical results."""
    recipe = RECIPES[name]
    x, w = randn(32, 128, seed=1), randn(128, 128, seed=2, scale=0.05)
    spec = recipe.operand("input", "fprop")
    assert torch.equal(quantize(x, spec).values().bfloat16().float(), quantize(x, spec).values())
    results = []
    for route in ("bf16", "fp32"):
        use_route(route)
        torch.manual_seed(0)  # stochastic rounding draws the same
        lin = QuantizedLinear(128, 128, bias=False, recipe=recipe)
        with torch.no_grad():
            lin.weight.copy_(w)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(xr)
        y.backward(randn(*y.shape, seed=3).to(y.dtype))
        results.append((y, xr.grad, lin.weight.grad))
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_route_forced_by_environment(monkeypatch):
    for value, expected in (("bf16", "bf16"), ("FP32", "fp32"), ("auto", "bf16" if gemm.native_bf16_cpu() else "fp32")):
        monkeypatch.setenv(gemm.ENV, value)
        monkeypatch.setattr(gemm, "_route", gemm.decide_route())
        assert gemm.route() == expected
    monkeypatch.setenv(gemm.ENV, "bf16")
    monkeypatch.setattr(gemm, "_route", gemm.decide_route())
    assert "native" in gemm.describe() and "LPBENCH_CPU_GEMM=bf16" in gemm.describe()
    monkeypatch.setenv(gemm.ENV, "fp32")
    monkeypatch.setattr(gemm, "_route", gemm.decide_route())
    assert gemm.describe() == "CPU BF16 GEMMs as FP32 (LPBENCH_CPU_GEMM=fp32)"
    monkeypatch.setenv(gemm.ENV, "fast")
    monkeypatch.setattr(gemm, "_route", gemm.decide_route())
    with pytest.raises(UsageError, match="LPBENCH_CPU_GEMM='fast'"):
        gemm.route()


def test_compiled_block_reads_the_route_without_a_graph_break(use_route):
    from torch._dynamo.testing import CompileCounter

    from lpbench.models.decoder import rope_tables

    use_route("fp32")
    cfg = with_overrides(get_model_config("tiny"), n_layers=1, vocab_size=256)
    block = build_model(cfg, device="cpu").layers[0]
    counter = CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    h = randn(2, 16, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(h, rope_tables(cfg, 16, "cpu")), block(h, rope_tables(cfg, 16, "cpu")))
    assert counter.frame_count == 1

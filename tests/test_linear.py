"""The quantized Linear: GEMM emulation, per-GEMM operand quantization, autograd, delayed scaling."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lpbench.precision import RECIPES
from lpbench.precision.linear import Emulated, NativeScaledMM, QuantizedLinear
from lpbench.precision.quantize import (
    QSpec,
    Scaling,
    apply_rht,
    quantize,
    quantize_fp8,
    quantize_mx,
    quantize_nvfp4,
    scale_to_float,
)
from lpbench.precision.formats import E4M3, E5M2

QUANTIZED = [n for n, r in RECIPES.items() if r.quantized]


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def deq(t, recipe, role, gemm):
    """``t`` quantized as a module's first cast of it does (delayed scaling: with the initial scale, 1.0)."""
    enc = torch.ones(()) if recipe.scaling is Scaling.DELAYED else None
    return quantize(t, recipe.operand(role, gemm), encode_scale=enc).dequantize().double()


def close(a, b, rtol=1e-5):
    """Equal up to FP32 accumulation order (relative to the output's scale)."""
    return (a.double() - b.double()).abs().max().item() <= rtol * b.double().abs().max().item()


@pytest.mark.parametrize(
    "qa,qb",
    [
        (lambda a: quantize_fp8(a, E5M2), lambda b: quantize_fp8(b, E4M3)),
        (lambda a: quantize_fp8(a, E4M3, (1, None), pow2=True), lambda b: quantize_fp8(b, E4M3, (1, None))),
        (lambda a: quantize_fp8(a, E4M3, (1, 128), pow2=True), lambda b: quantize_fp8(b, E4M3, (128, 128), pow2=True)),
        (lambda a: quantize_mx(a), lambda b: quantize_mx(b)),
        (lambda a: quantize_nvfp4(a), lambda b: quantize_nvfp4(b, block=(16, 16))),
    ],
    ids=["tensor", "row", "block", "mx", "nvfp4"],
)
def test_emulated_gemm_equals_gemm_of_dequantized(qa, qb):
    a, b = qa(randn(64, 256, seed=1)), qb(randn(128, 256, seed=2, scale=0.02))
    out = Emulated.gemm(a, b)
    assert out.dtype == torch.float32 and out.shape == (64, 128)
    assert close(out, a.dequantize().double() @ b.dequantize().double().t())


@pytest.mark.parametrize("name", QUANTIZED)
def test_forward_is_the_gemm_of_quantized_operands(name):
    r = RECIPES[name]
    lin = nn.Linear(256, 128)
    x = randn(2, 16, 256)
    y = QuantizedLinear.from_linear(lin, r)(x)
    ref = deq(x.reshape(32, 256), r, "input", "fprop") @ deq(lin.weight.detach(), r, "weight", "fprop").t()
    assert y.shape == (2, 16, 128) and y.dtype == torch.float32
    assert close(y.reshape(32, 128) - lin.bias.detach(), ref)


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"])
def test_backward_quantizes_each_gemm_along_its_own_reduction_dim(name):
    r = dataclasses.replace(RECIPES[name], stochastic_grads=False)  # deterministic, to compare exactly
    lin = nn.Linear(256, 128)
    with torch.no_grad():  # magnitudes vary along both dims, so row and column blocks differ
        lin.weight.copy_(randn(128, 256, seed=2) * torch.logspace(-3, 0, 256) * torch.logspace(0, -2, 128)[:, None])
    w = lin.weight.detach()
    x = randn(128, 256, seed=3).requires_grad_()  # 128 tokens: wgrad blocks divide without padding
    dy = randn(128, 128, seed=4, scale=1e-3)
    QuantizedLinear.from_linear(lin, r)(x).backward(dy)
    wgrad_layout = (lambda t: apply_rht(t.t())) if r.rht_wgrad else (lambda t: t.t())
    dx = deq(dy, r, "grad", "dgrad") @ deq(w.t(), r, "weight", "dgrad").t()
    dw = deq(wgrad_layout(dy), r, "grad", "wgrad") @ deq(wgrad_layout(x.detach()), r, "input", "wgrad").t()
    assert close(x.grad, dx) and close(lin.weight.grad, dw)
    assert torch.equal(lin.bias.grad, dy.sum(0))
    if r.scaling == "mx":  # the column-wise W copy is not the transposed row-wise copy
        wrong = deq(dy, r, "grad", "dgrad") @ deq(w, r, "weight", "fprop")
        assert not close(x.grad, wrong, rtol=1e-7)


@pytest.mark.parametrize("name", QUANTIZED + ["nvfp4-no-2d"])
def test_dgrad_weight_copy_is_the_weight_quantized_along_its_columns(name):
    """Square blocks reuse the fprop copy transposed; it must equal quantizing Wᵀ (codes and scales)."""
    from lpbench.precision import get_recipe

    r = get_recipe(name)
    w = randn(128, 256, seed=2) * torch.logspace(-3, 0, 256) * torch.logspace(0, -2, 128)[:, None]
    _, wd = QuantizedLinear.from_linear(nn.Linear(256, 128), r)._weight_operands(w, True)
    ref = quantize(
        w.t(), r.operand("weight", "dgrad"), encode_scale=torch.ones(()) if r.scaling is Scaling.DELAYED else None
    )  # delayed: the initial scale
    assert wd.block == ref.block and wd.codes.is_contiguous()
    assert torch.equal(wd.codes.view(torch.uint8), ref.codes.view(torch.uint8))
    assert wd.scale.dtype == ref.scale.dtype and torch.equal(scale_to_float(wd.scale), scale_to_float(ref.scale))


@pytest.mark.parametrize("name", QUANTIZED)
def test_gradients_close_to_bf16(name):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    x = randn(3, 40, 256).requires_grad_()  # 120 tokens: the wgrad token dim gets padded
    dy = randn(3, 40, 128, seed=5)
    (F.linear(x, lin.weight, lin.bias) * dy).sum().backward()
    ref_dx, ref_dw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    (QuantizedLinear.from_linear(lin, RECIPES[name])(x) * dy).sum().backward()
    bound = 0.97 if "fp4" in name else 0.998
    cos = lambda a, b: F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()  # noqa: E731
    assert cos(x.grad, ref_dx) > bound and cos(lin.weight.grad, ref_dw) > bound
    assert not torch.equal(x.grad, ref_dx)


def test_wgrad_in_bf16_for_gw_hp():
    lin = nn.Linear(64, 32)
    x = randn(16, 64).requires_grad_()
    dy = randn(16, 32, seed=1)
    QuantizedLinear.from_linear(lin, RECIPES["fp8-rowwise-gw-hp"])(x).backward(dy)
    assert torch.equal(lin.weight.grad, dy.t() @ x.detach())  # FP32 compute dtype: unquantized
    lin.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = QuantizedLinear.from_linear(lin, RECIPES["fp8-rowwise-gw-hp"])(x)
    y.backward(dy.bfloat16())
    ref = dy.bfloat16().float().t() @ x.detach().bfloat16().float()
    assert torch.equal(lin.weight.grad, ref)


@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8", "nvfp4"])
def test_autocast_dtypes(name):
    lin = nn.Linear(64, 32)
    x = randn(4, 64).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = QuantizedLinear.from_linear(lin, RECIPES[name])(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    assert lin.bias.grad.dtype == torch.float32
    assert QuantizedLinear.from_linear(lin, RECIPES[name])(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name, native, kernel",
    [
        ("fp8-tensorwise", True, "FusedFp8"),
        ("fp8-delayed", True, "FusedFp8"),
        ("fp8-rowwise", True, "NativeScaledMM"),
        ("fp8-blockwise", True, "NativeBlockwise"),
        ("mxfp8", True, "NativeBlockScaled"),
        ("nvfp4", True, "NativeBlockScaled"),
        ("fp8-tensorwise", False, "Emulated"),
        ("nvfp4", False, "Emulated"),
    ],
)
def test_one_kernel_per_module_chosen_at_construction(name, native, kernel):
    """The recipe's scaling and the path pick the module's kernel once; its repr names it."""
    q = QuantizedLinear(64, 32, recipe=RECIPES[name], native=native)
    assert q.kernel.name == kernel and q.native == native and f"kernel={kernel}" in repr(q)


def test_fused_kernel_falls_back_to_scaled_mm_for_shapes_it_does_not_take(monkeypatch):
    """Only the fused FP8 kernel has a shape fallback: a call whose tokens are not a multiple of 16 runs
    ``torch._scaled_mm`` through the operand kernel, with the same numbers as the emulation up to BF16 rounding."""
    calls, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape) or scaled_mm(*a, **k))
    q = QuantizedLinear(64, 32, recipe=RECIPES["fp8-rowwise"], native=True)
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    assert q.kernel.takes(x, q.weight.shape) and q.kernel.fallback is None
    fused = QuantizedLinear(64, 32, recipe=RECIPES["fp8-tensorwise"], native=True)
    assert not fused.kernel.takes(x, fused.weight.shape)  # CPU: the fused kernel takes CUDA tensors only
    with torch.no_grad():
        fused.weight.copy_(q.weight), fused.bias.copy_(q.bias)
        y = fused(x)
    emulated = QuantizedLinear(64, 32, recipe=RECIPES["fp8-tensorwise"], native=False)
    with torch.no_grad():
        emulated.weight.copy_(q.weight), emulated.bias.copy_(q.bias)
        want = emulated(x)
    assert calls == [(5, 64)]
    assert torch.allclose(y, want, rtol=1e-2, atol=1e-2)


def test_is_an_nn_linear_with_the_same_state_dict():
    lin = nn.Linear(64, 32)
    q = QuantizedLinear.from_linear(lin, RECIPES["mxfp8"])
    assert isinstance(q, nn.Linear) and q.weight is lin.weight and q.bias is lin.bias
    assert list(q.state_dict()) == list(lin.state_dict())
    assert "recipe=mxfp8, path=emulated" in repr(q)
    with pytest.raises(ValueError):
        QuantizedLinear(64, 32, recipe=RECIPES["bf16"])


def test_delayed_scaling_state_is_buffers_and_used_as_transformer_engine_does():
    r = RECIPES["fp8-delayed"]
    lin = nn.Linear(64, 32, bias=False)
    q = QuantizedLinear.from_linear(lin, r)
    roles = ("input", "weight", "grad")
    assert {f"{kind}_{role}" for kind in ("amax_history", "delayed_scale") for role in roles} <= set(q.state_dict())
    assert q.amax_history_input.shape == (1024,) and all(q.scale_buffer(role).item() == 1.0 for role in roles)
    x = randn(8, 64, scale=3).requires_grad_()
    dy = randn(8, 32, seed=1)
    w = lin.weight.detach()

    def expected(enc_x, enc_w):
        xq = quantize_fp8(x.detach(), E4M3, encode_scale=torch.tensor(enc_x)).dequantize().double()
        return xq @ quantize_fp8(w, E4M3, encode_scale=torch.tensor(enc_w)).dequantize().double().t()

    y = q(x)  # the first step casts with scale 1.0, reading no amax first
    assert close(y, expected(1.0, 1.0)) and not close(y, expected(448.0 / x.abs().max().item(), 1.0), rtol=1e-7)
    y.backward(dy)
    assert q.amax_history_input[0] == x.abs().max() and q.amax_history_weight[0] == w.abs().max()
    assert q.amax_history_grad[0] == dy.abs().max()
    for role, t, fmax in (("input", x, 448.0), ("weight", w, 448.0), ("grad", dy, 57344.0)):  # updated for step 2
        assert q.scale_buffer(role).item() == (torch.tensor(fmax, dtype=torch.float64) / t.abs().max()).float().item()
    q.amax_history_input[7] = 1000.0  # enters the next update, not the scale step 2 casts with
    y = q(x)
    assert close(y, expected(448.0 / x.abs().max().item(), 448.0 / w.abs().max().item()))
    assert q.amax_history_input[0] == x.abs().max() and q.amax_history_input[8] == 1000.0
    assert q.delayed_scale_input.item() == pytest.approx(0.448)
    q.to(torch.bfloat16)  # the state stays FP32 (a BF16 scale would change the codes)
    assert (
        q.weight.dtype == torch.bfloat16 and q.delayed_scale_input.dtype == q.amax_history_grad.dtype == torch.float32
    )
    assert q.delayed_scale_input.item() == pytest.approx(0.448)


def test_odd_token_counts_and_empty_input():
    for name in QUANTIZED:
        q = QuantizedLinear.from_linear(nn.Linear(128, 128), RECIPES[name])
        x = randn(5, 128).requires_grad_()
        q(x).sum().backward()
        assert x.grad.shape == (5, 128) and torch.isfinite(q.weight.grad).all()
        empty = torch.zeros(0, 128, requires_grad=True)
        assert q(empty).shape == (0, 128)


def test_nan_input_propagates():
    q = QuantizedLinear.from_linear(nn.Linear(64, 32), RECIPES["mxfp8"])
    x = randn(4, 64)
    x[1, 3] = math.nan
    y = q(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()


def test_qspec_dispatch_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="scaling"):
        quantize(torch.ones(4, 4), QSpec("int8", E4M3))


def test_native_qgemm_passes_fast_accumulation(monkeypatch):
    calls, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(
        torch,
        "_scaled_mm",
        lambda *a, use_fast_accum=False, **k: (
            calls.append(use_fast_accum) or scaled_mm(*a, use_fast_accum=use_fast_accum, **k)
        ),
    )
    a, b = quantize_fp8(torch.randn(32, 64), E4M3), quantize_fp8(torch.randn(48, 64), E4M3)
    fast, plain = NativeScaledMM.gemm(a, b, fast_accum=True), NativeScaledMM.gemm(a, b)
    assert calls == [True, False]
    assert fast.dtype == torch.bfloat16  # the native output, cast by mm (no FP32 round trip)
    assert torch.allclose(fast.float(), Emulated.gemm(a, b), rtol=1e-2, atol=1e-2) and torch.allclose(plain, fast)


@pytest.mark.parametrize(
    "name, fast", [("fp8-rowwise", [True, False, False]), ("fp8-rowwise-fast-grads", [True, True, True])]
)
def test_fast_grads_recipe_asks_for_fast_gradient_gemms_and_emulates_as_rowwise(monkeypatch, name, fast):
    """``fast_accum_grads`` changes the mode the native dgrad and wgrad GEMMs are asked for, nothing else: the
    emulation (FP32 accumulation throughout) is fp8-rowwise's bit for bit, the native result within its tolerance."""
    calls, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(
        torch,
        "_scaled_mm",
        lambda *a, use_fast_accum=False, **k: (
            calls.append(use_fast_accum) or scaled_mm(*a, use_fast_accum=use_fast_accum, **k)
        ),
    )
    lin, x, dy = nn.Linear(256, 384), randn(64, 256, seed=1), randn(64, 384, seed=2)

    def run(recipe, native):
        q = QuantizedLinear.from_linear(lin, RECIPES[recipe], native=native)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = q(xi)
        y.backward(dy.to(y.dtype))
        return [y.float(), xi.grad.float(), q.weight.grad.float()]

    native = run(name, True)
    assert calls == fast
    emulated, rowwise = run(name, False), run("fp8-rowwise", False)
    assert len(calls) == 3  # the emulation calls no native GEMM
    assert all(torch.equal(a, b) for a, b in zip(emulated, rowwise))
    assert all((a - b).norm() / b.norm() < 1e-2 for a, b in zip(native, emulated))


def test_one_autograd_function_for_every_quantized_linear(monkeypatch):
    """Trained, fused-FP8 and frozen (LoRA base) quantized linears all run QuantizedLinearFn, and the
    package defines no other autograd Function but those listed here, none of them a linear."""
    import ast
    import pathlib

    import lpbench
    from lpbench.precision import capability
    from lpbench.precision.frozen import FrozenQuantizedLinear

    not_linears = {
        "_Fp8GroupedFn": "MoE grouped GEMMs",
        "_GroupedIntoFn": "MoE grouped GEMMs in the compute dtype, weight gradients into FP32 buffers",
        "_AllToAll": "expert-parallel dispatch",
        "_AttachLoss": "MoE auxiliary loss",
        "_LinearCrossEntropy": "LM head fused with the loss",
        "_Start": "expert-parallel dispatch of one group of experts, started asynchronously",
        "_Wait": "the completion of that dispatch",
        "GradAllReduce": "hand-split tensor parallelism's entry (MoE experts, LoRA)",
        "AllReduce": "hand-split tensor parallelism's exit (MoE experts, LoRA)",
        "_ReduceScatterSeq": "LoRA's row-parallel exit under sequence parallelism",
        "_CastOnce": "a weight's BF16 copy, cast once per optimizer step",
        "_SwiGLU": "the MLP activation, with its hand-written backward",
        "_VocabParallelCrossEntropy": "tensor parallelism's loss over the LM head's vocabulary split",
    }
    root = pathlib.Path(lpbench.__file__).parent
    functions = {
        node.name
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in node.bases)
    }
    assert functions == {"QuantizedLinearFn", *not_linears}

    def grad_fn(mod):
        return type(mod(randn(32, 64).requires_grad_()).grad_fn).__name__

    trained = QuantizedLinear.from_linear(nn.Linear(64, 32), RECIPES["fp8-tensorwise"])
    frozen = FrozenQuantizedLinear.from_linear(trained)
    assert grad_fn(trained) == grad_fn(frozen) == "QuantizedLinearFnBackward"
    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: True)
    fused = QuantizedLinear.from_linear(nn.Linear(64, 32), RECIPES["fp8-tensorwise"], native=True)
    assert grad_fn(fused) == "QuantizedLinearFnBackward"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_a_frozen_base_runs_the_fused_fp8_kernel_with_the_fallbacks_numbers(monkeypatch, recipe, device):
    """A LoRA base stored in FP8 runs the fused FP8 kernel where it takes the call (its operands from the stored
    codes, Wᵀ's codes transposed), with the numbers of ``torch._scaled_mm`` on the stored operands (the shape
    fallback): outputs, input gradients and delayed scaling's histories bit for bit over three steps; and, in
    tensorwise scaling, those of the trained fused linear over the same weight. On CUDA the fused path casts with
    its Triton kernels and transposes the codes in tiles."""
    from lpbench.precision import capability
    from lpbench.precision.frozen import FrozenQuantizedLinear
    from lpbench.precision.kernels.fp8_linear import Fused

    takes = {"on": True}
    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: takes["on"])  # on CPU too (its _scaled_mm)
    linear = nn.Linear(64, 48, bias=False, device=device).requires_grad_(False)
    trained = QuantizedLinear.from_linear(linear, RECIPES[recipe], native=True)
    fused, fallback = (FrozenQuantizedLinear.from_linear(trained) for _ in range(2))
    assert issubclass(fused.kernel, Fused) and fused.kernel.fallback is NativeScaledMM

    def step(mod, seed, fuse):
        takes["on"] = fuse
        x = randn(32, 64, seed=seed).to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = mod(x)
        y.backward(randn(*y.shape, seed=seed + 10).to(device, y.dtype))
        return y, x.grad

    for seed in range(3):
        got, want = step(fused, seed, True), step(fallback, seed, False)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
        if recipe == "fp8-tensorwise":
            assert all(torch.equal(a, b) for a, b in zip(got, step(trained, seed, True))), seed
    for role in ("input", "grad") if recipe == "fp8-delayed" else ():
        assert torch.equal(fused.amax_history(role), fallback.amax_history(role))
        assert torch.equal(fused.scale_buffer(role), fallback.scale_buffer(role))

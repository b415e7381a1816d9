"""The experts' weight gradients accumulated in FP32 buffers by their GEMMs (convert/main_grads.py): the buffers
hold what autograd's ``.grad`` would, the weights get no gradient of their own, the optimizer step zeroes them, and
the training loop uses them only where no data-parallel wrapper reduces the experts' gradients."""

import copy
import dataclasses

import pytest
import torch

from lpbench.convert.quantize import quantize_experts

from lpbench.models.moe import MoE
from lpbench.models.registry import ModelConfig
from lpbench.convert import main_grads
from lpbench.precision.recipes import get_recipe

CFG = ModelConfig("moe-test", 1, 32, 64, 2, 2, 64, n_experts=4, top_k=2)
WEIGHTS = ("gate_up", "down")


def _moe(name: str, device: str = "cpu", cfg: ModelConfig = CFG) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg).to(device)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.router.weight.data[3] = -1.0  # with positive inputs expert 3 gets no token
    if name != "bf16":
        quantize_experts(moe.experts, get_recipe(name), native=device == "cuda")
    return moe


def _micro_batches(moe: MoE, xs, device: str) -> list[torch.Tensor]:
    """Forward and backward of each micro-batch (their loss summed); the inputs' gradients."""
    grads = []
    for x in xs:
        x = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = moe(x)
        y.float().square().sum().backward()
        grads.append(x.grad)
    return grads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["bf16", "fp8-rowwise", "fp8-tensorwise", "fp8-rowwise-gw-hp"])
def test_buffers_hold_the_accumulated_gradient(name, device):
    """Two micro-batches: each buffer holds the sum autograd accumulates in ``.grad`` while the weight gets none. FP8
    emulated (CPU): bit for bit (its weight gradients are FP32 either way). Natively (CUDA), and for BF16 on every
    device, the buffer adds FP32 products where autograd added them rounded to BF16, so they may differ by that
    rounding: at most 2^-8 of the sum of the two products' magnitudes, where a wrong or missing expert misses by
    the product itself. The data gradients do not change."""
    if device == "cuda" and name == "fp8-tensorwise":
        pytest.skip("natively its E5M2 gradients run per expert (the loop), which keeps autograd's .grad")
    xs = [torch.randn(2, 24, CFG.dim, generator=torch.Generator().manual_seed(s)).abs().to(device) for s in (1, 2)]
    plain = _moe(name, device)
    fused = copy.deepcopy(plain)
    grads = main_grads.install(fused, torch.optim.SGD(fused.parameters(), lr=0.0), list(fused.parameters()))
    assert grads is not None and len(grads.weights) == 2
    dx_plain = _micro_batches(plain, xs[:1], device)
    first = {n: getattr(plain.experts, n).grad.clone() for n in WEIGHTS}
    dx_plain += _micro_batches(plain, xs[1:], device)
    dx_fused = _micro_batches(fused, xs, device)
    assert all(getattr(fused.experts, n).grad is None for n in WEIGHTS)  # autograd handed the weights nothing
    grads.expose()
    exact = name != "bf16" and device == "cpu"
    for n in WEIGHTS:
        got, want = getattr(fused.experts, n).grad, getattr(plain.experts, n).grad
        assert got is fused.experts.gemm.main_grads[n]
        assert not want[3].any() and not got[3].any()  # the idle expert
        if exact:
            assert torch.equal(got, want), n
        else:
            bound = 2**-8 * (first[n].abs() + (want - first[n]).abs()) + 1e-30
            assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
            assert not torch.equal(got, torch.zeros_like(got))
    for a, b in zip(dx_fused, dx_plain):
        if exact or device == "cpu":
            assert torch.equal(a, b)
        else:
            assert (a - b).norm() <= 1e-2 * b.norm()


def test_the_optimizer_step_zeroes_the_buffers():
    moe = _moe("fp8-rowwise")
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    grads = main_grads.install(moe, opt, list(moe.parameters()))
    _micro_batches(moe, [torch.randn(2, 24, CFG.dim).abs()], "cpu")
    grads.expose()
    before = moe.experts.down.detach().clone()
    want = before.add(moe.experts.gemm.main_grads["down"], alpha=-0.1)
    opt.step()
    assert torch.equal(moe.experts.down.detach(), want)  # the step read the buffer as the gradient
    assert all(not b.any() for b in moe.experts.gemm.main_grads.values())
    grads.remove()
    assert moe.experts.gemm.main_grads == {}


def test_only_owned_grouped_experts_get_buffers():
    """Weights a data-parallel wrapper reduces (not among ``owned``), frozen experts and experts on the per-expert
    loop (a recipe without a grouped FP8 GEMM) keep autograd's ``.grad``."""
    moe = _moe("bf16")
    opt = torch.optim.SGD(moe.parameters(), lr=0.0)
    assert main_grads.install(moe, opt, [moe.router.weight]) is None
    moe.experts.down.requires_grad_(False)
    assert main_grads.install(moe, opt, list(moe.parameters())) is None
    assert main_grads.install(_moe("mxfp8"), opt, list(_moe("mxfp8").parameters())) is None


def test_training_with_the_buffers_is_autograds_training(monkeypatch):
    """Gradient accumulation on the CPU (FP8 emulated): the run with the buffers, which the loop installs and says
    so, trains bit-identically to the one without."""
    import lpbench.train.loop as loop
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS

    monkeypatch.setitem(MODELS, "moe-test", dataclasses.replace(CFG, n_layers=2, max_seq_len=64))
    cfg = RunConfig(
        model="moe-test", precision="fp8-rowwise", seq_len=16, mbs=1, gbs=2, steps=3, warmup_steps=1, device="cpu"
    )
    lines = []
    fused = loop.train(cfg, log=lines.append)
    assert any("4 expert weights' gradients accumulated in FP32" in line for line in lines)
    monkeypatch.setattr(main_grads, "install", lambda model, optimizer, owned: None)
    plain = loop.train(cfg, log=lambda line: None)
    assert [s["loss"] for s in fused.steps] == [s["loss"] for s in plain.steps]
    assert [s["grad_norm"] for s in fused.steps] == [s["grad_norm"] for s in plain.steps]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp8-rowwise"])
def test_compiled_training_with_the_buffers_on_cuda(monkeypatch, name):
    """On Hopper, compiled per block: the weight gradients go through lpbench's kernel into the buffers (an input the
    compiled backward mutates), and training follows autograd's up to the BF16 rounding of each product."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the kernel runs on SM 9.x")
    import lpbench.train.loop as loop
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS
    from lpbench.precision.kernels import grouped_mm

    monkeypatch.setitem(
        MODELS, "moe-test", dataclasses.replace(CFG, dim=256, ffn_dim=512, n_experts=8, n_layers=2, max_seq_len=512)
    )
    cfg = RunConfig(model="moe-test", precision=name, seq_len=256, mbs=2, gbs=4, steps=4, warmup_steps=1, device="cuda")
    calls, real = [], grouped_mm.wgrad_into
    monkeypatch.setattr(grouped_mm, "wgrad_into", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    fused = loop.train(cfg, log=lambda line: None)
    assert fused.status == "ok" and calls  # traced into the compiled backward
    monkeypatch.setattr(main_grads, "install", lambda model, optimizer, owned: None)
    plain = loop.train(cfg, log=lambda line: None)
    # the first step's gradient differs by the roundings only (a lost or doubled micro-batch moves it by ~30 %); after
    # the first updates the runs drift apart (Adam scales tiny differences; FP8 codes flip), so the losses less close
    assert fused.steps[0]["loss"] == plain.steps[0]["loss"]
    assert fused.steps[0]["grad_norm"] == pytest.approx(plain.steps[0]["grad_norm"], rel=1e-3)
    assert [s["loss"] for s in fused.steps] == pytest.approx([s["loss"] for s in plain.steps], rel=1e-2)

"""FP8 weights cast once per optimizer step (``convert/weight_cache.py``) train exactly as the
uncached linear, which casts the weight in every micro-batch's forward."""

import pytest
import torch
from torch import nn

from lpbench.convert.quantize import quantize_experts

from lpbench.convert import weight_cache
from lpbench.precision import capability
from lpbench.precision.kernels import fp8_linear
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.recipes import get_recipe


def _model(recipe: str, device="cpu") -> nn.Sequential:
    torch.manual_seed(0)
    r = get_recipe(recipe)
    return nn.Sequential(
        QuantizedLinear(64, 96, recipe=r, native=True, device=device),
        nn.GELU(),
        QuantizedLinear(96, 32, recipe=r, native=True, device=device),
    ).to(device)


def _train(model, cached: bool, steps=3, accum=2, device="cpu"):
    """Losses, final weights and histories of ``steps`` AdamW steps of ``accum`` micro-batches each."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cache = weight_cache.install(model, opt) if cached else None
    assert cached == (cache is not None)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            g = torch.Generator().manual_seed(100 * step + micro)
            x = torch.randn(32, 64, generator=g).to(device)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            (loss / accum).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, opt


def _assert_trained_alike(got, want, cached, plain, *optimizers):
    """Equal losses, final states (weights, histories) and, given two optimizers, AdamW second moments."""
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (name, a), b in zip(plain.state_dict().items(), cached.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(*(opt.state.values() for opt in optimizers)):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused FP8 linear and the cache on CPU (``torch._scaled_mm`` runs there; no Triton: the torch cast)."""
    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: True)
    monkeypatch.setattr(weight_cache, "eligible", lambda m: isinstance(m, QuantizedLinear))
    casts = []
    quantize = fp8_linear._quantize

    def counting(mod, role, *args, **kwargs):
        casts.append(role)
        return quantize(mod, role, *args, **kwargs)

    monkeypatch.setattr(fp8_linear, "_quantize", counting)
    return casts


@pytest.mark.parametrize("recipe, accum", [("fp8-tensorwise", 2), ("fp8-delayed", 1)])
def test_cached_weights_train_exactly_like_uncached(fused_on_cpu, recipe, accum):
    """Same losses, weights, optimizer states and histories; the weight cast once per optimizer step."""
    plain, cached = _model(recipe), _model(recipe)
    want, opt_plain = _train(plain, cached=False, accum=accum)
    n_plain = fused_on_cpu.count("weight")
    got, opt_cached = _train(cached, cached=True, accum=accum)
    assert n_plain == 2 * 3 * accum  # two linears, every micro-batch
    assert fused_on_cpu.count("weight") - n_plain == 2 * 3  # once per optimizer step
    _assert_trained_alike(got, want, cached, plain, opt_plain, opt_cached)


def test_delayed_weight_keeps_one_scale_through_the_step(fused_on_cpu):
    """Delayed scaling with accumulation: the weight's codes of the step's first micro-batch serve them
    all (as Transformer Engine's first-micro-batch weight cache), its amax recorded once per step."""
    model = _model("fp8-delayed")
    seen = []
    operands = fp8_linear.Fused.operands

    def spy(mod, t, role, *args):
        out = operands(mod, t, role, *args)
        if mod is model[0] and role == "weight":
            seen.append((out[0][0].clone(), out[0][1].clone()))
        return out

    fp8_linear.Fused.operands = staticmethod(spy)
    try:
        _train(model, cached=True, steps=2, accum=3)
    finally:
        fp8_linear.Fused.operands = staticmethod(operands)
    assert len(seen) == 6
    for step in (seen[:3], seen[3:]):
        assert all(
            torch.equal(c.view(torch.uint8), step[0][0].view(torch.uint8)) and torch.equal(s, step[0][1])
            for c, s in step
        )
    assert not torch.equal(seen[0][0].view(torch.uint8), seen[3][0].view(torch.uint8))  # the step changed it
    assert int((model[0].amax_history_weight > 0).sum()) == 2


def test_a_weight_changed_in_place_is_cast_again(fused_on_cpu):
    plain, cached = _model("fp8-tensorwise"), _model("fp8-tensorwise")
    _train(plain, cached=False, steps=1)
    _, opt = _train(cached, cached=True, steps=1)
    x = torch.randn(32, 64)
    with torch.no_grad():
        for m in (plain, cached):
            m[0].weight.mul_(0.5)  # bumps the version counter
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(plain(x), cached(x))


def test_cache_buffers_stay_out_of_checkpoints(fused_on_cpu):
    model = _model("fp8-tensorwise")
    keys = set(model.state_dict())
    _train(model, cached=True, steps=1)
    assert set(model.state_dict()) == keys
    assert model[0].fp8_weight.dtype == torch.float8_e4m3fn and model[0].fp8_weight_t.shape == (64, 96)


def test_only_native_per_tensor_linears_are_eligible():
    lin = QuantizedLinear(64, 96, recipe=get_recipe("fp8-tensorwise"), native=True)
    assert not weight_cache.eligible(lin)  # CPU weight: the fused FP8 linear does not take it
    assert not weight_cache.eligible(nn.Linear(64, 96))
    opt = torch.optim.AdamW(lin.parameters())
    assert weight_cache.install(lin, opt) is None and not hasattr(lin, "fp8_weight")


def test_the_optimizer_step_alone_makes_linears_and_experts_stale(fused_on_cpu, monkeypatch):
    """One cache, one invalidation: after ``optimizer.step()`` (the fused AdamW leaves version counters alone)
    the next forward quantizes the dense linears and the grouped experts again, with no other call, and the
    model trains exactly as uncached."""
    from lpbench.models.moe import MoE
    from lpbench.models.registry import ModelConfig
    from lpbench.precision import grouped

    def model():
        torch.manual_seed(0)
        moe = MoE(ModelConfig("moe", 1, 32, 64, 2, 2, 64, n_experts=4, top_k=2))
        quantize_experts(moe.experts, get_recipe("fp8-rowwise"), native=False)
        for p in moe.experts.parameters():
            nn.init.normal_(p, std=0.2)
        return nn.Sequential(QuantizedLinear(64, 32, recipe=get_recipe("fp8-tensorwise"), native=True), moe)

    made = []
    quantize = grouped.weight_codes
    monkeypatch.setattr(
        weight_cache, "weight_codes", lambda w, recipe, split: made.append(w) or quantize(w, recipe, split)
    )
    plain, cached = model(), model()
    want, opt_plain = _train(plain, cached=False)
    got, opt_cached = _train(cached, cached=True)
    assert fused_on_cpu.count("weight") == 2 * 3 + 3 and len(made) == 2 * 3  # uncached: every micro-batch
    _assert_trained_alike(got, want, cached, plain)
    assert not cached[1].experts.gemm.codes  # the last step dropped them: stale codes are not held


def test_training_loop_refills_after_the_optimizer_step_without_changing_training(fused_on_cpu, monkeypatch, tmp_path):
    """The loop casts the next step's weights right after the optimizer step (not after the last step, nor before
    an evaluation or a checkpoint save); fp8-delayed trains bit-identically with and without that, with
    evaluations (evaluate restores the amaxes its refill recorded, so the cache is cast again) and resumed from a
    checkpoint (which holds the amaxes from before the cast)."""
    from lpbench.config import RunConfig
    from lpbench.train import loop

    monkeypatch.setattr(capability, "why_emulated", lambda recipe, device: None)  # native: the fused linears
    cfg = RunConfig(
        model="tiny",
        precision="fp8-delayed",
        seq_len=32,
        mbs=2,
        gbs=4,
        steps=6,
        warmup_steps=1,
        device="cpu",
        log_interval=100,
    )
    by_loop = []
    refresh = weight_cache.WeightCache.refresh

    def spy(cache, *hook_args):
        if not hook_args:  # called by the loop, not as the forward pre-hook
            by_loop.append(sum(v is None for v in cache.versions))
        refresh(cache, *hook_args)

    monkeypatch.setattr(weight_cache.WeightCache, "refresh", spy)

    def losses(**changes):
        return [s["loss"] for s in loop.train(cfg.with_(**changes), log=lambda line: None).steps]

    plain = losses()
    n_linears = by_loop[0]
    assert n_linears > 0 and by_loop == [n_linears] * 5  # after steps 1-5, every weight stale
    by_loop.clear()
    assert losses(eval_every=2, eval_batches=2) == plain
    assert len(by_loop) == 3  # after steps 1, 3 and 5
    assert losses(save_every=3, save_dir=str(tmp_path)) == plain
    assert losses(load=str(tmp_path / "step-3")) == plain[3:]
    monkeypatch.setattr(loop, "prefetch_weights", lambda *args: False)
    assert losses() == plain


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, accum", [("fp8-tensorwise", 2), ("fp8-delayed", 1)])
def test_cached_weights_train_exactly_like_uncached_on_cuda(recipe, accum):
    """On CUDA the cache is filled by the one-pass Triton cast into its buffers."""
    plain, cached = _model(recipe, "cuda"), _model(recipe, "cuda")
    assert all(weight_cache.eligible(m) for m in (cached[0], cached[2]))
    want, _ = _train(plain, cached=False, accum=accum, device="cuda")
    got, _ = _train(cached, cached=True, accum=accum, device="cuda")
    _assert_trained_alike(got, want, cached, plain)


def _bf16_model(device="cpu") -> nn.Sequential:
    """The decoder's Linear and a BF16 MoE layer, FP32 weights (the BF16 recipe's model)."""
    from lpbench.models.decoder import Linear
    from lpbench.models.moe import MoE
    from lpbench.models.registry import ModelConfig

    torch.manual_seed(0)
    moe = MoE(ModelConfig("moe", 1, 32, 64, 2, 2, 64, n_experts=4, top_k=2))
    for p in moe.experts.parameters():
        nn.init.normal_(p, std=0.2)
    return nn.Sequential(Linear(64, 32), moe).to(device)


@pytest.fixture
def bf16_on_cpu(monkeypatch):
    """The BF16 cache on CPU, through autocast's BF16 GEMMs (not the FP32 route of CPUs without BF16)."""
    from lpbench import gemm

    monkeypatch.setattr(gemm, "fp32_route", lambda x: False)
    monkeypatch.setattr(weight_cache, "_plain_fp32_on_cuda", lambda w: w.dtype == torch.float32)


def test_bf16_weights_cast_once_per_step_train_exactly_like_autocast(bf16_on_cpu):
    """The BF16 recipe with the cache: the decoder's linear and the BF16 experts take their weights' BF16 copies,
    made once per optimizer step; losses, weights and optimizer states equal autocast's casts in every forward."""
    plain, cached = _bf16_model(), _bf16_model()
    want, opt_plain = _train(plain, cached=False)
    got, opt_cached = _train(cached, cached=True)
    assert cached[0].bf16_weight.dtype == torch.bfloat16
    assert set(cached[1].experts.gemm.codes) == set()  # the last step dropped the experts' copies
    _assert_trained_alike(got, want, cached, plain, opt_plain, opt_cached)


def test_the_bf16_copy_is_what_the_forward_reads_and_only_under_bf16_autocast(bf16_on_cpu):
    model = _bf16_model()
    cache = weight_cache.install(model, torch.optim.AdamW(model.parameters()))
    assert cache is not None and cache.bf16_linears == [model[0]] and cache.experts == [model[1].experts]
    x = torch.randn(8, 64)
    lin = model[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))  # made at install
        model(x)  # the pre-hook fills the copies
        lin.bf16_weight.mul_(2)  # a copy that no longer is the weight's: the forward must show it
        assert torch.equal(lin(x), nn.functional.linear(x, 2 * lin.weight.detach(), lin.bias))
    assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))  # no autocast: the FP32 weight
    assert weight_cache.install(_bf16_model(), torch.optim.AdamW(model.parameters()), bf16=False) is None


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_weights_cast_once_per_step_train_exactly_like_autocast_on_cuda(compiled):
    """On CUDA: the decoder's linear and the grouped BF16 experts (torch's grouped GEMM), eager and compiled."""
    plain, cached = _bf16_model("cuda"), _bf16_model("cuda")
    assert weight_cache.bf16_eligible(cached[0]) and weight_cache.bf16_eligible(cached[1].experts)
    if compiled:
        torch._dynamo.reset()
        plain[0].compile()
        cached[0].compile()
    want, _ = _train(plain, cached=False, device="cuda")
    got, _ = _train(cached, cached=True, device="cuda")
    _assert_trained_alike(got, want, cached, plain)

"""LoRA: only adapters train, the base stays bit-for-bit, merging preserves the output; FLOPs."""

import dataclasses

import pytest
import torch

from lpbench.errors import UsageError
from lpbench.metrics.flops import (
    flops_per_token,
    lora_adapter_flops_per_token,
    lora_flops_per_token,
    packed_flops_per_token,
    tflops_per_gpu,
)
from lpbench.models import MODELS, build_model
from lpbench.convert.lora import (
    ExpertLoRA,
    LoRAExperts,
    LoRALinear,
    apply_lora,
    lora_parameters,
    lora_state_dict,
    merge_lora,
)
from lpbench.models.decoder import expand_targets

TINY = dataclasses.replace(MODELS["tiny"], n_layers=2, vocab_size=256)
X = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def train_steps(model, steps=3, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    for _ in range(steps):
        model(X, X.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_apply_lora_wraps_targets_freezes_the_rest_and_starts_at_the_base_output():
    model = build_model(TINY, device="cpu", seed=0)
    with torch.no_grad():
        before = model(X)
    info = apply_lora(model, rank=4, alpha=8, targets="qkv,o,mlp")
    assert info["adapted"] == [
        f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    ]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.rsplit(".", 1)[1] in ("lora_a", "lora_b") for n in trainable)
    assert info["trainable"] == sum(
        4 * (m.in_features + m.out_features) for m in model.modules() if isinstance(m, LoRALinear)
    )
    qkv = model.layers[0].attn.qkv
    assert qkv.scaling == 2.0 and qkv.lora_b.abs().max() == 0 and qkv.lora_a.abs().max() > 0
    with torch.no_grad():
        torch.testing.assert_close(model(X), before, rtol=0, atol=0)  # B = 0: the base model exactly
    with pytest.raises(UsageError, match="already"):
        apply_lora(model, rank=4)


def test_only_adapters_train_and_the_base_is_bit_for_bit_unchanged():
    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=4, alpha=8)
    base = snapshot(model)
    adapters = {n: t.clone() for n, t in lora_state_dict(model).items()}
    with torch.no_grad():
        start = model(X)
    train_steps(model)
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base[n]), n
            assert p.grad is None
    assert all(not torch.equal(t, adapters[n]) for n, t in lora_state_dict(model).items())
    with torch.no_grad():
        assert not torch.allclose(model(X), start, atol=1e-4)


def test_merged_model_equals_the_adapted_model_and_exports(tmp_path):
    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=4, alpha=16, targets=("qkv", "o", "mlp"))
    train_steps(model)
    with torch.no_grad():
        adapted = model(X)
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(dict(model.named_parameters())) == set(dict(build_model(TINY, device="meta").named_parameters()))
    with torch.no_grad():
        merged = model(X)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(merged, build_model(TINY, device="cpu", seed=0)(X), atol=1e-4)

    pytest.importorskip("safetensors")
    from lpbench.models.hf import export_hf_checkpoint, load_hf_checkpoint

    export_hf_checkpoint(model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(load_hf_checkpoint(tmp_path)(X), adapted, rtol=1e-5, atol=1e-5)


def test_export_of_unmerged_adapters_says_merge_first(tmp_path):
    pytest.importorskip("safetensors")
    from lpbench.models.hf import export_hf_checkpoint

    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=2)
    with pytest.raises(UsageError, match="merge_lora"):
        export_hf_checkpoint(model, tmp_path)


def test_targets():
    assert expand_targets("qkv, mlp") == ("qkv", "gate_up", "up", "down")
    with pytest.raises(UsageError, match="unknown LoRA target 'v'"):
        expand_targets(["v"])
    model = build_model(TINY, device="cpu", seed=0)
    assert apply_lora(model, rank=2, targets=["o"])["adapted"] == ["layers.0.attn.o", "layers.1.attn.o"]
    moe = build_model(dataclasses.replace(TINY, n_experts=2, top_k=1), device="cpu", seed=0)
    info = apply_lora(moe, rank=2, targets="mlp,o")
    assert info["adapted"] == [
        f"layers.{i}.{m}"
        for i in range(2)  # stacked experts adapted, routers not
        for m in ("attn.o", "mlp.experts.gate_up", "mlp.experts.down")
    ]
    assert not moe.layers[0].mlp.router.weight.requires_grad and not moe.layers[0].mlp.experts.down.requires_grad
    assert moe.layers[0].mlp.experts.gemm.adapters["down"].lora_b.shape == (2, TINY.dim, 2)
    nogated = build_model(dataclasses.replace(TINY, activation="gelu"), device="cpu", seed=0)
    assert apply_lora(nogated, rank=2, targets="mlp")["adapted"][:2] == ["layers.0.mlp.up", "layers.0.mlp.down"]


MOE = dataclasses.replace(TINY, n_experts=4, top_k=2)


def test_expert_adapters_add_each_experts_own_low_rank_update():
    """Every expert's tokens get scaling · (x Aₑᵀ) Bₑᵀ from that expert's adapter (idle experts included)."""
    from lpbench.precision.grouped import Groups

    torch.manual_seed(0)
    w = torch.randn(4, 24, 16)
    lora = ExpertLoRA(w, rank=3, alpha=6, generator=torch.Generator().manual_seed(1))
    torch.nn.init.normal_(lora.lora_b)
    expert = torch.tensor([0, 0, 0, 2, 2, 3])  # expert 1 gets no token
    groups, dest = Groups.of(expert, 4)
    x = torch.randn(6, 16)
    buf = x.new_zeros(groups.rows, 16).index_put((dest,), x)
    got = lora.delta(buf, groups)[dest]
    want = torch.stack([2.0 * (x[i] @ lora.lora_a[e].T) @ lora.lora_b[e].T for i, e in enumerate(expert.tolist())])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_adapters_train_alone_and_merge_into_the_experts():
    model = build_model(MOE, device="cpu", seed=0)
    apply_lora(model, rank=4, targets="mlp")
    base = snapshot(model)
    train_steps(model)
    experts = model.layers[0].mlp.experts
    assert experts.gemm.adapters["gate_up"].lora_b.abs().sum() > 0  # the expert adapters learned
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        adapted = model(X)
        merged = merge_lora(model)(X)
    assert not lora_parameters(model) and not isinstance(experts.gemm, LoRAExperts)
    assert not torch.equal(experts.gate_up, base["layers.0.mlp.experts.gate_up"])
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)


def test_frozen_base_in_bf16_under_autocast():
    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=4, base_dtype=torch.bfloat16)
    assert model.layers[0].attn.qkv.base.weight.dtype == torch.bfloat16
    assert model.layers[0].attn.qkv.lora_a.dtype == torch.float32
    base = snapshot(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(X, X.roll(-1, 1))
    loss.backward()
    assert all(p.grad is not None for p in lora_parameters(model))
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("order", ["recipe-then-lora", "lora-then-recipe"])
def test_lora_over_a_quantized_base(order):
    policy = pytest.importorskip("lpbench.convert.quantize")
    from lpbench.precision.linear import QuantizedLinear

    model = build_model(TINY, device="cpu", seed=0)
    if order == "recipe-then-lora":
        policy.apply_recipe(model, "fp8-tensorwise", device="cpu", emulate=True)
        apply_lora(model, rank=4, alpha=8)
    else:
        apply_lora(model, rank=4, alpha=8)
        policy.apply_recipe(model, "fp8-tensorwise", device="cpu", emulate=True)
    qkv = model.layers[0].attn.qkv
    assert isinstance(qkv, LoRALinear) and isinstance(qkv.base, QuantizedLinear)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == 2 * 4  # the bases, not adapters
    base = snapshot(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train_steps(model, steps=2)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
    assert lora_parameters(model)[1].abs().max() > 0  # B of the first adapter moved
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        adapted = model(X)
        merge_lora(model)
        assert isinstance(model.layers[0].attn.qkv, QuantizedLinear)
        merged = model(X)
    # merged weights are re-quantized, so the outputs agree to FP8 precision only
    assert (merged.float() - adapted.float()).abs().mean() < 0.05 * adapted.float().abs().mean()


# --------------------------------------------------------------------------- FLOPs


def test_lora_flops_rule():
    cfg = MODELS["llama3-8b"]
    for formula in ("megatron", "nemo-legacy", "mha"):
        dense = flops_per_token(cfg, 0, formula)
        attn = flops_per_token(cfg, 8192, formula) - dense
        assert lora_flops_per_token(cfg, 8192, formula) == pytest.approx(2 / 3 * dense + attn, rel=1e-12)
    # 2/3 of SFT's GEMMs, attention in full, per sample when packed
    lengths = [[500, 1500], [2048]]
    sft = packed_flops_per_token(cfg, 2048, lengths)
    lora = lora_flops_per_token(cfg, 2048, sample_lengths=lengths)
    assert sft - lora == pytest.approx(flops_per_token(cfg, 0) / 3, rel=1e-12)


def test_adapter_flops_are_six_per_adapter_parameter():
    cfg = TINY
    model = build_model(cfg, device="meta")
    info = apply_lora(model, rank=8, targets="qkv,o,mlp")
    assert lora_adapter_flops_per_token(cfg, 8) == 6 * info["trainable"]
    assert lora_flops_per_token(cfg, 64, rank=8) == pytest.approx(lora_flops_per_token(cfg, 64) + 6 * info["trainable"])
    big = MODELS["llama3-8b"]  # small next to the model: < 1% at rank 16
    assert lora_adapter_flops_per_token(big, 16) < 0.01 * lora_flops_per_token(big, 16384)


def test_lora_flops_reproduce_nemo_llama3_8b_table():
    # NeMo 25.04 fine-tuning table, GB200, SQuAD packed to 16384 (same packing as the SFT row):
    # LoRA 44,281 tok/s <-> 1,342 TFLOP/s; SFT 33,437 <-> 1,515. One attention length fits both.
    cfg = MODELS["llama3-8b"]
    squad_like = [[180] * 91]
    lora = lora_flops_per_token(cfg, 16384, "nemo-legacy", sample_lengths=squad_like)
    sft = packed_flops_per_token(cfg, 16384, squad_like, "nemo-legacy")
    assert tflops_per_gpu(lora, 44281) == pytest.approx(1342, rel=0.002)
    assert tflops_per_gpu(sft, 33437) == pytest.approx(1515, rel=0.002)
    assert lora / sft == pytest.approx(2 / 3, rel=0.01)


def test_adapters_merged_into_a_stored_quantized_base_export_to_hf_and_back(tmp_path):
    """The base stored as FP8 codes, adapters trained, merged (W = dequantized codes + scaling B A) and
    exported as HF safetensors: the checkpoint read back holds exactly the merged weights."""
    pytest.importorskip("safetensors")
    from lpbench.convert.quantize import apply_recipe, store_frozen_quantized
    from lpbench.models.hf import export_hf_checkpoint, load_hf_checkpoint
    from lpbench.precision.frozen import FrozenQuantizedLinear

    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=4, alpha=8)
    apply_recipe(model, "fp8-tensorwise", device="cpu", emulate=True)
    assert store_frozen_quantized(model)
    base = model.layers[0].attn.qkv.base
    assert isinstance(base, FrozenQuantizedLinear)
    train_steps(model, steps=1)
    expected = base.dequantized() + model.layers[0].attn.qkv.delta_weight()
    merge_lora(model)
    export_hf_checkpoint(model, tmp_path / "hf", dtype=torch.float32)
    back = load_hf_checkpoint(tmp_path / "hf")
    torch.testing.assert_close(back.layers[0].attn.qkv.weight, expected, rtol=0, atol=0)
    merged = dict(model.named_parameters())
    for name, p in back.named_parameters():
        assert torch.equal(p, merged[name].float()), name


def test_a_stored_base_shards_under_an_fsdp2_that_makes_its_parameters_requiring_grad(monkeypatch):
    """FSDP2 of some torch versions (2.11 among them) makes each shard ``nn.Parameter(shard)`` and sets
    ``requires_grad`` afterwards, which an integer dtype refuses (pytorch/pytorch#177844): emulated here, a base stored as uint8 bytes still shards on
    one gloo rank, its bytes frozen and unchanged."""
    from types import ModuleType

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from lpbench.convert.quantize import apply_recipe, store_frozen_quantized
    from lpbench.parallel.dp import apply_fsdp, one_rank_mesh
    from lpbench.parallel.env import shutdown

    class GradFirstParameter(torch.nn.Parameter):
        def __new__(cls, data=None, requires_grad=True):
            p = torch.nn.Parameter(data)  # requires_grad=True, as those versions make it
            return p.requires_grad_(requires_grad)

    old_nn = ModuleType("nn")
    old_nn.__dict__.update(vars(torch.nn), Parameter=GradFirstParameter)
    monkeypatch.setattr(_fsdp_param, "nn", old_nn)
    model = build_model(TINY, device="cpu", seed=0)
    apply_lora(model, rank=4, alpha=8)
    apply_recipe(model, "fp8-tensorwise", device="cpu", emulate=True)
    assert store_frozen_quantized(model)
    stored = {n: p.clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    try:
        apply_fsdp(model, one_rank_mesh(torch.device("cpu")), None)
    finally:
        shutdown()
    sharded = {n: p for n, p in model.named_parameters() if n in stored}
    assert stored and sharded.keys() == stored.keys()
    assert all(not p.requires_grad and torch.equal(p.full_tensor(), stored[n]) for n, p in sharded.items())

import dataclasses

import pytest
import torch

from lpbench.models import MODELS, build_model, count_active_parameters, count_parameters
from lpbench.models.decoder import apply_rope, rope_tables


@pytest.mark.parametrize(
    "name,billions",
    [("llama3-8b", 8.03), ("llama3.2-1b", 1.24), ("llama3-70b", 70.6), ("qwen3-4b", 4.02), ("mixtral-8x7b", 46.7)],
)
def test_parameter_counts_on_meta(name, billions):
    model = build_model(MODELS[name], device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert round(count_parameters(model) / 1e9, 2 if billions < 10 else 1) == billions


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3)])
def test_moe_total_and_active_parameters(name, total, active):
    """The published sizes: Mixtral 8x7B 46.7 B total / 12.9 B active, Qwen3-30B-A3B 30.5 B / 3.3 B."""
    model = build_model(MODELS[name], device="meta")
    assert round(count_parameters(model) / 1e9, 1) == total
    assert abs(count_active_parameters(model) / 1e9 - active) < 0.06  # 3.35 B: Qwen writes 3.3 B


def tiny_variant(**kw):
    return dataclasses.replace(MODELS["tiny"], **kw)


VARIANTS = {
    "llama": tiny_variant(),
    "qwen3": tiny_variant(head_dim=48, qk_norm=True, tie_embeddings=True),
    "nemotron4": tiny_variant(norm="layer", activation="sqrelu", rope_fraction=0.5, tie_embeddings=False),
    "gpt3": tiny_variant(norm="layer", activation="gelu", positions="learned", bias=True, n_kv_heads=4),
    "mixtral": tiny_variant(n_experts=4, top_k=2),
}


@pytest.mark.parametrize("family", VARIANTS)
def test_every_family_is_causal_and_trains(family):
    cfg = VARIANTS[family]
    model = build_model(cfg, device="cpu", seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.shape == (2, 32, cfg.vocab_size)
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % cfg.vocab_size
    logits2 = model(x2)
    torch.testing.assert_close(logits[:, :20], logits2[:, :20])  # the future cannot leak backwards
    assert not torch.allclose(logits[:, 20:], logits2[:, 20:])
    loss = model(x, x.roll(-1, 1))
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" not in n)


def test_structure_matches_architecture_flags():
    nem = build_model(VARIANTS["nemotron4"], device="meta")
    assert isinstance(nem.layers[0].attn_norm, torch.nn.LayerNorm)
    assert hasattr(nem.layers[0].mlp, "up") and not hasattr(nem.layers[0].mlp, "gate_up")
    qwen = build_model(VARIANTS["qwen3"], device="meta")
    assert qwen.layers[0].attn.q_norm is not None
    assert qwen.layers[0].attn.qkv.out_features == (4 + 2 * 2) * 48
    assert qwen.lm_head.weight is qwen.tok_embeddings.weight
    gpt = build_model(VARIANTS["gpt3"], device="meta")
    assert gpt.pos_embeddings is not None and gpt.layers[0].attn.qkv.bias is not None
    assert build_model(VARIANTS["llama"], device="meta").pos_embeddings is None


def test_partial_rope_rotates_only_its_share():
    cfg = VARIANTS["nemotron4"]
    cos, sin = rope_tables(cfg, 8, torch.device("cpu"))
    assert cos.shape == (8, cfg.hd // 2)
    x = torch.randn(1, 8, 2, cfg.hd)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[..., cfg.hd // 2 :], x[..., cfg.hd // 2 :])
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep norms

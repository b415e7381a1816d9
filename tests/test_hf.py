"""Hugging Face interop: tiny transformers models in, lpbench logits identical, export back out."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from lpbench.errors import UsageError  # noqa: E402
from lpbench.models import MODELS, build_model  # noqa: E402
from lpbench.models.hf import (  # noqa: E402
    config_from_hf,
    export_hf_checkpoint,
    hf_weight_map,
    load_hf_checkpoint,
)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_model(kind: str, **kw):
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**TINY, "head_dim": 32, "tie_word_embeddings": True, **kw})
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            **{**TINY, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING, "max_position_embeddings": 256, **kw}
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a mix-up shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


INPUT = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
CASES = {
    "llama": ("llama", {}, {}),
    "llama-sharded": ("llama", {}, {"max_shard_size": "40KB"}),
    "llama-bias-tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, {}),
    "qwen3": ("qwen3", {}, {}),
    "qwen3-sharded-untied": ("qwen3", {"tie_word_embeddings": False}, {"max_shard_size": "40KB"}),
}


@pytest.mark.parametrize("case", CASES)
def test_hf_checkpoint_loads_with_identical_logits_and_exports_back(case, tmp_path):
    kind, cfg_kw, save_kw = CASES[case]
    ref = hf_model(kind, **cfg_kw)
    ref.save_pretrained(tmp_path / "hf", **save_kw)
    if "max_shard_size" in save_kw:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    expected = hf_logits(ref, INPUT)

    model = load_hf_checkpoint(tmp_path / "hf")
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert (model.lm_head.weight is model.tok_embeddings.weight) == ref.config.tie_word_embeddings
    with torch.no_grad():
        got = model(INPUT)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert expected.std() > 0.1  # logits large enough for the tolerance to mean something

    export_hf_checkpoint(model, tmp_path / "out")
    back = type(ref).from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(hf_logits(back, INPUT), expected, rtol=1e-5, atol=1e-5)
    for name, p in ref.state_dict().items():  # the weights themselves, bit for bit
        torch.testing.assert_close(back.state_dict()[name], p, rtol=0, atol=0)


def test_llama3_rope_scaling_is_read_and_matters(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    cfg = config_from_hf(tmp_path)
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 32) and cfg.rope_theta == 500000.0
    model = load_hf_checkpoint(tmp_path)
    plain = build_model(cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}), device="cpu")
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(INPUT), hf_logits(ref, INPUT), atol=1e-3)


def test_export_stores_requested_dtype_and_roundtrips_into_lpbench(tmp_path):
    model = build_model(MODELS["tiny"], device="cpu", seed=3)
    export_hf_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    again = load_hf_checkpoint(tmp_path)
    assert again.cfg.tie_embeddings and again.cfg.rope_theta == MODELS["tiny"].rope_theta
    for (n, p), (n2, p2) in zip(model.named_parameters(), again.named_parameters()):
        assert n == n2
        torch.testing.assert_close(p2, p.bfloat16().float(), rtol=0, atol=0)


def test_config_from_hf_llama31_8b_matches_the_zoo():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cfg = config_from_hf(hf, name="llama3-8b")
    assert cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}) == MODELS["llama3-8b"]
    qwen = config_from_hf(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
        name="qwen3-4b",
    )
    assert qwen == MODELS["qwen3-4b"]


def test_weight_map_covers_every_parameter_once():
    for cfg in (MODELS["llama3-8b"], MODELS["qwen3-4b"]):
        model = build_model(cfg.__class__(**{**cfg.__dict__, "n_layers": 2}), device="meta")
        wmap = hf_weight_map(model.cfg)
        rows = {}
        for lp, lo, hi in wmap.values():
            rows.setdefault(lp, []).append((lo, hi))
        params = dict(model.named_parameters())
        assert set(rows) == set(params)
        for name, spans in rows.items():  # fused rows tile the parameter exactly
            if spans != [(None, None)]:
                spans.sort()
                assert spans[0][0] == 0 and spans[-1][1] == params[name].shape[0]
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _bad(tmp_path, ref_kind="llama"):
    ref = hf_model(ref_kind)
    ref.save_pretrained(tmp_path)
    return tmp_path


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(UsageError, match="config.json"):
        load_hf_checkpoint(tmp_path / "nope")

    d = _bad(tmp_path / "arch")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(UsageError, match="unsupported architecture MistralForCausalLM"):
        load_hf_checkpoint(d)
    (d / "config.json").write_text(
        json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    )
    with pytest.raises(UsageError, match="RoPE type 'yarn'"):
        load_hf_checkpoint(d)
    (d / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(
        UsageError,
        match=r"tensor model\.layers\.\d\.self_attn\.[kv]_proj\.weight has shape "
        r"\(32, 64\), expected \(64, 64\)",
    ):
        load_hf_checkpoint(d)

    d = _bad(tmp_path / "corrupt")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UsageError, match="model.safetensors: not a readable safetensors file"):
        load_hf_checkpoint(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="no \\*.safetensors"):
        load_hf_checkpoint(d)

    d = _bad(tmp_path / "missing")
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UsageError, match="missing tensor.*model.layers.1.self_attn.v_proj.weight"):
        load_hf_checkpoint(d)

    d = tmp_path / "shards"
    hf_model("llama").save_pretrained(d, max_shard_size="40KB")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(UsageError, match=f"missing shard.*{shard.name}"):
        load_hf_checkpoint(d)
    shutil.rmtree(d)


def test_export_rejects_what_hf_llama_cannot_hold(tmp_path):
    with pytest.raises(UsageError, match="LayerNorm"):
        export_hf_checkpoint(
            build_model(
                MODELS["nemotron4-15b"].__class__(
                    **{**MODELS["tiny"].__dict__, "norm": "layer", "activation": "sqrelu"}
                ),
                device="cpu",
            ),
            tmp_path,
        )


@pytest.mark.parametrize("norm_topk", [True, False])
def test_qwen3_moe_checkpoint_loads_with_identical_logits(norm_topk, tmp_path):
    """A tiny random Qwen3-MoE (8 experts, top-2) saved by transformers: lpbench's logits are HF's."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        **{
            **TINY,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": norm_topk,
            "tie_word_embeddings": False,
        }
    )
    ref = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.cfg.n_experts == 8 and model.cfg.top_k == 2 and model.cfg.router == "qwen3"
    assert model.cfg.router_norm_topk == norm_topk and model.cfg.qk_norm and model.cfg.ffn_dim == 32
    with torch.no_grad():
        got = model(INPUT)
    expected = hf_logits(ref, INPUT)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert expected.std() > 0.1


def test_config_from_hf_qwen3_30b_a3b_matches_the_zoo():
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    assert config_from_hf(hf, name="qwen3-30b-a3b") == MODELS["qwen3-30b-a3b"]
    with pytest.raises(UsageError, match="mlp_only_layers"):
        config_from_hf({**hf, "mlp_only_layers": [0]})

"""Named architectures: every model lpbench knows is one ``ModelConfig`` instance here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lpbench.errors import UsageError


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    head_dim: int | None = None  # default dim // n_heads
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    activation: str = "swiglu"  # "swiglu" (gated) | "sqrelu" | "gelu"
    positions: str = "rope"  # "rope" | "learned"
    rope_theta: float = 500_000.0
    rope_fraction: float = 1.0  # share of head_dim that is rotated (Nemotron4: 0.5)
    # Llama 3.1 "llama3" RoPE frequency scaling, as HF's rope_type "llama3":
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); None: plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    bias: bool = False
    n_experts: int = 0  # 0 = dense MLP
    top_k: int = 1
    router: str = "mixtral"  # MoE routing: "mixtral" | "qwen3" (lpbench.models.moe)
    router_norm_topk: bool = True  # qwen3 routing: renormalise the top-k probabilities (HF norm_topk_prob)
    max_seq_len: int = 8192
    family: str = "llama"

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def experts_per_token(self) -> int:
        return self.top_k if self.n_experts else 1


def _llama(name, L, h, ffn, heads, vocab=128256, kv=8, **kw):
    return ModelConfig(name, L, h, ffn, heads, kv, vocab, max_seq_len=131072, **kw)


def _qwen3(name, L, h, ffn, heads, kv=8, **kw):
    qwen3 = dict(head_dim=128, norm_eps=1e-6, qk_norm=True, rope_theta=1e6, max_seq_len=40960, family="qwen3")
    return ModelConfig(name, L, h, ffn, heads, kv, 151936, **qwen3, **kw)


def _nemotron4(name, L, h, ffn, heads, **kw):
    nemotron = dict(norm="layer", activation="sqrelu", rope_theta=10_000.0, rope_fraction=0.5, max_seq_len=4096)
    return ModelConfig(name, L, h, ffn, heads, 8, 256000, **nemotron, family="nemotron4", **kw)


def _mixtral(name, L, h, ffn, heads, max_seq_len):
    mixtral = dict(rope_theta=1e6, n_experts=8, top_k=2, max_seq_len=max_seq_len, family="mixtral")
    return ModelConfig(name, L, h, ffn, heads, 8, 32000, **mixtral)


def _cpu(name, L, h, ffn, heads, kv, vocab, **kw):
    """A CPU-sized llama-family preset (tests, the default run, convergence studies)."""
    return ModelConfig(name, L, h, ffn, heads, kv, vocab, rope_theta=10_000.0, **{"max_seq_len": 2048, **kw})


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        _llama("llama3-8b", 32, 4096, 14336, 32),
        _llama("llama3-70b", 80, 8192, 28672, 64),
        _llama("llama3.1-405b", 126, 16384, 53248, 128),
        _llama("llama3.2-1b", 16, 2048, 8192, 32, tie_embeddings=True),
        _llama("llama3.2-3b", 28, 3072, 8192, 24, tie_embeddings=True),
        _qwen3("qwen3-4b", 36, 2560, 9728, 32, tie_embeddings=True),
        _qwen3("qwen3-14b", 40, 5120, 17408, 40),
        _nemotron4("nemotron4-15b", 32, 6144, 24576, 48),
        _nemotron4("nemotron4-340b", 96, 18432, 73728, 96, head_dim=192),
        _mixtral("mixtral-8x7b", 32, 4096, 14336, 32, max_seq_len=32768),
        _mixtral("mixtral-8x22b", 56, 6144, 16384, 48, max_seq_len=65536),
        _qwen3("qwen3-30b-a3b", 48, 2048, 768, 32, kv=4, n_experts=128, top_k=8, router="qwen3"),
        ModelConfig(
            "gpt3-175b",
            *(96, 12288, 49152, 96, 96, 51200),
            norm="layer",
            activation="gelu",
            positions="learned",
            tie_embeddings=True,
            bias=True,
            max_seq_len=2048,
            family="gpt3",
        ),
        _cpu("tiny", 8, 128, 384, 4, 2, 2048, tie_embeddings=True),
        _cpu("tiny-moe", 4, 128, 256, 4, 2, 2048, tie_embeddings=True, n_experts=4, top_k=2, family="mixtral"),
        _cpu("small", 8, 512, 1536, 8, 4, 8192, tie_embeddings=True, max_seq_len=4096),
        # GPT-3 Small's shape (12 x 768) as a llama: 125 M parameters with a 32k vocabulary.
        _cpu("llama-125m", 12, 768, 2048, 12, 4, 32000, max_seq_len=4096),
    )
}


def get_model_config(name: str) -> ModelConfig:
    try:
        return MODELS[name]
    except KeyError:
        raise UsageError(f"unknown model {name!r}; valid: {', '.join(MODELS)}") from None


def model_label(model: str, num_layers: int | None) -> str:
    """``model``, or ``model@NL`` for a run cut to its first N blocks (so no one takes it for the full model)."""
    return model if num_layers is None else f"{model}@{num_layers}L"


def first_blocks(cfg: ModelConfig, num_layers: int | None) -> ModelConfig:
    """``cfg`` cut to its first ``num_layers`` blocks (None: all); widths and vocabulary are kept."""
    if num_layers is None:
        return cfg
    if not 1 <= num_layers <= cfg.n_layers:
        raise UsageError(f"--num-layers must be between 1 and {cfg.name}'s {cfg.n_layers} blocks, got {num_layers}")
    return replace(cfg, n_layers=num_layers)


def with_overrides(cfg: ModelConfig, **kw) -> ModelConfig:
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})

"""Model FLOPs per token under the three named formulas of DESIGN.md.

``megatron`` (default) is Megatron-LM / Megatron-Bridge's count with the causal discount on
core attention; ``nemo-legacy`` is NeMo <= 25.07's (no causal discount) and reproduces its
published tables; ``mha`` is the Nemotron4 recipe document's simpler count that treats
attention as full multi-head. All count forward + backward (3x forward) matmul FLOPs.
"""

from __future__ import annotations

from lpbench.errors import UsageError
from lpbench.models.registry import ModelConfig


def _megatron(c: ModelConfig, s: int) -> float:
    h, L, V = c.dim, c.n_layers, c.vocab_size
    q, kv = c.hd * c.n_heads, c.hd * c.n_kv_heads
    mlp = 6 * h * c.ffn_dim * (3 if c.gated else 2) * c.experts_per_token * L
    proj = 6 * (h * (q + 2 * kv) + q * h) * L
    core_attn = 6 * q * s * L  # 12·q·s halved for the causal mask
    return mlp + proj + core_attn + 6 * h * V


def _nemo_legacy(c: ModelConfig, s: int) -> float:
    h, L, V = c.dim, c.n_layers, c.vocab_size
    mlp = (18 if c.gated else 12) * c.ffn_dim / h * c.experts_per_token
    g_over_n = c.n_kv_heads / c.n_heads
    return L * h * h * (12 + 12 * g_over_n + mlp + 12 * s / h + 6 * V / (L * h))


def _mha(c: ModelConfig, s: int) -> float:
    h, L, V = c.dim, c.n_layers, c.vocab_size
    attention = 24 * L * h * h + 12 * L * h * s
    mlp = 6 * h * c.ffn_dim * (3 if c.gated else 2) * c.experts_per_token * L  # 48·L·h² for ffn = 4h
    return attention + mlp + 6 * V * h


FORMULAS = {"megatron": _megatron, "nemo-legacy": _nemo_legacy, "mha": _mha}


def flops_per_token(cfg: ModelConfig, seq_len: int, formula: str = "megatron") -> float:
    """Training FLOPs (forward + backward) per token at ``seq_len``."""
    try:
        fn = FORMULAS[formula]
    except KeyError:
        raise UsageError(f"unknown FLOP formula {formula!r}; valid: {', '.join(FORMULAS)}") from None
    return float(fn(cfg, seq_len))


def tflops_per_gpu(flops_token: float, tokens_per_sec_per_gpu: float) -> float:
    return flops_token * tokens_per_sec_per_gpu / 1e12


def days_to_train(tokens: float, tokens_per_sec_per_gpu: float, num_gpus: int) -> float:
    return tokens / (tokens_per_sec_per_gpu * num_gpus) / 86400.0

"""Model FLOPs per token under three named formulas (ARCHITECTURE.md, Metrics).

``megatron`` (default) is Megatron-LM / Megatron-Bridge's count with the causal discount on
core attention; ``nemo-legacy`` is NeMo <= 25.07's (no causal discount) and reproduces its
published tables; ``mha`` is the Nemotron4 recipe document's simpler count that treats
attention as full multi-head. All count forward + backward (3x forward) matmul FLOPs.

Fine-tuning rules (each formula's per-token count is ``dense + attention(s)``, with the
core-attention term linear in ``s``):

- packed SFT (:func:`packed_flops_per_token`), Megatron's rule: every position of a packed
  sequence goes through the GEMMs, but attention is per sample, so ``s`` becomes
  ``Σ lᵢ² / seq_len`` (sample lengths ``lᵢ``, padding excluded; averaged over the sequences).
- LoRA (:func:`lora_flops_per_token`), Megatron-Bridge's rule: the frozen GEMMs (every linear,
  lm_head included) run forward and data-gradient only, 2/3 of training; core attention has no
  weights, so it keeps its full forward + backward; adapters (``rank`` > 0) add
  ``6·r·(in + out)`` per adapted linear per token (trained). NeMo / Megatron-Bridge leave the
  adapters out: pass ``rank=0`` to reproduce their tables. NeMo's Llama3-8B fine-tuning table
  (SQuAD packed to 16384, GB200: SFT 33,437 tok/s ↔ 1,515 TFLOP/s, LoRA 44,281 ↔ 1,342) follows
  from ``nemo-legacy`` with an attention length of about 180 for both (SQuAD's mean squared sample
  length over 16384); ``s = 16384`` would give 2,367 TFLOP/s for SFT.
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


# --------------------------------------------------------------------------- fine-tuning


def attention_flops_per_token(cfg: ModelConfig, seq_len: float, formula: str = "megatron") -> float:
    """The core-attention part of :func:`flops_per_token` at ``seq_len`` (linear in it)."""
    per_position = flops_per_token(cfg, 1, formula) - flops_per_token(cfg, 0, formula)
    return per_position * seq_len


def _sequences(sample_lengths) -> list[list[int]]:
    seqs = [list(map(int, s)) for s in sample_lengths]
    if not seqs:
        raise UsageError("sample_lengths needs at least one packed sequence")
    return seqs


def packed_attention_len(sample_lengths, seq_len: int) -> float:
    """``Σ lᵢ² / (sequences · seq_len)``: the dense sequence length with the same attention FLOPs.

    ``sample_lengths``: one list of sample lengths per packed sequence of ``seq_len`` positions.
    """
    seqs = _sequences(sample_lengths)
    if any(sum(s) > seq_len for s in seqs):
        raise UsageError(f"a packed sequence holds more than seq_len={seq_len} positions")
    return sum(n * n for s in seqs for n in s) / (len(seqs) * seq_len)


def packed_flops_per_token(cfg: ModelConfig, seq_len: int, sample_lengths, formula: str = "megatron") -> float:
    """Training FLOPs per position of packed SFT sequences (attention per sample, see module doc)."""
    return flops_per_token(cfg, 0, formula) + attention_flops_per_token(
        cfg, packed_attention_len(sample_lengths, seq_len), formula
    )


def lora_adapter_flops_per_token(cfg: ModelConfig, rank: int, targets=("qkv", "o", "mlp")) -> float:
    """``6·r·(in + out)`` per adapted linear and layer (forward, data and weight gradient of A and B)."""
    from lpbench.models.decoder import expand_targets

    if rank < 0:
        raise UsageError(f"LoRA rank must be >= 0, got {rank}")
    q, kv, h, f = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.dim, cfg.ffn_dim
    mlp_in_out = {"gate_up": h + 2 * f, "down": f + h} if cfg.gated else {"up": h + f, "down": f + h}
    in_out = {"qkv": h + q + 2 * kv, "o": q + h}
    per_layer = 0.0
    for name in expand_targets(targets):
        if name in in_out:
            per_layer += in_out[name]
        elif name in mlp_in_out:
            per_layer += mlp_in_out[name] * cfg.experts_per_token
    return 6.0 * rank * per_layer * cfg.n_layers


def lora_flops_per_token(
    cfg: ModelConfig,
    seq_len: int,
    formula: str = "megatron",
    *,
    sample_lengths=None,
    rank: int = 0,
    targets=("qkv", "o", "mlp"),
) -> float:
    """LoRA training FLOPs per token: 2/3 of the frozen GEMMs + full attention (per sample when
    ``sample_lengths`` are given) + adapters when ``rank`` > 0 (see module doc)."""
    s = seq_len if sample_lengths is None else packed_attention_len(sample_lengths, seq_len)
    frozen = flops_per_token(cfg, 0, formula)
    return (
        (2.0 / 3.0) * frozen
        + attention_flops_per_token(cfg, s, formula)
        + lora_adapter_flops_per_token(cfg, rank, targets)
    )

"""The one decoder implementation behind every architecture of the zoo.

Llama 3 / Qwen3 / Nemotron4 / GPT3 / Mixtral differ only in data (``ModelConfig``): norm
kind, MLP activation, RoPE fraction or learned positions, QK-norm, tied embeddings, MoE.
Linear layers are plain ``nn.Linear`` with fused QKV and gate+up projections, so a precision
recipe can swap them for quantized ones without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lpbench.models.registry import ModelConfig


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rms":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, rot_dim] in FP32 (HF "rotate_half" layout)."""
    rot = int(cfg.hd * cfg.rope_fraction)
    inv_freq = cfg.rope_theta ** (-torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x [B, S, H, D]; the rest pass through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = (xr.float() * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)
    return torch.cat([rotated, xp], dim=-1) if xp.shape[-1] else rotated


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd, bias=cfg.bias)
        self.o = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=cfg.bias)
        self.q_norm = make_norm(cfg, cfg.hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.hd) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q, k, v = q.view(B, S, -1, self.hd), k.view(B, S, -1, self.hd), v.view(B, S, -1, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=self.n_kv != self.n_heads,
        )
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        if cfg.gated:
            self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=cfg.bias)
        else:
            self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        elif self.activation == "sqrelu":
            hidden = F.relu(self.up(x)).square()
        else:
            hidden = F.gelu(self.up(x))
        return self.down(hidden)


class MoE(nn.Module):
    """Top-k routed experts (Mixtral): softmax over the k selected router logits.

    A plain loop over experts; each expert sees only its tokens.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = self.router(x).topk(self.top_k, dim=-1)
        weights = weights.float().softmax(dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.dim)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """GPT-2 style init: N(0, std), residual output projections scaled by 1/sqrt(2L)."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                s = out_std if name.endswith(("attn.o.weight", "down.weight")) else std
                p.normal_(0.0, s, generator=gen)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, V], or the mean cross-entropy (FP32) when labels are given (-100 ignored)."""
        S = input_ids.shape[1]
        h = self.tok_embeddings(input_ids)
        rope = None
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(torch.arange(S, device=input_ids.device))
        else:
            rope = rope_tables(self.cfg, S, input_ids.device)
        for layer in self.layers:
            h = layer(h, rope)
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_model(cfg: ModelConfig, device: torch.device | str = "meta", seed: int = 0) -> Decoder:
    """Build on ``device`` (meta: shapes only, nothing allocated) and initialise unless meta."""
    with torch.device(device):
        model = Decoder(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model

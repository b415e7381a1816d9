"""The one decoder implementation behind every architecture of the zoo.

Llama 3 / Qwen3 / Nemotron4 / GPT3 / Mixtral differ only in data (``ModelConfig``): norm
kind, MLP activation, RoPE fraction or learned positions, QK-norm, tied embeddings, MoE
(:mod:`lpbench.models.moe`).
Linear layers are ``nn.Linear`` (:class:`Linear`, whose BF16 GEMMs take the CPU's fast route) with
fused QKV and gate+up projections, so a precision recipe can swap them for quantized ones without
touching this file.

Document masking (packed SFT): ``Decoder.forward(..., doc_ids=...)`` confines attention to each
document (a run of equal ids along the sequence) and restarts RoPE / learned positions at each
run's first token, as NeMo's packed sequences do. Backends (``DOC_MASK_BACKEND``): ``"flex"``
(``torch.nn.attention.flex_attention`` with a block mask; compiled on CUDA, the fast path that
skips masked blocks) and ``"sdpa"`` (SDPA with a boolean [B, 1, S, S] mask; O(S²) memory, works on
every device and torch >= 2.10); ``"auto"`` picks flex on CUDA and SDPA elsewhere, because flex
on CPU has no backward (torch 2.10-2.13) and runs unfused outside torch.compile.
Without ``doc_ids`` attention is plain causal SDPA, as before.

Context parallelism sets ``context_parallel`` on the decoder and its attentions
(:mod:`lpbench.parallel.cp`): the input is then this rank's chunks of each sequence, whose places in
the whole sequence (``positions``) give RoPE and learned positions, attention runs over the whole
sequence's keys (``attention``), and the loss is this rank's share of the whole sequence's mean
(``label_count``).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lpbench.errors import UsageError
from lpbench.models.fused_loss import linear_cross_entropy
from lpbench.models.moe import ACTIVATIONS, MoE, expert_shape
from lpbench.models.registry import ModelConfig
from lpbench import gemm
from lpbench.gemm import local_linear


TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("qkv",),
    "o": ("o",),
    "mlp": ("gate_up", "up", "down"),
    "gate_up": ("gate_up",),
    "up": ("up",),
    "down": ("down",),
}


def expand_targets(targets) -> tuple[str, ...]:
    """Module names for ``targets`` (a list, or a comma-separated string such as ``"qkv,o,mlp"``)."""
    if isinstance(targets, str):
        targets = [t for t in targets.replace(" ", "").split(",") if t]
    names: list[str] = []
    for t in targets:
        if t not in TARGETS:
            raise UsageError(f"unknown LoRA target {t!r}; valid: {', '.join(TARGETS)}")
        names += [n for n in TARGETS[t] if n not in names]
    if not names:
        raise UsageError("LoRA needs at least one target")
    return tuple(names)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rms":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


def llama3_scaled_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_pos: int
) -> torch.Tensor:
    """Llama 3.1 RoPE scaling (HF rope_type "llama3"): long wavelengths slowed by ``factor``,
    short ones kept, a smooth blend in between."""
    low_wavelen, high_wavelen = original_max_pos / low_freq_factor, original_max_pos / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: ModelConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, rot_dim] in FP32 (HF "rotate_half" layout)."""
    rot = int(cfg.hd * cfg.rope_fraction)
    inv_freq = cfg.rope_theta ** (-torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, *cfg.rope_scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x [B, S, H, D]; the rest pass through.

    Tables are [S, rot] (positions 0..S-1) or [B, S, rot] (per-token positions).
    """
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.float().chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = (xr.float() * c + torch.cat([-x2, x1], dim=-1) * s).to(x.dtype)
    return torch.cat([rotated, xp], dim=-1) if xp.shape[-1] else rotated


class Linear(nn.Linear):
    """``nn.Linear`` whose BF16 GEMMs run as FP32 GEMMs on a CPU without native BF16 (:mod:`lpbench.gemm`),
    and under autocast take the BF16 weight the weight cache made once per optimizer step, if it made one."""

    tp_aware = True  # on the FP32 route its GEMM runs on the tensor-parallel shards (local_linear)
    caches_bf16_weight = True  # lpbench.convert.weight_cache.bf16_eligible

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemm.fp32_route(x):
            return local_linear(self, x, gemm.linear)
        w = gemm.cast_once(self.weight, getattr(self, "bf16_weight", None), x)
        return super().forward(x) if w is None else F.linear(x, w, self.bias)


class Attention(nn.Module):
    context_parallel = None  # lpbench.parallel.cp.ContextParallel: attention over the CP group's keys

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        self.qkv = Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.hd, bias=cfg.bias)
        self.o = Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=cfg.bias)
        self.q_norm = make_norm(cfg, cfg.hd) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.hd) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask=None) -> torch.Tensor:
        """``mask``: None (causal), a bool [B, 1, S, S] SDPA mask or a flex BlockMask (see ``document_mask``)."""
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q, k, v = q.view(B, S, -1, self.hd), k.view(B, S, -1, self.hd), v.view(B, S, -1, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        gqa, cp = self.n_kv != self.n_heads, self.context_parallel
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cp is not None:  # this rank's queries attend to the whole sequence's keys
            k, v = cp.gather(k, v)
        if mask is None and cp is not None:
            out = cp.attention(q, k, v, gqa)
        elif mask is None:
            out = gemm.attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, torch.Tensor):
            out = gemm.attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            out = _flex_attention(q, k.to(q.dtype), v.to(q.dtype), mask, gqa)
        return self.o(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act, self.gated = ACTIVATIONS[cfg.activation], cfg.gated
        if cfg.gated:
            self.gate_up = Linear(cfg.dim, 2 * cfg.ffn_dim, bias=cfg.bias)
        else:
            self.up = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.down = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)

    def activate(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The activation of ``linear(x)`` (a converter may give a fused one: ``lpbench.convert.SwiGLU``)."""
        return self.act(linear(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activate(self.gate_up if self.gated else self.up, x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg, cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg, cfg.dim)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, rope, mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    context_parallel = None  # lpbench.parallel.cp.ContextParallel: the input is this rank's part of each sequence
    vocab_parallel = None  # lpbench.parallel.tp.VocabParallel: the LM head split by vocabulary over a TP group

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.positions == "learned" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg, cfg.dim)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.fused_loss_scale: float | None = None  # set: the loss through linear_cross_entropy (configure_loss)
        self.seq_shards = 1  # a pipeline stage under sequence parallelism: the hidden states it takes are a shard

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02, write=None) -> None:
        """GPT-2 style init (:func:`initial_values`): every parameter's full values drawn in turn from one
        generator seeded with ``seed``, then stored by ``write(name, param, values)`` (default: copied), so a
        sharded model can keep its shard of the same values (:func:`lpbench.parallel.plan.materialize`)."""
        params = dict(self.named_parameters())
        for name, full in initial_values(self.cfg, seed, next(self.parameters()).device, std):
            if write is None:
                params[name].copy_(full)
            else:
                write(name, params[name], full)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, S, V], or the mean cross-entropy (FP32) when labels are given (-100 ignored).

        ``doc_ids`` [B, S] (packed sequences): attention stays inside each run of equal ids and
        positions restart at each run (see the module doc); None: one causal sequence.

        A pipeline stage (``lpbench.parallel.pp``) lacks the modules other stages hold: without
        ``tok_embeddings`` it takes the hidden states [B, S, D] as ``input_ids``, without ``lm_head`` it
        returns its hidden states; those of sequence-parallel ranks are their ``seq_shards``-th of the sequence.
        """
        S, cp = input_ids.shape[1] * (self.seq_shards if self.tok_embeddings is None else 1), self.context_parallel
        h = input_ids if self.tok_embeddings is None else self.tok_embeddings(input_ids)
        rope = mask = positions = None
        if cp is not None:
            positions = cp.positions(S, input_ids.device)
        if doc_ids is not None:  # under CP the whole sequences' ids (ContextParallel.shard keeps them whole)
            whole = (input_ids.shape[0], S * (1 if cp is None else cp.size))
            if doc_ids.shape != whole:
                raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be {whole}: the whole sequences' ids")
            runs, positions = document_runs(doc_ids)
            query = None if cp is None else cp.index(whole[1], input_ids.device)
            if query is not None:
                positions = positions[:, query]
            mask = document_mask(runs, query=query)
        if self.cfg.positions == "learned":
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(S, device=h.device) if positions is None else positions)
        else:
            rope = rope_tables(self.cfg, S if cp is None else S * cp.size, input_ids.device)
            if positions is not None:
                rope = (rope[0][positions], rope[1][positions])
        for layer in self.layers:
            h = layer(h, rope) if mask is None else layer(h, rope, mask)
        return h if self.lm_head is None else self.head(h, labels)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head: logits, or their mean cross-entropy (FP32) with ``labels``."""
        cp, vocab = self.context_parallel, self.vocab_parallel
        if vocab is not None or (labels is not None and cp is not None):
            logits = self.lm_head(self.norm(h))  # under TP this rank's share of the vocabulary's
            if labels is None:
                return vocab.gather(logits)
            if vocab is not None:
                total = vocab.cross_entropy(logits.flatten(0, 1), labels.flatten()).sum()
            else:
                total = F.cross_entropy(
                    logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
                )
            if cp is not None:  # this rank's sum over the whole sequences' count, x CP size
                return total * cp.size / cp.label_count(labels)
            return total / (labels != -100).sum()
        if labels is not None and self.fused_loss_scale is not None:
            return linear_cross_entropy(self.norm(h), self.lm_head.weight, labels, self.fused_loss_scale)
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


DOC_MASK_BACKEND = "auto"  # "auto" (flex on CUDA, else sdpa) | "flex" | "sdpa"
_compiled_flex = None


def document_runs(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run index and position within the run of each token of ``doc_ids`` [B, S] (int64 each).

    A run is a maximal stretch of equal consecutive ids, so two samples that happen to share an
    id but are not adjacent are still separate documents.
    """
    B, S = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    run_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return starts.long().cumsum(dim=1), idx - run_start


def document_mask(runs: torch.Tensor, backend: str | None = None, query: torch.Tensor | None = None):
    """Causal attention confined to each run: a flex ``BlockMask`` or a bool SDPA mask [B, 1, Q, S].

    ``query``: the places in the sequence of the queries (context parallelism: this rank's tokens, attending to
    the whole sequence's keys); None: every place, Q = S. A query at place p sees the keys at places <= p of
    its own run."""
    backend = backend or DOC_MASK_BACKEND
    if backend == "auto":
        backend = "flex" if runs.is_cuda else "sdpa"
    keys = torch.arange(runs.shape[1], device=runs.device)
    query = keys if query is None else query
    if backend == "sdpa":
        return _visible(runs, query, keys)[:, None]
    if backend != "flex":
        raise ValueError(f"unknown document-mask backend {backend!r}; valid: auto, flex, sdpa")

    def same_document_causal(b, h, q_idx, kv_idx):
        place = query[q_idx]
        return (runs[b, place] == runs[b, kv_idx]) & (place >= kv_idx)

    return _block_mask(runs, query, keys, same_document_causal)


def _visible(runs: torch.Tensor, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[B, Q, S] bool: the query at place ``query[i]`` sees key j (same run, j <= its place)."""
    return (runs[:, query, None] == runs[:, None, :]) & (query[:, None] >= keys)


def _block_mask(runs, query, keys, mask_mod, block: int = 128, chunk_elements: int = 1 << 24):
    """flex's ``BlockMask`` of the document mask: the blocks ``create_block_mask`` makes (a ``block``-square tile
    is full where every pair sees, partial where some do, in the same order), found a few block rows at a time
    so no [B, Q, S] mask is held (``chunk_elements`` bools at most, reduced as bools).

    Ours rather than ``create_block_mask`` because that one materialises the whole mask eagerly (gigabytes at
    16 K) and, compiled, spends minutes compiling its kernel at seq 16,384 (benchmarks/RESULTS.md)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, S, Q = runs.shape[0], runs.shape[1], len(query)
    n_q, n_k = -(-Q // block), -(-S // block)
    rows = max(1, chunk_elements // (B * block * n_k * block))  # block rows a chunk
    some = torch.empty(B, 1, n_q, n_k, dtype=torch.bool, device=runs.device)
    every = torch.empty_like(some)
    for first in range(0, n_q, rows):
        places = query[first * block : (first + rows) * block]
        seen = _visible(runs, places, keys)
        n = -(-len(places) // block)
        pad = (0, n_k * block - S, 0, n * block - len(places))
        if any(pad):  # padding sees nothing
            seen = F.pad(seen, pad)
        tiles = seen.view(B, n, block, n_k, block)
        some[:, 0, first : first + n] = tiles.any(4).any(2)
        every[:, 0, first : first + n] = tiles.all(4).all(2)

    def ordered(blocks):  # (blocks a row, their column indices first in ascending order): torch's layout
        blocks = blocks.to(torch.int32)
        columns = torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)
        return blocks.sum(-1, dtype=torch.int32), columns

    return BlockMask.from_kv_blocks(
        *ordered(some & ~every),
        *ordered(every),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(Q, S),
    )


def _flex_attention(q, k, v, block_mask, enable_gqa: bool) -> torch.Tensor:
    """flex_attention on [B, H, S, D]: traced by an outer torch.compile (the compiled block's own graph: no
    warnings filter, which Dynamo cannot trace, so none breaks the graph), compiled once on CUDA (fused kernel),
    eager elsewhere (an unfused reference that materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def configure_loss(model: Decoder, fused: bool, grad_scale: float) -> bool:
    """Compute ``model``'s training loss with the chunked LM head + cross-entropy
    (:mod:`lpbench.models.fused_loss`), told the gradient ``grad_scale`` its backward will bring;
    where the LM head is not a plain local linear (tensor-parallel, sharded, replaced), or not
    ``fused``, the unfused head. Returns whether the fused loss is on."""
    plain = type(model.lm_head) is Linear and not isinstance(model.lm_head.weight, DTensor)
    model.fused_loss_scale = grad_scale if fused and plain else None
    return model.fused_loss_scale is not None


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(model: nn.Module) -> int:
    """Parameters one token uses: in each MoE layer only ``top_k`` of its experts (tied weights once)."""
    idle = 0
    for m in model.modules():
        if isinstance(m, MoE):
            per_expert = sum(p.numel() for p in m.experts.parameters()) // m.experts.n_experts
            idle += (m.n_experts - m.top_k) * per_expert
    return count_parameters(model) - idle


def initial_values(cfg: ModelConfig, seed: int, device: torch.device | str, std: float = 0.02):
    """Yield ``(name, values)`` for every parameter of ``Decoder(cfg)`` in its order (tied weights once), each
    drawn whole when it is reached: N(0, std), residual output projections N(0, std / sqrt(2L)), norms' weights
    1 and biases 0, from one generator on ``device`` seeded with ``seed``, in the construction dtype.

    Stacked expert weights are drawn whole (all experts: EP; their whole FFN width: TP). The same sequence
    fills an eager model, a sharded one and one materialized block by block."""
    with torch.device("meta"):
        shapes = Decoder(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    out_std = std / math.sqrt(2 * cfg.n_layers)
    for name, p in shapes.named_parameters():
        stacked = name.endswith((".experts.gate_up", ".experts.up", ".experts.down"))
        shape = expert_shape(cfg, name.rpartition(".")[2]) if stacked else p.shape
        full = torch.empty(shape, dtype=p.dtype, device=device)
        if p.ndim == 1:
            full.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            full.normal_(
                0.0, out_std if name.endswith(("attn.o.weight", "down.weight", "experts.down")) else std, generator=gen
            )
        yield name, full


@torch.no_grad()
def assign(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole values of ``param``) into the part of it this rank holds: a DTensor's local
    shard (cut locally, no communication), else all of it."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)


def build_model(cfg: ModelConfig, device: torch.device | str = "meta", seed: int = 0) -> Decoder:
    """Build on ``device`` (meta: shapes only, nothing allocated) and initialise unless meta."""
    with torch.device(device):
        model = Decoder(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model

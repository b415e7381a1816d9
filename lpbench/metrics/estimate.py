"""Predicted peak memory per GPU of one training run, counted from first principles (docs/memory.md).

What a rank holds at the peak, the start of the first block's backward (every block's activations
kept, the head's gradient made), in bytes:

* parameters: the master weights of what trains (FP32, or BF16 with ``--master-weights bf16``; a LoRA base in
  BF16, or quantized), gradients in the weights' dtype, AdamW's two states (:func:`state_bytes`), each divided by
  FSDP's shards and TP's ranks; none of the three with ``--offload-optimizer`` (on the CPU, with FSDP2's BF16
  gathers on the GPU);
* weight copies: what a block's backward reuses from its forward (the quantized dgrad copy of each
  quantized linear's weight, whole under FSDP; without FSDP autocast's BF16 cast of every other
  linear weight), the weight cache under gradient accumulation (FP8 codes in both layouts, or BF16),
  and under FSDP the BF16 weights gathered: two blocks (in use, prefetched) and the root's;
* activations: bytes per token of one block (:func:`block_bytes_per_token`, tensor by tensor) times
  its tokens (MBS x seq / TP), over the blocks as ``--recompute`` keeps them, plus one block's
  whole activations while it is recomputed;
* the head: logits and their gradients (none with the chunked ``--fused-loss``).

A model (shapes only) built on the meta device gives the parameter counts; the rest are formulas, so
this runs without a GPU. It counts tensors, as ``torch.cuda.max_memory_allocated`` does: no CUDA context,
NCCL buffers or allocator fragmentation. Not modelled: the torchao backend, pipeline stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lpbench.models.registry import ModelConfig
from lpbench.precision.optim_states import BLOCK, blockwise
from lpbench.precision.quantize import Scaling
from lpbench.precision.recipes import Recipe

GB = 1024**3  # as metrics/memory.py reports measured peaks


@dataclass
class Estimate:
    parts: dict[str, float] = field(default_factory=dict)  # name -> bytes per GPU

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def gb(self) -> float:
        return self.total / GB


def code_bytes(recipe: Recipe) -> float:
    """Bytes per element of a quantized operand as lpbench stores it: one byte per code (FP8, and E2M1 in
    uint8) plus its block scales (MX: one byte per 32; NVFP4: one per 16); 2 (BF16) for an unquantized recipe."""
    if not recipe.quantized:
        return 2.0
    return 1.0 + ((1 / recipe.block) if recipe.block else 0.0)


STATE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4 / BLOCK, "8bit": 1.0 + 4 / BLOCK}  # per moment, with scales


def state_bytes(states: str, shapes: list[tuple[int, ...]]) -> float:
    """Bytes of AdamW's two moments for trained tensors of ``shapes`` stored as ``states``: FP32 (8 per element),
    BF16 (4), or one byte per element and an FP32 scale per 256 (fp8, 8bit) for the blockwise tensors, FP32 for
    the others."""
    total = 0.0
    for shape in shapes:
        n = math.prod(shape)
        total += 2 * (STATE_BYTES[states] if states in ("fp32", "bf16") or blockwise(tuple(shape)) else 4.0) * n
    return total


def block_bytes_per_token(
    m: ModelConfig,
    recipe: Recipe,
    recompute: str,
    *,
    compiled: bool = False,
    residual_bytes: int = 4,
    bf16_copies: bool = False,
    lora: bool = False,
) -> float:
    """Activation bytes one block keeps per token for its backward, counted tensor by tensor.

    ``none``, eager (autocast to the compute dtype, 2 bytes): each RMSNorm keeps its input in FP32 (the
    residual stream, or autocast's FP32 copy of it) and its FP32 normalized output, 8 bytes per feature
    each, and its FP32 rstd; the QKV linear its BF16 input (D); SDPA Q, K (new tensors after RoPE), V (a
    view: the whole QKV output stays), its output (a view the output projection reads: nothing more)
    and an FP32 log-sum-exp per head; the gate+up linear its input (D) and SwiGLU the gate+up output
    (2F); the down linear its input (F). A quantized linear keeps, instead of its BF16 input, the input's
    wgrad copy in the recipe's code bytes (the output projection too: its input is no view then), or in
    BF16 values with ``bf16_copies`` (emulated NVFP4 on a GPU: ``kernels/nvfp4.py``'s copies). With
    ``lora`` a frozen linear keeps nothing of its input (no weight gradient), its adapter the BF16 input.
    Compiled (``torch.compile``'s partitioner, measured): the norms keep their input (``residual_bytes``)
    and rstd only, the normalized outputs and the second norm's input are recomputed, and the output
    projection keeps its own copy of its input. MoE: the MLP part for each of the top-k experts a token
    visits, plus the router's FP32 logits and the tokens gathered for their experts.

    ``selective``: the block input, the QKV output, the attention output and log-sum-exp, and the gate+up
    output (the odd-numbered GEMMs'; the rest is recomputed). ``full``: the block input.
    """
    d, hd, f = m.dim, m.hd, m.ffn_dim
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    up = (2 if m.gated else 1) * f
    k = m.experts_per_token if m.n_experts else 1
    b, lse = 2.0, 4.0 * m.n_heads
    if recompute == "full":
        return residual_bytes * d
    if recompute == "selective":
        return residual_bytes * d + b * (q + 2 * kv + q + k * up) + lse
    quantized = recipe.quantized and not lora
    x = code_bytes(recipe) if quantized and not bf16_copies else b  # what a linear keeps of its input
    sdpa = b * (q + 2 * kv) + b * q + b * kv + b * q + lse  # QKV output (V's storage), Q, K, output, lse
    o_in = x * q if quantized or compiled else 0.0
    if compiled:
        norms = residual_bytes * d + 8
    else:
        norms = 2 * (4 * d + 4 * d + 4)
    attn = sdpa + x * d + o_in
    mlp = k * (x * d + b * up + x * f)
    if m.qk_norm:
        attn += b * (q + kv)
    if m.n_experts:
        mlp += 4 * m.n_experts + b * k * d
    return norms + attn + mlp


def estimate(
    m: ModelConfig,
    recipe: Recipe,
    *,
    seq_len: int,
    mbs: int,
    dp: int = 1,
    tp: int = 1,
    fsdp: bool = False,
    recompute: str = "none",
    recompute_every: int = 1,
    grad_accum: int = 1,
    workload: str = "pretrain",
    lora_rank: int = 32,
    lora_quantized_base: bool = False,
    fused_loss: bool = False,
    compiled: bool = True,
    cuda: bool = True,
    nvfp4_bf16_copies: bool = False,
    master_weights: str = "fp32",
    optimizer_states: str = "fp32",
    offload_optimizer: bool = False,
) -> Estimate:
    """The predicted peak of one rank (module doc); ``m``'s parameters counted on a meta-device model.

    ``compiled``: blocks (and, with one process or DDP, the head) compiled; ``cuda``: FSDP gathers the
    weights in BF16, so the residual stream is BF16 (else FP32, as the embeddings' output);
    ``nvfp4_bf16_copies``: NVFP4 emulated on a GPU, whose activation copies are BF16 values.
    ``master_weights``, ``optimizer_states``, ``offload_optimizer``: the run's settings of the same names (one
    process only offloads: FSDP2 on one rank, so its gathers are counted as FSDP's).
    """
    from lpbench.models.decoder import build_model

    model = build_model(m, device="meta")
    block = sum(p.numel() for p in model.layers.parameters()) / m.n_layers
    linear = (
        sum(mod.weight.numel() for mod in model.layers.modules() if hasattr(mod, "weight") and mod.weight.ndim == 2)
        + sum(p.numel() for n, p in model.layers.named_parameters() if ".experts." in n)
    ) / m.n_layers
    rest = sum(p.numel() for p in model.parameters()) - block * m.n_layers  # embeddings, final norm, LM head
    fsdp = (fsdp and dp > 1) or offload_optimizer
    shards = (dp if fsdp else 1) * tp
    quantized_blocks = (
        max(0, m.n_layers - recipe.first_bf16_layers - recipe.last_bf16_layers) if recipe.quantized else 0
    )
    parts: dict[str, float] = {}
    if workload == "lora":  # frozen base in the compute dtype or quantized; adapters trained in FP32
        q, kv, up = m.n_heads * m.hd, m.n_kv_heads * m.hd, (2 if m.gated else 1) * m.ffn_dim
        ins_outs = (m.dim + q + 2 * kv) + (q + m.dim) + (m.dim + up) + (m.ffn_dim + m.dim)  # qkv, o, mlp
        trainable = lora_rank * ins_outs * m.n_layers
        stored = (
            code_bytes(recipe) * quantized_blocks + 2.0 * (m.n_layers - quantized_blocks)
            if lora_quantized_base
            else 2.0 * m.n_layers
        )
        parts["frozen base"] = stored * linear + 2.0 * (block - linear) * m.n_layers + 4.0 * rest
        states = 8.0 * trainable  # the adapters' states: FP32 (no blockwise states counted)
    else:
        trainable = block * m.n_layers + rest
        states = state_bytes(optimizer_states, [p.shape for p in model.parameters()])
    on_gpu = 0.0 if offload_optimizer else 1.0
    weight = 2.0 if master_weights == "bf16" else 4.0
    parts[f"master weights ({master_weights})"] = on_gpu * weight * trainable / shards
    parts[f"gradients ({master_weights})"] = on_gpu * weight * trainable / shards
    parts[f"optimizer states ({optimizer_states} AdamW)"] = on_gpu * states / shards
    # dgrad copies of the quantized weights (whole, under FSDP); a base stored quantized is read as stored
    held = 0.0 if workload == "lora" and lora_quantized_base else code_bytes(recipe) * linear * quantized_blocks
    if not fsdp and workload != "lora" and master_weights != "bf16":
        held += 2.0 * linear * (m.n_layers - quantized_blocks)  # autocast's BF16 casts of the others
    parts["weight copies held for backward"] = held / tp
    if grad_accum > 1 and workload != "lora":  # FP8 codes in both layouts, or BF16 casts
        parts["weight cache (per optimizer step)"] = 2.0 * linear * (quantized_blocks or m.n_layers) / tp
    if fsdp:  # the block in use and the prefetched next, and the root's (embeddings, head) until the backward ends
        parts["FSDP gathered weights"] = 2.0 * (2 * block + rest) / tp
    tokens = mbs * seq_len / tp  # tensor parallelism splits the features (sequence parallelism the rest)
    checkpointed = len(range(0, m.n_layers, recompute_every)) if recompute != "none" else 0
    per = dict(
        compiled=compiled,
        residual_bytes=2 if fsdp and cuda else 4,
        bf16_copies=nvfp4_bf16_copies and recipe.scaling is Scaling.NVFP4,
        lora=workload == "lora",
    )
    kept = block_bytes_per_token(m, recipe, "none", **per)
    parts[f"activations ({recompute})"] = tokens * (
        block_bytes_per_token(m, recipe, recompute, **per) * checkpointed + kept * (m.n_layers - checkpointed)
    )
    if checkpointed:
        parts["one block recomputed"] = tokens * kept
    # the head: eager, log-softmax's FP32 output, its gradient and the logits' (FP32, then BF16); compiled
    # (one process or DDP): the BF16 logits and their FP32 gradient; chunked: one chunk's
    head = 6 if compiled and not fsdp and tp == 1 else 14
    parts["logits and loss"] = 0.0 if fused_loss else mbs * seq_len * m.vocab_size * head / tp
    return Estimate(parts)

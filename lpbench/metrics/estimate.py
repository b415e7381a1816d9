"""Predicted peak memory per GPU of one training run, counted from first principles (docs/memory.md).

The peak of a step is the largest of three moments, each the sum of what is live then, in bytes:

* the loss's backward (the usual peak): every block's activations as ``--recompute`` keeps them
  (:func:`block_bytes_per_token`, tensor by tensor, times MBS x seq / TP / CP; under context parallelism
  also the whole sequence's K and V each kept block all-gathered), the head's logit tensors, the
  weight copies the blocks' backward reuses, and no gradient yet (the optimizer sets them to None), but
  with gradient accumulation the earlier micro-batches' (FSDP: unsharded, in the reduction dtype; experts
  under ``--ep``, which FSDP leaves alone, their own, in the master weights' dtype);
* the last block's rerun (when it is recomputed): the same without the head, with that block's whole
  activations and the LM head's gradient;
* the end of the backward: every gradient, in the master weights' dtype, no activation; under FSDP the
  root's gradients still unsharded beside their reduce-scatter input; with tied embeddings (without FSDP) the
  embedding's own gradient of the shared weight, beside the head's it is added to.

Live throughout: the master weights of what trains (FP32, or BF16 with ``--master-weights bf16``; a LoRA
base in BF16, or quantized), AdamW's two states (:func:`state_bytes`), each divided by FSDP's shards (the
data-parallel ranks with ``--fsdp`` or ``--cp``, times the CP ranks, which always shard) and TP's ranks; with
``--offload-optimizer`` neither they nor the sharded gradients are on the GPU (FSDP2 keeps
them on the CPU; its BF16 gathers stay on the GPU); the weight cache under gradient accumulation; under
FSDP the BF16 weights gathered: two blocks (in use, prefetched) and the root's, or every block's
(``--fsdp-shard`` zero2/zero1 keep them to the backward), and with ``--fsdp-fp8-all-gather`` each
quantized weight's FP8 shard codes, kept for the optimizer step. The build's peak
(:func:`build_peak`: streamed, one block at a time) is estimated apart.

A model (shapes only) built on the meta device gives the parameter counts; the rest are formulas, so
this runs without a GPU. It counts tensors, as ``torch.cuda.max_memory_allocated`` does: no CUDA context,
NCCL buffers or allocator fragmentation. Not modelled: the torchao backend, DDP's buckets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lpbench.models.registry import ModelConfig
from lpbench.precision.optim_states import BLOCK, blockwise
from lpbench.precision.quantize import Scaling
from lpbench.precision.recipes import Recipe
from lpbench.sharding import shards_data_parallel, uses_fsdp

GB = 1024**3  # as metrics/memory.py reports measured peaks


@dataclass
class Estimate:
    parts: dict[str, float] = field(default_factory=dict)  # name -> bytes per GPU, live at the peak
    when: str = ""  # the moment of the step's peak
    build: float = 0.0  # bytes at the build's peak

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def gb(self) -> float:
        """The run's peak: the step's or, if higher, the build's."""
        return max(self.total, self.build) / GB

    @property
    def step_gb(self) -> float:
        return self.total / GB

    @property
    def build_gb(self) -> float:
        return self.build / GB


def code_bytes(recipe: Recipe) -> float:
    """Bytes per element of a quantized operand as lpbench stores it: one byte per code (FP8, and E2M1 in
    uint8) plus its block scales (MX: one byte per 32; NVFP4: one per 16); 2 (BF16) for an unquantized recipe."""
    if not recipe.quantized:
        return 2.0
    return 1.0 + ((1 / recipe.block) if recipe.block else 0.0)


def stored_bytes(recipe: Recipe) -> float:
    """Bytes per element of a frozen weight stored quantized (``precision/frozen.py``): its codes (E2M1 packed
    two per byte) and block scales (MX: one E8M0 per 32 elements; NVFP4: one E4M3 per 16 x 16 tile; FP8
    blockwise: one FP32 per 128 x 128 tile; one FP32 scale per tensor or row counted as nothing), in one copy
    when W and Wᵀ quantize alike (one scale per tensor, square tiles), else two; 2 (BF16) unquantized."""
    if not recipe.quantized:
        return 2.0
    code = 0.5 if recipe.element_format("weight").dtype is None else 1.0
    b = recipe.block or 0
    if recipe.weight_block_2d:
        scale = (4.0 if recipe.scaling is Scaling.BLOCK else 1.0) / (b * b)
    else:
        scale = 1.0 / b if recipe.scaling in (Scaling.MX, Scaling.NVFP4) else 0.0
    copies = 1 if recipe.scaling.per_tensor or recipe.weight_block_2d else 2
    return copies * (code + scale)


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
    cp: int = 1,
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
    reduce_bytes: int = 4,
    ep: int = 1,
    fsdp_shard: str = "zero3",
    fsdp_fp8_all_gather: bool = False,
    master_weights: str = "fp32",
    optimizer_states: str = "fp32",
    offload_optimizer: bool = False,
    pp: int = 1,
    vp: int = 1,
    pp_schedule: str | None = None,
    pp_rank_blocks: list[int] | None = None,
    pp_ends: tuple[bool, bool] | None = None,
) -> Estimate:
    """The predicted peak of one rank (module doc); ``m``'s parameters counted on a meta-device model.

    ``compiled``: blocks (and, with one process or DDP, the head) compiled; ``cuda``: FSDP gathers the
    weights in BF16, so the residual stream is BF16 (else FP32, as the embeddings' output);
    ``nvfp4_bf16_copies``: NVFP4 emulated on a GPU, whose activation copies are BF16 values;
    ``reduce_bytes``: the bytes of FSDP's gradient reduction dtype (``--grad-reduce-dtype``), in which it
    accumulates unsharded gradients between micro-batches; ``ep``, ``fsdp_shard``, ``fsdp_fp8_all_gather``,
    ``master_weights``, ``optimizer_states``, ``offload_optimizer``: the run's settings of the same names (one
    process only offloads: FSDP2 on one rank, so its gathers are counted as FSDP's). The estimate's ``parts``
    are what is live at the peak, ``when`` names that moment, ``build`` is the streamed build's peak
    (:func:`build_peak`). ``pp``, ``vp``, ``pp_schedule``, ``pp_rank_blocks`` (the blocks of each pipeline rank):
    pipeline parallelism (:func:`pipeline_estimate`); ``pp_ends``: whether this pipeline rank holds the first stage
    (the embedding) and the last (the LM head), default both.
    """
    from lpbench.models.decoder import build_model

    if pp > 1:
        kw = {
            k: v
            for k, v in locals().items()
            if k not in ("m", "recipe", "pp", "vp", "pp_schedule", "pp_rank_blocks", "pp_ends", "build_model")
        }
        return pipeline_estimate(m, recipe, pp, vp, pp_schedule, pp_rank_blocks, **kw)

    model = build_model(m, device="meta")
    block = sum(p.numel() for p in model.layers.parameters()) / m.n_layers
    linear = (
        sum(mod.weight.numel() for mod in model.layers.modules() if hasattr(mod, "weight") and mod.weight.ndim == 2)
        + sum(p.numel() for n, p in model.layers.named_parameters() if ".experts." in n)
    ) / m.n_layers
    rest = sum(p.numel() for p in model.parameters()) - block * m.n_layers  # embeddings, final norm, LM head
    head = m.vocab_size * m.dim  # the LM head's (or the tied embeddings') weight
    first, last = pp_ends or (True, True)
    # a pipeline rank holds the embedding with the first stage, the head with the last (tied: a copy on each)
    held_matrices = (first or last) if m.tie_embeddings else first + last
    rest -= ((1 if m.tie_embeddings else 2) - held_matrices) * head
    sharded = shards_data_parallel(fsdp, dp, cp) or offload_optimizer  # one process offloads through FSDP2
    fsdp = uses_fsdp(fsdp, dp, cp) or offload_optimizer
    shards = (dp if sharded else 1) * cp * tp  # CP ranks shard the weights too (dp_shard_cp)
    lora = workload == "lora"
    quantized_blocks = (
        max(0, m.n_layers - recipe.first_bf16_layers - recipe.last_bf16_layers) if recipe.quantized else 0
    )
    checkpointed = range(0, m.n_layers, recompute_every) if recompute != "none" else range(0)
    held: dict[str, float] = {}  # live through the step
    if lora:  # frozen base in the compute dtype or quantized; adapters trained in FP32
        q, kv, up = m.n_heads * m.hd, m.n_kv_heads * m.hd, (2 if m.gated else 1) * m.ffn_dim
        ins_outs = (m.dim + q + 2 * kv) + (q + m.dim) + (m.dim + up) + (m.ffn_dim + m.dim)  # qkv, o, mlp
        trainable = lora_rank * ins_outs * m.n_layers
        held["frozen base"] = frozen_base_bytes(m, recipe, linear, block, rest, lora_quantized_base) / shards
        states = 8.0 * trainable  # the adapters' states: FP32 (no blockwise states counted)
    else:
        trainable = block * m.n_layers + rest
        states = state_bytes(optimizer_states, [p.shape for p in model.parameters()])
    on_gpu = 0.0 if offload_optimizer else 1.0  # master weights, sharded gradients, states
    weight = 2.0 if master_weights == "bf16" else 4.0  # the master weights' and their gradients' bytes
    held[f"master weights ({master_weights})"] = on_gpu * weight * trainable / shards
    held[f"optimizer states ({optimizer_states} AdamW)"] = on_gpu * states / shards
    # the weight cache (gradient accumulation; plain, unsharded linears only): FP8 codes in both layouts of the
    # fused tensorwise / delayed linears, a BF16 cast of the 16-bit ones where the weights are FP32 (BF16 master
    # weights are read as they are); a cached linear's backward reads it
    cached = grad_accum > 1 and cuda and not fsdp and tp == 1 and not lora
    fp8_cached = recipe.scaling in (Scaling.TENSOR, Scaling.DELAYED)
    bf16_blocks = m.n_layers - quantized_blocks
    cached_blocks = (bf16_blocks if master_weights == "fp32" else 0) + (quantized_blocks if fp8_cached else 0)
    if cached and cached_blocks:
        held["weight cache (per optimizer step)"] = 2.0 * linear * cached_blocks
    if fsdp:  # the block in use and the prefetched next (zero3), or every block (zero2/zero1), and the root's
        gathered = m.n_layers if fsdp_shard in ("zero2", "zero1") else 2
        if lora:  # the base as stored (codes and scales, or BF16; on average a block's), the root's FP32 in BF16
            base_block = frozen_base_bytes(m, recipe, linear, block, 0.0, lora_quantized_base) / m.n_layers
            held["FSDP gathered weights"] = (gathered * base_block + 2.0 * rest) / tp
        else:
            held["FSDP gathered weights"] = 2.0 * (gathered * block + rest) / tp
        if fsdp_fp8_all_gather:  # each quantized weight's shard as FP8 codes, one byte, until the optimizer step
            held["FP8 all-gather shard codes"] = linear * quantized_blocks / shards
    # copies of the weights a block's backward reuses, held by each block whose forward is kept: the quantized
    # dgrad copy (a LoRA base stored quantized is read as stored), without FSDP autocast's BF16 cast of the
    # others. A compiled block that is recomputed keeps neither (its rerun makes them again), nor does a
    # cached linear (its backward reads the cache)
    kept_blocks = m.n_layers - (len(checkpointed) if compiled else 0)
    per_quantized = 0.0 if (lora and lora_quantized_base) or (cached and fp8_cached) else code_bytes(recipe)
    per_bf16 = 0.0 if fsdp or lora or cached or master_weights == "bf16" else 2.0  # BF16 weights: no cast
    copies = linear * (per_quantized * quantized_blocks + per_bf16 * bf16_blocks) * kept_blocks / m.n_layers / tp
    tokens = mbs * seq_len / (tp * cp)  # TP splits the features (sequence parallelism the rest), CP the sequence
    per = dict(
        compiled=compiled,
        residual_bytes=2 if fsdp and cuda else 4,
        bf16_copies=nvfp4_bf16_copies and recipe.scaling is Scaling.NVFP4,
        lora=lora,
    )
    kept = block_bytes_per_token(m, recipe, "none", **per) * tokens
    saved = block_bytes_per_token(m, recipe, recompute, **per) * tokens if checkpointed else kept
    activations = saved * len(checkpointed) + kept * (m.n_layers - len(checkpointed))
    # context parallelism: each block whose forward is kept holds the K and V it all-gathered (BF16)
    kv_gathered = 2.0 * 2 * m.n_kv_heads * m.hd * mbs * seq_len / tp if cp > 1 else 0.0
    # packed samples (SFT, LoRA): the document mask, made once per forward and held through the backward: on CUDA
    # flex's block tables, 16 bytes per 128 x 128 block of queries x keys (four int32 index tables: partial and
    # full blocks, by query and by key), elsewhere SDPA's bool mask, a byte per query x key; under CP the queries
    # are this rank's tokens, the keys the whole sequence's
    queries = seq_len // cp
    pairs = math.ceil(queries / 128) * math.ceil(seq_len / 128) * 16 if cuda else queries * seq_len
    doc_mask = mbs * pairs if workload in ("sft", "lora") else 0.0
    # gradient accumulation: the earlier micro-batches' gradients, FSDP's unsharded in its reduction dtype
    experts = sum(p.numel() for n, p in model.layers.named_parameters() if ".experts." in n) if ep > 1 else 0
    accumulated = (
        (
            reduce_bytes / tp * (trainable - experts) + weight * experts / ep / tp
            if fsdp
            else weight / shards * trainable
        )
        if grad_accum > 1
        else 0.0
    )
    grads = {"accumulated gradients": accumulated} if accumulated else {}
    # the head's backward, eager: log-softmax's FP32 output, its gradient and the FP32 logits' gradient (then
    # the BF16 one, once the first two are freed); compiled (one process or DDP): the BF16 logits and their
    # FP32 gradient; chunked (--fused-loss, only where the head is a plain local linear): :func:`chunked_loss_bytes`;
    # TP: its share of the vocabulary (the vocabulary-parallel loss, parallel/tp.py) in the same three FP32 tensors
    per_logit = 6 if compiled and not fsdp and tp == 1 else 12
    if fused_loss and not fsdp and tp == 1:
        logits = chunked_loss_bytes(m, mbs * seq_len, cuda=cuda, trains_head=not lora)
    else:
        logits = mbs * seq_len / cp * m.vocab_size * per_logit / tp
    phases = {
        "the loss's backward": {
            **held,
            **grads,
            "weight copies held for backward": copies,
            f"activations ({recompute})": activations,
            "gathered K/V (CP)": kv_gathered * (m.n_layers - len(checkpointed)),
            "document mask": doc_mask,
            "logits and loss": logits,
        }
    }
    if (m.n_layers - 1) in checkpointed:  # the last block's rerun: its whole activations again, the head's gradient
        head_grad = 0.0 if accumulated or lora else (2.0 / tp if fsdp else weight / shards) * head
        phases["the last block's rerun"] = {
            **held,
            **grads,
            "gradients so far (LM head)": head_grad,
            "weight copies held for backward": copies,
            f"activations ({recompute})": activations,
            "gathered K/V (CP)": kv_gathered * (m.n_layers - len(checkpointed) + 1),
            "document mask": doc_mask,
            "one block recomputed": kept,
        }
    # the end of the backward: every gradient; under FSDP the root's (embeddings, head) still unsharded, in the
    # compute dtype, beside its reduce-scatter input in the reduction dtype, every block resharded
    if fsdp and not lora:
        phases["the end of the backward"] = {
            **{k: v for k, v in held.items() if k != "FSDP gathered weights"},
            f"gradients ({master_weights})": on_gpu * weight * (trainable - rest) / shards,
            "the root's gradients (unsharded, reduce-scatter input)": (2.0 + reduce_bytes) * rest / tp,
        }
    else:
        # tied embeddings: the embedding's backward makes a second gradient of the shared weight (dense, the master
        # dtype) while the head's is already its .grad, and autograd adds it in place: one more for that moment
        tied = on_gpu * weight * head / shards if m.tie_embeddings and first and last and not lora else 0.0
        phases["the end of the backward"] = {
            **held,
            f"gradients ({master_weights})": on_gpu * weight * trainable / shards,
            "the tied embeddings' second gradient": tied,
        }
    when = max(phases, key=lambda k: sum(phases[k].values()))
    build = build_peak(m, recipe, linear, block, rest, lora=lora, quantized_base=lora_quantized_base, shards=shards)
    return Estimate({k: v for k, v in phases[when].items() if v}, when=when, build=build)


def chunked_loss_bytes(m: ModelConfig, tokens: int, *, cuda: bool, trains_head: bool) -> float:
    """What the chunked LM head + cross-entropy (``models/fused_loss.py``) holds at its peak, in its forward: the
    input's BF16 gradient, one chunk's FP32 logits, their exponentials and softmax (12 bytes a logit), and on
    CUDA, for a trained head, the BF16 gradient of every logit (its weight gradient is one GEMM over them)."""
    from lpbench.models.fused_loss import CHUNK_ELEMENTS

    chunk = min(tokens, max(1, CHUNK_ELEMENTS["cuda" if cuda else "cpu"] // m.vocab_size)) * m.vocab_size
    every = 2.0 * tokens * m.vocab_size if cuda and trains_head else 0.0
    return 2.0 * tokens * m.dim + 12.0 * chunk + every


def frozen_base_bytes(
    m: ModelConfig, recipe: Recipe, linear: float, block: float, rest: float, quantized_base: bool
) -> float:
    """A LoRA run's frozen base: the block linears in BF16 or stored quantized (blocks the recipe keeps in
    BF16 stay BF16), the blocks' norms in BF16, the embeddings, final norm and head as built (FP32)."""
    quantized_blocks = (
        max(0, m.n_layers - recipe.first_bf16_layers - recipe.last_bf16_layers) if recipe.quantized else 0
    )
    per = stored_bytes(recipe) if quantized_base else 2.0  # per element of a quantized block's linears
    stored = per * quantized_blocks + 2.0 * (m.n_layers - quantized_blocks)
    return stored * linear + 2.0 * (block - linear) * m.n_layers + 4.0 * rest


def build_peak(
    m: ModelConfig,
    recipe: Recipe,
    linear: float,
    block: float,
    rest: float,
    *,
    lora: bool,
    quantized_base: bool,
    shards: int = 1,
) -> float:
    """The build's peak (``parallel/plan.py: materialize``: on the meta device, then value by value). Without LoRA:
    the model's FP32 parameters (sharded: this rank's) and one parameter's FP32 values drawn whole. LoRA: the
    model as built (the base as stored, everything outside the blocks FP32; on several ranks, this rank's share,
    allocated at once), and the value being written: the largest weight's FP32 values and, for a base stored
    quantized, their BF16 cast and quantization (``quantize``, FP8 scalings: the scaled and the saturated FP32
    values and the codes, 9 bytes an element; MX and NVFP4 also the FP32 copy and the scales spread per element,
    13); a BF16 base on one process also its block in BF16. Or, if more, the embeddings' values drawn whole
    (FP32): on one process, when only the parts outside the blocks exist."""
    largest = m.ffn_dim * (2 if m.gated else 1) * m.dim * max(1, m.n_experts)  # a block's
    whole = 4.0 * (block * m.n_layers + rest)
    embeddings = 4.0 * m.vocab_size * m.dim
    if not lora:  # the embeddings' values are drawn whole too, but before any block
        return whole / shards + 4.0 * max(largest, m.vocab_size * m.dim)
    done = frozen_base_bytes(m, recipe, linear, block, rest, quantized_base)
    fp8 = recipe.scaling in (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW, Scaling.BLOCK)
    if quantized_base and recipe.quantized:
        value = (4.0 + 2.0 + (9.0 if fp8 else 13.0)) * largest
    else:
        value = 4.0 * largest + (2.0 * block if shards == 1 else 0.0)
    if shards > 1:
        return done / shards + max(value, embeddings)
    return max(done + value, 4.0 * rest + embeddings)


def in_flight(pp: int, vp: int, micro_batches: int, schedule: str, rank: int) -> int:
    """Stage-chunks (one stage's blocks, one micro-batch) whose activations pipeline rank ``rank`` keeps at its
    peak: 1F1B, ``p - r``; interleaved (torch's and Megatron's warm-up, plus the one of the steady state),
    ``(v - 1) p + 2 (p - 1 - r) + 1``; at most every chunk, ``m v``. The zero-bubble schedules count as interleaved."""
    if schedule == "1f1b":
        return min(pp - rank, micro_batches)
    return min((vp - 1) * pp + 2 * (pp - 1 - rank) + 1, micro_batches * vp)


def pipeline_estimate(
    m: ModelConfig, recipe: Recipe, pp: int, vp: int, schedule: str | None, rank_blocks: list[int] | None = None, **kw
) -> Estimate:
    """The peak of the busiest pipeline rank: each counted as a model of its blocks (``rank_blocks[r]``, the
    split's, :func:`lpbench.parallel.pp.rank_blocks`; default ``ceil(n / pp)`` on every rank), with the embedding
    on the first stage's rank and the LM head on the last's, whose activations, and under CP the K and V its blocks
    gathered, are those of the stage-chunks it keeps in flight (:func:`in_flight`) instead of one micro-batch's;
    each such chunk also keeps its output, the hidden states it sent on (torch's stage holds them for the chunk's
    backward), but for the last stage's (its loss); and each of the rank's stages has a receive posted ahead of
    its compute, whose buffer exists already (:class:`lpbench.parallel.pp.Stage`: one per stage, as counted on CPU
    runs); the logits only on the last stage's rank."""
    from dataclasses import replace

    schedule = schedule or ("1f1b" if vp == 1 else "interleaved-1f1b")
    rank_blocks = rank_blocks or [-(-m.n_layers // pp)] * pp
    last = 0 if schedule == "zbv" else pp - 1  # the rank of the last stage
    residual = 2 if uses_fsdp(kw["fsdp"], kw["dp"], kw["cp"]) and kw["cuda"] else 4  # the hidden states' bytes
    hidden = residual * m.dim * kw["mbs"] * kw["seq_len"] / (kw["tp"] * kw["cp"])
    shares: dict[tuple, Estimate] = {}
    out = []
    for rank, blocks in enumerate(rank_blocks):
        ends = (rank == 0, rank == last)
        if (blocks, ends) not in shares:
            shares[blocks, ends] = estimate(replace(m, n_layers=blocks), recipe, pp_ends=ends, **kw)
        share = shares[blocks, ends]
        parts = dict(share.parts)
        chunks = in_flight(pp, vp, kw["grad_accum"], schedule, rank)
        for name in parts:
            if name.startswith("activations (") or name == "gathered K/V (CP)":
                parts[name] *= chunks / vp  # a stage-chunk: one micro-batch through a stage, 1/vp of the blocks
        if share.when == "the loss's backward":
            parts["stage outputs held for backward"] = hidden * chunks * ((vp - 1) / vp if rank == last else 1)
            parts["receive buffers posted ahead"] = hidden * vp
        if rank != last:
            parts.pop("logits and loss", None)
        out.append(Estimate(parts, when=share.when, build=share.build))
    return max(out, key=lambda e: e.total)

"""Tensor parallelism through DTensor: Megatron's column/row-wise linears and sequence-parallel norms.

Per block: ``attn.qkv`` and ``mlp.gate_up|up`` column-wise, ``attn.o`` and ``mlp.down`` row-wise.
MoE blocks (torchtitan's and Megatron's expert tensor parallelism): the router is replicated and every
rank keeps all experts with its slice of their FFN width (stacked ``gate_up``/``up`` split along
their out features, ``down`` along its in features, as plain tensors: :class:`ExpertsTP`); the
layer sees the whole sequence, its experts' partial outputs are all-reduced. Quantized experts get
each weight's split as a :class:`TPShard` (:meth:`ExpertsTP.shard`) and quantize as split linears do. Vocabulary-parallel embedding and
``lm_head`` (a tied pair stays one parameter); the logits stay split by vocabulary, and the cross-entropy is
Megatron's vocabulary-parallel one (:class:`VocabParallel`: the max, the sum of exponentials and the target's logit
all-reduced over the group), so no rank holds the whole vocabulary's logits (256 K for Nemotron-4). Ours because
torch's ``loss_parallel`` must also wrap the backward, which the pipeline schedules run themselves.
With sequence parallelism the residual stream between the sublayers is split along the
sequence (norms run on ``S / tp`` tokens; all-gather in, reduce-scatter out).

The fused ``qkv`` ([q; k; v]) and ``gate_up`` ([gate; up]) weights are stored section-
interleaved per rank before sharding — rows ``[q_0; k_0; v_0; q_1; k_1; v_1; …]`` — so the
contiguous ``Shard(0)`` of rank r is exactly its heads of q, k and v (its slice of gate and
up), and the model's own ``split``/``chunk`` of the local output stays right. The weight is
the same linear map up to that row order; attention modules are told their local head counts.

A LoRA-wrapped linear (one with ``split_tp``: ``convert/lora.py: LoRALinear``) is left out of the
plan: it splits its base and adapters itself and runs their communication (see that module).

Every split linear gets a ``tp_shard`` attribute (:class:`TPShard`: group, rank, split dim and
sections), which quantized linears use to quantize their shards as the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lpbench.convert.lora import LoRAExperts
from lpbench.errors import UsageError
from lpbench.gemm import AllReduce, GradAllReduce


@dataclass(frozen=True)
class VocabParallel:
    """The LM head's split over a TP group (the decoder's ``vocab_parallel``): rank ``rank`` of ``size`` holds
    vocabulary entries ``[rank·width, (rank + 1)·width)`` (DTensor's ``Shard`` chunks; the last may be shorter)."""

    group: dist.ProcessGroup
    rank: int
    size: int
    vocab: int

    @property
    def width(self) -> int:
        """Entries a rank holds (the last rank's may be fewer): DTensor's chunk, ⌈vocab / size⌉."""
        return -(-self.vocab // self.size)

    @torch.compiler.disable  # collectives inside an autograd function: eager under --compile-scope model
    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Each token's cross-entropy (FP32; 0 where ``labels`` is ``ignore_index``) from this rank's ``logits``
        [N, its vocabulary entries] and the whole vocabulary's ``labels`` [N]."""
        return _VocabParallelCrossEntropy.apply(logits, labels, self.rank * self.width, self.group, ignore_index)

    @torch.compiler.disable
    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits from every rank's split of them (no gradient: validation, generation)."""
        mine = torch.nn.functional.pad(logits, (0, self.width - logits.shape[-1])).contiguous()  # as the first's
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split by vocabulary over ``group``: log Σ exp(x − max) − (x_target − max), with the
    max, the sum and the target's logit (held by one rank) all-reduced; backward: softmax − one-hot, local."""

    @staticmethod
    def forward(ctx, logits, labels, start: int, group, ignore_index: int):
        x = logits.float()
        top = x.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        x = x - top[:, None]
        local = labels - start
        mine = (local >= 0) & (local < x.shape[-1])
        index = torch.where(mine, local, 0)
        target = torch.where(mine, x.gather(1, index[:, None]).squeeze(1), 0.0)
        x = x.exp_()
        total = x.sum(dim=-1)
        dist.all_reduce(total, group=group)
        dist.all_reduce(target, group=group)
        valid = labels != ignore_index
        ctx.save_for_backward(x.div_(total[:, None]), index, mine, valid)  # the softmax, in place of the exps
        ctx.dtype = logits.dtype
        return torch.where(valid, total.log() - target, 0.0)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid = ctx.saved_tensors  # kept intact: a split backward may run this again
        grad = torch.where(valid, grad, 0.0)
        out = softmax * grad[:, None]
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, index] -= torch.where(mine, grad, 0.0)
        return out.to(ctx.dtype), None, None, None, None


@dataclass(frozen=True)
class TPShard:
    """How :func:`apply_tp` split a linear (its ``tp_shard`` attribute).

    ``dim``: the weight dim split over ``group`` (0 column-wise: out features; 1 row-wise: in
    features). ``sections``: that dim's fused parts in unsharded order ([q, k, v], [gate, up];
    one part otherwise); rank r holds the r-th of ``size`` equal chunks of each part.
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    dim: int
    sections: tuple[int, ...]

    def index(self, device: torch.device) -> torch.Tensor:
        """Unsharded positions (along ``dim``) of this rank's features, in local order."""
        return torch.cat(
            [
                torch.arange(
                    start + self.rank * n // self.size, start + (self.rank + 1) * n // self.size, device=device
                )
                for start, n in zip(accumulate((0, *self.sections)), self.sections)
            ]
        )


@dataclass(frozen=True)
class ExpertsTP:
    """One MoE layer's experts split over a tensor-parallel group (their kernel's ``tp``; see the module doc).

    Rank r holds, for every expert, the r-th of ``size`` chunks of the FFN width: rows
    ``[gate_r; up_r]`` of ``gate_up`` (``up_r`` of ``up``) and columns r of ``down``.
    """

    group: dist.ProcessGroup
    rank: int
    size: int

    @torch.compiler.disable
    def enter_hook(self, experts: nn.Module, args: tuple) -> tuple:
        """The experts' forward pre-hook: their input in the compute dtype, its gradient summed over the group."""
        x, *rest = args
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return GradAllReduce.apply(x, self.group), *rest

    @torch.compiler.disable
    def leave_hook(self, experts: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        """The experts' forward hook: their partial outputs summed over the group."""
        return AllReduce.apply(y, self.group)

    def shard(self, name: str, local_shape: torch.Size) -> TPShard:
        """The split of stacked weight ``name`` (local shape ``local_shape``) as one expert's linear sees it:
        what its quantized GEMMs need to quantize the slice as the whole weight (``tp_shard``)."""
        if name == "down":
            return TPShard(self.group, self.rank, self.size, 1, (local_shape[2] * self.size,))
        n = local_shape[1] * self.size
        return TPShard(self.group, self.rank, self.size, 0, (n // 2, n // 2) if name == "gate_up" else (n,))

    def local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the stacked expert weight ``name`` (``full``: all of it)."""
        if name == "down":
            return full.chunk(self.size, 2)[self.rank]
        sections = [full.shape[1] // 2] * 2 if name == "gate_up" else [full.shape[1]]
        return torch.cat([part.chunk(self.size, 1)[self.rank] for part in full.split(sections, 1)], 1)


def _shard_experts(experts: nn.Module, shard: ExpertsTP) -> None:
    """Replace ``experts``' stacked weights by this rank's parts (meta tensors stay meta)."""
    if isinstance(experts.gemm, LoRAExperts):
        raise UsageError("--tp does not split LoRA adapters of MoE experts: use --tp 1, or --lora-targets qkv,o")
    for name, p in list(experts.named_parameters(recurse=False)):
        local = shard.local(name, p.detach())
        setattr(experts, name, nn.Parameter(local if p.is_meta else local.clone(), requires_grad=p.requires_grad))
    experts.gemm.set_tp(shard, experts)
    experts.register_forward_pre_hook(shard.enter_hook)
    experts.register_forward_hook(shard.leave_hook)


def interleave(t: torch.Tensor, sections: list[int] | tuple[int, ...], tp: int) -> torch.Tensor:
    """Rows [a; b; …] of a fused weight or bias reordered to [a_0; b_0; …; a_1; b_1; …] (see module doc)."""
    parts = [s.chunk(tp, 0) for s in t.split(list(sections), 0)]
    return torch.cat([part[r] for r in range(tp) for part in parts])


@torch.no_grad()
def interleave_sections(linear: nn.Linear, sections: list[int], tp: int) -> None:
    """:func:`interleave` the output rows of a fused linear in place."""
    for p in (linear.weight, linear.bias):
        if p is not None:
            p.copy_(interleave(p, sections, tp))


def split_linears(block: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """A block's tensor-parallel linears: name -> (split weight dim, that dim's fused sections)."""
    attn = block.attn
    q, kv = attn.n_heads * attn.hd, attn.n_kv * attn.hd
    out = {"attn.qkv": (0, (q, kv, kv)), "attn.o": (1, (q,))}
    mlp = block.mlp
    if hasattr(mlp, "experts"):  # stacked experts: split by _shard_experts
        return out
    ffn = mlp.down.in_features
    out["mlp.gate_up" if hasattr(mlp, "gate_up") else "mlp.up"] = (0, (ffn, ffn) if hasattr(mlp, "gate_up") else (ffn,))
    out["mlp.down"] = (1, (ffn,))
    return out


def _mlp_plan(mlp: nn.Module, prefix: str, down_out) -> dict:
    up = "gate_up" if hasattr(mlp, "gate_up") else "up"
    return {f"{prefix}.{up}": ColwiseParallel(), f"{prefix}.down": RowwiseParallel(output_layouts=down_out)}


def block_plan(block: nn.Module, sp: bool) -> dict:
    """The parallelize_module plan of one transformer block."""
    seq = Shard(1) if sp else Replicate()
    plan = {"attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=seq)}
    if block.attn.q_norm is not None:  # per-head norms see this rank's heads: shard them on the head dim
        plan.update(
            {
                "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            }
        )
    if sp:
        plan.update(
            {
                "attn_norm": SequenceParallel(),
                "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),  # (x, rope, mask)
                    desired_input_layouts=(Replicate(), None, None),
                ),
            }
        )
    if hasattr(block.mlp, "experts"):  # the layer sees the whole sequence and gives the whole output
        if sp:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
        return plan
    plan.update(_mlp_plan(block.mlp, "mlp", seq))
    if sp:
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def localize_block(block: nn.Module, tp: int) -> None:
    """Interleave the fused weights per rank and give attention its local head counts (see module doc)."""
    for name, (_, sections) in split_linears(block).items():
        module = block.get_submodule(name)
        if len(sections) > 1 and not hasattr(module, "split_tp"):  # LoRA: split_tp takes rows in local order
            interleave_sections(module, list(sections), tp)
    block.attn.n_heads, block.attn.n_kv = block.attn.n_heads // tp, block.attn.n_kv // tp


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Shard ``model`` (a :class:`lpbench.models.decoder.Decoder`) over the 1-D ``mesh`` in place.

    Linear subclasses with their own GEMMs must declare ``tp_aware = True`` (see
    :func:`lpbench.gemm.local_linear`); others are refused with a UsageError before
    anything changes, as is a split that cuts a linear's quantization blocks (its ``tp_multiple``: every rank's part of
    every section must be a whole number of blocks, so that the blocks are the unsharded ones).
    """
    tp, sp = mesh.size(), sequence_parallel
    seq = Shard(1) if sp else Replicate()
    first, last = model.tok_embeddings is not None, model.lm_head is not None  # a pipeline stage may lack either
    tied = first and last and model.lm_head.weight is model.tok_embeddings.weight
    plan = {}
    if first:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if last:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1))
    if sp:
        if last:
            plan["norm"] = SequenceParallel()
        if model.pos_embeddings is not None:
            plan["pos_embeddings"] = PrepareModuleOutput(
                output_layouts=Replicate(),  # [S, D] or [B, S, D]
                desired_output_layouts=Shard(-2),
            )
    splits = {}
    for i, block in model.layers.named_children():
        plan.update({f"layers.{i}.{k}": v for k, v in block_plan(block, sp).items()})
        splits.update({f"layers.{i}.{k}": v for k, v in split_linears(block).items()})
    own = {name for name in splits if hasattr(model.get_submodule(name), "split_tp")}  # LoRA wrappers
    plan = {name: style for name, style in plan.items() if name not in own}
    for name in plan:
        module = model.get_submodule(name)
        if type(module) is not nn.Linear and isinstance(module, nn.Linear) and not getattr(module, "tp_aware", False):
            raise UsageError(
                f"{type(module).__name__} ({name}) does not support tensor parallelism yet: "
                "run this precision with --tp 1"
            )
    cuts = [
        (name, sections, getattr(model.get_submodule(name), "tp_multiple", 1)) for name, (_, sections) in splits.items()
    ]
    for i, block in model.layers.named_children():  # experts: every rank's part of the FFN width, as a dense MLP's
        experts = getattr(block.mlp, "experts", None)
        if experts is not None and experts.gemm.recipe is not None:
            cuts.append((f"layers.{i}.mlp.experts", (experts.down.shape[2],), experts.gemm.recipe.block or 1))
    for name, sections, multiple in cuts:
        if bad := [n // tp for n in sections if n // tp % multiple]:
            raise UsageError(
                f"--tp {tp} splits {name} into parts of {bad[0]} features, not whole {multiple}-element "
                "quantization blocks: use a smaller --tp or another precision"
            )
    for block in model.layers:
        localize_block(block, tp)
        if hasattr(block.mlp, "experts"):
            _shard_experts(block.mlp.experts, ExpertsTP(mesh.get_group(), mesh.get_local_rank(), tp))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # LoRA's base
    parallelize_module(model, mesh, plan)
    for name, p in model.named_parameters():  # the styles make every parameter they shard trainable
        if name in frozen:
            p.requires_grad_(False)
    if tied:
        model.lm_head.weight = model.tok_embeddings.weight
    if last:
        model.vocab_parallel = VocabParallel(mesh.get_group(), mesh.get_local_rank(), tp, model.cfg.vocab_size)
    for module in model.modules():  # the styles replicate buffers as DTensors: keep them plain (amax histories)
        for name, buffer in module.named_buffers(recurse=False):
            if isinstance(buffer, DTensor):
                module._buffers[name] = buffer.to_local().detach()
    for name, (dim, sections) in splits.items():
        shard = TPShard(mesh.get_group(), mesh.get_local_rank(), tp, dim, sections)
        if name in own:
            model.get_submodule(name).split_tp(mesh, shard, sp)
        model.get_submodule(name).tp_shard = shard
    return model

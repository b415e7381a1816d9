"""Tensor parallelism through DTensor: Megatron's column/row-wise linears and sequence-parallel norms.

Per block: ``attn.qkv`` and ``mlp.gate_up|up`` column-wise, ``attn.o`` and ``mlp.down`` row-wise
(MoE: every expert's MLP likewise, the router replicated). Vocabulary-parallel embedding and
``lm_head`` (a tied pair stays one parameter); the logits are gathered before the loss.
With sequence parallelism the residual stream between the sublayers is split along the
sequence (norms run on ``S / tp`` tokens; all-gather in, reduce-scatter out).

The fused ``qkv`` ([q; k; v]) and ``gate_up`` ([gate; up]) weights are stored section-
interleaved per rank before sharding — rows ``[q_0; k_0; v_0; q_1; k_1; v_1; …]`` — so the
contiguous ``Shard(0)`` of rank r is exactly its heads of q, k and v (its slice of gate and
up), and the model's own ``split``/``chunk`` of the local output stays right. The weight is
the same linear map up to that row order; attention modules are told their local head counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from lpbench.errors import UsageError


@torch.no_grad()
def interleave_sections(linear: nn.Linear, sections: list[int], tp: int) -> None:
    """Reorder the output rows of a fused linear from [a; b; …] to [a_0; b_0; …; a_1; b_1; …] in place."""
    for p in (linear.weight, linear.bias):
        if p is not None:
            parts = [s.chunk(tp, 0) for s in p.split(sections, 0)]
            p.copy_(torch.cat([part[r] for r in range(tp) for part in parts]))


def _mlp_plan(mlp: nn.Module, prefix: str, down_out) -> dict:
    up = "gate_up" if hasattr(mlp, "gate_up") else "up"
    return {f"{prefix}.{up}": ColwiseParallel(), f"{prefix}.down": RowwiseParallel(output_layouts=down_out)}


def block_plan(block: nn.Module, sp: bool) -> dict:
    """The parallelize_module plan of one transformer block."""
    seq = Shard(1) if sp else Replicate()
    plan = {"attn.qkv": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=seq)}
    if block.attn.q_norm is not None:  # per-head norms see this rank's heads: shard them on the head dim
        plan.update({"attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                     "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
    if sp:
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),  # (x, rope, mask)
                                                desired_input_layouts=(Replicate(), None, None))})
    if hasattr(block.mlp, "experts"):  # experts see a token subset: all-reduce, then re-split the sequence
        for e, expert in enumerate(block.mlp.experts):
            plan.update(_mlp_plan(expert, f"mlp.experts.{e}", Replicate()))
        if sp:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        return plan
    plan.update(_mlp_plan(block.mlp, "mlp", seq))
    if sp:
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def localize_block(block: nn.Module, tp: int) -> None:
    """Interleave the fused weights per rank and give attention its local head counts (see module doc)."""
    attn = block.attn
    interleave_sections(attn.qkv, [attn.n_heads * attn.hd, attn.n_kv * attn.hd, attn.n_kv * attn.hd], tp)
    attn.n_heads, attn.n_kv = attn.n_heads // tp, attn.n_kv // tp
    for mlp in getattr(block.mlp, "experts", [block.mlp]):
        if hasattr(mlp, "gate_up"):
            interleave_sections(mlp.gate_up, [mlp.down.in_features] * 2, tp)


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True) -> nn.Module:
    """Shard ``model`` (a :class:`lpbench.models.decoder.Decoder`) over the 1-D ``mesh`` in place.

    Linear subclasses with their own GEMMs must declare ``tp_aware = True`` (see
    :func:`local_linear`); others are refused with a UsageError before anything changes.
    """
    tp, sp = mesh.size(), sequence_parallel
    seq = Shard(1) if sp else Replicate()
    tied = model.lm_head.weight is model.tok_embeddings.weight
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sp:
        plan["norm"] = SequenceParallel()
        if model.pos_embeddings is not None:
            plan["pos_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(),  # [S, D] or [B, S, D]
                                                         desired_output_layouts=Shard(-2))
    for i, block in enumerate(model.layers):
        plan.update({f"layers.{i}.{k}": v for k, v in block_plan(block, sp).items()})
    for name in plan:
        module = model.get_submodule(name)
        if type(module) is not nn.Linear and isinstance(module, nn.Linear) and not getattr(module, "tp_aware", False):
            raise UsageError(f"{type(module).__name__} ({name}) does not support tensor parallelism yet: "
                             "run this precision with --tp 1")
    for block in model.layers:
        localize_block(block, tp)
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.tok_embeddings.weight
    return model


def amax_group(module: nn.Module, *, include_dp: bool = False) -> dist.ProcessGroup | None:
    """The process group a quantized linear all-reduces (MAX) its per-tensor amaxes over, or None.

    A tensor-parallel linear (weight a DTensor on a mesh with a ``"tp"`` dim, whether FSDP has
    it sharded or gathered) gets the TP group: its weight and its input or output gradient are
    sharded, so a tensor-wide scale (fp8-tensorwise/delayed, NVFP4's global scale) needs the amax
    of the whole tensor. ``include_dp`` returns the world group instead (Megatron reduces
    delayed-scaling amaxes over data-parallel ranks too, so every replica keeps one history).
    """
    if include_dp and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    w = module.weight
    names = (w.device_mesh.mesh_dim_names or ()) if isinstance(w, DTensor) else ()
    if "tp" not in names:
        return None
    mesh = w.device_mesh["tp"] if len(names) > 1 else w.device_mesh
    return mesh.get_group() if mesh.size() > 1 else None


def local_linear(module: nn.Linear, x: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn(x, weight, bias)`` on the plain local shards of a tensor-parallel linear.

    For a Linear subclass with its own GEMMs (a quantized linear): call this from ``forward``
    and declare ``tp_aware = True`` (:func:`apply_tp` refuses Linear subclasses without it).
    Column-wise (weight ``Shard(0)``): the output is ``Shard(-1)``. Row-wise (``Shard(1)``):
    a partial sum, reduced by the parallel style, with the replicated bias added after the
    reduction. Not tensor parallel: ``fn`` on the module's own tensors. Differentiable.
    """
    w, b = module.weight, module.bias
    if not isinstance(w, DTensor):
        return fn(x, w, b)
    mesh, (placement,) = w.device_mesh, w.placements
    if placement == Shard(0):  # column-wise: x replicated, its gradient a partial sum over ranks
        y = fn(x.to_local(grad_placements=[Partial()]), w.to_local(), None if b is None else b.to_local())
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
    if placement == Shard(1):  # row-wise: x sharded on its last dim, the output a partial sum
        y = DTensor.from_local(fn(x.to_local(), w.to_local(), None), mesh, [Partial()], run_check=False)
        return y if b is None else y + b
    raise ValueError(f"local_linear: unsupported weight placement {placement}")

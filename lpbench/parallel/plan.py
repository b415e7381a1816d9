"""``parallelize``: one model, one config -> the module to train on the layout's device mesh.

The layout and every group come from :class:`lpbench.parallel.dims.ParallelDims`. Order
(torchtitan's): tensor parallel on the ``tp`` mesh, expert parallel (``--ep``, the experts of each
MoE layer spread over data-parallel ranks, :mod:`lpbench.parallel.ep`), context parallel (``--cp``,
:mod:`lpbench.parallel.cp`: the sequence split over the ``cp`` mesh), activation recomputation
(``--recompute``, :mod:`lpbench.parallel.recompute`), ``torch.compile``, then
FSDP2 (``fsdp`` mesh: 1-D, or 2-D for HSDP) or DDP (``dp_replicate`` mesh) over the other weights; one process
with ``--offload-optimizer`` is FSDP2 on a mesh of one with CPU offload. A model built on the meta device (no memory) is sharded first, then
allocated and initialised (:func:`materialize`: after FSDP, else before DDP, which needs the
values): every rank keeps its shard of the very weights a single process would build from the
same seed, so all layouts start from identical weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._inductor.config
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lpbench.config import RunConfig
from lpbench.models.decoder import assign, initial_values
from lpbench.models.moe import Experts, moe_layers
from lpbench.parallel.cp import ContextParallel, apply_cp
from lpbench.parallel.dims import Meshes, ParallelDims
from lpbench.parallel.dp import apply_ddp, apply_fsdp, one_rank_mesh, reduce_dtype
from lpbench.parallel.ep import apply_ep
from lpbench.parallel.pp import (
    Pipeline,
    rank_stages,
    rank_view,
    stage_blocks,
    stage_fsdp_shard,
    stage_module,
    stage_sizes,
    tie_groups,
)
from lpbench.parallel.recompute import apply_recompute
from lpbench.precision import noise
from lpbench.precision.delayed import DelayedScaling
from lpbench.convert.quantize import apply_fp8_all_gather
from lpbench.parallel.tp import apply_tp, interleave


@dataclass
class Parallelized:
    module: nn.Module  # the model, DDP- or FSDP-wrapped: its parameters, train(), gradient sync
    forward: nn.Module  # what to call: ``module``, or ``module`` compiled
    dims: ParallelDims  # the layout
    meshes: Meshes | None  # its device mesh and named sub-meshes; None for one process
    dp_rank: int  # which data shard this rank reads (TP and CP ranks of one DP group read the same)
    context: ContextParallel | None = None  # under CP: this rank's part of each sequence
    pipeline: Pipeline | None = None  # under --pp: this rank's stages and their schedule (``module``: their view)

    def local(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """A micro-batch's model arguments as this rank takes them: under CP, its chunks of each sequence."""
        return args if self.context is None else self.context.shard(args)


def parallelize(
    model: nn.Module,
    cfg: RunConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    use_compile: bool,
    init: Callable[[nn.Module], None] | None = None,
) -> Parallelized:
    """Apply ``cfg``'s TP / FSDP / DDP to ``model`` in place, and ``torch.compile``.

    ``init(module)`` materializes a meta-device model (or pipeline stage) once it is split (default:
    :func:`materialize` with ``cfg``'s seed; ``train/workload.py: prepare_model`` gives the run's: its
    converters' hooks and ``--hf-checkpoint``'s values).

    ``--compile-scope block`` (default): each block is compiled before wrapping, as torchtitan
    does; the blocks share one code object, so one block's compilation serves all of them.
    With one process or DDP the output head (norm, LM head, loss) is compiled apart too, so the
    FP32 logits are never stored. ``model`` (one process or DDP only): one whole-model graph
    (DDP through Dynamo's DDPOptimizer), which may fuse across block boundaries.
    """
    if use_compile:  # compiled code rounds wherever eager code rounds (e.g. a BF16 activation
        # before its FP8 cast), so compiled quantizers see the values the reference sees
        torch._inductor.config.emulate_precision_casts = True
    whole = use_compile and cfg.compile_scope == "model"
    by_block = use_compile and not whole
    dims = ParallelDims.of(cfg)
    init = init or (lambda module: materialize(module, device, cfg.seed))
    if cfg.world_size == 1:
        init(model)
        apply_recompute(model, cfg.recompute, cfg.recompute_every)
        if by_block:
            compile_blocks(model, head=not cfg.offload_optimizer)
        if cfg.offload_optimizer:  # FSDP2 on a mesh of one, its shards (the whole weights) on the CPU: torchtitan's
            dtype = compute_dtype if device.type == "cuda" else None
            model = apply_fsdp(model, one_rank_mesh(device), dtype, reduce_dtype(cfg.grad_reduce_dtype), offload=True)
        return Parallelized(model, torch.compile(model) if whole else model, dims, None, 0)
    meshes = dims.mesh(device.type)
    if dims.pp_enabled:
        return pipeline(model, cfg, dims, meshes, device, compute_dtype, by_block, init)
    module, context = shard(model, cfg, dims, meshes, device, compute_dtype, by_block, init)
    forward = torch.compile(module) if whole else module
    return Parallelized(module, forward, dims, meshes, meshes.rank("batch"), context)


def shard(
    model: nn.Module,
    cfg: RunConfig,
    dims: ParallelDims,
    meshes: Meshes,
    device: torch.device,
    compute_dtype: torch.dtype,
    by_block: bool,
    init: Callable[[nn.Module], None],
) -> tuple[nn.Module, ContextParallel | None]:
    """TP, EP, CP, recompute, per-block compile, FSDP2 or DDP on ``model`` (a decoder, or a pipeline stage), which
    ``init`` materializes once split (before DDP, which needs the values); returns the module to call (wrapped by
    DDP, or ``model`` itself) and CP's sequence split."""
    if dims.tp_enabled:
        apply_tp(model, meshes["tp"], cfg.sequence_parallel)
    if dims.ep_enabled:
        apply_ep(model, meshes["ep"], cfg.ep_chunks)
    context = apply_cp(model, meshes.group("cp"), meshes.rank("cp"), dims.cp) if dims.cp_enabled else None
    for moe in moe_layers(model):  # the load-balancing loss counts the tokens of every data-parallel and CP rank
        moe.count_group = meshes.group("loss")
    if not dims.fsdp_enabled:
        init(model)
    apply_recompute(model, cfg.recompute, cfg.recompute_every)
    if by_block:
        compile_blocks(model, head=not cfg.fsdp and cfg.tp == 1 and model.lm_head is not None)
        if cfg.tp > 1 and model.tok_embeddings is not None:  # torch 2.13: a compiled block fed a DTensor's own
            # local tensor fails in backward
            model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    module = model
    if dims.fsdp_enabled:
        if cfg.fsdp_fp8_all_gather:
            apply_fp8_all_gather(model)
        module = apply_fsdp(
            model,
            meshes["fsdp"],
            compute_dtype if device.type == "cuda" else None,
            reduce_dtype(cfg.grad_reduce_dtype),
            cfg.fsdp_shard,
        )
        init(model)
    elif dims.ddp_enabled:
        module = apply_ddp(model, meshes["dp_replicate"], device, reduce_dtype(cfg.grad_reduce_dtype))
    return module, context


def pipeline(
    model: nn.Module,
    cfg: RunConfig,
    dims: ParallelDims,
    meshes: Meshes,
    device: torch.device,
    compute_dtype: torch.dtype,
    by_block: bool,
    init: Callable[[nn.Module], None],
) -> Parallelized:
    """``model`` cut into this rank's pipeline stages (:mod:`lpbench.parallel.pp`), each sharded as a whole model
    would be (:func:`shard`), and the schedule that runs them."""
    schedule = cfg.schedule
    n_stages = cfg.pp * cfg.vp
    blocks = stage_blocks(stage_sizes(cfg, model.cfg))
    ids = rank_stages(meshes.rank("pp"), cfg.pp, cfg.vp, schedule)
    last_rank = next(r for r in range(cfg.pp) if n_stages - 1 in rank_stages(r, cfg.pp, cfg.vp, schedule))
    tied = model.lm_head.weight is model.tok_embeddings.weight
    # a last stage on another rank holds its own copy; so does one beside the first stage (zbv) under FSDP2, which
    # shards each stage on its own and so would shard the one weight twice (DDP beside zbv, and TP with a tied
    # embedding: refused)
    untie = tied and (last_rank != 0 or dims.fsdp_enabled)
    stages = [stage_module(model, blocks[i], i == 0, i == n_stages - 1, untie) for i in ids]
    trained = tied and model.tok_embeddings.weight.requires_grad  # LoRA: frozen, no gradients to sum
    tp_sp = cfg.tp > 1 and cfg.sequence_parallel
    for stage in stages:  # the hidden states between stages: each TP rank's part of the sequence
        stage.seq_shards = cfg.tp if tp_sp else 1
    staged = cfg.with_(fsdp_shard=stage_fsdp_shard(cfg.fsdp_shard, schedule))
    sharded = [shard(stage, staged, dims, meshes, device, compute_dtype, by_block, init) for stage in stages]
    modules, context = [m for m, _ in sharded], sharded[0][1]  # each stage's CP split: the same chunks
    view = rank_view(model, stages)
    seq = cfg.seq_len // cfg.cp  # under CP a stage takes and passes on its CP rank's chunks
    hidden = torch.empty(
        (cfg.mbs, seq // cfg.tp if tp_sp else seq, model.cfg.dim),
        dtype=compute_dtype if dims.fsdp_enabled and device.type == "cuda" else torch.float32,
        device="meta",
        requires_grad=True,  # the received activations: their gradient goes back to the stage before
    )
    ids_example = torch.empty((cfg.mbs, seq), dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta")
    examples = [(ids_example if i == 0 else hidden, loss if i == n_stages - 1 else hidden) for i in ids]
    tie_group = tie_groups(meshes.world.mesh, cfg.pp, 0, last_rank) if untie and trained else None
    first = view.tok_embeddings.weight if untie and trained and view.tok_embeddings is not None else None
    head = view.lm_head.weight if untie and trained and view.lm_head is not None else None
    run = Pipeline(
        modules,
        ids,
        n_stages,
        schedule,
        cfg.grad_accum,
        device,
        meshes.group("pp"),
        examples,
        tie_group,
        (first, head),
        draws=(cfg.seed, cfg.dp, meshes.rank("batch")),
        sizes=[len(b) for b in blocks],
    )
    return Parallelized(view, None, dims, meshes, meshes.rank("batch"), context, pipeline=run)


def compile_blocks(model: nn.Module, head: bool) -> None:
    """Compile every transformer block (graph breaks allowed: MoE routing has data-dependent shapes),
    and with ``head`` the output head (norm, LM head, loss) as one more graph."""
    for block in model.layers:
        block.compile()
    if head:
        model.head = torch.compile(model.head)


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device, seed: int, *, values=None, names=None, after_block=None
) -> None:
    """Allocate a meta-device model (sharded or not) on ``device`` and fill it as ``build_model`` would.

    ``values`` yields ``(name, full tensor)`` in the plain decoder's parameter order (default:
    ``initial_values``: one seeded generator, each parameter drawn whole in turn); ``names`` maps a
    parameter's current name to that name where a converter renamed it (LoRA's ``.base``). Each rank keeps
    its part of each value as it comes: its DTensor shard (rows of TP-fused weights interleaved as ``apply_tp``
    stores them), or the rows or columns of a weight tensor parallelism split as plain tensors (LoRA's bases,
    ``TPShard.index``), so the gathered weights equal a single process's bit for bit whatever the layout. A
    frozen base stored quantized (a module with ``stored_values``: ``precision/frozen.py``) takes its codes and
    scales, quantized from the whole weight, in place of the weight. Buffers start at zero, but delayed
    scaling's scales at 1.0 and stochastic rounding's module indices at their values. Parameters ``values`` does not name (LoRA's adapters) are left to ``after_block``.

    ``after_block(name, block)`` runs once a block holds its values, before the next block's first value is read.
    Unsharded, the model is allocated part by part: first everything outside ``model.layers``, then each block in
    turn, so blocks after the current one do not exist yet. Sharded (any DTensor), this rank's parts are allocated
    at once. Either way a rank holds its own parts plus the one whole value being cut, never the whole model.
    A model not on the meta device is left as it is. A pipeline stage (:func:`lpbench.parallel.pp.stage_module`)
    keeps the values of its own parameters (the draws are the whole model's); a last stage's own copy of a tied
    embedding takes the embedding's.
    """
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return
    owners: dict[int, list] = {}  # parameter -> (module, name) of each place it is registered
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    ties = [places for places in owners.values() if len(places) > 1]  # holding no other module: blocks are freed
    del owners
    splits = {name: m.tp_shard for name, m in model.named_modules() if getattr(m, "tp_shard", None) is not None}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    stored = {f"{name}.weight": m for name, m in model.named_modules() if hasattr(m, "stored_values")}
    current = {old: new for new, old in (names or {}).items()}
    blocks = {f"layers.{i}": block for i, block in model.layers.named_children()}  # a stage's: global indices
    mine = {name for name, _ in model.named_parameters()} | set(stored)
    own_head = (  # a last pipeline stage's copy of a tied embedding
        model.cfg.tie_embeddings
        and model.lm_head is not None
        and (model.tok_embeddings is None or model.lm_head.weight is not model.tok_embeddings.weight)
    )

    def allocate(modules: list[nn.Module], recurse: bool = True) -> None:
        for module in modules:
            module.to_empty(device=device, recurse=recurse)
        for places in ties:  # to_empty may give each module its own copy: tie shared parameters again
            first = getattr(*places[0])
            if not first.is_meta:
                for module, name in places[1:]:
                    setattr(module, name, first)
        for module in modules:
            for buffer in module.buffers(recurse=recurse):
                buffer.zero_()
            for sub in module.modules() if recurse else [module]:
                if isinstance(sub, DelayedScaling):  # scales start at 1.0
                    sub.reset_delayed_state()
                noise.restore_index(sub)  # stochastic rounding's module index

    def write(name: str, full) -> None:
        lazy = not isinstance(full, torch.Tensor)  # read when asked (``models/hf.py: HFValue``)
        if name in stored:  # a frozen base stored quantized: its codes and scales, from the whole weight
            module = stored[name]
            for part, whole in module.stored_values(full.read() if lazy else full).items():
                assign(module.get_parameter(part), whole)
            return
        param = model.get_parameter(name)
        owner = experts.get(name.rpartition(".")[0])
        if lazy:  # only this rank's rows and columns are read
            index = None if owner is not None else local_index(param, full.shape, splits.get(name.rpartition(".")[0]))
            if index is not None:
                (param.to_local() if isinstance(param, DTensor) else param).copy_(full.read(index))
                return
            full = full.read()
        if owner is not None:  # expert parallelism: this rank's experts; tensor parallelism: their slices
            full = full[owner.first : owner.first + owner.n_experts]
            if owner.gemm.tp is not None:
                full = owner.gemm.tp.local(name.rpartition(".")[2], full)
        split = splits.get(name.rpartition(".")[0])
        if split is not None and param.shape != full.shape:  # split as plain tensors: this rank's rows or columns
            full = full.index_select(split.dim, split.index(full.device))
        elif split is not None and split.dim == 0 and len(split.sections) > 1:
            full = interleave(full, split.sections, split.size)
        assign(param, full)

    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        allocate([model])
    else:  # the embeddings, final norm and head; each block when its first value comes
        allocate([model], recurse=False)
        allocate([m for m in model.children() if m is not model.layers])
    if values is None:
        values = initial_values(model.cfg, seed, device)
    open_block = None
    for name, full in values:
        name = current.get(name, name)
        if own_head and name == "tok_embeddings.weight":
            write("lm_head.weight", full)
        if name not in mine:  # a pipeline stage: another stage's parameter
            continue
        block = ".".join(name.split(".")[:2]) if name.startswith("layers.") else None
        if block != open_block and open_block is not None and after_block is not None:
            after_block(open_block, blocks[open_block])
        if block is not None and block != open_block and not sharded:
            allocate([blocks[block]])
        open_block = block
        write(name, full)
        del full
    if open_block is not None and after_block is not None:
        after_block(open_block, blocks[open_block])


def local_index(param: torch.Tensor, shape: torch.Size, split) -> list[torch.Tensor] | None:
    """For each dim of ``param``'s whole values (``shape``), the positions of the values this rank holds, in its
    order, as :func:`materialize` cuts them (``split``: the module's ``tp_shard``); None where the cut is not of
    rows and columns alone (FSDP over a TP-sharded dim)."""
    positions = [torch.arange(n) for n in shape]
    if split is not None and param.shape != shape:  # split as plain tensors: this rank's rows or columns
        positions[split.dim] = split.index(torch.device("cpu"))
    elif split is not None and split.dim == 0 and len(split.sections) > 1:
        positions[0] = interleave(positions[0], split.sections, split.size)
    if isinstance(param, DTensor):
        if any(type(p) not in (Shard, Replicate) for p in param.placements):
            return None
        local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        positions = [p[o : o + n] for p, o, n in zip(positions, offset, local)]
    return positions

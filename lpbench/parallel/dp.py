"""Data parallelism: DDP or FSDP2 (HSDP on a 2-D mesh), gradient-sync control, global grad-norm clipping.

FSDP2 under gradient accumulation communicates as ``--fsdp-shard`` says (:data:`lpbench.config.FSDP_SHARDS`):
gradients are reduce-scattered once per optimizer step in every mode (``set_requires_gradient_sync(False)``
on all but the last micro-batch, :func:`grad_sync`); parameters are all-gathered for each micro-batch's
forward and again for its backward (``zero3``; but the last block, whose backward starts right after its
forward, keeps its parameters, as torchtitan does), once per micro-batch and kept from forward to backward
(``zero2``: ``reshard_after_forward=False``), or once per optimizer step and kept unsharded until the last
micro-batch's backward (``zero1``: also ``set_reshard_after_backward(False)`` on the others). Each block
prefetches the next block's all-gather in forward and the previous block's in backward (explicit prefetch).
The root group (embeddings, final norm, LM head), gathered at the start of a forward with no compute to hide
under, stays gathered from the first micro-batch to the last one's backward in every mode (it is gathered at
the peak of memory, the start of the backward, anyway).

LoRA: frozen parameters share a block's unit with its trained adapters (FSDP2 all-gathers every parameter
of a unit and reduce-scatters only those that require a gradient; their original dtypes may differ, the
trained ones' may not). A base stored quantized (``precision/frozen.py``: uint8 codes and scales) is in its
block's unit too, kept out of the unit's parameter dtype (:func:`_gather_integers_as_stored`): FSDP2 gathers a
unit of mixed dtypes as bytes, so the codes travel as the bytes they are, never cast to the compute dtype. One
unit per block keeps FSDP2's hooks at the block's edges, outside its compiled (and recomputed) graph: a unit
nested inside a block would run its hooks in the middle of it and break that graph.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _compress_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lpbench.parallel.ep import expert_params


def reduce_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--grad-reduce-dtype`` choice."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    grad_dtype: torch.dtype = torch.float32,
    shard: str = "zero3",
    offload: bool = False,
) -> nn.Module:
    """FSDP2: one ``fully_shard`` group per transformer block and one for the root (embeddings, head).

    ``mesh``: 1-D (shard over it) or 2-D (HSDP: replicas over dim 0, shards over dim 1). Parameters
    are all-gathered in ``param_dtype`` (the recipe's compute dtype on CUDA) and gradients reduced
    in ``grad_dtype``; the sharded master weights keep their dtype. ``shard``: see the module doc.
    ``offload``: the sharded weights, their gradients and so the optimizer's states and step live on the CPU
    (``CPUOffloadPolicy``, in pinned memory on a CUDA mesh); each group's weights are copied to the device for its
    all-gather.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=grad_dtype)
    # pinned host memory where a GPU copies from it (pinning needs one)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    ignored = set(expert_params(model)[0]) or None  # expert parallel: each rank's own experts
    blocks = list(model.layers)
    for i, block in enumerate(blocks):
        reshard = shard == "zero3" and i < len(blocks) - 1  # the last block's backward follows its forward
        with _integer_parameters_without_grad():
            fully_shard(
                block,
                mesh=mesh,
                mp_policy=mp,
                offload_policy=policy,
                ignored_params=ignored,
                reshard_after_forward=reshard,
            )
        _gather_integers_as_stored(block)
    root = fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, ignored_params=ignored)
    for before, after in zip(blocks, blocks[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    return root


def _gather_integers_as_stored(unit: FSDPModule) -> None:
    """``unit``'s integer parameters (a stored base's bytes) all-gathered in their own dtype, whatever its
    ``MixedPrecisionPolicy.param_dtype``. torch 2.13 leaves non-floating parameters out of the parameter dtype
    itself; 2.10-2.12 cast them to it (a uint8 code gathered as a BF16 number). FSDP2 sets its parameters' dtypes
    lazily, at the first forward, so each integer parameter's setter is wrapped here."""
    group = unit._get_fsdp_state()._fsdp_param_group
    for param in group.fsdp_params if group is not None else []:
        if param.sharded_param.dtype.is_floating_point:
            continue
        init = param.init_dtype_attrs

        def own_dtype(mp_policy, _init=init, _param=param):
            _init(mp_policy)
            _param.param_dtype = None

        param.init_dtype_attrs = own_dtype


@contextmanager
def _integer_parameters_without_grad():
    """Within: ``nn.Parameter(t)`` of an integer tensor ``t`` is made without a gradient.

    FSDP2 in some torch versions (2.11 among them; pytorch/pytorch#177844) wraps each shard as
    ``nn.Parameter(shard)`` and sets its ``requires_grad`` afterwards; the default ``requires_grad=True`` is refused
    for integer dtypes, so a stored base's uint8 bytes could not be sharded. Versions that pass ``requires_grad``
    are unaffected."""
    original = nn.Parameter.__dict__["__new__"]

    def new(cls, data=None, requires_grad=True):
        if data is not None and not (data.is_floating_point() or data.is_complex()):
            requires_grad = False
        return original.__func__(cls, data, requires_grad)

    nn.Parameter.__new__ = staticmethod(new)
    try:
        yield
    finally:
        nn.Parameter.__new__ = original


def one_rank_mesh(device: torch.device) -> DeviceMesh:
    """A device mesh of this process alone on ``device``, for FSDP2 in one process (``--offload-optimizer``);
    starts a process group of one if there is none, on an in-process store (no network). On CUDA the group holds
    NCCL and gloo, so that collectives on the offloaded (CPU) gradients, such as the clipping norm's, run too."""
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device already
        torch.cuda.set_device(device)  # the mesh's device
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, device: torch.device, grad_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """DDP over ``mesh``: full replicas, gradients all-reduced once per step in ``grad_dtype``.

    With tensor-parallel (DTensor) parameters torch's ``DistributedDataParallel`` does not apply;
    FSDP2's ``replicate`` (the same semantics, one group per block) does.
    """
    ignored_params = set(expert_params(model)[0]) or None  # split experts: sync_expert_grads reduces them
    if any(isinstance(p, DTensor) for p in model.parameters()):
        mp = MixedPrecisionPolicy(reduce_dtype=grad_dtype)
        for block in model.layers:
            replicate(block, mesh=mesh, ignored_params=ignored_params, mp_policy=mp)
        return replicate(model, mesh=mesh, ignored_params=ignored_params, mp_policy=mp)
    ignored = {id(p) for p in expert_params(model)[0]}  # expert parallel: each rank's own experts
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if id(p) in ignored]
        )
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=mesh.get_group(),
        find_unused_parameters=model.cfg.n_experts > 0,
    )  # an MoE expert may get no token on a rank
    if grad_dtype == torch.bfloat16:
        ddp.register_comm_hook(mesh.get_group(), _bf16_reduce)
    return ddp


def _bf16_reduce(group, bucket):
    """DDP communication hook: gradients all-reduced in BF16 (torch's ``bf16_compress_hook`` arithmetic, without
    its check for NCCL, so gloo runs it too)."""
    return _compress_hook(torch.bfloat16, group, bucket)


@contextmanager
def grad_sync(model: nn.Module, enabled: bool, keep_unsharded: bool = False):
    """Reduce gradients across data-parallel ranks in this forward/backward only if ``enabled``.

    Non-final micro-batches of gradient accumulation run with ``enabled=False`` (DDP ``no_sync``,
    FSDP2 ``set_requires_gradient_sync``), so each step communicates gradients once. FSDP2 keeps the root
    group's parameters gathered after those micro-batches' backward, and with ``keep_unsharded``
    (``--fsdp-shard zero1``) every group's, so the next forward does not gather them again.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        model.set_reshard_after_backward(enabled, recurse=keep_unsharded)
        yield
    else:
        with model.no_sync() if isinstance(model, DDP) and not enabled else nullcontext():
            yield


def clip_grad_norm_(
    params: list[nn.Parameter],
    max_norm: float,
    optimizer: torch.optim.Optimizer | None = None,
    spread: tuple[list, object] = ([], None),
    pipeline: tuple[object, dict[int, int], int] | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several device meshes (and none).

    Plain, DTensor-on-the-TP-mesh and FSDP-sharded gradients are normed per mesh (DTensor
    reduces each over its shards) and combined; ``spread`` (params, group): plain parameters that
    differ across the ranks of group (expert parallelism), their squares summed over it. Returns
    the global 2-norm, the same on all ranks.

    ``pipeline`` (group, index, n): pipeline parallelism; each rank holds some of the model's n parameters, ``index``
    maps ``id(p)`` to the parameter's place in the whole model (a parameter not in it, a last stage's copy of
    a tied embedding, is clipped but not counted). Plain gradients: every parameter's norm is summed into its
    place over the group and the norm taken over them all, in the whole model's order, as one process takes it;
    otherwise the per-rank norms' squares are summed over the group.

    With a fused ``optimizer`` (torch's fused Adam/AdamW) the gradients are not scaled here:
    the optimizer's next step divides them by ``1 / clip coefficient`` (its ``grad_scale``, the
    hook AMP's GradScaler uses) inside its one kernel, which saves a read and a write of every
    gradient. The update equals clipping first up to the rounding of ``g / s`` against ``g · c``.
    """
    spread_ids = {id(p) for p in spread[0]}
    groups: dict = {}
    counted = params if pipeline is None else [p for p in params if id(p) in pipeline[1]]
    for p in counted:
        if p.grad is not None:
            key = "spread" if id(p) in spread_ids else p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for key, group in groups.items():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        if key == "spread":
            n = n.square()
            torch.distributed.all_reduce(n, group=spread[1])
            n = n.sqrt()
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if pipeline is not None and list(groups) == [None]:  # one process's arithmetic: every norm in its place
        group, index, n = pipeline
        each = torch.zeros(n, device=norms[0].device)
        for p, n in zip(groups[None], torch._foreach_norm([p.grad for p in groups[None]])):
            each[index[id(p)]] = n
        torch.distributed.all_reduce(each, group=group)
        norms = [torch.linalg.vector_norm(each)]
    elif pipeline is not None:
        norms = [n.square().sum().reshape(1) for n in norms] or [torch.zeros(1)]
        total = torch.cat(norms).sum()
        torch.distributed.all_reduce(total, group=pipeline[0])
        norms = [total.sqrt()]
    if not norms:
        return torch.zeros(())
    total = torch.stack(norms).square().sum().sqrt() if len(norms) > 1 else norms[0]
    params_by_mesh = {}
    for p in params:  # what is clipped: every parameter, counted or not
        if p.grad is not None:
            key = "spread" if id(p) in spread_ids else p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            params_by_mesh.setdefault(key, []).append(p)
    groups = params_by_mesh
    if optimizer is not None and optimizer.defaults.get("fused") and None in groups and len(groups) == 1:
        # torch's clip coefficient, max_norm / (total + 1e-6) clamped to 1, as the divisor 1 / coefficient
        optimizer.grad_scale = ((total.float() + 1e-6) / max_norm).clamp(min=1.0)
        return total
    for group in groups.values():  # one call per mesh: foreach ops cannot mix plain and DTensor
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total

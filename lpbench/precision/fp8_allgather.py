"""``--fsdp-fp8-all-gather``: FSDP2 all-gathers the weights of fp8-tensorwise/-delayed linears in FP8.

FSDP2's extension protocol (torch 2.10-2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``;
torchao's Float8 training uses it): when the local tensor of a sharded parameter defines

* ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` -> ``(inputs, metadata)``:
  the tensors all-gathered for this shard (padded to FSDP's padded shard size), and
* ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``: the first time returns
  ``(unsharded tensor, inner tensors FSDP frees when it reshards)``; later FSDP passes the
  unsharded parameter as ``out`` (its storage re-filled by the all-gather) to update in place,

FSDP all-gathers what the hook returns instead of the parameter in ``param_dtype``.

:class:`Fp8AllGatherWeight` (the FP32 master weight, wrapped before ``fully_shard``) sends E4M3
codes, 1 byte per element, quantized with one scale for the whole weight: the shards' amaxes
are all-reduced (MAX) over the FSDP mesh, and over the TP group when TP splits the weight too.
The gathered codes are therefore exactly the codes the quantized linear would compute from the
whole weight in ``param_dtype``; the linear uses the gathered :class:`Fp8Weight` for fprop and
its transpose for dgrad instead of quantizing again (:func:`gathered`).

A shard is cast once per optimizer step (the weight cache's rule): its codes and scale are kept
until any optimizer's ``step()`` (a global step post-hook), so the re-gathers of ``--fsdp-shard``
zero3/zero2 and of every micro-batch of gradient accumulation send the same codes without casting
or all-reducing an amax again. A delayed-scaling linear still records the weight's amax at each use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.distributed.tensor import DTensor

from lpbench.precision.quantize import Scaling, all_reduce_max, fp8_encode_scale, quantize

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.as_strided.default, aten.detach.default, aten.alias.default}
# Ops that FSDP (sharding, padding, to_empty) and DTensor apply to a parameter, kept in the subclass.
_KEEP_SUBCLASS = _VIEWS | {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.split.Tensor}
_KEEP_SUBCLASS |= {aten.copy_.default, aten._to_copy.default, aten.clone.default}
_steps = [0, None]  # optimizer steps taken in this process (a cast is reused only within one), the hook's handle


def _count_step(optimizer, args, kwargs) -> None:
    _steps[0] += 1


def _watch_optimizer_steps() -> None:
    if _steps[1] is None:
        _steps[1] = register_optimizer_step_post_hook(_count_step)


class Fp8AllGatherWeight(torch.Tensor):
    """A high-precision weight (shard) that FSDP2 all-gathers as E4M3 codes; otherwise a plain tensor."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in _KEEP_SUBCLASS else out

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_tensor"])

    def __repr__(self):
        return f"Fp8AllGatherWeight({self._tensor})"

    def __reduce_ex__(self, protocol):  # saved (checkpoints) as the plain tensor it wraps
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This shard's E4M3 codes under the whole weight's scale; metadata: (decode scale, amax). Cast once per
        optimizer step (module doc)."""
        _watch_optimizer_steps()
        cached = getattr(self, "_cast", None)
        if cached is not None and cached[0] == _steps[0]:
            return cached[1]
        w = self._tensor.detach()
        if mp_policy.param_dtype is not None:
            w = w.to(mp_policy.param_dtype)  # what the linear would quantize without FP8 all-gather
        rows = -(-outer_size[0] // mesh.size())  # FSDP's padded shard (torch.chunk); zero rows change no amax
        w = F.pad(w, (0, 0, 0, rows - w.shape[0]))
        amax = module.reduce_amax("weight", all_reduce_max(w.abs().amax().float(), mesh.get_group()))
        spec, recipe = module.recipe.operand("weight", "fprop"), module.recipe
        if recipe.scaling is Scaling.DELAYED:
            enc = module.scale_buffer("weight")  # the scale as it stands (gathered() records the amax)
        else:
            enc = fp8_encode_scale(amax, spec.fmt, pow2=spec.pow2)
        q = quantize(w, spec, encode_scale=enc)
        self._cast = (_steps[0], ((q.codes,), (q.scale.reshape(()), amax)))
        return self._cast[1]

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,), (dec, amax) = all_gather_outputs, metadata
        if out is not None:
            local = out._local_tensor if isinstance(out, DTensor) else out
            local._dec, local._amax = dec, amax
            return None
        return Fp8Weight(codes, dec, amax, param_dtype), (codes,)


class Fp8Weight(torch.Tensor):
    """A weight all-gathered in FP8: E4M3 codes, the FP32 decode scale and amax of the whole weight.

    ``dtype`` is FSDP's parameter dtype (its gradient's). Views keep the codes; any other op sees
    the dequantized weight.
    """

    @staticmethod
    def __new__(cls, codes: torch.Tensor, dec: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            codes.size(),
            strides=codes.stride(),
            storage_offset=codes.storage_offset(),
            dtype=dtype,
            device=codes.device,
        )

    def __init__(self, codes: torch.Tensor, dec: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
        self._codes, self._dec, self._amax = codes, dec, amax

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            w = args[0]
            return cls(func(w._codes, *args[1:], **kwargs), w._dec, w._amax, w.dtype)
        if func is aten.is_same_size.default:  # autograd checks a gradient's shape with it
            return args[0].shape == args[1].shape
        args, kwargs = pytree.tree_map_only(cls, lambda w: (w._codes.float() * w._dec).to(w.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_codes", "_dec", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Weight(inner["_codes"], inner["_dec"], inner["_amax"], dtype)

    def __repr__(self):
        return f"Fp8Weight(codes={self._codes}, dec={self._dec})"


def gathered(module: nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(E4M3 codes, FP32 decode scale) of a weight FSDP all-gathered in FP8, else None.

    A delayed-scaling linear records the weight's amax and updates its scale, as quantizing it would.
    """
    if not isinstance(weight, Fp8Weight):
        return None
    if module.recipe.scaling is Scaling.DELAYED:
        module.record_amax("weight", weight._amax)
    return weight._codes, weight._dec

"""The recipe swap: which modules get which precision, and whether the GEMMs run natively or emulated.

Hand-written and small on purpose: the whole policy is "quantize the linears inside the
transformer blocks" (MoE experts' stacked weights included, :mod:`lpbench.models.moe`).
Embeddings, lm_head, norms, attention BMMs and routers stay in the compute dtype (routers FP32);
the recipe's first/last N blocks stay BF16; a linear whose in or out features do not divide the
recipe's block is left BF16 with a warning naming it (NVFP4 takes every width: its quantizer
zero-pads partial blocks, as Transformer Engine does).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lpbench.convert.lora import set_kernel
from lpbench.errors import UsageError
from lpbench.models.moe import Experts
from lpbench.precision import fp8_allgather, noise
from lpbench.precision.capability import emulation_reason
from lpbench.precision.frozen import FrozenQuantizedLinear
from lpbench.precision.grouped import experts_kernel
from lpbench.precision.linear import QuantizedGemms, QuantizedLinear
from lpbench.precision.recipes import Recipe, get_recipe


BACKENDS = ("lpbench", "torchao")


def _candidate_linears(model: nn.Module, recipe: Recipe):
    """(full name, module, dims divide) of every linear (and MoE experts module) the recipe may quantize, in order."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError("apply_recipe needs the transformer blocks in model.layers (an nn.ModuleList)")
    n, m = len(layers), recipe.dim_multiple
    for i, layer in enumerate(layers):
        if i < recipe.first_bf16_layers or i >= n - recipe.last_bf16_layers:
            continue
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear) and "router" not in name:
                yield f"layers.{i}.{name}".rstrip("."), mod, not (mod.in_features % m or mod.out_features % m)
            elif isinstance(mod, Experts):
                _, dim, ffn = mod.down.shape
                yield f"layers.{i}.{name}", mod, not (dim % m or ffn % m)


def apply_recipe(
    model: nn.Module, recipe: Recipe | str, *, device: torch.device | str, emulate: bool | str, backend: str = "lpbench"
) -> dict:
    """Swap every ``nn.Linear`` inside ``model.layers[i]`` (routers excepted) for a QuantizedLinear.

    ``emulate=True`` allows exact emulation where the device cannot run the recipe natively;
    with False such a recipe raises UsageError; ``"always"`` emulates even where the device
    runs it natively (same numerics as the emulation a device without the format runs).
    ``backend="torchao"`` converts the same
    linears with torchao's training linears instead (:mod:`lpbench.convert.torchao`).
    Returns ``{"path": "native"|"emulated", "quantized": [names], "skipped": [names left BF16
    because their dims do not divide], "why_emulated": reason or None}``, with ``"kernels"``:
    the quantized modules' kernel names, for a quantized recipe.
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    device = torch.device(device)
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "torchao" and recipe.quantized:
        from lpbench.convert import torchao

        return torchao.apply(model, recipe, device, list(_candidate_linears(model, recipe)), emulate)
    reason = emulation_reason(recipe, device, emulate) if recipe.quantized else None
    native = reason is None
    result = {"path": "native" if native else "emulated", "quantized": [], "skipped": [], "why_emulated": reason}
    if not recipe.quantized:
        return result
    if not native and not emulate:
        raise UsageError(
            f"precision {recipe.name} cannot run natively on {device}: {reason}; "
            "pass --emulate to run it with exact emulation (slower, same numerics)"
        )
    for full, mod, divides in list(_candidate_linears(model, recipe)):
        if not divides:
            result["skipped"].append(full)
            continue
        if isinstance(mod, Experts):
            quantize_experts(mod, recipe, native)
        else:
            parent, _, child = full.rpartition(".")
            setattr(model.get_submodule(parent), child, QuantizedLinear.from_linear(mod, recipe, native=native))
        result["quantized"].append(full)
    if recipe.stochastic_grads:  # stochastic rounding draws by each module's index in the whole model
        noise.number(model, (QuantizedGemms,))
    result["kernels"] = sorted(
        {
            m.gemm.name if isinstance(m, Experts) else m.kernel.name
            for m in model.modules()
            if isinstance(m, (Experts, QuantizedLinear))
        }
        - {"GroupedBf16"}
    )
    m, n = recipe.dim_multiple, len(model.layers)
    if result["skipped"]:
        warnings.warn(
            f"{recipe.name}: left in BF16 because in/out features do not divide {m}: {', '.join(result['skipped'])}",
            stacklevel=2,
        )
    if not result["quantized"]:
        warnings.warn(
            f"{recipe.name}: no linear was quantized (model has {n} blocks; recipe keeps the first "
            f"{recipe.first_bf16_layers} and last {recipe.last_bf16_layers} in BF16)",
            stacklevel=2,
        )
    return result


def quantize_experts(experts: Experts, recipe: Recipe, native: bool) -> None:
    """Give ``experts`` the kernel of ``recipe`` (:func:`lpbench.precision.grouped.experts_kernel`)."""
    set_kernel(
        experts, experts_kernel(recipe, native, (experts.in_name, "down"), experts.n_experts, experts.down.device)
    )


def store_frozen_quantized(model: nn.Module, prefix: str = "") -> list[str]:
    """Replace every QuantizedLinear whose weight is frozen by its :class:`FrozenQuantizedLinear`
    (the high-precision weight is freed once nothing else holds it); returns their names (after ``prefix``)."""
    names = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QuantizedLinear) and not mod.weight.requires_grad:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, FrozenQuantizedLinear.from_linear(mod))
            names.append(prefix + name)
    return names


@torch.no_grad()
def apply_fp8_all_gather(model: nn.Module) -> int:
    """Wrap the weight of every fp8-tensorwise/-delayed QuantizedLinear (before ``fully_shard``) so that
    FSDP2 all-gathers it in FP8 (:mod:`lpbench.precision.fp8_allgather`); returns the count."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, QuantizedLinear) and mod.recipe.scaling.per_tensor:
            w = mod.weight
            if isinstance(w, DTensor):  # tensor parallel: wrap the local shard
                new = DTensor.from_local(
                    fp8_allgather.Fp8AllGatherWeight(w.to_local()),
                    w.device_mesh,
                    w.placements,
                    run_check=False,
                    shape=w.shape,
                    stride=w.stride(),
                )
            else:
                new = fp8_allgather.Fp8AllGatherWeight(w.detach())
            mod.weight = nn.Parameter(new, requires_grad=w.requires_grad)
            n += 1
    return n

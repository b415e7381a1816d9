"""``--backend torchao``: torchao's training linears on the linears lpbench would quantize, as a peer.

* fp8-tensorwise / fp8-rowwise / fp8-rowwise-gw-hp: ``torchao.float8``'s Float8Linear: native GEMMs from
  the recipe's compute capability (8.9 / 9.0), torchao's emulation (``Float8LinearConfig.emulate``: FP32
  GEMMs of the dequantized operands) below it or under ``--emulate always``; CUDA only (its autocast
  handling is the GPU's). MoE experts (fp8-rowwise only) through ``torchao.prototype.moe_training``'s FP8
  row-wise grouped GEMMs (:class:`TorchaoGrouped`);
* mxfp8: ``torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear`` (E4M3, 1x32 blocks, RCEIL E8M0
  scales): torchao's kernels (``KernelPreference.AUTO``) on compute capability 10.x, its emulation
  (``EMULATED``: dequantize, then a BF16 GEMM) elsewhere (CPU included) or under ``--emulate always``;
* nvfp4: ``torchao.prototype.moe_training.nvfp4_training``'s NVFP4Linear (RHT on wgrad, stochastic
  rounding of gradients, 16x16 weight blocks): compute capability 10.x only, never emulated (see
  ``NO_NVFP4_EMULATION``); it needs M, K and N multiples of 128.

The recipe's layer policy (its BF16 first/last blocks) picks the same linears as lpbench's path.
Written against torchao 0.18.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
from torch import nn

from lpbench.convert.lora import set_kernel
from lpbench.errors import UsageError
from lpbench.models.moe import Experts, GroupedMM
from lpbench.precision.capability import EMULATE_ALWAYS, FORCED
from lpbench.precision.recipes import Recipe

FLOAT8_RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}
RECIPES = (*FLOAT8_RECIPES, "mxfp8", "nvfp4")
MODULES = {
    "mxfp8": "torchao.prototype.moe_training.mxfp8_linear",
    "nvfp4": "torchao.prototype.moe_training.nvfp4_training.nvfp4_training",
}
NVFP4_MULTIPLE = 128  # torchao's NVFP4Linear: M, K and N multiples of 128
BLACKWELL = (10, 0)
# Why torchao cannot emulate nvfp4 (torchao 0.18): nvfp4_linear raises unless KernelPreference.TRITON, whose
# casts (hadamard_*_triton.py, quantize_2d_triton.py) raise NotImplementedError below SM 100 (PTX cvt to e2m1)
# and whose three GEMMs are F.scaled_mm on float4_e2m1fn_x2; its NVFP4 emulation (nvfp4_grouped_mm.py) is
# grouped GEMMs without an autograd function, and QAT's NVFP4FakeQuantizedLinear needs SM 10.x too.
NO_NVFP4_EMULATION = (
    "torchao 0.18's NVFP4Linear has no emulated mode (KernelPreference.TRITON only: Triton casts "
    "that use SM 10.x FP4 conversions, cuBLAS NVFP4 GEMMs)"
)


def run_problem(precision: str, tokens: int, tp: int) -> str | None:
    """What a run of torchao's ``precision`` with ``tokens`` tokens per micro-batch and TP size ``tp`` cannot
    do (None when it can): torchao must be installed, its MX linears quantize along the tokens for wgrad and
    take no TP split here."""
    if precision in ("mxfp8", "nvfp4"):
        if tp > 1:
            return f"--backend torchao runs {precision} without tensor parallelism (--tp 1)"
        multiple = NVFP4_MULTIPLE if precision == "nvfp4" else 32
        if tokens % multiple:
            return (
                f"--backend torchao {precision} needs MBS x seq len a multiple of {multiple} (its wgrad blocks "
                f"run along the tokens), got {tokens}"
            )
    return None


def missing() -> str | None:
    """Why ``--backend torchao`` cannot run in this environment (torchao not installed), or None. Apart from
    :func:`run_problem`: a config is valid or not wherever it is checked (a sweep spec on a laptop for a
    cluster); whether this machine can run it is checked by the runner before any work."""
    if importlib.util.find_spec("torchao") is None:
        return "--backend torchao needs torchao: pip install 'lpbench[torchao]'"
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def path(recipe: Recipe, device: torch.device, emulate: bool | str = False) -> tuple[str, str | None]:
    """("native" | "emulated", why emulated) of torchao's linear for ``recipe`` on ``device`` in a run with
    ``emulate`` (``"always"``: torchao's emulation even where its kernels run); UsageError (one line) where
    torchao cannot run the recipe there."""
    if recipe.name not in RECIPES:
        raise UsageError(f"--backend torchao runs {', '.join(RECIPES)}; {recipe.name} is lpbench-only")
    cap = _capability(device)
    where = f"compute capability {cap[0]}.{cap[1]}" if cap else device.type
    forced = emulate == EMULATE_ALWAYS
    if recipe.name in FLOAT8_RECIPES:
        need = recipe.native_capability
        if cap is None:
            raise UsageError(
                f"--backend torchao runs {recipe.name} on a CUDA GPU (torchao's Float8Linear: native "
                f"from compute capability {need[0]}.{need[1]}, emulated below); {device} has none: "
                "use --backend lpbench"
            )
        if cap >= need and not forced:
            return "native", None
        why = (
            FORCED
            if cap >= need
            else (f"its native GEMMs need compute capability {need[0]}.{need[1]}, this GPU has {cap[0]}.{cap[1]}")
        )
        return "emulated", f"torchao's Float8Linear emulates {recipe.name} (Float8LinearConfig.emulate): {why}"
    if recipe.name == "nvfp4":
        if cap is None or cap < BLACKWELL:
            raise UsageError(
                f"--backend torchao runs nvfp4 only on compute capability 10.x: {NO_NVFP4_EMULATION}; "
                f"{f'{device} has {where}' if cap else f'{device} is not a CUDA GPU'}: use --backend "
                "lpbench, which emulates it"
            )
        if forced:
            raise UsageError(
                f"--backend torchao cannot emulate nvfp4 (--emulate always): {NO_NVFP4_EMULATION}; "
                "use --backend lpbench, which emulates it"
            )
        return "native", None
    emulated = "torchao's MXFP8Linear emulates MXFP8 (KernelPreference.EMULATED)"
    if cap is not None and cap >= BLACKWELL:
        return ("emulated", f"{emulated}: {FORCED}") if forced else ("native", None)
    return "emulated", f"{emulated} on {where}"


class TorchaoGrouped(GroupedMM):
    """The experts' kernel of ``--backend torchao``: torchao's FP8 row-wise grouped GEMMs (groups padded to 16 rows,
    as it requires)."""

    name = "TorchaoGrouped"

    def __init__(self):
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

        self.mm = _to_fp8_rowwise_then_scaled_grouped_mm

    def __call__(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups) -> torch.Tensor:
        return groups.clear_tail(
            self.mm(x, w.transpose(1, 2), groups.offs, x.dtype, pad_token_groups_for_grouped_mm=False)
        )


@functools.cache
def _mxfp8_linear_class() -> type:
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm

    class AutocastMXFP8Linear(MXFP8Linear):
        """MXFP8Linear computing in the autocast dtype as lpbench's QuantizedLinear does: input and weight are
        cast to it first (torchao's autograd function runs outside autocast, so it would compute in FP32)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_autocast_enabled(x.device.type):
                return super().forward(x)
            dtype = torch.get_autocast_dtype(x.device.type)
            with torch.autocast(x.device.type, enabled=False):
                y = _to_mxfp8_then_scaled_mm(
                    x.to(dtype),
                    self.weight.to(dtype),
                    self.kernel_preference,
                    self.scale_calculation_mode,
                    self.wgrad_with_hp,
                )
                return y if self.bias is None else y + self.bias.to(dtype)

    return AutocastMXFP8Linear


def _mxfp8_linear(linear: nn.Linear, native: bool) -> nn.Module:
    """torchao's MXFP8Linear (RCEIL scales) sharing ``linear``'s parameters; its kernels if ``native``, else emulated."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    mod = _mxfp8_linear_class()(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        device="meta",
        kernel_preference=KernelPreference.AUTO if native else KernelPreference.EMULATED,
        scale_calculation_mode=ScaleCalculationMode.RCEIL,
    )
    mod.weight, mod.bias = linear.weight, linear.bias
    return mod


def apply(model: nn.Module, recipe: Recipe, device: torch.device, candidates: list, emulate: bool | str) -> dict:
    """Convert ``candidates`` ((name, module, dims divide) of the recipe's linears) to torchao's linears."""
    kind, reason = path(recipe, device, emulate)
    if kind == "emulated" and not emulate:
        raise UsageError(f"--backend torchao: {reason}; pass --emulate to run it")
    try:
        import torchao
    except ImportError:
        raise UsageError("--backend torchao needs torchao: pip install 'lpbench[torchao]'") from None
    module = MODULES.get(recipe.name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise UsageError(
            f"--backend torchao {recipe.name} needs torchao 0.18 or later ({module}); "
            f"torchao {torchao.__version__} is installed"
        )
    experts = [(name, mod) for name, mod, ok in candidates if isinstance(mod, Experts)]
    if experts and recipe.name != "fp8-rowwise":
        raise UsageError(
            f"--backend torchao runs MoE experts through torchao.prototype.moe_training's FP8 "
            f"row-wise grouped GEMMs: precision fp8-rowwise, not {recipe.name}"
        )
    if experts and kind == "emulated":
        raise UsageError(
            f"--backend torchao runs MoE experts natively only (its FP8 grouped GEMMs have no emulation); "
            f"this run would emulate: {reason}"
        )
    if any(not ok for _, mod, ok in candidates if isinstance(mod, Experts)):
        raise UsageError("--backend torchao: the experts' widths must be multiples of 16")
    candidates = [c for c in candidates if not isinstance(c[1], Experts)]
    multiple = NVFP4_MULTIPLE if recipe.name == "nvfp4" else recipe.dim_multiple
    chosen = [
        (name, mod) for name, mod, _ in candidates if not (mod.in_features % multiple or mod.out_features % multiple)
    ]
    skipped = [name for name, mod, _ in candidates if name not in dict(chosen)]
    result = {
        "path": kind,
        "quantized": [name for name, _ in chosen],
        "skipped": skipped,
        "why_emulated": reason,
        "kernels": [],
    }
    if recipe.name in FLOAT8_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ids = {id(mod) for _, mod in chosen}
        config = Float8LinearConfig.from_recipe_name(FLOAT8_RECIPES[recipe.name])
        config = dataclasses.replace(config, emulate=kind == "emulated")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: id(mod) in ids)
        for name, mod in experts:
            set_kernel(mod, TorchaoGrouped())
            result["quantized"].append(name)
        result["kernels"] = ["Float8Linear"] + (["TorchaoGrouped"] if experts else [])
        return result
    for name, mod in chosen:
        if recipe.name == "mxfp8":
            new = _mxfp8_linear(mod, native=kind == "native")
        else:
            from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

            new = NVFP4Linear.from_linear(mod)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    result["kernels"] = [type(new).__name__] if chosen else []
    return result

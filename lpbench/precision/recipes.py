"""Precision recipes as data.

A recipe is a frozen dataclass instance; adding a recipe means adding an instance to
``RECIPES``, never editing branches across the tree. Every ingredient (scale rule, block
size, E5M2 gradients, 2-D weight blocks, random Hadamard transform, stochastic rounding,
BF16 first/last layers, fast accumulation in the forward or the gradient GEMMs) is a field, so ablations
are ``dataclasses.replace(recipe, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lpbench.errors import UsageError
from lpbench.precision.formats import FORMATS, FloatFormat
from lpbench.precision.quantize import RHT_SIZE, TE_RHT_SIGNS, QSpec, Scaling

ROLES = ("input", "weight", "grad")
GEMMS = ("fprop", "dgrad", "wgrad")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    compute_dtype: torch.dtype = torch.bfloat16  # autocast dtype of everything not quantized
    scaling: Scaling | None = None  # None: no quantized GEMM; a string value is made a Scaling
    fwd_format: str = "e4m3"  # inputs and weights
    grad_format: str = "e4m3"  # output gradients ("e5m2": the hybrid FP8 recipe)
    block: int | None = None  # block length along the reduction dim (block, mx, nvfp4)
    weight_block_2d: bool = False  # weights in block × block tiles, so W and Wᵀ quantize alike
    pow2_scales: bool = False  # FP32 scales rounded down to a power of two
    mx_scale_rounding: str = "rceil"  # "rceil" | "floor" (OCP MX v1.0)
    amax_history_len: int = 1024  # delayed scaling
    margin: int = 0  # delayed scaling: scale = FP8_MAX / amax / 2**margin
    amax_compute_algo: str = "max"  # delayed scaling: the history's max, or "most_recent" amax (TE's choices)
    wgrad_bf16: bool = False  # weight-gradient GEMM in the compute dtype
    rht_wgrad: bool = False  # 16×16 random Hadamard transform on both wgrad operands
    rht_signs: tuple[int, ...] = TE_RHT_SIGNS  # its random sign vector (16 × ±1; Transformer Engine's by default)
    stochastic_grads: bool = False  # stochastic rounding of output gradients
    first_bf16_layers: int = 0  # transformer blocks kept in BF16 at the start ...
    last_bf16_layers: int = 0  # ... and at the end
    fast_accum_fprop: bool = False  # native forward GEMM in Hopper's fast (reduced-precision) accumulation
    fast_accum_grads: bool = False  # native data- and weight-gradient GEMMs in fast accumulation too
    native_capability: tuple[int, int] | None = None  # compute capability with native GEMMs
    # How reports present it (not numerics): table name (default: the recipe's name), plot colour (None: one of
    # the plots' spare colours), and the gap of the final loss to the reference that `lpbench converge` passes, in %
    display_name: str = ""
    colour: str | None = None
    tolerance: float | None = None

    def __post_init__(self):
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)
        if self.scaling is not None:
            if self.scaling not in {s.value for s in Scaling}:
                raise ValueError(f"{self.name}: unknown scaling {self.scaling!r}; valid: {', '.join(Scaling)}")
            object.__setattr__(self, "scaling", Scaling(self.scaling))
        for fmt in (self.fwd_format, self.grad_format):
            if fmt not in FORMATS:
                raise ValueError(f"{self.name}: unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
        if self.scaling in (Scaling.BLOCK, Scaling.MX, Scaling.NVFP4) and not self.block:
            raise ValueError(f"{self.name}: {self.scaling} scaling needs a block size")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"{self.name}: amax_compute_algo must be 'max' or 'most_recent'")
        if self.amax_history_len < 1:
            raise ValueError(f"{self.name}: amax_history_len must be at least 1")
        if self.mx_scale_rounding not in ("rceil", "floor"):
            raise ValueError(f"{self.name}: mx_scale_rounding must be 'rceil' or 'floor'")
        for field in ("fast_accum_fprop", "fast_accum_grads"):
            if getattr(self, field) and self.scaling not in (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW):
                raise ValueError(f"{self.name}: {field} needs tensor, delayed or row scaling")
        if len(self.rht_signs) != RHT_SIZE or any(v not in (1, -1) for v in self.rht_signs):
            raise ValueError(f"{self.name}: rht_signs must be {RHT_SIZE} values of +1 or -1, got {self.rht_signs}")
        if self.scaling is Scaling.BLOCK and not self.pow2_scales:
            # Emulation folds block scales into BF16 operands, exact only for powers of two.
            raise ValueError(f"{self.name}: blockwise scaling needs pow2_scales=True")

    @property
    def quantized(self) -> bool:
        return self.scaling is not None

    @property
    def gemm_class(self) -> str | None:
        """Which peak its GEMMs run at when native: 'bf16', 'fp8', 'fp4' (None for FP32)."""
        if not self.quantized:
            return None if self.compute_dtype == torch.float32 else "bf16"
        return "fp4" if self.fwd_format == "e2m1" else "fp8"

    @property
    def dim_multiple(self) -> int:
        """What a linear's in and out features must divide by: the block, or 16 for FP8 GEMMs; 1 for
        NVFP4, whose quantizer zero-pads partial blocks as Transformer Engine does."""
        return 1 if self.scaling is Scaling.NVFP4 else self.block or 16

    def element_format(self, role: str) -> FloatFormat:
        """The element format of operand ``role``: the gradient's, or the forward one."""
        return FORMATS[self.grad_format if role == "grad" else self.fwd_format]

    def operand(self, role: str, gemm: str) -> QSpec | None:
        """How operand ``role`` of GEMM ``gemm`` is quantized along that GEMM's reduction dim.

        fprop Y = X·Wᵀ (input, weight), dgrad dX = dY·W (grad, weight),
        wgrad dW = dYᵀ·X (grad, input). None: that GEMM runs in the compute dtype.
        """
        if role not in ROLES or gemm not in GEMMS:
            raise ValueError(f"role must be one of {ROLES} and gemm one of {GEMMS}, got {role!r}, {gemm!r}")
        if not self.quantized or (gemm == "wgrad" and self.wgrad_bf16):
            return None
        kind = Scaling.TENSOR if self.scaling.per_tensor else self.scaling
        if kind is Scaling.TENSOR:
            block = (None, None)
        elif kind is Scaling.ROW:
            block = (1, None)
        elif role == "weight" and self.weight_block_2d:
            block = (self.block, self.block)
        else:
            block = (1, self.block)
        return QSpec(
            kind,
            self.element_format(role),
            block,
            pow2=self.pow2_scales,
            mx_rounding=self.mx_scale_rounding,
            stochastic=self.stochastic_grads and role == "grad",
        )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "bf16",
            "BF16 GEMMs, FP32 master weights and optimizer state (baseline)",
            display_name="BF16",
            colour="#3b3b3b",
        ),
        Recipe(
            "fp32", "FP32 everywhere (reference)", compute_dtype=torch.float32, display_name="FP32", colour="#9e9e9e"
        ),
        Recipe(
            "fp8-tensorwise",
            "FP8 current scaling, one FP32 scale per tensor; E4M3 fwd, E5M2 grads (NeMo cs, TE Float8CurrentScaling)",
            scaling="tensor",
            grad_format="e5m2",
            fast_accum_fprop=True,
            native_capability=(8, 9),
            display_name="FP8 (per-tensor)",
            colour="#1f77b4",
            tolerance=0.5,
        ),
        Recipe(
            "fp8-delayed",
            "FP8 delayed scaling from a 1024-step amax history; E4M3 fwd, E5M2 grads (NeMo ds, TE DelayedScaling)",
            scaling="delayed",
            grad_format="e5m2",
            fast_accum_fprop=True,
            native_capability=(8, 9),
            display_name="FP8 (delayed)",
            colour="#17becf",
            tolerance=0.5,
        ),
        Recipe(
            "fp8-rowwise",
            "FP8 E4M3, one power-of-two FP32 scale per row along the reduction dim (torchao rowwise)",
            scaling="row",
            pow2_scales=True,
            fast_accum_fprop=True,
            native_capability=(9, 0),
            display_name="FP8 (rowwise)",
            colour="#2ca02c",
            tolerance=0.5,
        ),
        Recipe(
            "fp8-rowwise-gw-hp",
            "fp8-rowwise with the weight-gradient GEMM in BF16 (torchao rowwise_with_gw_hp)",
            scaling="row",
            pow2_scales=True,
            wgrad_bf16=True,
            fast_accum_fprop=True,
            native_capability=(9, 0),
            display_name="FP8 (rowwise, BF16 wgrad)",
            colour="#8fbc5a",
            tolerance=0.5,
        ),
        Recipe(
            "fp8-rowwise-fast-grads",
            "fp8-rowwise with the data- and weight-gradient GEMMs in fast accumulation too (torchao's MoE GEMMs)",
            scaling="row",
            pow2_scales=True,
            fast_accum_fprop=True,
            fast_accum_grads=True,
            native_capability=(9, 0),
            display_name="FP8 (rowwise, fast-accum grads)",
            colour="#006400",
            tolerance=0.5,
        ),
        Recipe(
            "fp8-blockwise",
            "FP8 E4M3, 1x128 activation/grad and 128x128 weight blocks, power-of-two scales (DeepSeek-V3, TE Float8BlockScaling)",
            scaling="block",
            block=128,
            weight_block_2d=True,
            pow2_scales=True,
            native_capability=(9, 0),
            display_name="FP8 (blockwise)",
            colour="#9467bd",
            tolerance=0.5,
        ),
        Recipe(
            "mxfp8",
            "MXFP8: E4M3 in 1x32 blocks along the reduction dim, E8M0 scales, RCEIL (OCP MX, TE MXFP8BlockScaling)",
            scaling="mx",
            block=32,
            native_capability=(10, 0),
            display_name="MXFP8",
            colour="#ff7f0e",
            tolerance=0.5,
        ),
        Recipe(
            "mxfp4",
            "MXFP4: E2M1 in 1x32 blocks along the reduction dim, E8M0 scales, RCEIL (OCP MX)",
            scaling="mx",
            block=32,
            fwd_format="e2m1",
            grad_format="e2m1",
            native_capability=(10, 0),
            display_name="MXFP4",
            colour="#e377c2",
            tolerance=1.5,
        ),
        Recipe(
            "nvfp4",
            "NVFP4: E2M1 in 1x16 blocks (16x16 for weights), E4M3 block + FP32 global scales, RHT on wgrad, "
            "stochastic rounding of grads, last 4 layers BF16 (TE NVFP4BlockScaling)",
            scaling="nvfp4",
            block=16,
            fwd_format="e2m1",
            grad_format="e2m1",
            weight_block_2d=True,
            rht_wgrad=True,
            stochastic_grads=True,
            last_bf16_layers=4,
            native_capability=(10, 0),
            display_name="NVFP4",
            colour="#d62728",
            tolerance=1.5,
        ),
    )
}


# Ingredients an ablation switches off: recipe ``<name>-no-<ingredient>`` is ``<name>`` with these fields.
ABLATIONS: dict[str, tuple[dict, str]] = {
    "rht": ({"rht_wgrad": False}, "random Hadamard transform on wgrad"),
    "sr": ({"stochastic_grads": False}, "stochastic rounding of gradients"),
    "2d": ({"weight_block_2d": False}, "2-D weight blocks"),
    "bf16-tail": ({"last_bf16_layers": 0}, "last layers in BF16"),
    "fast-accum": ({"fast_accum_fprop": False}, "fast accumulation in the forward GEMM"),
}


def ablate(recipe: Recipe, ingredient: str) -> Recipe:
    """``recipe`` with one ingredient switched off, named ``<recipe>-no-<ingredient>``."""
    if ingredient not in ABLATIONS:
        raise UsageError(f"unknown ablation {ingredient!r}; valid: {', '.join(ABLATIONS)}")
    off, what = ABLATIONS[ingredient]
    if all(getattr(recipe, k) == v for k, v in off.items()):
        raise UsageError(f"{recipe.name} has no {what} to switch off")
    return replace(
        recipe,
        name=f"{recipe.name}-no-{ingredient}",
        display_name="",
        colour=None,
        description=f"{recipe.description}; without {what}",
        **off,
    )  # the base's tolerance


def get_recipe(name: str) -> Recipe:
    """A recipe of RECIPES, or an ablation of one: ``nvfp4-no-rht`` (see ABLATIONS)."""
    if name in RECIPES:
        return RECIPES[name]
    base, sep, ingredient = name.rpartition("-no-")
    if sep and base:
        return ablate(get_recipe(base), ingredient)
    raise UsageError(
        f"unknown precision {name!r}; valid: {', '.join(RECIPES)}, or RECIPE-no-INGREDIENT "
        f"({', '.join(ABLATIONS)}), e.g. nvfp4-no-rht"
    )

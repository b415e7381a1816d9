"""Model converters: what a run changes in the plain decoder of ``lpbench.models``, and when.

A converter (torchtitan's ``ModelConverter`` is the model) changes the model once, before it is parallelized
(``convert``), and may hook into training: ``attach`` once the optimizer exists (before the first forward, so
compiled code sees the converted model; ``owned``: the parameters no data-parallel wrapper reduces),
``after_backward`` after a step's last backward, ``after_optimizer_step`` (``prefetch``: the next step's work
may start now) and ``after_evaluate``. The trainer calls :class:`Converters`' hooks, never a converter's
internals.

A model converted on the meta device is then materialized block by block (one process) or shard by shard
(several ranks, after parallelization; :func:`lpbench.parallel.plan.materialize`): ``after_materialize`` runs on
each block once it holds its values, for what needs values (LoRA's adapters drawn).

The run's converters, in order (:func:`converters_for`): SwiGLU's kernel, LoRA adapters (:mod:`.lora`), the precision
recipe (:mod:`.quantize`, or torchao's linears, :mod:`.torchao`), frozen quantized bases, the weight cache
(:mod:`.weight_cache`) and the experts' FP32 gradient buffers (:mod:`.main_grads`).
"""

from __future__ import annotations

import torch
from torch import nn

from lpbench.convert import main_grads, weight_cache
from lpbench.convert.lora import apply_lora, init_adapters
from lpbench.convert.quantize import apply_recipe, store_frozen_quantized
from lpbench.models.decoder import MLP
from lpbench.models.moe import Experts, silu_mul
from lpbench.precision.kernels.swiglu import swiglu, swiglu_of
from lpbench.precision.linear import QuantizedLinear


class Converter:
    """One change to the model (:meth:`convert`, before parallelization) and its hooks into training (see the
    module doc); every hook is a no-op unless overridden."""

    def convert(self, model: nn.Module) -> None: ...
    def after_materialize(self, name: str, block: nn.Module) -> None: ...
    def attach(self, model: nn.Module, optimizer, owned: list[nn.Parameter]) -> None: ...
    def after_backward(self) -> None: ...
    def after_optimizer_step(self, prefetch: bool) -> None: ...
    def after_evaluate(self) -> None: ...
    def log_lines(self) -> list[str]:
        return []


class SwiGLU(Converter):
    """SwiGLU with its hand-written backward (``precision/kernels/swiglu.py``: eager autograd's numbers), and as
    the epilogue of a quantized gate+up linear that takes one."""

    def convert(self, model):
        for m in model.modules():
            if isinstance(m, MLP) and m.act is silu_mul:
                m.activate = swiglu_of
            elif isinstance(m, Experts) and m.act is silu_mul:
                m.act = swiglu


class LoRA(Converter):
    def __init__(self, cfg, recipe):
        self.cfg, self.recipe, self.info = cfg, recipe, {}

    def convert(self, model):
        c = self.cfg
        self.generator = None  # on the meta device: the adapters are drawn block by block, once allocated
        self.info = apply_lora(
            model, c.lora_rank, c.lora_alpha, c.lora_targets, base_dtype=self.recipe.compute_dtype, seed=c.seed
        )

    def after_materialize(self, name, block):
        i = int(name.split(".")[1])
        if self.generator is None or i < self.next:  # seeded as apply_lora's, drawn in the same order
            device = next(block.parameters()).device
            self.generator, self.next = torch.Generator(device=device).manual_seed(self.cfg.seed), 0
        init_adapters(block, self.generator, skip=i - self.next)  # skipped: other pipeline stages' blocks
        self.next = i + 1


class Quantize(Converter):
    """The recipe's quantized linears and experts (lpbench's or torchao's); ``info``: apply_recipe's result."""

    def __init__(self, recipe, device, emulate, backend: str):
        self.args, self.info = (recipe, device, emulate, backend), {}

    def convert(self, model):
        recipe, device, emulate, backend = self.args
        self.info = apply_recipe(model, recipe, device=device, emulate=emulate, backend=backend)


class FrozenQuantized(Converter):
    """Frozen quantized bases stored quantized once (LoRA's ``--lora-base-storage quantized``). On the meta device
    the stored codes and scales are shapes only; materializing fills them from each whole weight in turn
    (``FrozenQuantizedLinear.stored_values``), so the high-precision base never exists. ``sources``: on the meta
    device, each stored weight's name (``<linear>.weight``) -> the weight it replaced."""

    def convert(self, model):
        meta = next(model.parameters()).is_meta
        self.sources = {
            f"{name}.weight": m.weight
            for name, m in model.named_modules()
            if meta and isinstance(m, QuantizedLinear) and not m.weight.requires_grad
        }
        self.names = store_frozen_quantized(model)


class WeightCache(Converter):
    """Weights quantized (or cast to BF16) once per optimizer step (:mod:`lpbench.convert.weight_cache`)."""

    def __init__(self, bf16: bool):
        self.bf16, self.cache = bf16, None

    def attach(self, model, optimizer, owned):
        self.cache = weight_cache.install(model, optimizer, self.bf16)

    def after_optimizer_step(self, prefetch):
        if self.cache is not None and prefetch:
            self.cache.refresh()

    def after_evaluate(self):
        if self.cache is not None:  # cast again: evaluate undid the amaxes its refill recorded
            self.cache.invalidate()


class MainGrads(Converter):
    """The experts' weight gradients accumulated in FP32 by their GEMMs (:mod:`lpbench.convert.main_grads`)."""

    grads = None

    def attach(self, model, optimizer, owned):
        self.grads = main_grads.install(model, optimizer, owned)

    def after_backward(self):
        if self.grads is not None:
            self.grads.expose()

    def log_lines(self):
        return (
            []
            if self.grads is None
            else [
                f"lpbench: {len(self.grads.weights)} expert weights' gradients "
                "accumulated in FP32 by their GEMMs (gradient-accumulation fusion)"
            ]
        )


class BF16Weights(Converter):
    """``--master-weights bf16``: every trained parameter stored in BF16 (no FP32 copy anywhere); the optimizer
    rounds its FP32 update stochastically (``train/optim.py``). Frozen weights are left as they are."""

    def convert(self, model):
        for p in model.parameters():
            if p.requires_grad and p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)


class Converters(list):
    """A run's converters, in order: each hook calls theirs. ``materialize(module)``: for a model converted on the
    meta device, fills ``module`` (the model or a pipeline stage, once split) with its values
    (``train/workload.py: prepare_model`` sets it)."""

    materialize = None

    def _each(self, hook: str, *args) -> None:
        for c in self:
            getattr(c, hook)(*args)

    def convert(self, model):
        self._each("convert", model)

    def after_materialize(self, name, block):
        self._each("after_materialize", name, block)

    def attach(self, model, optimizer, owned):
        self._each("attach", model, optimizer, owned)

    def after_backward(self):
        self._each("after_backward")

    def after_optimizer_step(self, prefetch):
        self._each("after_optimizer_step", prefetch)

    def after_evaluate(self):
        self._each("after_evaluate")

    def log_lines(self) -> list[str]:
        return [line for c in self for line in c.log_lines()]

    def find(self, kind: type) -> Converter | None:
        return next((c for c in self if isinstance(c, kind)), None)


def converters_for(cfg, recipe, device: torch.device, emulate: bool | str, use_compile: bool) -> Converters:
    """The converters of run ``cfg`` (a RunConfig) with ``recipe`` on ``device``. The weight cache and the FP32
    gradient buffers need gradient accumulation (one micro-batch a step has nothing to reuse or accumulate) and
    eager code between the compiled blocks (their hooks run outside the graphs: not ``--compile-scope model``)."""
    out = Converters([SwiGLU()])
    lora = cfg.workload == "lora"
    if lora:
        out.append(LoRA(cfg, recipe))
    out.append(Quantize(recipe, device, emulate, cfg.backend))
    if lora and cfg.lora_base_storage == "quantized":
        out.append(FrozenQuantized())
    if cfg.master_weights == "bf16":
        out.append(BF16Weights())
    if cfg.grad_accum > 1 and not (use_compile and cfg.compile_scope == "model"):
        out += [WeightCache(bf16=recipe.compute_dtype == torch.bfloat16), MainGrads()]
    return out

"""Pretraining, SFT and LoRA: what differs between them in a run (model, data, FLOP count).

``pretrain``  every parameter trains on token sequences (:mod:`lpbench.data.loader`).
``sft``       every parameter trains on packed prompt/response samples (:mod:`lpbench.data.sft`):
              attention stays inside each sample (``doc_ids``), the loss covers responses only,
              and the FLOP count takes attention per sample (``packed_flops_per_token``).
``lora``      SFT's data and attention; the base is frozen, its block linears held in the
              recipe's compute dtype (BF16: a frozen weight needs no FP32 master copy), and only
              the adapters (FP32 master weights, BF16 GEMMs) train. FLOPs by Megatron-Bridge's rule
              (``lora_flops_per_token``: 2/3 of the frozen GEMMs, attention in full, adapters not
              counted, as NeMo and Megatron-Bridge count them).

LoRA order: ``apply_lora`` casts and freezes the bases first, then ``apply_recipe`` swaps them for
the recipe's ``QuantizedLinear`` (adapters are parameters, not linears, so they stay BF16; the
recipe's FP32 amax histories are made after the cast). With ``lora_base_storage="quantized"`` each
frozen quantized base is then quantized once and its BF16 copy freed
(:mod:`lpbench.precision.frozen`, the converters of :mod:`lpbench.convert`); bases the recipe leaves in BF16 (the BF16 recipe, NVFP4's last
layers, dims that do not divide the block) stay as they are.

A model from ``--hf-checkpoint`` takes its architecture from config.json; the run is labelled
``hf:<folder>``, or with a zoo name of the same shape (:func:`lpbench.models.hf.hf_model_config`).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import nn

from lpbench.config import RunConfig
from lpbench.data.loader import build_dataset
from lpbench.data.sft import build_sft_dataset
from lpbench.metrics.flops import flops_per_token, lora_flops_per_token, packed_flops_per_token
from lpbench.models.hf import check_hf_checkpoint, hf_values
from lpbench.models.registry import ModelConfig
from lpbench.parallel.plan import materialize
from lpbench.convert import Converters, FrozenQuantized, LoRA, Quantize, converters_for
from lpbench.precision.recipes import Recipe


def prepare_model(
    model: nn.Module, cfg: RunConfig, recipe: Recipe, *, device: torch.device, emulate: bool | str, use_compile: bool
) -> tuple[Converters, dict, dict]:
    """The run's converters (:func:`lpbench.convert.converters_for`) applied to ``model``: ``(converters, the
    recipe's result of apply_recipe, metrics)``.

    A model on the meta device is materialized by ``converters.materialize(module)``
    (:func:`lpbench.parallel.plan.materialize`, the converters' ``after_materialize`` on each block): its initial
    weights, or ``--hf-checkpoint``'s read one parameter at a time (each rank its own rows and columns; a base stored
    quantized whole, to quantize it), equal an eager build's bit for bit. One process materializes here, block by
    block; several ranks in ``parallelize``, each its own parts once split. The checkpoint's files are checked
    first, from their headers."""
    converters = converters_for(cfg, recipe, device, emulate, use_compile)
    plain = {id(p): name for name, p in model.named_parameters()}
    converters.convert(model)
    if next(model.parameters()).is_meta:
        renamed = {name: plain[id(p)] for name, p in model.named_parameters() if plain.get(id(p), name) != name}
        stored = converters.find(FrozenQuantized)
        if stored is not None:  # a base stored quantized takes its codes from the weight it replaced
            renamed.update({name: plain[id(p)] for name, p in stored.sources.items()})

        def fill(module: nn.Module) -> None:
            values = hf_values(cfg.hf_checkpoint, model.cfg, device, lazy=True) if cfg.hf_checkpoint else None
            materialize(
                module, device, cfg.seed, values=values, names=renamed, after_block=converters.after_materialize
            )

        if cfg.hf_checkpoint:  # every problem with the files (from their headers) before anything is allocated
            check_hf_checkpoint(cfg.hf_checkpoint, model.cfg)

        converters.materialize = fill
        if cfg.world_size == 1:
            fill(model)
    metrics = {
        "workload": cfg.workload,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    lora = converters.find(LoRA)
    if lora is not None:
        stored = converters.find(FrozenQuantized)
        metrics.update(
            lora_adapted_linears=len(lora.info["adapted"]),
            lora_base_storage=cfg.lora_base_storage,
            lora_stored_quantized=len(stored.names) if stored else 0,
        )
        if device.type == "cuda":  # return the freed FP32/BF16 copies, so reserved and NVML memory show the run
            torch.cuda.empty_cache()
    return converters, converters.find(Quantize).info, metrics


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds (tied weights once; shards: the local part)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in (t.to_local() if hasattr(t, "to_local") else t for t in tensors))


def describe_lora(cfg: RunConfig, metrics: dict) -> str:
    """The log line of a LoRA run: adapters, trainable parameters, how the frozen base is stored."""
    n = metrics["lora_stored_quantized"]
    if cfg.lora_base_storage == "quantized":
        stored = f"quantized ({n} linears quantized once)" if n else f"bf16 ({cfg.precision} quantizes no linear)"
    else:
        stored = "bf16"
    return (
        f"lpbench: lora rank {cfg.lora_rank} alpha {cfg.lora_alpha:g} on {cfg.lora_targets} "
        f"({metrics['lora_adapted_linears']} linears) | {metrics['trainable_params'] / 1e6:.2f} M trainable "
        f"params | frozen base stored {stored}"
    )


def build_data(cfg: RunConfig, model_cfg: ModelConfig):
    """Training/validation data: token sequences (pretrain) or packed SFT samples (sft, lora).

    Real SFT data is tokenized with the checkpoint's tokenizer.json when ``--hf-checkpoint`` has one
    (else byte-level); ``mock`` needs no tokenizer.
    """
    if cfg.workload == "pretrain":
        return build_dataset(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=model_cfg.vocab_size)
    tokenizer = (
        cfg.hf_checkpoint if cfg.hf_checkpoint and (Path(cfg.hf_checkpoint) / "tokenizer.json").is_file() else None
    )
    return build_sft_dataset(cfg.data, tokenizer, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=model_cfg.vocab_size)


def run_flops_per_token(cfg: RunConfig, model_cfg: ModelConfig, data) -> float:
    """Model FLOPs per token of the workload: dense (pretrain), attention per sample (sft), LoRA's rule."""
    if cfg.workload == "pretrain":
        return flops_per_token(model_cfg, cfg.seq_len, cfg.flops_formula)
    lengths = data.flops_sample_lengths()
    if cfg.workload == "sft":
        return packed_flops_per_token(model_cfg, cfg.seq_len, lengths, cfg.flops_formula)
    return lora_flops_per_token(model_cfg, cfg.seq_len, cfg.flops_formula, sample_lengths=lengths)

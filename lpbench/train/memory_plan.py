"""A run's predicted peak memory (``metrics/estimate.py``), whether it fits a GPU, and what would make it fit.

``lpbench memory``, ``lpbench run --dry-run``, every run's header and an out-of-memory result use it.
"""

from __future__ import annotations

import torch

from lpbench.config import RunConfig
from lpbench.metrics.estimate import Estimate, estimate
from lpbench.metrics.hardware import detect_gpu
from lpbench.parallel.pp import rank_blocks, stage_fsdp_shard, stage_sizes
from lpbench.precision.recipes import get_recipe
from lpbench.sharding import fsdp_requested, uses_fsdp


def predict(cfg: RunConfig, gpu: str | None = None, *, cuda: bool = True, compiled: bool | None = None) -> Estimate:
    """The predicted peak of one rank of ``cfg`` on ``gpu`` (a GPU without FP4 units, or an unknown one, emulates
    NVFP4), on CUDA unless ``cuda`` is False; ``compiled`` defaults to what ``train`` does on the device."""
    peaks = detect_gpu(gpu)
    return estimate(
        cfg.model_config(),
        get_recipe(cfg.precision),
        seq_len=cfg.seq_len,
        mbs=cfg.mbs,
        dp=cfg.dp,
        tp=cfg.tp,
        cp=cfg.cp,
        fsdp=cfg.fsdp,
        recompute=cfg.recompute,
        recompute_every=cfg.recompute_every,
        grad_accum=cfg.grad_accum,
        workload=cfg.workload,
        lora_rank=cfg.lora_rank,
        lora_quantized_base=cfg.lora_base_storage == "quantized",
        fused_loss=cfg.fused_loss,
        compiled=(cfg.compile if cfg.compile is not None else cuda) if compiled is None else compiled,
        cuda=cuda,
        nvfp4_bf16_copies=cuda and (peaks is None or peaks.fp4 is None),
        reduce_bytes=2 if cfg.grad_reduce_dtype == "bf16" else 4,
        ep=cfg.ep,
        fsdp_shard=cfg.fsdp_shard if cfg.pp == 1 else stage_fsdp_shard(cfg.fsdp_shard, cfg.schedule),
        fsdp_fp8_all_gather=cfg.fsdp_fp8_all_gather,
        master_weights=cfg.master_weights,
        optimizer_states=cfg.optimizer_states,
        offload_optimizer=cfg.offload_optimizer,
        pp=cfg.pp,
        vp=cfg.vp,
        pp_schedule=cfg.pp_schedule,
        pp_rank_blocks=rank_blocks(cfg, cfg.model_config()) if cfg.pp > 1 else None,
    )


def capacity_gb(gpu: str | None) -> float | None:
    """Memory of one GPU named like ``--gpu`` (h100, h200, ...) or like torch names it; None if unknown."""
    peaks = detect_gpu(gpu)
    return None if peaks is None else peaks.memory_gb


def suggestions(cfg: RunConfig, capacity: float, gpu: str | None = None) -> list[str]:
    """Changes to ``cfg`` (flags) whose predicted peak fits ``capacity`` GB, cheapest first."""
    tries = []
    if cfg.recompute != "selective" and cfg.recompute != "full":
        tries.append(("--recompute selective", dict(recompute="selective")))
    if cfg.recompute != "full":
        tries.append(("--recompute full", dict(recompute="full")))
    if cfg.recompute_every > 1:
        tries.append(("--recompute-every 1", dict(recompute_every=1)))
    if not cfg.fused_loss:
        tries.append(("--fused-loss", dict(fused_loss=True)))
    if cfg.dp > 1 and not fsdp_requested(cfg.fsdp, cfg.cp) and cfg.workload != "lora":
        tries.append(("--fsdp", dict(fsdp=True)))
    if fsdp_requested(cfg.fsdp, cfg.cp) and cfg.fsdp_shard != "zero3":  # e.g. a recommended row's zero1
        tries.append(("--fsdp-shard zero3", dict(fsdp_shard="zero3")))
    if cfg.optimizer_states not in ("fp8", "8bit"):
        tries.append(("--optimizer-states 8bit", dict(optimizer_states="8bit")))
    if cfg.master_weights != "bf16" and get_recipe(cfg.precision).compute_dtype == torch.bfloat16:
        tries.append(
            ("--master-weights bf16 --optimizer-states 8bit", dict(master_weights="bf16", optimizer_states="8bit"))
        )
    if cfg.world_size == 1 and not cfg.offload_optimizer and cfg.compile_scope != "model":
        tries.append(("--offload-optimizer", dict(offload_optimizer=True)))
    if cfg.mbs > 1:
        tries.append((f"--mbs {cfg.mbs // 2}", dict(mbs=cfg.mbs // 2)))
    out = []
    for flags, change in tries:
        gb = predict(cfg.with_(**change), gpu).gb
        if gb <= capacity:
            out.append(f"{flags} ({gb:.1f} GB)")
    if cfg.workload != "lora" and not out:  # more GPUs, the same batch per GPU, sharded (and recomputing)
        for world in (2 * cfg.world_size, 4 * cfg.world_size, 8 * cfg.world_size):
            dp = world // cfg.tp
            wider = cfg.with_(dp=dp, fsdp=True, gbs=cfg.gbs // cfg.dp * dp)
            for flags, mode in (
                ("", cfg.recompute),
                (" --recompute selective", "selective"),
                (" --recompute full", "full"),
            ):
                gb = predict(wider.with_(recompute=mode), gpu).gb
                if gb <= capacity:
                    return [f"{world} GPUs with --fsdp{flags if mode != cfg.recompute else ''} ({gb:.1f} GB)"]
    return out


def report(cfg: RunConfig, gpu: str | None) -> tuple[list[str], bool | None]:
    """The lines ``lpbench memory`` prints for ``cfg`` and whether it fits ``gpu`` (None: memory unknown)."""
    est = predict(cfg, gpu)
    stages = ",".join(map(str, stage_sizes(cfg, cfg.model_config()))) if cfg.pp > 1 else ""
    shard = "" if cfg.fsdp_shard == "zero3" else f" {cfg.fsdp_shard}"
    lines = [
        f"{cfg.label} {cfg.precision} {cfg.workload} | seq {cfg.seq_len} MBS {cfg.mbs} GA {cfg.grad_accum} | "
        f"dp {cfg.dp}{f' (fsdp{shard})' if uses_fsdp(cfg.fsdp, cfg.dp, cfg.cp) else ''} x tp {cfg.tp}"
        f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''}"
        f"{f' x pp {cfg.pp}' if cfg.pp > 1 else ''}{f' (vp {cfg.vp})' if cfg.vp > 1 else ''}"
        f"{f' (blocks {stages})' if cfg.pp > 1 else ''}"
        f"{f' x ep {cfg.ep}' if cfg.ep > 1 else ''} | "
        f"recompute {cfg.recompute}"
        f"{f' every {cfg.recompute_every}' if cfg.recompute_every > 1 else ''}",
        f"predicted peak: {est.gb:.1f} GB per GPU",
        f"  at {est.when} ({est.total / 2**30:.1f} GB; the build's peak {est.build_gb:.1f} GB):",
    ]
    lines += [f"  {name:<36} {size / 2**30:8.2f} GB" for name, size in est.parts.items() if size]
    if cfg.offload_optimizer:  # what FSDP2's CPU offload holds in host memory instead
        kept = predict(cfg.with_(offload_optimizer=False), gpu).parts  # gradients: as many bytes as the weights
        host = sum(
            v * (2 if k.startswith("master weights") else 1)
            for k, v in kept.items()
            if k.startswith(("master weights", "optimizer states"))
        )
        lines.append(f"  on the CPU (pinned): weights, gradients, optimizer states {host / 2**30:.1f} GB")
    cap = capacity_gb(gpu)
    if cap is None:
        return lines, None
    fits = est.gb <= cap
    lines.append(f"{'fits' if fits else 'does not fit'} {gpu}'s {cap:.1f} GB")
    if fits and (hint := fsdp_shard_hint(cfg, gpu)):
        lines.append(hint)
    if not fits:
        found = suggestions(cfg, cap, gpu)
        lines.append("would fit with: " + ("; ".join(found) if found else "none of lpbench's memory flags alone"))
    return lines, fits


def fsdp_shard_hint(cfg: RunConfig, gpu: str | None, *, headroom: float = 0.9) -> str | None:
    """The hint (``lpbench memory``, a CUDA run's header) for an FSDP2 run that accumulates gradients under
    ``--fsdp-shard zero3`` without a pipeline: ``zero1`` (it all-gathers the parameters once per optimizer step
    instead of twice per micro-batch) where its predicted peak fits ``headroom`` of ``gpu``'s memory, with
    ``--grad-reduce-dtype bf16`` (half the reduce-scatter's bytes) named beside it where the gradients are reduced
    in FP32, and required where zero1 fits only with it; None otherwise or where the GPU's memory is unknown."""
    cap = capacity_gb(gpu)
    if cap is None or cfg.pp > 1 or cfg.grad_accum == 1 or cfg.fsdp_shard != "zero3":
        return None
    if not uses_fsdp(cfg.fsdp, cfg.dp, cfg.cp):
        return None
    why = "would all-gather the parameters once per optimizer step instead of twice per micro-batch"
    gb = predict(cfg.with_(fsdp_shard="zero1"), gpu).gb
    if gb <= headroom * cap:
        fp32 = cfg.grad_reduce_dtype == "fp32"
        also = " (add --grad-reduce-dtype bf16 to halve its gradient reduce-scatter)" if fp32 else ""
        return f"hint: --fsdp-shard zero1 {why}, and is predicted to fit ({gb:.1f} of {cap:.1f} GB){also}"
    if cfg.grad_reduce_dtype != "fp32":
        return None
    gb = predict(cfg.with_(fsdp_shard="zero1", grad_reduce_dtype="bf16"), gpu).gb
    if gb > headroom * cap:
        return None
    return (
        f"hint: --fsdp-shard zero1 --grad-reduce-dtype bf16 {why} and reduce-scatter the gradients in BF16, and "
        f"is predicted to fit ({gb:.1f} of {cap:.1f} GB)"
    )


def oom_hint(cfg: RunConfig, gpu: str | None) -> str:
    """What an out-of-memory result adds to its error: the prediction and, where known, what would fit."""
    est = predict(cfg, gpu)
    cap = capacity_gb(gpu)
    hint = f"predicted peak {est.gb:.1f} GB per GPU"
    if cap is not None:
        found = suggestions(cfg, cap, gpu)
        hint += f" of {cap:.1f} GB" + (f"; would fit with {found[0]}" if found else "")
    return hint

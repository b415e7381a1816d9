"""The training loop: one run of one config, timed and measured per DESIGN.md's metrics."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lpbench.config import RunConfig
from lpbench.data.loader import build_dataset
from lpbench.errors import UsageError
from lpbench.metrics import memory
from lpbench.metrics.env import environment
from lpbench.metrics.flops import flops_per_token
from lpbench.metrics.hardware import detect_gpu, mfu, peak_tflops
from lpbench.models import build_model, count_parameters, get_model_config
from lpbench.parallel.dp import clip_grad_norm_, grad_sync
from lpbench.parallel.env import all_reduce, init_distributed
from lpbench.parallel.plan import parallelize
from lpbench.precision.recipes import apply_recipe, get_recipe
from lpbench.train.optim import build_optimizer, build_scheduler


@dataclass
class RunResult:
    config: RunConfig
    status: str = "ok"  # ok | diverged | oom | error
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name} requested but no CUDA device is available")
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    return torch.device(name)


def format_log_line(rec: dict, steps: int, gbs: int) -> str:
    """One line per step in the format the seeds' grep commands find."""
    mem = f"{rec['peak_mem_gb']:.1f}" if rec.get("peak_mem_gb") is not None else "n/a"
    return (f"iteration {rec['step']}/{steps} | global_batch_size: {gbs} | lm loss: {rec['loss']:.4f} | "
            f"elapsed time per iteration (ms): {rec['step_time_s'] * 1e3:.1f} | "
            f"train_step_timing in s: {rec['step_time_s']:.4f} | TFLOPS_per_GPU: {rec['tflops_per_gpu']:.3e} | "
            f"tokens_per_sec_per_gpu: {rec['tokens_per_sec_per_gpu']:.0f} | peak_mem_gb: {mem} | "
            f"lr: {rec['lr']:.3e} | grad_norm: {rec['grad_norm']:.3f}")


def train(cfg: RunConfig, log: Callable[[str], None] = print) -> RunResult:
    """Train ``cfg`` and return its measurements. Bad configs raise UsageError before any work.

    Under torchrun or srun every rank calls this; rank 0 logs, and the result's metrics are
    global: loss averaged over data-parallel ranks, peak memory the maximum over ranks.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    world = init_distributed(device.type)
    if cfg.world_size != world.size:
        raise UsageError(f"config is for {cfg.world_size} ranks (dp {cfg.dp} x tp {cfg.tp}) "
                         f"but this job has {world.size}")
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.cuda_index)
    if not world.is_main:
        log = _quiet
    recipe = get_recipe(cfg.precision)
    model_cfg = get_model_config(cfg.model)
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    emulate = cfg.emulate if cfg.emulate is not None else device.type == "cpu"
    result = RunResult(config=cfg, env=environment(device))

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=device, seed=cfg.seed)
    n_params = count_parameters(model)
    precision_info = apply_recipe(model, recipe, device=device, emulate=emulate, backend=cfg.backend)
    par = parallelize(model, cfg, device, recipe.compute_dtype, use_compile)
    forward = par.forward
    params = [p for p in par.module.parameters() if p.requires_grad]
    optimizer = build_optimizer(par.module, cfg, fused=device.type == "cuda")
    scheduler = build_scheduler(optimizer, cfg)
    memory.reset_peak(device)  # after sharding: every rank built the full model first
    splits = build_dataset(cfg.data, seq_len=cfg.seq_len, seed=cfg.seed, vocab_size=model_cfg.vocab_size)
    if splits.vocab_size > model_cfg.vocab_size:
        raise UsageError(f"--data {cfg.data} has a vocabulary of {splits.vocab_size}, larger than "
                         f"{cfg.model}'s {model_cfg.vocab_size}")
    data = splits.train_loader(cfg.mbs, rank=par.dp_rank, world_size=cfg.dp)
    autocast = torch.autocast(device.type, dtype=recipe.compute_dtype,
                              enabled=recipe.compute_dtype != torch.float32)

    fpt = flops_per_token(model_cfg, cfg.seq_len, cfg.flops_formula)
    gpu = detect_gpu(result.env.get("gpu")) if device.type == "cuda" else None
    tokens_per_step = cfg.gbs * cfg.seq_len
    log(f"lpbench: {cfg.model} ({n_params / 1e6:.1f} M params) | {cfg.precision} ({cfg.backend}) "
        f"[{precision_info['path']}] | device {device} ({result.env.get('gpu') or 'cpu'}) | "
        f"compile {'on' if use_compile else 'off'} | GBS {cfg.gbs} MBS {cfg.mbs} GA {cfg.grad_accum} "
        f"seq {cfg.seq_len} | peak LR {cfg.peak_lr:g} | {splits.source}")
    if world.size > 1:
        log(f"lpbench: {world.size} ranks ({world.launcher}) | dp {cfg.dp} ({'fsdp' if cfg.fsdp else 'ddp'}) "
            f"x tp {cfg.tp}{' + sequence parallel' if cfg.tp > 1 and cfg.sequence_parallel else ''}")

    par.module.train()
    try:
        for step in range(1, cfg.steps + 1):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                inputs, labels = (t.to(device, non_blocking=True) for t in next(data))
                with grad_sync(par.module, micro == cfg.grad_accum - 1):
                    with autocast:
                        loss = forward(inputs, labels)
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            loss_value = loss_sum.item() / cfg.grad_accum  # synchronises the device
            step_time = time.perf_counter() - t0
            loss_value = all_reduce([loss_value], "sum", device)[0] / world.size  # TP ranks hold equal copies
            peak = memory.peak_gb(device)
            tps = tokens_per_step / step_time / world.size
            rec = {"step": step, "loss": loss_value, "step_time_s": step_time, "lr": lr,
                   "grad_norm": float(grad_norm), "tokens_per_sec_per_gpu": tps,
                   "tflops_per_gpu": fpt * tps / 1e12,
                   "peak_mem_gb": None if peak is None else all_reduce([peak], "max", device)[0]}
            result.steps.append(rec)
            if step % cfg.log_interval == 0 or step == cfg.steps:
                log(format_log_line(rec, cfg.steps, cfg.gbs))
            if not math.isfinite(loss_value):
                result.status, result.error = "diverged", f"loss became {loss_value} at step {step}"
                log(f"lpbench: run diverged: {result.error}")
                break
    except torch.OutOfMemoryError as exc:
        result.status, result.error = "oom", str(exc).splitlines()[0]
    result.metrics = summarize(result.steps, cfg, fpt, gpu, precision_info, device)
    result.metrics.update(_max_over_ranks(memory.summary(device), device))
    result.metrics.update(params=n_params, compile=use_compile, gpu_peaks=gpu.name if gpu else None,
                          world_size=world.size, dp=cfg.dp, tp=cfg.tp, fsdp=cfg.dp if cfg.fsdp else 1,
                          sequence_parallel=cfg.tp > 1 and cfg.sequence_parallel)
    return result


def _quiet(line: str) -> None:
    """The log of ranks other than 0."""


def _max_over_ranks(values: dict, device: torch.device) -> dict:
    """Numeric entries replaced by their maximum over all ranks (peak memory per GPU)."""
    keys = [k for k, v in values.items() if isinstance(v, (int, float))]
    return {**values, **dict(zip(keys, all_reduce([values[k] for k in keys], "max", device)))}


def summarize(steps: list[dict], cfg: RunConfig, fpt: float, gpu, precision_info: dict,
              device: torch.device) -> dict:
    """Summary metrics over the timed (post-warm-up) steps, each defined once (DESIGN.md)."""
    recipe = get_recipe(cfg.precision)
    timed = [s["step_time_s"] for s in steps[cfg.warmup_steps:]]
    out = {"path": precision_info["path"], "flops_formula": cfg.flops_formula, "flops_per_token": fpt,
           "quantized_linears": len(precision_info["quantized"]), "skipped_linears": precision_info["skipped"],
           "device_type": device.type, "num_gpus": cfg.world_size, "timed_steps": len(timed)}
    if steps:
        out["final_loss"] = steps[-1]["loss"]
    if not timed:
        return out
    step_time = statistics.median(timed)
    tps = cfg.gbs * cfg.seq_len / step_time / cfg.world_size
    tflops = fpt * tps / 1e12
    gemm_class = "bf16" if precision_info["path"] == "emulated" else getattr(recipe, "gemm_class", "bf16")
    out.update(step_time_s=step_time, last_step_time_s=timed[-1], tokens_per_sec_per_gpu=tps,
               tflops_per_gpu=tflops, mfu_bf16=mfu(tflops, peak_tflops(gpu, "bf16")),
               mfu_precision=mfu(tflops, peak_tflops(gpu, gemm_class)), gemm_class=gemm_class)
    return out

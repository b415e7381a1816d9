"""The training loop: one run of one config, timed and measured (ARCHITECTURE.md, Metrics)."""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch._dynamo

from lpbench.config import OFFLOAD_NEEDS_GPU, RunConfig
from lpbench.errors import UsageError
from lpbench import threads
from lpbench.metrics import memory
from lpbench.metrics.env import environment
from lpbench.metrics.hardware import detect_gpu, mfu, peak_tflops
from lpbench.metrics.profile import StepProfiler
from lpbench.metrics.tensorboard import StepWriter
from lpbench.models import build_model, count_parameters
from lpbench.models.decoder import configure_loss
from lpbench.models.registry import ModelConfig
from lpbench.convert import Converters
from lpbench.models.moe import configure_moe, moe_layers, take_moe_stats
from lpbench.parallel.dp import clip_grad_norm_, grad_sync
from lpbench.parallel.ep import expert_params, sync_expert_grads
from lpbench.parallel.env import World, all_reduce, init_distributed
from lpbench.parallel.plan import Parallelized, parallelize
from lpbench.parallel.pp import bubble_theory, rank_loads
from lpbench import gemm
from lpbench.precision import noise
from lpbench.precision.delayed import is_delayed_state
from lpbench.precision.recipes import get_recipe
from lpbench.train.checkpoint import Checkpointer, CheckpointSaveError
from lpbench.train.export import export_merged
from lpbench.train.workload import build_data, describe_lora, prepare_model, run_flops_per_token, weight_bytes
from lpbench.train.optim import build_optimizer, build_scheduler
from lpbench.train import memory_plan


@dataclass
class RunResult:
    config: RunConfig
    status: str = "ok"  # ok | diverged | oom | error
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # the steps this process trained
    history: list[dict] = field(default_factory=list)  # after --load: the checkpoint's records of the steps before
    env: dict = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name} requested but no CUDA device is available")
    if name != "cpu" and not name.startswith("cuda"):
        raise UsageError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    return torch.device(name)


def plain(x: float, digits: int = 4) -> str:
    """``x`` with ``digits`` significant digits in plain decimals (never 1.7e-03: a ``[0-9.]+`` regex reads it)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:.1f}"
    return f"{x:.{max(1, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def format_log_lines(rec: dict, steps: int, gbs: int, short: bool = False) -> list[str]:
    """A step's log lines, in the formats existing parsers read, or (``short``) one line for a terminal.

    Megatron-Bridge's ``Step Time : 5.39s GPU utilization: 2347.0MODEL_TFLOP/s/GPU``, then one
    line with Megatron's fields (``iteration k/N``, ``lm loss``, ``elapsed time per iteration
    (ms)``) and NeMo's (``global_step``, ``reduced_train_loss``, ``train_step_timing in s``,
    ``consumed_samples``, ``TFLOPS_per_GPU``). Numbers are plain decimals. The short line holds the
    step, loss, step time, throughput and gradient norm in under 100 characters.
    """
    mem = f"{rec['peak_mem_gb']:.1f}" if rec.get("peak_mem_gb") is not None else "n/a"
    step, loss, secs, tflops = rec["step"], rec["loss"], rec["step_time_s"], rec["tflops_per_gpu"]
    if short:
        took = f"{secs:.1f} s" if secs >= 10 else f"{secs * 1e3:.1f} ms"
        rate = f"{tflops:,.0f}" if tflops >= 100 else plain(tflops, 3)
        return [
            f"step {step}/{steps}  loss {loss:.4f}  {took}  {rec['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU  "
            f"{rate} TFLOP/s  grad norm {plain(rec['grad_norm'], 3)}"
        ]
    return [
        f"Step Time : {secs:.2f}s GPU utilization: {plain(tflops)}MODEL_TFLOP/s/GPU",
        f"iteration {step}/{steps} | global_batch_size: {gbs} | global_step: {step} | "
        f"consumed_samples: {step * gbs} | lm loss: {loss:.4f} | reduced_train_loss: {loss:.4f} | "
        f"elapsed time per iteration (ms): {secs * 1e3:.1f} | train_step_timing in s: {secs:.4f} | "
        f"TFLOPS_per_GPU: {plain(tflops)} | tokens_per_sec_per_gpu: {rec['tokens_per_sec_per_gpu']:.0f} | "
        f"peak_mem_gb: {mem} | lr: {plain(rec['lr'])} | grad_norm: {rec['grad_norm']:.3f}",
    ]


@dataclass
class Run:
    """One run of one config, built (:func:`build`): its model on the layout, optimizer, data and measures."""

    cfg: RunConfig
    device: torch.device
    world: World
    log: Callable[[str], None]
    result: RunResult
    model_cfg: ModelConfig
    model: torch.nn.Module  # the decoder itself (``par.module`` may wrap it)
    n_params: int
    use_compile: bool
    converters: Converters
    precision_info: dict
    workload_metrics: dict
    par: Parallelized
    fused_loss: bool
    params: list[torch.nn.Parameter]  # the trained ones
    spread: tuple  # (parameters split over ranks (EP or TP experts), their group)
    optimizer: torch.optim.Optimizer
    scheduler: object
    splits: object
    data: object  # the train loader: micro-batches of this rank's data shard
    autocast: torch.autocast
    n_eval: int  # validation micro-batches per evaluation
    fpt: float  # FLOPs per token
    gpu: object  # the GPU's peak table entry, or None
    cpu_note: str
    loss_group: object  # the ranks whose losses are averaged (None: one)
    loss_ranks: int
    keep_unsharded: bool  # FSDP zero1: parameters stay unsharded between micro-batches
    build_peak: float | None  # GB: the peak memory of building it (None: unknown)
    moe_layer_ids: tuple | None = None  # under --pp: the global block indices of this rank's MoE layers, and of all
    pipeline_index: tuple | None = (
        None  # under --pp: each trained parameter's place in the whole model, and their count
    )


def build(cfg: RunConfig, log: Callable[[str], None]) -> Run:
    """Validate ``cfg``, start the process group, build the model with its converters on the layout, its optimizer,
    scheduler and data. Bad configs raise UsageError before any work."""
    cfg.validate()
    device = resolve_device(cfg.device)
    if cfg.offload_optimizer and device.type != "cuda":
        raise UsageError(OFFLOAD_NEEDS_GPU)
    world = init_distributed(device.type)
    if cfg.world_size != world.size:
        raise UsageError(
            f"config is for {cfg.world_size} ranks (dp {cfg.dp} x tp {cfg.tp}{f' x pp {cfg.pp}' if cfg.pp > 1 else ''}) but this job has {world.size}"
        )
    if world.size > 1 and device.type == "cuda":
        device = torch.device("cuda", world.cuda_index)
    if not world.is_main:
        log = _quiet
    recipe = get_recipe(cfg.precision)
    model_cfg = cfg.model_config()
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda"
    emulate = cfg.emulate if cfg.emulate is not None else device.type == "cpu"
    result = RunResult(config=cfg, env=environment(device))
    cpu_note = ""
    if device.type == "cpu":  # before any work: threads for a shared machine, the BF16 GEMM route
        cpu_note = f" | {threads.configure()} | {gemm.describe()}"
        result.env.update(cpu_threads=torch.get_num_threads(), cpu_gemm_route=gemm.route())

    gc.collect()  # what an earlier run in this process (a list of precisions, a test) left in cycles is freed
    memory.reset_peak(device)  # the build's peak from here
    torch.manual_seed(cfg.seed)
    # on the meta device: one process materializes it block by block once converted (prepare_model), several
    # ranks their own parts once split (parallelize), so no rank ever holds the whole model
    model = build_model(model_cfg, device="meta", seed=cfg.seed)
    n_params = count_parameters(model)
    converters, precision_info, workload_metrics = prepare_model(
        model, cfg, recipe, device=device, emulate=emulate, use_compile=use_compile
    )
    configure_moe(model, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff, 1.0 / cfg.grad_accum)
    if use_compile:  # runs in one process (several precisions, converge) each get Dynamo's full recompile budget
        torch._dynamo.reset()
    order = {name: i for i, (name, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}
    par = parallelize(model, cfg, device, recipe.compute_dtype, use_compile, converters.materialize)
    fused_loss = configure_loss(model, cfg.fused_loss, 1.0 / cfg.grad_accum)
    if par.pipeline is not None:  # the stages compute the loss (the last one)
        fused_loss = any([configure_loss(s, cfg.fused_loss, 1.0 / cfg.grad_accum) for s in par.module.forward_roots])
    workload_metrics["weight_bytes"] = weight_bytes(par.module)
    loss_group = par.meshes.group("loss") if par.meshes else None  # TP ranks hold equal copies: averaged over DP
    params = [p for p in par.module.parameters() if p.requires_grad]
    spread = expert_params(par.module)[0]  # expert parallel (or TP-split experts): each rank's own experts
    spread = (spread, par.meshes.group("ep" if par.dims.ep_enabled else "tp") if spread else None)
    optimizer = build_optimizer(par.module, cfg, fused=device.type == "cuda")  # offloaded: torch's fused CPU AdamW
    converters.attach(par.module if par.pipeline else model, optimizer, params if world.size == 1 else spread[0])
    scheduler = build_scheduler(optimizer, cfg)
    build_peak = memory.peak_gb(device)
    memory.reset_peak(device)  # after building, sharding and initialising the model
    splits = build_data(cfg, model_cfg)
    if splits.vocab_size > model_cfg.vocab_size:
        raise UsageError(
            f"--data {cfg.data} has a vocabulary of {splits.vocab_size}, larger than "
            f"{cfg.model}'s {model_cfg.vocab_size}"
        )
    moe_set = set(moe_layers(model))
    return Run(
        cfg=cfg,
        device=device,
        world=world,
        log=log,
        result=result,
        model_cfg=model_cfg,
        model=model,
        n_params=n_params,
        use_compile=use_compile,
        converters=converters,
        precision_info=precision_info,
        workload_metrics=workload_metrics,
        par=par,
        fused_loss=fused_loss,
        params=params,
        spread=spread,
        optimizer=optimizer,
        scheduler=scheduler,
        splits=splits,
        data=splits.train_loader(cfg.mbs, rank=par.dp_rank, world_size=cfg.dp),
        autocast=torch.autocast(device.type, dtype=recipe.compute_dtype, enabled=recipe.compute_dtype != torch.float32),
        n_eval=eval_batch_count(cfg, splits.valid),
        fpt=run_flops_per_token(cfg, model_cfg, splits),
        gpu=detect_gpu(result.env.get("gpu")) if device.type == "cuda" else None,
        cpu_note=cpu_note,
        loss_group=loss_group,
        loss_ranks=par.dims.dp * par.dims.cp,
        keep_unsharded=par.dims.fsdp_enabled and cfg.fsdp_shard == "zero1",
        build_peak=build_peak,
        moe_layer_ids=None
        if par.pipeline is None
        else (
            [int(i) for i, b in par.module.layers.items() if any(m in moe_set for m in b.modules())],
            [i for i, b in enumerate(model.layers) if any(m in moe_set for m in b.modules())],
        ),
        pipeline_index=None
        if par.pipeline is None
        else (
            {id(p): order[n] for n, p in par.module.named_parameters() if n in order and p.requires_grad},
            len(order),
        ),
    )


def log_header(run: Run) -> tuple[float, float]:
    """The run's first log lines (what runs, how, on what layout); returns the predicted peak memory (GB per GPU)
    of the steps and of the build."""
    cfg, log, par, info = run.cfg, run.log, run.par, run.precision_info
    kernels = f" kernels {', '.join(info['kernels'])}" if info.get("kernels") else ""
    log(
        f"lpbench: {cfg.workload} {cfg.label} ({run.n_params / 1e6:.1f} M params, weights "
        f"{run.workload_metrics['weight_bytes'] / 2**20:,.1f} MiB) | {cfg.precision} ({cfg.backend}) "
        f"[{info['path']}]{kernels} | device {run.device} ({run.result.env.get('gpu') or 'cpu'}){run.cpu_note} | "
        f"compile {'on' if run.use_compile else 'off'} | LM loss {'chunked' if run.fused_loss else 'unfused'} | "
        f"GBS {cfg.gbs} MBS {cfg.mbs} GA {cfg.grad_accum} "
        f"seq {cfg.seq_len} | peak LR {cfg.peak_lr:g} | {run.splits.source}"
    )
    log(f"lpbench: {cfg.header()}")
    plan = memory_plan.predict(cfg, run.result.env.get("gpu"), cuda=run.device.type == "cuda", compiled=run.use_compile)
    built = "n/a" if run.build_peak is None else f"{run.build_peak:.1f} GB"
    log(
        f"lpbench: predicted peak memory {plan.step_gb:.1f} GB per GPU (build {plan.build_gb:.1f} GB predicted, "
        f"{built} measured) | recompute {cfg.recompute}"
        f"{f' every {cfg.recompute_every}' if cfg.recompute_every > 1 else ''}"
    )
    if info.get("why_emulated"):
        log(f"lpbench: {cfg.precision} GEMMs emulated: {info['why_emulated']}")
    if cfg.workload == "lora":
        log(describe_lora(cfg, run.workload_metrics))
    for line in run.converters.log_lines():
        log(line)
    if run.world.size > 1:
        dp_kind = ("fsdp, fp8 all-gather" if cfg.fsdp_fp8_all_gather else "fsdp") if par.dims.fsdp_enabled else "ddp"
        if par.dims.fsdp_enabled:
            dp_kind += f" {cfg.fsdp_shard}" if cfg.fsdp_shard != "zero3" else ""
            if par.dims.hsdp_enabled:
                dp_kind += f", hsdp: {par.dims.dp_replicate} replicas x {par.dims.dp_shard} shards"
        if cfg.grad_reduce_dtype != "fp32":
            dp_kind += f", {cfg.grad_reduce_dtype} gradient reduction"
        log(
            f"lpbench: {run.world.size} ranks ({run.world.launcher}) | dp {cfg.dp} ({dp_kind}) "
            f"x tp {cfg.tp}{' + sequence parallel' if cfg.tp > 1 and cfg.sequence_parallel else ''}"
            f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''}"
            f"{f' | experts over ep {cfg.ep} ranks' if cfg.ep > 1 else ''}"
            f"{pipeline_line(run) if par.pipeline is not None else ''}"
        )
        cuda_main = run.device.type == "cuda" and run.world.is_main  # the rank that logs it
        if cuda_main and (hint := memory_plan.fsdp_shard_hint(cfg, run.result.env.get("gpu"))):
            log(f"lpbench: {hint}")
    return plan.step_gb, plan.build_gb


def micro_batches(run: Run) -> torch.Tensor:
    """The step's forward and backward passes, one micro-batch after another (gradients accumulated, synchronised
    over data-parallel ranks on the last); returns the micro-batches' loss sum (detached)."""
    cfg = run.cfg
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(cfg.grad_accum):
        batch = run.par.local(next(run.data).model_args(run.device))
        draws = noise.drawing(cfg.seed, run.scheduler.last_epoch, micro * cfg.dp + run.par.dp_rank, run.device)
        with grad_sync(run.par.module, micro == cfg.grad_accum - 1, run.keep_unsharded), draws:
            with run.autocast:
                loss = run.par.forward(*batch)  # input_ids, labels[, doc_ids]
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    return loss_sum


def pipelined(run: Run, measure: bool = False) -> torch.Tensor:
    """The step's forward and backward passes under pipeline parallelism: the schedule runs the step's
    micro-batches through this rank's stages; returns their loss sum on the last stage's rank, zero elsewhere."""
    batches = [run.par.local(next(run.data).model_args(run.device)) for _ in range(run.cfg.grad_accum)]
    with run.autocast:
        return run.par.pipeline.step(batches, run.scheduler.last_epoch, measure)


def train_step(run: Run, prefetch: bool, measure: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step: the forward and backward passes, the converters' hooks, expert gradients summed over
    their replicas, the gradient norm clipped, the optimizer and scheduler stepped. ``prefetch``: the converters
    may start the next step's work (:func:`prefetch_weights`); ``measure``: the pipeline measures its bubble. Returns the micro-batches' loss sum (a tensor,
    not synchronised), the gradient norm and the step's learning rate."""
    cfg, par = run.cfg, run.par
    loss_sum = micro_batches(run) if par.pipeline is None else pipelined(run, measure)
    run.converters.after_backward()
    if cfg.ep > 1 or cfg.tp > 1:
        sync_expert_grads(par.module, cfg.dp * cfg.cp, par.meshes.group("ep_replicate" if cfg.ep > 1 else "loss"))
    pipeline = None if par.pipeline is None else (par.meshes.group("pp"), *run.pipeline_index)
    grad_norm = clip_grad_norm_(run.params, cfg.grad_clip, run.optimizer, run.spread, pipeline)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    with run.autocast:
        run.converters.after_optimizer_step(prefetch)
    return loss_sum, grad_norm, lr


def train(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    results_dir: str = "lpbench-results",
    on_step: Callable[[dict], None] | None = None,
) -> RunResult:
    """Train ``cfg`` and return its measurements. Bad configs raise UsageError before any work.

    Under torchrun or srun every rank calls this; rank 0 logs, and the result's metrics are
    global: loss averaged over data-parallel ranks, peak memory the maximum over ranks.
    ``--profile-steps`` traces go to ``results_dir/profiles/<run key>/``. ``on_step`` (rank 0) gets
    each step's record as it is made (after ``--load`` the first is the checkpoint's step + 1): a
    sweep child writes them as JSON lines for its parent, run and converge move their progress display.
    """
    run = build(cfg, log)
    log, device, world, par, result = run.log, run.device, run.world, run.par, run.result
    if not world.is_main:
        on_step = None
    predicted, predicted_build = log_header(run)
    tokens_per_step = cfg.gbs * cfg.seq_len
    checkpointer = Checkpointer(cfg, par.module, run.optimizer, run.scheduler, run.data, device, log)
    start, result.history = checkpointer.resume()  # 0, [] without --load
    profiler = StepProfiler(cfg.profile_range, f"{results_dir}/profiles/{cfg.key()}", device, log, cfg.profile_stacks)
    short_lines = sys.stdout.isatty()  # a terminal: one short line a step; a log file: the parsers' formats
    scalars = StepWriter(
        cfg.tensorboard if world.is_main else None,
        cfg.model,
        cfg.precision,
        cfg.key(),
        wandb_dir=cfg.wandb if world.is_main else None,
        config=cfg.to_dict(),
    )
    par.module.train()
    breaks, new_breaks = graph_breaks() if run.use_compile else None, Counter()
    try:
        expert_tokens = None  # per MoE layer, summed over the steps
        for step in range(start + 1, cfg.steps + 1):
            profiler.begin(step)
            t0 = time.perf_counter()
            evaluates = bool(run.n_eval) and (step % cfg.eval_every == 0 or step == cfg.steps)
            prefetch = prefetch_weights(step, cfg, evaluates, checkpointer.saves(step))
            loss_sum, grad_norm, lr = train_step(run, prefetch, measure=step == cfg.steps)  # the bubble: last step
            if par.pipeline is not None:  # the last stage's loss, to every rank
                torch.distributed.all_reduce(loss_sum, group=par.meshes.group("pp"))
            loss_value = loss_sum.item() / cfg.grad_accum  # synchronises the device
            step_time = time.perf_counter() - t0
            if run.loss_group is not None:  # the global batch's mean
                loss_value = all_reduce([loss_value], "sum", device, run.loss_group)[0] / run.loss_ranks
            peak = memory.peak_gb(device)
            tps = tokens_per_step / step_time / world.size
            rec = {
                "step": step,
                "loss": loss_value,
                "step_time_s": step_time,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_sec_per_gpu": tps,
                "tflops_per_gpu": run.fpt * tps / 1e12,
                "peak_mem_gb": None if peak is None else all_reduce([peak], "max", device)[0],
            }
            moe = moe_step_stats(par.module, device, world.size // cfg.pp, cfg.tp, cfg.ep, run.moe_layer_ids)
            if moe is not None:
                rec.update(moe["step"])
                expert_tokens = (
                    moe["tokens"]
                    if expert_tokens is None
                    else [[a + b for a, b in zip(old, new)] for old, new in zip(expert_tokens, moe["tokens"])]
                )
            result.steps.append(rec)
            if breaks is not None and step == start + 1 and (new_breaks := graph_breaks() - breaks):
                log(graph_break_line(new_breaks))
            if step % cfg.log_interval == 0 or step == cfg.steps:
                for line in format_log_lines(rec, cfg.steps, cfg.gbs, short=short_lines):
                    log(line)
                if moe is not None:
                    log(format_moe_line(rec))
            profiler.end(step, rec)
            if on_step is not None:
                on_step(rec)
            if not math.isfinite(loss_value):
                result.status, result.error = "diverged", f"loss became {loss_value} at step {step}"
                log(f"lpbench: run diverged: {result.error}")
                break
            if evaluates:
                rec["val_loss"] = evaluate(
                    par.module,
                    run.splits.valid_batches(cfg.mbs, par.dp_rank, cfg.dp),
                    run.n_eval,
                    device,
                    run.autocast,
                    par.local,
                    None if par.pipeline is None else par.pipeline.evaluate,
                )
                run.converters.after_evaluate()
                take_moe_stats(par.module)  # the next step's MoE statistics count training forwards only
                log(
                    f"validation loss at iteration {step} | lm loss value: {rec['val_loss']:.6E} | "
                    f"lm loss PPL: {math.exp(min(rec['val_loss'], 700)):.6E} |"
                )
            scalars.add(rec)  # after validation: the step's val_loss too
            try:
                checkpointer.maybe_save(step, result.history + result.steps)
            except CheckpointSaveError as exc:  # the steps measured so far are the run's result
                result.status, result.error = "error", str(exc)
                log(f"lpbench: {exc}")
                break
    except torch.OutOfMemoryError as exc:
        result.status, result.error = "oom", oom_error(cfg, exc)
        log(f"lpbench: out of memory: {result.error}")
    finally:
        profile = profiler.close()  # a run that stopped inside the profiled steps still gets its trace
        scalars.close()
    if cfg.export_hf and result.status == "ok":  # every rank gathers, rank 0 writes
        export_merged(run.model, cfg.export_hf)
        log(f"lpbench: model exported as a Hugging Face checkpoint to {cfg.export_hf}")
    result.metrics = summarize(result.steps, cfg, run.fpt, run.gpu, run.precision_info, device)
    if start:
        result.metrics["resumed_from_step"] = start
    if run.model_cfg.n_experts and result.steps:
        result.metrics["tokens_per_expert"] = expert_tokens  # per layer, summed over the run's steps
        if cfg.ep > 1:
            result.metrics["ep_tokens_per_rank"] = [
                sum(c) for c in zip(*(s["ep_tokens_per_rank"] for s in result.steps))
            ]
            result.metrics["ep_imbalance_max"] = max(s["ep_imbalance"] for s in result.steps)
    if profile:
        result.metrics["profile"] = profile
    if new_breaks:
        result.metrics["compile_graph_breaks"] = sum(new_breaks.values())
    # an out-of-memory rank stopped inside a step the others may finish: its collectives are no longer in step with
    # theirs, so it makes none from here (its own peaks) and its job ends once the result is recorded
    # (bench/runner.py: end_if_stranded)
    collective = not (result.status == "oom" and world.size > 1)
    peaks = memory.summary(device)
    result.metrics.update(_max_over_ranks(peaks, device) if collective else peaks)
    result.metrics["predicted_peak_gb"] = predicted
    result.metrics["predicted_build_peak_gb"] = predicted_build
    if run.build_peak is not None:
        result.metrics["build_peak_gb"] = (
            all_reduce([run.build_peak], "max", device)[0] if collective else run.build_peak
        )
    measured = result.metrics.get("peak_mem_allocated_gb")
    if measured is not None and device.type == "cuda":
        log(
            f"lpbench: peak memory {measured:.1f} GB per GPU measured, {predicted:.1f} GB predicted "
            f"({(predicted / measured - 1) * 100:+.0f} %)"
        )
    result.metrics.update(
        params=run.n_params,
        compile=run.use_compile,
        compile_scope=cfg.compile_scope if run.use_compile else "off",  # what ran, not what was asked
        gpu_peaks=run.gpu.name if run.gpu else None,
        world_size=world.size,
        dp=cfg.dp,
        tp=cfg.tp,
        cp=cfg.cp,
        ep=cfg.ep,
        fsdp=cfg.dp if par.dims.fsdp_enabled else 1,
        dp_replicate=par.dims.dp_replicate,
        dp_shard=par.dims.dp_shard,
        fsdp_shard=cfg.fsdp_shard if par.dims.fsdp_enabled else None,
        grad_reduce_dtype=cfg.grad_reduce_dtype if par.dims.dp_enabled else None,
        sequence_parallel=cfg.tp > 1 and cfg.sequence_parallel,
        **run.workload_metrics,
    )
    if par.pipeline is not None and collective:
        result.metrics.update(pipeline_metrics(run, log))
    return result


def pipeline_line(run: Run) -> str:
    """The log header's pipeline part: stages, every stage's block count and the split, schedule, micro-batches."""
    pipe, cfg = run.par.pipeline, run.cfg
    split = cfg.pp_split if cfg.pp_split in ("balanced", "even") else "as given"
    return (
        f" | pp {cfg.pp} x vp {cfg.vp} ({pipe.n_stages} stages of {','.join(map(str, pipe.sizes))} blocks, {split}; "
        f"{pipe.name}, {pipe.micro_batches} micro-batches)"
    )


def pipeline_metrics(run: Run, log: Callable[[str], None]) -> dict:
    """The pipeline's layout and its bubble: measured on the last step (each rank's idle fraction of the schedule,
    :class:`lpbench.parallel.pp.BusyClock`: the mean over ranks, and each pipeline rank's), beside the theory
    (p - 1) / (m * v + p - 1) of equal ranks and that of this split's ranks (:func:`bubble_theory` with
    :func:`rank_loads`: whole blocks and the LM head rarely divide evenly, and the busiest rank sets the pace)."""
    pipe, cfg = run.par.pipeline, run.cfg
    theory = bubble_theory(cfg.pp, cfg.vp, cfg.grad_accum)
    loads = rank_loads(cfg, cfg.model_config())
    split = bubble_theory(cfg.pp, cfg.vp, cfg.grad_accum, loads)
    out = {"pp": cfg.pp, "vp": cfg.vp, "pp_schedule": pipe.name, "pp_bubble_theory": theory}
    out |= {"pp_bubble_split": split, "pp_stage_blocks": ",".join(map(str, pipe.sizes))}
    if pipe.bubble is not None:
        slots = [0.0] * cfg.pp  # each pipeline rank's bubble, averaged over the ranks of its stage
        slots[run.par.meshes.rank("pp")] = pipe.bubble * cfg.pp / run.world.size
        per_rank = all_reduce(slots, "sum", run.device)
        out["pp_bubble"] = sum(per_rank) / cfg.pp
        out["pp_bubble_ranks"] = ",".join(f"{b:.3f}" for b in per_rank)
        log(
            f"lpbench: pipeline bubble {out['pp_bubble']:.1%} measured (last step, mean over ranks; by pipeline rank "
            f"{', '.join(f'{b:.1%}' for b in per_rank)}), {theory:.1%} in theory ((p-1)/(m*v+p-1), p {cfg.pp}, "
            f"v {cfg.vp}, m {cfg.grad_accum}, {pipe.name}), {split:.1%} with this split's rank loads "
            f"({', '.join(f'{x:.1f}' for x in loads)} blocks)"
        )
    return out


def oom_error(cfg: RunConfig, exc: BaseException) -> str:
    """An out-of-memory result's error: torch's first line, the predicted peak and what would fit."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return f"{str(exc).splitlines()[0]} ({memory_plan.oom_hint(cfg, gpu)})"


def moe_step_stats(module, device, world_size: int, tp: int, ep: int = 1, layer_ids=None) -> dict | None:
    """One step's MoE log values (aux and z-loss as the loss sees them: averaged over micro-batches and
    ranks; expert load = the busiest expert's tokens over the mean, worst layer) and per-layer token counts
    (the ``tp`` ranks of a tensor-parallel group route the same tokens: counted once). Under expert
    parallelism also the tokens each expert-parallel rank's experts received (summed over layers and over
    the expert-parallel groups) and the imbalance: the busiest rank's tokens over the mean, worst layer.
    ``layer_ids`` (pipeline parallelism): the global block indices of this rank's MoE layers and of all of them;
    every rank counts zero for the other stages' layers, and ``world_size`` is the ranks of one stage."""
    stats = take_moe_stats(module)
    if stats is None:
        return None
    tokens = stats["tokens_per_expert"]
    if layer_ids is not None:
        mine, every = layer_ids
        full = {i: [0] * module.cfg.n_experts for i in every}
        full.update(zip(mine, tokens))
        tokens = [full[i] for i in every]
    flat = all_reduce(
        [float(c) for layer in tokens for c in layer] + [stats["aux_loss"], stats["z_loss"]], "sum", device
    )
    n_layers, n_exp = len(tokens), len(tokens[0])
    tokens = [[int(c) // tp for c in flat[i * n_exp : (i + 1) * n_exp]] for i in range(n_layers)]
    load = max(max(layer) * n_exp / max(sum(layer), 1) for layer in tokens)
    step = {"moe_aux_loss": flat[-2] / world_size, "moe_z_loss": flat[-1] / world_size, "expert_load_max": load}
    if ep > 1:
        per_rank = [[sum(layer[r * n_exp // ep : (r + 1) * n_exp // ep]) for r in range(ep)] for layer in tokens]
        step["ep_tokens_per_rank"] = [sum(column) for column in zip(*per_rank)]
        step["ep_imbalance"] = max(max(ranks) * ep / max(sum(ranks), 1) for ranks in per_rank)
    return {"tokens": tokens, "step": step}


def format_moe_line(rec: dict) -> str:
    line = (
        f"moe | load_balancing_loss: {rec['moe_aux_loss']:.4f} | z_loss: {rec['moe_z_loss']:.4f} | "
        f"max expert load (x mean, worst layer): {rec['expert_load_max']:.2f}"
    )
    if "ep_tokens_per_rank" in rec:
        line += (
            f" | tokens per ep rank: {','.join(str(n) for n in rec['ep_tokens_per_rank'])} | "
            f"ep imbalance (max x mean, worst layer): {rec['ep_imbalance']:.2f}"
        )
    return line


def _quiet(line: str) -> None:
    """The log of ranks other than 0."""


def eval_batch_count(cfg: RunConfig, valid) -> int:
    """Micro-batches per evaluation: whole global micro-batches only, so every rank runs as many."""
    if not cfg.eval_every:
        return 0
    n_valid = len(valid)
    full = n_valid // (cfg.mbs * cfg.dp)
    if not full:
        from lpbench.data.loader import VAL_FRACTION

        need = cfg.mbs * cfg.dp
        sequences = math.ceil((need - 1) / VAL_FRACTION) + 1  # the fewest whose held-out share gives `need`
        raise UsageError(
            f"--eval-every needs at least MBS x DP = {need} validation sequences of {cfg.seq_len} "
            f"tokens; --data {cfg.data} holds out {n_valid} ({VAL_FRACTION:.0%} of its sequences): "
            f"about {sequences * cfg.seq_len:,} tokens of data are needed, or pass --eval-every 0 "
            "to judge by the training loss alone"
        )
    return min(full, cfg.eval_batches) if cfg.eval_batches else full


def prefetch_weights(step: int, cfg: RunConfig, evaluates: bool, saves: bool) -> bool:
    """Whether the converters may start the next step's work (the weight cache's refill) right after step
    ``step``'s optimizer step, before the step's closing sync, so that the host launches it while the GPU still
    runs the optimizer. Not after the last step, nor before an evaluation or a checkpoint save: those must see
    delayed scaling's amaxes as they stand before the cast records the weights' (evaluate restores them; a
    resumed run casts again at its first forward)."""
    return step < cfg.steps and not evaluates and not saves


def evaluate(
    module: torch.nn.Module,
    batches,
    n_batches: int,
    device: torch.device,
    autocast,
    local=lambda args: args,
    forward=None,
) -> float:
    """Mean loss per label token over ``n_batches`` micro-batches on every rank, without gradients
    (``local``: a batch's model arguments as this rank takes them, :meth:`Parallelized.local`; ``forward``: the loss
    of those arguments, or None on a rank that holds none (a pipeline's, :meth:`lpbench.parallel.pp.Pipeline.evaluate`),
    by default ``module``'s).

    Delayed scaling's amax histories and scales (the buffers a forward changes) are restored afterwards:
    evaluating does not change the training that follows (as in TE, whose no-grad forwards update no scale).
    """
    state = [b for name, b in module.named_buffers() if is_delayed_state(name)]
    saved = [b.clone() for b in state]
    module.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in itertools.islice(batches, n_batches):
            whole = batch.model_args(device)
            args = local(whole)
            # labels (-100 marks tokens without loss); under CP each rank's loss is its share of the whole sequences'
            # mean (lpbench.parallel.cp), so it weighs its part of their count
            n = int((whole[1] >= 0).sum()) * args[1].numel() / whole[1].numel()
            with autocast:
                loss = module(*args) if forward is None else forward(args)
            if loss is not None:
                total += loss.item() * n
                count += n
    for buf, old in zip(state, saved):
        buf.copy_(old)
    module.train()
    total, count = all_reduce([total, count], "sum", device)
    return total / count


def graph_breaks() -> Counter:
    """torch.compile's graph breaks so far in this process, by reason (Dynamo's counters)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def graph_break_line(breaks: Counter) -> str:
    """The log line of the first step's graph breaks: between the compiled graphs the code runs eagerly (a break
    inside a recomputed block: the whole block; MoE routing breaks its block by design)."""
    reason = breaks.most_common(1)[0][0].strip().splitlines()[0][:160]
    return (
        f"lpbench: torch.compile broke its graphs {sum(breaks.values())} times in the first step, the code between "
        f"them running eagerly (most often: {reason})"
    )


def _max_over_ranks(values: dict, device: torch.device) -> dict:
    """Numeric entries replaced by their maximum over all ranks (peak memory per GPU)."""
    keys = [k for k, v in values.items() if isinstance(v, (int, float))]
    return {**values, **dict(zip(keys, all_reduce([values[k] for k in keys], "max", device)))}


def step_time_dist(times: list[float]) -> dict:
    """The spread of the timed steps: quartiles (inclusive method; all equal for one step), min, max."""
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return {"step_time_p25_s": q1, "step_time_p75_s": q3, "step_time_min_s": min(times), "step_time_max_s": max(times)}


def tail_loss(steps: list[dict]) -> dict:
    """The training loss over the last quarter of the steps (at least one): its mean, the standard error
    of that mean (step-to-step noise; 0 for one step) and the step count. A comparison of precisions
    reads this mean, not the last step's loss, which one batch moves."""
    losses = [s["loss"] for s in steps if isinstance(s.get("loss"), (int, float)) and math.isfinite(s["loss"])]
    if not losses or len(losses) < len(steps):  # a non-finite loss: the run diverged, no mean describes it
        return {}
    tail = losses[-max(1, len(losses) // 4) :]
    sem = statistics.stdev(tail) / math.sqrt(len(tail)) if len(tail) > 1 else 0.0
    return {"tail_loss": statistics.fmean(tail), "tail_loss_sem": sem, "tail_steps": len(tail)}


def summarize(steps: list[dict], cfg: RunConfig, fpt: float, gpu, precision_info: dict, device: torch.device) -> dict:
    """Summary metrics over the timed (post-warm-up) steps, each defined once (ARCHITECTURE.md, Metrics)."""
    recipe = get_recipe(cfg.precision)
    timed = [s["step_time_s"] for s in steps[cfg.warmup_steps :] if not s.get("profiled")]  # profiler overhead
    out = {
        "path": precision_info["path"],
        "why_emulated": precision_info["why_emulated"],
        "flops_formula": cfg.flops_formula,
        "flops_per_token": fpt,
        "quantized_linears": len(precision_info["quantized"]),
        "kernels": ",".join(precision_info.get("kernels", [])),
        "skipped_linears": precision_info["skipped"],
        "device_type": device.type,
        "num_gpus": cfg.world_size,
        "timed_steps": len(timed),
    }
    if steps:
        out["final_loss"] = steps[-1]["loss"]
        out.update(tail_loss(steps))
    val = [s["val_loss"] for s in steps if "val_loss" in s]
    if val:
        out["val_loss"] = val[-1]
    if not timed:
        return out
    step_time = statistics.median(timed)
    tps = cfg.gbs * cfg.seq_len / step_time / cfg.world_size
    tflops = fpt * tps / 1e12
    gemm_class = "bf16" if precision_info["path"] == "emulated" else recipe.gemm_class
    out.update(step_time_dist(timed))
    out.update(
        step_time_s=step_time,
        last_step_time_s=timed[-1],
        tokens_per_sec_per_gpu=tps,
        tflops_per_gpu=tflops,
        mfu_bf16=mfu(tflops, peak_tflops(gpu, "bf16")),
        mfu_precision=mfu(tflops, peak_tflops(gpu, gemm_class)),
        gemm_class=gemm_class,
    )
    return out

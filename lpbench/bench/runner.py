"""One run from config to row: check it, train it, turn a failure into a result, record it.

``lpbench run`` and ``lpbench converge`` check each config before any work through :func:`validated`
(the config's own rules, then a ``--load`` checkpoint against it); they and every sweep child train
through :func:`execute` and write their row through :func:`record`; a sweep parent records a child
that left no row through :func:`record` too, so a run's row is written in one place.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist
from rich.markup import escape

from lpbench.config import settings
from lpbench.console import console
from lpbench.bench.store import RunRecord
from lpbench.errors import UsageError
from lpbench.parallel.pp import even_sizes, stage_sizes
from lpbench.train import loop
from lpbench.train.loop import RunResult


def validated(cfg):
    """``cfg`` validated (``RunConfig.validate``), its layout (:class:`ParallelDims`) possible, runnable here
    (``--backend torchao`` needs torchao installed), ``--hf-checkpoint``'s files fit its config.json, and with
    ``--load``, resumable from its checkpoint."""
    from lpbench.parallel.dims import ParallelDims

    cfg.validate()
    ParallelDims.of(cfg)
    if cfg.hf_checkpoint is not None:  # the weight files' names, shapes and dtypes, from their headers
        from lpbench.models.hf import check_hf_checkpoint

        check_hf_checkpoint(cfg.hf_checkpoint, cfg.model_config())
    if cfg.backend == "torchao":
        from lpbench.convert.torchao import missing

        if why := missing():
            raise UsageError(why)
    if cfg.load is not None:
        check_resume(cfg)
    return cfg


def check_resume(cfg) -> None:
    """The checkpoint ``cfg.load`` names can resume ``cfg``: the settings declared ``resume`` match (a setting
    the checkpoint predates counts as its default), under PP so do the stages' block counts, and steps are left
    to train."""
    from dataclasses import fields

    from lpbench.train.checkpoint import find_checkpoint, read_metadata

    ckpt = find_checkpoint(cfg.load)
    meta = read_metadata(ckpt)
    saved, defaults = meta["config"], {f.name: f.default for f in fields(cfg)}
    diff = [
        f"{k} {saved.get(k, defaults[k])!r} (this run: {getattr(cfg, k)!r})"
        for k in settings("resume")
        if saved.get(k, defaults[k]) != getattr(cfg, k)
    ]
    if diff:
        raise UsageError(f"--load {ckpt}: checkpoint does not match this run: {'; '.join(diff)}")
    if cfg.pp > 1:  # a checkpoint saved before --pp-split existed: the even split
        m = cfg.model_config()
        then, now = meta.get("pp_stage_blocks") or even_sizes(m.n_layers, cfg.pp * cfg.vp), stage_sizes(cfg, m)
        if then != now:
            blocks = ",".join(map(str, then))
            raise UsageError(
                f"--load {ckpt}: its pipeline stages hold {blocks} blocks, this run's "
                f"{','.join(map(str, now))}: resume with --pp-split {blocks}"
            )
    if meta["step"] >= cfg.steps:
        raise UsageError(
            f"--load {ckpt}: checkpoint is at step {meta['step']}, --steps {cfg.steps} leaves nothing to train"
        )
    if cfg.profile_range and cfg.profile_range[1] <= meta["step"]:
        raise UsageError(
            f"--profile-steps {cfg.profile_steps}: the run resumed from {ckpt} starts at step {meta['step'] + 1}"
        )


def execute(
    cfg, *, results_dir: str, on_step: Callable[[dict], None] | None = None, record_usage_errors: bool = False
) -> RunResult:
    """Train ``cfg``, its log lines on stdout. An exception becomes an ``error`` result, so one failing
    recipe does not take the others down: named on the console, or, for a sweep child (whose row must
    say why even for bad input: ``record_usage_errors``), with its traceback on stderr."""
    try:
        validated(cfg)  # again where a command checked it up front: cheap, and no caller can skip it
        return loop.train(cfg, log=lambda line: print(line, flush=True), results_dir=results_dir, on_step=on_step)
    except Exception as exc:
        if isinstance(exc, UsageError) and not record_usage_errors:
            raise
        if isinstance(exc, torch.OutOfMemoryError):  # before the first step (building, sharding): OOM as in a step
            result = RunResult(config=cfg, status="oom", error=loop.oom_error(cfg, exc))
            console.print(f"[red]lpbench: {escape(cfg.precision)} ran out of memory: {escape(result.error)}[/red]")
            return result
        error = error_line(exc)
        if PEER_GONE.search(error):  # gloo's read from a rank that ended the job: that rank says why
            error = "another rank ended the job (its line says why)"
        result = RunResult(config=cfg, status="error", error=error)
        if record_usage_errors:
            traceback.print_exc()
        else:
            console.print(f"[red]lpbench: {escape(cfg.precision)} failed: {escape(result.error)}[/red]")
        return result


PEER_GONE = re.compile(r"Connection (reset|closed) by peer")


def error_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line: its message's first line that is not blank, and where another
    exception caused it (torch's pipeline stages wrap their failures), the cause's the same way."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    line = f"{type(exc).__name__}: {first}".rstrip(": ")
    cause = exc.__cause__ or exc.__context__
    if cause is None or cause is exc:
        return line
    said = error_line(cause)
    return line if said.partition(": ")[2] in line else f"{line} (from {said})"  # a wrapper that repeats it: once


def end_if_stranded(result: RunResult) -> None:
    """Exit (code 1) after a run of a multi-rank job failed with an exception or ran out of memory on this rank: the
    other ranks may wait for it in a collective it will never join (a pipeline stage's backward that fails on one
    rank only; an allocation that fails on one rank), or have stopped at another collective than this rank, so no
    later collective of the job could be trusted; torchrun stops them once one rank has exited. The job's later
    runs do not start."""
    if result.status in ("error", "oom") and dist.is_initialized() and dist.get_world_size() > 1:
        what = "ran out of memory" if result.status == "oom" else "failed"
        console.print(
            f"[red]lpbench: rank {dist.get_rank()} {what} ({escape(str(result.error))}): ending the job (its other "
            "ranks may wait for it; the job's later runs do not start)[/red]"
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def record(
    store,
    result: RunResult,
    *,
    group_id: str | None,
    sweep_id: str | None = None,
    workload: str | None = None,
    metrics: dict | None = None,
    env: dict | None = None,
) -> int | None:
    """``result``'s row and steps in ``store`` (``metrics``, ``env``, ``workload`` replace the result's)."""
    cfg = result.config
    return store.add_run(
        RunRecord(
            config=cfg.to_dict(),
            status=result.status,
            error=result.error,
            metrics=result.metrics if metrics is None else metrics,
            steps=result.steps,
            env=result.env if env is None else env,
            run_key=cfg.key(),
            group_id=group_id,
            sweep_id=sweep_id,
            workload=workload or cfg.workload,
            backend=cfg.backend,
            num_gpus=cfg.world_size,
        )
    )

"""lpbench's single entry point: ``lpbench run | report | flops | models | recipes | ...``.

Bad input never ends in a traceback: it prints one line on stderr and exits 2.

Start-up stays light: ``lpbench``, ``lpbench --help`` and ``--version`` import neither torch nor the
model code. ``main`` builds the full parser only for the command on the command line (``COMMANDS``
holds every command's one-line help for the top-level listing), and each command imports what it
needs inside its function.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shlex
import sys
import uuid
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from lpbench import __version__
from lpbench.console import Parser, console, csv_list, stdout_failed, usable_streams
from lpbench.errors import Terminated, UsageError, raise_terminated
from lpbench.paths import check_dir, check_export_dir, check_file, write_file

if TYPE_CHECKING:  # imported where used: `lpbench --help` imports no torch
    from lpbench.config import RunConfig

MAX_QUANT_ERROR_ELEMENTS = 1 << 28  # quant-error's sample tensors: about 1 GB each at this size


# ----------------------------------------------------------------------------- run
def add_run_args(p: argparse.ArgumentParser) -> None:
    from lpbench.config import RunConfig, add_config_args

    defaults = RunConfig()
    recommended = {
        k: f"the recommended config with --gpu, else {defaults.default_text(k)}"
        for k in ("seq_len", "mbs", "gbs", "tp")
    }  # the flags --gpu fills
    add_config_args(p, default_texts=recommended)  # every RunConfig setting; unset ones stay None
    p.add_argument(
        "--gpu",
        default=None,
        help="take --seq-len/--mbs/--gbs/--tp (and --flops-formula) defaults from lpbench's recommended "
        "config for this GPU type (h100, h200, b200, gb200, cpu); explicit flags override",
    )
    p.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="GPU count of the recommended config to use with --gpu (default: the smallest listed)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="start N processes (one per GPU) on this machine through torchrun; not needed when "
        "lpbench is started by torchrun or srun",
    )
    p.add_argument("--results", default="lpbench-results", help="results folder (default ./lpbench-results)")
    p.add_argument(
        "--wide",
        action="store_true",
        help="show every column of the summary table, however wide (default: fit the terminal)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        default=None,
        help="also write the summary table's rows (every number, unrounded) to FILE as JSON, for scripts",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print each config's predicted peak memory per GPU (as `lpbench memory`) and stop",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="take settings from a TOML or YAML file of flag names and values (a sweep spec's keys; "
        "precision may be a list); flags given on the command line win",
    )


def sized_to_data(cfg, explicit: dict):
    """``cfg`` with the model's vocabulary resized to a prepared dataset's (its ``.lpbench.json`` note), as
    ``converge`` does, unless the vocabulary was set; one line on stderr says so."""
    from lpbench.data.loader import data_vocab
    from lpbench.models.registry import get_model_config

    if cfg.workload != "pretrain" or cfg.hf_checkpoint or "vocab_size" in explicit or cfg.vocab_size is not None:
        return cfg
    found = data_vocab(cfg.data)
    model_vocab = get_model_config(cfg.model).vocab_size
    if found is None or found[0] == model_vocab:
        return cfg
    from lpbench.parallel.env import is_main_process

    if is_main_process():  # a stale RANK in the shell is not a launch
        print(
            f"lpbench: model {cfg.model}'s vocabulary of {model_vocab} resized to the data's {found[0]} "
            f"(from {found[1]})",
            file=sys.stderr,
        )
    return cfg.with_(vocab_size=found[0])


def configs_from_args(args, world_size: int | None = None) -> list[RunConfig]:
    """Validated configs, one per precision, for ``world_size`` ranks (default: this launch's)."""
    from lpbench.bench.recommended import recommended_defaults
    from lpbench.config import DEFAULT_PRECISIONS, RunConfig, config_kwargs, fact, flag_fields, spread
    from lpbench.models.hf import hf_label
    from lpbench.parallel.launch import planned_world
    from lpbench.bench.runner import validated

    if args.config:
        from lpbench.bench.run_file import apply_config_file

        apply_config_file(args)  # the file's values for the flags the command line left unset
    explicit = config_kwargs(args)
    if "model" not in explicit and args.hf_checkpoint:
        explicit["model"] = hf_label(args.hf_checkpoint)
    world = world_size or planned_world(args.nproc_per_node)
    defaults = RunConfig()
    recommended = recommended_defaults(
        args.gpu,
        args.num_gpus,
        model=explicit.get("model", defaults.model),
        workload=explicit.get("workload", defaults.workload),
        precision=(args.precision or [None])[0],
        explicit=explicit,
        world=world,
    )
    base = RunConfig(**{**recommended, **explicit})  # explicit flags > the recommended config > RunConfig's defaults
    base = base.with_world(world, dp=args.dp)
    base = sized_to_data(base, explicit)
    if base.tensorboard is not None:  # before any work: the optional package is there, or one line says how
        from lpbench.metrics.tensorboard import require_tensorboard

        check_dir(base.tensorboard, "--tensorboard")
        require_tensorboard()
    if base.wandb is not None:
        from lpbench.metrics.tensorboard import require_wandb

        require_wandb()
    if args.precision is None:  # the default comparison runs anywhere: emulate what the device lacks
        base = base.with_(emulate=True if args.emulate is None else args.emulate)
    precisions = args.precision or DEFAULT_PRECISIONS
    if len(precisions) > 1 and (args.save_dir or args.load or args.export_hf):
        raise UsageError(f"--save-dir, --load and --export-hf take a single --precision, not {','.join(precisions)}")
    lists = {f.name: getattr(args, f.name, None) for f in flag_fields() if fact(f, "many")}
    configs = spread(base, {**lists, "precision": list(precisions)})
    if len(configs) > len(precisions) and (args.save_dir or args.load or args.export_hf):
        raise UsageError("--save-dir, --load and --export-hf take one run, not a comma-separated list of settings")
    return [validated(cfg) for cfg in configs]


def cmd_run(args) -> int:
    from lpbench.bench.progress import RunsProgress, next_command, step_costs
    from lpbench.bench.runner import end_if_stranded, execute, record
    from lpbench.config import run_labels
    from lpbench.bench.store import open_store
    from lpbench.report.tables import summary_rows, to_json, to_rich
    from lpbench.parallel.env import detect_world, shutdown
    from lpbench.parallel.launch import needs_relaunch, relaunch

    if args.dry_run:
        return cmd_memory(args)
    configs = configs_from_args(args)  # validate every config before any work starts
    check_dir(args.results, "--results")
    if args.json:
        check_file(args.json, "--json")
    if args.save_dir:
        check_dir(args.save_dir, "--save-dir")
    if args.export_hf:
        check_export_dir(args.export_hf, "--export-hf")
    if needs_relaunch(args.nproc_per_node):
        return relaunch(args.nproc_per_node)
    is_main = detect_world().is_main  # only rank 0 writes the database and prints the table
    # an existing database is opened now, so that its problems are known before training (a database that
    # cannot be written keeps the runs in pending-runs/); a new one is made at the first result, so that a
    # run rejected on the way creates none
    store = open_store(args.results, create=False) if is_main else None
    group = uuid.uuid4().hex[:12]
    statuses = []
    with RunsProgress(
        console, list(zip(run_labels(configs), (cfg.steps for cfg in configs))), step_costs(configs), enabled=is_main
    ) as progress:
        for i, cfg in enumerate(configs):
            progress.start(i)
            result = execute(cfg, results_dir=args.results, on_step=progress.step)
            statuses.append(result.status)
            if is_main:
                store = store or open_store(args.results)
                record(store, result, group_id=group)
                progress.finish(i, result.status)
            end_if_stranded(result)  # after rank 0 recorded it
    shutdown()
    if not is_main:
        return 0 if all(s == "ok" for s in statuses) else 1
    rows = summary_rows(store.runs("group_id = ?", (group,)) + [r for r in store.kept if r["group_id"] == group])
    console.print(to_rich(rows, title=f"lpbench run {group} -> {store.path}", wide=args.wide))
    if args.json:
        write_file(args.json, to_json(rows) + "\n")
    console.print(escape(next_command(args.results, group)), highlight=False, soft_wrap=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def cmd_memory(args) -> int:
    """``lpbench memory`` (and ``run --dry-run``): each config's predicted peak per GPU, whether it fits
    ``--gpu``, and what would make it fit. Exit 1 if one does not fit."""
    from lpbench.train.memory_plan import report

    world = args.nproc_per_node or args.num_gpus or 1
    gpu = args.gpu
    try:
        configs = configs_from_args(args, world_size=world)
    except UsageError as exc:  # --gpu names the memory to fit even where it has no recommended config
        if gpu is None or "recommended" not in str(exc):
            raise
        args.gpu = args.num_gpus = None
        configs = configs_from_args(args, world_size=world)
    fits = []
    for cfg in configs:
        lines, fit = report(cfg, gpu)
        fits.append(fit)
        for line in lines:
            console.print(escape(line), highlight=False, soft_wrap=True)
    return 1 if False in fits else 0


# ----------------------------------------------------------------------------- report
def cmd_report(args) -> int:
    from lpbench.bench.store import ResultsStore
    from lpbench.report.build import run_report

    return run_report(args, lambda: [ResultsStore(d, create=False) for d in args.results or ["lpbench-results"]])


# ----------------------------------------------------------------------------- flops
def cmd_flops(args) -> int:
    from lpbench.metrics.flops import days_to_train, flops_per_token, tflops_per_gpu
    from lpbench.models.registry import first_blocks, get_model_config, model_label

    if args.seq_len <= 0 or args.num_gpus <= 0 or not (math.isfinite(args.tokens) and args.tokens > 0):
        raise UsageError("--seq-len, --num-gpus and --tokens must be positive")
    model = first_blocks(get_model_config(args.model), args.num_layers)
    label = model_label(args.model, args.num_layers)
    fpt = flops_per_token(model, args.seq_len, args.flops_formula)
    out = {
        "model": label,
        "seq_len": args.seq_len,
        "formula": args.flops_formula,
        "flops_per_token": fpt,
        "flops_per_sample": fpt * args.seq_len,
    }
    if args.tokens_per_sec_per_gpu is not None:
        if not (math.isfinite(args.tokens_per_sec_per_gpu) and args.tokens_per_sec_per_gpu > 0):
            raise UsageError("--tokens-per-sec-per-gpu must be positive")
        out.update(
            tokens_per_sec_per_gpu=args.tokens_per_sec_per_gpu,
            num_gpus=args.num_gpus,
            tflops_per_gpu=tflops_per_gpu(fpt, args.tokens_per_sec_per_gpu),
            tokens=args.tokens,
            days_to_train=days_to_train(args.tokens, args.tokens_per_sec_per_gpu, args.num_gpus),
        )
    if args.json:
        print(json.dumps(out))
        return 0
    console.print(f"{label} at seq {args.seq_len}, formula {args.flops_formula} (forward + backward):")
    console.print(f"  FLOPs per token : {fpt:.4e}")
    console.print(f"  FLOPs per sample: {fpt * args.seq_len:.4e}")
    if "tflops_per_gpu" in out:
        console.print(f"  {args.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU -> {out['tflops_per_gpu']:,.1f} TFLOP/s/GPU")
        console.print(f"  {args.tokens:.3g} tokens on {args.num_gpus} GPU(s): {out['days_to_train']:,.2f} days")
    return 0


# ----------------------------------------------------------------------------- models / recipes
def _show(rows: list[dict], as_json: bool, title: str, columns: dict, cells) -> int:
    """``rows`` as indented JSON, or as a table of ``columns`` (name: add_column options) and ``cells(row)``."""
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=title)
    for col, options in columns.items():
        table.add_column(col, **options)
    for r in rows:
        table.add_row(*cells(r))
    console.print(table)
    return 0


def cmd_models(args) -> int:
    from lpbench.models import MODELS, build_model, count_active_parameters, count_parameters

    rows = []
    for cfg in MODELS.values():
        model = build_model(cfg, device="meta")
        params, active = count_parameters(model), count_active_parameters(model)
        notes = [cfg.norm + "norm", cfg.activation, cfg.positions]
        notes += [f"rope {cfg.rope_fraction:.0%}"] if cfg.rope_fraction != 1 else []
        notes += ["qk-norm"] if cfg.qk_norm else []
        notes += ["tied"] if cfg.tie_embeddings else []
        notes += [f"MoE {cfg.n_experts}x top-{cfg.top_k} ({cfg.router} routing)"] if cfg.n_experts else []
        row = {"name": cfg.name, "layers": cfg.n_layers, "hidden": cfg.dim, "ffn": cfg.ffn_dim, "heads": cfg.n_heads}
        row |= {"kv_heads": cfg.n_kv_heads, "head_dim": cfg.hd, "vocab": cfg.vocab_size, "max_seq_len": cfg.max_seq_len}
        rows.append({**row, "params": params, "active_params": active, "notes": ", ".join(notes)})
    cols = ("name", "layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab")

    def size(p):
        return f"{p / 1e9:.2f} B" if p >= 1e8 else f"{p / 1e6:.1f} M"

    return _show(
        rows,
        args.json,
        "lpbench models (parameters counted on the meta device)",
        {c: {} for c in (*cols, "params", "active", "notes")},
        lambda r: (*(str(r[c]) for c in cols), size(r["params"]), size(r["active_params"]), r["notes"]),
    )


def cmd_recipes(args) -> int:
    import dataclasses

    import torch

    from lpbench.precision.capability import native_supported
    from lpbench.precision.recipes import RECIPES

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for r in RECIPES.values():
        params = {
            f.name: getattr(r, f.name)
            for f in dataclasses.fields(r)
            if f.name not in ("name", "description") and getattr(r, f.name) != f.default
        }
        path = "native" if native_supported(r, device) else "emulated"
        params = {k: str(v).replace("torch.", "") for k, v in params.items()}
        rows.append({"name": r.name, "path": path, "params": params, "description": r.description})
    return _show(
        rows,
        args.json,
        f"lpbench precision recipes (path on this device: {where})",
        {c: {"overflow": "fold"} for c in ("name", "path", "parameters", "description")},
        lambda r: (
            r["name"],
            r["path"],
            ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-",
            r["description"],
        ),
    )


def cmd_quant_error(args) -> int:
    from lpbench.precision import DISTRIBUTIONS, ROLES, quant_error_table
    from lpbench.precision.recipes import get_recipe

    recipes = args.precision or None
    for name in recipes or []:
        get_recipe(name)
    for role in args.role or []:
        if role not in ROLES:
            raise UsageError(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
    for dist in args.distribution or []:
        if dist not in DISTRIBUTIONS:
            raise UsageError(f"unknown distribution {dist!r}; valid: {', '.join(DISTRIBUTIONS)}")
    if len(args.shape) != 2 or min(args.shape) <= 0:
        raise UsageError("--shape takes two positive integers, e.g. --shape 512 1024")
    if args.shape[0] * args.shape[1] > MAX_QUANT_ERROR_ELEMENTS:
        raise UsageError(
            f"--shape {args.shape[0]} {args.shape[1]}: more than {MAX_QUANT_ERROR_ELEMENTS:,} elements "
            "(a sample tensor, not a model)"
        )
    try:
        rows = quant_error_table(
            recipes, args.role or ROLES, args.distribution or DISTRIBUTIONS, shape=tuple(args.shape), seed=args.seed
        )
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "alloc" not in str(exc).lower():
            raise
        raise UsageError(
            f"--shape {args.shape[0]} {args.shape[1]}: not enough memory for it; pick a smaller shape"
        ) from None
    except ValueError as exc:  # a block that does not divide --shape (NVFP4 pads; the others do not)
        raise UsageError(f"{exc}; pick a --shape the recipes' blocks divide, or fewer --precision") from None
    return _show(
        rows,
        args.json,
        f"quantization error on {args.shape[0]}x{args.shape[1]} tensors (blocks along the last dim)",
        {
            "distribution": {},
            "recipe": {},
            "role": {},
            "relative error": {"justify": "right"},
            "SQNR dB": {"justify": "right"},
        },
        lambda r: (r["distribution"], r["recipe"], r["role"], f"{r['rel_error']:.3e}", f"{r['sqnr_db']:.1f}"),
    )


# ----------------------------------------------------------------------------- slurm
def cmd_slurm(args) -> int:
    from lpbench.parallel.slurm import sbatch_script

    if args.nodes <= 0 or args.gpus_per_node <= 0:
        raise UsageError("--nodes and --gpus-per-node must be positive")
    check_file(args.output, "--output")
    run_args = [a for i, a in enumerate(args.run_args) if not (i == 0 and a == "--")]
    if any(a.startswith("--nproc-per-node") for a in run_args):
        raise UsageError("leave --nproc-per-node out of the run flags: the script launches the processes")
    run_parser = Parser(prog="lpbench slurm ... -- <lpbench run flags>")
    add_run_args(run_parser)
    parsed = run_parser.parse_args(run_args)
    cfg = configs_from_args(parsed, world_size=args.nodes * args.gpus_per_node)[0]
    run_args += layout_flags(parsed, cfg)
    options = ("nodes", "gpus_per_node", "launcher", "container", "container_mounts", "job_name", "time", "partition")
    script = sbatch_script(run_args, **{k: getattr(args, k) for k in (*options, "account")})
    write_file(args.output, script)
    print(
        f"wrote {args.output}: {args.nodes} node(s) x {args.gpus_per_node} GPU(s), {args.launcher} launch\n"
        f"submit it with: sbatch {shlex.quote(args.output)}"
    )
    return 0


# written out when --gpu chose them (those RunConfig has)
SLURM_LAYOUT = ("tp", "pp", "vp", "pp_schedule", "cp", "ep", "fsdp", "fsdp_shard")


def layout_flags(args, cfg) -> list[str]:
    """With ``--gpu``: the recommended layout's flags that the run flags left to the row, so the script states
    the layout it runs (and a later change of the table changes no written script)."""
    from lpbench.config import config_kwargs

    if args.gpu is None:
        return []
    explicit = config_kwargs(args)
    flag = lambda name, value: (  # noqa: E731
        [f"--{'' if value else 'no-'}{name}"] if isinstance(value, bool) else [f"--{name}", str(value)]
    )
    return [
        part
        for name in SLURM_LAYOUT
        if name not in explicit and getattr(cfg, name, None) is not None
        for part in flag(name.replace("_", "-"), getattr(cfg, name))
    ]


def add_slurm_parser(sub) -> None:
    from lpbench.parallel.slurm import LAUNCHERS

    p = sub.add_parser(
        "slurm",
        help=COMMANDS["slurm"][0],
        description="Write an sbatch script; the flags after -- are passed to `lpbench run`.",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (processes) per node")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="torchrun",
        help="torchrun: one task per node running torchrun (default); srun: one task per GPU",
    )
    p.add_argument("--container", metavar="IMAGE", help="run in this container image (Pyxis --container-image)")
    p.add_argument("--container-mounts", help="Pyxis --container-mounts (default: the submit directory)")
    p.add_argument("--job-name", default="lpbench", help="job name, also the log file's prefix (default lpbench)")
    p.add_argument("--time", help="time limit, e.g. 01:00:00")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--output", default="lpbench.sbatch", help="script file to write (default lpbench.sbatch)")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then the `lpbench run` flags")
    p.set_defaults(func=cmd_slurm)


# ----------------------------------------------------------------------------- main
def add_run_parser(sub) -> None:
    p = sub.add_parser("run", help=COMMANDS["run"][0])
    add_run_args(p)
    p.set_defaults(func=cmd_run)


def add_memory_parser(sub) -> None:
    p = sub.add_parser("memory", help=COMMANDS["memory"][0])
    add_run_args(p)
    p.set_defaults(func=cmd_memory)


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help=COMMANDS["report"][0])
    p.add_argument(
        "--results",
        action="append",
        metavar="DIR",
        help="results folder (default ./lpbench-results); repeat it to report several databases together",
    )
    p.add_argument(
        "--format",
        choices=["md", "csv", "json"],
        default="md",
        help="stdout format: md (one table per workload + time to train 1T tokens), or csv/json "
        "(one flat row per run) (default md)",
    )
    p.add_argument("--html", metavar="FILE", help="also write one self-contained HTML page (tables + plots)")
    p.add_argument("--plots", metavar="DIR", help="also write the PNG plots into DIR")
    p.add_argument(
        "--group",
        action="append",
        metavar="ID",
        help="only runs of this sweep id or `lpbench run` group id (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="list the groups (id, when, runs, what differs between them) instead of the tables",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="md only: every column, however wide (default: the columns that differ between runs)",
    )
    p.set_defaults(func=cmd_report)


def add_flops_parser(sub) -> None:
    from lpbench.config import add_config_args

    p = sub.add_parser("flops", help=COMMANDS["flops"][0])
    p.add_argument("--model", required=True, help="model name from `lpbench models`")
    p.add_argument("--num-layers", type=int, default=None, metavar="N", help="count the first N blocks only")
    p.add_argument("--seq-len", type=int, required=True, help="sequence length")
    add_config_args(p, ["flops_formula"], defaults={})  # --flops-formula, or --formula as before
    p.add_argument("--tokens-per-sec-per-gpu", type=float, help="measured throughput to convert")
    p.add_argument("--num-gpus", type=int, default=1, help="GPU count for time-to-train (default 1)")
    p.add_argument("--tokens", type=float, default=1e12, help="tokens for time-to-train (default 1e12)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_flops)


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help=COMMANDS["models"][0])
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)


def add_recipes_parser(sub) -> None:
    p = sub.add_parser("recipes", help=COMMANDS["recipes"][0])
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_recipes)


def add_quant_error_parser(sub) -> None:
    p = sub.add_parser("quant-error", help=COMMANDS["quant-error"][0])
    p.add_argument("--precision", type=csv_list, help="recipes to compare (default: all)")
    p.add_argument("--role", type=csv_list, help="operand roles: input, weight, grad (default: all)")
    p.add_argument("--distribution", type=csv_list, help="gaussian, student-t, outlier-channel (default: all)")
    p.add_argument("--shape", type=int, nargs="+", default=[512, 1024], help="tensor shape (default 512 1024)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_quant_error)


COMMANDS = {  # name: (its line in `lpbench --help`, what adds its parser: a function, or a module's add_parser)
    "run": ("train one or more precisions on the same work and compare them", add_run_parser),
    "sweep": ("run a grid of configs from a YAML spec, one subprocess per run, resumable", "lpbench.bench.sweep"),
    "converge": (
        "train several precisions on the same real data and compare their validation loss with the "
        "first (pass/fail per tolerance)",
        "lpbench.bench.converge",
    ),
    "report": ("tables (NeMo style), plots and an HTML page from the results database", add_report_parser),
    "memory": (
        "predicted peak memory per GPU of a run (the `run` flags; world size from --num-gpus or "
        "--nproc-per-node), whether it fits --gpu, what would fit",
        add_memory_parser,
    ),
    "flops": ("model FLOPs per token/sample, TFLOP/s for a throughput, days to train", add_flops_parser),
    "models": ("list the model zoo with parameter counts", add_models_parser),
    "recipes": ("list the precision recipes, their parameters and native/emulated here", add_recipes_parser),
    "quant-error": ("relative error and SQNR of each recipe's quantizer on test tensors", add_quant_error_parser),
    "slurm": ("write an sbatch script for a multi-node `lpbench run`", add_slurm_parser),
    "data": ("prepare datasets and tokenizers", "lpbench.data.prepare"),
}


def build_parser(command: str | None = None) -> Parser:
    """The CLI's parser: every command's flags, or only ``command``'s (the others listed by name and help)."""
    parser = Parser(
        prog="lpbench",
        description="Pretrain, fine-tune and benchmark decoder LLMs in BF16, FP8, MXFP8 and NVFP4, "
        "side by side: throughput, memory and whether each precision still learns.",
        epilog="Start with `lpbench run` (the tiny model in four precisions, then a summary table); "
        "`lpbench COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"lpbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, required=True)
    for name, (help_text, add) in COMMANDS.items():
        if command not in (None, name):
            sub.add_parser(name, help=help_text)
        elif callable(add):
            add(sub)
        else:
            importlib.import_module(add).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except OSError as exc:
        code = stdout_failed(exc)
        if code is None:
            raise
        return code


def _main(argv: list[str] | None) -> int:
    usable_streams()
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no valued option
    parser = build_parser(command if command in COMMANDS else "")
    if not argv:  # as every CLI: bare `lpbench` explains itself; `lpbench run` is the main job
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:  # sub-parsers that raise on bad arguments (lpbench data ...)
        print(f"{exc} (see --help)", file=sys.stderr)
        return 2
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()  # only it may set a signal handler
    previous = signal.signal(signal.SIGTERM, raise_terminated) if main_thread else None
    try:
        code = args.func(args)
        sys.stdout.flush()  # a broken pipe or a full /dev/full is found here, not at exit
        return code
    except UsageError as exc:
        from lpbench.parallel.env import is_main_process

        if is_main_process():  # every rank of a launch has the same bad input: say it once
            print(f"lpbench {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print("lpbench: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("lpbench: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

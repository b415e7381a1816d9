"""``lpbench converge``: does each precision still learn like the first one, on real data?

Every recipe trains the same model from the same seed on the same data in the same order for
the same number of tokens (steps = tokens / (GBS x seq_len)); the held-out validation loss is
measured every K steps and at the last. Each recipe's final validation loss is compared with
the first recipe's: gap = (loss - reference) / reference, and the recipe passes when the gap is
at most its tolerance (its recipe's ``tolerance``: FP8 recipes and MXFP8 0.5%, FP4 recipes 1.5%;
``--tolerance`` overrides by name or family prefix). A run whose
loss turns NaN/Inf stops there and is reported as diverged; the others go on.
``--ablate rht,sr,2d,bf16-tail`` adds one NVFP4 run per ingredient switched off
(``nvfp4-no-rht``, ...; :data:`lpbench.precision.recipes.ABLATIONS`). ``--noise-seeds K`` runs
the reference K more times with other seeds (other init and data order): their gaps are the
seed-to-seed noise that the recipes' gaps are to be read against.

``--save-every K --save-dir DIR`` checkpoints each run every K steps into ``DIR/<run>/step-K``
(``<run>``: the recipe, ``bf16-seed1235`` for a noise-seed run), in ``lpbench run``'s format
(:mod:`lpbench.train.checkpoint`); ``--load DIR`` resumes every run from its latest checkpoint there
and continues exactly where it stopped: weights, optimizer, LR schedule, data position, RNG, and
the curve recorded so far, so the table and the plot cover the whole run.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from lpbench.config import (
    DEFAULT_PRECISIONS,
    RunConfig,
    add_config_args,
    config_kwargs,
    fact,
    flag_fields,
    run_labels,
    settings,
    spread,
)
from lpbench.console import csv_list
from lpbench.errors import UsageError
from lpbench.paths import check_dir, check_file, write_file

TRAIN_WINDOW = 10  # the "final train loss" is the mean over this many last steps
ABLATION_BASE = "nvfp4"


@dataclass
class Outcome:
    """One recipe's result as the table shows it."""

    precision: str
    status: str
    path: str | None = None
    error: str | None = None
    diverged_step: int | None = None
    train_loss: float | None = None  # mean of the last TRAIN_WINDOW steps
    val_loss: float | None = None  # at the last evaluation
    gap_pct: float | None = None  # relative to the reference's, in %
    tolerance: float | None = None
    verdict: str = ""
    steps: list[dict] = field(default_factory=list)
    seed: int | None = None  # set on a --noise-seeds run of the reference
    name: str = ""  # the run's label (run_labels) when it differs from the precision

    @property
    def label(self) -> str:
        name = self.name or self.precision
        return name if self.seed is None else f"{name} @ seed {self.seed}"

    @property
    def status_text(self) -> str:
        return f"diverged @ step {self.diverged_step}" if self.status == "diverged" else self.status


def parse_tolerances(text: str | None) -> dict[str, float]:
    """``"fp8=0.5,nvfp4=1.5"``: tolerances (percent) by recipe name or family prefix, over the recipes' own."""
    out = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        try:
            pct = float(value.rstrip("%"))
        except ValueError:
            pct = -1.0
        if not sep or not key.strip() or not 0 <= pct < math.inf:
            raise UsageError(f"--tolerance takes NAME=PERCENT pairs (e.g. fp8=0.5,nvfp4=1.5), got {item!r}")
        out[key.strip()] = pct
    return out


def tolerance_for(precision: str, tolerances: dict[str, float] | None = None) -> float | None:
    """The tolerance of the longest key of ``tolerances`` equal to ``precision`` or a dash-prefix of it
    (``fp8`` covers ``fp8-delayed``, ``nvfp4`` covers ``nvfp4-no-rht``), else the recipe's own
    (``Recipe.tolerance``; an ablation keeps its base's); None for a recipe without one (bf16, fp32)."""
    from lpbench.precision.recipes import get_recipe

    keys = [k for k in tolerances or {} if precision == k or precision.startswith(k + "-")]
    return tolerances[max(keys, key=len)] if keys else get_recipe(precision).tolerance


def judge(outcomes: list[Outcome], tolerances: dict[str, float]) -> str:
    """Fill each outcome's gap, tolerance and verdict against the first; return the loss compared."""
    use_val = any(o.val_loss is not None for o in outcomes)
    metric = "val_loss" if use_val else "train_loss"
    ref = outcomes[0]
    ref_loss = getattr(ref, metric) if ref.status == "ok" else None
    for i, o in enumerate(outcomes):
        o.tolerance = None if i == 0 or o.seed is not None else tolerance_for(o.precision, tolerances)
        loss = getattr(o, metric)
        if o.status != "ok":
            o.verdict = o.status_text if o.status == "diverged" else o.status
        elif ref_loss is None or loss is None or not math.isfinite(loss):
            o.verdict = "no reference" if i else "reference failed"
        else:
            o.gap_pct = (loss - ref_loss) / ref_loss * 100
            if i == 0 or o.seed is not None or o.tolerance is None:
                o.verdict = "reference" if i == 0 else "seed noise" if o.seed is not None else "no tolerance"
            else:
                o.verdict = "pass" if o.gap_pct <= o.tolerance else "fail"
    return metric


def noise_floor(outcomes: list[Outcome]) -> float | None:
    """The largest |gap| of the reference's runs with other seeds (%), None without any."""
    gaps = [abs(o.gap_pct) for o in outcomes if o.seed is not None and o.gap_pct is not None]
    return max(gaps) if gaps else None


def outcome_of(result) -> Outcome:
    """An :class:`Outcome` from a :class:`lpbench.train.loop.RunResult` (a resumed run's whole curve)."""
    steps = result.history + result.steps
    losses = [s["loss"] for s in steps]
    window = losses[-TRAIN_WINDOW:]
    vals = [s["val_loss"] for s in steps if "val_loss" in s]
    return Outcome(
        precision=result.config.precision,
        status=result.status,
        path=result.metrics.get("path"),
        error=result.error,
        diverged_step=steps[-1]["step"] if result.status == "diverged" else None,
        train_loss=sum(window) / len(window) if window and result.status == "ok" else None,
        val_loss=vals[-1] if vals and result.status == "ok" else None,
        steps=steps,
    )


def run_name(cfg: RunConfig, reference_seed: int, label: str | None = None) -> str:
    """A run's folder under --save-dir and --load: its recipe (its label, ``fp8-tensorwise-optimizer-states-bf16``,
    where runs of one recipe differ in other settings), ``-seedN`` for a noise-seed run."""
    name = (label or cfg.precision).replace(", ", "-").replace(" ", "-")
    return name if cfg.seed == reference_seed else f"{name}-seed{cfg.seed}"


def with_checkpoints(configs: list[RunConfig], args) -> list[RunConfig]:
    """Each run's --save-dir and --load folder (``DIR/<run>``), its checkpoint checked before any work."""
    from lpbench.bench.runner import validated

    out = []
    for cfg, label in zip(configs, run_labels(configs)):
        name = run_name(cfg, configs[0].seed, label)
        if args.save_every or args.save_dir:
            cfg = cfg.with_(save_every=args.save_every or 0, save_dir=args.save_dir and str(Path(args.save_dir) / name))
        if args.load:
            folder = Path(args.load) / name
            if not folder.is_dir():
                raise UsageError(
                    f"--load {args.load}: no checkpoint of {name} (no folder {folder}); --load resumes "
                    "every run given, so name only the runs saved there"
                )
            cfg = cfg.with_(load=str(folder))
        out.append(validated(cfg))
    return out


def expand_precisions(precisions: list[str], ablate: list[str]) -> list[str]:
    """The recipes to run: ``precisions`` then ``nvfp4-no-<x>`` per ablated ingredient (validated)."""
    from lpbench.precision.recipes import get_recipe

    names = list(dict.fromkeys(list(precisions) + [f"{ABLATION_BASE}-no-{a}" for a in ablate]))
    for name in names:
        get_recipe(name)
    return names


def resolve_data(args, model_vocab: int):
    """(``--data`` for every run, its :class:`DataSplits`, lines saying what was done).

    Raw text is tokenized once into a Megatron dataset under ``RESULTS/converge-data/`` (with
    ``--tokenizer``, or a byte-level BPE trained on it, or bytes for ``--tokenizer byte``).
    """
    from lpbench.data.loader import MOCK_KINDS, build_dataset

    if args.data in MOCK_KINDS:
        if args.tokenizer:
            raise UsageError("--tokenizer applies to real data, not --data mock")
        splits = build_dataset(args.data, seq_len=args.seq_len, seed=args.seed, vocab_size=model_vocab)
        return args.data, splits, []
    raw = Path(args.data).exists() and not args.data.endswith((".bin", ".idx"))
    trained = raw and args.tokenizer is None
    vocab = args.vocab_size or model_vocab
    splits = build_dataset(
        args.data,
        args.tokenizer,
        seq_len=args.seq_len,
        seed=args.seed,
        train_vocab_size=vocab if trained else None,
        cache_dir=Path(args.results) / "converge-data" if raw else None,
    )
    lines = splits.describe().splitlines()
    if trained:
        lines.insert(
            1,
            f"tokenizer: none given, so a byte-level BPE (vocab {vocab} requested) was trained on "
            f"{args.data} itself (pass --tokenizer tokenizer.json or --tokenizer byte to choose)",
        )
    return splits.prefix, splits, lines


def build_configs(args) -> tuple[list[RunConfig], list[str]]:
    """Validated configs, one per recipe, and the data description."""
    from lpbench.models import get_model_config
    from lpbench.precision.capability import native_supported
    from lpbench.precision.recipes import get_recipe
    from lpbench.train.loop import eval_batch_count, resolve_device

    if not (math.isfinite(args.tokens) and args.tokens > 0):
        raise UsageError(f"--tokens must be a positive number, got {args.tokens}")
    if args.noise_seeds < 0:
        raise UsageError(f"--noise-seeds must be >= 0, got {args.noise_seeds}")
    model_vocab = get_model_config(args.model).vocab_size
    names = expand_precisions(args.precision, args.ablate or [])
    device = resolve_device(args.device)
    lacking = [n for n in names if not args.emulate and not native_supported(get_recipe(n), device)]
    if lacking:
        raise UsageError(f"{', '.join(lacking)} cannot run natively on {device}: drop --no-emulate")
    base = RunConfig(**config_kwargs(args, settings("converge")))
    tokens_per_step = base.gbs * base.seq_len
    steps = int(args.tokens) // tokens_per_step
    if steps < 1:
        raise UsageError(f"--tokens {args.tokens:g} is less than one step of GBS x seq_len = {tokens_per_step}")
    eval_every = args.eval_every if args.eval_every is not None else max(1, steps // 10)
    base = base.with_(steps=steps, eval_every=eval_every)  # warm-up follows the steps
    base.validate()  # sizes and names, before the data is touched
    data, splits, lines = resolve_data(args, model_vocab)
    if splits.vocab_size != model_vocab:
        base = base.with_(vocab_size=splits.vocab_size)
        lines.append(f"model: {args.model}'s vocabulary of {model_vocab} resized to the data's {splits.vocab_size}")
    base = base.with_(data=data)
    if eval_every:
        n = eval_batch_count(base, splits.valid)
        lines.append(
            f"validation: {n * args.mbs} held-out sequences of {args.seq_len} tokens "
            f"(of {len(splits.valid)} in the split) every {eval_every} steps and at step {steps}"
        )
    lists = {f.name: getattr(args, f.name, None) for f in flag_fields(settings("converge")) if fact(f, "many")}
    configs = [cfg.validate() for cfg in spread(base, {**lists, "precision": names})]
    configs += [configs[0].with_(seed=base.seed + i) for i in range(1, args.noise_seeds + 1)]
    return with_checkpoints(configs, args), lines


def cmd_converge(args) -> int:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from lpbench.bench.progress import RunsProgress, next_command, step_costs
    from lpbench.bench.runner import execute, record
    from lpbench.bench.store import open_store
    from lpbench.console import console
    from lpbench.report.plots import convergence_curves
    from lpbench.report.tables import precision_name

    tolerances = parse_tolerances(args.tolerance)
    check_dir(args.results, "--results")
    if args.plot:
        check_file(args.plot, "--plot")
    if args.save_dir:
        check_dir(args.save_dir, "--save-dir")
    configs, data_lines = build_configs(args)
    first = configs[0]
    tokens = first.steps * first.gbs * first.seq_len
    console.print(
        f"lpbench converge: {escape(first.label)}, {len(configs)} runs x {first.steps} steps x "
        f"{first.gbs * first.seq_len:,} tokens = {tokens:,} tokens each (asked {args.tokens:,.0f}); "
        f"same seed ({first.seed}), same data order",
        highlight=False,
    )
    for line in data_lines:
        console.print(f"  {escape(line)}", highlight=False)
    store = open_store(args.results)
    group = uuid.uuid4().hex[:12]
    outcomes = []
    names = run_labels(configs)
    labels = [name if cfg.seed == first.seed else f"{name} @ seed {cfg.seed}" for name, cfg in zip(names, configs)]
    with RunsProgress(
        console, [(label, cfg.steps) for label, cfg in zip(labels, configs)], step_costs(configs)
    ) as progress:
        for i, cfg in enumerate(configs):
            progress.start(i)
            result = execute(cfg, results_dir=args.results, on_step=progress.step)
            progress.finish(i, result.status)
            outcome = outcome_of(result)
            outcome.seed = cfg.seed if cfg.seed != first.seed else None
            outcome.name = names[i]
            outcomes.append(outcome)
            metrics = dict(
                result.metrics,
                diverged_step=outcome.diverged_step,
                train_loss=outcome.train_loss,
                train_loss_steps=TRAIN_WINDOW,
                val_losses=[[s["step"], s["val_loss"]] for s in outcome.steps if "val_loss" in s],
            )
            record(store, replace(result, steps=outcome.steps), group_id=group, workload="converge", metrics=metrics)
            console.print(
                f"lpbench converge: {escape(outcome.label)}: {escape(outcome.status_text)}, train loss "
                f"{_fmt(outcome.train_loss)}, validation loss {_fmt(outcome.val_loss)}",
                highlight=False,
            )
    metric = judge(outcomes, tolerances)
    ref = outcomes[0].name if outcomes[0].name != outcomes[0].precision else precision_name(outcomes[0].precision)
    table = Table(title=Text(f"lpbench converge {group}: {first.label}, {tokens:,} tokens per recipe"))
    window = min(TRAIN_WINDOW, first.steps)
    numbers = (f"train loss (last {window})", "val loss", f"gap vs {ref}", "tolerance")
    for col in ("recipe", "path", "status", *numbers, "verdict"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for o in outcomes:
        colour = {"pass": "green", "fail": "red"}.get(o.verdict, "red" if o.status != "ok" else "")
        table.add_row(
            Text(o.label),
            o.path or "-",
            Text(o.status_text),
            _fmt(o.train_loss),
            _fmt(o.val_loss),
            "-" if o.gap_pct is None else f"{o.gap_pct:+.2f}%",
            "-" if o.tolerance is None else f"{o.tolerance:g}%",
            f"[{colour}]{o.verdict}[/{colour}]" if colour else o.verdict,
        )
    console.print(table)
    console.print(
        f"gap = ({'validation' if metric == 'val_loss' else 'train'} loss - {ref}'s) / {ref}'s"
        + ("" if metric == "val_loss" else " (no validation: --eval-every 0)")
        + f"; pass when gap <= tolerance. Train loss: mean of the last {window} steps.",
        highlight=False,
    )
    noise = noise_floor(outcomes)
    if noise is not None:
        console.print(
            f"seed noise: {ref} with other seeds lands up to {noise:.2f}% from seed {first.seed}; "
            f"gaps within ±{noise:.2f}% are not resolved by this budget",
            highlight=False,
        )
    plot = Path(args.plot or Path(args.results) / f"converge-{group}.png")
    png = convergence_curves(
        [_plot_run(o, first) for o in outcomes],
        title=f"{first.label} · {tokens:,} tokens per recipe · "
        f"GBS {first.gbs} × seq {first.seq_len} · seed {first.seed}",
    )
    write_file(plot, png)
    console.print(escape(f"plot: {plot}\nresults: {store.path} (group {group})"), highlight=False)
    console.print(escape(next_command(args.results, group)), highlight=False, soft_wrap=True)
    return 0 if all(o.verdict in ("reference", "pass", "no tolerance", "seed noise") for o in outcomes) else 1


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _plot_run(o: Outcome, cfg: RunConfig) -> dict:
    per_step = cfg.gbs * cfg.seq_len
    return {
        "precision": o.label,
        "status": o.status_text,
        "ok": o.status == "ok",
        "verdict": o.verdict,
        "tolerance": o.tolerance,
        "train": [(s["step"] * per_step, s["loss"]) for s in o.steps],
        "val": [(s["step"] * per_step, s["val_loss"]) for s in o.steps if "val_loss" in s],
    }


def add_parser(sub) -> None:
    """``lpbench converge`` on the CLI's sub-command parsers."""
    p = sub.add_parser(
        "converge",
        help="train several precisions on the same real data and compare their "
        "validation loss with the first (pass/fail per tolerance)",
        description="Train several precisions from the same seed on the same data for the same "
        "number of tokens; compare each one's validation loss with the first's.",
    )
    p.add_argument(
        "--ablate",
        type=csv_list,
        default=None,
        metavar="A,B",
        help="add one nvfp4 run per ingredient switched off: rht, sr, 2d, bf16-tail",
    )
    p.add_argument(
        "--tokens",
        type=float,
        default=100_000,
        help="training tokens per recipe; steps = tokens / (GBS x seq_len) (default 1e5)",
    )
    add_config_args(
        p,
        settings("converge"),
        defaults={"precision": list(DEFAULT_PRECISIONS), "emulate": True, "log_interval": 10, "eval_every": None},
        default_texts={"eval_every": "steps / 10; 0: none, judge by train loss"},
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json for raw text, or 'byte' (default: train a byte-level BPE on the data)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary of the BPE trained on raw text (default: the model's)"
    )
    p.add_argument(
        "--tolerance",
        default=None,
        metavar="NAME=PCT,...",
        help="tolerated gap in %% by recipe or family prefix, over each recipe's own (`lpbench "
        "recipes --json`: FP8 recipes and MXFP8 0.5, FP4 recipes 1.5)",
    )
    p.add_argument(
        "--noise-seeds",
        type=int,
        default=0,
        metavar="K",
        help="also run the reference with seeds SEED+1..SEED+K: its seed-to-seed gap is the noise "
        "floor to read the other gaps against (default 0)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="K",
        help="checkpoint every run every K steps into --save-dir/<run>/step-K (<run>: the recipe, or "
        "bf16-seed1235 for a --noise-seeds run) (default 0: never)",
    )
    p.add_argument("--save-dir", default=None, metavar="DIR", help="folder of --save-every's checkpoints")
    p.add_argument(
        "--load",
        default=None,
        metavar="DIR",
        help="resume every run from its latest checkpoint in DIR/<run>/ (a --save-dir of an earlier "
        "converge with the same flags) and continue it exactly: weights, optimizer, LR schedule, "
        "data position, RNG and the curve so far",
    )
    p.add_argument("--results", default="lpbench-results", help="results folder (default ./lpbench-results)")
    p.add_argument("--plot", default=None, metavar="FILE", help="loss-curve PNG (default RESULTS/converge-<group>.png)")
    p.set_defaults(func=cmd_converge)

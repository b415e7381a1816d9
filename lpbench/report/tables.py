"""Summary tables from result rows.

``summary_rows`` flattens stored runs into one row per run with its speedup and final-loss
delta against the BF16 run of its comparison group: the same invocation or sweep
(``group_id``), workload, model, sequence length, batch sizes, GPU count and type, parallel
layout and compilation, whatever the backend (torchao's rows are compared with lpbench's BF16
run). A group without an ok BF16 run is compared with its first ok run, and the row says
which (``baseline``). ``to_rich`` / ``to_markdown`` / ``to_csv`` / ``to_json`` render those
rows flat.

Timing is reported with its spread: each run stores its step-time quartiles (``step_time_p25_s``,
``step_time_p75_s``), the step time is shown with them, and a speedup with the interval they give
(baseline Q1 / run Q3 to baseline Q3 / run Q1); where the two runs' quartile ranges overlap it is
"within noise", not a speedup. Ratios measured on a CPU or with emulated GEMMs carry a mark (``†``)
and a note: they do not predict GPU speed.

``workload_tables`` and ``time_to_train_tables`` build the report's tables in the style of
NeMo's performance summary (one table per workload, the config cells written once per
comparison group, failures spelled out as "OOM") and of the Nemotron4 recipe's time-to-train
table; ``TextTable.to_markdown`` / ``to_html`` render them.
"""

from __future__ import annotations

import csv
import functools
import html
import io
import json
import math
from dataclasses import dataclass, field

from rich.table import Table

COLUMNS = [  # (key, header, format) of the flat table (lpbench run, sweep, --format md of old)
    ("model", "model", "{}"),
    ("precision", "precision", "{}"),
    ("path", "path", "{}"),
    ("batch", "GBS/MBS/seq", "{}"),
    ("num_gpus", "GPUs", "{}"),
    ("tp", "TP", "{}"),  # NeMo's layout columns
    ("pp", "PP", "{}"),
    ("vp", "VP", "{}"),
    ("cp", "CP", "{}"),
    ("step_time_ms", "step ms (IQR)", "{:.1f}"),
    ("tokens_per_sec_per_gpu", "tokens/s/GPU", "{:,.0f}"),
    ("tflops_per_gpu", "TFLOP/s/GPU", "{:.3g}"),
    ("mfu_bf16", "MFU", "{:.1%}"),
    ("peak_mem_gb", "peak mem GB", "{:.2f}"),
    ("predicted_peak_gb", "pred GB", "{:.1f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("status", "status", "{}"),
]
BASELINE = "bf16"
# a pipeline run's metrics the flat rows (csv, json) carry (lpbench.train.loop: pipeline_metrics)
PIPELINE_METRICS = (
    "pp_stage_blocks",
    "pp_bubble",
    "pp_bubble_ranks",
    "pp_bubble_theory",
    "pp_bubble_split",
)
TIME_TO_TRAIN_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TIME_TO_TRAIN_TOKENS = 1e12
WORKLOAD_TITLES = {
    "pretrain": "Pre-training",
    "sft": "Fine-tuning (SFT)",
    "lora": "Fine-tuning (LoRA)",
    "converge": "Convergence (lpbench converge: same tokens per precision)",
}


def precision_name(name: str | None) -> str:
    """A recipe's name in tables (``Recipe.display_name``); a name lpbench no longer knows as it is."""
    from lpbench.errors import UsageError
    from lpbench.precision.recipes import get_recipe

    try:
        return get_recipe(name).display_name if name else "?"
    except UsageError:
        return name


@functools.cache
def layout_keys(numbers_only: bool = False) -> tuple[str, ...]:
    """The settings declared ``layout`` (parallel layout and compilation: ``arg(layout=True)`` in
    lpbench/config.py); with ``numbers_only``, the sizes among them (TP, EP, DP ...)."""
    from dataclasses import fields

    from lpbench.config import RunConfig, fact, field_type

    return tuple(f.name for f in fields(RunConfig) if fact(f, "layout") and (not numbers_only or field_type(f) is int))


def layout_choices(r: dict) -> list[str]:
    """A row's layout settings beyond its sizes that differ from their defaults, as the run table names them:
    ``zero-bubble``, ``split even``, ``HSDP2``, ``zero1``, ``EP-chunks 2``, ``recompute selective/2``."""
    from lpbench.config import default_schedule

    default = None if (r.get("pp") or 1) == 1 else default_schedule(r.get("vp") or 1)
    out = [r["pp_schedule"]] if r.get("pp_schedule") not in (None, default) else []
    out += [f"split {r['pp_split']}"] if r.get("pp_split") not in (None, "balanced") else []
    out += [f"HSDP{_int(r['dp_replicate'])}"] if (r.get("dp_replicate") or 1) > 1 else []
    out += [r["fsdp_shard"]] if r.get("fsdp_shard") not in (None, "zero3") else []
    out += [f"EP-chunks {_int(r['ep_chunks'])}"] if (r.get("ep_chunks") or 1) > 1 else []
    if r.get("recompute") not in (None, "none"):
        every = r.get("recompute_every") or 1
        out.append(f"recompute {r['recompute']}" + (f"/{_int(every)}" if every > 1 else ""))
    return out  # --offload-optimizer: the precision cell says it (optimizer_label)


def run_group(r: dict) -> tuple:
    """A run's group: its database and its ``lpbench run`` invocation or sweep."""
    return r.get("results"), r.get("sweep_id") or r.get("group_id")


def group_differences(runs: list[dict]) -> dict[tuple, dict]:
    """Per :func:`run_group`, the settings in which its runs differ from the other groups' (precision and the
    settings of how a run is observed, ``arg(key=False)``, aside), from each group's first run."""
    from dataclasses import fields

    from lpbench.config import RunConfig, fact

    ignore = {"precision", *(f.name for f in fields(RunConfig) if not fact(f, "key"))}
    settings = {}
    for r in runs:
        settings.setdefault(run_group(r), {k: v for k, v in (r.get("config") or {}).items() if k not in ignore})
    values = list(settings.values())
    differ = sorted({k for s in values for k in s if len({json.dumps(t.get(k), default=str) for t in values}) > 1})
    return {g: {k: s.get(k) for k in differ} for g, s in settings.items()}


def differences_text(differs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in differs.items())


def system_name(gpu: str | None) -> str:
    """Short GPU name for tables ('H100 SXM'), 'CPU' when the run had no GPU."""
    if not gpu:
        return "CPU"
    from lpbench.metrics.hardware import detect_gpu

    known = detect_gpu(gpu)
    return known.name if known else gpu.replace("NVIDIA ", "")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _layout(r: dict) -> dict:
    """The parallel layout and compilation a run had: what ran (metrics) over what was asked (config)."""
    cfg, metrics = r.get("config") or {}, r.get("metrics") or {}
    ran = {k: metrics[k] for k in ("compile", "compile_scope") if k in metrics}
    return {k: ran.get(k, cfg.get(k)) for k in layout_keys() if k in cfg or k in ran}


# What must match for two runs to be compared: the same work on the same machine (and the layout)
SAME_WORK = ("results", "group_id", "workload", "model", "seq_len", "mbs", "gbs", "num_gpus", "gpu")


def group_key(r: dict) -> tuple:
    """A run's comparison group: :data:`SAME_WORK` and its layout."""
    return (*(r.get(k) for k in SAME_WORK), json.dumps(_layout(r), sort_keys=True))


def _baselines(runs: list[dict]) -> dict[tuple, dict]:
    """Per group: its first ok BF16 run, else its first ok run."""
    out: dict[tuple, dict] = {}
    for r in runs:
        if r.get("status") != "ok" or not r.get("tokens_per_sec_per_gpu"):
            continue
        key = group_key(r)
        current = out.get(key)
        if current is None or (r.get("precision") == BASELINE and current.get("precision") != BASELINE):
            out[key] = r
    return out


NOT_GPU_SPEED = "† CPU run or emulated GEMMs: speed ratios do not predict GPU speed"


def _quartiles(r: dict) -> tuple[float, float] | None:
    m = r.get("metrics") or {}
    q1, q3 = m.get("step_time_p25_s"), m.get("step_time_p75_s")
    return (q1, q3) if _finite(q1) and _finite(q3) and q1 > 0 else None


def speedup_interval(run: dict, base: dict) -> tuple[float, float, bool] | None:
    """(low, high, within noise) of ``run``'s speedup over ``base`` from their step-time quartiles:
    base Q1 / run Q3 .. base Q3 / run Q1; within noise when the quartile ranges overlap."""
    a, b = _quartiles(run), _quartiles(base)
    if a is None or b is None:
        return None
    return b[0] / a[1], b[1] / a[0], a[0] <= b[1] and b[0] <= a[1]


def _not_gpu_speed(r: dict | None) -> bool:
    """A CPU run or one with emulated GEMMs: its speed says nothing about a GPU's."""
    return r is not None and (not r.get("gpu") or r.get("path") == "emulated")


def speedup_text(row: dict) -> str:
    """``1.27× (1.20–1.35)``, ``within noise (0.95–1.08×)`` or ``1.00×`` for the baseline; ``†`` marks
    ratios that do not predict GPU speed."""
    s = row.get("speedup")
    if s is None:
        return "n/a"
    mark = " †" if row.get("not_gpu_speed") else ""
    low, high = row.get("speedup_low"), row.get("speedup_high")
    if row.get("id") is not None and row.get("id") == row.get("baseline_id") or low is None:
        return f"{s:.2f}×{mark}"
    if row.get("within_noise"):
        return f"within noise ({low:.2f}–{high:.2f}×){mark}"
    return f"{s:.2f}× ({low:.2f}–{high:.2f}){mark}"


def step_time_text(row: dict) -> str:
    """Median step time in ms with its quartiles: ``412.3 (405.1–420.8)``."""
    t = row.get("step_time_ms")
    if t is None:
        return "n/a"
    q1, q3 = row.get("step_time_p25_ms"), row.get("step_time_p75_ms")
    return f"{t:.1f}" if q1 is None else f"{t:.1f} ({q1:.1f}–{q3:.1f})"


def _int(v):
    return int(v) if _finite(v) else v


def _compared_loss(r: dict):
    """The loss precisions are compared on: the mean over the run's last steps (``tail_loss``), or the last
    step's loss for a row recorded before runs stored that mean."""
    tail = (r.get("metrics") or {}).get("tail_loss")
    return tail if _finite(tail) else r.get("final_loss")


def _loss_sem(r: dict) -> float:
    sem = (r.get("metrics") or {}).get("tail_loss_sem")
    return sem if _finite(sem) else 0.0


def optimizer_label(cfg: dict) -> str:
    """A run's optimizer settings that differ from FP32 AdamW on the GPU, as its precision cell adds them:
    ``(bf16 weights, 8bit states, offloaded)``; "" for the defaults."""
    parts = [
        f"{cfg[key]} {what}"
        for key, what in (("master_weights", "weights"), ("optimizer_states", "states"))
        if cfg.get(key, "fp32") != "fp32"
    ]
    parts += ["offloaded"] if cfg.get("offload_optimizer") else []
    return f"({', '.join(parts)})" if parts else ""


def summary_rows(runs: list[dict]) -> list[dict]:
    """Flatten stored runs into table rows with speedup and loss delta vs the group's baseline."""
    baselines, differs = _baselines(runs), group_differences(runs)
    rows = []
    for r in runs:
        tps = r.get("tokens_per_sec_per_gpu")
        key = group_key(r)
        base = baselines.get(key)
        base_tps = base.get("tokens_per_sec_per_gpu") if base else None
        loss, base_loss = _compared_loss(r), _compared_loss(base) if base else None
        cfg, metrics = r.get("config") or {}, r.get("metrics") or {}
        mbs, gbs, seq = _int(r.get("mbs")), _int(r.get("gbs")), _int(r.get("seq_len"))
        speed = tps / base_tps if r.get("status") == "ok" and tps and base_tps else None
        interval = speedup_interval(r, base) if speed is not None else None
        quart = _quartiles(r)
        same = lambda *keys: {k: r.get(k) for k in keys}  # the stored run's values, under their names
        rows.append(
            {
                **same("id", "group_id", "workload", "model", "precision"),
                "optimizer": optimizer_label(cfg),
                **same("backend", "path"),
                "why_emulated": metrics.get("why_emulated"),
                "batch": f"{gbs}/{mbs}/{seq}",
                "num_gpus": r.get("num_gpus"),
                "gpu": r.get("gpu") or "cpu",
                "step_time_ms": r["step_time_s"] * 1e3 if r.get("step_time_s") else None,
                "tokens_per_sec_per_gpu": tps,
                **same("tflops_per_gpu", "mfu_bf16", "mfu_precision"),
                "peak_mem_gb": r.get("peak_mem_allocated_gb"),
                **same("predicted_peak_gb", "final_loss"),
                "tail_loss": loss,
                "tail_steps": metrics.get("tail_steps"),
                "speedup": speed,
                "speedup_low": interval[0] if interval else None,
                "speedup_high": interval[1] if interval else None,
                "within_noise": interval[2] if interval else None,
                "not_gpu_speed": speed is not None and (_not_gpu_speed(r) or _not_gpu_speed(base)),
                "step_time_p25_ms": quart[0] * 1e3 if quart else None,
                "step_time_p75_ms": quart[1] * 1e3 if quart else None,
                **same("status", "error"),
                "baseline": base.get("precision") if base else None,
                "baseline_id": base.get("id") if base else None,
                "loss_delta": loss - base_loss
                if r.get("status") == "ok" and _finite(loss) and _finite(base_loss)
                else None,
                "loss_delta_se": math.hypot(_loss_sem(r), _loss_sem(base)) if base else None,
                **same("sweep_id", "run_key", "created_at", "results"),
                "system": system_name(r.get("gpu")),
                "seq_len": seq,
                "mbs": mbs,
                "gbs": gbs,
                "grad_accum": cfg.get("gbs", 0) // max(1, cfg.get("mbs", 1) * cfg.get("dp", 1)) if cfg else None,
                **{"tp": 1, "pp": 1, "vp": 1, "cp": 1},  # a run stored before a layout setting existed
                **_layout(r),
                **same("peak_mem_reserved_gb", "device_mem_used_gb"),
                "memory_kind": metrics.get("memory_kind"),
                "diverged_step": metrics.get("diverged_step"),
                "resumed_from_step": metrics.get("resumed_from_step"),  # --load: steps before it ran elsewhere
                "lora_base_storage": cfg.get("lora_base_storage"),
                "lora_stored_quantized": metrics.get("lora_stored_quantized"),
                "steps": cfg.get("steps"),
                "group_differs": differences_text(differs[run_group(r)]),  # from the other groups' runs
                "flops_formula": metrics.get("flops_formula") or cfg.get("flops_formula"),
                **{k: metrics.get(k) for k in PIPELINE_METRICS},  # PP runs: the split, the bubble and its theory
                **{f"profile_{k}": v for k, v in (metrics.get("profile") or {}).items()},  # --profile-steps
            }
        )
    return rows


def _formulas(rows: list[dict]) -> list[str]:
    return sorted({r["flops_formula"] for r in rows if r.get("flops_formula")})


def tflops_header(rows: list[dict], header: str) -> str:
    """``header`` naming the FLOP formula of the rows' TFLOP/s (``TFLOP/s/GPU (megatron)``); where rows differ
    in it, each cell names its own (:func:`tflops_cell`)."""
    formulas = _formulas(rows)
    return f"{header} ({formulas[0] if len(formulas) == 1 else 'formula per cell'})" if formulas else header


def tflops_cell(rows: list[dict], row: dict, text: str) -> str:
    return f"{text} ({row['flops_formula']})" if len(_formulas(rows)) > 1 and row.get("flops_formula") else text


def _headers(rows: list[dict]) -> list[str]:
    return [tflops_header(rows, h) if k == "tflops_per_gpu" else h for k, h, _ in COLUMNS]


def _cell(row: dict, key: str, fmt: str, rows: list[dict] = ()) -> str:
    v = row.get(key)
    if key == "tflops_per_gpu" and v is not None:
        return tflops_cell(rows, row, fmt.format(v))
    if key == "speedup":
        return speedup_text(row)
    if key == "step_time_ms":
        return step_time_text(row)
    if key == "status" and v != "ok" and row.get("error"):
        return f"{v}: {row['error']}"
    if key == "status" and row.get("resumed_from_step"):
        return f"{v} (resumed from step {row['resumed_from_step']})"
    return "n/a" if v is None else fmt.format(v)


def quantizes(precision: str | None) -> str:
    """What a recipe quantizes, in a few words: the block linears' element formats and scaling, and the
    ingredients that change which GEMMs or layers stay in higher precision."""
    from lpbench.precision.recipes import get_recipe

    try:
        r = get_recipe(precision)
    except Exception:  # an old row of a recipe since renamed
        return "?"
    if not r.quantized:
        return f"nothing ({'FP32' if r.gemm_class is None else 'BF16'} GEMMs)"
    fmt = r.fwd_format.upper() + (f", grads {r.grad_format.upper()}" if r.grad_format != r.fwd_format else "")
    scale = {
        "tensor": "per-tensor",
        "delayed": "per-tensor, delayed",
        "row": "per-row",
        "block": f"1x{r.block} blocks" + (f" (W {r.block}x{r.block})" if r.weight_block_2d else ""),
        "mx": f"1x{r.block} blocks, E8M0 scales",
        "nvfp4": f"1x{r.block} blocks" + (f" (W {r.block}x{r.block})" if r.weight_block_2d else "") + ", E4M3 scales",
    }.get(r.scaling.value, r.scaling.value)
    extra = ["wgrad BF16"] if r.wgrad_bf16 else []
    extra += ["RHT wgrad"] if r.rht_wgrad else []
    extra += ["SR grads"] if r.stochastic_grads else []
    bf16 = r.first_bf16_layers + r.last_bf16_layers
    extra += [f"{bf16} blocks BF16"] if bf16 else []
    return f"{fmt}, {scale}" + "".join(f"; {e}" for e in extra)


def _delta_text(row: dict) -> str:
    """Δ loss vs the baseline, with the standard error of the two tail means: ``+0.0251 ±0.0310``."""
    d = row.get("loss_delta")
    if d is None:
        return "n/a"
    if row.get("id") is not None and row.get("id") == row.get("baseline_id"):
        return "0 (ref)"
    se = row.get("loss_delta_se")
    return f"{d:+.4f}" + (f" ±{se:.4f}" if _finite(se) and se > 0 else "")


WRAPPED = {"quantizes": 24}  # text columns that wrap onto more lines (their narrowest width); no others do


def _fit(columns: dict[str, list[str]], headers: dict[str, str]) -> int:
    """Width of a rich table with these cells: each column its widest line (a wrapped one its narrowest)
    plus padding, plus borders."""
    widths = [
        WRAPPED.get(key) or max([len(x) for x in headers[key].split("\n")] + [len(c) for c in cells])
        for key, cells in columns.items()
    ]
    return sum(w + 2 for w in widths) + len(widths) + 1


_SHARED_LABEL = {  # a setting every row of the run table shares, as the title says it
    "workload": lambda v, cpu: v,
    "model": lambda v, cpu: f"model {v}",
    "system": lambda v, cpu: v,
    "batch": lambda v, cpu: "GBS/MBS/seq " + v,
    "num_gpus": lambda v, cpu: (
        f"{v} {'process' if cpu else 'GPU'}(es)" if v != "1" else f"1 {'process' if cpu else 'GPU'}"
    ),
    "layout": lambda v, cpu: f"layout {v}",
    "steps": lambda v, cpu: f"{v} steps",
}
_SETTING_COLUMNS = tuple(_SHARED_LABEL)


def bubble_text(r: dict) -> str:
    """A pipeline run's measured bubble (mean over its ranks) and, in brackets, the theory for its split; n/a
    without a pipeline or where the bubble was not measured."""
    if r.get("pp_bubble") is None:
        return "n/a"
    split = r.get("pp_bubble_split")
    return f"{r['pp_bubble']:.1%}" + ("" if split is None else f" ({split:.1%})")


def to_rich(rows: list[dict], title: str | None = None, width: int | None = None, wide: bool = False) -> Table:
    """The flat table for the console, fitted to ``width`` columns (default: the console's).

    Settings that every row shares (model, batch, GPUs, layout, steps) move to the title; columns whose
    every cell is n/a go; then, until the table fits, the least important column goes (their names are
    listed under the table). A precision, model or number is never cut: every cell is one whole line.
    ``wide`` keeps every column. On a CPU or with emulated GEMMs the loss columns lead and the speed
    column's header says its ratios do not predict GPU speed. Every text is literal (a ``[`` in a
    path or error is no markup)."""
    from rich.text import Text

    from lpbench.console import console

    width = width or console.width
    cpu_like = bool(rows) and all(r.get("system") == "CPU" for r in rows)
    any_mark = any(r.get("not_gpu_speed") for r in rows)
    notes: list[str] = []

    def status(r):
        if r.get("status") == "ok":
            return "ok" + (f" (resumed from step {r['resumed_from_step']})" if r.get("resumed_from_step") else "")
        if r.get("error"):
            notes.append(f"[{len(notes) + 1}] {r.get('precision')}: {r.get('status')}: {r['error']}")
            return f"{_status_cell(r)} [{len(notes)}]"
        return _status_cell(r)

    def layout(r):
        sizes = [
            f"{k.upper()}{_int(r[k])}" for k in ("tp", "pp", "vp", "cp", "ep", "dp") if r.get(k, 1) not in (1, None)
        ]
        return (
            " ".join(sizes + layout_choices(r))
            + (" FSDP" if r.get("fsdp") or (r.get("cp") or 1) > 1 else "")  # CP runs under FSDP2
            + (" compiled" if r.get("compile") else "")
            or "-"
        )

    speed_note = " (CPU:\nnot\npredictive)" if cpu_like else "\n(†: emulated,\nnot predictive)" if any_mark else ""
    speed_head = "speed vs\nBF16" + speed_note
    loss_head = "loss (mean\nlast steps)"
    # (key, header, importance: higher stays longer, cell); the order is the order shown
    speed_cols = [
        ("speedup", speed_head, 6, lambda r: speedup_text(r).replace(" †", "") if cpu_like else speedup_text(r)),
        ("step_time_ms", "step ms\n(IQR)", 2, step_time_text),
        ("tokens_per_sec_per_gpu", "tokens/s\n/GPU", 4, lambda r: _cell(r, "tokens_per_sec_per_gpu", "{:,.0f}")),
        (
            "tflops_per_gpu",
            tflops_header(rows, "TFLOP/s\n/GPU").replace(" (", "\n("),
            3,
            lambda r: _cell(r, "tflops_per_gpu", "{:.3g}", rows),
        ),
        ("mfu_bf16", "MFU", 3, lambda r: _cell(r, "mfu_bf16", "{:.1%}")),
        ("pp_bubble", "PP bubble\n(split's\ntheory)", 2, bubble_text),
    ]
    loss_cols = [
        ("loss_delta", "Δ loss\nvs BF16", 9, _delta_text),
        ("tail_loss", loss_head, 6.5 if cpu_like else 5, lambda r: _cell(r, "tail_loss", "{:.4f}")),
    ]
    mem = (
        "peak_mem_gb",
        "peak mem\nGB" + ("\n(host RSS)" if cpu_like else ""),
        3 if cpu_like else 5,
        lambda r: _cell(r, "peak_mem_gb", "{:.2f}"),
    )
    what = ("quantizes", "quantizes", 7 if cpu_like else 1, lambda r: quantizes(r.get("precision")))
    setting = [
        ("workload", "workload", 8, lambda r: str(r.get("workload"))),
        ("model", "model", 9, lambda r: str(r.get("model"))),
        ("system", "system", 8, lambda r: str(r.get("system"))),
        ("batch", "GBS/MBS\n/seq", 8, lambda r: str(r.get("batch"))),
        ("num_gpus", "GPUs", 8, lambda r: str(r.get("num_gpus"))),
        ("layout", "layout", 8, layout),
        ("steps", "steps", 8, lambda r: str(r.get("steps"))),
    ]
    head = [
        ("precision", "precision", 10, lambda r: " ".join(filter(None, (str(r.get("precision")), r.get("optimizer"))))),
        ("path", "path", 8, lambda r: str(r.get("path") or "-")),
    ]
    if cpu_like:
        spec = setting + head + [what] + loss_cols + speed_cols[:1] + [mem] + speed_cols[1:]
    else:
        spec = setting + head + speed_cols[:1] + [mem] + speed_cols[1:] + loss_cols + [what]
    spec.append(("status", "status", 10, status))
    cells = {key: [fn(r) for r in rows] for key, _, _, fn in spec}
    shared = []
    keep = []
    for key, header, rank, fn in spec:
        values = cells[key]
        if key in _SETTING_COLUMNS and len(set(values)) <= 1 and rows and not wide:
            if values and values[0] not in ("None", "-", ""):
                shared.append(_SHARED_LABEL[key](values[0], cpu_like))
            continue
        if not wide and rows and all(v == "n/a" for v in values):
            continue
        keep.append((key, header, rank))
    hidden = []
    while not wide and len(keep) > 1 and _fit({k: cells[k] for k, _, _ in keep}, {k: h for k, h, _ in keep}) > width:
        drop = min((c for c in keep if c[2] < 9), key=lambda c: c[2], default=None)
        if drop is None:
            break
        keep.remove(drop)
        hidden.append(drop[1].replace("\n/", "/").replace("\n", " "))
    heading = title or ""
    if shared:
        heading += ("\n" if heading else "") + " · ".join(shared)
    caption = []
    if any_mark and not cpu_like:
        caption.append(NOT_GPU_SPEED)
    if any(r.get("tail_steps") for r in rows):
        caption.append(
            "loss: mean of the last quarter of the steps; ± the standard error of Δ from both runs' "
            "step-to-step noise (not seed noise: rerun with --seed to see that)"
        )
    if hidden:
        caption.append(f"not shown at {width} columns: {', '.join(hidden)} (--wide shows every column)")
    table = Table(
        title=Text(heading) if heading else None,
        caption=Text("\n".join(caption + notes)) if caption or notes else None,
        caption_justify="left",
    )
    for key, header, _ in keep:
        table.add_column(
            Text(header),
            no_wrap=key not in WRAPPED,
            min_width=WRAPPED.get(key),
            justify="left"
            if key in ("model", "precision", "path", "status", "quantizes", "workload", "system", "layout")
            else "right",
        )
    for i in range(len(rows)):
        table.add_row(*(Text(cells[k][i]) for k, _, _ in keep))
    return table


_MARKDOWN_SPECIAL = "\\`*_<>|"


def md_escape(text) -> str:
    """``text`` as literal markdown inside a table cell: emphasis, code, HTML and '|' escaped, no link
    (``](`` broken), newlines as spaces. Brackets stay as they are: footnote marks read ``[1]``."""
    text = "".join("\\" + c if c in _MARKDOWN_SPECIAL else c for c in " ".join(str(text).splitlines()))
    return text.replace("](", "]\\(")


def to_markdown(rows: list[dict]) -> str:
    """The flat table (one row per run) as markdown."""
    lines = ["| " + " | ".join(_headers(rows)) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(md_escape(_cell(r, k, f, rows)) for k, _, f in COLUMNS) + " |" for r in rows]
    if any(r.get("not_gpu_speed") for r in rows):
        lines += ["", NOT_GPU_SPEED]
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        names = list(dict.fromkeys(k for r in rows for k in r))
        writer = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def to_json(rows: list[dict]) -> str:
    """Strict JSON: non-finite numbers become null."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    return json.dumps(clean, indent=2, allow_nan=False, default=str)


# ----------------------------------------------------------------------------- report tables
@dataclass
class TextTable:
    """A rendered table: cells are final strings; ``notes`` go under it."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    right: set[int] = field(default_factory=set)  # right-aligned (numeric) columns
    caption: str | None = None  # one line above the table
    notes: list[str] = field(default_factory=list)
    group_starts: set[int] = field(default_factory=set)  # row indexes that open a comparison group

    def compact(self) -> "TextTable":
        """This table without the columns whose every cell is the same (blank cells of a group's later rows
        aside); a note names them with their value. The precision column and the numbers that differ stay."""
        same = [
            i
            for i, c in enumerate(self.columns)
            if c != "Precision"
            and len({row[i] for row in self.rows if row[i] != ""}) == 1
            and all(row[i] != "" for n, row in enumerate(self.rows) if n in self.group_starts)
        ]
        if not same or len(self.rows) < 2:
            return self
        keep = [i for i in range(len(self.columns)) if i not in same]
        shared = "; ".join(f"{self.columns[i]} {next(row[i] for row in self.rows if row[i])}" for i in same)
        return TextTable(
            title=self.title,
            columns=[self.columns[i] for i in keep],
            rows=[[row[i] for i in keep] for row in self.rows],
            right={keep.index(i) for i in self.right if i in keep},
            caption=self.caption,
            notes=[f"Every row: {shared} (--wide shows these columns)", *self.notes],
            group_starts=set(self.group_starts),
        )

    def to_markdown(self, level: int = 2) -> str:
        esc = md_escape
        out = [f"{'#' * level} {esc(self.title)}", ""]
        if self.caption:
            out += [f"> {self.caption}", ""]
        out.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
        out.append("|" + "|".join("---:" if i in self.right else "---" for i in range(len(self.columns))) + "|")
        out += ["| " + " | ".join(esc(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out)

    def to_html(self, level: int = 2) -> str:
        e = html.escape
        out = [f"<h{level}>{e(self.title)}</h{level}>"]
        if self.caption:
            out.append(f'<p class="caption">{e(self.caption)}</p>')
        out.append('<div class="scroll"><table><thead><tr>')
        out += [f'<th class="{"num" if i in self.right else ""}">{e(c)}</th>' for i, c in enumerate(self.columns)]
        out.append("</tr></thead><tbody>")
        for n, row in enumerate(self.rows):
            cls = ' class="group"' if n in self.group_starts and n else ""
            cells = "".join(f'<td class="{"num" if i in self.right else ""}">{e(c)}</td>' for i, c in enumerate(row))
            out.append(f"<tr{cls}>{cells}</tr>")
        out.append("</tbody></table></div>")
        if self.notes:
            out.append('<ul class="notes">' + "".join(f"<li>{e(n)}</li>" for n in self.notes) + "</ul>")
        return "\n".join(out)


def _num(v, kind: str = "") -> str:
    """Numbers as the seeds print them: 33,099 tokens/s; 1,917 TFLOP/s; small CPU values with 3 digits."""
    if not _finite(v):
        return "n/a"
    if kind == "pct":
        return f"{v:.1%}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}" if kind != "gb" else f"{v:.2f}"
    return f"{v:.3g}" if kind != "gb" else f"{v:.2f}"


def _status_cell(row: dict) -> str:
    s = row["status"]
    if s == "oom":
        return "OOM"
    if s == "diverged":
        return f"diverged (step {row['diverged_step']})" if row.get("diverged_step") else "diverged"
    return s


def _group_order(rows: list[dict]) -> list[list[dict]]:
    """Rows in comparison groups (first-seen order); the baseline precision first within each."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_row_group(r), []).append(r)
    out = []
    for members in groups.values():
        members.sort(key=lambda r: (r["precision"] != BASELINE, r["precision"] != r.get("baseline")))
        out.append(members)
    return out


def _row_group(r: dict) -> tuple:
    """A summary row's comparison group (:func:`group_key` of a row, whose layout settings are its own keys)."""
    return (*(r.get(k) for k in SAME_WORK), tuple((k, r.get(k)) for k in layout_keys() if k in r))


def workload_tables(rows: list[dict]) -> list[TextTable]:
    """One NeMo-style table per workload: config cells once per comparison group."""
    tables = []
    workloads = list(dict.fromkeys(r.get("workload") or "pretrain" for r in rows))
    for wl in workloads:
        mine = [r for r in rows if (r.get("workload") or "pretrain") == wl]
        layout = [k for k in layout_keys(numbers_only=True) if any(k in r for r in mine)]
        show_fsdp = any(r.get("fsdp") for r in mine)
        fsdp_col = ["FSDP"] if show_fsdp else []
        show_choices = any(layout_choices(r) for r in mine)  # schedule, recompute, HSDP, shard mode
        fsdp_col += ["Layout"] if show_choices else []
        config_cols = ["Model", "System", "#-GPUs", "GBS", "MBS", "Seq Length", *[k.upper() for k in layout], *fsdp_col]
        config_cols += ["GA", "Steps", "Group (when, UTC): what differs"]
        tflops = tflops_header(mine, "Model TFLOP / sec / GPU")
        show_bubble = any(r.get("pp_bubble") is not None for r in mine)
        metric_cols = ["Precision", "Backend", "Path", "Step ms (IQR)", "Tokens / sec / GPU", tflops, "MFU"]
        metric_cols += ["PP bubble (split's theory)"] if show_bubble else []
        metric_cols += ["Speedup over BF16", "Peak mem (GB)", "Loss (last-steps mean)", "Δ loss vs BF16"]
        columns = config_cols + metric_cols
        text = {"Model", "System", "Layout", "Group (when, UTC): what differs", "Precision", "Backend", "Path"}
        table = TextTable(
            title=WORKLOAD_TITLES.get(wl, wl),
            columns=columns,
            rows=[],
            right={i for i, c in enumerate(columns) if c not in text},
        )
        mem_kinds = set()
        for members in _group_order(mine):
            table.group_starts.add(len(table.rows))
            for i, r in enumerate(members):
                if i == 0:
                    when = (r.get("created_at") or "")[5:16].replace("T", " ")
                    fsdp = ("yes, FP8 all-gather" if r.get("fsdp_fp8_all_gather") else "yes") if r.get("fsdp") else "no"
                    group = f"{r.get('sweep_id') or r.get('group_id') or '-'} ({when})"
                    cfg_cells = [r["model"], r["system"], str(r.get("num_gpus") or 1)]
                    cfg_cells += [str(r["gbs"]), str(r["mbs"]), str(r["seq_len"])]
                    cfg_cells += [str(_int(r.get(k, ""))) for k in layout] + ([fsdp] if show_fsdp else [])
                    cfg_cells += [" ".join(layout_choices(r)) or "–"] if show_choices else []
                    cfg_cells += [str(r.get("grad_accum") or ""), str(r.get("steps") or "")]
                    cfg_cells.append(group + (f": {r['group_differs']}" if r.get("group_differs") else ""))
                else:
                    cfg_cells = [""] * len(config_cols)
                mem_kinds.add(r.get("memory_kind"))
                if r["status"] == "ok":
                    base = r.get("baseline")
                    speed = speedup_text(r)
                    if base and base != BASELINE and r.get("speedup") is not None:  # no BF16 run in the group
                        speed += " (baseline)" if r["id"] == r["baseline_id"] else f" (vs {precision_name(base)})"
                    delta = r.get("loss_delta")
                    metric = [
                        step_time_text(r),
                        _num(r.get("tokens_per_sec_per_gpu")),
                        tflops_cell(mine, r, _num(r.get("tflops_per_gpu"))),
                        _num(r.get("mfu_bf16"), "pct"),
                        *([bubble_text(r)] if show_bubble else []),
                        speed,
                        _num(r.get("peak_mem_gb"), "gb"),
                        _num(r.get("tail_loss")) if not _finite(r.get("tail_loss")) else f"{r['tail_loss']:.4f}",
                        "n/a" if delta is None else ("0" if r["id"] == r["baseline_id"] else _delta_text(r)),
                    ]
                else:
                    note = len(table.notes) + 1
                    table.notes.append(
                        f"[{note}] {r['model']} {precision_name(r['precision'])} "
                        f"(GBS {r['gbs']}, MBS {r['mbs']}, seq {r['seq_len']}): {r['status']}"
                        + (f": {r['error']}" if r.get("error") else "")
                    )
                    metric = [
                        "–",
                        f"{_status_cell(r)} [{note}]",
                        "–",
                        "–",
                        *(["–"] if show_bubble else []),
                        "–",
                        _num(r.get("peak_mem_gb"), "gb"),
                        "–",
                        "–",
                    ]
                label = " ".join(filter(None, (precision_name(r["precision"]), r.get("optimizer"))))
                label += ", base stored quantized" if r.get("lora_stored_quantized") else ""  # not for bf16
                label += f", resumed from step {r['resumed_from_step']}" if r.get("resumed_from_step") else ""
                table.rows.append(cfg_cells + [label, r.get("backend") or "lpbench", r.get("path") or "–", *metric])
        kinds = (("cuda", "allocator peak per GPU"), ("host-rss", "the run's peak host resident set size on CPU"))
        mem = "; ".join(what for kind, what in kinds if kind in mem_kinds)
        table.caption = (
            "Speedup and Δ loss are against the BF16 run of the same group (same invocation or sweep, "
            "model, batch, GPUs and layout); loss: the mean over the last quarter of the steps, Δ ± "
            "the standard error of both means (step-to-step noise, not seed noise). MFU against the GPU's "
            "dense BF16 peak; n/a on CPU. Step ms: median over the timed steps (interquartile range); "
            "a speedup's interval comes from both runs' quartiles, \"within noise\" where they overlap. "
            + (f"Peak mem: {mem}." if mem else "")
        )
        if any(r.get("not_gpu_speed") for r in mine):
            table.notes.append(NOT_GPU_SPEED)
        tables.append(table)
    return tables


def time_to_train(tokens_per_sec_per_gpu: float, num_gpus: int, tokens: float = TIME_TO_TRAIN_TOKENS) -> float:
    """Days to train ``tokens`` at a per-GPU rate on ``num_gpus`` GPUs: N / (tokens/s/GPU x GPUs) / 86400."""
    return tokens / (tokens_per_sec_per_gpu * num_gpus) / 86400.0


def time_to_train_tables(
    rows: list[dict], gpu_counts=TIME_TO_TRAIN_GPUS, tokens: float = TIME_TO_TRAIN_TOKENS
) -> list[TextTable]:
    """Days to train 1T tokens at 8..2048 GPUs, one row per model/system/precision: pre-training on GPUs only.

    Each row takes the best tokens/s/GPU measured for that model, system, backend and precision
    and assumes it holds at every scale (the Nemotron4 recipe's table measures each scale). A CPU
    rate or a fine-tuning rate says nothing about pre-training a model on a cluster.
    """
    best: dict[tuple, dict] = {}
    for r in rows:
        pretrain_on_gpu = (r.get("workload") or "pretrain") == "pretrain" and r.get("gpu") not in (None, "cpu")
        if r["status"] != "ok" or not _finite(r.get("tokens_per_sec_per_gpu")) or not pretrain_on_gpu:
            continue
        key = (r["model"], r["system"], r.get("backend"), r["precision"])
        if key not in best or r["tokens_per_sec_per_gpu"] > best[key]["tokens_per_sec_per_gpu"]:
            best[key] = r
    if not best:
        return []
    columns = [
        "Model",
        "System",
        "Precision",
        "Measured with",
        "Tokens / sec / GPU",
        *[f"{n} GPUs" for n in gpu_counts],
    ]
    table = TextTable(
        title=f"Time to train {tokens / 1e12:g}T tokens (days), {WORKLOAD_TITLES['pretrain']}",
        columns=columns,
        rows=[],
        right=set(range(4, len(columns))),
        caption=f"days = {tokens:.0e} / (tokens/s/GPU x GPUs) / 86400, assuming the measured "
        "tokens/s/GPU holds at every GPU count (linear scaling; the Nemotron4 recipe "
        "measures each scale).",
    )
    last = None
    for r in sorted(best.values(), key=lambda r: (r["model"], r["system"], r["precision"] != BASELINE)):
        same = last == (r["model"], r["system"])
        gpus = r.get("num_gpus") or 1
        measured = f"GBS {r['gbs']}, MBS {r['mbs']}, seq {r['seq_len']}, {gpus} GPU" + ("s" if gpus > 1 else "")
        days = [_days(time_to_train(r["tokens_per_sec_per_gpu"], n, tokens)) for n in gpu_counts]
        table.rows.append(["" if same else r["model"], "" if same else r["system"], precision_name(r["precision"])])
        table.rows[-1] += [measured, _num(r["tokens_per_sec_per_gpu"]), *days]
        if not same:
            table.group_starts.add(len(table.rows) - 1)
        last = (r["model"], r["system"])
    return [table]


def _days(d: float) -> str:
    return f"{d:,.0f}" if d >= 1000 else f"{d:.2f}"  # the recipe's table: 117.44, 0.96

"""Report figures (matplotlib, Agg backend): each function returns PNG bytes, or None without data.

* ``throughput_vs_seq``: tokens/s/GPU and model TFLOP/s/GPU against sequence length, one line
  per precision, one row of panels per model / system / GPU count / workload.
* ``speedup_bars``: speedup over BF16 per comparison group; failed runs marked in place.
* ``loss_curves``: the loss per step of every precision of a group, overlaid.
* ``memory_bars``: peak memory per precision and group.

Colours are fixed per precision across all figures (BF16 is always the dark grey).
"""

from __future__ import annotations

import io
import math

from lpbench.report.tables import BASELINE, precision_name

_EXTRA = ["#8c564b", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a"]
MAX_PANELS = 12
LABEL_BOX = {"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none"}  # hides lines behind labels
FAILED = "#b00020"  # the colour of a run that did not finish ok
FAIL_LABELS = {"oom": "OOM", "diverged": "diverged", "timeout": "timeout", "error": "error"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "savefig.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "font.size": 9,
            "axes.titlesize": 10,
            "legend.fontsize": 8,
            "legend.frameon": False,
            "text.parse_math": False,
        }
    )  # labels hold names and paths: a '$' is a dollar sign

    return plt


def _own_colour(precision: str) -> str | None:
    """The recipe's ``colour`` (None for an ablation, a noise-seed label or a name lpbench does not know)."""
    from lpbench.errors import UsageError
    from lpbench.precision.recipes import get_recipe

    try:
        return get_recipe(precision).colour
    except UsageError:
        return None


def colour(precision: str, order: list[str]) -> str:
    """``precision``'s colour in every figure: its recipe's, else a spare one by its place among ``order``'s
    precisions without one."""
    if own := _own_colour(precision):
        return own
    unknown = [p for p in order if not _own_colour(p)]
    return _EXTRA[unknown.index(precision) % len(_EXTRA)] if precision in unknown else _EXTRA[0]


def _png(fig) -> bytes:
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _precisions(rows) -> list[str]:
    """Precisions in display order: BF16 first, then as first seen."""
    seen = list(dict.fromkeys(r["precision"] for r in rows))
    return sorted(seen, key=lambda p: (p != BASELINE, seen.index(p)))


def _group_rows(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    from lpbench.report.tables import _row_group

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_row_group(r), []).append(r)
    return list(groups.items())


def _devices(n: int, system: str) -> str:
    unit = "process" if system == "CPU" else "GPU"
    return f"{n} {unit}" + ("" if n == 1 else ("es" if unit == "process" else "s"))


_LABEL_PARTS = [  # (how a comparison group is named, piece by piece)
    ("workload", lambda r: r.get("workload") or "pretrain"),
    ("model", lambda r: r["model"]),
    ("system", lambda r: r["system"]),
    ("gpus", lambda r: _devices(r.get("num_gpus") or 1, r["system"])),
    ("seq", lambda r: f"seq {r['seq_len']}"),
    ("batch", lambda r: f"GBS {r['gbs']} MBS {r['mbs']}"),
    ("layout", lambda r: " ".join(f"{k.upper()}{r[k]}" for k in ("tp", "pp", "vp", "cp", "ep") if r.get(k, 1) != 1)),
    ("group", lambda r: r.get("group_id") or ""),
]


def group_labels(groups: list[list[dict]]) -> tuple[list[str], str]:
    """A short label per group (only what differs between groups) and the common part."""
    firsts = [g[0] for g in groups]
    varying, common = [], []
    for name, fn in _LABEL_PARTS:
        values = [fn(r) for r in firsts]
        if len(set(values)) > 1:
            varying.append(fn)
        elif values[0] and name != "group":
            common.append(values[0])
    labels = []
    for i, r in enumerate(firsts):
        parts = [fn(r) for fn in varying if fn(r)]
        if varying and varying[-1] is _LABEL_PARTS[-1][1] and len(parts) > 1:
            parts = parts[:-1] + [f"run {r.get('group_id')}"]
        labels.append(", ".join(parts) or ("" if len(firsts) == 1 else f"group {i + 1}"))
    return labels, " · ".join(common)


def _legend_handles(precisions, order, kind: str = "line"):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if kind == "bar":
        return [Patch(color=colour(p, order), label=precision_name(p)) for p in precisions]
    return [Line2D([0], [0], color=colour(p, order), marker="o", lw=2, label=precision_name(p)) for p in precisions]


def throughput_vs_seq(rows: list[dict]) -> bytes | None:
    ok = [r for r in rows if r["status"] == "ok" and _finite(r.get("tokens_per_sec_per_gpu"))]
    if not ok:
        return None
    plt = _plt()
    order = _precisions(ok)
    panels: dict[tuple, list[dict]] = {}
    for r in ok:
        panels.setdefault(
            (r.get("workload"), r["model"], r["system"], r.get("num_gpus") or 1, r.get("backend")), []
        ).append(r)
    keys = list(panels)[:MAX_PANELS]
    pooled = 1  # the most runs one point stands for
    fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3.2 * len(keys)), squeeze=False)
    for row_axes, key in zip(axes, keys):
        members = panels[key]
        seqs = sorted({r["seq_len"] for r in members})
        for ax, metric, ylabel in (
            (row_axes[0], "tokens_per_sec_per_gpu", "tokens / s / GPU"),
            (row_axes[1], "tflops_per_gpu", "model TFLOP / s / GPU"),
        ):
            for p in _precisions(members):
                best: dict[int, float] = {}
                count: dict[int, int] = {}
                for r in members:
                    if r["precision"] == p and _finite(r.get(metric)):
                        best[r["seq_len"]] = max(best.get(r["seq_len"], 0.0), r[metric])
                        count[r["seq_len"]] = count.get(r["seq_len"], 0) + 1
                pooled = max([pooled, *count.values()])
                xs = sorted(best)
                emulated = any(r["precision"] == p and r.get("path") == "emulated" for r in members)
                ax.plot(
                    xs,
                    [best[x] for x in xs],
                    marker="o",
                    lw=2,
                    color=colour(p, order),
                    ls="--" if emulated else "-",
                    label=precision_name(p) + (" (emulated)" if emulated else ""),
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs)
            ax.set_xticklabels([str(s) for s in seqs])
            ax.minorticks_off()
            if len(seqs) == 1:
                ax.set_xlim(seqs[0] / 1.5, seqs[0] * 1.5)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(ylabel)
            wl, model, system, n, backend = key
            ax.set_title(f"{model} · {system} · {_devices(n, system)} · {wl or 'pretrain'}")
        row_axes[0].legend(loc="best")
    extra = f" (first {MAX_PANELS} of {len(panels)})" if len(panels) > MAX_PANELS else ""
    drawn = list(dict.fromkeys(r.get("sweep_id") or r.get("group_id") or "?" for r in ok))
    how = (
        f"each point the fastest of up to {pooled} runs (batch configs, groups)" if pooled > 1 else "one run per point"
    )
    fig.suptitle(
        f"Throughput vs sequence length{extra}\n{how}; {len(ok)} runs from "
        + (", ".join(drawn[:4]) + (f" and {len(drawn) - 4} more" if len(drawn) > 4 else ""))
        + " (lpbench report --group picks runs)",
        fontweight="bold",
        fontsize=9,
    )
    fig.tight_layout()
    return _png(fig)


def _bar_canvas(groups: list[list[dict]]):
    """Shared layout of the grouped bar charts: one cluster per group, one bar per precision."""
    groups = groups[: MAX_PANELS * 2]
    order = _precisions([r for g in groups for r in g])
    labels, common = group_labels(groups)
    fig, ax = _plt().subplots(figsize=(max(6.0, 1.1 + len(groups) * len(order) * 0.55), 4.2))
    return groups, order, labels, common, 0.8 / max(1, len(order)), fig, ax


def _bar_slots(groups: list[list[dict]], width: float):
    """(x position, precision, row) of every bar: each group's precisions centred on its tick."""
    for gi, members in enumerate(groups):
        present = _precisions(members)
        for pi, p in enumerate(present):
            yield gi + (pi - (len(present) - 1) / 2) * width, p, next(m for m in members if m["precision"] == p)


def _group_axis(ax, labels: list[str]) -> None:
    """One tick per group, labels slanted once there are more than three."""
    n = len(labels)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=20 if n > 3 else 0, ha="right" if n > 3 else "center")


def _failed_bar(ax, x: float, top: float, text: str) -> None:
    """``text`` upright in red where a run without a value would have its bar."""
    ax.text(x, top * 0.02, text, ha="center", va="bottom", rotation=90, fontsize=8, color=FAILED)


def _hatched(hatch: str, label: str, **kw):
    """A legend entry for the hatched bars."""
    from matplotlib.patches import Patch

    return Patch(facecolor="#bbbbbb", hatch=hatch, edgecolor="white", label=label, **kw)


def speedup_bars(rows: list[dict]) -> bytes | None:
    groups = [
        members
        for _, members in _group_rows(rows)
        if any(r.get("speedup") is not None for r in members) and len(members) > 1
    ]
    if not groups:
        return None
    groups, order, labels, common, width, fig, ax = _bar_canvas(groups)
    top = max([r["speedup"] for g in groups for r in g if r.get("speedup")] + [1.0])
    any_emulated = False
    for x, p, r in _bar_slots(groups, width):
        if r.get("speedup") is not None:
            emulated = r.get("path") == "emulated"
            any_emulated = any_emulated or emulated
            ax.bar(
                x,
                r["speedup"],
                width * 0.9,
                color=colour(p, order),
                hatch="///" if emulated else None,
                edgecolor="white" if emulated else None,
                linewidth=0,
            )
            ax.annotate(
                f"{r['speedup']:.2f}×",
                (x, r["speedup"]),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                zorder=4,
                bbox=LABEL_BOX,
            )  # legible across the line
        else:
            _failed_bar(ax, x, top, f"{precision_name(p)}: {FAIL_LABELS.get(r['status'], r['status'])}")
    ax.axhline(1.0, color="#3b3b3b", lw=1, ls="--", zorder=0.5)  # behind bars and labels
    ax.grid(axis="x", visible=False)
    _group_axis(ax, labels)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("speedup over BF16 (tokens/s/GPU ratio)")
    handles = _legend_handles(order, order, "bar")
    if any_emulated:
        handles.append(_hatched("///", "emulated GEMMs\n(no native unit here:\nspeed not representative)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Speedup over BF16" + (f" — {common}" if common else ""), fontweight="bold")
    if any(g[0].get("baseline") not in (None, BASELINE) for g in groups):
        ax.text(
            0,
            -0.2,
            "groups without a BF16 run are compared with their first run",
            transform=ax.transAxes,
            fontsize=7,
            color="#555",
        )
    fig.tight_layout()
    return _png(fig)


def loss_curves(rows: list[dict], steps_by_run: dict[int, list[dict]]) -> bytes | None:
    groups = [members for _, members in _group_rows(rows) if any(len(steps_by_run.get(r["id"], [])) for r in members)]
    if not groups:
        return None
    plt = _plt()
    shown = groups[:MAX_PANELS]
    order = _precisions([r for g in shown for r in g])
    labels, common = group_labels(shown)
    cols = min(3, len(shown))
    nrows = math.ceil(len(shown) / cols)
    width = 4.6 if len(shown) > 1 else 8.0
    fig, axes = plt.subplots(nrows, cols, figsize=(width * cols, 3.4 * nrows if len(shown) > 1 else 4.2), squeeze=False)
    for ax, members, label in zip(axes.flat, shown, labels):
        failures = 0
        for r in sorted(members, key=lambda m: order.index(m["precision"])):
            steps = steps_by_run.get(r["id"], [])
            pts = [(s["step"], s["loss"]) for s in steps if _finite(s.get("loss"))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, lw=1.6, color=colour(r["precision"], order), marker="o" if len(xs) <= 20 else None, ms=3)
            if r["status"] != "ok":  # where it stopped, and why
                what = FAIL_LABELS.get(r["status"], r["status"])
                if r["status"] == "diverged" and r.get("diverged_step"):
                    what += f" at step {r['diverged_step']}"
                ax.plot(xs[-1], ys[-1], marker="x", ms=9, mew=2, color=FAILED)
                ax.annotate(
                    f"{precision_name(r['precision'])} {what}",
                    (xs[-1], ys[-1]),
                    textcoords="offset points",
                    xytext=(8, 10 + 12 * failures),
                    ha="left",
                    fontsize=7,
                    color=FAILED,
                    arrowprops={"arrowstyle": "-", "color": FAILED, "lw": 0.6},
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
                )
                failures += 1
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        if label:
            ax.set_title(label, fontsize=9)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.margins(x=0.12)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    extra = f" (first {MAX_PANELS} of {len(groups)} groups)" if len(groups) > MAX_PANELS else ""
    fig.suptitle("Training loss per step" + (f" — {common}" if common else "") + extra, fontweight="bold")
    fig.tight_layout(rect=(0, 0.06 if nrows == 1 else 0.03, 1, 1))
    fig.legend(
        handles=_legend_handles(order, order), loc="lower center", ncol=min(len(order), 6), bbox_to_anchor=(0.5, 0.0)
    )
    return _png(fig)


def memory_bars(rows: list[dict]) -> bytes | None:
    groups = [members for _, members in _group_rows(rows) if any(_finite(r.get("peak_mem_gb")) for r in members)]
    if not groups:
        return None
    groups, order, labels, common, width, fig, ax = _bar_canvas(groups)
    top = max(r["peak_mem_gb"] for g in groups for r in g if _finite(r.get("peak_mem_gb")))
    any_failed = False
    for x, p, r in _bar_slots(groups, width):
        failed = r["status"] != "ok"
        any_failed = any_failed or failed
        what = FAIL_LABELS.get(r["status"], r["status"])
        if _finite(r.get("peak_mem_gb")):
            ax.bar(
                x,
                r["peak_mem_gb"],
                width * 0.9,
                color=colour(p, order),
                alpha=0.45 if failed else 1.0,
                hatch="//" if failed else None,
                edgecolor="white" if failed else None,
                linewidth=0,
            )
            ax.text(
                x,
                r["peak_mem_gb"] + top * 0.01,
                f"{r['peak_mem_gb']:.2f}" + (f"\n{what}" if failed else ""),
                ha="center",
                va="bottom",
                fontsize=7,
                color=FAILED if failed else "black",
            )
        elif failed:
            _failed_bar(ax, x, top, f"{precision_name(p)}: {what}")
    kinds = {r.get("memory_kind") for g in groups for r in g}
    _group_axis(ax, labels)
    ax.set_ylim(0, top * 1.2)
    ax.set_ylabel("peak memory per GPU (GB)" if kinds <= {"cuda", None} else "peak memory (GB; host RSS on CPU)")
    ax.grid(axis="x", visible=False)
    handles = _legend_handles(order, order, "bar")
    if any_failed:
        handles.append(_hatched("//", "run did not finish ok\n(peak when it stopped)", alpha=0.45))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Peak memory" + (f" — {common}" if common else ""), fontweight="bold")
    fig.tight_layout()
    return _png(fig)


def all_plots(rows: list[dict], steps_by_run: dict[int, list[dict]]) -> dict[str, bytes]:
    """Every figure with data, by file name."""
    figures = {
        "throughput_vs_seq.png": throughput_vs_seq(rows),
        "speedup.png": speedup_bars(rows),
        "loss_curves.png": loss_curves(rows, steps_by_run),
        "peak_memory.png": memory_bars(rows),
    }
    return {name: png for name, png in figures.items() if png}


def convergence_curves(runs: list[dict], title: str = "") -> bytes:
    """``lpbench converge``'s figure: loss against tokens (left) and the gap to the first run (right).

    ``runs``: ``{"precision", "status", "ok", "verdict", "tolerance", "train": [(tokens, loss)], "val": [...]}``,
    the reference first (``tolerance``: the gap in % a run passes with, or None). Left: training loss (trailing 10-step mean, thin) and validation loss
    (dots), one colour per recipe; a stopped run ends in a red cross. Right: the relative gap of
    the validation loss (or, without one, of the mean training loss) to the reference's, in %,
    with the tolerances as dotted and dashed lines.
    """
    plt = _plt()
    order = [r["precision"] for r in runs]
    use_val = any(r["val"] for r in runs)
    most = max([t for r in runs for t, _ in r["train"]] + [1])
    scale, unit = next(
        (s, u) for s, u in ((1e9, "billions"), (1e6, "millions"), (1e3, "thousands"), (1, "")) if most >= s
    )
    xlabel = f"training tokens ({unit})" if unit else "training tokens"
    fig, (ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.25, 1]})
    handles = []
    tops, bottoms = [], []
    for i, r in enumerate(runs):
        c = colour(r["precision"], order)
        ls = ":" if "@ seed" in r["precision"] else "--" if "-no-" in r["precision"] else "-"  # noise run, ablation
        pts = [(t / scale, v) for t, v in _gap_series(r, False).items()]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, lw=1.0, alpha=0.5, color=c, ls=ls)
            tops.append(ys[min(len(ys) - 1, len(ys) // 10)])
            bottoms.append(min(ys))
            if not r["ok"]:
                ax.plot(xs[-1], ys[-1], marker="x", ms=9, mew=2, color=FAILED)
                ax.annotate(
                    r["status"], (xs[-1], ys[-1]), xytext=(6, 6), textcoords="offset points", fontsize=7, color=FAILED
                )
        if r["val"]:
            vx, vy = zip(*[(t / scale, v) for t, v in r["val"]])
            ax.plot(vx, vy, lw=1.8, color=c, ls=ls, marker="o", ms=3.5)
            bottoms.append(min(vy))
        note = r["verdict"] if r["ok"] else r["status"]
        handles.append(plt.Line2D([0], [0], color=c, ls=ls, lw=2, label=f"{r['precision']}  ({note})"))
    if tops and bottoms:
        lo, hi = min(bottoms), max(tops)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(
        "Training loss (10-step mean, thin) and validation loss (dots)" if use_val else "Training loss (10-step mean)"
    )

    ref = runs[0]
    ref_curve = _gap_series(ref, use_val)
    for r in runs[1:]:
        if not ref_curve:
            break
        pts = [
            (x / scale, (v - ref_curve[x]) / ref_curve[x] * 100)
            for x, v in _gap_series(r, use_val).items()
            if x in ref_curve
        ]
        if pts:
            gx, gy = zip(*pts)
            gap_ax.plot(
                gx,
                gy,
                lw=1.8,
                marker="o",
                ms=3.5,
                color=colour(r["precision"], order),
                ls="--" if "-no-" in r["precision"] else "-",
            )
    gap_ax.axhline(0, color=colour(ref["precision"], order), lw=1.2)
    used = sorted({r["tolerance"] for r in runs[1:] if r.get("tolerance") is not None})
    tol_handles = []
    for tol, style in zip(used, [(0, (1, 1)), (0, (4, 2)), (0, (6, 2, 1, 2)), (0, (2, 4))] * 4):
        names = "/".join(r["precision"] for r in runs[1:] if r.get("tolerance") == tol)
        tol_handles.append(gap_ax.axhline(tol, color="#555", lw=1.1, ls=style, label=f"tolerance {tol:g}% ({names})"))
    if tol_handles:
        gap_ax.legend(handles=tol_handles, loc="best", framealpha=0.9, frameon=True, edgecolor="none")
        low, high = gap_ax.get_ylim()
        gap_ax.set_ylim(low, max(high, max(used) + 0.15 * (max(used) - low)))
    gap_ax.set_xlabel(xlabel)
    gap_ax.set_ylabel(f"gap to {ref['precision']} (%)")
    gap_ax.set_title(
        f"{'Validation' if use_val else 'Training (10-step mean)'} loss relative to "
        f"{ref['precision']} (lower is better)"
    )
    fig.suptitle(
        "Convergence: same model, seed and data order per recipe" + (f"\n{title}" if title else ""), fontweight="bold"
    )
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), bbox_to_anchor=(0.5, 0.0))
    return _png(fig)


def _gap_series(run: dict, use_val: bool) -> dict:
    """Tokens -> loss to compare: validation points, or the trailing 10-step mean of training loss."""
    if use_val:
        return {t: v for t, v in run["val"] if _finite(v)}
    out, window = {}, []
    for t, v in run["train"]:
        if not _finite(v):
            break
        window = (window + [v])[-10:]
        out[t] = sum(window) / len(window)
    return out

"""``lpbench report``: read the results database, print tables, write plots and the HTML page."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.paths import check_dir, check_file, write_file
from lpbench.report import tables


def select_runs(runs: list[dict], groups: list[str] | None) -> list[dict]:
    """Runs whose group id (a ``lpbench run`` invocation) or sweep id is one of ``groups``."""
    if not groups:
        return runs
    wanted = [g for item in groups for g in item.split(",") if g.strip()]
    known = {r.get("group_id") for r in runs} | {r.get("sweep_id") for r in runs}
    missing = [g for g in wanted if g not in known]
    if missing:
        recent = list(dict.fromkeys(r.get("sweep_id") or r.get("group_id") for r in reversed(runs)))[:8]
        raise UsageError(f"no runs in group {', '.join(missing)}; recent groups: {', '.join(map(str, recent))}")
    return [r for r in runs if r.get("group_id") in wanted or r.get("sweep_id") in wanted]


def merged_runs(stores: list) -> tuple[list[dict], dict]:
    """The runs of several databases as one list, and ``{run id: its store}``. With more than one
    database a run's id becomes ``N:id`` (N counts the databases from 1) and its row names its
    database (``results``), so that neither ids nor comparison groups mix databases."""
    runs, where = [], {}
    for n, store in enumerate(stores, 1):
        for r in store.runs():
            if len(stores) > 1:
                r = {**r, "id": f"{n}:{r['id']}", "db_id": r["id"], "results": str(store.path)}
            where[r["id"]] = store
            runs.append(r)
    return runs, where


def _when(r: dict) -> str:
    return (r.get("created_at") or "")[:16].replace("T", " ")


def group_list(runs: list[dict]) -> list[dict]:
    """One entry per ``lpbench run`` invocation or sweep: id, when it started, its runs, precisions,
    models, database, and the settings in which it differs from the other groups."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tables.run_group(r), []).append(r)
    differs = tables.group_differences(runs)
    return [
        {
            "group": gid,
            "kind": "sweep" if members[0].get("sweep_id") else "run",
            "when": min(_when(r) for r in members),
            "runs": len(members),
            "precisions": list(dict.fromkeys(r.get("precision") for r in members)),
            "models": list(dict.fromkeys(r.get("model") for r in members)),
            "statuses": dict(Counter(r.get("status") for r in members)),
            "results": results,
            "differs": differs[results, gid],
        }
        for (results, gid), members in groups.items()
    ]


def print_group_list(groups: list[dict], as_json: bool) -> None:
    if as_json:
        print(json.dumps(groups, indent=2, default=str))
        return
    from rich.table import Table
    from rich.text import Text

    from lpbench.console import console

    table = Table(title="lpbench report --list: groups (pass one to --group)")
    for name in ("group", "when (UTC)", "runs", "precisions", "models", "what differs"):
        table.add_column(
            name, no_wrap=name in ("group", "when (UTC)", "runs"), justify="right" if name == "runs" else "left"
        )
    for g in groups:
        status = ", ".join(f"{n} {s}" for s, n in g["statuses"].items())
        table.add_row(
            Text(f"{g['group']}" + (f"\n({g['kind']})")),
            Text(g["when"]),
            Text(f"{g['runs']}\n{status}"),
            Text(", ".join(map(str, g["precisions"]))),
            Text(", ".join(map(str, g["models"]))),
            Text(tables.differences_text(g["differs"]) or "-"),
        )
    console.print(table)


def report_markdown(rows: list[dict], plot_files: list[Path] = (), wide: bool = False) -> str:
    """The report as markdown: columns whose every cell is the same are named in a note, unless ``wide``."""
    if not rows:
        return "No runs recorded."
    blocks = [(t if wide else t.compact()).to_markdown() for t in tables.workload_tables(rows)]
    blocks += [t.to_markdown(level=3) for t in tables.time_to_train_tables(rows)]
    if plot_files:
        blocks.append("## Plots\n\n" + "\n".join(f"![{tables.md_escape(p.stem)}](<{p}>)" for p in plot_files))
    return "\n\n".join(blocks)


def run_report(args, open_store) -> int:
    """``lpbench report``; ``open_store()`` opens the results databases (each a ``bench.store.ResultsStore``, the
    command layer's, so that reports need not import the layer that records runs), reported as one."""
    if args.html:
        check_file(args.html, "--html")
    if args.plots:
        check_dir(args.plots, "--plots")
    stores = open_store()
    all_runs, where = merged_runs(stores)
    if getattr(args, "list", False):
        print_group_list(group_list(all_runs), args.format == "json")
        return 0
    runs = select_runs(all_runs, args.group)
    rows = tables.summary_rows(runs)
    plots: dict[str, bytes] = {}
    plot_files: list[Path] = []
    if args.plots or args.html:
        from lpbench.report.plots import all_plots

        plots = all_plots(rows, {r["id"]: where[r["id"]].steps(r.get("db_id", r["id"])) for r in runs})
    if args.plots:
        out = Path(args.plots)
        for name, png in plots.items():
            write_file(out / name, png)
            plot_files.append(out / name)
        print(f"lpbench report: {len(plot_files)} plots in {out}", file=sys.stderr)
    if args.html:
        from lpbench.report.html import render_page

        page_tables = tables.workload_tables(rows) + tables.time_to_train_tables(rows) if rows else []
        systems = sorted({r["system"] for r in rows})
        meta = [
            f"{len(rows)} runs from {', '.join(str(s.path) for s in stores)}"
            + (f" (groups: {', '.join(args.group)})" if args.group else ""),
            f"systems: {', '.join(systems) or 'none'}; statuses: "
            + ", ".join(f"{s} {n}" for s, n in Counter(r["status"] for r in rows).items()),
        ]
        page = Path(args.html)
        write_file(page, render_page(page_tables, plots, meta=meta))
        print(f"lpbench report: wrote {page}", file=sys.stderr)
    render = {
        "md": lambda r: report_markdown(r, plot_files, getattr(args, "wide", False)),
        "csv": tables.to_csv,
        "json": tables.to_json,
    }[args.format]
    text = render(rows)
    try:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
    except BrokenPipeError:  # `lpbench report | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

"""``lpbench report``: read the results database, print tables, write plots and the HTML page."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.paths import check_dir, check_file, write_file
from lpbench.report.tables import md_escape, summary_rows, time_to_train_tables, to_csv, to_json, workload_tables


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


def report_markdown(rows: list[dict], plot_files: list[Path] = ()) -> str:
    if not rows:
        return "No runs recorded."
    blocks = [t.to_markdown() for t in workload_tables(rows)]
    blocks += [t.to_markdown(level=3) for t in time_to_train_tables(rows)]
    if plot_files:
        blocks.append("## Plots\n\n" + "\n".join(f"![{md_escape(p.stem)}](<{p}>)" for p in plot_files))
    return "\n\n".join(blocks)


def run_report(args, open_store) -> int:
    """``lpbench report``; ``open_store()`` opens the results database (a ``bench.store.ResultsStore``: the
    command layer's, so that reports need not import the layer that records runs)."""
    if args.html:
        check_file(args.html, "--html")
    if args.plots:
        check_dir(args.plots, "--plots")
    store = open_store()
    runs = select_runs(store.runs(), args.group)
    rows = summary_rows(runs)
    plots: dict[str, bytes] = {}
    plot_files: list[Path] = []
    if args.plots or args.html:
        from lpbench.report.plots import all_plots

        plots = all_plots(rows, {r["id"]: store.steps(r["id"]) for r in runs})
    if args.plots:
        out = Path(args.plots)
        for name, png in plots.items():
            write_file(out / name, png)
            plot_files.append(out / name)
        print(f"lpbench report: {len(plot_files)} plots in {out}", file=sys.stderr)
    if args.html:
        from lpbench.report.html import render_page

        tables = workload_tables(rows) + time_to_train_tables(rows) if rows else []
        systems = sorted({r["system"] for r in rows})
        meta = [f"{len(rows)} runs from {store.path}" + (f" (groups: {', '.join(args.group)})" if args.group else ""),
                f"systems: {', '.join(systems) or 'none'}; statuses: "
                + ", ".join(f"{s} {sum(r['status'] == s for r in rows)}"
                            for s in dict.fromkeys(r["status"] for r in rows))]
        page = Path(args.html)
        write_file(page, render_page(tables, plots, meta=meta))
        print(f"lpbench report: wrote {page}", file=sys.stderr)
    render = {"md": lambda r: report_markdown(r, plot_files), "csv": to_csv, "json": to_json}[args.format]
    text = render(rows)
    try:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)
    except BrokenPipeError:  # `lpbench report | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0

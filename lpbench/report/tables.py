"""Summary tables from result rows: one row per run, speedup against the first run of its group.

A group is one comparison: the same invocation (``group_id``), workload, model, sequence
length, batch sizes and GPU count. Renders to a rich table, markdown, CSV or JSON.
"""

from __future__ import annotations

import csv
import io
import json

from rich.table import Table

COLUMNS = [  # (key, header, format)
    ("model", "model", "{}"),
    ("precision", "precision", "{}"),
    ("path", "path", "{}"),
    ("batch", "GBS/MBS/seq", "{}"),
    ("num_gpus", "GPUs", "{}"),
    ("step_time_ms", "step ms", "{:.1f}"),
    ("tokens_per_sec_per_gpu", "tokens/s/GPU", "{:,.0f}"),
    ("tflops_per_gpu", "TFLOP/s/GPU", "{:.3g}"),
    ("mfu_bf16", "MFU", "{:.1%}"),
    ("peak_mem_gb", "peak mem GB", "{:.2f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("status", "status", "{}"),
]


def _group_key(r: dict) -> tuple:
    return (r.get("group_id"), r.get("workload"), r.get("model"), r.get("seq_len"), r.get("mbs"), r.get("gbs"),
            r.get("num_gpus"))


def summary_rows(runs: list[dict]) -> list[dict]:
    """Flatten stored runs into table rows with speedup vs the first ok run of each group."""
    baselines: dict[tuple, float] = {}
    rows = []
    for r in runs:
        tps = r.get("tokens_per_sec_per_gpu")
        key = _group_key(r)
        if r["status"] == "ok" and tps and key not in baselines:
            baselines[key] = tps
        base = baselines.get(key)
        status = r["status"] if not r.get("error") else f"{r['status']}: {r['error']}"
        rows.append({
            "id": r.get("id"), "group_id": r.get("group_id"), "workload": r.get("workload"),
            "model": r["model"], "precision": r["precision"], "backend": r.get("backend"), "path": r.get("path"),
            "batch": f"{int(r['gbs'])}/{int(r['mbs'])}/{int(r['seq_len'])}", "num_gpus": r.get("num_gpus"),
            "gpu": r.get("gpu") or "cpu",
            "step_time_ms": r["step_time_s"] * 1e3 if r.get("step_time_s") else None,
            "tokens_per_sec_per_gpu": tps, "tflops_per_gpu": r.get("tflops_per_gpu"),
            "mfu_bf16": r.get("mfu_bf16"), "mfu_precision": r.get("mfu_precision"),
            "peak_mem_gb": r.get("peak_mem_allocated_gb"), "final_loss": r.get("final_loss"),
            "speedup": tps / base if tps and base else None, "status": status,
        })
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "n/a" if v is None else fmt.format(v)


def to_rich(rows: list[dict], title: str | None = None) -> Table:
    table = Table(title=title)
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="left" if header in ("model", "precision", "path", "status") else "right")
    for row in rows:
        table.add_row(*(_cell(row, k, f) for k, _, f in COLUMNS))
    return table


def to_markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def to_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2)

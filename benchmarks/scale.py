"""A scaling table in one command: the same per-GPU work on 1, 2, 4 ... GPUs in several layouts.

Weak scaling: every GPU does the work of the one-GPU run (``--gbs-per-gpu`` sequences a step), so
the global batch grows with the GPU count and efficiency = tokens/s/GPU of the layout over
tokens/s/GPU of the one-GPU run of the same precision, measured in this call. Each (GPU count,
layout) is one ``lpbench run`` of every precision, its own results folder and log under ``--out``.

    PYTHONPATH=. python benchmarks/scale.py --model llama3-8b --num-layers 16 --seq-len 8192 \\
        --gpus 1,4 --layouts ddp,fsdp --precision bf16,fp8-tensorwise --out $OUT/scale

Layouts (``--layouts``): ``ddp``, ``fsdp``, or ``NAME=FLAGS`` for any other (``tp2='--tp 2'``;
a layout whose flags shrink the data-parallel size keeps the same global batch, so its
efficiency is strong scaling against the same one-GPU run). Printed last: a markdown table with
tokens/s/GPU (median of the timed steps, and the quartiles of those steps' own rates), model
TFLOP/s/GPU, efficiency, the ratio to BF16 of the same layout, and peak memory.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

LAYOUTS = {"ddp": [], "fsdp": ["--fsdp"]}
# NVLink multicast off for every multi-GPU run (NCCL NVLS, symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_layouts(text: str) -> dict[str, list[str]]:
    layouts = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, flags = item.partition("=")
        if eq:
            layouts[name] = shlex.split(flags)
        elif name in LAYOUTS:
            layouts[name] = LAYOUTS[name]
        else:
            raise SystemExit(f"scale.py: unknown layout {name!r}; give ddp, fsdp or NAME='FLAGS'")
    return layouts


def plan(args) -> list[tuple[str, int, list[str]]]:
    """(name, GPUs, lpbench run flags) for each run of the table, the one-GPU run first."""
    gpus = sorted({int(g) for g in args.gpus.split(",")})
    if not gpus or gpus[0] < 1:
        raise SystemExit("scale.py: --gpus takes GPU counts >= 1, e.g. 1,2,4")
    common = [
        "--model",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--mbs",
        str(args.mbs),
        "--steps",
        str(args.steps),
        "--warmup-steps",
        str(args.warmup_steps),
        "--precision",
        args.precision,
        *(["--num-layers", str(args.num_layers)] if args.num_layers else []),
        *shlex.split(args.extra),
    ]
    runs = []
    for n in gpus:
        for layout, flags in ({"single": []} if n == 1 else parse_layouts(args.layouts)).items():
            launch = ["--nproc-per-node", str(n)] if n > 1 else []
            runs.append((f"{n}gpu-{layout}", n, [*common, "--gbs", str(args.gbs_per_gpu * n), *launch, *flags]))
    return runs


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def rows_of(results: Path, name: str, gpus: int) -> list[dict]:
    """One row per precision of a finished run folder: its summary and the spread of its timed steps."""
    from lpbench.bench.store import ResultsStore

    store = ResultsStore(results, create=False)
    try:
        out = []
        for run in store.runs():
            m = run["metrics"]
            timed = [
                s["tokens_per_sec_per_gpu"]
                for s in store.steps(run["id"])
                if s["step"] > run["config"].get("warmup_steps", 0) and s["tokens_per_sec_per_gpu"]
            ]
            out.append(
                {
                    "name": name,
                    "layout": name.split("-", 1)[1],
                    "gpus": gpus,
                    "precision": run["precision"],
                    "status": run["status"],
                    "tps": run["tokens_per_sec_per_gpu"],
                    "spread": quartiles(timed),
                    "tflops": run["tflops_per_gpu"],
                    "peak_gb": m.get("peak_mem_allocated_gb"),
                }
            )
        return out
    finally:
        store.close()


def table(rows: list[dict]) -> str:
    """Markdown: efficiency against the one-GPU row of the same precision, ratio to BF16 of the same run."""
    single = {r["precision"]: r["tps"] for r in rows if r["gpus"] == 1 and r["tps"]}
    bf16 = {r["name"]: r["tps"] for r in rows if r["precision"] == "bf16" and r["tps"]}
    lines = [
        "| layout | GPUs | precision | tokens/s/GPU (q1-q3 of steps) | TFLOP/s/GPU | efficiency | vs BF16 | peak GB |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r["tps"]:
            lines.append(f"| {r['layout']} | {r['gpus']} | {r['precision']} | {r['status']} | | | | |")
            continue
        q1, q3 = r["spread"]
        eff = f"{r['tps'] / single[r['precision']]:.1%}" if r["precision"] in single else "-"
        ratio = f"{r['tps'] / bf16[r['name']]:.3f}x" if r["name"] in bf16 else "-"
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        lines.append(
            f"| {r['layout']} | {r['gpus']} | {r['precision']} | {r['tps']:,.0f} ({q1:,.0f}-{q3:,.0f}) | "
            f"{r['tflops']:.1f} | {eff} | {ratio} | {peak} |"
        )
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--gbs-per-gpu", type=int, default=8, help="sequences per GPU per step (the one-GPU GBS)")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts, comma-separated (1 is the baseline)")
    p.add_argument("--layouts", default="ddp,fsdp", help="ddp, fsdp or NAME='FLAGS', comma-separated")
    p.add_argument("--precision", default="bf16,fp8-tensorwise")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--extra", default="", help="more lpbench run flags for every run, one string")
    p.add_argument("--out", type=Path, required=True, help="folder for each run's results and log")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if args.gbs_per_gpu % args.mbs:
        raise SystemExit("scale.py: --gbs-per-gpu must be a multiple of --mbs")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    runs = plan(args)
    if args.dry_run:
        for name, _, flags in runs:
            print(f"{name}: lpbench run {shlex.join(flags)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], 0
    for name, gpus, flags in runs:
        results = args.out / name
        cmd = [sys.executable, "-m", "lpbench", "run", *flags, "--results", str(results)]
        print(f"=== {name}: {shlex.join(cmd[1:])}", flush=True)
        with open(args.out / f"{name}.log", "w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **NO_MULTICAST})
        failed |= done.returncode != 0
        if (results / "results.db").exists():
            rows += rows_of(results, name, gpus)
        else:
            print(f"    no results (exit {done.returncode}); see {name}.log", flush=True)
    print(table(rows))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())

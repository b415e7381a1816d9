"""A scaling table in one command: the same per-GPU work on 1, 2, 4 ... GPUs in several layouts.

Weak scaling: every GPU does the work of the one-GPU run (``--gbs-per-gpu`` sequences a step), so
the global batch grows with the GPU count and efficiency = tokens/s/GPU of the layout over
tokens/s/GPU of the one-GPU run of the same precision, measured in this call. Each (GPU count,
layout) is one ``lpbench run`` of every precision (one run per precision where it leaves GPUs of
``--gpus-available`` free, so runs can share the host), with its own results folder and log under
``--out``, run under coreutils ``timeout`` (``--timeout`` per precision; the whole call within
``--budget`` seconds: a run not started in time is reported as skipped).

    PYTHONPATH=. python benchmarks/scale.py --model llama3-8b --num-layers 16 --seq-len 8192 \\
        --gpus 1,2,4 --layouts ddp,fsdp --precision bf16,fp8-tensorwise --gpus-available 4 --out $OUT/scale

Layouts (``--layouts``): ``ddp``, ``fsdp``, or ``NAME=FLAGS`` for any other (``tp2='--tp 2'``;
a layout whose flags shrink the data-parallel size keeps the same global batch, so its
efficiency is strong scaling against the same one-GPU run). ``--knob NAME=FLAGS`` adds a layout
run at the largest GPU count only (A/B rows: ``fsdp-zero2='--fsdp --fsdp-shard zero2'``); a knob's or
row's own ``--precision A,B`` replaces ``--precision`` for it, and its ``NAME=VALUE`` words are its
environment (``fsdp-nccl8='NCCL_MAX_NCHANNELS=8 --fsdp'``).
``--row NAME:GPUS:FLAGS`` adds a run of its own flags (another model or batch) to a second table,
and ``--extrapolate A,B:BLOCKS`` fits those two rows' step times linearly in their block counts
and prints tokens/s/GPU at BLOCKS blocks. ``--profile-layouts`` profiles one more step of those
layouts' runs at the largest GPU count (left out of their timing) and adds the NCCL kernel time per step and the
part of it no compute kernel overlapped (``lpbench.metrics.trace.exposed_comm``; mean over the
ranks' traces).

``--gpus-available N`` runs jobs side by side on disjoint GPUs of one host
(``CUDA_VISIBLE_DEVICES``), in order (the table's runs, the ``--row`` runs, the knobs), each starting
once enough GPUs are free (a later, smaller job may start first where it fits). Printed last: markdown tables with tokens/s/GPU
(median of the timed steps, and the quartiles of those steps' own rates), model TFLOP/s/GPU,
efficiency, the ratio to BF16 of the same layout, peak memory and (profiled) communication.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {"ddp": [], "fsdp": ["--fsdp"]}
# NVLink multicast off for every multi-GPU run (NCCL NVLS, symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MIN_START_S = 45  # a job is not started with less of the budget left: it could not get past compilation
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # a knob's or row's leading NAME=VALUE words: its environment


class Job:
    """One ``lpbench run``: its table row name (``4gpu-fsdp``), GPUs, precisions, flags and table
    (``weak``: the scaling table; ``rows``: the table of ``--row`` runs). A plain class: the script is
    loaded by path in tests, where a dataclass cannot resolve its annotations."""

    def __init__(self, name: str, gpus: int, precisions: list[str], flags: list[str], table: str = "weak"):
        self.name, self.gpus, self.precisions, self.table = name, gpus, precisions, table
        self.env = dict(f.split("=", 1) for f in flags if ENV.match(f))
        self.flags = [f for f in flags if not ENV.match(f)]

    @property
    def folder(self) -> str:
        return self.name if len(self.precisions) > 1 else f"{self.name}-{self.precisions[0]}"


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


def layout_of(name: str) -> str:
    """The layout column of a row: ``fsdp`` of ``4gpu-fsdp``; a ``--row`` run's own name."""
    return name.split("-", 1)[1] if "gpu-" in name else name


def parse_row(text: str) -> tuple[str, int, list[str]]:
    name, gpus, flags = (text.split(":", 2) + ["", ""])[:3]
    if not name or not gpus.isdigit() or int(gpus) < 1 or not flags.strip():
        raise SystemExit(f"scale.py: --row takes NAME:GPUS:FLAGS, got {text!r}")
    return name, int(gpus), shlex.split(flags)


def own_precisions(flags: list[str], default: list[str]) -> tuple[list[str], list[str]]:
    """(precisions, the other flags): a knob's or row's own ``--precision A,B`` replaces the table's."""
    mine, rest, i = default, [], 0
    while i < len(flags):
        if flags[i] == "--precision":
            if i + 1 >= len(flags):
                raise SystemExit("scale.py: --precision in a knob or row needs a value")
            mine, i = [p for p in flags[i + 1].split(",") if p], i + 2  # the last one counts, as in lpbench run
        else:
            rest.append(flags[i])
            i += 1
    return mine, rest


def jobs_of(name: str, gpus: int, precisions: list[str], flags: list[str], args, table: str = "weak") -> list[Job]:
    """One job of every precision, or one per precision where it leaves GPUs free for others."""
    launch = ["--nproc-per-node", str(gpus)] if gpus > 1 else []
    if gpus < args.gpus_available:
        return [Job(name, gpus, [p], [*flags, "--precision", p, *launch], table) for p in precisions]
    return [Job(name, gpus, precisions, [*flags, "--precision", ",".join(precisions), *launch], table)]


def plan(args) -> list[Job]:
    """The jobs of the table (the one-GPU runs first), then the ``--row`` runs, then the knobs at the largest
    GPU count."""
    gpus = sorted({int(g) for g in args.gpus.split(",")})
    if not gpus or gpus[0] < 1:
        raise SystemExit("scale.py: --gpus takes GPU counts >= 1, e.g. 1,2,4")
    precisions = [p for p in args.precision.split(",") if p]
    profiled = set(filter(None, args.profile_layouts.split(",")))
    knobs = {}
    for knob in args.knob:
        name, eq, flags = knob.partition("=")
        if not eq or not name:
            raise SystemExit(f"scale.py: --knob takes NAME=FLAGS, got {knob!r}")
        knobs[name] = shlex.split(flags)
    common = [
        "--model",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--mbs",
        str(args.mbs),
        "--warmup-steps",
        str(args.warmup_steps),
        *(["--num-layers", str(args.num_layers)] if args.num_layers else []),
        *shlex.split(args.extra),
    ]
    grid = [(n, layout, flags) for n in gpus for layout, flags in parse_layouts(args.layouts).items() if n > 1]
    grid = [(1, "single", []) for _ in gpus[:1] if gpus[0] == 1] + grid
    knobs = [(gpus[-1], name, flags) for name, flags in knobs.items()]

    def table_jobs(n: int, layout: str, flags: list[str]) -> list[Job]:
        steps = ["--steps", str(args.steps)]
        if n > 1 and n == gpus[-1] and layout in profiled:  # one more step, profiled, left out of the timing
            steps = ["--steps", str(args.steps + 1), "--profile-steps", f"{args.steps + 1}:{args.steps + 1}"]
        mine, flags = own_precisions(flags, precisions)
        return jobs_of(f"{n}gpu-{layout}", n, mine, [*common, *steps, "--gbs", str(args.gbs_per_gpu * n), *flags], args)

    jobs = [job for n, layout, flags in grid for job in table_jobs(n, layout, flags)]
    for name, n, flags in map(parse_row, args.row):
        jobs += jobs_of(name, n, *own_precisions(flags, precisions), args, table="rows")
    jobs += [job for n, layout, flags in knobs for job in table_jobs(n, layout, flags)]
    return jobs


def run_jobs(jobs: list[Job], args) -> dict[str, str]:
    """Run ``jobs`` on ``args.gpus_available`` GPUs (see the module doc); each job's outcome by folder:
    ``ok``, ``exit N``, ``timeout`` or ``skipped``."""
    free = list(range(args.gpus_available))
    queue, running, outcome = list(jobs), {}, {}
    start = time.monotonic()
    while queue or running:
        left = args.budget - (time.monotonic() - start) if args.budget else None
        for job in list(queue):
            if job.gpus > args.gpus_available or (left is not None and left < MIN_START_S):
                outcome[job.folder] = "skipped" if job.gpus <= args.gpus_available else "skipped (too few GPUs)"
                print(f"=== {job.folder}: {outcome[job.folder]}", flush=True)
                queue.remove(job)
                continue
            if job.gpus > len(free):
                continue
            take, free = free[: job.gpus], free[job.gpus :]
            limit = args.timeout * len(job.precisions)
            limit = int(min(limit, left) if left is not None else limit)
            results = args.out / job.folder
            cmd = ["timeout", "-k", "20", str(limit), sys.executable, "-m", "lpbench", "run", *job.flags]
            cmd += ["--results", str(results)]
            env = {**os.environ, **NO_MULTICAST, **job.env}
            if args.gpus_available > 1:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in take)
            print(f"=== {job.folder} (GPUs {take}, limit {limit} s): {shlex.join(cmd[5:])}", flush=True)
            log = open(args.out / f"{job.folder}.log", "w")
            running[subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)] = (
                job,
                take,
                log,
                time.monotonic(),
            )
            queue.remove(job)
        for proc in [p for p in running if p.poll() is not None]:
            job, take, log, began = running.pop(proc)
            log.close()
            free = sorted(free + take)
            rc = proc.returncode
            outcome[job.folder] = "ok" if rc == 0 else "timeout" if rc in (124, 137) else f"exit {rc}"
            print(f"    {job.folder}: {outcome[job.folder]} in {time.monotonic() - began:.0f} s", flush=True)
        if running:
            time.sleep(1)
    return outcome


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def comm_of(trace: str | None, steps: int) -> tuple[float, float] | None:
    """(NCCL ms, exposed NCCL ms) per step, the mean over every rank's trace beside ``trace``; None without one."""
    from lpbench.metrics import trace as chrome_trace

    if not trace or not Path(trace).is_file():
        return None
    paths = sorted(Path(trace).parent.glob("trace-rank*.json")) or [Path(trace)]
    per_rank = [chrome_trace.exposed_comm(chrome_trace.read(p)) for p in paths]
    steps = max(steps, 1)
    return (
        statistics.fmean(c for c, _ in per_rank) / steps,
        statistics.fmean(e for _, e in per_rank) / steps,
    )


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
                if s["step"] > run["config"].get("warmup_steps", 0)
                and s["tokens_per_sec_per_gpu"]
                and not s.get("profiled")
            ]
            prof = m.get("profile") or {}
            first, _, last = str(prof.get("steps", "")).partition(":")
            n_prof = int(last) - int(first) + 1 if first.isdigit() and last.isdigit() else 1
            cfg = run["config"]
            out.append(
                {
                    "name": name,
                    "layout": layout_of(name),
                    "gpus": gpus,
                    "precision": run["precision"],
                    "status": run["status"],
                    "tps": run["tokens_per_sec_per_gpu"],
                    "spread": quartiles(timed),
                    "tflops": run["tflops_per_gpu"],
                    "peak_gb": m.get("peak_mem_allocated_gb"),
                    "comm": comm_of(prof.get("trace"), n_prof),
                    "blocks": cfg.get("num_layers"),
                    "tokens_per_step": (cfg.get("gbs") or 0) * (cfg.get("seq_len") or 0),
                }
            )
        return out
    finally:
        store.close()


def _cells(r: dict, eff: str, ratio: str) -> str:
    q1, q3 = r["spread"]
    peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
    comm = "- | -" if not r.get("comm") else f"{r['comm'][0]:.0f} | {r['comm'][1]:.0f}"
    return f"{r['tps']:,.0f} ({q1:,.0f}-{q3:,.0f}) | {r['tflops']:.1f} | {eff} | {ratio} | {peak} | {comm} |"


HEADER = (
    "tokens/s/GPU (q1-q3 of steps) | TFLOP/s/GPU | efficiency | vs BF16 | peak GB | NCCL ms/step | exposed ms/step |"
)


def table(rows: list[dict]) -> str:
    """Markdown: efficiency against the one-GPU row of the same precision, ratio to BF16 of the same run."""
    single = {r["precision"]: r["tps"] for r in rows if r["gpus"] == 1 and r["tps"]}
    bf16 = {r["name"]: r["tps"] for r in rows if r["precision"] == "bf16" and r["tps"]}
    lines = [f"| layout | GPUs | precision | {HEADER}", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["tps"]:
            lines.append(f"| {r['layout']} | {r['gpus']} | {r['precision']} | {r['status']} | | | | | | |")
            continue
        eff = f"{r['tps'] / single[r['precision']]:.1%}" if r["precision"] in single else "-"
        ratio = f"{r['tps'] / bf16[r['name']]:.3f}x" if r["name"] in bf16 else "-"
        lines.append(f"| {r['layout']} | {r['gpus']} | {r['precision']} | {_cells(r, eff, ratio)}")
    return "\n".join(lines)


def extrapolate(rows: list[dict], spec: str) -> list[str]:
    """Lines: tokens/s/GPU at BLOCKS blocks from the step times of rows A and B (``A,B:BLOCKS``), linear in the
    block count, per precision both rows have."""
    names, _, blocks = spec.partition(":")
    a, _, b = names.partition(",")
    if not (a and b and blocks.isdigit()):
        raise SystemExit(f"scale.py: --extrapolate takes A,B:BLOCKS, got {spec!r}")
    by = {(r["name"], r["precision"]): r for r in rows if r["tps"]}
    out = []
    for (name, precision), ra in by.items():
        rb = by.get((b, precision))
        if name != a or rb is None or None in (ra["blocks"], rb["blocks"]) or ra["blocks"] == rb["blocks"]:
            continue
        step = [r["tokens_per_step"] / (r["tps"] * r["gpus"]) for r in (ra, rb)]  # seconds per step
        slope = (step[1] - step[0]) / (rb["blocks"] - ra["blocks"])
        at = step[0] + slope * (int(blocks) - ra["blocks"])
        tps = rb["tokens_per_step"] / (at * rb["gpus"])
        out.append(
            f"{a},{b} -> {blocks} blocks, {precision}: step {at:.3f} s, {tps:,.0f} tokens/s/GPU "
            f"({step[1] - step[0]:.3f} s per {rb['blocks'] - ra['blocks']} blocks)"
        )
    return out


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
    p.add_argument("--knob", action="append", default=[], help="NAME=FLAGS: a layout at the largest GPU count only")
    p.add_argument("--row", action="append", default=[], help="NAME:GPUS:FLAGS: a run of its own (second table)")
    p.add_argument("--extrapolate", action="append", default=[], help="A,B:BLOCKS over two --row runs")
    p.add_argument("--profile-layouts", default="", help="layouts (or knobs) whose multi-GPU runs profile a step")
    p.add_argument("--precision", default="bf16,fp8-tensorwise")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--extra", default="", help="more lpbench run flags for every table run, one string")
    p.add_argument("--gpus-available", type=int, default=1, help="GPUs of this host to run jobs side by side on")
    p.add_argument("--timeout", type=int, default=600, help="seconds one run may take (coreutils timeout)")
    p.add_argument("--budget", type=int, default=0, help="seconds for the whole call (0: no limit)")
    p.add_argument("--out", type=Path, required=True, help="folder for each run's results and log")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if args.gbs_per_gpu % args.mbs:
        raise SystemExit("scale.py: --gbs-per-gpu must be a multiple of --mbs")
    if args.gpus_available < 1 or args.timeout < 1 or args.budget < 0:
        raise SystemExit("scale.py: --gpus-available and --timeout must be positive, --budget >= 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    jobs = plan(args)
    for spec in args.extrapolate:
        extrapolate([], spec)  # refuse a malformed spec before any work
    if args.dry_run:
        for job in jobs:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in job.env.items())
            print(f"{job.folder} ({job.gpus} GPUs): {env + ' ' if env else ''}lpbench run {shlex.join(job.flags)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    outcome = run_jobs(jobs, args)
    rows = {"weak": [], "rows": []}
    for job in jobs:  # a precision without a result gets a row saying why
        results = args.out / job.folder
        got = rows_of(results, job.name, job.gpus) if (results / "results.db").exists() else []
        status = f"no results ({outcome.get(job.folder, 'not run')}; {job.folder}.log)"
        rows[job.table] += got + [
            {"name": job.name, "layout": layout_of(job.name), "gpus": job.gpus, "precision": p}
            | {"status": status, "tps": None}
            for p in job.precisions
            if p not in {r["precision"] for r in got}
        ]
    if rows["weak"]:
        print(table(rows["weak"]))
    if rows["rows"]:
        print()
        print(table(rows["rows"]).replace("| layout |", "| row |", 1))
    for spec in args.extrapolate:
        for line in extrapolate(rows["rows"], spec):
            print(line)
    return int(any(v != "ok" for v in outcome.values()))


if __name__ == "__main__":
    sys.exit(main())

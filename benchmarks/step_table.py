"""One call, one table: lpbench BF16, every FP8 recipe, torchao, emulated MXFP8/NVFP4 and the
Hugging Face + torch.compile baseline on the same work, each with where its step's time goes.

Each lpbench row is a run of one sweep (its own process, compiled per block) that profiles its
last two steps (``--profile-steps``; profiled steps are left out of the timing). The HF row is
``benchmarks/hf_baseline.py`` with the same profiler. Printed last: a markdown table with
tokens/s, model TFLOP/s, MFU, the ratio to lpbench BF16 of this call, and the profiled kernel time
per step split into GEMM / quantize / attention / other (other: the trace's kernel total less
the first three, comm included) and the kernel total, then each row's heaviest kernels and where the GPU
idled between kernels (the longest gaps, the kernels it waited for longest in all, and where the
host was when it launched the kernel after each gap: late launches, e.g. Python-launched kernels, against
kernels that were queued but waited on a dependency).

    python benchmarks/step_table.py --model llama3-8b --num-layers 16 --seq-len 8192 --mbs 1 \\
        --results $OUT/table                  # the 8B-class table, one H100
    python benchmarks/step_table.py --model llama3.2-1b --seq-len 4096 --mbs 2 \\
        --rows bf16,fp8-tensorwise,torchao:fp8-tensorwise

Rows (``--rows``, comma-separated): a recipe name (``mxfp8``/``nvfp4``/... run emulated where the
GPU lacks them), ``torchao:RECIPE`` (torchao's Float8Linear), ``hf`` (the baseline); suffixes change a
row's settings, for A/B: ``/fused-loss`` runs it with ``--fused-loss`` (the chunked LM head + cross-entropy),
``/model-scope`` with ``--compile-scope model`` (one compiled graph for the model, not one per block).
``--gbs`` above ``--mbs`` accumulates gradients, so the optimizer step is shared by GBS/MBS
micro-batches as in Megatron's runs; ``--no-profile`` times without the profiled steps (at large
GBS their traces cost minutes).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

import yaml

from lpbench.metrics import trace as chrome_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = (
    "bf16,fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-blockwise,torchao:fp8-tensorwise,"
    "torchao:fp8-rowwise,mxfp8,nvfp4,hf"
)
PARTS = ("gemm", "quantize", "attention", "other")


SUFFIXES = {"fused-loss": ("fused_loss", True), "model-scope": ("compile_scope", "model")}  # row suffix: setting


def spec_for(args, rows: list[str]) -> dict:
    recipes = []
    for row in rows:
        row, *suffixes = row.split("/")
        backend, _, precision = row.rpartition(":")
        point = {"precision": precision, "backend": backend or "lpbench"}
        for suffix in suffixes:
            if suffix not in SUFFIXES:
                raise SystemExit(
                    f"step_table.py: unknown row suffix /{suffix}; valid: {', '.join('/' + k for k in SUFFIXES)}"
                )
            key, value = SUFFIXES[suffix]
            point[key] = value
        if precision in ("mxfp8", "mxfp4", "nvfp4", "fp8-blockwise"):
            point["emulate"] = True  # native where the GPU has it, exact emulation where it does not
        recipes.append(point)
    spec = {
        "name": f"step-table-{time.strftime('%Y%m%d-%H%M%S')}",
        "timeout": args.timeout,
        "model": args.model,
        "seq_len": args.seq_len,
        "mbs": args.mbs,
        "gbs": args.gbs or args.mbs,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "recipe": recipes,
    }
    if args.profile:
        spec["profile_steps"] = f"{args.steps - 1}:{args.steps}"
    if args.num_layers:
        spec["num_layers"] = args.num_layers
    return spec


@lru_cache(maxsize=1)
def _trace_events(trace: str) -> list[dict]:
    return chrome_trace.read(trace)


def top_kernels(trace: str | None, steps: int, n: int) -> tuple[list[tuple[str, float]], float]:
    """The ``n`` kernels with the most device time per step in a Chrome trace, and the kernel
    total per step (ms): a check on the profile's breakdown, which sums the same kernels."""
    if not trace or not Path(trace).is_file():
        return [], 0.0
    per = Counter({name: ms / steps for name, ms in chrome_trace.kernel_totals(_trace_events(trace))[0].items()})
    return per.most_common(n), sum(per.values())


def idle_gaps(trace: str | None, steps: int, n: int) -> tuple[float, list[tuple[float, str, str]], list]:
    """GPU idle time per step (ms) inside the profiled steps' kernel span, the ``n`` longest gaps
    (ms, kernel before, kernel after), and the ``n`` kernels the device waited longest for in all
    (ms per step, name): where the device waited on the host."""
    if not trace or not Path(trace).is_file():
        return 0.0, [], []
    gaps = [
        ((after["ts"] - start) / 1e3, before["name"], after["name"])
        for start, before, after in chrome_trace.gaps(_trace_events(trace))
    ]
    waited = Counter()
    for ms, _, name in gaps:
        waited[name] += ms / steps
    return sum(g[0] for g in gaps) / steps, sorted(gaps, reverse=True)[:n], waited.most_common(n)


def _frame(name: str) -> str:
    """A Python frame's name without the directories before the package (``lpbench/...``, ``torch/...``)."""
    m = re.search(r"(?:^|/)((?:lpbench|torch|benchmarks|triton)/.*)$", name)
    return m.group(1) if m else name


def host_waits(trace: str | None, steps: int, n: int) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """Why the GPU idled: for each idle gap, whether the next kernel was launched only after the gap began
    (the host was late) and, if so, the innermost lpbench frame and the innermost Python frame on the
    launching thread at the launch (("lpbench frame | innermost frame", ms per step) for the ``n`` largest;
    gaps before a kernel launched earlier are summed as waiting on a dependency); and the ``n`` CUDA runtime
    calls that can block the host (synchronisations, copies) with their time per step."""
    if not trace or not Path(trace).is_file():
        return [], []
    events = _trace_events(trace)
    queries, queued = _late_launches(events)
    frames = sorted(
        ((e["ts"], -e["dur"], e["tid"], e["name"]) for e in events if e.get("cat") == "python_function" and "dur" in e)
    )
    stacks: dict = {}
    late = Counter()
    i = 0
    for t, tid, ms in sorted(queries):
        while i < len(frames) and frames[i][0] <= t:
            ts, neg, ftid, name = frames[i]
            stack = stacks.setdefault(ftid, [])
            while stack and stack[-1][0] < ts:
                stack.pop()
            stack.append((ts - neg, _frame(name)))
            i += 1
        stack = [f for f in stacks.get(tid, []) if f[0] >= t]
        stacks[tid] = stack
        names = [name for _, name in stack]
        ours = next((x for x in reversed(names) if x.startswith("lpbench/")), "-")
        late[f"{ours} | {names[-1] if names else '-'}"] += ms / steps
    late["(launched before the gap: the GPU waited on a dependency)"] += queued / steps
    blocking = Counter()
    for e in _blocking_calls(events):
        blocking[e["name"]] += e["dur"] / 1e3 / steps
    return late.most_common(n), blocking.most_common(n)


def _blocking_calls(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "cuda_runtime" and re.search(r"Synchronize|Memcpy", e["name"])]


def _late_launches(events: list[dict]) -> tuple[list[tuple[float, int, float]], float]:
    """Each idle gap whose next kernel the host launched only after the GPU ran dry, as (launch time, launching
    thread, idle ms), and the idle ms before kernels launched earlier (the GPU waited on a dependency)."""
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):  # Triton: driver
            launches[e["args"]["correlation"]] = e
    late, queued = [], 0.0
    for start, _, after in chrome_trace.gaps(events):
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] > start:  # the host launched it only after the GPU ran dry
            late.append((launch["ts"], launch["tid"], (after["ts"] - start) / 1e3))
        else:
            queued += (after["ts"] - start) / 1e3
    return late, queued


SINCE_BLOCKING_MS = (5.0, 50.0, 500.0)


def idle_after_blocking(trace: str | None, steps: int) -> list[tuple[str, float]]:
    """The host-late idle (ms per step) split by how long before the late launch the host last returned from a
    call that blocks it (a synchronisation or a copy): idle soon after one is the GPU refilling after the
    host drained it; idle long after one is the host falling behind on its own."""
    if not trace or not Path(trace).is_file():
        return []
    events = _trace_events(trace)
    ends = sorted(e["ts"] + e["dur"] for e in _blocking_calls(events))
    edges = [f"< {SINCE_BLOCKING_MS[0]:g} ms"] + [
        f"{a:g}-{b:g} ms" for a, b in zip(SINCE_BLOCKING_MS, SINCE_BLOCKING_MS[1:])
    ]
    edges.append(f">= {SINCE_BLOCKING_MS[-1]:g} ms or none before")
    split = dict.fromkeys(edges, 0.0)
    for t, _tid, ms in _late_launches(events)[0]:
        i = bisect.bisect_right(ends, t)
        since = (t - ends[i - 1]) / 1e3 if i else float("inf")
        split[edges[bisect.bisect_right(SINCE_BLOCKING_MS, since)]] += ms / steps
    return list(split.items())


def run_hf(args, log_dir: Path) -> dict | None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "hf_baseline.py"),
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
        "--profile-steps",
        f"{args.steps - 1}:{args.steps}",
        "--profile-dir",
        str(log_dir / "hf-profile"),
    ]
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    print("+", " ".join(cmd), flush=True)
    with open(log_dir / "hf.log", "w") as log:
        try:
            proc = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                timeout=args.timeout,
                env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"},
            )
        except subprocess.TimeoutExpired:
            print("hf baseline: timed out", flush=True)
            return None
        log.write(proc.stdout)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not found:
        print(f"hf baseline failed (exit {proc.returncode}); see {log_dir / 'hf.log'}", flush=True)
        return None
    return json.loads(found[-1][len("RESULT ") :])


def table(rows: list[dict], bf16_tps: float | None) -> list[str]:
    out = [
        "| row | path | step ms | tokens/s | model TFLOP/s | MFU | vs lpbench BF16 | GEMM | quantize | "
        "attention | other | kernels | peak GB |",
        "|---|---|" + "---:|" * 11,
    ]
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"| {r['name']} | | | | | | {r.get('status')}: {r.get('error') or ''} | | | | | | |")
            continue
        prof = r.get("profile") or {}
        n = prof.get("n_steps") or 1
        parts = [prof[f"{p}_ms"] / n if f"{p}_ms" in prof else None for p in PARTS]
        if parts[3] is not None:
            parts[3] += (prof.get("comm_ms") or 0.0) / n
        if r.get("kernel_ms") and None not in parts:  # the trace's kernel total decides "other"
            parts[3] = r["kernel_ms"] - sum(parts[:3])
        cells = [f"{p:.1f}" if p is not None else "" for p in parts]
        ratio = f"{r['tps'] / bf16_tps:.2f}x" if bf16_tps else ""
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else ""
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else ""
        kernel = f"{r['kernel_ms']:.1f}" if r.get("kernel_ms") else ""
        out.append(
            f"| {r['name']} | {r['path']} | {r['step_ms']:.1f} | {r['tps']:,.0f} | {r['tflops']:.0f} | {mfu} | "
            f"{ratio} | {' | '.join(cells)} | {kernel} | {peak} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=None, help="default: MBS (one micro-batch a step)")
    ap.add_argument("--steps", type=int, default=12, help="the last two are profiled (default 12)")
    ap.add_argument("--warmup-steps", type=int, default=6)
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile each row's last two steps (default on)",
    )
    ap.add_argument("--results", default="lpbench-results/step-table")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per row (default 420)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per row (default 12)")
    args = ap.parse_args()
    if args.steps - 2 * args.profile <= args.warmup_steps:
        ap.error("--steps must leave timed steps between the warm-up and the two profiled steps")

    from lpbench.bench.store import ResultsStore
    from lpbench.bench.sweep import run_sweep

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    lp_rows = [r for r in rows if r != "hf"]
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    out: list[dict] = []
    if lp_rows:
        spec = spec_for(args, lp_rows)
        spec_path = results / f"{spec['name']}.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        run_sweep(str(spec_path), results=str(results))
        for r in ResultsStore(results).runs("sweep_id = ?", (spec["name"],)):
            m, cfg = r["metrics"], r["config"]
            prof = dict(m.get("profile") or {})
            first, _, last = str(prof.get("steps", "")).partition(":")
            prof["n_steps"] = int(last) - int(first) + 1 if last else 1
            name = (
                cfg["precision"]
                + (f" ({r['backend']})" if r["backend"] != "lpbench" else "")
                + (" fused loss" if cfg.get("fused_loss") else "")
                + (" model scope" if cfg.get("compile_scope") == "model" else "")
            )
            out.append(
                {
                    "name": name,
                    "status": r["status"],
                    "error": r.get("error"),
                    "path": m.get("path", ""),
                    "step_ms": (r.get("step_time_s") or 0) * 1e3,
                    "tps": r.get("tokens_per_sec_per_gpu"),
                    "tflops": r.get("tflops_per_gpu"),
                    "mfu": r.get("mfu_bf16"),
                    "peak_gb": r.get("peak_mem_allocated_gb"),
                    "profile": prof,
                    "model": r["model"],
                    "gpu": r.get("gpu"),
                }
            )
    if "hf" in rows:
        res = run_hf(args, results)
        if res is None:
            out.append({"name": "hf-transformers + compile", "status": "error"})
        else:
            prof = res.get("profile") or {}
            prof["n_steps"] = 2
            out.append(
                {
                    "name": "hf-transformers + compile",
                    "status": "ok",
                    "path": "native",
                    "step_ms": res["step_time_s"] * 1e3,
                    "tps": res["tokens_per_sec_per_gpu"],
                    "tflops": res["tflops_per_gpu"],
                    "mfu": res.get("mfu"),
                    "peak_gb": res.get("peak_mem_gb"),
                    "profile": prof,
                }
            )
    bf16 = next((r["tps"] for r in out if r["name"] == "bf16" and r["status"] == "ok"), None)
    for r in out:
        kernels, total = top_kernels(
            (r.get("profile") or {}).get("trace"), (r.get("profile") or {}).get("n_steps", 1), args.top
        )
        r["kernel_ms"] = total
        if kernels:
            prof = r.get("profile") or {}
            profiled = prof.get("total_ms", 0.0) / prof.get("n_steps", 1)
            print(
                f"\n{r['name']}: heaviest kernels (ms per step; all kernels {total:.1f} ms per step, "
                f"the profile's categories {profiled:.1f})"
            )
            for name, ms in kernels:
                print(f"  {ms:8.2f}  {name[:150]}")
            idle, gaps, waited = idle_gaps(prof.get("trace"), prof.get("n_steps", 1), 8)
            r["idle_ms"], r["kernels"] = idle, top_kernels(prof.get("trace"), prof.get("n_steps", 1), 400)[0]
            print(f"  GPU idle between kernels: {idle:.1f} ms per step; longest gaps (ms, kernel before -> after):")
            for ms, before, after in gaps:
                print(f"  {ms:8.2f}  {before[:70]} -> {after[:70]}")
            print("  idle before each kernel, summed (ms per step):")
            for name, ms in waited:
                print(f"  {ms:8.2f}  {name[:140]}")
            late, blocking = host_waits(prof.get("trace"), prof.get("n_steps", 1), 15)
            print(
                "  idle by where the host was when it launched the kernel after the gap (ms per step; "
                "lpbench frame | innermost frame):"
            )
            for name, ms in late:
                print(f"  {ms:8.2f}  {name[:200]}")
            print("  CUDA runtime calls that can block the host (ms per step):")
            for name, ms in blocking:
                print(f"  {ms:8.2f}  {name[:100]}")
            print("  host-late idle by time since the host last returned from a blocking call (ms per step):")
            for name, ms in idle_after_blocking(prof.get("trace"), prof.get("n_steps", 1)):
                print(f"  {ms:8.2f}  {name}")
    label = next((r["model"] for r in out if r.get("model")), args.model)
    gpu = next((r["gpu"] for r in out if r.get("gpu")), "?")
    print(
        f"\n{label}, seq {args.seq_len}, MBS {args.mbs}, GBS {args.gbs or args.mbs}, {gpu}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; GEMM..kernels: profiled kernel ms per step"
    )
    print("\n".join(table(out, bf16)))
    (results / "table.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

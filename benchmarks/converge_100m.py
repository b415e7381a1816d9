"""The convergence study at 100 M tokens per run: run a named subset, one JSON per run; table and plots.

llama-125m (its vocabulary resized to the corpus tokenizer's 8,192: 88.1 M parameters) on the
offline documentation corpus (README.md, "Real corpus": 28.9 M tokens, so 100 M tokens is ~3.5
epochs), seq 1024, GBS 64 (65,536 tokens a step, 1,525 steps), peak LR 6e-4 with linear warm-up over
the first 10 % of the steps and cosine decay to 10 % at the last step, validation on 256 held-out
sequences every 150 steps (~9.8 M tokens) and at the last. Every run is one ``lpbench converge``
process; the study accumulates across device calls because each finished run is a small JSON file
(``OUT/<run>.json``: config, device, command, curves, validation losses, tokens/s) that the report
reads back from wherever the runs were collected (``benchmarks/converge-100M/``).

Runs are named ``<recipe>`` (seed 1234) or ``<recipe>-seed<N>``: bf16, fp8-tensorwise, fp8-delayed,
mxfp8, nvfp4, nvfp4-no-rht, nvfp4-no-sr, nvfp4-no-2d, nvfp4-no-bf16-tail, bf16-seed1235, ...

    PYTHONPATH=. python benchmarks/converge_100m.py run bf16 nvfp4 --out $OUT [--ckpt /tmp/ckpt]
    python benchmarks/converge_100m.py report [--runs benchmarks/converge-100M] [--plot FILE]
    PYTHONPATH=. python benchmarks/converge_100m.py export nvfp4 --out $OUT   # a run whose wrapper was cut

``run`` records ``$CODE_REV`` as the code's commit where the tree that runs has no ``.git`` (a copy sent
to a device), else the checkout's. It needs the prepared corpus at ``--data`` (default ``.corpus/prepared/docs_text_document``).
With ``--ckpt DIR`` each run checkpoints every ``--save-every`` steps into ``DIR/<run>/`` and a run
that finds a checkpoint there resumes it (``lpbench converge --load``), so a run cut by a call's time
limit goes on in the next call when ``DIR`` survived (the same machine, still warm).
Each JSON records the corpus's SHA-256 (the corpus is built from the documentation installed where
it is built, so a rebuild can differ): ``report`` compares only runs on the reference's corpus.
``report`` prints the markdown table (final validation loss, gap to bf16 with the BF16 seed-noise
floor beside it, tokens/s) and the gap at every evaluation, and writes the figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REFERENCE = "bf16"
REF_SEED = 1234
MODEL, SEQ, LR = "llama-125m", 1024, 6e-4
RUN_NAME = re.compile(r"(?P<recipe>[a-z0-9-]+?)(?:-seed(?P<seed>\d+))?")


def parse_run(name: str) -> tuple[str, int]:
    m = RUN_NAME.fullmatch(name)
    if not m:
        raise SystemExit(f"converge_100m: bad run name {name!r} (<recipe> or <recipe>-seed<N>)")
    return m["recipe"], int(m["seed"] or REF_SEED)


def converge_command(args, name: str, work: Path) -> list[str]:
    recipe, seed = parse_run(name)
    cmd = [
        sys.executable,
        "-m",
        "lpbench",
        "converge",
        "--model",
        args.model,
        "--data",
        args.data,
        "--precision",
        recipe,
        "--seed",
        str(seed),
        "--tokens",
        f"{args.tokens:.0f}",
        "--seq-len",
        str(args.seq_len),
        "--mbs",
        str(args.mbs),
        "--gbs",
        str(args.gbs),
        "--lr",
        f"{LR:g}",
        "--eval-every",
        str(args.eval_every),
        "--eval-batches",
        str(max(1, 256 // args.mbs)),
        "--device",
        args.device,
        "--emulate",
        "--log-interval",
        "100",
        "--results",
        str(work / name),
        "--plot",
        str(work / f"{name}.png"),
    ]
    if args.ckpt:
        ckpt = Path(args.ckpt) / name
        cmd += ["--save-every", str(args.save_every), "--save-dir", str(ckpt)]
        if any((ckpt / recipe).glob("step-*")):
            cmd += ["--load", str(ckpt)]
    return cmd


def corpus_identity(data: str) -> dict:
    """What identifies the training data: its note (documents, tokens, tokenizer) and the SHA-256 of its tokens.

    The corpus is assembled from the documentation installed on the machine that builds it, so a rebuild
    elsewhere can differ; runs on different corpora are not compared (``report`` leaves them out)."""
    if data == "mock":
        return {"sha256": "mock"}
    note = json.loads(Path(data + ".lpbench.json").read_text())
    digest = hashlib.sha256()
    with open(data + ".bin", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {
        "documents": note.get("documents"),
        "tokens": note.get("tokens"),
        "tokenizer_fingerprint": note.get("tokenizer_fingerprint"),
        "sha256": digest.hexdigest(),
    }


def export(name: str, work: Path, command: list[str], wall_s: float | None, corpus: dict) -> dict | None:
    """The run's JSON record from its results database (None if it left no row)."""
    from lpbench.bench.store import ResultsStore

    if not (work / name / "results.db").is_file():
        return None
    store = ResultsStore(work / name)
    rows = store.runs("workload = 'converge'")
    if not rows:
        return None
    row = rows[-1]
    cfg, m, env = row["config"], row["metrics"], row["env"]
    per_step = cfg["gbs"] * cfg["seq_len"]
    steps = store.steps(row["id"])
    recipe, seed = parse_run(name)
    keep = (
        "model",
        "precision",
        "seed",
        "seq_len",
        "mbs",
        "gbs",
        "steps",
        "lr",
        "min_lr_ratio",
        "weight_decay",
        "grad_clip",
        "eval_every",
        "eval_batches",
        "vocab_size",
        "data",
        "compile",
        "emulate",
    )
    return {
        "run": name,
        "recipe": recipe,
        "seed": seed,
        "status": row["status"],
        "error": row["error"],
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "command": " ".join(command[1:]),
        "device": env.get("gpu"),
        "driver": env.get("driver"),
        "torch": env.get("torch"),
        "git_sha": os.environ.get("CODE_REV") or env.get("git_sha"),
        "config": {k: cfg.get(k) for k in keep},
        "corpus": corpus,
        "tokens": cfg["steps"] * per_step,
        "tokens_per_step": per_step,
        "path": m.get("path"),
        "params": m.get("params"),
        "tokens_per_sec": m.get("tokens_per_sec_per_gpu"),
        "resumed_from_step": m.get("resumed_from_step"),
        "peak_mem_gb": m.get("peak_mem_allocated_gb"),
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "train_loss_last10": m.get("train_loss"),
        "val_loss": m["val_losses"][-1][1] if m.get("val_losses") else None,
        "val_losses": m.get("val_losses", []),
        "train": [[s["step"], round(s["loss"], 5), float(f"{s['lr']:.4g}"), round(s["grad_norm"], 4)] for s in steps],
    }


def dump(record: dict) -> str:
    """The JSON file: one line per training step, the rest indented."""
    head = json.dumps({k: v for k, v in record.items() if k != "train"}, indent=1)
    rows = ",\n  ".join(json.dumps(row) for row in record["train"])
    return head[:-2] + ',\n "train": [\n  ' + rows + "\n ]\n}\n"


def _folders_and_corpus(args) -> tuple[Path, Path, dict]:
    """``run``'s and ``export``'s OUT folder, work folder and corpus identity; exits on a bad run name or a
    missing corpus."""
    for name in args.runs:
        parse_run(name)
    if args.data != "mock" and not Path(args.data + ".bin").is_file():
        raise SystemExit(f"converge_100m: no prepared corpus at {args.data}.bin (README.md, 'Real corpus')")
    out = Path(args.out)
    return out, out / "work" if args.work is None else Path(args.work), corpus_identity(args.data)


def cmd_run(args) -> int:
    out, work, corpus = _folders_and_corpus(args)
    out.mkdir(parents=True, exist_ok=True)
    print(f"converge_100m: corpus {args.data}: {corpus}", flush=True)
    failed = 0
    for name in args.runs:
        command = converge_command(args, name, work)
        print(f"converge_100m: {name}: {' '.join(command[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(command)
        record = export(name, work, command, time.monotonic() - t0, corpus)
        if record is None:
            print(f"converge_100m: {name}: no result (exit {rc})", flush=True)
            failed += 1
            continue
        (out / f"{name}.json").write_text(dump(record))
        print(
            f"converge_100m: {name}: {record['status']}, validation loss {record['val_loss']}, "
            f"{record['tokens_per_sec'] or 0:,.0f} tokens/s, {record['wall_s']:.0f} s -> {out / name}.json",
            flush=True,
        )
    return 1 if failed else 0


def cmd_export(args) -> int:
    """Each named run's JSON from its results database, for a run whose training finished (or stopped) after
    ``run`` was cut, e.g. by a device call's time limit (its wall time is not known: ``wall_s`` is null)."""
    out, work, corpus = _folders_and_corpus(args)
    failed = 0
    for name in args.runs:
        record = export(name, work, converge_command(args, name, work), None, corpus)
        if record is None:
            print(f"converge_100m: {name}: no result in {work / name}", file=sys.stderr)
            failed += 1
            continue
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(dump(record))
        print(f"converge_100m: {name}: {record['status']}, validation loss {record['val_loss']} -> {out / name}.json")
    return 2 if failed else 0


def load_runs(folder: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        runs[rec["run"]] = rec
    return runs


def order(names) -> list[str]:
    """bf16 first, then recipes, then nvfp4 ablations, then noise-seed runs."""
    rank = [
        "bf16",
        "fp8-tensorwise",
        "fp8-delayed",
        "mxfp8",
        "nvfp4",
        "nvfp4-no-rht",
        "nvfp4-no-sr",
        "nvfp4-no-2d",
        "nvfp4-no-bf16-tail",
    ]
    return sorted(
        names,
        key=lambda n: (
            parse_run(n)[1] != REF_SEED,
            rank.index(parse_run(n)[0]) if parse_run(n)[0] in rank else len(rank),
            n,
        ),
    )


def gap(loss: float, ref: float) -> float:
    return (loss - ref) / ref * 100


def cmd_report(args) -> int:
    from lpbench.bench.converge import tolerance_for

    runs = load_runs(Path(args.runs))
    if REFERENCE not in runs:
        print(f"converge_100m: no {REFERENCE} run in {args.runs} yet: nothing to compare", file=sys.stderr)
        return 2
    ref = runs[REFERENCE]
    other = sorted(
        n for n, r in runs.items() if r.get("corpus", {}).get("sha256") != ref.get("corpus", {}).get("sha256")
    )
    for n in other:
        print(
            f"converge_100m: {n} trained on another corpus than {REFERENCE} "
            f"(SHA-256 {runs[n].get('corpus', {}).get('sha256')}): left out",
            file=sys.stderr,
        )
        del runs[n]
    names = order(runs)
    ref_val = dict((s, v) for s, v in ref["val_losses"])
    noise = [
        abs(gap(runs[n]["val_loss"], ref["val_loss"]))
        for n in names
        if parse_run(n)[1] != REF_SEED and parse_run(n)[0] == REFERENCE and runs[n]["val_loss"] is not None
    ]
    floor = f"±{max(noise):.2f}% ({len(noise)} seed{'s' * (len(noise) > 1)})" if noise else "not yet measured"
    print(
        "| run | path | device | tokens | train loss (last 10) | val loss | gap vs bf16 | noise floor "
        "(bf16, other seeds) | tolerance | tokens/s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|")
    for n in names:
        r = runs[n]
        g = "—" if n == REFERENCE or r["val_loss"] is None else f"{gap(r['val_loss'], ref['val_loss']):+.2f}%"
        tol = tolerance_for(parse_run(n)[0]) if parse_run(n)[1] == REF_SEED else None
        print(
            f"| {n} | {r['path']} | {r['device']} | {r['tokens'] / 1e6:.1f} M | {r['train_loss_last10']:.4f} | "
            f"{r['val_loss']:.4f} | {g} | {floor} | {'—' if tol is None else f'{tol:g}%'} | "
            f"{r['tokens_per_sec'] or 0:,.0f} |"
        )
    steps = sorted(ref_val)
    per_step = ref["tokens_per_step"]
    print("\nGap of the validation loss to bf16 (%) at each evaluation (M tokens):\n")
    print("| run | " + " | ".join(f"{s * per_step / 1e6:.1f}" for s in steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for n in names:
        if n == REFERENCE:
            continue
        vals = dict((s, v) for s, v in runs[n]["val_losses"])
        print(f"| {n} | " + " | ".join(f"{gap(vals[s], ref_val[s]):+.2f}" if s in vals else "" for s in steps) + " |")
    if args.plot:
        from lpbench.report.plots import convergence_curves

        plot_runs = []
        for n in names:
            r = runs[n]
            recipe, seed = parse_run(n)
            tol = tolerance_for(recipe)
            verdict = (
                "reference"
                if n == REFERENCE
                else "seed noise"
                if seed != REF_SEED
                else "no tolerance"
                if tol is None
                else "pass"
                if gap(r["val_loss"], ref["val_loss"]) <= tol
                else "fail"
            )
            plot_runs.append(
                {
                    "precision": recipe if seed == REF_SEED else f"{recipe} @ seed {seed}",
                    "status": r["status"],
                    "ok": r["status"] == "ok",
                    "verdict": verdict,
                    "tolerance": tol if n != REFERENCE and seed == REF_SEED else None,
                    "train": [(s * per_step, loss) for s, loss, _, _ in r["train"]],
                    "val": [(s * per_step, v) for s, v in r["val_losses"]],
                }
            )
        png = convergence_curves(
            plot_runs,
            title=f"{ref['config']['model']} · {ref['tokens'] / 1e6:.1f} M tokens per run · GBS "
            f"{ref['config']['gbs']} × seq {ref['config']['seq_len']} · cosine LR "
            f"{ref['config']['lr']:g} · {ref['device'] or 'cpu'}",
        )
        Path(args.plot).write_bytes(png)
        print(f"\nplot: {args.plot}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the named runs, one JSON each")
    e = sub.add_parser(
        "export",
        help="the JSON of runs that trained but whose wrapper was stopped before writing it "
        "(from their results databases in --work; the same flags as their run)",
    )
    for a in (r, e):
        a.add_argument("runs", nargs="+", help="run names: <recipe> or <recipe>-seed<N>")
        a.add_argument("--out", required=True, help="folder for <run>.json")
        a.add_argument("--work", default=None, help="results databases and per-run plots (default OUT/work)")
        a.add_argument("--data", default=".corpus/prepared/docs_text_document")
        a.add_argument("--tokens", type=float, default=100e6)
        a.add_argument("--model", default=MODEL)
        a.add_argument("--seq-len", type=int, default=SEQ)
        a.add_argument("--device", default="cuda")
        a.add_argument("--mbs", type=int, default=64)
        a.add_argument("--gbs", type=int, default=64)
        a.add_argument("--eval-every", type=int, default=150)
        a.add_argument(
            "--ckpt", default=None, help="checkpoint folder (resume from it when a run's checkpoint is there)"
        )
        a.add_argument("--save-every", type=int, default=300)
    r.set_defaults(func=cmd_run)
    e.set_defaults(func=cmd_export)
    q = sub.add_parser("report", help="table and figure from the JSON files")
    q.add_argument("--runs", default=str(Path(__file__).parent / "converge-100M"))
    q.add_argument("--plot", default=str(Path(__file__).parent / "converge-llama-125m-100M.png"))
    q.set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

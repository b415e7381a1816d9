"""Hostile command lines made from the CLI's own flag table: each must be refused in one line.

For every command of ``lpbench`` (its sub-parsers, read from ``lpbench.cli.build_parser``) a
valid base command line is taken from ``BASES``; each flag the parser declares then gets values
hostile to its type (an int flag gets ``abc``, ``1.5``, ``-1``, 2**64 ...; a float flag NaN and Inf;
a path flag /proc, an empty string, a symlink loop, an existing results database ...). Each case
runs in-process in a fresh folder with training disabled, and must exit 2 with one line on
stderr, no traceback, nothing written, and no training started.

``python tests/fuzz_cli.py`` runs every case and lists the failures; ``tests/test_fuzz_cli.py``
runs a seeded subset in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# the smallest valid run: one line of flags the hardening and fault tests share
TINY = "--model tiny --precision bf16 --device cpu --seq-len 32 --mbs 2 --gbs 2 --steps 2 --warmup-steps 1".split()
# A valid command line per command ({d}: the case's folder); each case changes one flag of it.
BASES = {
    "run": ["run", *TINY, "--eval-every", "0", "--results", "{d}/r"],
    "converge": [
        "converge",
        "--data",
        "mock",
        "--model",
        "tiny",
        "--precision",
        "bf16",
        "--tokens",
        "192",
        "--seq-len",
        "32",
        "--mbs",
        "2",
        "--gbs",
        "2",
        "--device",
        "cpu",
        "--results",
        "{d}/r",
    ],
    "sweep": ["sweep", "{d}/spec.yaml", "--results", "{d}/r", "--dry-run"],
    "report": ["report", "--results", "{d}/db"],
    "flops": ["flops", "--model", "tiny", "--seq-len", "32"],
    "quant-error": ["quant-error", "--shape", "64", "64", "--precision", "bf16"],
    "slurm": ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", "{d}/job.sbatch", "--", "--model", "tiny"],
    "data prepare": ["data", "prepare", "--input", "{d}/text.txt", "--output-prefix", "{d}/out/data"],
    "data tokenizer": [
        "data",
        "tokenizer",
        "--input",
        "{d}/text.txt",
        "--vocab-size",
        "300",
        "--output",
        "{d}/tok.json",
    ],
    "data corpus": ["data", "corpus", "--out", "{d}/corpus", "--sources", "man", "--root", "man={d}/man"],
}
INT_VALUES = ["abc", "1.5", "", "0x10", "1e3"]
FLOAT_VALUES = ["nan", "inf", "-inf", "abc", "1e999"]
PATH_VALUES = ["", "/proc/lpbench-fuzz", "/sys/lpbench-fuzz/x", "{d}/loop", "{d}/dangling", "{d}/file/below"]
OUTPUT_FILE_VALUES = ["{d}/db/results.db", "{d}/ckpt/lpbench.json"]
NAME_VALUES = ["bogus-name", "", "../../etc/passwd", "[red]x[/red]"]
PATH_FLAGS = (
    "results",
    "output",
    "out",
    "output-prefix",
    "html",
    "plot",
    "plots",
    "save-dir",
    "tensorboard",
    "wandb",
    "load",
    "input",
    "config",
    "data",
    "hf-checkpoint",
    "export-hf",
    "root",
    "tokenizer",
    "json",
)
FILE_OUTPUTS = ("output", "html", "plot", "json")
# Flags whose values are free text (any string is a valid label) or that need another flag to matter.
FREE = {
    "job-name",
    "time",
    "partition",
    "account",
    "container",
    "container-mounts",
    "group",
    "name",
    "eos-token",
    "text-key",
    "help",
    "version",
    "gpu",
    "precision",
    "role",
    "distribution",
}
# (command, flag): values that are valid there although hostile in general.
ALLOWED = {
    ("flops", "--tokens", "1e3"),
    ("converge", "--tokens", "1e3"),
    ("data prepare", "--output-prefix", "{d}/loop"),  # writes loop.bin, loop.idx: not the symlink
    ("data prepare", "--output-prefix", "{d}/dangling"),
}


@dataclass
class Case:
    command: str
    flag: str
    value: str

    def argv(self, folder: Path) -> list[str]:
        base = [a.format(d=folder) for a in BASES[self.command]]
        value = self.value.format(d=folder)
        if self.flag in base:
            i = base.index(self.flag)
            return [*base[: i + 1], value, *base[i + 2 :]]
        cut = base.index("--") if "--" in base else len(base)
        return [*base[:cut], self.flag, value, *base[cut:]]

    def __str__(self) -> str:
        return f"{self.command} {self.flag} {self.value!r}"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every leaf command of the parser: ``run``, ``data prepare`` ..."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = _commands(sub)
                out.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return out


def cases() -> list[Case]:
    """Hostile values for every value-taking flag of every command in BASES, from the parsers' own actions."""
    from lpbench.cli import build_parser

    found = []
    for command, sub in sorted(_commands(build_parser()).items()):
        if command not in BASES:
            continue
        for action in sub._actions:
            flags = [o for o in action.option_strings if o.startswith("--")]
            if not flags or action.nargs == 0 or isinstance(action, argparse._VersionAction):
                continue
            flag = flags[0]
            name = flag[2:]
            if name in FREE:
                continue
            if action.choices:
                values = ["bogus-choice", ""]
            elif action.type is int or action.nargs == "+":
                values = INT_VALUES
            elif action.type is float:
                values = FLOAT_VALUES
            elif name in PATH_FLAGS:
                values = PATH_VALUES + (OUTPUT_FILE_VALUES if name in FILE_OUTPUTS else [])
            else:
                values = NAME_VALUES
            found += [Case(command, flag, v) for v in values if (command, flag, v) not in ALLOWED]
    return found


def _prepare(folder: Path) -> None:
    from lpbench.bench.store import ResultsStore

    (folder / "loop").symlink_to(folder / "loop")
    (folder / "dangling").symlink_to(folder / "nowhere")
    (folder / "file").write_text("a file")
    (folder / "text.txt").write_text("some words to tokenize\n\nand more words here\n" * 20)
    (folder / "spec.yaml").write_text("name: s\nmodel: tiny\nprecision: bf16\ndevice: cpu\nsteps: 2\n")
    (folder / "man" / "man1").mkdir(parents=True)
    (folder / "ckpt").mkdir()
    (folder / "ckpt" / "lpbench.json").write_text("{}")
    ResultsStore(folder / "db").close()


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and "results.db" not in p.name else None)
        for p in folder.rglob("*")
    }


class _TrainingStarted(BaseException):  # not an Exception: a run's error handling must not turn it into a row
    pass


class _TooSlow(Exception):
    pass


CASE_LIMIT_S = 20  # a refusal comes before any work: a case still running after this is a failure


def _too_slow(signum, frame):
    raise _TooSlow


def run_case(case: Case) -> str | None:
    """None if ``case`` was refused as promised, else what went wrong."""
    from lpbench.cli import main
    from lpbench.train import loop

    def no_training(*args, **kw):  # the first step would follow: device, data and model were accepted
        raise _TrainingStarted

    real_resume, loop.Checkpointer.resume = loop.Checkpointer.resume, no_training
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="lpbench-fuzz-") as tmp:
        folder = Path(tmp)
        _prepare(folder)
        before = _snapshot(folder)
        out, err = io.StringIO(), io.StringIO()
        os.chdir(folder)
        previous = signal.signal(signal.SIGALRM, _too_slow)
        signal.alarm(CASE_LIMIT_S)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(case.argv(folder))
                except SystemExit as exc:
                    code = exc.code
        except _TrainingStarted:
            return "accepted: training started"
        except _TooSlow:
            return f"still running after {CASE_LIMIT_S} s"
        except Exception as exc:  # noqa: BLE001 (what the fuzzer looks for)
            return f"traceback: {type(exc).__name__}: {exc}"[:300]
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
            os.chdir(cwd)
            loop.Checkpointer.resume = real_resume
        lines = err.getvalue().strip().splitlines()
        if code != 2:
            return f"exit {code}: {' | '.join(lines)[:200]}"
        if len(lines) != 1 or "Traceback" in err.getvalue():
            return f"{len(lines)} lines on stderr: {' | '.join(lines)[:200]}"
        after = _snapshot(folder)
        if after != before:
            return f"wrote {sorted(set(after) ^ set(before)) or 'into existing files'}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="run a seeded sample of this many cases")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    all_cases = cases()
    chosen = random.Random(args.seed).sample(all_cases, args.limit) if args.limit else all_cases
    failures = []
    for case in chosen:
        if why := run_case(case):
            failures.append((case, why))
            print(f"FAIL {case}: {why}", flush=True)
    print(
        f"{len(chosen) - len(failures)} of {len(chosen)} hostile command lines refused in one line "
        f"({len(all_cases)} generated)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

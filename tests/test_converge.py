import dataclasses
import json
import math
import random
import re
import shutil

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.bench.converge import Outcome, judge, parse_tolerances, tolerance_for
from lpbench.bench.store import ResultsStore
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.precision.recipes import ABLATIONS, Recipe, get_recipe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--seq-len", "32", "--mbs", "2", "--gbs", "2", "--device", "cpu", "--log-interval", "100"]


def write_corpus(path, n_docs=300, seed=0):
    """JSON lines of English-like sentences from a small grammar (enough for a held-out split)."""
    rng = random.Random(seed)
    subjects, verbs, objects = (
        ["the program", "a widget", "every user", "the file"],
        ["reads", "writes", "turns", "opens"],
        ["the output", "a gadget", "each line", "the input"],
    )
    with open(path, "w") as f:
        for _ in range(n_docs):
            text = " ".join(
                f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}."
                for _ in range(rng.randint(3, 8))
            )
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.mark.parametrize("ingredient", list(ABLATIONS))
def test_ablation_switches_off_exactly_that_ingredient(ingredient):
    off, _ = ABLATIONS[ingredient]
    name = "fp8-tensorwise" if ingredient == "fast-accum" else "nvfp4"
    base, ablated = get_recipe(name), get_recipe(f"{name}-no-{ingredient}")
    changed = {f.name for f in dataclasses.fields(Recipe) if getattr(base, f.name) != getattr(ablated, f.name)} - {
        "name",
        "description",
        "display_name",
        "colour",
    }
    assert changed == set(off)
    assert all(getattr(ablated, k) == v for k, v in off.items())
    assert ablated.name == f"{name}-no-{ingredient}"


def test_ablation_names_that_do_not_resolve():
    with pytest.raises(UsageError, match="mxfp8 has no random Hadamard transform"):
        get_recipe("mxfp8-no-rht")
    with pytest.raises(UsageError, match="unknown ablation 'magic'"):
        get_recipe("nvfp4-no-magic")
    assert get_recipe("nvfp4-no-rht-no-sr").stochastic_grads is False  # ablations compose


def test_tolerances_by_name_or_family_prefix():
    """A recipe's own tolerance (an ablation keeps its base's), overridden by --tolerance's name or family prefix."""
    assert tolerance_for("fp8-delayed") == 0.5
    assert tolerance_for("mxfp8") == 0.5
    assert tolerance_for("nvfp4-no-rht") == 1.5
    assert tolerance_for("bf16") is None
    assert parse_tolerances(None) == {}
    tol = parse_tolerances("fp8=1,nvfp4-no-rht=3%")
    assert tolerance_for("fp8-tensorwise", tol) == 1.0 and tolerance_for("nvfp4-no-rht", tol) == 3.0
    assert tolerance_for("nvfp4-no-sr", tol) == 1.5  # the longest matching key wins
    for bad in ("fp8", "fp8=x", "=1", "fp8=-1"):
        with pytest.raises(UsageError, match="NAME=PERCENT"):
            parse_tolerances(bad)


def test_judge_computes_gaps_and_verdicts():
    outs = [
        Outcome("bf16", "ok", val_loss=4.0),
        Outcome("fp8-tensorwise", "ok", val_loss=4.01),
        Outcome("mxfp8", "ok", val_loss=4.04),
        Outcome("nvfp4", "ok", val_loss=4.05),
        Outcome("fp32", "ok", val_loss=3.9),
        Outcome("nvfp4-no-sr", "diverged", diverged_step=7),
    ]
    assert judge(outs, {}) == "val_loss"
    assert [o.gap_pct for o in outs[:5]] == pytest.approx([0.0, 0.25, 1.0, 1.25, -2.5])
    assert [o.verdict for o in outs] == ["reference", "pass", "fail", "pass", "no tolerance", "diverged @ step 7"]
    assert outs[5].gap_pct is None and outs[0].tolerance is None and outs[2].tolerance == 0.5
    # without validation losses the train loss is compared
    train_only = [Outcome("bf16", "ok", train_loss=2.0), Outcome("mxfp8", "ok", train_loss=2.02)]
    assert judge(train_only, {}) == "train_loss" and train_only[1].verdict == "fail"


def test_validation_every_k_steps_leaves_training_unchanged():
    cfg = RunConfig(
        model="tiny",
        precision="fp8-delayed",
        seq_len=32,
        mbs=2,
        gbs=2,
        steps=5,
        warmup_steps=1,
        device="cpu",
        log_interval=100,
    )
    plain = loop.train(cfg, log=lambda line: None)
    lines = []
    evaluated = loop.train(cfg.with_(eval_every=2, eval_batches=3), log=lines.append)
    assert [s["step"] for s in evaluated.steps if "val_loss" in s] == [2, 4, 5]
    assert evaluated.metrics["val_loss"] == evaluated.steps[-1]["val_loss"] and "val_loss" not in plain.metrics
    assert all(math.isfinite(s["val_loss"]) for s in evaluated.steps if "val_loss" in s)
    # evaluation restores the delayed-scaling amax histories: training is bit-identical
    assert [s["loss"] for s in evaluated.steps] == [s["loss"] for s in plain.steps]
    assert sum(line.startswith("validation loss at iteration") for line in lines) == 3
    with pytest.raises(UsageError, match="at least MBS x DP = 32 validation sequences"):
        loop.train(cfg.with_(mbs=32, gbs=32, eval_every=1), log=lambda line: None)


def test_converge_on_raw_text(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    results, plot = tmp_path / "res", tmp_path / "curves.png"
    rc = main(
        [
            "converge",
            "--data",
            str(corpus),
            "--precision",
            "bf16,fp8-tensorwise",
            "--tokens",
            "384",
            "--eval-every",
            "2",
            "--vocab-size",
            "300",
            "--tolerance",
            "fp8=0",
            "--results",
            str(results),
            "--plot",
            str(plot),
        ]
        + SMALL
    )
    out = capsys.readouterr().out
    assert "no tokenizer given" not in out and "a byte-level BPE (vocab 300 requested) was trained on" in out
    runs = ResultsStore(results).runs("workload = 'converge'")
    assert [r["precision"] for r in runs] == ["bf16", "fp8-tensorwise"] and len({r["group_id"] for r in runs}) == 1
    assert all(r["config"]["steps"] == 6 and r["config"]["vocab_size"] <= 300 for r in runs)
    vals = [r["metrics"]["val_losses"] for r in runs]
    assert [[s for s, _ in v] for v in vals] == [[2, 4, 6], [2, 4, 6]]
    ref, fp8 = vals[0][-1][1], vals[1][-1][1]
    gap = (fp8 - ref) / ref * 100
    verdict = "pass" if gap <= 0 else "fail"
    row = next(line for line in out.splitlines() if "│ fp8-tensorwise" in line)
    assert f"{fp8:.4f}" in row and f"{gap:+.2f}%" in row and "0%" in row and verdict in row
    assert rc == (0 if verdict == "pass" else 1)
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert main(["report", "--results", str(results)]) == 0
    assert "Convergence" in capsys.readouterr().out


def test_a_diverging_recipe_stops_and_the_others_run(tmp_path, capsys, monkeypatch):
    real_train, real_build = loop.train, loop.build_model

    def poisoned_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        forward, calls = model.forward, [0]

        def forward_with_nan(*a, **k):
            calls[0] += torch.is_grad_enabled()  # training forwards only
            out = forward(*a, **k)
            return out * float("nan") if calls[0] >= 3 else out

        model.forward = forward_with_nan
        return model

    def train(cfg, *args, **kwargs):
        with monkeypatch.context() as m:
            if cfg.precision == "fp8-tensorwise":
                m.setattr(loop, "build_model", poisoned_build)
            return real_train(cfg, *args, **kwargs)

    monkeypatch.setattr(loop, "train", train)
    results = tmp_path / "res"
    rc = main(
        [
            "converge",
            "--precision",
            "bf16,fp8-tensorwise,mxfp8",
            "--tokens",
            "384",
            "--eval-every",
            "3",
            "--results",
            str(results),
            "--plot",
            str(tmp_path / "p.png"),
        ]
        + SMALL
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert re.search(r"│ fp8-tensorwise .*diverged @ step 3", out)
    assert re.search(r"│ mxfp8 .*│ ok .*(pass|fail)", out)
    runs = ResultsStore(results).runs()
    assert [r["status"] for r in runs] == ["ok", "diverged", "ok"]
    assert runs[1]["metrics"]["diverged_step"] == 3 and len(ResultsStore(results).steps(runs[2]["id"])) == 6


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ablate", "magic"], "unknown ablation 'magic'"),
        (["--tokens", "10"], "less than one step"),
        (["--noise-seeds", "-1"], "--noise-seeds must be >= 0, got -1"),
        (["--tolerance", "fp8"], "NAME=PERCENT"),
        (["--data", "mock", "--tokenizer", "byte"], "--tokenizer applies to real data"),
        (["--data", "/no/such/corpus.jsonl"], "--data /no/such/corpus.jsonl"),
        (["--precision", "bf16,mxfp8", "--no-emulate", "--device", "cpu"], "mxfp8 cannot run natively on cpu"),
        (["--model", "tiny", "--seq-len", "4096"], "exceeds tiny's limit"),
    ],
)
def test_converge_rejects_bad_input_in_one_line(argv, message, tmp_path, capsys):
    assert main(["converge", "--results", str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_noise_seeds_run_the_reference_again_and_give_the_noise_floor(tmp_path, capsys):
    results = tmp_path / "res"
    rc = main(
        [
            "converge",
            "--data",
            "mock",
            "--model",
            "tiny",
            "--precision",
            "bf16,fp8-tensorwise",
            "--tokens",
            "256",
            "--eval-every",
            "2",
            "--noise-seeds",
            "2",
            "--results",
            str(results),
        ]
        + SMALL
    )
    out = capsys.readouterr().out
    runs = ResultsStore(results).runs("workload = 'converge'")
    assert [(r["precision"], r["config"]["seed"]) for r in runs] == [
        ("bf16", 1234),
        ("fp8-tensorwise", 1234),
        ("bf16", 1235),
        ("bf16", 1236),
    ]
    ref = runs[0]["metrics"]["val_losses"][-1][1]
    gaps = [(r["metrics"]["val_losses"][-1][1] - ref) / ref * 100 for r in runs[2:]]
    assert all(g != 0 for g in gaps)  # another seed: other weights and data order
    for seed, gap in zip((1235, 1236), gaps):
        row = next(line for line in out.splitlines() if f"│ bf16 @ seed {seed}" in line)
        assert f"{gap:+.2f}%" in row and "seed noise" in row
    floor = max(abs(g) for g in gaps)
    assert f"lands up to {floor:.2f}% from seed 1234; gaps within ±{floor:.2f}%" in out
    fp8_row = next(line for line in out.splitlines() if "│ fp8-tensorwise" in line)
    assert rc == (1 if "fail" in fp8_row else 0)  # noise runs never fail the command
    # progress: each run's time, the command's elapsed time and ETA; then the next command
    done = [line for line in out.splitlines() if line.startswith("lpbench: run ")]
    assert [line.split(":")[1].strip() for line in done] == [
        "run 1/4 bf16",
        "run 2/4 fp8-tensorwise",
        "run 3/4 bf16 @ seed 1235",
        "run 4/4 bf16 @ seed 1236",
    ]
    assert all("| elapsed 0:" in line for line in done) and "ETA 0:" in done[0] and "for 3 more run(s)" in done[0]
    assert done[-1].endswith("all runs done")
    group = runs[0]["group_id"]
    assert (
        out.rstrip().splitlines()[-1] == f"next: lpbench report --results {results} --group {group} --html report.html"
    )


def _final_state(folder):
    """The model and optimizer tensors of a checkpoint folder, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = folder.parent / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, path)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(path, weights_only=False))
    return {k: v for k, v in flat.items() if k.startswith((".model.", ".optim."))}


def test_a_resumed_converge_continues_exactly(tmp_path, capsys):
    """6 steps straight == 3 steps, checkpoint, resume 3: same losses, LR, gradient norms, validation losses
    and final weights and optimizer state, bit for bit; nvfp4's stochastic rounding included (RNG restored)."""
    argv = [
        "converge",
        "--data",
        "mock",
        "--model",
        "tiny",
        "--precision",
        "bf16,nvfp4",
        "--noise-seeds",
        "1",
        "--tokens",
        "384",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
    ] + SMALL
    straight, partial = tmp_path / "straight", tmp_path / "partial"
    main(argv + ["--results", str(tmp_path / "r1"), "--save-every", "3", "--save-dir", str(straight)])
    names = ["bf16", "bf16-seed1235", "nvfp4"]
    assert sorted(p.name for p in straight.iterdir()) == names
    shutil.copytree(straight, partial)
    for name in names:
        assert sorted(p.name for p in (straight / name).iterdir()) == ["step-3", "step-6"]
        shutil.rmtree(partial / name / "step-6")
    capsys.readouterr()
    main(
        argv
        + ["--results", str(tmp_path / "r2"), "--load", str(partial), "--save-every", "3", "--save-dir", str(partial)]
    )
    out = capsys.readouterr().out
    assert out.count("resumed from") == 3 and f"{partial / 'nvfp4' / 'step-3'} at step 3" in out.replace("\n", "")
    first, resumed = (ResultsStore(tmp_path / r).runs("workload = 'converge'") for r in ("r1", "r2"))
    for a, b in zip(first, resumed, strict=True):
        assert b["metrics"]["resumed_from_step"] == 3 and b["metrics"]["val_losses"] == a["metrics"]["val_losses"]
        assert [s for s, _ in b["metrics"]["val_losses"]] == [2, 4, 6]
        steps_a, steps_b = (ResultsStore(tmp_path / r).steps(run["id"]) for r, run in (("r1", a), ("r2", b)))
        assert [s["step"] for s in steps_b] == [1, 2, 3, 4, 5, 6]
        for key in ("loss", "lr", "grad_norm"):
            assert [s[key] for s in steps_b] == [s[key] for s in steps_a]
    for name in names:
        want, got = _final_state(straight / name / "step-6"), _final_state(partial / name / "step-6")
        assert want.keys() == got.keys() and any(k.startswith(".optim.state.") for k in want)
        assert all(torch.equal(want[k], got[k]) for k in want), name


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--load", "{tmp}/nowhere"], "--load {tmp}/nowhere: no checkpoint of bf16 (no folder {tmp}/nowhere/bf16)"),
        (["--load", "{tmp}/saved", "--precision", "bf16,fp8-tensorwise"], "no checkpoint of fp8-tensorwise"),
        (["--load", "{tmp}/saved", "--seq-len", "16"], "checkpoint does not match this run: seq_len 32 (this run: 16)"),
        (["--load", "{tmp}/saved", "--seed", "7"], "does not match this run: seed 1234 (this run: 7)"),
        (["--load", "{tmp}/broken"], "corrupt checkpoint (DCP's .metadata is missing)"),
        (["--load", "{tmp}/saved", "--tokens", "192"], "checkpoint is at step 3, --steps 3 leaves nothing to train"),
        (["--save-every", "2"], "--save-every K needs --save-dir DIR"),
        (["--save-dir", "{tmp}/x"], "--save-dir needs --save-every K"),
    ],
)
def test_converge_refuses_bad_checkpoints_in_one_line(argv, message, tmp_path, capsys):
    base = [
        "converge",
        "--data",
        "mock",
        "--model",
        "tiny",
        "--precision",
        "bf16",
        "--tokens",
        "384",
        "--eval-every",
        "0",
        "--results",
        str(tmp_path / "res"),
    ] + SMALL
    if any("{tmp}/saved" in a or "{tmp}/broken" in a for a in argv):
        assert (
            main(
                base[: base.index("--tokens") + 1]
                + ["192"]
                + base[base.index("--tokens") + 2 :]
                + ["--save-every", "3", "--save-dir", str(tmp_path / "saved")]
            )
            == 0
        )
        shutil.copytree(tmp_path / "saved", tmp_path / "broken")
        (tmp_path / "broken" / "bf16" / "step-3" / ".metadata").unlink()
    capsys.readouterr()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", str(tmp_path)) in err and len(err.strip().splitlines()) == 1

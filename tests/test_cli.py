import json
import re
import subprocess
import sys

import pytest

from lpbench.cli import main

TINY = ["--model", "tiny", "--seq-len", "32", "--mbs", "2", "--gbs", "4", "--steps", "6", "--warmup-steps", "2"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--model", "gpt5"], "unknown model 'gpt5'; valid: llama3-8b"),
        (["run", "--precision", "bf16,fp3"], "unknown precision 'fp3'; valid: bf16"),
        (["run", "--gbs", "10", "--mbs", "4"], "global batch 10 is not divisible by micro batch 4"),
        (["run", "--steps", "0"], "--steps must be positive"),
        (["run", "--steps", "5", "--warmup-steps", "5"], "must be less than --steps"),
        (["run", "--model", "tiny", "--seq-len", "4096"], "exceeds tiny's limit of 2048"),
        (["run", "--steps", "abc"], "invalid int value"),
        (["run", "--flops-formula", "magic"], "unknown FLOP formula"),
        (["flops", "--model", "llama3-8b", "--seq-len", "8192", "--formula", "magic"], "unknown FLOP formula"),
        (["report", "--results", "/nonexistent/lpbench"], "no results database"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main([*argv, *(["--results", str(tmp_path)] if argv[0] == "run" else [])]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "results.db").exists()  # nothing written for a rejected run


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lpbench.cli", "run", "--model", "nope", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "unknown model 'nope'" in out.stderr and "Traceback" not in out.stderr


def test_flops_json(capsys):
    assert (
        main(
            [
                "flops",
                "--model",
                "llama3-8b",
                "--seq-len",
                "8192",
                "--formula",
                "nemo-legacy",
                "--tokens-per-sec-per-gpu",
                "33099",
                "--num-gpus",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["tflops_per_gpu"] == pytest.approx(1917, rel=0.005)
    assert out["flops_per_sample"] == pytest.approx(out["flops_per_token"] * 8192)
    assert out["days_to_train"] == pytest.approx(1e12 / (33099 * 8) / 86400)


def test_models_lists_every_model(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"llama3-8b", "qwen3-14b", "nemotron4-340b", "mixtral-8x22b", "gpt3-175b", "tiny"} <= set(rows)
    assert round(rows["llama3.2-1b"]["params"] / 1e9, 2) == 1.24


def test_run_then_report(tmp_path, capsys):
    assert main(["run", *TINY, "--precision", "bf16,fp32", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("train_step_timing in s:") == 12 and "elapsed time per iteration (ms):" in out
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["precision"] for r in rows] == ["bf16", "fp32"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[1]["speedup"] > 0
    assert all(r["status"] == "ok" and r["tokens_per_sec_per_gpu"] > 0 for r in rows)
    assert main(["report", "--results", str(tmp_path), "--format", "md", "--wide"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## Pre-training") and md.count("\n| tiny | CPU | 1 |") == 1 and "| FP32 |" in md
    assert main(["report", "--results", str(tmp_path), "--format", "md"]) == 0  # shared settings in one note
    md = capsys.readouterr().out
    assert "| tiny |" not in md and "Every row: Model tiny; System CPU" in md and "| FP32 |" in md
    assert main(["report", "--results", str(tmp_path), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("id,group_id,workload,model,precision")


def test_bare_lpbench_prints_help_and_exits_0():
    out = subprocess.run([sys.executable, "-m", "lpbench"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("usage: lpbench") and "lpbench run" in out.stdout and "report" in out.stdout
    assert "iteration" not in out.stdout  # nothing was trained


def test_run_shows_progress_and_ends_with_the_next_command(tmp_path, capsys):
    assert main(["run", *TINY, "--precision", "bf16,fp32", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    done = [line for line in lines if line.startswith("lpbench: run ")]
    assert len(done) == 2 and done[0].startswith("lpbench: run 1/2 bf16: ok in 0:")
    assert "| elapsed 0:" in done[0] and "| ETA 0:" in done[0] and done[0].endswith("for 1 more run(s)")
    assert done[1].startswith("lpbench: run 2/2 fp32: ok in 0:") and done[1].endswith("all runs done")
    from lpbench.bench.store import ResultsStore

    (group,) = {r["group_id"] for r in ResultsStore(tmp_path).runs()}
    assert lines[-1] == f"next: lpbench report --results {tmp_path} --group {group} --html report.html"
    argv = lines[-1].split()[2:-1] + [str(tmp_path / "report.html")]  # it runs as printed
    assert main(argv) == 0 and (tmp_path / "report.html").stat().st_size > 1000


def test_progress_eta_is_the_rate_so_far_times_the_steps_left(monkeypatch):
    import io

    from rich.console import Console

    from lpbench.bench import progress as pg

    now = [100.0]
    monkeypatch.setattr(pg.time, "monotonic", lambda: now[0])
    console = Console(file=io.StringIO(), width=200)
    with pg.RunsProgress(console, [("bf16", 10), ("fp8-tensorwise", 30)]) as p:
        p.start(0)
        for step in range(1, 11):
            now[0] += 0.5
            p.step({"step": step})
        assert p.progress.tasks[0].completed == 10 and p.progress.tasks[0].total == 40
        assert p.finish(0, "ok") == (
            "lpbench: run 1/2 bf16: ok in 0:00:05 | elapsed 0:00:05 | ETA 0:00:15 for 1 more run(s)"
        )
        p.start(1)
        p.step({"step": 21})  # resumed from a checkpoint at step 20
        assert p.progress.tasks[0].completed == 31
        now[0] += 10
        assert p.finish(1, "diverged").endswith("elapsed 0:00:15 | all runs done")


def test_progress_eta_counts_each_recipes_expected_cost_and_then_its_own_rate(monkeypatch):
    import io

    from rich.console import Console

    from lpbench.bench import progress as pg

    now = [0.0]
    monkeypatch.setattr(pg.time, "monotonic", lambda: now[0])
    costs = [pg.step_cost("bf16", False), pg.step_cost("fp8-tensorwise", True), pg.step_cost("nvfp4", True)]
    assert costs == [1.0, 3.0, 5.0] and pg.step_cost("fp8-tensorwise", False) == 1.0
    console = Console(file=io.StringIO(), width=200)
    with pg.RunsProgress(console, [("bf16", 11), ("fp8-tensorwise", 10), ("nvfp4", 10)], costs) as p:
        p.start(0)
        for step in range(1, 12):
            now[0] += 1.0
            p.step({"step": step})
        # 1 s a BF16 step; then 10 steps at 3x and 10 at 5x, not 20 at BF16's rate
        assert p.finish(0, "ok").split(" | ")[2].startswith("ETA 0:01:20 for 2 more run(s)")
        p.start(1)
        for step in range(1, 4):
            now[0] += 2.0  # faster than estimated: its own rate takes over
            p.step({"step": step})
        here, total = p.eta(10 - 3)
        assert here == 14.0 and total == 14.0 + 50.0
        p.finish(1, "diverged")
        assert [t.description for t in p.progress.tasks] == ["all 3 runs"]  # no stale bar of the diverged run


def test_fully_resumed_sweep_says_so_without_an_empty_bar(tmp_path, monkeypatch):
    import io

    import yaml
    from rich.console import Console

    from lpbench.bench import sweep as sw
    from lpbench.bench.store import ResultsStore

    spec = tmp_path / "s.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "model": "tiny",
                "device": "cpu",
                "steps": 3,
                "warmup_steps": 1,
                "seq_len": 32,
                "mbs": 2,
                "gbs": 2,
                "precision": ["bf16", "fp32"],
            }
        )
    )
    monkeypatch.setattr(
        ResultsStore, "finished_keys", lambda self, sweep_id: {r.key for r in sw.expand(sw.load_spec(str(spec))).runs}
    )
    monkeypatch.setattr(sw, "execute", lambda *a, **k: pytest.fail("nothing should run"))
    console = Console(file=io.StringIO(), width=200, force_terminal=True)
    sw.run_sweep(str(spec), results=str(tmp_path), console=console)
    out = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", console.file.getvalue())
    assert "nothing to run: all 2 runs of s are recorded" in out and "0/0" not in out

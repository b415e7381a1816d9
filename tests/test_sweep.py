"""lpbench sweep: grid expansion, per-run subprocesses and their statuses, timeout, kill + resume.

Children are real subprocesses training the tiny model for 3 steps; failures are injected
with the test-only ``LPBENCH_FAULT`` hook (tests/faults/sitecustomize.py, put on the children's path).
"""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lpbench.bench import sweep as sw
from lpbench.bench import sweep_child
from lpbench.bench.store import ResultsStore
from lpbench.cli import main
from lpbench.errors import UsageError

TINY = {"model": "tiny", "device": "cpu", "seq_len": 32, "mbs": 2, "gbs": 2, "steps": 3, "warmup_steps": 1}
REPO = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py: LPBENCH_FAULT's hooks
FAULT_ENV = "LPBENCH_FAULT"


def _inject(monkeypatch, faults: str) -> None:
    """Children started from now on fail as ``faults`` says."""
    monkeypatch.setenv(FAULT_ENV, faults)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))


def _spec(tmp_path, name="s", **settings) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, **TINY, **settings}))
    return path


def _rows(results, sweep_id):
    store = ResultsStore(results)
    rows = store.runs("sweep_id = ?", (sweep_id,))
    return store, rows


# ----------------------------------------------------------------------------- the spec
def test_grid_crosses_lists_zips_mappings_and_skips_invalid_combinations():
    no_batch = {k: v for k, v in TINY.items() if k not in ("mbs", "gbs", "seq_len")}
    spec = {
        "name": "g",
        **no_batch,
        "precision": ["bf16", "fp8-tensorwise"],
        "seq-len": [32, 64],
        "batch": [{"mbs": 2, "gbs": 4}, {"mbs": 4, "gbs": 4}, {"mbs": 3, "gbs": 4}],
    }
    sweep = sw.expand(spec)
    assert len(sweep.runs) == 2 * 2 * 2  # mbs 3 does not divide gbs 4: skipped, with the reason
    assert len(sweep.skipped) == 4 and all("not divisible" in why for _, why in sweep.skipped)
    assert {(r.config.precision, r.config.seq_len, r.config.mbs, r.config.gbs) for r in sweep.runs} == {
        (p, s, m, 4) for p in ("bf16", "fp8-tensorwise") for s in (32, 64) for m in (2, 4)
    }
    assert set(sweep.varying) == {"seq_len", "precision", "mbs"} and sweep.fixed["gbs"] == 4
    assert len({r.key for r in sweep.runs}) == 8 and [r.index for r in sweep.runs] == list(range(1, 9))
    assert sweep.runs[0].key == sweep.runs[0].config.key()  # resume matches on RunConfig.key()


def test_scalar_spec_is_one_run_and_repeats_run_once():
    sweep = sw.expand({"name": "one", **TINY, "seed": [5, 5]})
    assert len(sweep.runs) == 1 and sweep.duplicates == 1 and sweep.runs[0].config.seed == 5


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"precision": ["bf16", "fp9"]}, "unknown precision 'fp9'"),
        ({"model": "gpt5"}, "unknown model 'gpt5'"),
        ({"colour": "red"}, "unknown spec key 'colour'"),
        ({"seq_len": [32], "batch": [{"seq_len": 64, "mbs": 2}]}, "sets seq_len twice"),
        ({"steps": "many"}, "spec key steps: expected int"),
        ({"seq_len": []}, "empty list"),
        ({"workload": ["sft", "finetune"]}, "unknown workload 'finetune'; valid: pretrain, sft, lora"),
        ({"mbs": 4, "gbs": 6}, "no valid run"),
        ({"timeout": -1}, "spec key timeout"),
    ],
)
def test_bad_specs_are_usage_errors(spec, message):
    with pytest.raises(UsageError, match=message):
        sw.expand({"name": "bad", **TINY, **spec})


def test_gpu_setting_takes_the_recommended_config_and_num_gpus_sets_dp():
    sweep = sw.expand(
        {"name": "r", "model": "nemotron4-15b", "gpu": "h100", "num_gpus": 16, "steps": 3, "warmup_steps": 1}
    )
    (run,) = sweep.runs
    assert (run.config.seq_len, run.config.mbs, run.config.gbs, run.config.tp) == (4096, 2, 64, 2)
    assert run.num_gpus == 16 and run.config.dp == 8 and "nemotron4-recipe" in run.recommended
    assert sw.child_command(run, Path("r"), "r")[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    explicit = sw.expand(
        {"name": "r", "model": "nemotron4-15b", "gpu": "h100", "num_gpus": 16, "seq_len": 2048, "tp": 4}
    )
    assert (explicit.runs[0].config.seq_len, explicit.runs[0].config.tp, explicit.runs[0].config.dp) == (2048, 4, 4)


def test_missing_and_bad_spec_files(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "none.yaml")]) == 2
    assert "no sweep spec" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [tiny\n")
    assert main(["sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_dry_run_lists_runs_and_writes_nothing(tmp_path, capsys):
    spec = _spec(tmp_path, "dry", precision=["bf16", "fp8-tensorwise", "mxfp8"])
    assert main(["sweep", str(spec), "--results", str(tmp_path / "res"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 runs (0 done, 3 to run)" in out and out.count("to run │") == 3
    assert "fp8-tensorwise" in out and "mxfp8" in out
    assert not (tmp_path / "res").exists()


# ----------------------------------------------------------------------------- parent-side helpers
def test_classify_and_read_step_records(tmp_path):
    records = tmp_path / "001-k.steps.jsonl"
    records.write_text(
        '{"step": 1, "loss": 7.7, "step_time_s": 0.01, "tokens_per_sec_per_gpu": 6400, '
        '"peak_mem_gb": 0.4, "lr": 0.003, "grad_norm": 2.0}\n'
        '{"step": 2, "loss": NaN, "step_time_s": 0.01, "tokens_per_sec_per_gpu": 6400, '
        '"peak_mem_gb": null, "lr": 0.003, "grad_norm": NaN}\n'
        '{"step": 3, "loss": 7.'
    )  # the line a killed child left half-written
    steps = sw.read_steps(records)
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["loss"] == 7.7 and steps[1]["peak_mem_gb"] is None
    assert sw.read_steps(tmp_path / "none.jsonl") == []
    assert sw.classify(1, False, 10, "", steps) == ("diverged", "loss became nan at step 2")
    assert sw.classify(None, True, 10, "", steps[:1])[0] == "timeout"
    trace = "Traceback (most recent call last):\n  File x\nValueError: bad shape (3, 4)\nsome warning after\n"
    assert sw.classify(1, False, 10, trace, []) == ("error", "ValueError: bad shape (3, 4)")
    status, msg = sw.classify(1, False, 10, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n", [])
    assert status == "oom" and "CUDA out of memory" in msg
    status, msg = sw.classify(-9, False, 10, "", [])
    assert status == "error" and "SIGKILL" in msg


# ----------------------------------------------------------------------------- real sweeps
def test_sweep_records_ok_error_diverged_oom_and_crash(tmp_path, monkeypatch, capsys):
    # seed 1 trains; the others fail in the child in different ways (test-only hook).
    _inject(monkeypatch, "seed=2:error@2;seed=3:diverge@2;seed=4:oom@1;seed=5:crash@1;seed=6:oom-exit@1")
    spec = _spec(tmp_path, "faults", seed=[1, 2, 3, 4, 5, 6])
    rc = sw.run_sweep(str(spec), results=str(tmp_path))
    assert rc == 1  # not all ok
    store, rows = _rows(tmp_path, "faults")
    by_seed = {r["config"]["seed"]: r for r in rows}
    assert len(rows) == 6 and sorted(by_seed) == [1, 2, 3, 4, 5, 6]
    assert by_seed[1]["status"] == "ok" and by_seed[1]["tokens_per_sec_per_gpu"] > 0
    assert len(store.steps(by_seed[1]["id"])) == 3
    assert by_seed[2]["status"] == "error" and "injected error at step 2" in by_seed[2]["error"]
    assert by_seed[3]["status"] == "diverged" and "at step 2" in by_seed[3]["error"]
    assert by_seed[3]["metrics"]["diverged_step"] == 2 and len(store.steps(by_seed[3]["id"])) == 2
    assert by_seed[4]["status"] == "oom" and "out of memory" in by_seed[4]["error"]
    # the child died without a row: the parent wrote it from the exit status / stderr
    assert by_seed[5]["status"] == "error" and "SIGKILL" in by_seed[5]["error"]
    assert by_seed[5]["env"]["recorded_by"].startswith("sweep parent")
    assert by_seed[6]["status"] == "oom" and by_seed[6]["env"]["recorded_by"].startswith("sweep parent")
    assert all(r["group_id"] == "faults" for r in rows)
    logs = sorted((tmp_path / "sweeps" / "faults").glob("*.log"))
    assert len(logs) == 6 and "iteration 3/3" in logs[0].read_text()
    out = capsys.readouterr().out
    assert "5 of 6 runs did not finish ok" in out


def test_hanging_run_is_killed_and_recorded_as_timeout(tmp_path, monkeypatch):
    _inject(monkeypatch, "hang@2")
    spec = _spec(tmp_path, "hang")
    t0 = time.time()
    assert sw.run_sweep(str(spec), results=str(tmp_path), timeout=40) == 1
    assert time.time() - t0 < 150
    _, (row,) = _rows(tmp_path, "hang")
    assert row["status"] == "timeout" and "no result within 40 s" in row["error"]
    assert "last logged step 1" in row["error"]  # step 1 finished before the hang: kept from the log
    assert [s["step"] for s in ResultsStore(tmp_path).steps(row["id"])] == [1]


def _children_of(pid: int) -> list[int]:
    """Processes started by sweep ``pid`` (they carry its pid in their environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{sw.PARENT_ENV}={pid}".encode() in env:
            found.append(int(proc.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_sweep_killed_with_sigkill_resumes_with_one_row_per_run(tmp_path):
    spec = _spec(tmp_path, "resume", seed=[1, 2, 3])
    env = {
        **os.environ,
        FAULT_ENV: "seed=2:hang@1",  # run 2 hangs: killed mid-way
        "PYTHONPATH": os.pathsep.join([str(FAULTS), str(REPO)]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "lpbench", "sweep", str(spec), "--results", str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    db = tmp_path / "results.db"
    deadline = time.time() + 120
    first = []
    while time.time() < deadline and not first:
        time.sleep(0.5)
        if db.exists():
            try:
                with sqlite3.connect(db) as conn:
                    first = conn.execute("SELECT id, run_key, created_at FROM runs").fetchall()
            except sqlite3.OperationalError:
                pass  # schema being created
    assert first, "the first run never finished"
    deadline = time.time() + 60
    while time.time() < deadline and not _children_of(proc.pid):
        time.sleep(0.2)
    assert _children_of(proc.pid), "run 2 never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and _children_of(proc.pid):
        time.sleep(0.2)
    assert not _children_of(proc.pid), "the killed sweep left a run behind"

    store, rows = _rows(tmp_path, "resume")
    assert len(rows) == 1  # only the run that finished; the killed one left no half row
    assert sw.run_sweep(str(spec), results=str(tmp_path)) == 0  # no fault this time
    store, rows = _rows(tmp_path, "resume")
    assert sorted(r["config"]["seed"] for r in rows) == [1, 2, 3]
    assert len({r["run_key"] for r in rows}) == 3 and all(r["status"] == "ok" for r in rows)
    assert (rows[0]["id"], rows[0]["run_key"], rows[0]["created_at"]) == first[0]  # kept, not re-run
    assert all(len(store.steps(r["id"])) == 3 for r in rows)
    # a third invocation has nothing left to do and adds nothing
    assert sw.run_sweep(str(spec), results=str(tmp_path)) == 0
    assert len(_rows(tmp_path, "resume")[1]) == 3


def test_a_run_that_fails_before_training_is_recorded_with_the_machines_gpu(tmp_path, monkeypatch):
    """So the report lists it beside its sweep's other runs, not under 'CPU'."""
    from lpbench.config import RunConfig
    from lpbench.train import loop

    def fail(cfg, **kwargs):
        raise RuntimeError("torchao missing")

    monkeypatch.setattr(loop, "train", fail)
    monkeypatch.setattr(sweep_child, "_gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    cfg = RunConfig(model="tiny", device="auto")
    rc = sweep_child.child_main(
        ["--config", json.dumps(cfg.to_dict()), "--results", str(tmp_path), "--sweep-id", "g", "--run-key", cfg.key()]
    )
    _, (row,) = _rows(tmp_path, "g")
    assert rc == 1 and row["status"] == "error" and "torchao missing" in row["error"]
    assert row["gpu"] == "NVIDIA H100 80GB HBM3"


def test_a_resumed_run_is_not_credited_with_its_killed_attempts_steps(tmp_path, monkeypatch):
    """The steps file of a run is this attempt's: a killed earlier attempt's records (here a loss of 99 at
    steps 1-3) must not become the curve and final loss of the attempt that resumed it."""
    _inject(monkeypatch, "seed=1:crash@2")  # this attempt dies at step 2, leaving no row
    spec = _spec(tmp_path, "again", seed=1)
    [run] = sw.expand(sw.load_spec(spec)).runs
    steps_file = tmp_path / "sweeps" / "again" / f"{run.index:03d}-{run.key}.steps.jsonl"
    steps_file.parent.mkdir(parents=True)
    steps_file.write_text("".join(json.dumps({"step": s, "loss": 99.0}) + "\n" for s in (1, 2, 3)))
    assert sw.run_sweep(str(spec), results=str(tmp_path)) == 1
    store, [row] = _rows(tmp_path, "again")
    steps = store.steps(row["id"])
    assert row["status"] == "error" and "SIGKILL" in row["error"]
    assert [s["step"] for s in steps] == [1] and steps[0]["loss"] != 99.0, steps

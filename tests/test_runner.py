"""The one runner: a failure becomes a row that says why; every caller writes its row the same way."""

import pytest

from lpbench.bench import runner
from lpbench.bench.store import ResultsStore
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.train import loop


def _failing(exc):
    def train(cfg, **kwargs):
        raise exc

    return train


def test_an_exception_becomes_an_error_result_named_on_the_console(monkeypatch, capsys):
    monkeypatch.setattr(loop, "train", _failing(RuntimeError("no kernel\nsecond line")))
    result = runner.execute(RunConfig(precision="mxfp8"), results_dir="unused")
    assert (result.status, result.error) == ("error", "RuntimeError: no kernel")
    assert "lpbench: mxfp8 failed: RuntimeError: no kernel" in capsys.readouterr().out


def test_bad_input_is_raised_except_for_a_sweep_child(monkeypatch, capsys):
    monkeypatch.setattr(loop, "train", _failing(UsageError("--seq-len too long")))
    with pytest.raises(UsageError):
        runner.execute(RunConfig(), results_dir="unused")
    result = runner.execute(RunConfig(), results_dir="unused", record_usage_errors=True)
    assert result.error == "UsageError: --seq-len too long"
    assert "Traceback" in capsys.readouterr().err


def test_steps_reach_on_step_and_the_row(monkeypatch, tmp_path):
    def train(cfg, log, results_dir, on_step):
        rec = {"step": 1, "loss": 2.5, "step_time_s": 0.1}
        on_step(rec)
        return loop.RunResult(config=cfg, metrics={"final_loss": 2.5}, steps=[rec], env={"gpu": None})

    monkeypatch.setattr(loop, "train", train)
    seen = []
    cfg = RunConfig(workload="sft", seq_len=64).with_world(1)
    result = runner.execute(cfg, results_dir=str(tmp_path), on_step=seen.append)
    store = ResultsStore(tmp_path)
    runner.record(store, result, group_id="g", workload="converge", metrics={"final_loss": 2.0})
    (row,) = store.runs()
    assert seen == result.steps
    assert (row["run_key"], row["workload"], row["backend"], row["num_gpus"]) == (cfg.key(), "converge", "lpbench", 1)
    assert row["final_loss"] == 2.0 and row["config"]["seq_len"] == 64
    assert [s["loss"] for s in store.steps(row["id"])] == [2.5]


def test_a_peer_rank_gone_reads_as_that_not_as_gloos_message(monkeypatch, tmp_path):
    """A rank whose collective failed because another rank ended the job says so, not gloo's socket error (which
    named neither rank nor cause, and raced the other rank's own line into the job's output)."""

    def train(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4507: Connection reset by peer.")

    monkeypatch.setattr(loop, "train", train)
    result = runner.execute(RunConfig().with_world(1), results_dir=str(tmp_path))
    assert (result.status, result.error) == ("error", "another rank ended the job (its line says why)")


def test_a_failure_reads_as_its_first_line_that_says_something_and_its_cause():
    try:
        try:
            raise AssertionError("({y0: 64}, {y0: 128})\nmore")
        except AssertionError as inner:  # as torch's pipeline stage wraps a failed backward
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: Tensor") from inner
    except RuntimeError as exc:
        assert (
            runner.error_line(exc)
            == "RuntimeError: Failed to run stage backward (from AssertionError: ({y0: 64}, {y0: 128}))"
        )
    assert runner.error_line(ValueError("")) == "ValueError"
    try:
        try:
            raise AssertionError("shapes differ")
        except AssertionError as inner:  # as inductor wraps its own failures
            raise RuntimeError("AssertionError: shapes differ") from inner
    except RuntimeError as exc:
        assert runner.error_line(exc) == "RuntimeError: AssertionError: shapes differ"

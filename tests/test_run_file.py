"""lpbench run --config FILE (TOML or YAML; flags win) and --tensorboard DIR."""

import importlib.util

import pytest

from lpbench.bench.store import ResultsStore
from lpbench.cli import build_parser, configs_from_args, main

YAML = """\
model: tiny
precision: [bf16, fp8-tensorwise]   # a list, as in a sweep spec
seq-len: 64
mbs: 2
gbs: 4
steps: 8
warmup_steps: 2
compile: false
lr: 1e-3
"""
TOML = """\
model = "tiny"
precision = "fp32"
seq = 32          # the sweep spec's alias of seq_len
mbs = 2
gbs = 2
steps = 3
warmup-steps = 1
"""


def _configs(tmp_path, text, suffix, *flags):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    return configs_from_args(build_parser().parse_args(["run", "--config", str(path), *flags]))


def test_yaml_file_sets_the_flags_and_the_command_line_wins(tmp_path):
    a, b = _configs(tmp_path, YAML, ".yaml", "--steps", "5", "--mbs", "4")
    assert (a.precision, b.precision) == ("bf16", "fp8-tensorwise")
    assert (a.model, a.seq_len, a.gbs, a.warmup_steps, a.compile, a.lr) == ("tiny", 64, 4, 2, False, 1e-3)
    assert (a.steps, a.mbs) == (5, 4)  # flags override the file
    (c,) = _configs(tmp_path, YAML, ".yaml", "--precision", "mxfp8", "--compile")
    assert c.precision == "mxfp8" and c.compile is True


def test_toml_file_takes_the_sweep_specs_aliases(tmp_path):
    (cfg,) = _configs(tmp_path, TOML, ".toml")
    assert (cfg.seq_len, cfg.steps, cfg.warmup_steps, cfg.precision) == (32, 3, 1, "fp32")


@pytest.mark.parametrize(
    "text,suffix,message",
    [
        ("seq_lenn: 64\n", ".yaml", "unknown key 'seq_lenn'; valid:"),
        ("seq_len: [64, 128]\n", ".yaml", "seq_len: a list makes a grid of runs; that is `lpbench sweep"),
        ("mbs: two\n", ".yaml", "--config {path}: mbs: expected int, got 'two'"),
        ("compile: maybe\n", ".yaml", "--config {path}: compile: expected bool, got 'maybe'"),
        ("workload: finetune\n", ".yaml", "unknown workload 'finetune'; valid: pretrain, sft, lora"),
        ("steps = [\n", ".toml", "not valid TOML"),
        ("a: [1\n", ".yaml", "not valid YAML"),
        ("- 1\n- 2\n", ".yaml", "expected a mapping of flag names to values"),
        ("steps: 3\n", ".json", "expected a .toml, .yaml or .yml file"),
        ("seq_len: 64\nseq: 128\n", ".yaml", "--config {path}: sets seq_len twice (as 'seq_len' and 'seq')"),
        ("steps: 3\nsteps: 4\n", ".yaml", "key 'steps' given twice"),
        ("seq-len = 64\nseq_len = 128\n", ".toml", "sets seq_len twice"),
    ],
)
def test_bad_config_files_exit_2_with_one_line(text, suffix, message, tmp_path, capsys):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    assert main(["run", "--config", str(path), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "results.db").exists()


def test_config_file_not_utf8_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfe seq_len: 3\n")
    assert main(["run", "--config", str(path), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: not UTF-8 text (byte 0)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()


def test_missing_config_file(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "nope.yaml"), "--results", str(tmp_path)]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def test_run_from_a_file_with_tensorboard_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = tmp_path / "run.toml"
    path.write_text(TOML)
    tb = tmp_path / "tb"
    assert main(["run", "--config", str(path), "--tensorboard", str(tb), "--results", str(tmp_path)]) == 0
    capsys.readouterr()
    (run,) = ResultsStore(tmp_path).runs()
    assert (run["config"]["seq_len"], run["config"]["steps"], run["precision"]) == (32, 3, "fp32")
    (folder,) = tb.iterdir()
    assert folder.name == f"tiny-fp32-{run['run_key']}"
    events = EventAccumulator(str(folder))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    steps = ResultsStore(tmp_path).steps(run["id"])
    assert losses == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in steps]
    assert {"perf/tokens_per_sec_per_gpu", "optim/lr", "perf/step_time_s"} <= set(events.Tags()["scalars"])


def test_tensorboard_missing_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["run", "--model", "tiny", "--tensorboard", str(tmp_path / "tb"), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard needs the tensorboard package: pip install tensorboard" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "tb").exists()


def test_wandb_logs_each_step_offline(tmp_path, capsys, monkeypatch):
    """--wandb DIR: one offline W&B run per precision with every step's metrics (a fake wandb module)."""
    import sys
    import types

    runs = []

    class FakeRun:
        def __init__(self, **kw):
            self.init, self.logged, self.finished = kw, [], False
            runs.append(self)

        def log(self, values, step):
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: FakeRun(**kw)))
    assert (
        main(
            [
                "run",
                "--model",
                "tiny",
                "--seq-len",
                "32",
                "--mbs",
                "2",
                "--gbs",
                "2",
                "--steps",
                "3",
                "--warmup-steps",
                "1",
                "--precision",
                "bf16,fp32",
                "--wandb",
                str(tmp_path / "wb"),
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert [r.init["config"]["precision"] for r in runs] == ["bf16", "fp32"]
    assert all(r.init["mode"] == "offline" and r.init["dir"] == str(tmp_path / "wb") and r.finished for r in runs)
    assert [step for step, _ in runs[0].logged] == [1, 2, 3]
    assert runs[0].logged[0][1]["train/loss"] > 0 and "perf/tokens_per_sec_per_gpu" in runs[0].logged[0][1]


def test_wandb_missing_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    import sys

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["run", "--model", "tiny", "--wandb", str(tmp_path / "wb"), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--wandb needs the wandb package: pip install wandb" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()

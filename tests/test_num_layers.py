"""--num-layers: a zoo model cut to its first N blocks, labelled model@NL, counted for what ran."""

import json
import sys
from dataclasses import replace

import pytest
import yaml

from lpbench.bench.store import ResultsStore
from lpbench.bench.sweep import expand
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.metrics.flops import flops_per_token
from lpbench.models import build_model, count_parameters, get_model_config
from lpbench.convert.quantize import apply_recipe
from lpbench.precision.recipes import get_recipe

TINY = ["--model", "tiny", "--seq-len", "32", "--mbs", "2", "--gbs", "2", "--steps", "3", "--warmup-steps", "1"]


def test_cut_model_keeps_widths_and_vocabulary_and_is_labelled():
    full = get_model_config("llama3-8b")
    cfg = RunConfig(model="llama3-8b", num_layers=16, seq_len=8192, mbs=1, gbs=1).validate()
    cut = cfg.model_config()
    assert cut.n_layers == 16 and cut == replace(full, n_layers=16)
    assert cfg.label == "llama3-8b@16L" and RunConfig(model="llama3-8b").label == "llama3-8b"
    assert cfg.key() != cfg.with_(num_layers=None).key() != cfg.with_(num_layers=15).key()


def test_flops_and_parameters_count_the_blocks_that_ran():
    full = get_model_config("llama3-8b")
    per_block = flops_per_token(replace(full, n_layers=2), 8192) - flops_per_token(replace(full, n_layers=1), 8192)
    cut = RunConfig(model="llama3-8b", num_layers=16, seq_len=8192).model_config()
    assert flops_per_token(cut, 8192) == pytest.approx(flops_per_token(full, 8192) - 16 * per_block)
    tiny = get_model_config("tiny")
    one, two = (count_parameters(build_model(replace(tiny, n_layers=n))) for n in (1, 2))
    assert count_parameters(build_model(RunConfig(model="tiny", num_layers=3).model_config())) == one + 2 * (two - one)


def test_flops_command_takes_num_layers(capsys):
    assert main(["flops", "--model", "llama3-8b", "--seq-len", "8192", "--num-layers", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama3-8b@16L"
    assert out["flops_per_token"] == flops_per_token(replace(get_model_config("llama3-8b"), n_layers=16), 8192)


def test_bf16_tail_applies_to_the_last_blocks_of_the_cut_model():
    recipe = get_recipe("nvfp4")  # its last 4 blocks stay BF16
    cfg = RunConfig(model="tiny", num_layers=6).model_config()
    info = apply_recipe(build_model(cfg), recipe, device="cpu", emulate=True)
    blocks = sorted({int(name.split(".")[1]) for name in info["quantized"]})
    assert recipe.last_bf16_layers == 4 and blocks == [0, 1]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--model", "tiny", "--num-layers", "0"], "--num-layers must be between 1 and tiny's 8 blocks, got 0"),
        (["run", "--model", "tiny", "--num-layers", "9"], "--num-layers must be between 1 and tiny's 8 blocks, got 9"),
        (["run", "--model", "tiny", "--num-layers", "-2"], "got -2"),
        (["run", "--model", "tiny", "--num-layers", "two"], "invalid int value"),
        (["run", "--hf-checkpoint", "/nonexistent", "--num-layers", "2"], "--num-layers cuts a zoo model"),
        (["flops", "--model", "tiny", "--seq-len", "32", "--num-layers", "40"], "between 1 and tiny's 8 blocks"),
    ],
)
def test_bad_num_layers_exit_2_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main([*argv, *(["--results", str(tmp_path)] if argv[0] == "run" else [])]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "results.db").exists()


def test_run_records_the_label_and_what_ran(tmp_path, capsys):
    assert main(["run", *TINY, "--num-layers", "2", "--precision", "bf16", "--results", str(tmp_path)]) == 0
    assert "pretrain tiny@2L (" in capsys.readouterr().out
    (row,) = ResultsStore(tmp_path).runs()
    cut = RunConfig(model="tiny", num_layers=2).model_config()
    assert row["model"] == "tiny@2L" and row["config"]["num_layers"] == 2
    assert row["metrics"]["params"] == count_parameters(build_model(cut))
    assert row["metrics"]["flops_per_token"] == flops_per_token(cut, 32)
    assert main(["report", "--results", str(tmp_path), "--format", "md"]) == 0
    assert "| tiny@2L | CPU |" in capsys.readouterr().out


def test_sweep_key_num_layers(tmp_path):
    sweep = expand(
        {
            "name": "cut",
            "model": "llama3-8b",
            "num_layers": [8, 16],
            "seq_len": 8192,
            "mbs": 1,
            "gbs": 1,
            "device": "cpu",
        }
    )
    assert [r.config.num_layers for r in sweep.runs] == [8, 16]
    assert [r.config.label for r in sweep.runs] == ["llama3-8b@8L", "llama3-8b@16L"]
    assert sweep.varying == ["num_layers"]
    with pytest.raises(UsageError, match="between 1 and llama3-8b's 32 blocks, got 33"):
        expand({"model": "llama3-8b", "num_layers": 33})
    with pytest.raises(UsageError, match="expected int"):
        expand({"model": "llama3-8b", "num_layers": "many"})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({"model": "tiny", "num_layers": 0}))
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["sweep", str(tmp_path / "s.yaml"), "--results", str(tmp_path)]))
    assert exc.value.code == 2

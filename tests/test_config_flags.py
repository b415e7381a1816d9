"""The run configuration is declared once: RunConfig's fields make the flags and the sweep keys."""

import argparse
import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from lpbench.bench import sweep_spec
from lpbench.cli import build_parser, configs_from_args
from lpbench.config import RunConfig, add_config_args, config_kwargs, field_type, flag_fields
from lpbench.errors import UsageError


def _subparser(name):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_flag_field_is_a_run_flag_and_unset_by_default():
    run = _subparser("run")
    dests = {}
    for a in run._actions:  # a switch that takes words (--emulate [always]) has a --no- action after it
        dests.setdefault(a.dest, a)
    for f in flag_fields():
        assert f.name in dests, f.name
        assert dests[f.name].default is None  # unset: explicit flags are told from defaults
        assert f.metadata["help"] in dests[f.name].help
    args = run.parse_args([])
    assert config_kwargs(args) == {}


def test_flags_take_the_fields_types():
    p = argparse.ArgumentParser()
    add_config_args(p, ["steps", "lr", "compile", "model", "tp"])
    args = p.parse_args(["--steps", "7", "--lr", "1e-3", "--no-compile", "--model", "small", "-tp", "2"])
    assert config_kwargs(args) == {"steps": 7, "lr": 1e-3, "compile": False, "model": "small", "tp": 2}
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "seven"])


def test_help_states_each_default():
    p = argparse.ArgumentParser()
    add_config_args(p, ["steps", "emulate", "lr"], defaults={"emulate": True})
    helps = {}
    for a in p._actions:
        helps.setdefault(a.dest, a.help)
    assert helps["steps"].endswith(f"(default {RunConfig().steps})")
    assert helps["emulate"].endswith("(default on)")
    assert helps["lr"].endswith("(default: 3e-3 for the CPU-sized presets, 3e-4 otherwise)")
    assert p.parse_args([]).emulate is True and p.parse_args([]).steps == RunConfig().steps


def test_run_without_flags_is_runconfigs_defaults():
    (cfg,) = configs_from_args(build_parser().parse_args(["run", "--precision", "bf16"]))
    assert cfg == RunConfig()


def test_converge_flags_come_from_runconfig_with_its_own_defaults():
    args = _subparser("converge").parse_args([])
    d = RunConfig()
    assert (args.model, args.seq_len, args.mbs, args.seed) == (d.model, d.seq_len, d.mbs, d.seed)
    assert args.gbs is None and args.precision == ["bf16", "fp8-tensorwise", "mxfp8", "nvfp4"]  # GBS follows MBS
    assert (args.emulate, args.log_interval, args.eval_every) == (True, 10, None)


def test_sweep_keys_are_coerced_to_the_fields_types():
    run_fields = {f.name: f for f in fields(RunConfig)}
    assert sweep_spec._coerce("steps", "12", run_fields) == 12
    assert sweep_spec._coerce("lr", "1e-3", run_fields) == 1e-3
    assert sweep_spec._coerce("compile", "off", run_fields) is False
    assert sweep_spec._coerce("model", 8, run_fields) == "8"
    assert sweep_spec._coerce("num_gpus", "2", run_fields) == 2
    with pytest.raises(UsageError, match="spec key seq_len: expected int"):
        sweep_spec._coerce("seq_len", "long", run_fields)
    assert {field_type(f) for f in fields(RunConfig)} == {int, float, bool, str}


def _flags_of(parser) -> set[str]:
    return {a.dest for a in parser._actions if a.option_strings}


def test_every_setting_is_a_run_flag_a_config_key_and_a_sweep_key(tmp_path):
    """#40.4: the three sets come from RunConfig's declaration and are the same; a sweep leaves out only the
    settings of one run (declared ``sweep=False``: the checkpoint folders)."""
    from lpbench.bench.run_file import apply_config_file
    from lpbench.config import fact

    declared = {f.name for f in fields(RunConfig)}
    run_flags = _flags_of(_subparser("run")) & declared
    config_keys, sweep_keys = set(), set()
    for f in fields(RunConfig):
        value = "null" if f.default is None else json.dumps(f.default)
        path = tmp_path / f"{f.name}.yaml"
        path.write_text(f"{f.name.replace('_', '-')}: {value}\n")
        args = _subparser("run").parse_args(["--config", str(path)])
        apply_config_file(args)  # an unknown key is an error
        config_keys.add(f.name)
        spec = {"name": "keys", "seq_len": 64, "steps": 4, f.name: f.default}
        try:
            sweep_spec.expand(spec)
            sweep_keys.add(f.name)
        except UsageError as exc:
            assert "belong to one run" in str(exc) and not fact(f, "sweep"), (f.name, exc)
    assert run_flags == config_keys == declared
    assert sweep_keys == declared - {"save_every", "save_dir", "load", "export_hf"}


def test_the_facts_lists_come_from_the_declaration():
    """What used to be NOT_IN_KEY, MATCH_FIELDS, CONFIG_FLAGS and LAYOUT_KEYS, now facts of each field (a field
    added later may join a set, none of these may leave it)."""
    from lpbench.config import settings
    from lpbench.report.tables import layout_keys

    assert set(settings("resume")) >= {
        "model",
        "num_layers",
        "vocab_size",
        "precision",
        "backend",
        "workload",
        "lora_rank",
        "lora_targets",
        "seq_len",
        "mbs",
        "gbs",
        "dp",
        "tp",
        "ep",
        "fsdp",
        "data",
        "seed",
    }
    assert {f.name for f in fields(RunConfig)} - set(settings("key")) == {
        "save_every",
        "save_dir",
        "load",
        "export_hf",
        "profile_steps",
        "profile_stacks",
        "tensorboard",
        "wandb",
        "flops_formula",
    }
    assert set(settings("converge")) >= {
        "model",
        "num_layers",
        "data",
        "seq_len",
        "mbs",
        "gbs",
        "lr",
        "eval_every",
        "eval_batches",
        "seed",
        "device",
        "compile",
        "emulate",
        "log_interval",
        "precision",
    }
    assert set(layout_keys()) >= {
        "tp",
        "ep",
        "dp",
        "fsdp",
        "fsdp_fp8_all_gather",
        "sequence_parallel",
        "compile",
        "compile_scope",
    }
    assert set(layout_keys(numbers_only=True)) >= {"tp", "ep", "dp"} and "fsdp" not in layout_keys(True)
    converge = _flags_of(_subparser("converge"))
    assert set(settings("converge")) <= converge and "lr_warmup_steps" not in converge


def test_help_groups_the_settings_by_section(capsys):
    """``lpbench run --help`` lists each setting under its section; an ``arg`` without one (a field from a
    branch that predates sections) lands in "other settings" and still works."""
    from dataclasses import dataclass, field

    from lpbench.config import SECTIONS, arg, fact

    groups = {g.title: {a.dest for a in g._group_actions} for g in _subparser("run")._action_groups}
    for f in fields(RunConfig):
        assert fact(f, "section") in SECTIONS[:-1] and f.name in groups[f"{fact(f, 'section')} settings"], f.name

    @dataclass
    class Legacy:
        pp: int = field(default=1, metadata=arg("pipeline-parallel size"))

    (pp,) = fields(Legacy)
    assert [fact(pp, k) for k in ("section", "key", "resume", "layout", "converge", "sweep")] == [
        "other",
        True,
        False,
        False,
        False,
        True,
    ]
    p = argparse.ArgumentParser()
    add_config_args(p, ["precision", "steps"])
    assert p.parse_args(["--precision", "bf16,nvfp4"]).precision == ["bf16", "nvfp4"]  # generated, a list
    assert config_kwargs(p.parse_args(["--precision", "bf16", "--steps", "3"])) == {"steps": 3}


def test_defaults_follow_the_settings_they_depend_on():
    """#40.5: warm-up follows --steps, GBS follows MBS x DP (also after DP is set from the world size); only
    explicit contradictions are errors."""

    def configs(*argv, world=None):
        return configs_from_args(build_parser().parse_args(["run", "--precision", "bf16", *argv]), world_size=world)

    (cfg,) = configs("--steps", "2")
    assert (cfg.warmup_steps, cfg.derived) == (1, ("gbs", "warmup_steps"))
    assert "warmup steps 1 (default: min(10, steps / 2))" in cfg.header()
    (cfg,) = configs("--mbs", "2", world=2)
    assert (cfg.dp, cfg.gbs, cfg.grad_accum) == (2, 4, 1) and "gbs 4 (default: MBS x DP)" in cfg.header()
    (cfg,) = configs("--gbs", "8", "--mbs", "2", "--steps", "30", "--warmup-steps", "3", world=2)
    assert (cfg.gbs, cfg.warmup_steps, cfg.derived) == (8, 3, ())
    assert "TFLOP/s by the megatron formula" in cfg.header()
    with pytest.raises(UsageError, match=r"--warmup-steps \(10\) must be less than --steps \(2\)"):
        configs("--steps", "2", "--warmup-steps", "10")
    with pytest.raises(UsageError, match="global batch 8 is not divisible by micro batch 8 x data-parallel size 2"):
        configs("--gbs", "8", world=2)
    assert RunConfig(mbs=2).with_(mbs=4).gbs == 4 and RunConfig(mbs=2, gbs=2).with_(mbs=4).gbs == 2


def test_steps_2_on_two_processes_runs_with_the_defaults(tmp_path):
    """#40.5 end to end: ``--steps 2 --nproc-per-node 2`` with the default warm-up and GBS trains, and the log
    header says which defaults followed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpbench",
            "run",
            "--precision",
            "bf16",
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--mbs",
            "2",
            "--steps",
            "2",
            "--device",
            "cpu",
            "--nproc-per-node",
            "2",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "lpbench: gbs 4 (default: MBS x DP) | warmup steps 1 (default: min(10, steps / 2)) | TFLOP/s by the "
        "megatron formula"
    ) in out.stdout
    assert out.stdout.count("train_step_timing in s:") == 2


def test_flops_and_run_share_one_formula_flag(capsys):
    """#40.7: ``--flops-formula`` in both commands, ``--formula`` kept as its alias in both."""
    from lpbench.cli import main

    for flag in ("--flops-formula", "--formula"):
        assert main(["flops", "--model", "llama3-8b", "--seq-len", "8192", flag, "nemo-legacy", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["formula"] == "nemo-legacy"
        (cfg,) = configs_from_args(build_parser().parse_args(["run", "--precision", "bf16", flag, "mha"]))
        assert cfg.flops_formula == "mha"

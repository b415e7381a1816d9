"""The run configuration is declared once: RunConfig's fields make the flags and the sweep keys."""

import argparse
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

"""``lpbench run --config FILE``: the run's flags from a TOML or YAML file; flags on the command line win.

Keys are the flags' names (``seq-len`` or ``seq_len``) and the sweep spec's aliases (``seq``,
``gpus``, ``task``, ...), values typed as a sweep spec's are (one coercion, in
:mod:`lpbench.bench.sweep_spec`); ``precision`` may be a list. A bad file is one line on stderr
and exit 2, like a bad flag. A list anywhere else makes a grid: that is ``lpbench sweep FILE``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.parsing import MAX_DEPTH, check_structure, parse_yaml

IGNORED = ("name", "description")  # a sweep spec's labels: allowed, unused by one run
LAUNCH_KEYS = ("gpu", "num_gpus", "nproc_per_node")  # flags of `lpbench run` that are not fields (typed by _coerce)


def load_mapping(path: str) -> dict:
    """The top-level mapping of a ``.toml``, ``.yaml`` or ``.yml`` file."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path}: not UTF-8 text (byte {exc.start})") from None
    if p.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            raise UsageError("--config FILE.toml needs Python >= 3.11 (or use YAML)") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
        except RecursionError:
            raise UsageError(f"--config {path}: nested deeper than {MAX_DEPTH} levels") from None
        check_structure(data, f"--config {path}: ")
    elif p.suffix in (".yaml", ".yml"):
        data = parse_yaml(text, f"--config {path}")
    else:
        raise UsageError(f"--config {path}: expected a .toml, .yaml or .yml file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values")
    return data


def apply_config_file(args: argparse.Namespace) -> None:
    """Set on ``args`` the values of ``args.config`` for the flags the command line left unset (None)."""
    from lpbench.bench.sweep_spec import _coerce, _norm_key, _normalized
    from lpbench.config import fact, flag_fields
    from lpbench.console import csv_list

    path = args.config
    run_fields = {f.name: f for f in flag_fields()}
    valid = sorted({*run_fields, *LAUNCH_KEYS})
    mapping = load_mapping(path)
    try:
        _normalized(mapping, run_fields)  # one setting given twice (``seq`` and ``seq-len``) is an error
    except UsageError as exc:
        raise UsageError(f"--config {path}: {str(exc).removeprefix('spec ')}") from None
    for raw_key, value in mapping.items():
        key = _norm_key(raw_key, run_fields)
        if key in IGNORED:
            continue
        if key not in valid:
            raise UsageError(
                f"--config {path}: unknown key {raw_key!r}; valid: {', '.join(k.replace('_', '-') for k in valid)}"
            )
        if getattr(args, key) is not None:  # the command line wins
            continue
        if key in run_fields and fact(run_fields[key], "many"):  # precision: one run per item
            try:
                value = csv_list(",".join(map(str, value)) if isinstance(value, list) else str(value))
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"--config {path}: {key}: {exc}") from None
        elif isinstance(value, (list, dict)):
            raise UsageError(f"--config {path}: {key}: a list makes a grid of runs; that is `lpbench sweep {path}`")
        else:
            try:
                value = _coerce(key, value, run_fields)
            except UsageError as exc:
                raise UsageError(f"--config {path}: {str(exc).removeprefix('spec key ')}") from None
        setattr(args, key, value)

"""Sweep specs: a YAML mapping of run settings, expanded into a grid of validated runs.

* ``name`` (default: the file's stem) is the sweep id: a re-run with the same name resumes.
* ``timeout``: seconds per run (default 3600); ``--timeout`` overrides.
* every other key is a run setting: a RunConfig field (``model``, ``precision``, ``seq_len``,
  ``mbs``, ``gbs``, ``steps``, ``tp``, ``dp``, ``fsdp`` ...; dashes or underscores; values are
  coerced to the field's type; not those declared ``sweep=False``, the settings of one run: its
  checkpoint folders), or ``num_gpus`` (processes to launch, torchrun when > 1; DP =
  GPUs / TP), ``gpu`` (take unset seq_len/mbs/gbs/tp from the recommended configs of that GPU
  type). ``workload`` (pretrain, sft, lora), the ``lora_*`` settings and ``hf_checkpoint`` (the
  run's model is then labelled ``hf:<folder>`` unless ``model`` is set) are RunConfig fields too.
  A scalar applies to every run; a list is an axis of the grid; a list of mappings is an axis
  whose points set several settings together (e.g. MBS/GBS pairs, or ``{workload: lora, lora_rank: 8}``).

README "Sweeps" has the full story; :mod:`lpbench.bench.sweep` runs the grid.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from lpbench.errors import UsageError
from lpbench.parsing import parse_yaml

DEFAULT_TIMEOUT_S = 3600.0
RESERVED = ("name", "timeout", "description")
EXTRA_KEYS = ("num_gpus", "gpu")  # sweep settings that are not RunConfig fields
ALIASES = {
    "task": "workload",
    "models": "model",
    "precisions": "precision",
    "gpus": "num_gpus",
    "seq": "seq_len",
    "seq_length": "seq_len",
    "sequence_length": "seq_len",
}


@dataclass
class SweepRun:
    index: int  # 1-based position in the grid
    config: object  # RunConfig
    settings: dict  # the spec's settings for this run (after recommended defaults)
    workload: str = "pretrain"
    backend: str = "lpbench"
    num_gpus: int = 1
    recommended: str | None = None  # the recommended row used, described

    @property
    def key(self) -> str:
        return self.config.key()


@dataclass
class Sweep:
    name: str
    timeout: float
    runs: list[SweepRun]
    fixed: dict = field(default_factory=dict)
    varying: list[str] = field(default_factory=list)  # settings that differ between runs (labels)
    skipped: list[tuple[dict, str]] = field(default_factory=list)  # invalid combinations and why
    duplicates: int = 0  # grid points that are the same run as an earlier one

    def label(self, run: SweepRun) -> str:
        keys = self.varying or ["model", "precision"]
        return " ".join(f"{k}={run.settings.get(k, getattr(run.config, k, None))}" for k in keys)


def _norm_key(key, run_fields: dict | None = None) -> str:
    k = str(key).strip().replace("-", "_").lower()
    return k if run_fields and k in run_fields else ALIASES.get(k, k)


def _normalized(mapping: dict, run_fields: dict) -> dict:
    """``mapping`` with its keys normalized; two keys naming one setting (``model`` and ``models``) are an error."""
    out, given = {}, {}
    for key, value in mapping.items():
        k = _norm_key(key, run_fields)
        if k in out:
            raise UsageError(f"spec sets {k} twice (as {given[k]!r} and {key!r})")
        out[k], given[k] = value, key
    return out


def sweep_id_of(name) -> str:
    """A sweep id: letters, digits, '.', '_' and '-', not starting with '.' or '-' (a folder name in sweeps/)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).lstrip(".-").rstrip("-") or "sweep"


def _coerce(key: str, value, run_fields: dict):
    """A YAML value as the type of RunConfig's field (or of the sweep or launch setting)."""
    if value is None:
        return None
    from lpbench.config import check_number, field_type

    kind = {"num_gpus": int, "gpu": str, "nproc_per_node": int}.get(key) or field_type(run_fields[key])
    if kind is bool:
        if isinstance(value, bool) or value in _words(key, run_fields):
            return value
        if str(value).lower() in ("true", "yes", "on", "1"):
            return True
        if str(value).lower() in ("false", "no", "off", "0"):
            return False
    elif kind is int and not isinstance(value, bool):
        try:
            number = value if isinstance(value, int) else float(value)
            whole = int(number) if number == int(number) else None
        except (TypeError, ValueError, OverflowError):
            whole = None
        if whole is not None:
            check_number(key, whole, int)  # the same check as the flag's
            return whole
    elif kind is float and not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
        else:
            check_number(key, number, float)
            return number
    elif kind is str and not isinstance(value, (dict, list)):
        return str(value)
    expected = " or ".join((kind.__name__, *_words(key, run_fields)))
    raise UsageError(f"spec key {key}: expected {expected}, got {value!r}")


def _words(key: str, run_fields: dict) -> tuple:
    """The strings a RunConfig switch also takes (``emulate: always``)."""
    return run_fields[key].metadata.get("words", ()) if key in run_fields else ()


def load_spec(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no sweep spec at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (byte {exc.start}); a sweep spec is a YAML file") from None
    spec = parse_yaml(text, str(path))
    if not isinstance(spec, dict) or not spec:
        raise UsageError(f"{path}: a sweep spec is a YAML mapping of settings (see README, Sweeps)")
    spec.setdefault("name", path.stem)
    return spec


def expand(spec: dict) -> Sweep:
    """The spec's grid as validated runs (invalid combinations are listed in ``skipped``)."""
    from lpbench.config import WORKLOADS, RunConfig, fact
    from lpbench.models import get_model_config
    from lpbench.precision.recipes import get_recipe

    run_fields = {f.name: f for f in fields(RunConfig)}
    run_only = {name for name, f in run_fields.items() if not fact(f, "sweep")}  # every run would share them
    valid = sorted(set(run_fields) - run_only | set(EXTRA_KEYS))
    spec = _normalized(spec, run_fields)
    name = sweep_id_of(spec.pop("name", "sweep"))
    timeout = spec_timeout = spec.pop("timeout", DEFAULT_TIMEOUT_S)
    spec.pop("description", None)
    try:
        timeout = -1.0 if isinstance(timeout, bool) else float(timeout)  # `timeout: true` is not a number
    except (TypeError, ValueError, OverflowError):
        timeout = -1.0
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"spec key timeout: expected seconds > 0, got {spec_timeout!r}")

    fixed: dict = {}
    axes: list[list[dict]] = []
    owner: dict[str, str] = {}  # setting -> the spec key that sets it

    def claim(setting: str, by: str) -> None:
        if setting in run_only:
            raise UsageError(
                f"spec key {setting}: checkpoints belong to one run (lpbench run "
                f"--{setting.replace('_', '-')}), not to a sweep"
            )
        if setting not in valid:
            raise UsageError(f"unknown spec key {setting!r}; valid: {', '.join(RESERVED + tuple(valid))}")
        if setting in owner:
            raise UsageError(f"spec sets {setting} twice (in {owner[setting]!r} and {by!r})")
        owner[setting] = by

    for key, value in spec.items():
        if isinstance(value, str) and key in ("model", "precision") and "," in value:
            value = [v.strip() for v in value.split(",") if v.strip()]  # like --precision a,b
        if isinstance(value, list):
            if not value:
                raise UsageError(f"spec key {key}: an empty list gives no runs")
            if all(isinstance(v, dict) for v in value):  # settings swept together
                points = [_normalized(point, run_fields) for point in value]
                for setting in dict.fromkeys(k for p in points for k in p):
                    claim(setting, key)
                axes.append([{k: _coerce(k, v, run_fields) for k, v in p.items()} for p in points])
            elif any(isinstance(v, (dict, list)) for v in value):
                raise UsageError(f"spec key {key}: a list of values or a list of mappings, not a mix")
            else:
                claim(key, key)
                axes.append([{key: _coerce(key, v, run_fields)} for v in value])
        elif isinstance(value, dict):
            raise UsageError(
                f"spec key {key}: a mapping must be inside a list (a list of mappings is "
                "an axis whose points set several settings together)"
            )
        else:
            claim(key, key)
            fixed[key] = _coerce(key, value, run_fields)

    # Names are checked across the whole spec: a typo is an error, not a skipped run.
    def values(k: str) -> set:
        return {p[k] for axis in axes for p in axis if k in p} | ({fixed[k]} if k in fixed else set())

    for m in values("model"):
        get_model_config(m)
    for p in values("precision"):
        get_recipe(p)
    for w in values("workload"):
        if w not in WORKLOADS:
            raise UsageError(f"unknown workload {w!r}; valid: {', '.join(WORKLOADS)}")

    sweep = Sweep(name=name, timeout=timeout, runs=[], fixed=fixed)
    seen: set[str] = set()
    for combo in itertools.product(*axes) if axes else [()]:
        settings = dict(fixed)
        for point in combo:
            settings.update(point)
        try:
            run = _make_run(settings, run_fields, RunConfig)
        except UsageError as exc:
            sweep.skipped.append((settings, str(exc)))
            continue
        if run.key in seen:
            sweep.duplicates += 1
            continue
        seen.add(run.key)
        run.index = len(sweep.runs) + 1
        sweep.runs.append(run)
    if not sweep.runs:
        reasons = "; ".join(sorted({why for _, why in sweep.skipped}))
        raise UsageError(f"the sweep has no valid run ({reasons})")
    keys = list(dict.fromkeys(k for r in sweep.runs for k in r.settings))
    sweep.varying = [k for k in keys if len({json.dumps(r.settings.get(k)) for r in sweep.runs}) > 1]
    sweep.fixed = {k: sweep.runs[0].settings.get(k) for k in keys if k not in sweep.varying}
    return sweep


def _make_run(settings: dict, run_fields: dict, RunConfig) -> SweepRun:
    settings = dict(settings)
    kwargs = {k: v for k, v in settings.items() if k in run_fields}
    if kwargs.get("hf_checkpoint") and "model" not in kwargs:
        from lpbench.models.hf import hf_label

        kwargs["model"] = hf_label(kwargs["hf_checkpoint"])
    rec_text = None
    if settings.get("gpu"):
        from lpbench.bench.recommended import FLAG_FIELDS, lookup, run_defaults

        rec = lookup(
            settings.get("model", RunConfig().model),
            settings["gpu"],
            settings.get("num_gpus"),
            task=settings.get("workload", "pretrain"),
        )
        ran = {k: kwargs.get(k) for k in FLAG_FIELDS}
        for k, v in run_defaults(rec, kwargs).items():
            kwargs[k] = settings[k] = v
        settings.setdefault("num_gpus", rec.num_gpus)
        rec_text = rec.describe(settings["num_gpus"], kwargs.get("num_layers"), **ran)
    cfg = RunConfig(**kwargs)
    num_gpus = settings.get("num_gpus")
    if num_gpus is not None:
        if num_gpus <= 0:
            raise UsageError(f"num_gpus must be positive, got {num_gpus}")
        cfg = cfg.with_world(num_gpus, dp=kwargs.get("dp"))
    cfg.validate()  # no --load: a sweep has no checkpoint settings
    return SweepRun(
        index=0,
        config=cfg,
        settings=settings,
        workload=cfg.workload,
        backend=cfg.backend,
        num_gpus=cfg.world_size,
        recommended=rec_text,
    )

"""Hostile input, round two (issue 41): one test per class, each failing without its fix.

Classes 1 (checkpoints carry no code) and the sweep's per-attempt steps (class 7) are in
test_checkpoint.py and test_sweep.py; ``--backend torchao`` without torchao (class 5) in
test_torchao_backend.py. Every refusal here is one line on stderr, exit 2, no traceback, nothing
written, and, where a run would train, before training starts.
"""

import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lpbench.bench.store import SCHEMA_VERSION, ResultsStore, RunRecord
from lpbench.cli import main
from lpbench.train import loop
from tests.fuzz_cli import TINY

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(argv: list[str], capsys) -> str:
    """``lpbench argv`` exits 2 with one line on stderr and no traceback; returns the line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals exit from parse_args
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture
def no_training(monkeypatch):
    """Training fails the test: a refusal must come before it."""
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))


def _add(store, run_key="k1"):
    store.add_run(
        RunRecord(
            config={"model": "tiny", "precision": "bf16", "seq_len": 32, "mbs": 2, "gbs": 2},
            status="ok",
            error=None,
            metrics={"tokens_per_sec_per_gpu": 10.0, "final_loss": 1.0},
            steps=[{"step": 1, "loss": 2.0}],
            env={"gpu": None},
            run_key=run_key,
            group_id="g",
        )
    )


# ----------------------------------------------------------------------------- 2. pending-runs/ files
BAD_PENDING = {
    "empty-row.json": {"row": {}, "steps": []},
    "row-is-a-list.json": {"row": [1, 2], "steps": []},
    "steps-not-a-list.json": "GOOD_ROW_STEPS_5",
    "not-json.json": "{",
    "deep.json": "[" * 50_000 + "]" * 50_000,
}


def test_a_bad_pending_file_is_set_aside_and_never_loses_a_run(tmp_path, capsys):
    store = ResultsStore(tmp_path)
    _add(store, "before")
    good = {
        "schema": SCHEMA_VERSION,
        "row": dict(store.runs()[0], id=None, run_key="kept"),
        "steps": [{"step": 1, "loss": 2.0}],
    }
    store.close()
    folder = tmp_path / "pending-runs"
    folder.mkdir()
    for name, content in BAD_PENDING.items():
        if content == "GOOD_ROW_STEPS_5":
            content = {"row": good["row"], "steps": 5}
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    (folder / "zz-good.json").write_text(json.dumps(good))  # sorted after the bad ones: they must not block it
    assert main(["run", *TINY, "--results", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if "not a kept run" in line]
    assert len(warnings) == len(BAD_PENDING), err
    assert sorted(p.name for p in (folder / "rejected").iterdir()) == sorted(BAD_PENDING)
    assert not list(folder.glob("*.json"))  # the good one imported, the bad ones set aside
    keys = [r["run_key"] for r in ResultsStore(tmp_path).runs()]
    assert keys[:2] == ["before", "kept"] and len(keys) == 3  # and this run's own row
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_a_locked_database_is_said_and_waited_for_a_stated_time(tmp_path, monkeypatch, capsys):
    import lpbench.bench.store as store_module

    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.3)
    ResultsStore(tmp_path).close()
    other = sqlite3.connect(tmp_path / "results.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        assert main(["report", "--results", str(tmp_path), "--format", "json"]) in (0, 2)
    finally:
        other.execute("ROLLBACK")
    err = capsys.readouterr().err
    assert "is locked by another process; waiting for it (at most 0.3 s)" in err, err
    assert "Traceback" not in err and "not a readable" not in err


# ----------------------------------------------------------------------------- 3. output paths
@pytest.fixture
def places(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("a file")
    (tmp_path / "text.txt").write_text("some words to tokenize\n\nand more words\n" * 20)
    return {"tmp": tmp_path}


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["run", *TINY, "--results", "/proc/lpbench-results"],
            "--results /proc/lpbench-results: nothing can be written",
        ),
        (["run", *TINY, "--results", "/sys/lpbench-results"], "--results /sys/lpbench-results: nothing can be written"),
        (["run", *TINY, "--results", "{tmp}/loop"], "symlink that leads nowhere"),
        (["run", *TINY, "--results", "{tmp}/loop/results"], "symlink that leads nowhere"),
        (["run", *TINY, "--results", "{tmp}/dangling"], "symlink that leads nowhere"),
        (["run", *TINY, "--results", ""], "argument --results: an empty value"),
        (["run", *TINY, "--results", "{tmp}/r", "--tensorboard", "/proc/x"], "--tensorboard /proc/x: nothing can be"),
        (
            ["run", *TINY, "--results", "{tmp}/r", "--save-every", "1", "--save-dir", "/proc/ckpt"],
            "--save-dir /proc/ckpt",
        ),
        (
            ["data", "prepare", "--input", "{tmp}/text.txt", "--output-prefix", "/proc/data"],
            "--output-prefix /proc/data.bin: nothing can be written",
        ),
        (
            ["data", "corpus", "--out", "/proc/corpus", "--sources", "man", "--root", "man={tmp}"],
            "--out /proc/corpus: nothing can be written",
        ),
        (
            ["data", "corpus", "--out", "{tmp}/file", "--sources", "man", "--root", "man={tmp}"],
            "--out {tmp}/file: a file is there, not a folder",
        ),
        (["report", "--results", "{tmp}", "--html", "/sys/page.html"], "--html /sys/page.html: nothing can be written"),
    ],
)
def test_every_output_path_is_probed_before_work(argv, message, places, no_training, capsys):
    tmp = places["tmp"]
    if argv[0] == "report":
        ResultsStore(tmp).close()
    before = _tree(tmp)
    err = _refused([a.format(tmp=tmp) for a in argv], capsys)
    assert message.format(tmp=tmp) in err
    assert _tree(tmp) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_before_work(tmp_path, no_training, capsys):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    assert "--results" in _refused(["run", *TINY, "--results", str(folder / "r")], capsys)


# ----------------------------------------------------------------------------- 4. parsers
DEEP_YAML = "a: " + "[" * 50_000 + "]" * 50_000 + "\n"
DEEP_JSON = "[" * 50_000 + "]" * 50_000


@pytest.mark.parametrize(
    "kind,text,message",
    [
        ("config", DEEP_YAML, "nested deeper than"),
        ("config", "? [a, b]\n: 1\n", "a key is a list or a mapping"),
        ("config", "? {a: 1}\n: 1\n", "a key is a list or a mapping"),
        ("config-toml", "a = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than"),
        ("spec", "model: tiny\nx: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than"),
        ("spec", "model: tiny\n? [steps]\n: 3\n", "a key is a list or a mapping"),
        ("jsonl", '{"text": ' + DEEP_JSON + "}\n", "nested deeper than"),
        ("hf", DEEP_JSON, "nested deeper than"),
        ("hf-index", '{"weight_map": ' + DEEP_JSON + "}", "nested deeper than"),
    ],
)
def test_parsers_are_bounded(kind, text, message, tmp_path, no_training, capsys):
    if kind.startswith("config"):
        path = tmp_path / ("run.toml" if kind == "config-toml" else "run.yaml")
        argv = ["run", *TINY, "--config", str(path), "--results", str(tmp_path / "r")]
    elif kind == "spec":
        path = tmp_path / "spec.yaml"
        argv = ["sweep", str(path), "--results", str(tmp_path / "r")]
    elif kind == "jsonl":
        path = tmp_path / "data.jsonl"
        argv = ["data", "prepare", "--input", str(path), "--output-prefix", str(tmp_path / "out" / "data")]
    else:
        (tmp_path / "hf").mkdir()
        path = tmp_path / "hf" / ("config.json" if kind == "hf" else "model.safetensors.index.json")
        if kind == "hf-index":
            from lpbench.models.hf import hf_config_dict
            from lpbench.models.registry import get_model_config

            (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config_dict(get_model_config("tiny"))))
        argv = ["run", *TINY[2:], "--hf-checkpoint", str(tmp_path / "hf"), "--results", str(tmp_path / "r")]
    path.write_text(text)
    if kind == "hf-index":  # read with the weights, in training: checked on its own
        from lpbench.errors import UsageError
        from lpbench.models.hf import safetensors_files

        with pytest.raises(UsageError, match=message):
            safetensors_files(tmp_path / "hf")
        return
    before = _tree(tmp_path)
    assert message in _refused(argv, capsys)
    assert _tree(tmp_path) == before


def test_report_skips_a_row_of_the_wrong_types_with_a_warning(tmp_path, capsys):
    store = ResultsStore(tmp_path)
    for key in ("good", "bad-json", "bad-list", "bad-number", "deep"):
        _add(store, key)
    store.conn.execute("UPDATE runs SET metrics_json = '{not json' WHERE run_key = 'bad-json'")
    store.conn.execute("UPDATE runs SET config_json = '[1, 2]' WHERE run_key = 'bad-list'")
    store.conn.execute("UPDATE runs SET tokens_per_sec_per_gpu = 'fast' WHERE run_key = 'bad-number'")
    store.conn.execute("UPDATE runs SET env_json = ? WHERE run_key = 'deep'", (DEEP_JSON,))
    store.close()
    for fmt in ("md", "json"):
        assert main(["report", "--results", str(tmp_path), "--format", fmt]) == 0
        out = capsys.readouterr()
        assert "Traceback" not in out.err and len([ln for ln in out.err.splitlines() if "skipped" in ln]) == 4, out.err
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    assert [r["run_key"] for r in json.loads(capsys.readouterr().out)] == ["good"]


def test_a_corrupt_gz_man_page_is_skipped_in_one_line(tmp_path, capsys):
    import gzip

    man = tmp_path / "man" / "man1"
    man.mkdir(parents=True)
    page = ".TH X 1\n.SH NAME\nx \\- the tool that is used for the work of the day and the night\n.SH DESCRIPTION\n"
    (man / "good.1.gz").write_bytes(
        gzip.compress(
            (page + "It is a tool that does what it says it will do for the user and for the machine.\n" * 5).encode()
        )
    )
    (man / "bad.1.gz").write_bytes(gzip.compress(page.encode())[:20])  # truncated
    (man / "junk.1.gz").write_bytes(b"\x1f\x8b not gzip at all")
    out = tmp_path / "out"
    assert (
        main(
            [
                "data",
                "corpus",
                "--out",
                str(out),
                "--sources",
                "man",
                "--root",
                f"man={tmp_path / 'man'}",
                "--min-words",
                "5",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([ln for ln in err.splitlines() if "not readable" in ln]) == 2, err
    assert (out / "corpus.jsonl").read_text().count("\n") == 1


# ----------------------------------------------------------------------------- 5. wrong inputs
def _megatron(prefix: Path, ids, vocab: int | None = None) -> None:
    import numpy as np

    from lpbench.data.indexed import write_indexed_dataset

    write_indexed_dataset(prefix, [np.asarray(ids, dtype=np.int32)] * 40)
    if vocab is not None:
        (prefix.parent / f"{prefix.name}.lpbench.json").write_text(json.dumps({"vocab_size": vocab}))


@pytest.mark.parametrize(
    "case,message",
    [
        ("negative-length", "a negative sequence length or pointer"),
        ("vocab-1e9", "vocab_size must be an integer from 1 to"),
        ("vocab-below-ids", "the note does not belong to this data"),
    ],
)
def test_wrong_megatron_data_is_refused(case, message, tmp_path, capsys):
    prefix = tmp_path / "data"
    _megatron(prefix, list(range(1, 60)), vocab={"vocab-1e9": 10**9, "vocab-below-ids": 30}.get(case))
    if case == "negative-length":
        idx = bytearray((tmp_path / "data.idx").read_bytes())
        idx[34:38] = struct.pack("<i", -5)
        (tmp_path / "data.idx").write_bytes(bytes(idx))
    assert message in _refused(["run", *TINY, "--data", str(prefix), "--results", str(tmp_path / "r")], capsys)
    assert not (tmp_path / "r").exists()


def _hf_folder(tmp_path: Path, **config) -> Path:
    import torch

    from lpbench.models import build_model
    from lpbench.models.hf import export_hf_checkpoint
    from lpbench.models.registry import get_model_config

    folder = tmp_path / "hf"
    export_hf_checkpoint(build_model(get_model_config("tiny"), device="cpu").to(torch.float32), folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, **config}))
    return folder


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_hf_weights_that_are_not_floats_are_refused(dtype, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    folder = _hf_folder(tmp_path)
    [weights] = folder.glob("*.safetensors")
    tensors = load_file(weights)
    key = "model.embed_tokens.weight"
    tensors[key] = tensors[key].to(getattr(torch, dtype))
    save_file(tensors, weights)
    err = _refused(["run", *TINY[2:], "--hf-checkpoint", str(folder), "--results", str(tmp_path / "r")], capsys)
    assert f"tensor {key} holds {dtype}, not floating-point weights" in err


@pytest.mark.parametrize(
    "config,message",
    [
        ({"hidden_size": 10**9}, "hidden_size must be an integer from 1 to"),
        ({"num_hidden_layers": 10**7}, "num_hidden_layers must be an integer from 1 to 1,024"),
        (
            {
                "hidden_size": 1 << 17,
                "intermediate_size": 1 << 17,
                "num_hidden_layers": 1024,
                "num_attention_heads": 1024,
                "num_key_value_heads": 1024,
                "head_dim": 128,
            },
            "parameters, more than lpbench builds",
        ),
    ],
)
def test_an_hf_config_with_absurd_dims_is_refused(config, message, tmp_path, no_training, capsys):
    folder = _hf_folder(tmp_path, **config)
    assert message in _refused(
        ["run", *TINY[2:], "--hf-checkpoint", str(folder), "--results", str(tmp_path / "r")], capsys
    )


def test_a_sweep_timeout_of_true_is_refused(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text("model: tiny\ndevice: cpu\nsteps: 2\ntimeout: true\n")
    assert "spec key timeout: expected seconds > 0, got True" in _refused(
        ["sweep", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r")], capsys
    )


# ----------------------------------------------------------------------------- 6. process edges
@pytest.mark.parametrize(
    "env,name",
    [
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc'"),
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "abc"}, "SLURM_STEP_NUM_TASKS='abc'"),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "not a rank of the launch"),
    ],
)
def test_launch_variables_that_are_not_numbers_are_one_line(env, name, monkeypatch, tmp_path, no_training, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert name in _refused(["run", *TINY, "--results", str(tmp_path / "r")], capsys)


def test_a_stale_rank_does_not_silence_errors(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")  # left in the shell, no launch
    assert "unknown model 'nope'" in _refused(["run", "--model", "nope"], capsys)


def _lpbench(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "lpbench", *args], capture_output=True, env=env, timeout=120, check=False, **kw
    )


@pytest.mark.parametrize("how", ["broken-pipe", "dev-full", "closed"])
def test_a_stdout_that_cannot_be_written_is_one_line(how, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "lpbench", "models", "--json"]
    if how == "broken-pipe":
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc.stdout.close()  # the reader is gone before the first write (`| head -0`)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
        assert code == 141 and "broken pipe" in err
    elif how == "dev-full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, env=env, timeout=120, check=False)
        err, code = done.stderr.decode(), done.returncode
        assert code == 1 and "No space left on device" in err
    else:
        done = subprocess.run(
            f"{sys.executable} -m lpbench models --json >&-",
            shell=True,
            stderr=subprocess.PIPE,
            env=env,
            timeout=120,
            check=False,
        )
        err, code = done.stderr.decode(), done.returncode
        assert code == 0 and "stdout is closed" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_narrow_output_encoding_with_a_non_ascii_path_does_not_fail(tmp_path):
    """``PYTHONIOENCODING=ascii`` and a path with an accent: the path is printed escaped, the command works."""
    script = tmp_path / "résultats.sbatch"
    done = _lpbench(
        ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", str(script), "--", "--model", "tiny"],
        env={"PYTHONIOENCODING": "ascii"},
    )
    assert done.returncode == 0 and done.stderr == b"", done.stderr.decode(errors="replace")
    assert b"r\\xe9sultats.sbatch" in done.stdout and script.exists()


def test_a_vocab_size_beyond_64_bits_is_one_line(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("words and more words\n" * 10)
    assert "--vocab-size must be <=" in _refused(
        [
            "data",
            "tokenizer",
            "--input",
            str(tmp_path / "t.txt"),
            "--vocab-size",
            str(2**64),
            "--output",
            str(tmp_path / "t.json"),
        ],
        capsys,
    )
    assert not (tmp_path / "t.json").exists()


def test_quant_error_with_an_unallocatable_shape_is_one_line(capsys):
    assert "--shape 100000000 100000000: more than" in _refused(
        ["quant-error", "--shape", "100000000", "100000000"], capsys
    )


# ----------------------------------------------------------------------------- 7. outputs never overwrite results
@pytest.mark.parametrize(
    "argv",
    [
        ["report", "--results", "{db}", "--html", "{db}/results.db"],
        ["converge", "--model", "tiny", "--results", "{tmp}/c", "--plot", "{db}/results.db"],
        ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", "{db}/results.db", "--", "--model", "tiny"],
        ["data", "tokenizer", "--input", "{tmp}/t.txt", "--vocab-size", "300", "--output", "{db}/results.db"],
        ["report", "--results", "{db}", "--html", "{ckpt}/lpbench.json"],
        ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", "{ckpt}/__0_0.distcp", "--", "--model", "tiny"],
    ],
)
def test_no_output_overwrites_a_results_database_or_a_checkpoint(argv, tmp_path, no_training, capsys):
    store = ResultsStore(tmp_path / "db")
    _add(store)
    store.close()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "lpbench.json").write_text("{}")
    (tmp_path / "ckpt" / "__0_0.distcp").write_bytes(b"tensors")
    (tmp_path / "t.txt").write_text("words and more words\n" * 10)

    def files():  # the database by its rows (opening it may fold its WAL in), the other files by their bytes
        return (
            {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "results.db" not in p.name},
            [r["run_key"] for r in ResultsStore(tmp_path / "db", create=False).runs()],
        )

    before = files()
    err = _refused([a.format(tmp=tmp_path, db=tmp_path / "db", ckpt=tmp_path / "ckpt") for a in argv], capsys)
    assert "lpbench does not overwrite results" in err
    assert files() == before and before[1] == ["k1"]


def _read_only_connect(monkeypatch):
    import lpbench.bench.store as store_module

    real = sqlite3.connect

    def read_only(target, *args, **kw):  # as a read-only results.db answers, whoever the user is
        if kw.get("uri"):
            return real(target, *args, **kw)
        return real(f"file:{target}?mode=ro", *args, uri=True, **kw)

    monkeypatch.setattr(store_module.sqlite3, "connect", read_only)


@pytest.mark.parametrize("fault", ["locked", "read-only", "long-path"])
def test_a_trained_run_the_database_cannot_take_goes_to_pending_runs(fault, tmp_path, monkeypatch, capsys):
    """The database's problem is found (and said) before training; the run trains and is kept aside."""
    import lpbench.bench.store as store_module

    results = tmp_path / "results"
    if fault == "long-path":
        results = tmp_path.joinpath(*["d" * 100] * 6)
    results.mkdir(parents=True)
    if fault != "long-path":
        _add(ResultsStore(results))
    other = None
    if fault == "locked":
        monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.2)
        other = sqlite3.connect(results / "results.db", isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
    elif fault == "read-only":
        _read_only_connect(monkeypatch)
    said_before_training = []
    real_train = loop.train

    def train(*args, **kw):
        said_before_training.append(capsys.readouterr().err)
        return real_train(*args, **kw)

    monkeypatch.setattr(loop, "train", train)
    try:
        code = main(["run", *TINY, "--results", str(results)])
    finally:
        if other is not None:
            other.execute("ROLLBACK")
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "runs will be kept in" in said_before_training[0], said_before_training
    [kept] = (results / "pending-runs").glob("*.json")
    assert json.loads(kept.read_text())["row"]["status"] == "ok"


# ----------------------------------------------------------------------------- 8. flags that need another flag
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fsdp-shard", "zero1"], "--fsdp-shard zero1 needs FSDP2 (--fsdp, or --cp > 1)"),
        (["--recompute-every", "2"], "--recompute-every 2 needs --recompute selective or full"),
    ],
)
def test_a_flag_without_the_layout_it_tunes_is_refused(flags, message, tmp_path, no_training, capsys):
    """A tuning flag is refused, not silently ignored, where the feature it tunes is off."""
    assert message in _refused(["run", *TINY, "--results", str(tmp_path / "r"), *flags], capsys)
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("what", ["hf-export", "hf-checkpoint-itself", "safetensors-only"])
def test_export_hf_never_overwrites_a_checkpoint(what, tmp_path, no_training, capsys):
    """--export-hf into a folder holding a Hugging Face checkpoint (an earlier export, the run's own
    --hf-checkpoint) is refused before work: its files would be overwritten or mixed with stale shards."""
    folder = _hf_folder(tmp_path)
    if what == "safetensors-only":
        (folder / "config.json").unlink()
    extra = ["--hf-checkpoint", str(folder)] if what == "hf-checkpoint-itself" else []
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = ["run", *TINY, "--results", str(tmp_path / "r"), "--export-hf", str(folder), *extra]
    if what == "hf-checkpoint-itself":
        argv.remove("--model"), argv.remove("tiny")
    assert "a Hugging Face checkpoint is there; lpbench does not overwrite results" in _refused(argv, capsys)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

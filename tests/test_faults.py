"""What lpbench promises under hostile input and faults (README, "Faults"): paths, signals, launches, text.

Checkpoint faults are in test_checkpoint.py, store faults in test_store.py, spec faults in
test_sweep.py.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpbench.cli import main
from tests.fuzz_cli import TINY


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", *TINY, "--results", "{file}"], "--results {file}: a file is there, not a folder"),
        (["run", *TINY, "--results", "{file}/results"], "--results {file}/results: cannot create it ({file} is a file"),
        (
            ["run", *TINY, "--results", "{out}", "--save-every", "1", "--save-dir", "{file}/ckpt"],
            "--save-dir {file}/ckpt",
        ),
        (["sweep", "{spec}", "--results", "{file}"], "--results {file}: a file is there"),
        (["converge", "--model", "tiny", "--results", "{file}"], "--results {file}: a file is there"),
        (
            ["converge", "--model", "tiny", "--results", "{out}", "--plot", "{dir}"],
            "--plot {dir}: a folder, not a file",
        ),
        (["report", "--results", "{db}", "--html", "{dir}"], "--html {dir}: a folder, not a file"),
        (["report", "--results", "{db}", "--plots", "{file}"], "--plots {file}: a file is there, not a folder"),
        (
            ["report", "--results", "{db}", "--html", "{file}/page.html"],
            "--html {file}/page.html: cannot create it ({file} is a file",
        ),
        (
            ["data", "prepare", "--input", "{text}", "--output-prefix", "{file}/data"],
            "--output-prefix {file}/data.bin: cannot create it",
        ),
        (
            ["data", "prepare", "--input", "{text}", "--output-prefix", "{dir}/x"],
            "--output-prefix {dir}/x.bin: a folder",
        ),
        (
            ["data", "tokenizer", "--input", "{text}", "--vocab-size", "300", "--output", "{dir}"],
            "--output {dir}: a folder, not a file",
        ),
        (
            ["slurm", "--nodes", "1", "--gpus-per-node", "1", "--output", "{dir}", "--", "--model", "tiny"],
            "--output {dir}: a folder, not a file",
        ),
    ],
)
def test_every_output_path_is_checked_before_work_and_nothing_is_created(argv, message, tmp_path, capsys):
    from lpbench.bench.store import ResultsStore

    (tmp_path / "file").write_text("a file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.bin").mkdir()
    (tmp_path / "text.txt").write_text("some words to tokenize\n\nand more words\n" * 20)
    (tmp_path / "spec.yaml").write_text("name: s\nmodel: tiny\nprecision: bf16\nsteps: 2\nwarmup_steps: 1\n")
    ResultsStore(tmp_path / "db").close()
    names = dict(
        file=tmp_path / "file",
        dir=tmp_path / "dir",
        text=tmp_path / "text.txt",
        db=tmp_path / "db",
        spec=tmp_path / "spec.yaml",
        out=tmp_path / "out",
    )
    before = _tree(tmp_path)
    err = _one_line_exit_2([a.format(**names) for a in argv], capsys)
    assert message.format(**names) in err
    assert _tree(tmp_path) == before  # no database, no folder, no temporary file


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_run_rejected_on_the_way_creates_no_database(tmp_path, capsys):
    err = _one_line_exit_2(["run", *TINY[:-8], "--device", "cuda", "--results", str(tmp_path / "results")], capsys)
    assert "no CUDA device" in err and not (tmp_path / "results").exists()


def test_sigterm_of_run_says_what_happened(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lpbench",
            "run",
            *TINY[:-4],
            "--steps",
            "100000",
            "--warmup-steps",
            "1",
            "--results",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # wait until training runs
        if line.startswith("iteration"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "lpbench: terminated (SIGTERM)", err
    assert "Traceback" not in err


def test_a_launched_run_fails_with_lpbench_s_line_not_torchrun_s_traceback(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpbench",
            "run",
            *TINY,
            "--gbs",
            "4",
            "--nproc-per-node",
            "2",
            "--data",
            str(tmp_path / "missing.jsonl"),
            "--results",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(("*****", "Setting OMP"))]
    assert out.returncode == 2 and len(lines) == 1 and "--data" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "results").exists()


def _two_ranks_with_a_fault_on_rank_1(tmp_path, fault: str) -> tuple[int, str]:
    """(exit code, output with its whitespace runs made single spaces: rich wraps long lines) of a 2-process
    ``lpbench run`` of bf16 then fp8-tensorwise, rank 1 given the test-only ``fault`` (``LPBENCH_FAULT``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "faults"), str(Path(__file__).parents[1])]),
        "LPBENCH_FAULT": f"env.RANK=1:{fault}",
    }
    argv = [*TINY, "--gbs", "4", "--nproc-per-node", "2", "--precision", "bf16,fp8-tensorwise"]
    out = subprocess.run(
        [sys.executable, "-m", "lpbench", "run", *argv, "--results", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    return out.returncode, " ".join((out.stdout + out.stderr).split())


def test_a_run_failing_on_one_rank_ends_the_job_instead_of_waiting_for_it(tmp_path):
    """Rank 1 raises in its first step (the test-only fault hook) while rank 0 waits for it in DDP's gradient
    all-reduce: the job ends, with the error, instead of hanging; rank 0's row of the failed run stays untouched."""
    code, text = _two_ranks_with_a_fault_on_rank_1(tmp_path, "error@1")
    assert code != 0, text
    assert "bf16 failed: RuntimeError: LPBENCH_FAULT: injected error at step 1" in text
    assert "rank 1 failed (RuntimeError: LPBENCH_FAULT: injected error at step 1): ending the job" in text
    assert "run 2/2" not in text


def test_an_out_of_memory_on_one_rank_ends_the_job_with_its_cause(tmp_path):
    """Rank 1 runs out of memory in its first step while rank 0 waits for it in DDP's all-reduce: rank 1 makes no
    further collective (one would meet rank 0's all-reduce: a mismatch that broke the job with a reset connection,
    or under NCCL a hang), says why and ends the job; the later run does not start. Rank 0, if it reports before
    the launcher stops it, says another rank ended the job, not gloo's reset connection."""
    code, text = _two_ranks_with_a_fault_on_rank_1(tmp_path, "oom@1")
    assert code == 1, text
    assert "rank 1 ran out of memory (CUDA out of memory. Tried to allocate 1.00 GiB" in text
    assert "ending the job" in text and "run 2/2" not in text
    assert "mismatch" not in text and "Connection reset" not in text


# ----------------------------------------------------------------------------- numeric input (flags and specs alike)
@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", *TINY, "--lr", "nan"], "--lr must be a finite number"),
        (["run", *TINY, "--lr", "inf"], "--lr must be a finite number"),
        (["run", *TINY, "--seed", str(2**70)], "--seed 1180591620717411303424 is out of range"),
        (["run", *TINY, "--seed", "-1"], "--seed must be >= 0"),
        (["run", *TINY, "--steps", str(2**40)], "--steps 1099511627776 is out of range"),
        (["run", *TINY, "--workload", "lora", "--lora-rank", "100000"], "--lora-rank 100000 exceeds tiny's width"),
        (["run", *TINY, "--workload", "lora", "--lora-alpha", "nan"], "--lora-alpha must be a finite number"),
        (["sweep", "{spec}", "--timeout", "nan", "--dry-run"], "--timeout must be a positive number"),
        (
            ["converge", "--model", "tiny", "--tokens", "nan", "--results", "{out}"],
            "--tokens must be a positive number",
        ),
        (["flops", "--model", "tiny", "--seq-len", "32", "--tokens", "nan"], "--tokens must be positive"),
    ],
)
def test_numeric_flags_are_validated_up_front(argv, message, tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text("name: s\nmodel: tiny\nprecision: bf16\n")
    err = _one_line_exit_2([a.format(spec=tmp_path / "spec.yaml", out=tmp_path / "out") for a in argv], capsys)
    assert message in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "line,message",
    [
        ("lr: .nan", "--lr must be a finite number"),
        ("lr: [0.001, .inf]", "--lr must be a finite number"),
        ("seed: 1.0e+30", "--seed 1000000000000000019884624838656 is out of range"),
        ("mbs: 4294967296", "--mbs 4294967296 is out of range"),
        ("timeout: .inf", "spec key timeout: expected seconds > 0"),
    ],
)
def test_numeric_spec_values_are_validated_up_front(line, message, tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: s\nmodel: tiny\nprecision: bf16\ndevice: cpu\n{line}\n")
    assert message in _one_line_exit_2(["sweep", str(spec), "--results", str(tmp_path / "r"), "--dry-run"], capsys)


@pytest.mark.parametrize(
    "ids,dtype,message",
    [
        ([[5, -3, 7]], "int32", "negative token id -3"),
        ([[1.5, 2.0, 3.0]], "float32", "token ids stored as float32"),
    ],
)
def test_megatron_data_with_bad_token_ids_is_refused(ids, dtype, message, tmp_path, capsys):
    import numpy as np

    from lpbench.data.indexed import write_indexed_dataset

    write_indexed_dataset(tmp_path / "data", [np.asarray(d * 200, dtype=dtype) for d in ids], dtype=getattr(np, dtype))
    err = _one_line_exit_2(["run", *TINY, "--data", str(tmp_path / "data"), "--results", str(tmp_path / "r")], capsys)
    assert message in err


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be an integer, got '2'"),
        ({"hidden_size": None}, "hidden_size is missing"),
        ({"rope_theta": "big"}, "rope_theta must be a finite number"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of strings"),
        ({"head_dim": 12.5}, "head_dim must be an integer"),
        ({"max_position_embeddings": [4096]}, "max_position_embeddings must be an integer"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": None,
                    "low_freq_factor": 1,
                    "high_freq_factor": 4,
                    "original_max_position_embeddings": 8192,
                }
            },
            "factor is missing",
        ),
    ],
)
def test_hf_config_fields_of_the_wrong_type_are_refused(change, message, tmp_path, capsys):
    import json

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **change}))
    err = _one_line_exit_2(
        ["run", *TINY[2:], "--hf-checkpoint", str(tmp_path), "--results", str(tmp_path / "r")], capsys
    )
    assert message in err


def test_hf_config_nulls_mean_the_defaults():
    from lpbench.models.hf import config_from_hf

    cfg = config_from_hf({**LLAMA, "num_key_value_heads": None, "rope_scaling": None, "rope_theta": None})
    assert cfg.n_kv_heads == 4 and cfg.rope_theta == 10_000.0 and cfg.rope_scaling is None


# ----------------------------------------------------------------------------- sweep specs
@pytest.mark.parametrize(
    "text,message",
    [
        ("model: tiny\nmodels: [small]\n", "spec sets model twice (as 'model' and 'models')"),
        ("model: tiny\nprecision: bf16\nprecision: fp8-tensorwise\n", "key 'precision' given twice"),
        ("model: tiny\nbatch:\n  - {seq: 32, seq_len: 64}\n", "spec sets seq_len twice (as 'seq' and 'seq_len')"),
    ],
)
def test_a_setting_given_twice_is_an_error(text, message, tmp_path, capsys):
    (tmp_path / "s.yaml").write_text(text)
    assert message in _one_line_exit_2(["sweep", str(tmp_path / "s.yaml"), "--dry-run"], capsys)


def test_a_spec_that_is_not_utf8_is_one_line(tmp_path, capsys):
    (tmp_path / "s.yaml").write_bytes(b"model: tiny\nname: caf\xe9\n")
    assert "is not UTF-8 text" in _one_line_exit_2(["sweep", str(tmp_path / "s.yaml"), "--dry-run"], capsys)


@pytest.mark.parametrize("name", ["..", "../../outside", "/etc/x", ".hidden", "-"])
def test_sweep_ids_stay_inside_the_sweeps_folder(name, tmp_path):
    from lpbench.bench.sweep import expand

    sweep_id = expand({"name": name, "model": "tiny", "precision": "bf16", "device": "cpu"}).name
    log_dir = (tmp_path / "sweeps" / sweep_id).resolve()
    assert log_dir.parent == (tmp_path / "sweeps").resolve() and not sweep_id.startswith(".")


# ----------------------------------------------------------------------------- text escaped for where it goes
ODD = "hf:/data/[/x] [bold]$x^$ a|b*c_d"


def _row(**kw):
    return {
        "id": 1,
        "run_key": "k",
        "group_id": "g",
        "sweep_id": None,
        "status": "ok",
        "error": None,
        "workload": "pretrain",
        "backend": "lpbench",
        "num_gpus": 1,
        "gpu": None,
        "model": ODD,
        "precision": "bf16",
        "seq_len": 32,
        "mbs": 2,
        "gbs": 2,
        "path": "native",
        "step_time_s": 0.5,
        "tokens_per_sec_per_gpu": 128.0,
        "tflops_per_gpu": 0.1,
        "final_loss": 2.0,
        "config": {"model": ODD, "seq_len": 32},
        "env": {},
        "metrics": {"path": "native"},
        **kw,
    }


def test_console_tables_show_brackets_literally():
    from rich.console import Console

    from lpbench.report.tables import summary_rows, to_rich

    console = Console(record=True, width=400)
    console.print(to_rich(summary_rows([_row(status="error", error="[/red] boom [Errno 28]")]), title=f"t {ODD}"))
    text = console.export_text()
    assert ODD in text and "[/red] boom [Errno 28]" in text


def test_markdown_cells_and_plot_labels_take_any_text():
    from lpbench.report.plots import all_plots
    from lpbench.report.tables import summary_rows, to_markdown

    rows = summary_rows([_row(), _row(id=2, precision="fp8-tensorwise", seq_len=64)])
    line = to_markdown(rows).splitlines()[2]
    assert line.count(" | ") == to_markdown(rows).splitlines()[0].count(" | ")  # no cell split by the '|'
    assert "[/x] [bold]$x^$ a\\|b\\*c\\_d" in line
    plots = all_plots(rows, {1: [{"step": 1, "loss": 2.0}], 2: [{"step": 1, "loss": 2.1}]})  # unbalanced '$'
    assert plots and all(png.startswith(b"\x89PNG") for png in plots.values())


def test_a_bracket_in_paths_and_errors_does_not_crash_a_resumed_sweep(tmp_path, capsys):
    from lpbench.bench.store import ResultsStore, RunRecord
    from lpbench.bench.sweep import expand, run_sweep

    results = tmp_path / "res[/x]"
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nmodel: tiny\nprecision: [bf16, fp8-tensorwise]\ndevice: cpu\nsteps: 2\nwarmup_steps: 1\n")
    store = ResultsStore(results)
    for run, status in zip(
        expand(
            {
                "name": "s",
                "model": "tiny",
                "precision": ["bf16", "fp8-tensorwise"],
                "device": "cpu",
                "steps": 2,
                "warmup_steps": 1,
            }
        ).runs,
        ("ok", "error"),
    ):
        store.add_run(
            RunRecord(
                config=run.config.to_dict(),
                status=status,
                error="[/red] boom" if status == "error" else None,
                metrics={},
                steps=[],
                env={"gpu": "[/gpu]"},
                run_key=run.key,
                group_id="s",
                sweep_id="s",
            )
        )
    from rich.console import Console

    wide = Console(width=400)
    assert run_sweep(str(spec), results=str(results), console=wide) == 1  # all done: resumes, prints, runs nothing
    out = capsys.readouterr().out
    assert "measured on [/gpu]" in out and "[/red] boom" in out and f"logs: {results}" in out


@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--job-name", "my job", "--partition", "gpu", "--account", "team a"],
            [
                '#SBATCH --job-name="my job"',
                "#SBATCH --partition=gpu",
                '#SBATCH --account="team a"',
                '#SBATCH --output="my job-%j.log"',
            ],
        ),
        (["--job-name", "x\n#SBATCH --wrap=evil"], "holds a newline"),
        (["--account", 'a"b'], "--account"),
        (["--time", "1:00:00; rm -rf ~"], "not a Slurm time"),
        (["--time", "2-12:00:00"], ["#SBATCH --time=2-12:00:00"]),
    ],
)
def test_slurm_script_values_are_quoted_or_refused(flags, expected, tmp_path, capsys):
    argv = [
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--output",
        str(tmp_path / "job.sbatch"),
        *flags,
        "--",
        "--model",
        "tiny",
    ]
    if isinstance(expected, str):
        assert expected in _one_line_exit_2(argv, capsys) and not (tmp_path / "job.sbatch").exists()
        return
    assert main(argv) == 0
    lines = (tmp_path / "job.sbatch").read_text().splitlines()
    assert all(e in lines for e in expected), lines

"""The run summary table: fits 80/120/200 columns without cutting a precision, model or number; on a CPU it
leads with Δ loss (mean of the last steps) and says speed does not predict a GPU's."""

import io
import json
import re

import pytest
from rich.console import Console

from lpbench.bench.store import ResultsStore, RunRecord
from lpbench.cli import main
from lpbench.report.tables import quantizes, summary_rows, to_rich
from lpbench.train.loop import tail_loss

PRECISIONS = ["bf16", "fp8-tensorwise", "fp8-rowwise-fast-grads", "fp8-blockwise", "mxfp8", "nvfp4"]


def _runs(tmp_path, gpu=None, model="llama3.2-1b"):
    store = ResultsStore(tmp_path)
    for i, p in enumerate(PRECISIONS):
        losses = [8.0 - 0.01 * s + 0.001 * i + (0.02 if s % 2 else 0) for s in range(1, 13)]
        metrics = {
            "path": "native" if p == "bf16" else "emulated",
            "step_time_s": 0.0661 * (i + 1),
            "step_time_p25_s": 0.0650 * (i + 1),
            "step_time_p75_s": 0.0670 * (i + 1),
            "tokens_per_sec_per_gpu": 1937.25 / (i + 1),
            "tflops_per_gpu": 0.0217 / (i + 1),
            "peak_mem_allocated_gb": 0.39 + i / 100,
            "final_loss": losses[-1],
            **tail_loss([{"loss": v} for v in losses]),
        }
        store.add_run(
            RunRecord(
                config={"model": model, "precision": p, "seq_len": 32, "mbs": 2, "gbs": 4, "steps": 12},
                status="ok",
                error=None,
                metrics=metrics,
                steps=[{"step": s + 1, "loss": v} for s, v in enumerate(losses)],
                env={"gpu": gpu},
                run_key=p,
                group_id="g",
                workload="pretrain",
                num_gpus=1,
            )
        )
    return summary_rows(store.runs())


def _render(rows, width, **kw):
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(to_rich(rows, title="lpbench run g", width=width, **kw))
    return console.export_text()


def _column(text, word):
    """Where ``word`` starts in its line: the left-to-right order of multi-line headers."""
    return min(line.find(word) for line in text.splitlines() if word in line)


def _words(text):
    return set(re.split(r"[\s│┃]+", text))


@pytest.mark.parametrize("width", [80, 120, 200])
def test_table_fits_and_cuts_nothing(tmp_path, width):
    rows = _runs(tmp_path)
    text = _render(rows, width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    words = _words(text)
    assert set(PRECISIONS) <= words  # every precision whole, on one line
    assert "llama3.2-1b" in text  # the shared model, in the title
    deltas = [f"{r['loss_delta']:+.4f}" for r in rows if r["precision"] != "bf16"]
    assert set(deltas) <= words  # the headline column survives every width
    if width >= 120:
        assert {f"{r['tail_loss']:.4f}" for r in rows} <= words
    hidden = re.search(r"not shown at \d+ columns: (.*?)--wide", text.replace("\n", " "))
    for number in (f"{r['tokens_per_sec_per_gpu']:,.0f}" for r in rows):  # shown whole, or its column named
        assert number in words or (hidden and "tokens/s/GPU" in hidden.group(1))


def test_wide_shows_every_column(tmp_path):
    rows = _runs(tmp_path)
    text = _render(rows, 400, wide=True)
    words = _words(text)
    for r in rows:
        assert {f"{r['tokens_per_sec_per_gpu']:,.0f}", f"{r['step_time_ms']:.1f}", r["model"]} <= words


def test_cpu_table_leads_with_loss_and_says_speed_is_not_predictive(tmp_path):
    rows = _runs(tmp_path)
    text = _render(rows, 200)
    header = text[: text.index("bf16 ")]
    assert _column(text, "Δ loss") < _column(text, "speed vs") and "predictive" in header
    assert "E2M1" in text and "nothing (BF16 GEMMs)" in text  # what each recipe quantizes
    assert "emulated" in _words(text)
    gpu_text = _render(_runs(tmp_path / "gpu", gpu="NVIDIA H100 80GB HBM3"), 200)
    assert _column(gpu_text, "speed vs") < _column(gpu_text, "Δ loss")  # on a GPU speed leads


def test_loss_delta_is_the_mean_of_the_last_steps(tmp_path):
    rows = {r["precision"]: r for r in _runs(tmp_path)}
    fp8 = rows["fp8-tensorwise"]
    # the last three of twelve losses, alternating: the mean differs from the last step's loss
    assert fp8["tail_loss"] == pytest.approx((7.901 + 7.911 + 7.881) / 3)  # steps 10, 11, 12
    assert fp8["final_loss"] == pytest.approx(7.881)
    assert fp8["loss_delta"] == pytest.approx(fp8["tail_loss"] - rows["bf16"]["tail_loss"])
    assert fp8["loss_delta"] == pytest.approx(0.001)
    assert fp8["loss_delta_se"] > 0


def test_tail_loss():
    assert tail_loss([{"loss": v} for v in (9, 8, 7, 6, 5, 4, 3, 2)]) == pytest.approx(
        {"tail_loss": 2.5, "tail_loss_sem": 0.5, "tail_steps": 2}
    )
    assert tail_loss([{"loss": 3.0}]) == {"tail_loss": 3.0, "tail_loss_sem": 0.0, "tail_steps": 1}
    assert tail_loss([{"loss": 3.0}, {"loss": float("nan")}]) == {}


def test_quantizes():
    assert quantizes("fp8-tensorwise") == "E4M3, grads E5M2, per-tensor"
    assert quantizes("fp32") == "nothing (FP32 GEMMs)"
    assert "RHT wgrad" in quantizes("nvfp4") and "4 blocks BF16" in quantizes("nvfp4")


def test_run_json_file(tmp_path, capsys):
    out = tmp_path / "summary.json"
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
                "4",
                "--steps",
                "4",
                "--warmup-steps",
                "1",
                "--precision",
                "bf16,fp32",
                "--results",
                str(tmp_path),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["precision"] for r in rows] == ["bf16", "fp32"]
    assert all(r["status"] == "ok" and r["tokens_per_sec_per_gpu"] > 0 and r["tail_loss"] > 0 for r in rows)
    assert rows[1]["loss_delta"] == pytest.approx(rows[1]["tail_loss"] - rows[0]["tail_loss"])


def test_short_step_line_fits_100_columns():
    from lpbench.train.loop import format_log_lines

    rec = {
        "step": 12345,
        "loss": 10.1234,
        "step_time_s": 123.456,
        "tflops_per_gpu": 1917.3456,
        "tokens_per_sec_per_gpu": 1234567.8,
        "lr": 0.000123456,
        "grad_norm": 1234.5678,
        "peak_mem_gb": 79.5,
    }
    (line,) = format_log_lines(rec, 100000, 4096, short=True)
    assert len(line) <= 100, line
    assert "step 12345/100000" in line and "loss 10.1234" in line and "1,234,568 tok/s/GPU" in line
    full = format_log_lines(rec, 100000, 4096)  # the parsers' formats, unchanged off a terminal
    assert full[1].startswith("iteration 12345/100000 | global_batch_size: 4096") and len(full) == 2


def test_the_sweep_table_fits_the_console_it_is_printed_on(tmp_path, monkeypatch):
    """A sweep run in-process (as the benchmark scripts run it) prints its table fitted to the console it is
    given, not to the width of another console: every precision whole at 80 columns."""
    from lpbench.bench import sweep as sw
    from lpbench.bench.store import ResultsStore

    spec = tmp_path / "s.yaml"
    spec.write_text(
        json.dumps(
            {
                "name": "s",
                "model": "tiny",
                "device": "cpu",
                "steps": 2,
                "warmup_steps": 1,
                "seq_len": 32,
                "mbs": 2,
                "gbs": 2,
                "precision": ["bf16", "fp8-tensorwise"],
            }
        )
    )
    monkeypatch.setattr(ResultsStore, "finished_keys", lambda self, sweep_id: set())
    console = Console(file=io.StringIO(), width=80)
    assert sw.run_sweep(str(spec), results=str(tmp_path / "r"), console=console) == 0
    out = console.file.getvalue()
    table = out[out.index("┏") : out.index("┘")]
    assert "…" not in table and "fp8-tensorwise" in table
    assert max(len(line) for line in table.splitlines()) <= 80


@pytest.mark.parametrize(
    "config,layout",
    [
        (
            {
                "pp": 2,
                "vp": 2,
                "pp_schedule": "zbv",
                "pp_split": "balanced",
                "recompute": "selective",
                "recompute_every": 2,
            },
            "PP2 VP2 zbv recompute selective/2",
        ),
        (
            {"pp": 2, "vp": 2, "pp_schedule": "interleaved-1f1b", "pp_split": "balanced", "recompute": "none"},
            "PP2 VP2 ·",
        ),
        ({"pp": 2, "pp_split": "even"}, "PP2 split even"),
        ({"pp": 2, "pp_split": "balanced"}, "PP2 ·"),
        ({"cp": 2, "dp": 4, "dp_replicate": 2, "fsdp_shard": "zero1"}, "CP2 DP4 HSDP2 zero1 FSDP"),
        ({"ep": 2, "ep_chunks": 2}, "EP2 EP-chunks 2 ·"),
    ],
)
def test_the_title_names_the_layout_that_ran(config, layout, tmp_path):
    """The run table's layout names the pipeline schedule and split (when not the default), recomputation, HSDP, the
    FSDP shard mode and EP chunks: runs differing only by those are told apart."""
    store = ResultsStore(tmp_path)
    store.add_run(
        RunRecord(
            config={"model": "tiny", "precision": "bf16", "seq_len": 32, "mbs": 2, "gbs": 4, "steps": 2, **config},
            status="ok",
            error=None,
            metrics={"step_time_s": 0.1, "tokens_per_sec_per_gpu": 100.0, "final_loss": 7.0},
            steps=[{"step": 1, "loss": 7.0}, {"step": 2, "loss": 7.0}],
            env={"gpu": None},
            run_key="k",
            group_id="g",
            workload="pretrain",
            num_gpus=4,
        )
    )
    text = " ".join(_render(summary_rows(store.runs()), 200).split())
    assert f"layout {layout}" in text, text

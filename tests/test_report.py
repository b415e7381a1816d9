"""lpbench report: NeMo-style tables, speedup/loss delta vs BF16, time to train, plots, HTML page."""

import base64
import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from lpbench.bench.store import ResultsStore, RunRecord
from lpbench.cli import main
from lpbench.report import plots
from lpbench.report.build import report_markdown, select_runs
from lpbench.report.html import render_page
from lpbench.report.tables import (
    NOT_GPU_SPEED,
    summary_rows,
    time_to_train_tables,
    to_markdown,
    to_rich,
    workload_tables,
)

CHROMIUM = "/usr/bin/chromium"


def _run(
    store,
    precision,
    tps,
    *,
    status="ok",
    error=None,
    group="g1",
    workload="pretrain",
    seq=8192,
    loss=2.0,
    mem=60.0,
    gpu="NVIDIA H100 80GB HBM3",
    steps=5,
    path="native",
    sweep_id=None,
    extra_metrics=None,
    extra_config=None,
):
    config = {
        "model": "llama3-8b",
        "precision": precision,
        "seq_len": seq,
        "mbs": 1,
        "gbs": 128,
        "dp": 8,
        "tp": 1,
        "steps": steps,
        **(extra_config or {}),
    }
    metrics = {
        "tokens_per_sec_per_gpu": tps,
        "tflops_per_gpu": tps * 5.8e-2 if tps else None,
        "path": path,
        "final_loss": loss,
        "peak_mem_allocated_gb": mem,
        "mfu_bf16": tps / 17000 if tps else None,
        "memory_kind": "cuda",
        **(extra_metrics or {}),
    }
    end = 3.0 if loss is None else loss
    curve = [
        {"step": s, "loss": 10.0 - s * (10.0 - end) / steps + (0.02 if precision != "bf16" else 0)}
        for s in range(1, steps + 1)
    ]
    if status == "diverged":
        curve[-1]["loss"] = float("nan")
    return store.add_run(
        RunRecord(
            config=config,
            status=status,
            error=error,
            metrics=metrics,
            steps=curve,
            env={"gpu": gpu},
            run_key=f"{group}-{precision}-{seq}-{workload}" + "".join(f"-{v}" for v in (extra_config or {}).values()),
            group_id=group,
            workload=workload,
            num_gpus=8,
            sweep_id=sweep_id,
        )
    )


@pytest.fixture
def store(tmp_path):
    s = ResultsStore(tmp_path)
    # group 1: fp8 recorded before bf16 (the baseline is BF16 anyway), NVFP4 out of memory
    _run(s, "fp8-tensorwise", 13812, loss=2.01)
    _run(s, "bf16", 10000, loss=2.00)
    _run(s, "mxfp8", 13000, loss=2.02, path="emulated")
    _run(s, "nvfp4", None, status="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB", mem=79.5, loss=None)
    # another sequence length of the same sweep
    _run(s, "bf16", 9000, seq=4096, loss=2.1)
    _run(s, "fp8-tensorwise", 12600, seq=4096, loss=2.12)
    # group 2 (another invocation): no BF16 run, a diverged run; SFT workload
    _run(s, "fp8-delayed", 8000, group="g2", workload="sft", loss=1.5)
    _run(
        s,
        "mxfp8",
        None,
        group="g2",
        workload="sft",
        status="diverged",
        error="loss became nan at step 5",
        loss=None,
        extra_metrics={"diverged_step": 5},
    )
    return s


def test_speedup_and_loss_delta_are_against_bf16_of_the_group(store):
    rows = {(r["group_id"], r["precision"], r["seq_len"]): r for r in summary_rows(store.runs())}
    fp8 = rows[("g1", "fp8-tensorwise", 8192)]
    assert fp8["baseline"] == "bf16" and fp8["speedup"] == pytest.approx(1.3812)
    assert fp8["loss_delta"] == pytest.approx(0.01)
    assert rows[("g1", "bf16", 8192)]["speedup"] == pytest.approx(1.0)
    assert rows[("g1", "fp8-tensorwise", 4096)]["speedup"] == pytest.approx(1.4)  # its own seq's BF16
    assert rows[("g1", "nvfp4", 8192)]["speedup"] is None and rows[("g1", "nvfp4", 8192)]["status"] == "oom"
    # no BF16 in group 2: compared with its first ok run, and the row says so
    assert rows[("g2", "fp8-delayed", 8192)]["baseline"] == "fp8-delayed"
    assert rows[("g2", "mxfp8", 8192)]["speedup"] is None


def test_markdown_has_one_nemo_style_table_per_workload(store):
    md = report_markdown(summary_rows(store.runs()), wide=True)  # every column (the default names shared ones)
    assert md.index("## Pre-training") < md.index("## Fine-tuning (SFT)")
    pre = md[md.index("## Pre-training") : md.index("## Fine-tuning (SFT)")]
    lines = [ln for ln in pre.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:6] == ["Model", "System", "#-GPUs", "GBS", "MBS", "Seq Length"]
    for col in (
        "Precision",
        "Backend",
        "Path",
        "Tokens / sec / GPU",
        "Model TFLOP / sec / GPU",
        "MFU",
        "Speedup over BF16",
        "Peak mem (GB)",
        "Δ loss vs BF16",
    ):
        assert col in header
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]
    col = header.index
    assert cells[0][col("Model")] == "llama3-8b" and cells[0][col("System")] == "H100 SXM"
    assert cells[0][col("Precision")] == "BF16"  # the baseline leads its group
    assert cells[1][col("Model")] == "" and cells[1][col("Precision")] == "FP8 (per-tensor)"  # config cells once
    assert cells[1][col("Tokens / sec / GPU")] == "13,812" and cells[1][col("Speedup over BF16")] == "1.38×"
    assert cells[1][col("Δ loss vs BF16")] == "+0.0100" and cells[1][col("GA")] == ""
    assert cells[0][col("GA")] == "16"  # 128 / (1 x 8)
    assert cells[2][col("Path")] == "emulated"
    nvfp4 = next(c for c in cells if c[col("Precision")] == "NVFP4")
    assert nvfp4[col("Tokens / sec / GPU")] == "OOM [1]" and nvfp4[col("Speedup over BF16")] == "–"
    assert "[1] llama3-8b NVFP4 (GBS 128, MBS 1, seq 8192): oom: CUDA out of memory" in pre
    sft = md[md.index("## Fine-tuning (SFT)") :]
    assert "diverged (step 5) [1]" in sft and "1.00× (baseline)" in sft  # no BF16 here: says what it is against


def test_time_to_train_follows_the_nemotron4_formula(store):
    (pre,) = time_to_train_tables(summary_rows(store.runs()))  # pre-training only: not the SFT group
    assert pre.columns[-9:] == [f"{n} GPUs" for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048)]
    bf16 = next(r for r in pre.rows if r[2] == "BF16")
    assert bf16[4] == "10,000"  # the best BF16 rate (seq 8192 beats 4096)
    assert float(bf16[5].replace(",", "")) == pytest.approx(1e12 / (10000 * 8) / 86400, abs=0.01)
    assert float(bf16[-1]) == pytest.approx(1e12 / (10000 * 2048) / 86400, abs=0.01)
    assert all(r[2] != "NVFP4" for r in pre.rows)  # failed runs have no rate
    # the recipe's own example: 389,371 tokens/s on 64 GPUs is 29.7 days
    from lpbench.report.tables import time_to_train

    assert time_to_train(389371 / 64, 64) == pytest.approx(29.7, abs=0.05)


def test_time_to_train_only_for_gpu_pretraining(tmp_path):
    s = ResultsStore(tmp_path)
    _run(s, "bf16", 900.0, gpu=None)  # a CPU run
    _run(s, "bf16", 5000.0, group="g2", workload="sft")
    _run(s, "bf16", 8000.0, group="g3", workload="lora")
    rows = summary_rows(s.runs())
    assert time_to_train_tables(rows) == []
    assert "Time to train" not in report_markdown(rows)
    _run(s, "bf16", 10000.0, group="g4")
    (table,) = time_to_train_tables(summary_rows(s.runs()))
    assert [r[4] for r in table.rows] == ["10,000"] and "Pre-training" in table.title


def test_csv_and_json_keep_one_flat_row_per_run(store, capsys, tmp_path):
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8 and {"speedup", "loss_delta", "baseline", "status", "error", "backend"} <= set(rows[0])
    assert main(["report", "--results", str(tmp_path), "--format", "csv", "--group", "g2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("id,group_id,workload,model,precision") and len(out) == 3


def test_flat_rows_carry_a_pipeline_runs_bubble(tmp_path, capsys):
    s = ResultsStore(tmp_path)
    bubble = dict(pp_stage_blocks="4,4,4,4,4,5,5,2", pp_bubble=0.128)
    bubble |= dict(pp_bubble_ranks="0.186,0.091,0.071,0.163", pp_bubble_theory=0.045, pp_bubble_split=0.096)
    _run(s, "bf16", 8975, extra_metrics=bubble, extra_config=dict(pp=4, vp=2))
    _run(s, "bf16", 10067, group="g2")
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    rows = {r["group_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert {k: rows["g1"][k] for k in bubble} == bubble and (rows["g1"]["pp"], rows["g1"]["vp"]) == (4, 2)
    assert rows["g2"]["pp_bubble"] is None and rows["g2"]["pp"] == 1
    table = to_rich(summary_rows(s.runs()), width=400)
    column = [c for c in table.columns if str(c.header).startswith("PP bubble")]
    assert len(column) == 1 and sorted(str(c) for c in column[0]._cells) == ["12.8% (9.6%)", "n/a"]
    markdown = "".join(t.to_markdown() for t in workload_tables(summary_rows(s.runs())))
    assert "PP bubble (split's theory)" in markdown and "| 12.8% (9.6%) |" in markdown


def test_group_filter(store):
    runs = store.runs()
    assert {r["group_id"] for r in select_runs(runs, ["g2"])} == {"g2"}
    assert len(select_runs(runs, ["g1,g2"])) == 8
    with pytest.raises(Exception, match="no runs in group nope; recent groups: g2, g1"):
        select_runs(runs, ["nope"])


def _png_pixels(png: bytes) -> np.ndarray:
    import io

    import matplotlib.image as mpimg

    return mpimg.imread(io.BytesIO(png), format="png")


def _not_blank(pixels: np.ndarray) -> bool:
    rgb = pixels[..., :3].reshape(-1, 3)
    non_white = (rgb < 0.9).any(axis=1).mean()
    return non_white > 0.02 and rgb.std() > 0.05


def test_plots_are_pngs_with_content(store):
    runs = store.runs()
    rows = summary_rows(runs)
    figures = plots.all_plots(rows, {r["id"]: store.steps(r["id"]) for r in runs})
    assert set(figures) == {"throughput_vs_seq.png", "speedup.png", "loss_curves.png", "peak_memory.png"}
    for name, png in figures.items():
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
        pixels = _png_pixels(png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400 and _not_blank(pixels), name
    assert plots.all_plots([], {}) == {}


def test_plot_labels_name_only_what_differs_between_groups(store):
    rows = [r for r in summary_rows(store.runs()) if r["group_id"] == "g1"]
    groups = [m for _, m in plots._group_rows(rows)]
    labels, common = plots.group_labels(groups)
    assert labels == ["seq 8192", "seq 4096"] and "llama3-8b" in common and "H100 SXM" in common


def _write_report(tmp_path, capsys):
    page = tmp_path / "out" / "report.html"
    assert main(["report", "--results", str(tmp_path), "--html", str(page), "--plots", str(tmp_path / "png")]) == 0
    capsys.readouterr()
    return page


def test_html_page_is_self_contained_with_embedded_plots(store, tmp_path, capsys):
    page = _write_report(tmp_path, capsys)
    text = page.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 4 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from the network
    assert "<h2>Pre-training</h2>" in text and "OOM [1]" in text and "13,812" in text
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "loss_curves.png",
        "peak_memory.png",
        "speedup.png",
        "throughput_vs_seq.png",
    ]
    assert render_page([], {}).count("No runs recorded") == 1


@pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason=f"{CHROMIUM} missing (Debian: apt-get update && apt-get install -y chromium)"
)
def test_html_report_renders_in_headless_chromium(store, tmp_path, capsys):
    page = _write_report(tmp_path, capsys)
    shot = tmp_path / "shot.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--hide-scrollbars",
        "--window-size=1400,2400",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    pixels = _png_pixels(shot.read_bytes())
    assert pixels.shape[:2] == (2400, 1400)
    assert _not_blank(pixels)
    # the embedded plots rendered: many saturated (coloured) pixels, which text and tables do not have
    rgb = pixels[..., :3]
    saturation = rgb.max(axis=-1) - rgb.min(axis=-1)
    assert (saturation > 0.3).mean() > 0.005


def test_torchao_rows_are_compared_with_lpbench_bf16_of_the_same_sweep(tmp_path):
    s = ResultsStore(tmp_path)
    _run(s, "bf16", 10000)
    config = {
        "model": "llama3-8b",
        "precision": "fp8-tensorwise",
        "seq_len": 8192,
        "mbs": 1,
        "gbs": 128,
        "dp": 8,
        "tp": 1,
        "steps": 5,
        "backend": "torchao",
    }
    s.add_run(
        RunRecord(
            config=config,
            status="ok",
            error=None,
            metrics={"tokens_per_sec_per_gpu": 11000.0, "final_loss": 2.0},
            steps=[],
            env={"gpu": "NVIDIA H100 80GB HBM3"},
            run_key="g1-torchao",
            group_id="g1",
            workload="pretrain",
            num_gpus=8,
            backend="torchao",
        )
    )
    torchao = next(r for r in summary_rows(s.runs()) if r["backend"] == "torchao")
    assert torchao["baseline"] == "bf16" and torchao["speedup"] == pytest.approx(1.1)


def test_runs_compiled_differently_get_their_own_bf16_baseline(tmp_path):
    s = ResultsStore(tmp_path)
    for scope, bf16, fp8 in (("block", 10000.0, 11000.0), ("model", 9000.0, 10800.0)):
        for precision, tps in (("bf16", bf16), ("fp8-tensorwise", fp8)):
            config = {
                "model": "llama3-8b",
                "precision": precision,
                "seq_len": 8192,
                "mbs": 1,
                "gbs": 128,
                "dp": 8,
                "tp": 1,
                "steps": 5,
                "compile_scope": scope,
            }
            s.add_run(
                RunRecord(
                    config=config,
                    status="ok",
                    error=None,
                    metrics={"tokens_per_sec_per_gpu": tps},
                    steps=[],
                    env={"gpu": "NVIDIA H100 80GB HBM3"},
                    run_key=f"{scope}-{precision}",
                    group_id="g1",
                    workload="pretrain",
                    num_gpus=8,
                )
            )
    speedups = {(r["compile_scope"], r["precision"]): r["speedup"] for r in summary_rows(s.runs())}
    assert speedups[("block", "fp8-tensorwise")] == pytest.approx(1.1)
    assert speedups[("model", "fp8-tensorwise")] == pytest.approx(1.2)
    assert speedups[("model", "bf16")] == pytest.approx(1.0)


def _timed(store, precision, step_s, q1, q3, *, gpu="NVIDIA H100 80GB HBM3", path="native", group="spread"):
    tps = 128 * 8192 / step_s / 8
    return _run(
        store,
        precision,
        tps,
        gpu=gpu,
        path=path,
        group=group,
        extra_metrics={"step_time_s": step_s, "step_time_p25_s": q1, "step_time_p75_s": q3},
    )


def _speedup_cells(store, group):
    rows = summary_rows(store.runs("group_id = ?", (group,)))
    table = report_markdown(rows)
    return {r["precision"]: r for r in rows}, table


def test_overlapping_step_time_spreads_are_not_shown_as_a_speedup(tmp_path):
    s = ResultsStore(tmp_path)
    _timed(s, "bf16", 1.00, 0.95, 1.05)
    _timed(s, "fp8-tensorwise", 0.97, 0.93, 1.01)  # 1.03x by the medians, but the quartiles overlap
    _timed(s, "mxfp8", 0.80, 0.78, 0.82)  # clearly faster
    rows, md = _speedup_cells(s, "spread")
    fp8, mx = rows["fp8-tensorwise"], rows["mxfp8"]
    assert fp8["within_noise"] and fp8["speedup"] == pytest.approx(1 / 0.97)
    text = to_markdown([fp8])
    assert "within noise (0.94–1.13×)" in text and "1.03×" not in text
    assert not mx["within_noise"] and "1.25× (1.16–1.35)" in to_markdown([mx])
    assert "within noise (0.94–1.13×)" in md and "1.25× (1.16–1.35)" in md  # the report's table too
    assert "1000.0 (950.0–1050.0)" in md and "†" not in md  # step time with its quartiles; GPU, native: no caveat


def test_cpu_and_emulated_speed_ratios_are_marked_as_no_gpu_prediction(tmp_path):
    s = ResultsStore(tmp_path)
    _timed(s, "bf16", 1.0, 0.99, 1.01, gpu=None, group="cpu")
    _timed(s, "fp8-tensorwise", 0.15, 0.149, 0.151, gpu=None, path="emulated", group="cpu")
    _timed(s, "bf16", 1.0, 0.99, 1.01, group="gpu")
    _timed(s, "mxfp8", 0.9, 0.89, 0.91, path="emulated", group="gpu")
    rows = summary_rows(s.runs())
    marked = {(r["group_id"], r["precision"]): r["not_gpu_speed"] for r in rows}
    assert marked == {
        ("cpu", "bf16"): True,
        ("cpu", "fp8-tensorwise"): True,
        ("gpu", "bf16"): False,
        ("gpu", "mxfp8"): True,
    }
    flat = to_markdown(rows)
    assert "6.67× (6.56–6.78) †" in flat and flat.rstrip().endswith(NOT_GPU_SPEED)
    assert NOT_GPU_SPEED in report_markdown(rows)


def test_speedup_labels_are_not_struck_through_by_the_reference_line(tmp_path, monkeypatch):
    s = ResultsStore(tmp_path)
    _run(s, "bf16", 10000)
    _run(s, "fp8-tensorwise", 9800)  # 0.98x: its label sits where the 1.0 line runs
    _run(s, "mxfp8", 10100)
    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    plots.speedup_bars(summary_rows(s.runs()))
    (fig,) = figures
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    (line,) = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [1.0, 1.0]]
    line_y = ax.transData.transform((0, 1.0))[1]
    labels = [t for t in ax.texts if t.get_text().endswith("×")]
    assert sorted(t.get_text() for t in labels) == ["0.98×", "1.00×", "1.01×"]
    crossed = [t for t in labels if t.get_window_extent(renderer).y0 <= line_y <= t.get_window_extent(renderer).y1]
    assert [t.get_text() for t in crossed] == ["0.98×"]
    for t in crossed:  # drawn over the line on an opaque box
        box = t.get_bbox_patch()
        assert box is not None and box.get_facecolor()[3] == 1.0 and t.get_zorder() > line.get_zorder()


MEASURE = """<script>
document.body.dataset.hidden = JSON.stringify([...document.querySelectorAll("table")].map(t => {
  const box = t.parentElement.getBoundingClientRect();
  return [...t.querySelectorAll("th")].filter(th => th.getBoundingClientRect().right > box.right + 0.5)
    .map(th => th.textContent);
}).flat());
document.body.dataset.tables = document.querySelectorAll("table").length;
</script>"""


@pytest.mark.skipif(
    not shutil.which(CHROMIUM), reason=f"{CHROMIUM} missing (Debian: apt-get update && apt-get install -y chromium)"
)
@pytest.mark.parametrize("width", [1400, 1920])
def test_html_tables_show_every_column_at_common_widths(tmp_path, capsys, width):
    s = ResultsStore(tmp_path)  # the widest tables: long precision labels, a resumed run, LoRA, FSDP, a failure
    _run(s, "bf16", 10000, extra_metrics={"resumed_from_step": 20})
    _run(s, "fp8-rowwise-gw-hp", 13812, loss=2.01, extra_metrics={"resumed_from_step": 20})
    _run(s, "nvfp4", None, status="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB", mem=79.5, loss=None)
    _run(s, "bf16", 7000, group="g2", workload="lora")
    _run(s, "fp8-delayed", 8000, group="g2", workload="lora", extra_metrics={"lora_stored_quantized": 32})
    page = _write_report(tmp_path, capsys)
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--window-size={width},1000",
        "--dump-dom",
        probe.as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    tables = re.search(r'data-tables="(\d+)"', out.stdout)
    hidden = re.search(r'data-hidden="([^"]*)"', out.stdout)
    assert tables and int(tables.group(1)) == 3 and hidden, out.stdout[-2000:]
    assert json.loads(hidden.group(1).replace("&quot;", '"')) == []  # no column past the page's edge


def test_recipes_carry_their_presentation():
    """Display name, plot colour and converge tolerance are Recipe fields; an ablation is shown by its own name
    and colour, keeps its base's tolerance; a name lpbench does not know is shown as it is."""
    from lpbench.bench.converge import tolerance_for
    from lpbench.precision.recipes import RECIPES
    from lpbench.report.plots import colour
    from lpbench.report.tables import precision_name

    assert precision_name("fp8-tensorwise") == "FP8 (per-tensor)" and precision_name("nvfp4-no-rht") == "nvfp4-no-rht"
    assert precision_name("a-recipe-since-removed") == "a-recipe-since-removed"
    order = ["bf16", "nvfp4", "nvfp4-no-rht"]
    assert colour("nvfp4", order) == RECIPES["nvfp4"].colour and colour("nvfp4-no-rht", order) not in {
        r.colour for r in RECIPES.values()
    }
    assert tolerance_for("nvfp4-no-rht") == RECIPES["nvfp4"].tolerance == 1.5
    assert len({r.colour for r in RECIPES.values()}) == len(RECIPES)  # every recipe its own colour


def test_report_names_each_runs_optimizer_settings(tmp_path, capsys):
    """Runs that differ only by --master-weights/--optimizer-states/--offload-optimizer are told apart in the
    report's precision cell, as in the run's own table, not printed as identical BF16 rows."""
    s = ResultsStore(tmp_path)
    _run(s, "bf16", 10000)
    _run(s, "bf16", 9000, extra_config={"master_weights": "bf16", "optimizer_states": "8bit"})
    _run(s, "bf16", 8000, extra_config={"optimizer_states": "fp8", "offload_optimizer": True})
    s.close()
    assert main(["report", "--results", str(tmp_path)]) == 0
    cells = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| BF16")]
    assert cells == ["BF16", "BF16 (bf16 weights, 8bit states)", "BF16 (fp8 states, offloaded)"]


def test_report_names_the_recompute_mode_and_pipeline_schedule(tmp_path, capsys):
    """The report's Layout column says how each group ran (recompute mode, a non-default pipeline schedule);
    without it, --recompute full and none showed the same row but for RECOMPUTE_EVERY."""
    s = ResultsStore(tmp_path)
    _run(s, "bf16", 10000, group="g1", extra_config={"recompute": "full"})
    _run(
        s,
        "bf16",
        9000,
        group="g2",
        extra_config={"pp": 2, "vp": 2, "pp_schedule": "zbv", "pp_split": "balanced", "recompute": "none"},
    )
    _run(s, "bf16", 8000, group="g3", extra_config={"recompute": "none"})
    s.close()
    assert main(["report", "--results", str(tmp_path)]) == 0
    lines = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    col = [c.strip() for c in lines[0]].index("Layout")
    rows = [line for line in lines[1:] if len(line) == len(lines[0])]  # the pretraining table's (shared cells folded)
    assert sorted(line[col].strip() for line in rows) == ["recompute full", "zbv", "–"]

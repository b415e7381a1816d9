"""lpbench report over several databases, its --list of groups, and tables that tell groups apart."""

import json

from lpbench.bench.store import ResultsStore, RunRecord
from lpbench.cli import main


def _add(store, precision, group, steps, loss, tps=1000.0):
    config = {"model": "tiny", "precision": precision, "seq_len": 32, "mbs": 2, "gbs": 4, "steps": steps}
    metrics = {"path": "native", "tokens_per_sec_per_gpu": tps, "final_loss": loss, "step_time_s": 0.1}
    store.add_run(
        RunRecord(
            config=config,
            status="ok",
            error=None,
            metrics=metrics,
            steps=[{"step": s, "loss": loss + 0.01 * (steps - s)} for s in range(1, steps + 1)],
            env={"gpu": None},
            run_key=f"{group}-{precision}",
            group_id=group,
            workload="pretrain",
            num_gpus=1,
        )
    )


def _two_databases(tmp_path):
    a, b = ResultsStore(tmp_path / "a"), ResultsStore(tmp_path / "b")
    _add(a, "bf16", "aaaa", 10, 7.0)
    _add(a, "fp8-tensorwise", "aaaa", 10, 7.1, tps=500)
    _add(b, "bf16", "bbbb", 20, 6.0)
    _add(b, "fp8-tensorwise", "bbbb", 20, 6.3, tps=400)
    return a, b


def test_report_merges_several_databases(tmp_path, capsys):
    _two_databases(tmp_path)
    assert main(["report", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["group_id"], r["precision"]) for r in rows) == [
        ("aaaa", "bf16"),
        ("aaaa", "fp8-tensorwise"),
        ("bbbb", "bf16"),
        ("bbbb", "fp8-tensorwise"),
    ]
    assert len({r["id"] for r in rows}) == 4  # ids of the two databases do not collide
    fp8 = {r["group_id"]: r for r in rows if r["precision"] == "fp8-tensorwise"}
    assert fp8["aaaa"]["speedup"] == 0.5 and fp8["bbbb"]["speedup"] == 0.4  # each against its own database's BF16
    assert abs(fp8["bbbb"]["loss_delta"] - 0.3) < 1e-9


def test_report_tables_show_group_steps_and_when(tmp_path, capsys):
    _two_databases(tmp_path)
    assert main(["report", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")]) == 0
    md = capsys.readouterr().out
    header = next(line for line in md.splitlines() if line.startswith("| "))
    assert "Steps" in header and "Group (when, UTC): what differs" in header
    assert "aaaa (" in md and "bbbb (" in md
    assert "| 10 |" in md and "| 20 |" in md
    cells = {c.strip() for line in md.splitlines() for c in line.split("|")}
    assert {c.split(": ", 1)[-1] for c in cells if c.startswith(("aaaa (", "bbbb ("))} == {"steps=10", "steps=20"}


def test_report_table_of_one_group_names_no_difference(tmp_path, capsys):
    _two_databases(tmp_path)
    assert main(["report", "--results", str(tmp_path / "a")]) == 0
    md = capsys.readouterr().out
    assert "aaaa (" in md and "steps=" not in md


def test_report_list_names_what_differs(tmp_path, capsys):
    _two_databases(tmp_path)
    assert (
        main(
            ["report", "--list", "--format", "json", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")]
        )
        == 0
    )
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)}
    assert set(groups) == {"aaaa", "bbbb"}
    assert groups["aaaa"]["differs"] == {"steps": 10} and groups["bbbb"]["differs"] == {"steps": 20}
    assert groups["aaaa"]["runs"] == 2 and groups["aaaa"]["precisions"] == ["bf16", "fp8-tensorwise"]
    assert main(["report", "--list", "--results", str(tmp_path / "a"), "--results", str(tmp_path / "b")]) == 0
    text = capsys.readouterr().out
    assert "aaaa" in text and "steps=20" in text


def test_throughput_plot_says_which_runs_it_draws(tmp_path, monkeypatch):
    from lpbench.report import plots
    from lpbench.report.build import merged_runs
    from lpbench.report.tables import summary_rows

    titles = []
    monkeypatch.setattr(plots, "_png", lambda fig: titles.append(fig._suptitle.get_text()) or b"")
    runs, _ = merged_runs(list(_two_databases(tmp_path)))
    plots.throughput_vs_seq(summary_rows(runs))
    assert "fastest of up to 2 runs" in titles[0] and "aaaa" in titles[0] and "bbbb" in titles[0]


def test_markdown_names_shared_columns_instead_of_repeating_them(tmp_path, capsys):
    a = ResultsStore(tmp_path / "a")
    _add(a, "bf16", "aaaa", 10, 7.0)
    _add(a, "fp8-tensorwise", "aaaa", 10, 7.1, tps=500)
    assert main(["report", "--results", str(tmp_path / "a")]) == 0
    md = capsys.readouterr().out
    header = next(line for line in md.splitlines() if line.startswith("| "))
    assert "Model" not in header and "Steps" not in header and "Precision" in header
    assert "Every row: Model tiny; System CPU" in md and "Steps 10" in md
    assert main(["report", "--results", str(tmp_path / "a"), "--wide"]) == 0
    wide = capsys.readouterr().out
    assert next(line for line in wide.splitlines() if line.startswith("| ")).startswith("| Model | System")

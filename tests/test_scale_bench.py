"""benchmarks/scale.py: the runs it plans and the scaling table it prints from their results."""

import pytest


@pytest.fixture(scope="module")
def scale(benchmark_script):
    return benchmark_script("scale")


def test_plan_grows_the_global_batch_with_the_gpus_and_runs_the_baseline_first(scale):
    runs = scale.plan(
        scale.parse(["--out", "x", "--gpus", "4,1,2", "--layouts", "fsdp,tp2=--tp 2", "--gbs-per-gpu", "8"])
    )
    assert [(name, n) for name, n, _ in runs] == [
        ("1gpu-single", 1),
        ("2gpu-fsdp", 2),
        ("2gpu-tp2", 2),
        ("4gpu-fsdp", 4),
        ("4gpu-tp2", 4),
    ]
    flags = dict(((name, tuple(f)) for name, _, f in runs))
    assert "--nproc-per-node" not in flags["1gpu-single"]
    fsdp4 = list(flags["4gpu-fsdp"])
    assert fsdp4[fsdp4.index("--gbs") + 1] == "32" and "--fsdp" in fsdp4
    assert fsdp4[fsdp4.index("--nproc-per-node") + 1] == "4"
    assert list(flags["2gpu-tp2"])[-2:] == ["--tp", "2"]


def test_unknown_layout_is_refused(scale):
    with pytest.raises(SystemExit, match="unknown layout"):
        scale.parse_layouts("ddp,zero9")


def test_table_divides_by_the_one_gpu_run_of_the_same_precision(scale):
    def row(name, gpus, precision, tps):
        return {
            "name": name,
            "layout": name.split("-", 1)[1],
            "gpus": gpus,
            "precision": precision,
            "status": "ok",
            "tps": tps,
            "spread": (tps * 0.99, tps * 1.01),
            "tflops": tps / 100,
            "peak_gb": 10.0,
        }

    text = scale.table(
        [
            row("1gpu-single", 1, "bf16", 1000.0),
            row("1gpu-single", 1, "fp8-tensorwise", 1300.0),
            row("4gpu-fsdp", 4, "bf16", 950.0),
            row("4gpu-fsdp", 4, "fp8-tensorwise", 1170.0),
        ]
    )
    fsdp_fp8 = next(line for line in text.splitlines() if "| fsdp | 4 | fp8-tensorwise" in line)
    assert "| 90.0% |" in fsdp_fp8  # 1170 / 1300
    assert f"| {1170 / 950:.3f}x |" in fsdp_fp8
    assert "1,170 (1,158-1,182)" in fsdp_fp8


def test_one_gpu_run_end_to_end_reads_its_own_results(scale, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(scale.Path(scale.__file__).resolve().parents[1]))
    rc = scale.main(
        [
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--mbs",
            "2",
            "--gbs-per-gpu",
            "2",
            "--gpus",
            "1",
            "--precision",
            "bf16,fp8-tensorwise",
            "--steps",
            "4",
            "--warmup-steps",
            "1",
            "--extra",
            "--device cpu --no-compile",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| single |")]
    assert [line.split("|")[3].strip() for line in lines] == ["bf16", "fp8-tensorwise"]
    assert all("| 100.0% |" in line for line in lines)
    assert "| 1.000x |" in lines[0]

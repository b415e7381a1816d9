"""benchmarks/scale.py: the runs it plans and the scaling table it prints from their results."""

import pytest


@pytest.fixture(scope="module")
def scale(benchmark_script):
    return benchmark_script("scale")


def test_plan_grows_the_global_batch_with_the_gpus_and_runs_the_baseline_first(scale):
    jobs = scale.plan(
        scale.parse(
            ["--out", "x", "--gpus", "4,1,2", "--layouts", "fsdp,tp2=--tp 2", "--gbs-per-gpu", "8"]
            + ["--gpus-available", "4", "--knob", "fsdp-zero2=--fsdp --fsdp-shard zero2"]
            + ["--knob", "fp8ag=--fsdp --precision fp8-tensorwise --fsdp-fp8-all-gather"]
            + ["--row", "full:4:--model llama3-8b --fsdp --gbs 32", "--row", "moe:2:--model tiny-moe --ep 2"]
            + ["--row", "moe4:4:--model tiny-moe --ep 4 --precision bf16 --precision bf16,fp8-rowwise"]
        )
    )
    both = ["bf16", "fp8-tensorwise"]
    assert [(j.folder, j.gpus, j.precisions, j.table) for j in jobs] == [
        ("1gpu-single-bf16", 1, ["bf16"], "weak"),  # one run per precision where GPUs are left for others
        ("1gpu-single-fp8-tensorwise", 1, ["fp8-tensorwise"], "weak"),
        ("2gpu-fsdp-bf16", 2, ["bf16"], "weak"),
        ("2gpu-fsdp-fp8-tensorwise", 2, ["fp8-tensorwise"], "weak"),
        ("2gpu-tp2-bf16", 2, ["bf16"], "weak"),
        ("2gpu-tp2-fp8-tensorwise", 2, ["fp8-tensorwise"], "weak"),
        ("4gpu-fsdp", 4, both, "weak"),  # every precision in one run where it takes every GPU
        ("4gpu-tp2", 4, both, "weak"),
        ("full", 4, both, "rows"),
        ("moe-bf16", 2, ["bf16"], "rows"),
        ("moe-fp8-tensorwise", 2, ["fp8-tensorwise"], "rows"),
        ("moe4", 4, ["bf16", "fp8-rowwise"], "rows"),  # its own precisions, the last --precision
        ("4gpu-fsdp-zero2", 4, both, "weak"),  # knobs last, at the largest GPU count
        ("4gpu-fp8ag-fp8-tensorwise", 4, ["fp8-tensorwise"], "weak"),
    ]
    flags = {j.folder: j.flags for j in jobs}
    assert "--nproc-per-node" not in flags["1gpu-single-bf16"]
    fsdp4 = flags["4gpu-fsdp"]
    assert fsdp4[fsdp4.index("--gbs") + 1] == "32" and "--fsdp" in fsdp4
    assert fsdp4[fsdp4.index("--nproc-per-node") + 1] == "4"
    assert fsdp4[fsdp4.index("--precision") + 1] == "bf16,fp8-tensorwise"
    assert flags["2gpu-tp2-bf16"][-6:-4] == ["--tp", "2"]
    assert flags["4gpu-fsdp-zero2"][-7:-4] == ["--fsdp", "--fsdp-shard", "zero2"]
    full = flags["full"]
    assert full[:5] == ["--model", "llama3-8b", "--fsdp", "--gbs", "32"] and "--num-layers" not in full
    assert all(f.count("--precision") == 1 for f in flags.values())
    assert flags["moe4"][flags["moe4"].index("--precision") + 1] == "bf16,fp8-rowwise"
    (nccl,) = scale.plan(scale.parse(["--out", "x", "--gpus", "4", "--knob", "n8=NCCL_MAX_NCHANNELS=8 --fsdp"]))[-1:]
    assert nccl.env == {"NCCL_MAX_NCHANNELS": "8"} and nccl.flags[-5:-3] == ["--fsdp", "--precision"]
    assert not any("NCCL" in f for f in nccl.flags)


def test_profiled_layouts_run_one_more_step_and_profile_it(scale):
    argv = ["--out", "x", "--gpus", "1,2,4", "--steps", "6", "--profile-layouts", "fsdp"]
    jobs = scale.plan(scale.parse(argv))  # at the largest GPU count only
    flags = {j.folder: j.flags for j in jobs}
    fsdp = flags["4gpu-fsdp"]
    assert fsdp[fsdp.index("--steps") + 1] == "7" and fsdp[fsdp.index("--profile-steps") + 1] == "7:7"
    assert "--profile-steps" not in flags["4gpu-ddp"] and "--profile-steps" not in flags["1gpu-single"]
    assert "--profile-steps" not in flags["2gpu-fsdp"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--row", "full:four:--fsdp"], "--row takes NAME:GPUS:FLAGS"),
        (["--row", "full:4:"], "--row takes NAME:GPUS:FLAGS"),
        (["--knob", "zero2"], "--knob takes NAME=FLAGS"),
    ],
)
def test_malformed_rows_and_knobs_are_refused(scale, argv, message):
    with pytest.raises(SystemExit, match=message):
        scale.plan(scale.parse(["--out", "x", *argv]))


def test_jobs_share_the_gpus_in_order_under_a_budget(scale, tmp_path, monkeypatch):
    """Jobs start where they fit (CUDA_VISIBLE_DEVICES of free GPUs), each under timeout; a job the budget
    cannot start is skipped, one larger than the host is refused."""
    started, cmds = [], []

    class Proc:
        def __init__(self, cmd, env, **kw):
            self.cmd, self.gpus, self.polls = cmd, env["CUDA_VISIBLE_DEVICES"], 0
            assert env["NCCL_NVLS_ENABLE"] == "0" and env.get("NCCL_MAX_NCHANNELS") == (
                "8" if "--fsdp" in cmd else None
            )
            cmds.append(cmd)
            started.append((cmd[5 + cmd[5:].index("--precision") + 1], self.gpus, [p.gpus for p in live]))
            live.append(self)

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            live.remove(self)
            precision, two = self.cmd[self.cmd.index("--precision") + 1], "--nproc-per-node" in self.cmd
            self.returncode = 124 if precision == "fp8-tensorwise" and two else 0  # 2gpu-fsdp-fp8-tensorwise
            return self.returncode

    live = []
    monkeypatch.setattr(scale.subprocess, "Popen", Proc)
    monkeypatch.setattr(scale.time, "sleep", lambda s: None)
    argv = ["--out", str(tmp_path), "--gpus", "1,2,4,8", "--layouts", "fsdp=NCCL_MAX_NCHANNELS=8 --fsdp"]
    argv += ["--gpus-available", "4"]
    args = scale.parse(argv)
    outcome = scale.run_jobs(scale.plan(args), args)
    assert started[:3] == [("bf16", "0", []), ("fp8-tensorwise", "1", ["0"]), ("bf16", "2,3", ["0", "1"])]
    assert started[4:] == [("bf16,fp8-tensorwise", "0,1,2,3", [])]  # the 4-GPU run waits for every GPU
    assert [cmd[:4] for cmd in cmds] == [["timeout", "-k", "20", "600"]] * 4 + [["timeout", "-k", "20", "1200"]]
    assert outcome["2gpu-fsdp-bf16"] == "ok" and outcome["2gpu-fsdp-fp8-tensorwise"] == "timeout"
    assert outcome["8gpu-fsdp"] == "skipped (too few GPUs)"
    monkeypatch.setattr(scale, "MIN_START_S", 10**9)  # nothing fits the budget
    args = scale.parse(["--out", str(tmp_path), "--gpus", "1", "--budget", "100"])
    assert set(scale.run_jobs(scale.plan(args), args).values()) == {"skipped"}


def test_extrapolation_is_linear_in_the_block_count(scale):
    def row(name, blocks, step_s, precision="bf16"):  # 4 GPUs, 16 x 4096 tokens a step
        tps = 65536 / (step_s * 4)
        return {"name": name, "precision": precision, "gpus": 4, "blocks": blocks, "tokens_per_step": 65536, "tps": tps}

    rows = [row("q8", 8, 1.0), row("q16", 16, 1.8), row("q8", 8, 1.0, "fp8-rowwise")]
    (line,) = scale.extrapolate(rows, "q8,q16:48")  # 1.0 + 0.1 s a block x 40 = 5.0 s
    assert "step 5.000 s" in line and f"{65536 / (5.0 * 4):,.0f} tokens/s/GPU" in line and "bf16" in line
    with pytest.raises(SystemExit, match="A,B:BLOCKS"):
        scale.extrapolate(rows, "q8:48")


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
            "comm": (12.0, 3.0) if gpus > 1 else None,
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
    assert fsdp_fp8.endswith("| 10.0 | 12 | 3 |")  # peak GB, NCCL and exposed ms per step


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

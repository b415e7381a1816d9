"""Recommended configs (lpbench/configs/recommended_model_configs.csv) and `lpbench run --gpu`."""

import dataclasses
import sys

import pytest

from lpbench.bench import recommended as rc
from lpbench.cli import build_parser, configs_from_args, main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.models import MODELS, get_model_config

HEADER = "task,model,size,system,dtype,num_gpus,seq_len,tp,pp,cp,ep,vp,mbs,gbs"


def test_the_csv_has_nemos_columns_and_every_row_is_a_sound_config():
    text = (rc.resources.files("lpbench") / "configs" / rc.CSV_NAME).read_text()
    assert text.startswith(HEADER + ",fsdp,source")
    rows = rc.load()
    assert len(rows) > 80
    keys = [(r.task, r.name, r.system, d, r.num_gpus) for r in rows for d in r.dtypes]
    assert len(keys) == len(set(keys))  # one row per lookup key
    configs = [
        (r.task, r.name, r.system, r.num_gpus, r.seq_len, r.tp, r.pp, r.cp, r.ep, r.vp, r.mbs, r.gbs, r.fsdp)
        for r in rows
    ]
    assert len(configs) == len(set(configs))  # no duplicate rows: one config serving BF16 and FP8 is one row
    for r in rows:
        model = get_model_config(r.name)  # every row names a zoo model
        assert set(r.sources) <= set(rc.SOURCES) and set(r.dtypes) <= {"bf16", "fp8", "fp4"}, r
        assert r.seq_len <= model.max_seq_len, r
        assert r.num_gpus % (r.tp * r.pp * r.cp) == 0, r
        assert r.gbs % (r.mbs * r.dp) == 0, r  # whole gradient accumulation under NeMo's DP
        cfg = RunConfig(
            model=r.name, seq_len=r.seq_len, mbs=r.mbs, gbs=r.gbs, tp=r.tp, pp=r.pp, cp=r.cp, ep=r.ep, dp=r.dp
        )
        cfg.validate()  # TP divides heads, EP the experts and DP; CP's chunks the sequence
    # every zoo model (the CPU presets on "cpu") has pretraining rows on every GPU type
    for name in MODELS:
        systems = {r.system for r in rows if r.name == name and r.task == "pretrain"}
        assert systems == ({"cpu"} if name in ("tiny", "tiny-moe", "small") else {"h100", "h200", "b200", "gb200"}), (
            name
        )


@pytest.mark.parametrize(
    "model,gpu,n,expect",
    [
        # NeMo 25.04 performance summary (FP8): seq, TP, PP, CP, VP, EP, MBS, GBS and the table's GA
        ("llama3-8b", "gb200", 8, (8192, 1, 1, 1, 1, 1, 2, 128, 8)),
        ("llama3-8b", "h100", 8, (8192, 1, 1, 2, 1, 1, 1, 128, 32)),
        ("llama3-70b", "b200", 64, (8192, 2, 4, 2, 5, 1, 1, 128, 32)),
        ("llama3.1-405b", "h100", 1024, (8192, 8, 8, 2, 8, 1, 1, 512, 64)),
        ("nemotron4-340b", "gb200", 128, (4096, 8, 4, 1, 12, 1, 1, 32, 8)),
        ("mixtral-8x7b", "h100", 64, (4096, 1, 4, 1, 8, 8, 1, 256, 16)),
        ("mixtral-8x22b", "gb200", 256, (65536, 2, 4, 8, 14, 8, 1, 64, 16)),
        ("gpt3-175b", "b200", 512, (2048, 4, 4, 1, 6, 1, 2, 2048, 32)),
    ],
)
def test_rows_reproduce_the_published_configs(model, gpu, n, expect):
    r = rc.lookup(model, gpu, n, precision="fp8-tensorwise")
    assert (r.seq_len, r.tp, r.pp, r.cp, r.vp, r.ep, r.mbs, r.gbs, r.grad_accum) == expect


def test_dtype_rows_and_fallback():
    # the Nemotron4 recipe lists BF16 and FP8 at 16..2048 GPUs: GBS = 4 x GPUs
    assert rc.lookup("nemotron4-15b", "h100", 256, precision="bf16").gbs == 1024
    assert rc.lookup("nemotron4-15b", "h100", 16, precision="bf16").dtypes == ("bf16", "fp8")  # the recipe's BF16/FP8
    # only an FP8 row: BF16 and NVFP4 runs take it too (one config for every precision compared)
    assert rc.lookup("llama3-8b", "h100", 8, precision="bf16").dtype == "fp8"
    assert rc.lookup("llama3-8b", "h100", 8, precision="nvfp4").dtype == "fp8"
    assert rc.lookup("llama3-8b", "b200", 8, precision="bf16").sources == ("nemo-25.04", "nemo-25.07-nvfp4-bench")
    assert rc.lookup("nemotron4-340b", "h100", 256, precision="bf16").vp == 1  # the recipe's BF16 row ...
    assert rc.lookup("nemotron4-340b", "h100", 256, precision="fp8").vp == 12  # ... and NeMo 25.04's FP8 row
    assert rc.lookup("llama3-70b", "h100", 32, task="sft").tp == 4
    assert rc.lookup("llama3-8b", "H100").num_gpus == 8  # no count: the smallest listed; case-insensitive


@pytest.mark.parametrize(
    "args,message",
    [
        (("llama3-8b", "h100", 16), "no recommended pretrain config for llama3-8b on 16x h100; GPU counts with one: 8"),
        (("llama3-8b", "a100", 8), "no recommended configs for GPU 'a100'; known: b200, cpu, gb200, h100, h200"),
        (("tiny", "h100", 8), "no recommended pretrain config for tiny on h100; models with one: gpt3-175b"),
    ],
)
def test_missing_combinations_say_what_exists(args, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        rc.lookup(*args)


def _configs(argv):
    return configs_from_args(build_parser().parse_args(["run", "--precision", "bf16", *argv]))


def test_run_takes_its_defaults_from_the_recommended_config(capsys):
    (cfg,) = _configs(["--model", "nemotron4-15b", "--gpu", "h100", "--num-gpus", "16", "--nproc-per-node", "16"])
    assert (cfg.seq_len, cfg.mbs, cfg.gbs, cfg.tp, cfg.dp, cfg.grad_accum) == (4096, 2, 64, 2, 8, 4)
    err = capsys.readouterr().err
    # the printed layout is the one that runs (the recipe's TP 2 x DP 8, GA 4)
    assert (
        "recommended config: nemotron4-15b pretrain on 16x h100 (bf16/fp8 row, nemotron4-recipe); runs as "
        "seq_len 4096, MBS 2, GBS 64, TP 2, DP 8 (distributed optimizer: FSDP2 zero1), GA 4 on 16 process(es); "
        "TFLOP/s by the mha formula, as nemotron4-recipe's table counts\n"
    ) in err
    assert cfg.flops_formula == "mha"  # the row's table's formula
    # explicit flags win, and the printed layout says so
    (cfg,) = _configs(
        [
            "--model",
            "nemotron4-15b",
            "--gpu",
            "h100",
            "--num-gpus",
            "16",
            "--nproc-per-node",
            "16",
            "--seq-len",
            "2048",
            "--mbs",
            "1",
        ]
    )
    assert (cfg.seq_len, cfg.mbs, cfg.gbs, cfg.grad_accum) == (2048, 1, 64, 8)
    assert (
        "runs as seq_len 2048 (flag), MBS 1 (flag), GBS 64, TP 2, DP 8 (distributed optimizer: FSDP2 zero1), GA 8 on 16"
        in capsys.readouterr().err
    )
    # fewer processes than the row's GPUs: the layout of this launch, and the row's beside it
    (cfg,) = _configs(["--model", "llama3.2-1b", "--gpu", "h100", "--num-gpus", "8"])
    assert (cfg.dp, cfg.grad_accum) == (1, 128)
    assert (
        "TP 1, DP 1, GA 128 on 1 process(es) (the row: 8 GPUs, DP 8, GA 16; start 8 with --nproc-per-node"
        in capsys.readouterr().err
    )
    a, b = _configs(["--model", "qwen3-14b", "--gpu", "gb200", "--precision", "bf16,mxfp8", "--nproc-per-node", "8"])
    assert a.tp == b.tp == 2 and a.dp == 4 and a.seq_len == b.seq_len == 4096  # one config for every precision
    (cfg,) = _configs(["--model", "qwen3-14b", "--gpu", "gb200", "--tp", "1"])  # one process: override TP
    assert (cfg.tp, cfg.seq_len) == (1, 4096)
    # a NeMo row's TFLOP/s are NeMo's (nemo-legacy) unless --flops-formula (or --formula) says otherwise
    (cfg,) = _configs(["--model", "llama3-8b", "--gpu", "gb200", "--num-gpus", "8", "--nproc-per-node", "8"])
    assert (
        cfg.flops_formula == "nemo-legacy"
        and "by the nemo-legacy formula, as nemo-25.04's table counts" in capsys.readouterr().err
    )
    (cfg,) = _configs(
        ["--model", "llama3-8b", "--gpu", "gb200", "--num-gpus", "8", "--nproc-per-node", "8", "--formula", "megatron"]
    )
    assert cfg.flops_formula == "megatron" and "by the megatron formula (flag)" in capsys.readouterr().err
    # without --gpu: RunConfig's defaults, as before
    (cfg,) = _configs(["--model", "tiny"])
    d = RunConfig()
    assert (cfg.seq_len, cfg.mbs, cfg.gbs) == (d.seq_len, d.mbs, d.gbs)


def test_a_row_gives_its_whole_layout():
    """The defaults from a row: every parallel size it names, as RunConfig's keys (DP follows the world)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    d = rc.run_defaults(rc.lookup("llama3-8b", "h100", 8))  # NeMo's H100 8B row: CP 2
    assert (d["tp"], d["pp"], d["cp"], d["ep"], d["seq_len"], d["mbs"], d["gbs"]) == (1, 1, 2, 1, 8192, 1, 128)
    d = rc.run_defaults(rc.lookup("llama3.1-405b", "b200", 128))
    assert (d["tp"], d["pp"], d["cp"]) == (4, 8, 2)
    if not {"vp", "pp_schedule"} <= fields:
        pytest.skip("RunConfig has no vp / pp_schedule yet (the pipeline-parallel branch adds them)")
    assert (d["vp"], d["pp_schedule"]) == (8, "interleaved-1f1b")
    assert "pp_schedule" not in rc.run_defaults(rc.lookup("llama3-8b", "h100", 8))  # VP 1: the default schedule


def test_a_data_parallel_row_runs_the_distributed_optimizer(capsys):
    """NeMo runs Megatron's distributed optimizer: a DP > 1 row without FSDP gets FSDP2 zero1, an FSDP row keeps
    zero3, a DP 1 row neither; flags win."""
    argv = ["--model", "nemotron4-15b", "--gpu", "h100", "--num-gpus", "16", "--nproc-per-node", "16"]
    (cfg,) = _configs(argv)  # TP 2, DP 8, fsdp 0
    assert (cfg.dp, cfg.fsdp, cfg.fsdp_shard) == (8, True, "zero1")
    assert "TP 2, DP 8 (distributed optimizer: FSDP2 zero1), GA 4" in capsys.readouterr().err
    (cfg,) = _configs([*argv, "--no-fsdp"])  # DDP asked for: the row's shard does not apply
    assert (cfg.fsdp, cfg.fsdp_shard) == (False, "zero3") and "DP 8 (DDP) (flag)" in capsys.readouterr().err
    (cfg,) = _configs([*argv, "--fsdp-shard", "zero2"])
    assert (cfg.fsdp, cfg.fsdp_shard) == (True, "zero2") and "DP 8 (FSDP zero2) (flag)" in capsys.readouterr().err
    (cfg,) = _configs(["--model", "llama3-70b", "--gpu", "gb200", "--num-gpus", "64", "--nproc-per-node", "64"])
    assert (cfg.dp, cfg.fsdp, cfg.fsdp_shard) == (64, True, "zero3") and "DP 64 (FSDP), GA 2" in (
        capsys.readouterr().err
    )
    rec = rc.lookup("llama3.1-405b", "b200", 128, precision="bf16")
    (cfg,) = _configs(["--model", rec.name, "--gpu", "b200", "--num-gpus", "128", "--nproc-per-node", "128"])
    assert (rec.tp, rec.pp, rec.cp, rec.vp) == (4, 8, 2, 8) and (cfg.dp, cfg.fsdp_shard) == (2, "zero3")  # CP: zero3
    capsys.readouterr()
    ddp = [r for r in rc.load() if not r.fsdp and (r.dp == 1 or r.cp > 1 or r.task == "lora")]  # DP 1, CP, LoRA
    assert {r.task for r in ddp} == {"pretrain", "lora"} and any(r.dp > 1 for r in ddp)
    assert all(rc.run_defaults(r)["fsdp"] is False and "fsdp_shard" not in rc.run_defaults(r) for r in ddp)
    (cfg,) = _configs(["--model", "llama3-8b", "--workload", "lora", "--gpu", "h100", "--nproc-per-node", "8"])
    assert (cfg.dp, cfg.fsdp, cfg.fsdp_shard) == (8, False, "zero3")
    sft = rc.lookup("llama3-8b", "h100", 8, task="sft")
    assert sft.dp > 1 and rc.run_defaults(sft)["fsdp_shard"] == "zero1"
    # the sweep spec takes the row the same way, and its settings too
    from lpbench.bench.sweep_spec import expand

    run = expand({"model": "nemotron4-15b", "gpu": "h100", "num_gpus": 16, "precision": "bf16"}).runs[0]
    assert (run.config.fsdp, run.config.fsdp_shard) == (True, "zero1")
    run = expand({"model": "nemotron4-15b", "gpu": "h100", "num_gpus": 16, "precision": "bf16", "fsdp": False}).runs[0]
    assert (run.config.fsdp, run.config.fsdp_shard) == (False, "zero3")


def test_memory_of_a_data_parallel_row_is_the_distributed_optimizers(capsys):
    """``lpbench memory`` of a DP > 1 row predicts the sharded master weights and states, below DDP's."""
    argv = ["memory", "--model", "nemotron4-15b", "--gpu", "h100", "--num-gpus", "16", "--precision", "bf16"]

    def peak(*more):
        main([*argv, *more])
        out = capsys.readouterr().out
        return float(out.split("predicted peak: ")[1].split(" GB")[0]), out

    zero1, out = peak()
    assert "dp 8 (fsdp zero1) x tp 2" in out and "would fit with:" in out and "--fsdp-shard zero3" in out
    ddp, out = peak("--no-fsdp")
    assert "dp 8 x tp 2" in out and zero1 < ddp / 1.5
    zero3, _ = peak("--fsdp-shard", "zero3")
    assert zero3 < zero1  # zero1 keeps every block's weights gathered across the micro-batches


def test_a_context_parallel_row_runs_its_layout(capsys):
    (cfg,) = _configs(["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8", "--nproc-per-node", "8"])
    assert (cfg.cp, cfg.tp, cfg.dp, cfg.seq_len, cfg.grad_accum) == (2, 1, 4, 8192, 32)
    assert (
        "runs as seq_len 8192, MBS 1, GBS 128, TP 1, CP 2, DP 4 (FSDP), GA 32 on 8 "
        "process(es)" in capsys.readouterr().err
    )
    # on 4 GPUs: CP 2 x DP 2, the row beside it
    (cfg,) = _configs(["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8", "--nproc-per-node", "4"])
    assert (cfg.cp, cfg.dp, cfg.grad_accum) == (2, 2, 64)
    assert "TP 1, CP 2, DP 2 (FSDP), GA 64 on 4 process(es) (the row: 8 GPUs, DP 4" in (capsys.readouterr().err)


def test_num_layers_cuts_the_model_so_a_layout_fits_and_the_label_says_so(capsys):
    argv = ["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8", "--nproc-per-node", "2", "--num-layers", "4"]
    (cfg,) = _configs(argv)
    assert (cfg.cp, cfg.dp, cfg.label) == (2, 1, "llama3-8b@4L")
    assert "(fp8 row, nemo-25.04); the model cut to its first 4 blocks (--num-layers); runs as" in (
        capsys.readouterr().err
    )


def test_every_runnable_row_prints_the_layout_it_builds(capsys):
    for r in rc.load():
        if r.task != "pretrain" or (r.tp > 1 and r.ep > 1):  # TP with EP (Mixtral 8x22B's rows): refused
            continue
        (cfg,) = configs_from_args(
            build_parser().parse_args(
                ["run", "--precision", "bf16", "--model", r.name, "--gpu", r.system, "--num-gpus", str(r.num_gpus)]
            ),
            world_size=r.num_gpus,
        )
        err = capsys.readouterr().err
        ep = f", EP {cfg.ep}" if cfg.ep > 1 else ""
        used = rc.lookup(r.name, r.system, r.num_gpus, precision="bf16")  # a BF16 row where the size has one
        more = "".join(f", {k.upper()} {getattr(used, k)}" for k in ("pp", "vp", "cp") if getattr(used, k) > 1)
        kind = {"zero1": " (distributed optimizer: FSDP2 zero1)", "zero3": " (FSDP)"}[cfg.fsdp_shard]
        assert (cfg.fsdp, cfg.fsdp_shard) == (
            (True, "zero3") if used.fsdp else (True, "zero1") if used.dp > 1 and used.cp == 1 else (False, "zero3")
        ), used
        assert (
            f"TP {cfg.tp}{more}, DP {cfg.dp}{kind if cfg.dp > 1 else ''}{ep}, GA {cfg.grad_accum} on "
            f"{r.num_gpus} process(es); TFLOP/s by the {cfg.flops_formula} formula"
        ) in err, (used, err)
        assert (
            cfg.flops_formula
            == {"nemo": "nemo-legacy", "mb": "megatron", "nemotron4": "mha", "lpbench": "megatron"}[
                used.source.split("-")[0]
            ]
        ), used
        assert (cfg.tp, cfg.pp, cfg.cp, cfg.dp, cfg.ep, cfg.grad_accum) == (
            used.tp,
            used.pp,
            used.cp,
            used.dp,
            used.ep,
            used.grad_accum,
        )


def test_sweep_runs_a_rows_layout():
    from lpbench.bench.sweep_spec import expand

    sweep = expand({"model": "llama3-8b", "gpu": "h100", "num_gpus": 8, "precision": "bf16"})
    assert sweep.runs[0].config.cp == 2 and "TP 1, CP 2, DP 4 (FSDP), GA 32" in (sweep.runs[0].recommended)
    sweep = expand({"model": "nemotron4-15b", "gpu": "h100", "num_gpus": 16, "precision": "bf16"})
    assert sweep.runs[0].recommended.endswith(
        "runs as seq_len 4096, MBS 2, GBS 64, TP 2, DP 8 (distributed optimizer: FSDP2 zero1), GA 4 on 16 process(es); "
        "TFLOP/s by the mha formula, as nemotron4-recipe's table counts"
    )
    assert sweep.runs[0].config.flops_formula == "mha"


def test_slurm_checks_the_recommended_config_against_the_jobs_world(tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    # qwen3-14b's H100 row is TP 4 on 8 GPUs: one node of 8 GPUs runs it, though the writer is one process
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "1",
                "--gpus-per-node",
                "8",
                "--output",
                str(script),
                "--",
                "--model",
                "qwen3-14b",
                "--gpu",
                "h100",
                "--num-gpus",
                "8",
                "--precision",
                "bf16",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "TP 4, DP 2 (distributed optimizer: FSDP2 zero1), GA 64 on 8 process(es)" in err and script.exists()
    assert "--tp 4 --pp 1" in script.read_text()  # the row's layout written out
    assert "--fsdp --fsdp-shard zero1" in script.read_text()  # with its distributed optimizer
    script.unlink()
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "1",
                "--gpus-per-node",
                "6",
                "--output",
                str(script),
                "--",
                "--model",
                "qwen3-14b",
                "--gpu",
                "h100",
                "--num-gpus",
                "8",
            ]
        )
        == 2
    )
    assert "uses TP 4 = 4 ranks, but this launch has 6 process(es)" in capsys.readouterr().err
    assert not script.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16"], "GPU counts with one: 8"),
        (["--model", "llama3-8b", "--num-gpus", "8"], "--num-gpus selects a recommended config and needs --gpu"),
        (["--model", "llama3-8b", "--gpu", "tpu"], "no recommended configs for GPU 'tpu'"),
        (["--model", "qwen3-14b", "--gpu", "h100"], "uses TP 4 = 4 ranks, but this launch has 1 process(es): start 8"),
        (["--model", "llama3-8b", "--gpu", "h100"], "uses TP 1 x CP 2 = 2 ranks, but this launch has 1 process(es)"),
    ],
)
def test_run_rejects_missing_combinations_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["run", *argv, "--results", str(tmp_path)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()

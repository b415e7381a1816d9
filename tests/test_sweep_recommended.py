"""Recommended configs (lpbench/configs/recommended_model_configs.csv) and `lpbench run --gpu`."""

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
    keys = [(r.task, r.name, r.system, r.dtype, r.num_gpus) for r in rows]
    assert len(keys) == len(set(keys))  # one row per lookup key
    for r in rows:
        model = get_model_config(r.name)  # every row names a zoo model
        assert r.source in rc.SOURCES, r
        assert r.seq_len <= model.max_seq_len, r
        assert r.num_gpus % (r.tp * r.pp * r.cp) == 0, r
        assert r.gbs % (r.mbs * r.dp) == 0, r  # whole gradient accumulation under NeMo's DP
        RunConfig(model=r.name, seq_len=r.seq_len, mbs=r.mbs, gbs=r.gbs, tp=r.tp).validate()  # TP divides heads
    # every zoo model (the CPU presets on "cpu") has pretraining rows on every GPU type
    for name in MODELS:
        systems = {r.system for r in rows if r.name == name and r.task == "pretrain"}
        assert systems == ({"cpu"} if name in ("tiny", "small") else {"h100", "h200", "b200", "gb200"}), name


@pytest.mark.parametrize("model,gpu,n,expect", [
    # NeMo 25.04 performance summary (FP8): seq, TP, PP, CP, VP, EP, MBS, GBS and the table's GA
    ("llama3-8b", "gb200", 8, (8192, 1, 1, 1, 1, 1, 2, 128, 8)),
    ("llama3-8b", "h100", 8, (8192, 1, 1, 2, 1, 1, 1, 128, 32)),
    ("llama3-70b", "b200", 64, (8192, 2, 4, 2, 5, 1, 1, 128, 32)),
    ("llama3.1-405b", "h100", 1024, (8192, 8, 8, 2, 8, 1, 1, 512, 64)),
    ("nemotron4-340b", "gb200", 128, (4096, 8, 4, 1, 12, 1, 1, 32, 8)),
    ("mixtral-8x7b", "h100", 64, (4096, 1, 4, 1, 8, 8, 1, 256, 16)),
    ("mixtral-8x22b", "gb200", 256, (65536, 2, 4, 8, 14, 8, 1, 64, 16)),
    ("gpt3-175b", "b200", 512, (2048, 4, 4, 1, 6, 1, 2, 2048, 32)),
])
def test_rows_reproduce_the_published_configs(model, gpu, n, expect):
    r = rc.lookup(model, gpu, n, precision="fp8-tensorwise")
    assert (r.seq_len, r.tp, r.pp, r.cp, r.vp, r.ep, r.mbs, r.gbs, r.grad_accum) == expect


def test_dtype_rows_and_fallback():
    # the Nemotron4 recipe lists BF16 and FP8 at 16..2048 GPUs: GBS = 4 x GPUs
    assert rc.lookup("nemotron4-15b", "h100", 256, precision="bf16").gbs == 1024
    assert rc.lookup("nemotron4-15b", "h100", 16, precision="bf16").dtype == "bf16"
    # only an FP8 row: BF16 and NVFP4 runs take it too (one config for every precision compared)
    assert rc.lookup("llama3-8b", "h100", 8, precision="bf16").dtype == "fp8"
    assert rc.lookup("llama3-8b", "h100", 8, precision="nvfp4").dtype == "fp8"
    assert rc.lookup("llama3-8b", "b200", 8, precision="bf16").source == "nemo-25.07-nvfp4-bench"
    assert rc.lookup("llama3-70b", "h100", 32, task="sft").tp == 4
    assert rc.lookup("llama3-8b", "H100").num_gpus == 8  # no count: the smallest listed; case-insensitive


@pytest.mark.parametrize("args,message", [
    (("llama3-8b", "h100", 16), "no recommended pretrain config for llama3-8b on 16x h100; GPU counts with one: 8"),
    (("llama3-8b", "a100", 8), "no recommended configs for GPU 'a100'; known: b200, cpu, gb200, h100, h200"),
    (("tiny", "h100", 8), "no recommended pretrain config for tiny on h100; models with one: gpt3-175b"),
])
def test_missing_combinations_say_what_exists(args, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        rc.lookup(*args)


def _configs(argv):
    return configs_from_args(build_parser().parse_args(["run", "--precision", "bf16", *argv]))


def test_run_takes_its_defaults_from_the_recommended_config(capsys):
    (cfg,) = _configs(["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8"])
    assert (cfg.seq_len, cfg.mbs, cfg.gbs, cfg.tp) == (8192, 1, 128, 1)
    assert "recommended config: llama3-8b pretrain on 8x h100" in capsys.readouterr().err
    # explicit flags win
    (cfg,) = _configs(["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "8", "--seq-len", "4096", "--mbs", "2"])
    assert (cfg.seq_len, cfg.mbs, cfg.gbs) == (4096, 2, 128)
    a, b = _configs(["--model", "qwen3-14b", "--gpu", "gb200", "--precision", "bf16,mxfp8", "--nproc-per-node", "8"])
    assert a.tp == b.tp == 2 and a.dp == 4 and a.seq_len == b.seq_len == 4096  # one config for every precision
    (cfg,) = _configs(["--model", "qwen3-14b", "--gpu", "gb200", "--tp", "1"])  # one process: override TP
    assert (cfg.tp, cfg.seq_len) == (1, 4096)
    # without --gpu: RunConfig's defaults, as before
    (cfg,) = _configs(["--model", "tiny"])
    d = RunConfig()
    assert (cfg.seq_len, cfg.mbs, cfg.gbs) == (d.seq_len, d.mbs, d.gbs)


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama3-8b", "--gpu", "h100", "--num-gpus", "16"], "GPU counts with one: 8"),
    (["--model", "llama3-8b", "--num-gpus", "8"], "--num-gpus selects a recommended config and needs --gpu"),
    (["--model", "llama3-8b", "--gpu", "tpu"], "no recommended configs for GPU 'tpu'"),
    (["--model", "qwen3-14b", "--gpu", "h100"], "uses TP 4, but this launch has 1 process(es): start 8"),
])
def test_run_rejects_missing_combinations_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["run", *argv, "--results", str(tmp_path)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()

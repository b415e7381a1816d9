"""Workloads end to end: sft and lora runs, frozen quantized LoRA bases, --hf-checkpoint, CLI and sweep."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lpbench.train.loop as loop
from lpbench.bench import sweep as sw
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.data.sft import build_sft_dataset
from lpbench.errors import UsageError
from lpbench.metrics.flops import flops_per_token, lora_flops_per_token, packed_flops_per_token
from lpbench.models import MODELS, build_model
from lpbench.convert.quantize import store_frozen_quantized
from lpbench.precision.frozen import FrozenQuantizedLinear
from lpbench.precision.linear import QuantizedLinear
from lpbench.convert.quantize import apply_recipe
from lpbench.precision.recipes import RECIPES
from lpbench.convert.lora import apply_lora, merge_lora
from lpbench.models.hf import hf_model_config

TINY2 = dataclasses.replace(MODELS["tiny"], n_layers=2, vocab_size=256)
RUN = RunConfig(model="tiny", seq_len=128, mbs=2, gbs=2, steps=2, warmup_steps=1, device="cpu")
ARGS = [
    "--model",
    "tiny",
    "--seq-len",
    "64",
    "--mbs",
    "2",
    "--gbs",
    "2",
    "--steps",
    "2",
    "--warmup-steps",
    "1",
    "--device",
    "cpu",
]


def train_capturing(monkeypatch, cfg):
    """Train ``cfg``; also return its model and a copy of its state right after preparation."""
    seen = {}
    prepare = loop.prepare_model

    def capture(model, *args, **kwargs):
        out = prepare(model, *args, **kwargs)
        seen["model"], seen["start"] = model, {k: v.clone() for k, v in model.state_dict().items()}
        return out

    monkeypatch.setattr(loop, "prepare_model", capture)
    return loop.train(cfg, log=lambda line: None), seen["model"], seen["start"]


@pytest.mark.parametrize(
    "workload,precision", [("sft", "bf16"), ("sft", "fp8-tensorwise"), ("lora", "bf16"), ("lora", "mxfp8")]
)
def test_sft_and_lora_train_with_their_flop_rule(workload, precision, monkeypatch):
    cfg = RUN.with_(workload=workload, precision=precision)
    result, model, start = train_capturing(monkeypatch, cfg)
    assert result.status == "ok" and all(math.isfinite(s["loss"]) for s in result.steps)
    m = result.metrics
    assert m["workload"] == workload and m["weight_bytes"] > 0
    tiny = MODELS["tiny"]
    lengths = build_sft_dataset("mock", seq_len=128, seed=cfg.seed, vocab_size=tiny.vocab_size).flops_sample_lengths()
    rule = (
        packed_flops_per_token
        if workload == "sft"
        else lambda c, s, ls, f: lora_flops_per_token(c, s, f, sample_lengths=ls)
    )
    assert m["flops_per_token"] == rule(tiny, 128, lengths, "megatron")
    assert m["flops_per_token"] < flops_per_token(tiny, 128)  # attention per sample, not over the sequence
    end = model.state_dict()
    if workload == "sft":
        assert m["trainable_params"] == m["params"]
        assert not torch.equal(end["tok_embeddings.weight"], start["tok_embeddings.weight"])
        return
    adapters = [k for k in end if "lora_" in k]
    assert m["trainable_params"] == sum(end[k].numel() for k in adapters) < m["params"] / 2
    assert m["lora_adapted_linears"] == 8 * 4 and m["lora_base_storage"] == "bf16"
    assert all(not torch.equal(end[k], start[k]) for k in adapters)
    assert all(torch.equal(end[k], start[k]) for k in end if "lora_" not in k)  # the base, bit for bit
    base = model.layers[0].attn.qkv.base
    assert base.weight.dtype == torch.bfloat16 and not base.weight.requires_grad
    assert isinstance(base, QuantizedLinear) == (precision != "bf16")


def test_quantized_base_storage_saves_bytes_and_trains_identically(monkeypatch):
    cfg = RUN.with_(workload="lora", precision="fp8-tensorwise")
    plain, _, _ = train_capturing(monkeypatch, cfg)
    stored, model, start = train_capturing(monkeypatch, cfg.with_(lora_base_storage="quantized"))
    assert [s["loss"] for s in stored.steps] == [s["loss"] for s in plain.steps]
    frozen = [m for m in model.modules() if isinstance(m, FrozenQuantizedLinear)]
    assert len(frozen) == stored.metrics["lora_stored_quantized"] == 32 and not any(
        isinstance(m, QuantizedLinear) for m in model.modules()
    )
    # each base: BF16 weight (2 bytes per element) -> E4M3 codes (1 byte) + one FP32 scale
    saved = sum(m.in_features * m.out_features - 4 for m in frozen)
    assert plain.metrics["weight_bytes"] - stored.metrics["weight_bytes"] == saved > 0
    end = model.state_dict()
    assert all(torch.equal(end[k], start[k]) for k in end if "lora_" not in k)


@pytest.mark.parametrize("name", [n for n, r in RECIPES.items() if r.quantized])
def test_frozen_linear_computes_what_the_quantized_linear_computes(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(torch.bfloat16).requires_grad_(False)
    quantized = QuantizedLinear.from_linear(linear, recipe)
    x = torch.randn(3, 32, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # delayed scaling: a first step updates the scales from
        quantized(x.requires_grad_(True)).float().sum().backward()  # 1.0 (the frozen weight's is its own amax's)
    frozen = FrozenQuantizedLinear.from_linear(quantized)  # takes the input and grad histories and scales
    x = x.detach()
    outs = []
    for mod in (quantized, frozen):
        torch.manual_seed(1)  # the same stochastic rounding of gradients
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(2):  # delayed scaling: the second step reads the amax histories
                y = mod(xi)
                y.float().square().sum().backward()
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert frozen.shared == (recipe.scaling not in ("row", "mx"))  # W and Wᵀ quantized alike
    n = 256 * 128
    codes = sum(b.numel() for k, b in frozen.named_parameters() if k.endswith("_codes"))
    assert codes == n * (2 - frozen.shared) // (2 if recipe.fwd_format == "e2m1" else 1)
    assert all(b.dtype == torch.uint8 for k, b in frozen.named_buffers() if "amax" not in k and "delayed" not in k)
    frozen.to(torch.float16)  # a dtype cast leaves the stored bytes alone
    torch.testing.assert_close(frozen(x.bfloat16()), outs[1][0], rtol=0, atol=0)


def test_merging_adapters_into_a_stored_base_requantizes():
    model = build_model(TINY2, device="cpu", seed=0)
    apply_lora(model, rank=4, alpha=8, base_dtype=torch.bfloat16)
    apply_recipe(model, "fp8-tensorwise", device="cpu", emulate=True)
    assert len(store_frozen_quantized(model)) == 2 * 4
    x = torch.randint(0, 256, (2, 16))

    def run():  # a fresh autocast region each time: its weight-cast cache would hide the changes
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float()

    base = run()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_b"):
                m.lora_b.normal_(0, 0.05)
    adapted = run()
    merge_lora(model)
    merged = run()
    assert isinstance(model.layers[0].attn.qkv, QuantizedLinear)
    # the merged weights are quantized again: equal to FP8 precision, far closer than without the adapters
    assert (merged - adapted).abs().mean() < 0.25 * (base - adapted).abs().mean()


# --------------------------------------------------------------------------- --hf-checkpoint


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_hf_checkpoint_is_the_runs_model(hf_folder, tmp_path):
    import torch.nn.functional as F
    import transformers

    from lpbench.bench.store import ResultsStore
    from lpbench.data.loader import build_dataset

    argv = [a for a in ARGS if a not in ("--model", "tiny")]  # no --model: the run is labelled hf:<folder>
    assert (
        main(["run", *argv, "--hf-checkpoint", str(hf_folder), "--precision", "fp32", "--results", str(tmp_path)]) == 0
    )
    (run,) = ResultsStore(tmp_path).runs()
    assert run["model"] == "hf:tiny-llama" and run["status"] == "ok" and run["workload"] == "pretrain"
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_folder).eval()
    assert run["metrics"]["params"] == sum(p.numel() for p in ref.parameters())
    # step 1's loss is the checkpoint's loss on the first batch: its weights were loaded, not initialised
    inputs, labels = next(build_dataset("mock", seq_len=64, seed=RunConfig().seed, vocab_size=256).train_loader(2))
    with torch.no_grad():
        expected = F.cross_entropy(ref(inputs).logits.flatten(0, 1), labels.flatten()).item()
    assert ResultsStore(tmp_path).steps(run["id"])[0]["loss"] == pytest.approx(expected, rel=1e-4)


def test_lora_on_an_hf_checkpoint_trains_only_adapters(hf_folder, monkeypatch):
    cfg = RUN.with_(
        model="hf:tiny-llama",
        hf_checkpoint=str(hf_folder),
        workload="lora",
        lora_rank=4,
        lora_targets="qkv,mlp",
        seq_len=64,
    )
    result, model, start = train_capturing(monkeypatch, cfg)
    assert result.status == "ok" and result.metrics["lora_adapted_linears"] == 2 * 3
    end = model.state_dict()
    assert all(torch.equal(end[k], start[k]) for k in end if "lora_" not in k)


def test_model_and_hf_checkpoint_must_agree(hf_folder, monkeypatch):
    assert hf_model_config("hf:mine", str(hf_folder)).name == "hf:mine"
    with pytest.raises(
        UsageError,
        match=r"--model tiny does not match --hf-checkpoint .*n_layers 8 vs 2.*"
        r"leave out --model to label the run hf:tiny-llama",
    ):
        hf_model_config("tiny", str(hf_folder))
    # a zoo model of the checkpoint's shape labels it; RoPE and eps come from the checkpoint
    monkeypatch.setitem(MODELS, "tiny-64", dataclasses.replace(TINY2, name="tiny-64", dim=64, ffn_dim=128))
    cfg = hf_model_config("tiny-64", str(hf_folder))
    assert cfg.name == "tiny-64" and cfg.rope_theta == 10_000.0 and cfg.max_seq_len == 256


# --------------------------------------------------------------------------- CLI, report, sweep


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workload", "sft", "--lora-rank", "8"], "--lora-rank applies to --workload lora only (this run is sft)"),
        (["--lora-base-storage", "quantized"], "--lora-base-storage applies to --workload lora only"),
        (["--workload", "lora", "--lora-rank", "0"], "--lora-rank must be positive, got 0"),
        (["--workload", "lora", "--lora-alpha", "-1"], "--lora-alpha must be positive"),
        (["--workload", "lora", "--lora-targets", "qkv,v"], "unknown LoRA target 'v'"),
        (
            ["--workload", "lora", "--fsdp", "--fsdp-fp8-all-gather", "--precision", "fp8-tensorwise"],
            "a LoRA base is frozen: use --lora-base-storage",
        ),
        (
            ["--workload", "lora", "--tp", "2", "--nproc-per-node", "2", "--backend", "torchao"],
            "--tp with --workload lora splits lpbench's linears only",
        ),
        (["--workload", "lora", "--lora-base-storage", "quantized", "--backend", "torchao"], "needs --backend lpbench"),
        (["--workload", "finetune"], "invalid choice: 'finetune'"),
        (["--hf-checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt: no such file"),
        (["--workload", "sft", "--data", "mock-uniform"], "--data mock-uniform: not 'mock' or an existing"),
    ],
)
def test_bad_workload_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["run", *ARGS, "--precision", "bf16", *argv, "--results", str(tmp_path)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_lora_with_stored_base_then_report(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                *ARGS,
                "--workload",
                "lora",
                "--precision",
                "bf16,fp8-tensorwise",
                "--lora-rank",
                "8",
                "--lora-base-storage",
                "quantized",
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "lpbench: lora tiny" in out and "frozen base stored quantized (32 linears quantized once)" in out
    assert "frozen base stored bf16 (bf16 quantizes no linear)" in out  # bf16: nothing to quantize
    assert main(["report", "--results", str(tmp_path), "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## Fine-tuning (LoRA)") and "Pre-training" not in md
    assert "| BF16 |" in md and "FP8 (per-tensor), base stored quantized" in md  # BF16 stored nothing quantized
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["workload"], r["precision"], r["status"]) for r in rows] == [
        ("lora", "bf16", "ok"),
        ("lora", "fp8-tensorwise", "ok"),
    ]


def test_sweep_takes_workload_and_lora_settings_as_grid_keys():
    tiny = {
        "name": "ft",
        "model": "tiny",
        "device": "cpu",
        "seq_len": 32,
        "mbs": 2,
        "gbs": 2,
        "steps": 2,
        "warmup_steps": 1,
    }
    sweep = sw.expand({**tiny, "workload": ["pretrain", "sft", "lora"], "precision": ["bf16", "mxfp8"]})
    assert [(r.workload, r.config.workload, r.config.precision) for r in sweep.runs] == [
        (w, w, p) for w in ("pretrain", "sft", "lora") for p in ("bf16", "mxfp8")
    ]
    assert (
        "--workload" in (cmd := sw.child_command(sweep.runs[-1], sw.Path("r"), "ft"))
        and cmd[cmd.index("--workload") + 1] == "lora"
    )
    sweep = sw.expand(
        {
            **tiny,
            "finetune": [{"workload": "sft"}, {"workload": "lora", "lora_rank": 8, "lora_base_storage": "quantized"}],
            "precision": "fp8-tensorwise",
        }
    )
    assert [(r.config.workload, r.config.lora_rank, r.config.lora_base_storage) for r in sweep.runs] == [
        ("sft", 32, "bf16"),
        ("lora", 8, "quantized"),
    ]
    sweep = sw.expand({**tiny, "workload": ["sft", "lora"], "lora_rank": 8})
    assert [r.workload for r in sweep.runs] == ["lora"]
    assert "--lora-rank applies to --workload lora only" in sweep.skipped[0][1]


def test_the_seeds_workloads_spec_expands_to_every_precision_of_each_workload():
    from lpbench.bench import sweep_spec

    sweep = sweep_spec.expand(sweep_spec.load_spec(Path(__file__).parents[1] / "examples" / "seeds-workloads.yaml"))
    assert not sweep.skipped and len(sweep.runs) == 3 * 7
    precisions = ["bf16", "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"]
    grid = {
        "pretrain": ("llama3-8b", None, 8192, 2, 128, 16),  # model, cut, seq, MBS, GBS, GA on 4 GPUs
        "sft": ("llama3-8b", None, 16384, 1, 8, 2),
        "lora": ("llama3-70b", None, 4096, 1, 32, 8),
    }
    got = {}
    for run in sweep.runs:
        c = run.config
        assert (c.world_size, c.dp, c.tp, c.fsdp, c.recompute, c.fused_loss) == (4, 4, 1, True, "full", True)
        assert (c.lora_base_storage == "quantized") == (c.workload == "lora")
        got.setdefault(c.workload, set()).add(
            (c.precision, (c.model, c.num_layers, c.seq_len, c.mbs, c.gbs, c.grad_accum))
        )
    assert got == {w: {(p, shape) for p in precisions} for w, shape in grid.items()}

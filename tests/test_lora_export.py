"""LoRA merge and Hugging Face export from a sharded run (``train/export.py``) against one process.

CPU, gloo. Each case builds a run on 2 ranks (FSDP2 or TP2) as ``lpbench run`` does, gives every adapter the
same values as the single-process model (B non-zero, so the merge matters), and exports it merged. The files
must hold exactly the tensors of ``merge_lora`` + ``export_hf_checkpoint`` in one process, and the export loads
back into lpbench with the logits of the adapted model it came from.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig

pytest.importorskip("safetensors")

# six blocks (NVFP4 keeps the last four in BF16); heads of 32 and an FFN of 256: every rank's part is whole blocks
MODEL = ModelConfig("test-lora-export", 6, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=64)
BASE = RunConfig(model=MODEL.name, seq_len=16, mbs=2, gbs=4, steps=1, device="cpu")
LORA = dict(workload="lora", lora_rank=8)
CASES = {
    "fsdp2 lora fp8-tensorwise stored": dict(
        LORA, precision="fp8-tensorwise", lora_base_storage="quantized", fsdp=True
    ),
    "tp2 lora nvfp4 stored": dict(LORA, precision="nvfp4", lora_base_storage="quantized", tp=2, mbs=4),
    "tp2 lora bf16": dict(LORA, precision="bf16", tp=2, mbs=4),
    "fsdp2 lora bf16": dict(LORA, precision="bf16", fsdp=True),
    "tp2 pretrain bf16": dict(precision="bf16", tp=2, mbs=4),
}


def set_adapters(model) -> None:
    """Every adapter's A and B from a generator seeded by its name, whole, cut as the layout holds them."""
    import zlib

    from lpbench.convert.lora import lora_modules
    from lpbench.models.decoder import assign

    for name, mod in lora_modules(model):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        a = torch.randn(mod.lora_a.shape, generator=gen) * 0.1
        b = torch.randn(mod.lora_b.shape, generator=gen) * 0.1
        split = getattr(mod, "tp_shard", None)
        if split is not None:  # the split dim's parts in each rank's order
            order = torch.cat(
                [dataclasses.replace(split, rank=r).index(torch.device("cpu")) for r in range(split.size)]
            )
            a, b = (a, b.index_select(0, order)) if split.dim == 0 else (a.index_select(1, order), b)
        with torch.no_grad():
            assign(mod.lora_a, a.to(mod.lora_a.dtype))
            assign(mod.lora_b, b.to(mod.lora_b.dtype))


def _worker(rank: int, world: int, out: str) -> dict:
    MODELS[MODEL.name] = MODEL
    import lpbench.train.loop as loop
    from lpbench.train.export import export_merged

    for name, kw in CASES.items():
        run = loop.build(BASE.with_(**kw).with_world(world), log=lambda line: None)
        set_adapters(run.model)
        export_merged(run.model, f"{out}/{name}")
    return {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("lora-export")
    spawn_ranks(_worker, 2, out, 2, str(out))
    return out


def _single(cfg: RunConfig):
    """The single-process model of ``cfg`` (adapters set), as ``lpbench run`` builds it."""
    from lpbench.models import build_model
    from lpbench.precision.recipes import get_recipe
    from lpbench.train.workload import prepare_model

    cfg = cfg.with_(fsdp=False, tp=1, dp=1)
    model = build_model(MODEL, device="meta", seed=cfg.seed)
    prepare_model(model, cfg, get_recipe(cfg.precision), device=torch.device("cpu"), emulate=True, use_compile=False)
    set_adapters(model)
    return model


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    return {k: v for f in files for k, v in load_file(f"{folder}/{f}").items()}


@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_export_equals_the_one_process_merge_and_loads_back(
    exported, name, tmp_path, monkeypatch, one_thread
):
    from lpbench.convert.lora import lora_modules, merge_lora
    from lpbench.models.hf import export_hf_checkpoint, load_hf_checkpoint

    monkeypatch.setitem(MODELS, MODEL.name, MODEL)
    cfg = BASE.with_(**CASES[name])
    adapted = _single(cfg)
    x = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = adapted(x).float()
    assert not lora_modules(adapted) or cfg.workload == "lora"
    export_hf_checkpoint(merge_lora(_single(cfg)), tmp_path / "ref")
    got, ref = _tensors(exported / name), _tensors(tmp_path / "ref")
    assert got.keys() == ref.keys() and len(got) > 20
    unequal = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    assert not unequal, unequal
    index = json.loads((exported / name / "model.safetensors.index.json").read_text())
    assert (
        len(set(index["weight_map"].values())) == MODEL.n_layers + 1
    )  # a file per block (the first with the embeddings)
    back = load_hf_checkpoint(exported / name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = back(x).float()
    if "stored" not in name:  # quantized compute differs from the merged BF16 weights' by more than rounding
        assert torch.allclose(logits, want, rtol=0.05, atol=0.05), (logits - want).abs().max()


def test_run_export_hf_on_two_ranks_writes_a_checkpoint_a_run_starts_from(tmp_path):
    from lpbench.cli import main
    from lpbench.models.hf import load_hf_checkpoint

    common = ["run", "--model", "tiny", "--seq-len", "32", "--mbs", "1", "--gbs", "2", "--device", "cpu"]
    common += ["--precision", "fp8-tensorwise", "--warmup-steps", "0", "--results", str(tmp_path / "results")]
    argv = [*common, "--workload", "lora", "--lora-base-storage", "quantized", "--fsdp", "--nproc-per-node", "2"]
    argv += ["--steps", "2", "--export-hf", str(tmp_path / "hf")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "lpbench", *argv], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "model exported as a Hugging Face checkpoint" in out.stdout
    merged = load_hf_checkpoint(tmp_path / "hf")
    assert (
        merged.cfg.n_layers == MODELS["tiny"].n_layers and (tmp_path / "hf" / "model.safetensors.index.json").exists()
    )
    assert main([*common, "--steps", "1", "--hf-checkpoint", str(tmp_path / "hf")]) == 0


def test_export_hf_refuses_what_it_cannot_gather(tmp_path, capsys):
    from lpbench.cli import main

    argv = ["run", "--model", "tiny", "--seq-len", "32", "--steps", "1", "--precision", "bf16"]
    argv += ["--results", str(tmp_path / "results")]
    assert main([*argv, "--pp", "2", "--nproc-per-node", "2", "--export-hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "--export-hf gathers FSDP and TP layouts only" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists() and not (tmp_path / "results").exists()

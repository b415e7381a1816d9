"""Multi-rank builds are sharded, never whole: a model on the meta device is split (TP, FSDP2), then each rank
materializes only its own parts, value by value, a LoRA base stored quantized as its codes and scales.

CPU, gloo. Each rank runs the run's real build (``train/loop.py: build``) and, for reference, the model built
whole in this process and split by the same layout (which ``tests/test_lora_parallel.py`` checks against one
process): every parameter and buffer this rank holds must be equal bit for bit, and under FSDP alone every
gathered weight equals the single-process build's. While building, the bytes of the model a rank holds never
exceed what it holds once built: no rank ever holds the whole model (the one whole value being cut, e.g. a
weight before it is quantized, is not the model's).
"""

import itertools
import json

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig

# six blocks (NVFP4 keeps the last four in BF16); heads of 32 and an FFN of 256: every rank's part of every split is whole MX (32) and NVFP4 (16) blocks
MODEL = ModelConfig("test-sharded-build", 6, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=64)
BASE = RunConfig(model=MODEL.name, seq_len=16, mbs=2, gbs=4, steps=1, device="cpu")
LORA = dict(workload="lora", lora_rank=8, lora_base_storage="quantized")
CASES2 = {
    "fsdp2 lora fp8-tensorwise": dict(LORA, precision="fp8-tensorwise", fsdp=True),
    "fsdp2 lora nvfp4": dict(LORA, precision="nvfp4", fsdp=True),
    "fsdp2 lora mxfp8": dict(LORA, precision="mxfp8", fsdp=True),
    "fsdp2 lora bf16 base": dict(workload="lora", lora_rank=8, precision="fp8-delayed", fsdp=True),
    "fsdp2 pretrain fp8-delayed": dict(precision="fp8-delayed", fsdp=True),
    "tp2 lora fp8-delayed": dict(LORA, precision="fp8-delayed", tp=2, mbs=4),
    "tp2 lora nvfp4": dict(LORA, precision="nvfp4", tp=2, mbs=4),
    "tp2 lora bf16 base": dict(workload="lora", lora_rank=8, precision="bf16", tp=2, mbs=4),
}
CASES4 = {
    "fsdp2xtp2 lora mxfp8": dict(LORA, precision="mxfp8", fsdp=True, tp=2),
    "fsdp2xtp2 pretrain bf16": dict(precision="bf16", fsdp=True, tp=2),
}
HF = {  # --hf-checkpoint (a folder the fixture writes): every rank reads its own rows and columns
    "hf fsdp2 pretrain": dict(precision="bf16", fsdp=True),
    "hf tp2 pretrain": dict(precision="bf16", tp=2, mbs=4),
    "hf fsdp2 lora fp8-tensorwise": dict(LORA, precision="fp8-tensorwise", fsdp=True),
    "hf tp2 lora nvfp4": dict(LORA, precision="nvfp4", tp=2, mbs=4),
}


class _CountingOpen:
    """``safetensors.safe_open`` that counts the elements each read returns (``read``: a list to add to)."""

    def __init__(self, real, read: list):
        self.real, self.read = real, read

    def __call__(self, *args, **kwargs):
        handle = self.real(*args, **kwargs)
        read = self.read

        class Slice:
            def __init__(self, s):
                self.s = s

            def __getitem__(self, index):
                t = self.s[index]
                read.append(t.numel())
                return t

            def __getattr__(self, name):
                return getattr(self.s, name)

        class Handle:
            def __enter__(self):
                self.h = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_slice(self, key):
                return Slice(self.h.get_slice(key))

            def get_tensor(self, key):
                t = self.h.get_tensor(key)
                read.append(t.numel())
                return t

        return Handle()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds (local parts; meta tensors hold nothing)."""
    tensors = (_local(t) for t in itertools.chain(model.parameters(), model.buffers()))
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _tensors(model: torch.nn.Module) -> dict:
    return dict(itertools.chain(model.named_parameters(), model.named_buffers()))


def _case(cfg: RunConfig) -> dict:
    """Build ``cfg`` as ``lpbench run`` does, watching the bytes held and read; compare with the whole build split."""
    import safetensors

    import lpbench.parallel.plan as plan
    import lpbench.train.loop as loop
    from lpbench.models import build_model
    from lpbench.models.hf import load_hf_checkpoint
    from lpbench.precision.frozen import FrozenQuantizedLinear
    from lpbench.precision.recipes import get_recipe
    from lpbench.train.workload import prepare_model

    built, held = [], []
    real_build, real_parallelize, real_values = loop.build_model, loop.parallelize, plan.initial_values

    def watched_build(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    def parallelize(model, *args, **kwargs):
        held.append(held_bytes(model))
        return real_parallelize(model, *args, **kwargs)

    def values(*args, **kwargs):
        for item in real_values(*args, **kwargs):
            held.append(held_bytes(built[-1]))
            yield item

    read, real_open = [], safetensors.safe_open
    loop.build_model, loop.parallelize, plan.initial_values = watched_build, parallelize, values
    safetensors.safe_open = _CountingOpen(real_open, read)
    try:
        run = loop.build(cfg, log=lambda line: None)
    finally:
        loop.build_model, loop.parallelize, plan.initial_values = real_build, real_parallelize, real_values
        safetensors.safe_open = real_open
    sharded = run.model
    cpu, recipe = torch.device("cpu"), get_recipe(cfg.precision)

    def built_whole():  # the model built whole in this process (from the checkpoint: loaded whole)
        if cfg.hf_checkpoint:
            return load_hf_checkpoint(cfg.hf_checkpoint)
        return build_model(MODEL, device=cpu, seed=cfg.seed)

    whole = built_whole()  # split as before (the reference)
    prepare_model(whole, cfg, recipe, device=cpu, emulate=True, use_compile=False)
    real_parallelize(whole, cfg, cpu, recipe.compute_dtype, use_compile=False)
    single = built_whole()
    prepare_model(single, cfg.with_(fsdp=False, tp=1, dp=1), recipe, device=cpu, emulate=True, use_compile=False)
    a, b, s = _tensors(whole), _tensors(sharded), _tensors(single)
    assert a.keys() == b.keys()
    unequal = [n for n in a if _local(a[n]).dtype != _local(b[n]).dtype or not torch.equal(_local(a[n]), _local(b[n]))]
    gathered = [n for n, t in b.items() if cfg.tp == 1 and hasattr(t, "full_tensor")]
    unequal_gathered = [n for n in gathered if not torch.equal(b[n].full_tensor(), s[n])]
    return {
        "unequal": unequal,
        "compared": len(a),
        "gathered": len(gathered),
        "unequal_gathered": unequal_gathered,
        "stored": sum(isinstance(m, FrozenQuantizedLinear) for m in sharded.modules()),
        "held_during": max(held),
        "held_after": held_bytes(sharded),
        "whole": held_bytes(single),
        "read": sum(read),
        "held_elements": sum(_local(p).numel() for p in sharded.parameters()),
        "whole_elements": sum(p.numel() for p in single.parameters()),
    }


def _worker(rank: int, world: int, cases: dict, folder: str) -> dict:
    MODELS[MODEL.name] = MODEL
    results = {}
    for name, kw in cases.items():
        cfg = BASE.with_(**kw, hf_checkpoint=folder if name.startswith("hf ") else None)
        results[name] = _case(cfg.with_world(world))
    return results


def _spawn(spawn_ranks, out, world: int, cases: dict) -> list:
    from lpbench.models import build_model
    from lpbench.models.hf import export_hf_checkpoint

    export_hf_checkpoint(build_model(MODEL, device="cpu", seed=3), out / "hf", dtype=torch.bfloat16)
    return spawn_ranks(_worker, world, out, world, cases, str(out / "hf"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return _spawn(spawn_ranks, tmp_path_factory.mktemp("sharded-build2"), 2, {**CASES2, **HF})


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return _spawn(spawn_ranks, tmp_path_factory.mktemp("sharded-build4"), 4, CASES4)


def _check(ranks: list, name: str) -> None:
    for r in ranks:
        case = r[name]
        assert case["compared"] > 20 and not case["unequal"], case["unequal"]
        assert not case["unequal_gathered"], case["unequal_gathered"]
        if "tp" not in name:
            assert case["gathered"] > 20
        if "lora" in name and "bf16 base" not in name:
            assert case["stored"] > 0
        assert case["held_during"] <= case["held_after"] < case["whole"]


@pytest.mark.parametrize("name", list(CASES2))
def test_a_two_rank_build_is_sharded_and_equals_the_whole_build(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", list(CASES4))
def test_an_fsdp_times_tp_build_is_sharded_and_equals_the_whole_build(world4, name):
    _check(world4, name)


@pytest.mark.parametrize("name", list(HF))
def test_a_sharded_hf_import_reads_each_ranks_part_and_equals_the_whole_import(world2, name):
    _check(world2, name)
    for r in world2:
        case = r[name]
        if "pretrain" in name:  # its own rows and columns, nothing more
            assert case["read"] == case["held_elements"] < case["whole_elements"]
        else:  # a base stored quantized is read whole, to quantize it; the rest as the rank holds it
            assert 0 < case["read"] < case["whole_elements"]


def _bad_checkpoint(folder, **change):
    """A tiny checkpoint whose config.json has ``change`` applied (its weights no longer fit, or its class)."""
    from lpbench.models import build_model
    from lpbench.models.hf import export_hf_checkpoint

    export_hf_checkpoint(build_model(MODEL, device="cpu", seed=3), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    return folder


@pytest.mark.parametrize(
    "change,message",
    [
        (None, "no such file"),
        ({"intermediate_size": 512}, "tensor model.layers.0.mlp.gate_proj.weight has shape (256, 128), expected (512"),
        ({"num_hidden_layers": 7}, "missing tensor(s) model.layers.6."),
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ],
)
def test_a_bad_checkpoint_exits_2_with_one_line_before_any_work(change, message, capsys, tmp_path):
    from lpbench.cli import main

    folder = tmp_path / "missing" if change is None else _bad_checkpoint(tmp_path / "hf", **change)
    results = tmp_path / "results"
    argv = ["run", "--hf-checkpoint", str(folder), "--workload", "lora", "--lora-base-storage", "quantized"]
    argv += ["--precision", "fp8-tensorwise", "--fsdp", "--nproc-per-node", "2", "--mbs", "1", "--gbs", "2"]
    assert main([*argv, "--seq-len", "16", "--steps", "1", "--device", "cpu", "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not results.exists()


def test_a_bad_output_path_exits_2_before_any_weight_is_read(capsys, tmp_path, monkeypatch):
    import safetensors

    from lpbench.cli import main

    folder = _bad_checkpoint(tmp_path / "hf")  # a good one
    read = []
    monkeypatch.setattr(safetensors, "safe_open", _CountingOpen(safetensors.safe_open, read))
    (tmp_path / "file").write_text("")
    argv = [
        "run",
        "--hf-checkpoint",
        str(folder),
        "--steps",
        "1",
        "--device",
        "cpu",
        "--precision",
        "bf16",
        "--seq-len",
        "16",
    ]
    assert main([*argv, "--results", str(tmp_path / "file" / "results")]) == 2
    err = capsys.readouterr().err
    assert "--results" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert read == []

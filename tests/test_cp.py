"""Context parallelism (``--cp``) on CPU (gloo): CP 2, CP 2 x FSDP 2 and CP 2 x TP 2 against one process.

Exactness is checked where it is defined, as in ``test_parallel_quant.py``: one block's attention and
MLP under CP 2, with each recipe's quantized GEMMs in FP32 compute, give the unsplit block's outputs
and gradients up to FP32 summation order (the attention's softmax sums over the keys in other
blocks, and each rank's weight gradient is a partial sum over its tokens), i.e. every quantized value
equals the unsplit one; without the amax all-reduce over CP, or with stochastic rounding drawn by
local position, they differ. Whole training runs: FP32 matches one process to summation order at
every step; BF16 and the quantized recipes match on the first step (same weights: BF16 roundings of
the same sums in another order) and loosely after, as under TP (the first Adam step turns last-bit
gradient differences into sign-level update differences for gradients near zero, and quantization is
discontinuous: ``test_parallel_quant.test_quantized_backward_amplifies_last_bit_differences``).
"""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

import lpbench.train.loop as loop
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.parallel.env import shutdown
from lpbench.precision.recipes import RECIPES

BASE = RunConfig(model="tiny", seq_len=64, mbs=4, gbs=4, steps=3, warmup_steps=1, device="cpu")
TRAIN_RECIPES = ["fp32", "bf16", "fp8-tensorwise", "fp8-delayed", "nvfp4"]
MODULE_RECIPES = ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8", "nvfp4"]
ONE_BLOCK = ModelConfig("test-one-block", 1, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=128)
LAYOUTS = {2: {"cp2": dict(cp=2)}, 4: {"cp2-fsdp2": dict(cp=2, fsdp=True, mbs=2), "cp2-tp2": dict(cp=2, tp=2)}}


def _fp32_compute(name: str):
    """The recipe with FP32 compute and every block quantized: no BF16 rounding between the GEMMs."""
    return dataclasses.replace(RECIPES[name], compute_dtype=torch.float32, last_bf16_layers=0)


def _module_errors(name: str, rank: int, patch: str | None = None) -> dict:
    """Max relative error of CP 2 vs the unsplit attention and MLP of one block: outputs, input and weight grads
    of a second forward and backward (after the first recorded delayed scaling's amaxes)."""
    from lpbench.convert.quantize import apply_recipe
    from lpbench.models import build_model
    from lpbench.models.decoder import rope_tables
    from lpbench.parallel.cp import ContextParallel, apply_cp
    from lpbench.precision.linear import QuantizedGemms

    recipe, cpu, S = _fp32_compute(name), torch.device("cpu"), 128
    models = []
    for _ in range(2):
        model = build_model(ONE_BLOCK, device="cpu", seed=0)
        apply_recipe(model, recipe, device="cpu", emulate=True)
        models.append(model)
    ref, split = models
    cp = apply_cp(split, dist.group.WORLD, rank, 2)
    idx = cp.index(S, cpu)
    cp.positions(S // 2, cpu)
    cos, sin = rope_tables(ONE_BLOCK, S, cpu)
    with pytest.MonkeyPatch.context() as mpatch:
        if patch == "no-reduce":  # every rank scales its own tokens
            mpatch.setattr(QuantizedGemms, "_cp", lambda self, role: None)
        if patch == "local-noise":  # stochastic rounding draws by local token position
            mpatch.setattr(ContextParallel, "token_index", lambda self, n, device: torch.arange(n, device=device))
        errors = {}
        gen = torch.Generator().manual_seed(0)
        for part in ("attn", "mlp"):
            x, g = torch.randn(2, S, 128, generator=gen), torch.randn(2, S, 128, generator=gen)
            outs = []
            for model, xs, gs, rope in ((ref, x, g, (cos, sin)), (split, x[:, idx], g[:, idx], (cos[idx], sin[idx]))):
                module = model.layers[0].get_submodule(part)
                for _ in range(2):  # delayed scaling: the second pass casts with the scales the first recorded
                    module.zero_grad()
                    xi = xs.clone().requires_grad_()
                    y = module(xi, rope) if part == "attn" else module(xi)
                    torch.manual_seed(1)  # the same stochastic-rounding draws
                    (y * gs).sum().backward()
                grads = {n: p.grad for n, p in module.named_parameters()}
                if model is split:  # each rank's weight gradient is its tokens' part
                    for grad in grads.values():
                        dist.all_reduce(grad)
                    outs.append({"out": y, "x_grad": xi.grad, **grads})
                else:
                    outs.append({"out": y[:, idx], "x_grad": xi.grad[:, idx], **grads})
            errors[part] = {k: float((outs[1][k] - v).abs().max() / v.abs().max()) for k, v in outs[0].items()}
    return errors


def _checkpoint_runs(out: str) -> dict:
    """CP 2, bf16: 4 steps straight; saving at step 2; resumed from step 2."""
    cfg = BASE.with_(cp=2, steps=4, precision="bf16").with_world(2)
    folder = os.path.join(out, "ckpt")
    runs = {
        "straight": loop.train(cfg, log=lambda line: None),
        "saving": loop.train(cfg.with_(save_every=2, save_dir=folder), log=lambda line: None),
        "resumed": loop.train(cfg.with_(load=os.path.join(folder, "step-2")), log=lambda line: None),
    }
    return {
        k: {"loss": [s["loss"] for s in r.steps], "grad_norm": [s["grad_norm"] for s in r.steps]}
        for k, r in runs.items()
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    results = {}
    for layout, kw in LAYOUTS[world].items():
        for precision in TRAIN_RECIPES:
            r = loop.train(BASE.with_(precision=precision, **kw).with_world(world), log=lambda line: None)
            results[f"{layout}-{precision}"] = {
                "loss": [s["loss"] for s in r.steps],
                "grad_norm": [s["grad_norm"] for s in r.steps],
                "status": r.status,
                "error": r.error,
                "metrics": {k: r.metrics[k] for k in ("dp", "tp", "cp", "fsdp", "world_size")},
            }
    if world == 2:
        MODELS[ONE_BLOCK.name] = ONE_BLOCK
        for name in MODULE_RECIPES:
            results[f"module-{name}"] = _module_errors(name, rank)
        for name in ("fp8-tensorwise", "fp8-delayed"):
            results[f"module-{name}-no-reduce"] = _module_errors(name, rank, "no-reduce")
        results["module-nvfp4-local-noise"] = _module_errors("nvfp4", rank, "local-noise")
        results["checkpoint"] = _checkpoint_runs(out)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    shutdown()


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("cp-world2"), 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 4, tmp_path_factory.mktemp("cp-world4"), 4)


@pytest.fixture(scope="module")
def reference():
    return {p: loop.train(BASE.with_(precision=p), log=lambda line: None) for p in TRAIN_RECIPES}


def test_chunks_balance_the_causal_work():
    from lpbench.parallel.cp import ContextParallel

    held = [ContextParallel(None, r, 4).index(16, torch.device("cpu")).tolist() for r in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))
    assert len({sum(h) for h in held}) == 1  # every rank attends over as many keys


@pytest.mark.parametrize("name", MODULE_RECIPES)
def test_a_cp_split_block_quantizes_exactly_like_the_unsplit_one(world2, name):
    for rank in world2:
        for part, errors in rank[f"module-{name}"].items():
            assert max(errors.values()) < 1e-5, (part, errors)  # FP32 summation order only


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-delayed"])
def test_without_the_amax_all_reduce_over_cp_the_parts_differ(world2, name):
    errors = world2[0][f"module-{name}-no-reduce"]
    assert max(errors["mlp"].values()) > 1e-3 and max(errors["attn"].values()) > 1e-3


def test_stochastic_rounding_draws_follow_the_whole_sequence(world2):
    errors = world2[0]["module-nvfp4-local-noise"]
    assert errors["mlp"]["gate_up.weight"] > 1e-3 and errors["attn"]["qkv.weight"] > 1e-3
    assert errors["mlp"]["out"] < 1e-5  # the forward draws nothing


def _assert_trains_like_one_process(run: dict, ref, precision: str) -> None:
    assert run["status"] == "ok", run["error"]
    loss, norm = [s["loss"] for s in ref.steps], [s["grad_norm"] for s in ref.steps]
    if precision == "fp32":  # summation order only
        assert run["loss"] == pytest.approx(loss, rel=1e-5) and run["grad_norm"] == pytest.approx(norm, rel=1e-4)
        return
    assert run["loss"][0] == pytest.approx(loss[0], rel=1e-5)  # same weights: BF16 roundings of reordered sums
    assert run["grad_norm"][0] == pytest.approx(norm[0], rel=2e-3)
    assert run["loss"] == pytest.approx(loss, rel=2e-3)  # then amplified by Adam's first step (module doc)


@pytest.mark.parametrize("precision", TRAIN_RECIPES)
def test_cp2_trains_like_one_process(world2, reference, precision):
    run = world2[0][f"cp2-{precision}"]
    _assert_trains_like_one_process(run, reference[precision], precision)
    assert world2[1][f"cp2-{precision}"]["loss"] == run["loss"]  # every rank reports the global loss
    assert run["metrics"] == {"dp": 1, "tp": 1, "cp": 2, "fsdp": 1, "world_size": 2}


@pytest.mark.parametrize("layout", list(LAYOUTS[4]))
@pytest.mark.parametrize("precision", TRAIN_RECIPES)
def test_cp2_times_fsdp2_or_tp2_trains_like_one_process(world4, reference, layout, precision):
    _assert_trains_like_one_process(world4[0][f"{layout}-{precision}"], reference[precision], precision)


def test_a_cp2_checkpoint_resumes_exactly(world2):
    runs = world2[0]["checkpoint"]
    assert runs["saving"] == runs["straight"]
    for key in ("loss", "grad_norm"):
        assert runs["saving"][key][:2] + runs["resumed"][key] == runs["straight"][key]  # bit for bit


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "2", "--nproc-per-node", "2", "--seq-len", "66"], "--seq-len 66 must be divisible by 4"),
        (["--cp", "2", "--nproc-per-node", "2", "--precision", "mxfp8"], "must be a multiple of 128"),
        (["--cp", "3", "--nproc-per-node", "2"], "world size 2 is not divisible by --tp 1 x --cp 3"),
        (["--cp", "2", "--nproc-per-node", "2", "--workload", "sft"], "--cp supports pretraining only"),
        (["--cp", "2", "--nproc-per-node", "2", "--model", "tiny-moe"], "mixture-of-experts"),
        (["--cp", "0"], "--cp must be positive"),
    ],
)
def test_impossible_cp_layouts_exit_2_with_one_line(argv, message, capsys, tmp_path):
    results = tmp_path / "results"
    assert main(["run", "--model", "tiny", "--seq-len", "32", "--steps", "2", "--results", str(results), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not results.exists()

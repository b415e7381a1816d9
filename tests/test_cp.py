"""Context parallelism (``--cp``) on CPU (gloo): CP 2, CP 2 x FSDP 2 and CP 2 x TP 2 against one process.

Exactness is checked where it is defined, as in ``test_parallel_quant.py``: one block's attention and
MLP under CP 2, with each recipe's quantized GEMMs in FP32 compute, give the unsplit block's outputs
and gradients up to FP32 summation order (the attention's softmax sums over the keys in other
blocks, and each rank's weight gradient is a partial sum over its tokens), i.e. every quantized value
equals the unsplit one; without the amax all-reduce over CP, or with stochastic rounding drawn by
local position, they differ. Whole training runs: FP32 matches one process to summation order at
every step; BF16 and the quantized recipes match on the first step within the tolerances
``test_parallel_quant`` gives TP (same weights: BF16 roundings of the same sums in another order) and
loosely after, as under TP (the first Adam step turns last-bit
gradient differences into sign-level update differences for gradients near zero, and quantization is
discontinuous: ``test_parallel_quant.test_quantized_backward_amplifies_last_bit_differences``).
"""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import lpbench.train.loop as loop
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.precision.recipes import RECIPES

BASE = RunConfig(
    model="tiny", seq_len=64, mbs=4, gbs=4, steps=3, warmup_steps=1, eval_every=3, eval_batches=1, device="cpu"
)
TRAIN_RECIPES = ["fp32", "bf16", "fp8-tensorwise", "fp8-delayed", "nvfp4"]
MODULE_RECIPES = ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8", "nvfp4"]
ONE_BLOCK = ModelConfig("test-one-block", 1, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=128)
LAYOUTS = {2: {"cp2": dict(cp=2)}, 4: {"cp2-fsdp2": dict(cp=2, fsdp=True, mbs=2), "cp2-tp2": dict(cp=2, tp=2)}}


def _fp32_compute(name: str):
    """The recipe with FP32 compute and every block quantized: no BF16 rounding between the GEMMs."""
    return dataclasses.replace(RECIPES[name], compute_dtype=torch.float32, last_bf16_layers=0)


def _module_errors(name: str, rank: int, patch: str | None = None, tp: int = 1) -> dict:
    """Max relative error of CP 2 vs the unsplit attention and MLP of one block: outputs, input and weight grads
    of a second forward and backward (after the first recorded delayed scaling's amaxes). ``tp`` 2: CP 2 x TP 2
    on 4 ranks (the unsplit gradients of fused TP weights compared in TP's interleaved row order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lpbench.parallel.tp import apply_tp, interleave

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
    group = dist.group.WORLD
    if tp > 1:
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("cp", "tp"))
        apply_tp(split, mesh["tp"], sequence_parallel=False)
        group, rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    cp = apply_cp(split, group, rank, 2)
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
                    grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
                    for grad in grads.values():
                        dist.all_reduce(grad, group=group)
                    outs.append({"out": y, "x_grad": xi.grad, **grads})
                else:
                    for n in grads:
                        shard = getattr(
                            split.layers[0].get_submodule(part).get_submodule(n.rpartition(".")[0]), "tp_shard", None
                        )
                        if shard is not None and shard.dim == 0 and len(shard.sections) > 1:
                            grads[n] = interleave(grads[n], shard.sections, tp)
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
    traces = {k: {key: [s[key] for s in r.steps] for key in ("loss", "grad_norm")} for k, r in runs.items()}
    return {**traces, "folder": os.path.join(folder, "step-2")}


def _trained(cfg: RunConfig) -> dict:
    r = loop.train(cfg, log=lambda line: None)
    return {
        "loss": [s["loss"] for s in r.steps],
        "grad_norm": [s["grad_norm"] for s in r.steps],
        "val_loss": r.metrics.get("val_loss"),
        "status": r.status,
        "error": r.error,
        "metrics": {k: r.metrics[k] for k in ("dp", "tp", "cp", "fsdp", "world_size")},
    }


def _worker(rank: int, world: int, out: str) -> dict:
    results = {}
    for layout, kw in LAYOUTS[world].items():
        for precision in TRAIN_RECIPES:
            results[f"{layout}-{precision}"] = _trained(BASE.with_(precision=precision, **kw).with_world(world))
    if world == 4:
        for name in MODULE_RECIPES:
            results[f"module-tp-{name}"] = _module_errors(name, rank, tp=2)
    if world == 2:
        for mode in ("selective", "full"):
            cfg = BASE.with_(precision="fp8-delayed", cp=2, recompute=mode).with_world(world)
            results[f"cp2-{mode}-fp8-delayed"] = _trained(cfg)
        MODELS[ONE_BLOCK.name] = ONE_BLOCK
        for name in MODULE_RECIPES:
            results[f"module-{name}"] = _module_errors(name, rank)
        for name in ("fp8-tensorwise", "fp8-delayed"):
            results[f"module-{name}-no-reduce"] = _module_errors(name, rank, "no-reduce")
        results["module-nvfp4-local-noise"] = _module_errors("nvfp4", rank, "local-noise")
        results["checkpoint"] = _checkpoint_runs(out)
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("cp-world2")
    return spawn_ranks(_worker, 2, out, 2, str(out))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    out = tmp_path_factory.mktemp("cp-world4")
    return spawn_ranks(_worker, 4, out, 4, str(out))


@pytest.fixture(scope="module")
def reference():
    return {p: loop.train(BASE.with_(precision=p), log=lambda line: None) for p in TRAIN_RECIPES}


def test_chunks_balance_the_causal_work():
    from lpbench.parallel.cp import ContextParallel

    held = [ContextParallel(None, r, 4).index(16, torch.device("cpu")).tolist() for r in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))
    assert len({sum(h) for h in held}) == 1  # every rank attends over as many keys


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_chunk_attention_equals_causal_attention(device):
    """One rank's view (a group of one: chunks 0 and 1 of 2, the keys already whole): the lower-right masked
    chunks (on CUDA flash attention's bottom-right alignment) give causal attention over the whole sequence,
    forward and backward."""
    from lpbench.parallel import cp as cp_module

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, generator=gen).to(device, dtype) for h in (8, 2, 2))
    g = torch.randn(2, 8, 256, 64, generator=gen).to(device, dtype)
    one = cp_module.ContextParallel(None, 0, 1)
    one.positions(256, device)
    grads = []
    for attend in (
        lambda q, k, v: one.attention(q, k, v, True),
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out.float() * g.float()).sum().backward()
        grads.append([out, *(t.grad for t in leaves)])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("name", MODULE_RECIPES)
def test_a_cp_split_block_quantizes_exactly_like_the_unsplit_one(world2, name):
    for rank in world2:
        for part, errors in rank[f"module-{name}"].items():
            assert max(errors.values()) < 1e-5, (part, errors)  # FP32 summation order only


@pytest.mark.parametrize("name", MODULE_RECIPES)
def test_a_cp_and_tp_split_block_quantizes_exactly_like_the_unsplit_one(world4, name):
    for rank in world4:
        for part, errors in rank[f"module-tp-{name}"].items():
            assert max(errors.values()) < 1e-5, (part, errors)


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
        assert run["val_loss"] == pytest.approx(ref.metrics["val_loss"], rel=1e-5)  # evaluation splits as training
        return
    # same weights: BF16 roundings of sums taken in another order (other GEMM shapes, TP's partial sums), as
    # test_parallel_quant allows TP; then amplified by Adam's first step and quantization (module doc)
    assert run["loss"][0] == pytest.approx(loss[0], rel=5e-4)
    assert run["grad_norm"][0] == pytest.approx(norm[0], rel=1e-2)  # NVFP4 under TP 2 alone: 4e-3 off
    assert run["loss"] == pytest.approx(loss, rel=5e-3)
    assert run["val_loss"] == pytest.approx(ref.metrics["val_loss"], rel=5e-3)


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


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_under_cp_changes_nothing(world2, mode):
    run, plain = world2[0][f"cp2-{mode}-fp8-delayed"], world2[0]["cp2-fp8-delayed"]
    assert run["status"] == "ok", run["error"]
    assert (run["loss"], run["grad_norm"], run["val_loss"]) == (plain["loss"], plain["grad_norm"], plain["val_loss"])


def test_a_cp2_checkpoint_resumes_exactly(world2):
    runs = world2[0]["checkpoint"]
    assert runs["saving"] == runs["straight"]
    for key in ("loss", "grad_norm"):
        assert runs["saving"][key][:2] + runs["resumed"][key] == runs["straight"][key]  # bit for bit


def test_a_cp2_checkpoint_is_refused_under_another_cp_size(world2, capsys, tmp_path):
    argv = ["run", "--model", "tiny", "--seq-len", "64", "--mbs", "4", "--gbs", "4", "--steps", "4", "--warmup-steps"]
    argv += ["1", "--precision", "bf16", "--device", "cpu", "--load", world2[0]["checkpoint"]["folder"]]
    assert main([*argv, "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert "cp 2 (this run: 1)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "2", "--nproc-per-node", "2", "--seq-len", "66"], "--seq-len 66 must be divisible by 4"),
        (["--cp", "2", "--nproc-per-node", "2", "--precision", "mxfp8"], "must be a multiple of 128"),
        (["--cp", "3", "--nproc-per-node", "2"], "world size 2 is not divisible by --tp 1 x --cp 3"),
        (["--cp", "0"], "--cp must be positive"),
    ],
)
def test_impossible_cp_layouts_exit_2_with_one_line(argv, message, capsys, tmp_path):
    results = tmp_path / "results"
    assert main(["run", "--model", "tiny", "--seq-len", "32", "--steps", "2", "--results", str(results), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not results.exists()

"""Quantized linears and MoE experts under TP, FP8 all-gather under FSDP2, meta-device init: CPU, gloo, 2 ranks.

Exactness is checked where it is defined: a TP-split attention or MLP (quantized GEMMs whose
cross-rank sums feed no further quantization) must give the unsharded outputs and gradients up
to summation order, i.e. every quantized value equals the unsharded one. Whole training runs
agree only loosely: quantization is discontinuous, so the last-bit differences of TP's partial
sums flip a few codes downstream and, with tensor-wide scales, move whole tensors' scales
(``test_quantized_backward_amplifies_last_bit_differences`` shows it in one process).
"""

import dataclasses

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.convert.quantize import quantize_experts
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.precision.recipes import RECIPES

BASE = RunConfig(model="tiny", seq_len=32, mbs=8, gbs=8, steps=3, warmup_steps=1, device="cpu")
TP_RECIPES = ["fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4"]
EXACT_RECIPES = [*TP_RECIPES, "fp8-rowwise"]
ONE_BLOCK = ModelConfig("test-one-block", 1, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=64)
# 6 blocks: nvfp4 quantizes 2 (it keeps the last 4 in BF16); heads of 32: whole MX/NVFP4 blocks per rank
MOE = ModelConfig("test-moe-q", 6, 128, 128, 4, 2, 512, n_experts=4, top_k=2, max_seq_len=256)
MOE_RECIPES = ["bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-fp32-scales", "fp8-delayed", "mxfp8", "nvfp4"]
MOE_TRAIN_RECIPES = ["fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4"]
FSDP_RUNS = {
    f"{p}{'-fp8ag' if ag else ''}": dict(precision=p, fsdp=True, mbs=4, fsdp_fp8_all_gather=ag)
    for p in ("fp8-tensorwise", "fp8-delayed")
    for ag in (False, True)
}
FSDP_RUNS.update(  # gradient accumulation: 4 micro-batches a step
    {
        f"fp8-tensorwise{'-fp8ag' if ag else ''}-ga-{shard}": dict(
            precision="fp8-tensorwise", fsdp=True, mbs=1, fsdp_fp8_all_gather=ag, fsdp_shard=shard
        )
        for ag in (False, True)
        for shard in ("zero3", "zero1")
    }
)


def _fp32_compute(name: str):
    """The recipe with FP32 compute and every block quantized: no BF16 rounding between the GEMMs.
    ``…-fp32-scales``: without power-of-two scales (FP8 codes are scale-invariant under power-of-two scales,
    so only these show a row-wise amax that is not all-reduced)."""
    base, pow2 = name.removesuffix("-fp32-scales"), {"pow2_scales": False} if name.endswith("-fp32-scales") else {}
    return dataclasses.replace(RECIPES[base], compute_dtype=torch.float32, last_bf16_layers=0, **pow2)


def _module_errors(name: str, patch: str | None = None) -> dict:
    """Max relative error of TP=2 vs unsharded attention and MLP of one block: outputs, input and weight grads."""
    from torch.distributed.tensor import DTensor

    from lpbench.models import build_model
    from lpbench.models.decoder import rope_tables
    from lpbench.parallel import tp as tp_module
    from lpbench.parallel.plan import parallelize
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.convert.quantize import apply_recipe

    recipe, cfg = _fp32_compute(name), BASE.with_(model=ONE_BLOCK.name, tp=2, sequence_parallel=False).with_world(2)
    ref = build_model(ONE_BLOCK, device="cpu", seed=cfg.seed)
    apply_recipe(ref, recipe, device="cpu", emulate=True)
    split = build_model(ONE_BLOCK, device="meta")
    apply_recipe(split, recipe, device="cpu", emulate=True)
    with pytest.MonkeyPatch.context() as mpatch:
        if patch == "no-reduce":  # every rank scales its own shard
            mpatch.setattr(QuantizedLinear, "_tp_group", lambda self, role: None)
        if patch == "local-noise":  # stochastic rounding draws by local position, ignoring the fused layout
            mpatch.setattr(
                tp_module.TPShard,
                "index",
                lambda self, device: torch.arange(
                    self.rank * sum(self.sections) // self.size,
                    (self.rank + 1) * sum(self.sections) // self.size,
                    device=device,
                ),
            )
        parallelize(split, cfg, torch.device("cpu"), torch.float32, use_compile=False)
        errors = {}
        gen = torch.Generator().manual_seed(0)
        rope = rope_tables(ONE_BLOCK, 32, torch.device("cpu"))
        for part in ("attn", "mlp"):
            x, g = torch.randn(2, 32, 128, generator=gen), torch.randn(2, 32, 128, generator=gen)
            outs = []
            for model in (ref, split):
                xi = x.clone().requires_grad_()
                module = model.layers[0].get_submodule(part)
                y = module(xi, rope) if part == "attn" else module(xi)
                torch.manual_seed(1)  # the same stochastic-rounding draws
                (y * g).sum().backward()
                grads = {}
                for pname, p in module.named_parameters():
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    sections = _fused_sections(split, f"layers.0.{part}.{pname}")
                    grads[pname] = tp_module.interleave(grad, sections, 2) if model is ref and sections else grad
                outs.append({"out": y, "x_grad": xi.grad, **grads})
            errors[part] = {k: float((outs[1][k] - v).abs().max() / v.abs().max()) for k, v in outs[0].items()}
    return errors


def _expert_errors(name: str, no_reduce: bool = False) -> dict:
    """Max relative error of TP=2 vs unsharded MoE experts (expert 2 gets no tokens): output, input and weight
    grads (the unsharded ones cut to this rank's slice); ``cached``: the weight cache's codes give the very
    numbers of the uncached TP forward. The rank-0 half of every expert's FFN width is 3x the other, so
    per-rank scales along a split dim differ from the whole tensor's (the check can fail)."""
    import torch.distributed as dist

    from lpbench.models.moe import Experts
    from lpbench.parallel.tp import ExpertsTP, _shard_experts
    from lpbench.precision import grouped
    from lpbench.precision.grouped import Groups
    from lpbench.precision.linear import QuantizedGemms
    from lpbench.convert.weight_cache import install

    gen = torch.Generator().manual_seed(0)
    ref = Experts(MOE)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        F = MOE.ffn_dim
        ref.gate_up[:, torch.arange(2 * F) % F < F // 2] *= 3
        ref.down[:, :, : F // 2] *= 3
    split = Experts(MOE)
    split.load_state_dict(ref.state_dict())
    if name != "bf16":
        for m in (ref, split):
            quantize_experts(m, _fp32_compute(name), native=False)
    _shard_experts(split, ExpertsTP(dist.group.WORLD, dist.get_rank(), 2))
    expert = torch.tensor([0] * 5 + [1] * 20 + [3] * 7)  # sorted; expert 2 gets no tokens
    groups, dest = Groups.of(expert, MOE.n_experts)
    xs, g = torch.randn(len(expert), MOE.dim, generator=gen), torch.randn(len(expert), MOE.dim, generator=gen)

    def run(model):
        x = xs.clone().requires_grad_()
        torch.manual_seed(1)  # the same stochastic-rounding draws
        y = model(x.new_zeros(groups.rows, MOE.dim).index_put((dest,), x), groups)[dest]
        torch.manual_seed(2)
        (y * g).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return {"out": y.detach(), "x_grad": x.grad, **grads}

    with pytest.MonkeyPatch.context() as mpatch:
        if no_reduce:  # every rank scales its own slice
            mpatch.setattr(grouped, "_amax_group", lambda *args: None)
            mpatch.setattr(QuantizedGemms, "_tp_group", lambda self, role: None)
        want, got = run(ref), run(split)
        want = {k: split.gemm.tp.local(k, v) if k in ("gate_up", "down") else v for k, v in want.items()}
        errors = {k: float((got[k] - v).abs().max() / v.abs().max()) for k, v in want.items()}
        if install(split, torch.optim.SGD(split.parameters())) is not None:  # FP8 grouped: codes cached
            errors["cached"] = all(torch.equal(a, got[k]) for k, a in run(split).items())
    return errors


def _experts_refused(name: str) -> str:
    """apply_tp on an MoE model whose expert FFN width splits into parts that cut ``name``'s blocks."""
    from torch.distributed.device_mesh import init_device_mesh

    from lpbench.errors import UsageError
    from lpbench.models import build_model
    from lpbench.parallel.tp import apply_tp
    from lpbench.convert.quantize import apply_recipe

    model = build_model(ModelConfig("test-moe-wide", 1, 256, 128, 2, 2, 256, n_experts=4, top_k=2), device="meta")
    apply_recipe(model, _fp32_compute(name), device="cpu", emulate=True)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)))
    except UsageError as exc:
        return str(exc)
    return "accepted"


def _fused_sections(model, param_name: str):
    """The fused sections whose rows TP interleaved in a parameter of ``model``, or None."""
    shard = getattr(model.get_submodule(param_name.rpartition(".")[0]), "tp_shard", None)
    return shard.sections if shard is not None and shard.dim == 0 and len(shard.sections) > 1 else None


def _meta_init_matches(world_cfg: RunConfig) -> bool:
    """Meta-built, sharded, materialized weights gather to the single-process build's (TP rows interleaved)."""
    from torch.distributed.tensor import DTensor

    from lpbench.models import build_model
    from lpbench.parallel.plan import parallelize
    from lpbench.parallel.tp import interleave

    tp = world_cfg.tp
    ref = build_model(MODELS["tiny"], device="cpu", seed=world_cfg.seed)
    model = build_model(MODELS["tiny"], device="meta")
    parallelize(model, world_cfg, torch.device("cpu"), torch.float32, use_compile=False)
    same = model.lm_head.weight is model.tok_embeddings.weight  # still tied
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        sections = _fused_sections(model, name)
        want = interleave(refs[name], sections, tp) if sections else refs[name]
        same = same and torch.equal(full.detach(), want.detach())
    return same


def _worker(rank: int, world: int) -> dict:
    from lpbench.errors import UsageError
    from lpbench.precision import fp8_allgather

    results = {
        "exact": {name: _module_errors(name) for name in EXACT_RECIPES},
        "no-reduce": {name: _module_errors(name, "no-reduce") for name in ("fp8-tensorwise", "nvfp4")},
        "local-noise": _module_errors("nvfp4", "local-noise"),
        "experts": {name: _expert_errors(name) for name in MOE_RECIPES},
        "experts-no-reduce": {
            name: _expert_errors(name, no_reduce=True)
            for name in ("fp8-tensorwise", "fp8-rowwise-fp32-scales", "nvfp4")
        },
        "experts-blockwise": _experts_refused("fp8-blockwise"),
        "meta-fsdp": _meta_init_matches(BASE.with_(fsdp=True, mbs=4).with_world(2)),
        "meta-tp": _meta_init_matches(BASE.with_(tp=2).with_world(2)),
    }
    for name in TP_RECIPES:
        r = loop.train(BASE.with_(precision=name, tp=2).with_world(2), log=lambda line: None)
        results[f"tp-{name}"] = {"loss": [s["loss"] for s in r.steps], "status": r.status}
    MODELS[MOE.name] = MOE
    for name in MOE_TRAIN_RECIPES:
        r = loop.train(BASE.with_(model=MOE.name, precision=name, tp=2).with_world(2), log=lambda line: None)
        results[f"tp-moe-{name}"] = {"loss": [s["loss"] for s in r.steps], "status": r.status}
    gathered, casts = [], []
    pre = fp8_allgather.Fp8AllGatherWeight.fsdp_pre_all_gather
    cast = fp8_allgather.quantize

    def counted_cast(*args, **kw):
        casts.append(1)
        return cast(*args, **kw)

    fp8_allgather.quantize = counted_cast

    def spy(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP reads the signature
        inputs, metadata = pre(self, mesh, outer_size, outer_stride, module, mp_policy)
        gathered.append([(str(t.dtype), t.element_size()) for t in inputs])
        return inputs, metadata

    fp8_allgather.Fp8AllGatherWeight.fsdp_pre_all_gather = spy
    for name, kw in FSDP_RUNS.items():
        gathered.clear()
        casts.clear()
        r = loop.train(BASE.with_(**kw).with_world(2), log=lambda line: None)
        results[name] = {
            "loss": [s["loss"] for s in r.steps],
            "grad_norm": [s["grad_norm"] for s in r.steps],
            "status": r.status,
            "gathered": gathered[:],
            "casts": len(casts),
        }
    try:
        loop.train(BASE.with_(precision="fp8-blockwise", tp=2).with_world(2), log=lambda line: None)
    except UsageError as exc:
        results["blockwise"] = str(exc)
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("quant-world2"), 2)


@pytest.fixture(scope="module")
def reference():
    """Single-process runs of the TP recipes (dense tiny, and the MoE model)."""
    runs = {name: loop.train(BASE.with_(precision=name), log=lambda line: None) for name in TP_RECIPES}
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setitem(MODELS, MOE.name, MOE)
        for name in MOE_TRAIN_RECIPES:
            runs[f"moe-{name}"] = loop.train(BASE.with_(model=MOE.name, precision=name), log=lambda line: None)
    return runs


@pytest.mark.parametrize("name", EXACT_RECIPES)
@pytest.mark.parametrize("part", ["attn", "mlp"])
def test_tp_shards_quantize_exactly_like_the_unsharded_tensor(world2, name, part):
    errors = world2[0]["exact"][name][part]
    assert len(errors) >= 4  # output, input gradient and every weight gradient
    assert max(errors.values()) < 1e-5, errors  # summation order only: not one code differs


@pytest.mark.parametrize("name", ["fp8-tensorwise", "nvfp4"])
def test_without_the_amax_all_reduce_tp_shards_differ(world2, name):
    assert max(world2[0]["no-reduce"][name]["mlp"].values()) > 1e-3  # the exactness test can fail


def test_stochastic_rounding_draws_follow_the_unsharded_layout(world2):
    errors = world2[0]["local-noise"]
    assert errors["mlp"]["gate_up.weight"] > 1e-3 and errors["attn"]["qkv.weight"] > 1e-3  # fused: rows interleaved
    assert errors["mlp"]["down.weight"] < 1e-5  # row-wise: its gradient is not split, nothing to draw differently


@pytest.mark.parametrize("name", TP_RECIPES)
def test_quantized_recipes_train_with_tp_like_one_process(world2, reference, name):
    run = world2[0][f"tp-{name}"]
    assert run["status"] == "ok" and world2[1][f"tp-{name}"]["loss"] == run["loss"]
    ref = [s["loss"] for s in reference[name].steps]
    assert run["loss"][0] == pytest.approx(ref[0], rel=5e-4)  # same weights: BF16 rounding of TP's partial sums
    assert run["loss"] == pytest.approx(ref, rel=5e-3)  # then codes flipped by those last bits (module doc)


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_tp_split_experts_quantize_exactly_like_the_unsharded_ones(world2, name):
    errors = world2[0]["experts"][name]
    cached = errors.pop("cached", None)
    assert set(errors) == {"out", "x_grad", "gate_up", "down"}
    assert max(errors.values()) < 1e-5, errors  # summation order only: not one code differs
    # FP8 grouped (tensor- and row-wise): the weight cache's codes give the same numbers
    assert cached is (True if name.startswith(("fp8-tensorwise", "fp8-rowwise")) else None)


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise-fp32-scales", "nvfp4"])
def test_without_the_amax_all_reduce_tp_split_experts_differ(world2, name):
    errors = world2[0]["experts-no-reduce"][name]
    errors.pop("cached", None)
    assert max(errors.values()) > 1e-4  # the exactness test can fail


@pytest.mark.parametrize("name", MOE_TRAIN_RECIPES)
def test_quantized_moe_trains_with_tp_like_one_process(world2, reference, name):
    run = world2[0][f"tp-moe-{name}"]
    assert run["status"] == "ok" and world2[1][f"tp-moe-{name}"]["loss"] == run["loss"]
    ref = [s["loss"] for s in reference[f"moe-{name}"].steps]
    assert run["loss"][0] == pytest.approx(ref[0], rel=5e-4)  # as the dense recipes (see there)
    assert run["loss"] == pytest.approx(ref, rel=5e-3)


def test_a_tp_split_that_cuts_experts_quantization_blocks_is_refused(world2):
    assert world2[0]["experts-blockwise"] == (
        "--tp 2 splits layers.0.mlp.experts into parts of 64 features, not whole 128-element quantization "
        "blocks: use a smaller --tp or another precision"
    )


def test_a_tp_split_that_cuts_quantization_blocks_is_refused(world2):
    assert world2[0]["blockwise"] == (
        "--tp 2 splits layers.0.attn.qkv into parts of 64 features, not whole "
        "128-element quantization blocks: use a smaller --tp or another precision"
    )


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-delayed"])
def test_fsdp_fp8_all_gather_gives_the_same_training(world2, name):
    plain, fp8 = world2[0][name], world2[0][f"{name}-fp8ag"]
    assert plain["status"] == fp8["status"] == "ok"
    assert fp8["loss"] == plain["loss"] and fp8["grad_norm"] == plain["grad_norm"]  # the very same codes
    assert plain["gathered"] == []
    # tiny: 8 blocks x 4 quantized linears, gathered in forward and again for backward (the last block once),
    # 1 byte per element, cast once per step
    assert len(fp8["gathered"]) == 3 * 4 * (2 * 7 + 1)
    assert all(inputs == [["torch.float8_e4m3fn", 1]] for inputs in fp8["gathered"])
    assert fp8["casts"] == 3 * 8 * 4 and plain["casts"] == 0


@pytest.mark.parametrize("shard", ["zero3", "zero1"])
def test_fsdp_fp8_all_gather_casts_once_per_step_under_gradient_accumulation(world2, shard):
    plain, fp8 = world2[0][f"fp8-tensorwise-ga-{shard}"], world2[0][f"fp8-tensorwise-fp8ag-ga-{shard}"]
    assert plain["status"] == fp8["status"] == "ok"
    assert fp8["loss"] == plain["loss"] and fp8["grad_norm"] == plain["grad_norm"]
    gathers = {"zero3": 4 * (2 * 7 + 1), "zero1": 8}[shard]  # a step: 4 micro-batches x 15, or each block once
    assert len(fp8["gathered"]) == 3 * 4 * gathers  # 3 steps, 4 quantized linears a block
    assert fp8["casts"] == 3 * 8 * 4  # each of the 32 quantized linears once a step


def test_an_fp8_all_gather_weight_is_checkpointed_as_a_plain_tensor(tmp_path):
    from lpbench.precision.fp8_allgather import Fp8AllGatherWeight

    w = torch.randn(4, 8)
    torch.save({"w": Fp8AllGatherWeight(w)}, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)["w"]  # no pickled subclass to refuse
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w)


def test_meta_init_gathers_to_the_single_process_weights(world2):
    assert world2[0]["meta-fsdp"] is True and world2[1]["meta-fsdp"] is True
    assert world2[0]["meta-tp"] is True and world2[1]["meta-tp"] is True


def test_quantized_backward_amplifies_last_bit_differences():
    """Why whole runs compare loosely: one process, one gradient perturbed by 1e-6, percent-level changes."""
    from lpbench.data.loader import build_dataset
    from lpbench.models import build_model
    from lpbench.convert.quantize import apply_recipe

    ids, labels = next(build_dataset("mock-uniform", seq_len=32, seed=1, vocab_size=2048).train_loader(8, 0, 1))
    grads = []
    for eps in (0.0, 1e-6):
        model = build_model(MODELS["tiny"], device="cpu", seed=1)
        apply_recipe(model, _fp32_compute("fp8-tensorwise"), device="cpu", emulate=True)
        noise = torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(0))

        def perturb_grad(module, args, out):
            out.register_hook(lambda g: g * (1 + eps * noise))

        model.layers[6].register_forward_hook(perturb_grad)
        model(ids, labels).backward()
        grads.append(model.layers[0].mlp.down.weight.grad)
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()) > 1e-3


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--precision", "fp8-tensorwise", "--fsdp-fp8-all-gather"], "--fsdp-fp8-all-gather needs --fsdp"),
        (
            ["--precision", "mxfp8", "--fsdp", "--nproc-per-node", "2", "--mbs", "4", "--fsdp-fp8-all-gather"],
            "--fsdp-fp8-all-gather needs precision fp8-tensorwise or fp8-delayed on the lpbench backend, not mxfp8",
        ),
    ],
)
def test_fsdp_fp8_all_gather_needs_fsdp_and_a_per_tensor_fp8_recipe(argv, message, capsys, tmp_path):
    assert main(["run", "--model", "tiny", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

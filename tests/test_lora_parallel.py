"""LoRA under FSDP2, TP and FSDP2 x TP against one process; a quantized base all-gathered as its bytes.

CPU, gloo. Each rank builds the same model (same seed), applies the run's converters with the base
stored quantized (``--lora-base-storage quantized``), parallelizes it and runs one forward and
backward on its part of one batch; the single-process run on the whole batch is computed in the same
process. The loss and every adapter gradient (gathered whole) must agree. Recipes run with FP32
compute and every block quantized, and the ranks with ATen's scalar kernels (``_spawn_with_scalar_kernels``), so
the only differences are the order of TP's partial sums (and of the gradients' reduction). Those last-bit
differences can flip a few codes of every quantized format (whether they do depends on the CPU's GEMM kernels), so
quantized TP layouts agree to 1 %; the stored shards themselves are exact
(``test_a_stored_base_split_keeps_the_whole_weights_operands``).
"""

import dataclasses

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.precision.linear import Emulated
from lpbench.precision.recipes import RECIPES

# heads of 32 and an FFN of 256: every rank's part of every split is whole MX (32) and NVFP4 (16) blocks
MODEL = ModelConfig("test-lora-par", 2, 128, 256, 4, 2, 256, rope_theta=10_000.0, max_seq_len=64)
BASE = RunConfig(
    model=MODEL.name, workload="lora", lora_rank=8, lora_base_storage="quantized", seq_len=16, mbs=4, gbs=4
)
PRECISIONS = ["bf16", "fp8-tensorwise", "mxfp8", "nvfp4"]
LAYOUTS2 = {
    "fsdp2": dict(dp=2, fsdp=True),
    "tp2": dict(tp=2, sequence_parallel=False),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
}
LAYOUTS4 = {"fsdp2xtp2": dict(dp=2, tp=2, fsdp=True)}


def _recipe(name: str):
    """The recipe with FP32 compute and every block quantized (NVFP4 keeps none in BF16)."""
    recipe = RECIPES[name]
    if not recipe.quantized:
        return dataclasses.replace(recipe, compute_dtype=torch.float32)
    return dataclasses.replace(recipe, compute_dtype=torch.float32, first_bf16_layers=0, last_bf16_layers=0)


def _batch(cfg: RunConfig):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, MODEL.vocab_size, (cfg.gbs, cfg.seq_len), generator=gen)
    return x, x.roll(-1, 1)


def _step(cfg: RunConfig, recipe, count_bytes: bool = False, micro: int = 1) -> dict:
    """Loss and adapter gradients (whole, the fused rows in the unsharded order) of one step of ``cfg``; one
    process: over ``micro`` micro-batches (each data-parallel rank quantizes its own micro-batch's activations)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from torch.distributed.tensor import DTensor

    from lpbench.convert.lora import lora_modules
    from lpbench.models import build_model
    from lpbench.parallel.plan import parallelize
    from lpbench.precision.frozen import FrozenQuantizedLinear
    from lpbench.train.workload import prepare_model

    cpu = torch.device("cpu")
    model = build_model(MODEL, device=cpu, seed=cfg.seed)
    prepare_model(model, cfg, recipe, device=cpu, emulate=True, use_compile=False)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B starts at zero, which would leave A's gradient zero: give it values
        for _, mod in lora_modules(model):
            mod.lora_b.copy_(torch.randn(mod.lora_b.shape, generator=gen) * 0.05)
    stored = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, FrozenQuantizedLinear))
    # a block's floating parameters (norms, adapters) share its all-gather, which mixed dtypes make one of bytes
    floats = sum(p.numel() * p.element_size() for b in model.layers for p in b.parameters() if p.is_floating_point())
    par = parallelize(model, cfg, cpu, recipe.compute_dtype, use_compile=False)
    x, y = _batch(cfg)
    rows = cfg.gbs // cfg.dp
    x, y = x[par.dp_rank * rows : (par.dp_rank + 1) * rows], y[par.dp_rank * rows : (par.dp_rank + 1) * rows]
    gathered = []  # bytes of each all-gather of bytes (the blocks holding stored bases) in the forward passes
    real = DefaultAllGather.__call__

    def counting(self, *args, **kwargs):
        output = kwargs["output_tensor"] if "output_tensor" in kwargs else args[0]
        if count_bytes and output.dtype == torch.uint8 and not backward[0]:
            gathered.append(output.numel())
        return real(self, *args, **kwargs)

    backward = [False]
    DefaultAllGather.__call__ = counting
    loss = torch.zeros(())
    try:
        for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            torch.manual_seed(par.dp_rank + k)  # NVFP4's stochastic rounding: each micro-batch draws alike
            backward[0] = False
            part = par.forward(xm, ym) / micro
            backward[0] = True
            part.backward()
            loss += part.detach()
    finally:
        DefaultAllGather.__call__ = real
    if cfg.dp > 1:
        dist.all_reduce(loss, group=par.meshes.group("loss"))
        loss /= cfg.dp
    grads = {}
    kv = MODEL.n_kv_heads * MODEL.dim // MODEL.n_heads
    fused = {"attn.qkv": (MODEL.dim, kv, kv), "mlp.gate_up": (MODEL.ffn_dim, MODEL.ffn_dim)}
    for name, mod in lora_modules(model):
        for part in ("lora_a", "lora_b"):
            g = getattr(mod, part).grad
            g = g.full_tensor() if isinstance(g, DTensor) else g
            parts = fused.get(name.split(".", 2)[2], ())
            if part == "lora_b" and cfg.tp > 1 and parts:  # undo the per-rank interleave of fused rows
                tp = cfg.tp
                chunks = [g.chunk(tp, 0)[r].split([n // tp for n in parts], 0) for r in range(tp)]
                g = torch.cat([torch.cat([chunks[r][s] for r in range(tp)]) for s in range(len(parts))])
            grads[f"{name}.{part}"] = g.float().tolist()
    return {
        "loss": loss.item(),
        "grads": grads,
        "gathered_bytes": sum(gathered),
        "stored_elements": stored,
        "block_float_bytes": floats,
    }


def _worker(rank: int, layouts: dict) -> dict:
    MODELS[MODEL.name] = MODEL
    import torch.distributed as dist

    results = {}
    for precision in PRECISIONS:
        recipe = _recipe(precision)
        cfg = BASE.with_(precision=precision)
        for micro in sorted({layout.get("dp", 1) for layout in layouts.values()}):
            results[f"ref{micro}-{precision}"] = _step(cfg, recipe, micro=micro)
        for name, layout in layouts.items():
            run = cfg.with_(mbs=cfg.gbs // layout.get("dp", 1), **layout)
            results[f"{name}-{precision}"] = _step(run, recipe, count_bytes=name == "fsdp2")
        dist.barrier()
    return results


def _spawn_with_scalar_kernels(spawn_ranks, nprocs: int, out, layouts: dict) -> list:
    """The ranks run ATen's scalar CPU kernels. SiLU's vectorized kernel rounds some elements differently from its
    scalar loop, which one process and a TP rank's shard can reach for the same element, and FP8's rounding turns
    that last bit into a code step (2 % of a tensorwise adapter gradient on an AVX-512 CPU)."""
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setenv("ATEN_CPU_CAPABILITY", "default")  # read by each spawned rank's torch at import
        return spawn_ranks(_worker, nprocs, out, layouts)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return _spawn_with_scalar_kernels(spawn_ranks, 2, tmp_path_factory.mktemp("lora-world2"), LAYOUTS2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return _spawn_with_scalar_kernels(spawn_ranks, 4, tmp_path_factory.mktemp("lora-world4"), LAYOUTS4)


def _tolerance(layout: dict, precision: str) -> float:
    return 1e-2 if precision != "bf16" and layout.get("tp", 1) > 1 else 1e-4


def _assert_same(result: dict, layout: dict, name: str, precision: str, rel: float) -> None:
    run, ref = result[f"{name}-{precision}"], result[f"ref{layout.get('dp', 1)}-{precision}"]
    assert run["loss"] == pytest.approx(ref["loss"], rel=rel)
    assert run["grads"].keys() == ref["grads"].keys()
    errors = {}
    for name, g in run["grads"].items():
        got, want = torch.tensor(g), torch.tensor(ref["grads"][name])
        assert got.shape == want.shape, name
        errors[name] = ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()
    assert max(errors.values()) <= rel, errors


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS2))
def test_lora_on_two_ranks_equals_one_process(world2, layout, precision):
    for result in world2:
        _assert_same(result, LAYOUTS2[layout], layout, precision, rel=_tolerance(LAYOUTS2[layout], precision))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_lora_under_fsdp_times_tp_equals_one_process(world4, precision):
    for result in world4:
        _assert_same(
            result, LAYOUTS4["fsdp2xtp2"], "fsdp2xtp2", precision, rel=_tolerance(LAYOUTS4["fsdp2xtp2"], precision)
        )


@pytest.mark.parametrize("precision", ["fp8-tensorwise", "fp8-delayed", "fp8-blockwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_stored_base_split_keeps_the_whole_weights_operands(precision, dim):
    """Each rank's part of a base stored quantized (fused rows in the per-rank layout) dequantizes to exactly that
    part of the whole weight's stored operands, for fprop (W) and dgrad (Wᵀ)."""
    from lpbench.parallel.tp import TPShard
    from lpbench.precision.frozen import FrozenQuantizedLinear

    recipe = RECIPES[precision]
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    whole = FrozenQuantizedLinear(weight, None, recipe)
    sections = (128, 64, 64) if dim == 0 else (512,)
    for rank in range(2):
        shard = TPShard(None, rank, 2, dim, sections)
        part = FrozenQuantizedLinear(weight, None, recipe)
        part.tp_local(dim, shard.index(weight.device))
        index = shard.index(weight.device)
        w = whole.weight_operand("fprop", Emulated).dequantize().index_select(dim, index)
        wt = whole.weight_operand("dgrad", Emulated).dequantize().index_select(1 - dim, index)
        assert torch.equal(part.weight_operand("fprop", Emulated).dequantize(), w)
        assert torch.equal(part.weight_operand("dgrad", Emulated).dequantize(), wt)
        assert (part.out_features, part.in_features) == tuple(w.shape)


def _stored_bytes(precision: str, out: int, inp: int) -> int:
    """Bytes of one [out, in] weight stored as ``precision``'s codes and scales, from the formats' definitions:
    E4M3 codes 1 byte, E2M1 half a byte; FP8 tensorwise one FP32 scale (one copy for W and Wᵀ); MXFP8 one E8M0
    scale per 32 elements along each GEMM's reduction dim (two copies); NVFP4 one E4M3 scale per 16x16 tile
    and an FP32 global scale (one copy)."""
    n = out * inp
    return {"fp8-tensorwise": n + 4, "mxfp8": 2 * (n + n // 32), "nvfp4": n // 2 + n // 256 + 4}[precision]


@pytest.mark.parametrize("precision,per_element", [("fp8-tensorwise", 1.0), ("mxfp8", 2.0625), ("nvfp4", 0.504)])
def test_fsdp_gathers_a_stored_base_as_its_codes_and_scales(world2, precision, per_element):
    shapes = [(256, 128), (128, 128), (512, 128), (128, 256)] * MODEL.n_layers  # qkv, o, gate_up, down
    for result in world2:
        run = result[f"fsdp2-{precision}"]
        assert run["stored_elements"] == sum(o * i for o, i in shapes)
        base = run["gathered_bytes"] - run["block_float_bytes"]  # the blocks' floating parameters (FP32 on the CPU)
        assert base == sum(_stored_bytes(precision, o, i) for o, i in shapes)
        assert base / run["stored_elements"] == pytest.approx(per_element, rel=1e-3)  # BF16: 2


# --------------------------------------------------------------------------- whole runs (train loop)

RUN = RunConfig(model=MODEL.name, seq_len=64, mbs=2, gbs=4, steps=3, warmup_steps=1, device="cpu")
RUNS = {  # on 2 ranks; the reference: one process, the same micro-batches (GA = DP)
    "sft-fsdp": dict(workload="sft", precision="fp32", fsdp=True),
    "lora-fsdp-fp8": dict(workload="lora", precision="fp8-tensorwise", lora_base_storage="quantized", fsdp=True),
    "lora-tp2": dict(workload="lora", precision="fp32", tp=2, mbs=4),
}


def _train_worker(rank: int, world: int) -> dict:
    MODELS[MODEL.name] = MODEL
    import lpbench.train.loop as loop

    results = {}
    for name, kw in RUNS.items():
        r = loop.train(RUN.with_(**kw).with_world(world), log=lambda line: None)
        results[name] = {"status": r.status, "loss": [s["loss"] for s in r.steps], "metrics": r.metrics}
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_train_worker, 2, tmp_path_factory.mktemp("lora-train"), 2)


@pytest.mark.parametrize("name", list(RUNS))
def test_sft_and_lora_runs_on_two_ranks_train_like_one_process(trained, name):
    import lpbench.train.loop as loop

    kw = dict(RUNS[name])
    if kw.pop("tp", 1) == 1:
        kw["mbs"] = RUN.mbs  # DP 2: each rank one micro-batch; one process: both, in turn
    kw.pop("fsdp", None)
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setitem(MODELS, MODEL.name, MODEL)
        ref = loop.train(RUN.with_(**kw), log=lambda line: None)
    assert trained[0][name]["status"] == "ok" and ref.status == "ok"
    assert trained[0][name]["loss"] == pytest.approx([s["loss"] for s in ref.steps], rel=1e-5)
    if "lora" in name:  # only the adapters trained
        assert trained[0][name]["metrics"]["trainable_params"] == ref.metrics["trainable_params"]


# --------------------------------------------------------------------------- compiled, recomputed blocks under FSDP2


@pytest.mark.parametrize("precision", ["fp8-tensorwise", "nvfp4"])
def test_a_sharded_stored_base_keeps_its_compiled_recomputed_block_one_graph(precision):
    """FSDP2 shards a block and its stored base (uint8 codes and scales) as one unit, so its hooks run at the
    block's edges: the compiled, fully recomputed block runs forward and backward without a graph break (a unit of
    the codes alone, nested in the block, ran its hooks mid-block: Dynamo broke the graph there and the checkpoint
    ran eagerly), and under a BF16 parameter dtype the codes are gathered as the uint8 bytes they are."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lpbench.models import build_model
    from lpbench.models.decoder import rope_tables
    from lpbench.parallel.dp import apply_fsdp, one_rank_mesh
    from lpbench.parallel.env import shutdown
    from lpbench.parallel.recompute import apply_recompute
    from lpbench.precision.frozen import FrozenQuantizedLinear
    from lpbench.train.workload import prepare_model

    cpu = torch.device("cpu")
    model = build_model(MODEL, device=cpu, seed=0)
    prepare_model(
        model, BASE.with_(precision=precision), _recipe(precision), device=cpu, emulate=True, use_compile=True
    )
    apply_recompute(model, "full")
    for block in model.layers:
        block.compile(backend="aot_eager")  # Dynamo's graphs and AOT autograd's (checkpointing), as inductor sees them
    rope = rope_tables(MODEL, 16, cpu)
    x = torch.randn(2, 16, MODEL.dim, requires_grad=True)
    try:
        apply_fsdp(model, one_rank_mesh(cpu), torch.bfloat16, torch.float32)
        torch._dynamo.reset()
        counters.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.layers[1](model.layers[0](x, rope), rope)
        out.float().sum().backward()
        breaks = dict(counters["graph_break"])
        model.layers[0].unshard()
        stored = [p for m in model.layers[0].modules() if isinstance(m, FrozenQuantizedLinear) for p in m.parameters()]
        dtypes = {p.dtype for p in stored}
    finally:
        shutdown()
    assert breaks == {}
    assert dtypes == {torch.uint8} and x.grad is not None and torch.isfinite(x.grad).all()

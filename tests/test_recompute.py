"""Activation recomputation (``--recompute``): none, selective and full train bit for bit alike.

Each case trains a small decoder a few steps with and without recomputation and compares every loss,
every gradient and, for delayed scaling, every amax history and scale after the steps (a rerun that
recorded its amaxes again would advance the histories twice and cast with updated scales).
"""

import dataclasses

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.models import build_model
from lpbench.models.registry import ModelConfig
from lpbench.parallel.plan import compile_blocks
from lpbench.parallel.recompute import apply_recompute, checkpointed
from lpbench.precision.delayed import DelayedScaling, is_delayed_state
from lpbench.precision.formats import E4M3
from lpbench.precision.kernels.fp8_linear import producer_cast
from lpbench.precision.quantize import fp8_decode_scale
from lpbench.precision.recipes import get_recipe
from lpbench.train.workload import prepare_model

DENSE = ModelConfig("rc-dense", 2, 64, 128, 4, 2, 256, head_dim=16, max_seq_len=64)
DEEP = dataclasses.replace(DENSE, name="rc-deep", n_layers=6)
MOE = dataclasses.replace(DENSE, name="rc-moe", n_experts=4, top_k=2)
CPU = torch.device("cpu")


def _batches(n: int, vocab: int, seq: int = 32):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(n)]


def train(
    mode: str,
    precision: str,
    *,
    model_cfg=DENSE,
    workload="pretrain",
    compiled=False,
    steps=3,
    every=1,
    aux=0.0,
    device=CPU,
    seq=32,
    kept=None,
):
    """Losses, per-step gradients and the delayed-scaling state after ``steps`` steps (``kept``: a list that
    gets the CUDA memory each step's forward leaves allocated for its backward)."""
    torch.manual_seed(0)
    model = build_model(model_cfg, device=device, seed=0)
    cfg = RunConfig(model="tiny", precision=precision, workload=workload, device=device.type)
    recipe = get_recipe(precision)
    prepare_model(model, cfg, recipe, device=device, emulate=True, use_compile=compiled)
    if aux:
        from lpbench.models.moe import configure_moe

        configure_moe(model, aux_coeff=aux)
    blocks = apply_recompute(model, mode, every)
    assert blocks == (0 if mode == "none" else len(range(0, model_cfg.n_layers, every)))
    if compiled:  # as parallelize compiles: compiled code rounds where eager code rounds
        torch._inductor.config.emulate_precision_casts = True
        torch._dynamo.reset()
        compile_blocks(model, head=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], []
    for x in _batches(steps, model_cfg.vocab_size, seq):
        x = x.to(device)
        if kept is not None:
            before = torch.cuda.memory_allocated()
        with torch.autocast(device.type, dtype=recipe.compute_dtype, enabled=recipe.compute_dtype != torch.float32):
            loss = model(x, x.roll(-1, 1))
        if kept is not None:
            kept.append(torch.cuda.memory_allocated() - before)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {
        n: b.clone()
        for n, b in model.named_buffers()
        if is_delayed_state(n) or n.endswith(("tokens_per_expert", "loss_sums"))
    }
    return losses, grads, state


def assert_same(a, b):
    (la, ga, sa), (lb, gb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    for step, (x, y) in enumerate(zip(ga, gb)):
        for i, (p, q) in enumerate(zip(x, y)):
            assert torch.equal(p, q), f"step {step + 1}: gradient {i} differs by {(p - q).abs().max()}"
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("precision", ["bf16", "fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_trains_bit_for_bit_like_none(precision, mode):
    model_cfg = DEEP if precision == "nvfp4" else DENSE  # NVFP4 keeps the last 4 blocks in BF16
    assert_same(train(mode, precision, model_cfg=model_cfg), train("none", precision, model_cfg=model_cfg))


@pytest.mark.parametrize("workload", ["pretrain", "lora"])
@pytest.mark.parametrize(
    "precision", ["bf16", "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4"]
)
def test_a_compiled_recomputed_block_is_one_graph(precision, workload):
    """A graph break inside a checkpointed block makes torch.compile run the whole checkpoint eagerly (its
    elementwise work as separate kernels, its casts unfused): every recipe's block, with LoRA over a base stored
    quantized too, traces to one graph under full recomputation, as ``train`` compiles it."""
    import torch._dynamo

    from lpbench.models.decoder import rope_tables

    model = build_model(DENSE, device=CPU, seed=0)
    storage = "quantized" if workload == "lora" and precision != "bf16" else "bf16"
    cfg = RunConfig(model="tiny", precision=precision, workload=workload, lora_base_storage=storage, device="cpu")
    prepare_model(model, cfg, get_recipe(precision), device=CPU, emulate=True, use_compile=True)
    apply_recompute(model, "full")
    rope = rope_tables(DENSE, 32, CPU)
    torch._dynamo.reset()

    def block(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model.layers[0](x, rope)

    explained = torch._dynamo.explain(block)(torch.randn(2, 32, DENSE.dim, requires_grad=True))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_delayed_histories_advance_once_per_step():
    """The state check of the test above can fail: a history written twice per step differs from once."""
    _, _, state = train("full", "fp8-delayed", steps=2)
    history = state["layers.0.attn.qkv.amax_history_input"]
    assert (history != 0).sum() == 2  # two forwards: two amaxes, not four


def test_every_kth_block_and_lora_and_moe():
    assert_same(train("full", "fp8-delayed", every=2), train("none", "fp8-delayed"))
    assert_same(train("full", "fp8-delayed", workload="lora"), train("none", "fp8-delayed", workload="lora"))
    moe = dict(model_cfg=MOE, aux=0.01)
    assert_same(train("selective", "fp8-delayed", **moe), train("none", "fp8-delayed", **moe))
    assert_same(train("full", "bf16", **moe), train("none", "bf16", **moe))


def test_compiled_moe_blocks_recompute_eagerly_and_exactly():
    """MoE routing breaks a compiled block's graph, which a compiled checkpoint cannot hold: checkpointed MoE
    blocks run eagerly, bit for bit as eager blocks without recomputation."""
    moe = dict(model_cfg=MOE, steps=2)
    assert_same(train("full", "fp8-delayed", compiled=True, **moe), train("none", "fp8-delayed", **moe))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_compiled_recomputation_trains_like_none(mode):
    """Compiled, the checkpointed block is another graph, whose backward inductor fuses differently: losses
    and delayed scaling's state stay bit for bit, gradients agree up to FP32 summation order."""
    (la, ga, sa), (lb, gb, sb) = (train(m, "fp8-delayed", compiled=True, steps=2) for m in (mode, "none"))
    assert all(torch.equal(x, y) for x, y in zip(la, lb)), (la, lb)
    assert all(torch.equal(sa[n], sb[n]) for n in sa) and sa.keys() == sb.keys()
    for x, y in zip(ga, gb):
        for p, q in zip(x, y):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class CastThenRecord(DelayedScaling, torch.nn.Module):
    """The compiled fused FP8 linear's order of reads and writes (``kernels/fp8_linear.py``), in CPU ops: the input
    cast with the scale as it stands (``cast_scale``), then its amax recorded and the scale updated in place (the
    update returns the encode scale the cast used), then a GEMM whose weight gradient reads the codes."""

    def __init__(self):
        super().__init__()
        self.recipe = get_recipe("fp8-delayed")
        self._init_histories(CPU, roles=("input",))
        self.weight = torch.nn.Parameter(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 0.1)

    def reduce_amax(self, role, amax):
        return amax

    def forward(self, x):
        q, rows = producer_cast(x.detach(), self.cast_scale("input"), E4M3)
        amax = rows.amax()
        enc = self.record_amax("input", amax)
        return (q.float() * fp8_decode_scale(enc, amax)) @ self.weight.t()


def _cast_then_record(mode: str, compiled: bool, steps: int = 3):
    mod = CastThenRecord()
    forward = mod.forward if mode == "none" else checkpointed(mod.forward, mode)
    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(forward, fullgraph=True)
    out = []
    for step in range(steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)) * 4.0**step
        loss = forward(x).square().mean()
        loss.backward()
        out.append((loss.detach(), mod.weight.grad.clone(), mod.delayed_scale_input.clone()))
        mod.weight.grad = None
    return out + [mod.amax_history_input.clone()]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_compiled_casts_with_the_scale_the_forward_read(mode):
    """A compiled cast that reads delayed scaling's scale buffer, which the update then changes in place: the backward
    that recomputes the cast (recomputation, or inductor's own rematerialization without it) must cast with the
    scale the forward read, not the updated one. Compiled none, selective and full equal eager none bit for bit.
    (AOTAutograd saves the mutated buffer for the backward by reference; the cast reads it through an opaque copy,
    ``kernels/fp8.py: scale_copy``, whose output is saved.)"""
    eager = _cast_then_record("none", compiled=False)
    compiled = _cast_then_record(mode, compiled=True)
    for step, (a, b) in enumerate(zip(eager[:-1], compiled[:-1])):
        for name, x, y in zip(("loss", "weight grad", "scale"), a, b):
            assert torch.equal(x, y), (step, name, (x - y).abs().max())
    assert torch.equal(eager[-1], compiled[-1])


def test_quantized_wgrad_copies_are_saved_tensors():
    """Recomputation frees and recomputes what autograd saves: the quantized copies of a linear's input that
    its weight gradient reads must be saved tensors, not held on the autograd context (where a checkpointed
    block would keep them for the whole step)."""
    from lpbench.precision.linear import QuantizedLinear

    for precision, kind in (("fp8-tensorwise", torch.float8_e4m3fn), ("mxfp8", torch.float8_e4m3fn)):
        lin = QuantizedLinear(64, 32, recipe=get_recipe(precision))
        x = torch.randn(16, 64, requires_grad=True)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = lin(x)
        assert any(t is not None and t.dtype == kind and t.shape[0] == 64 for t in packed), precision
        y.sum().backward()
        assert lin.weight.grad is not None


def test_bad_recompute_values_are_usage_errors():
    with pytest.raises(UsageError, match="--recompute"):
        RunConfig(recompute="some").validate()
    with pytest.raises(UsageError, match="--recompute-every"):
        RunConfig(recompute="full", recompute_every=0).validate()
    assert RunConfig().key() == RunConfig(recompute="none").key() != RunConfig(recompute="full").key()


RUN = RunConfig(
    model="tiny", num_layers=2, seq_len=32, mbs=2, gbs=8, steps=3, warmup_steps=1, device="cpu", precision="fp8-delayed"
)
# DDP with gradient accumulation (the weight cache); TP with sequence parallelism (amaxes all-reduced in the rerun)
LAYOUTS = {"fsdp": dict(fsdp=True), "ddp-ga": dict(mbs=2, gbs=8), "tp": dict(tp=2, mbs=4, gbs=8)}


def _worker(rank: int) -> dict:
    import lpbench.train.loop as loop

    runs = {}
    for name, kw in LAYOUTS.items():
        for mode in ("none", "full", "selective"):
            r = loop.train(RUN.with_(**kw, recompute=mode).with_world(2), log=lambda line: None)
            runs[f"{name}-{mode}"] = [[s["loss"], s["grad_norm"]] for s in r.steps] + [r.status]
    return runs


def test_recomputation_under_fsdp_ddp_and_tp_trains_bit_for_bit_like_none(tmp_path, spawn_ranks):
    """Two ranks (gloo), fp8-delayed: FSDP, DDP with gradient accumulation (the weight cache) and TP: every loss and
    gradient norm of full and selective recomputation equals that of none exactly."""
    runs = spawn_ranks(_worker, 2, tmp_path)[0]
    for name in LAYOUTS:
        assert runs[f"{name}-none"][-1] == "ok"
        assert runs[f"{name}-full"] == runs[f"{name}-none"], name
        assert runs[f"{name}-selective"] == runs[f"{name}-none"], name


GPU_MODEL = dataclasses.replace(DEEP, dim=256, ffn_dim=768, vocab_size=1024, max_seq_len=1024)


def train_cuda(mode: str, precision: str, compiled: bool):
    """``train`` on CUDA with the GPU's kernels (fused FP8 linear, fused NVFP4 quantizer), native where the GPU
    runs the recipe; and what the last step's forward kept for its backward."""
    kept = []
    run = train(
        mode, precision, model_cfg=GPU_MODEL, compiled=compiled, device=torch.device("cuda"), seq=1024, kept=kept
    )
    return run, kept[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8-tensorwise", "fp8-delayed", "nvfp4"])
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_recomputation_is_exact_and_saves_memory(precision, compiled):
    """On a GPU (fused FP8 linear, fused NVFP4 quantizer with stochastic rounding): eager, none, selective and
        full train bit for bit alike; compiled, losses and delayed scaling's state do and gradients agree to
        summation order. What the forward keeps for the backward: full < selective < none. (Not the peak: in a
    model this small the backward's transients, not the saved activations, set it.)"""
    (ref, kept_none) = train_cuda("none", precision, compiled)
    kept = {}
    for mode in ("selective", "full"):
        run, kept[mode] = train_cuda(mode, precision, compiled)
        if compiled:
            assert all(torch.equal(x, y) for x, y in zip(run[0], ref[0]))
            assert all(torch.equal(run[2][n], ref[2][n]) for n in ref[2])
            for x, y in zip(run[1], ref[1]):
                for p, q in zip(x, y):
                    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        else:
            assert_same(run, ref)
    assert kept["full"] < kept["selective"] < kept_none, (kept, kept_none)

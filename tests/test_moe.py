"""MoE: grouped expert GEMMs == the per-expert loop (outputs and gradients) for every recipe, routing, losses."""

import dataclasses
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from lpbench.convert.quantize import quantize_experts

from lpbench.models.moe import MoE, load_balancing_loss, route, z_loss
from lpbench.models.registry import ModelConfig
from lpbench import gemm
from lpbench.precision import grouped
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.quantize import quantize_fp8
from lpbench.precision.recipes import RECIPES, get_recipe

CFG = ModelConfig("moe-test", 1, 32, 64, 2, 2, 64, n_experts=4, top_k=2)


def loop_reference(moe: MoE, x: torch.Tensor, recipe=None) -> torch.Tensor:
    """The per-expert loop: each expert's tokens (in token order) through dense linears of its weights
    (a QuantizedLinear of the recipe, or F.linear in the autocast dtype), gated, summed in expert order."""
    x2 = x.reshape(-1, x.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        weights, chosen, _ = route(
            F.linear(x2.float(), moe.router.weight.float()), moe.top_k, moe.router_kind, moe.norm_topk
        )
    exp = moe.experts
    out = torch.zeros_like(x2)
    for e in range(moe.n_experts):
        token, slot = (chosen == e).nonzero(as_tuple=True)
        if not token.numel():
            continue
        xe = x2[token].to(torch.bfloat16)

        def lin(name):
            w = getattr(exp, name)[e]
            if recipe is None or not recipe.quantized:  # the dense Linear's GEMM (its CPU route included)
                return lambda t: gemm.linear(t, w.to(t.dtype))
            q = QuantizedLinear(w.shape[1], w.shape[0], bias=False, recipe=recipe, device="meta")
            q._init_histories("cpu")
            return lambda t: q._linear(t, w, None)

        gate, up = lin("gate_up")(xe).chunk(2, dim=-1)
        ye = lin("down")(F.silu(gate) * up)
        out.index_add_(0, token, ye * weights[token, slot, None].to(x2.dtype))
    return out.reshape(x.shape)


def _moe(seed=0, **kw):
    torch.manual_seed(seed)
    moe = MoE(dataclasses.replace(CFG, **kw))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def _compare(moe, recipe, x):
    if recipe.quantized:
        quantize_experts(moe.experts, recipe, native=False)
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = moe(xa)
        yb = loop_reference(moe, xb, recipe)
    torch.manual_seed(1)
    dy = torch.randn_like(ya)
    ga = torch.autograd.grad(ya, [xa, moe.experts.gate_up, moe.experts.down], dy)
    gb = torch.autograd.grad(yb, [xb, moe.experts.gate_up, moe.experts.down], dy)
    assert torch.equal(ya, yb)
    for a, b in zip(ga, gb):
        assert torch.equal(a, b)


@pytest.mark.parametrize("counts", [[70, 0, 200, 33, 5], [0, 0, 300, 0], [1] * 9])
def test_groups_layout(counts):
    """Every item lands in its group's rows; groups start at multiples of ALIGN, in order, each taking its items'
    count padded to the next ALIGN; the buffer's rows a multiple of ROWS_ALIGN that holds any split of the items
    (the padded total is at most items + groups x ALIGN); every row knows its group (padding: the group before)."""
    group = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    groups, dest = grouped.Groups.of(group, len(counts))
    assert groups.counts.tolist() == counts
    padded = [-(-c // grouped.ALIGN) * grouped.ALIGN for c in counts]
    assert groups.offs.tolist() == torch.tensor(padded).cumsum(0).tolist()
    assert groups.starts.tolist() == [o - p for o, p in zip(groups.offs.tolist(), padded)]
    assert groups.rows % grouped.ROWS_ALIGN == 0 and groups.rows >= sum(counts) + len(counts) * grouped.ALIGN
    assert dest.tolist() == [s + i for s, c in zip(groups.starts.tolist(), counts) for i in range(c)]
    ends = groups.offs.tolist()
    assert groups.row_group.tolist() == [min(sum(r >= e for e in ends), len(counts) - 1) for r in range(groups.rows)]


@pytest.mark.parametrize("blocks", [[[3, 0, 5], [2, 7, 0]], [[0, 0], [0, 4]], [[40, 1, 0, 17]]])
def test_groups_of_blocks_places_items_as_a_stable_sort_would(blocks):
    """Items arriving in blocks (block (s, g): ``blocks[s][g]`` items of group g, row-major, as an all-to-all delivers
    each rank's rows sorted by group) get the layout and rows that stably sorting them by group gives."""
    b = torch.tensor(blocks)
    group = torch.repeat_interleave(torch.arange(b.shape[1]).repeat(b.shape[0]), b.flatten())
    order = group.argsort(stable=True)
    want, want_dest = grouped.Groups.of(group[order], b.shape[1])
    got, dest = grouped.Groups.of_blocks(b, group.numel())
    for field in ("counts", "starts", "offs", "row_group"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.rows == want.rows
    assert torch.equal(dest[order], want_dest)  # item order[i] lands where the sort put it


QUANTIZED = [n for n, r in RECIPES.items() if r.quantized]
CASES = ("random", "idle-experts", "one-expert")


def _case_moe(case: str, recipe):
    """A tiny MoE whose dims fit the recipe's block, and inputs that route as ``case`` says."""
    width = max(32, recipe.block or 0)
    moe = _moe(dim=width, ffn_dim=width, top_k=1 if case == "one-expert" else 2)
    x = torch.randn(2, 24, width)
    if case != "random":  # positive inputs; experts 1 (and 2) win every token, 0 and 3 get none
        x = x.abs()
        w = moe.router.weight.data
        w[0], w[1], w[2] = -1.0, 1.0, 0.5
        w[3] = w[3] * 0.01
    return moe, x


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("recipe", ["bf16", *QUANTIZED, "nvfp4-no-sr"])
def test_grouped_equals_loop(recipe, case):
    r = get_recipe(recipe)
    if r.stochastic_grads:
        pytest.skip("stochastic rounding draws in another order; nvfp4-no-sr covers the rest of nvfp4")
    moe, x = _case_moe(case, r)
    with torch.no_grad():
        _, chosen, _ = route(F.linear(x.reshape(-1, x.shape[-1]), moe.router.weight), moe.top_k, "mixtral")
    used = set(chosen.unique().tolist())
    assert used == ({1} if case == "one-expert" else {1, 2} if case == "idle-experts" else used)
    _compare(moe, r, x)


def _scaled_grouped_mm_on_cpu(calls):
    """``torch._scaled_grouped_mm`` (CUDA only) as FP32 products of the codes, recording ``use_fast_accum``."""

    def mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        ends = offs.tolist()
        bounds = list(zip([0, *ends[:-1]], ends))
        if b.dim() == 3:  # [rows, K] x [E, K, N]: each group's rows by its expert
            out = torch.zeros(a.shape[0], b.shape[2])
            for e, (s, t) in enumerate(bounds):
                out[s:t] = a[s:t].float() @ b[e].float() * scale_a[s:t, None] * scale_b[e][None, :]
            return out.to(out_dtype)
        n, k = a.shape[0], b.shape[1]  # [N, rows] x [rows, K]: each expert reduces over its rows
        return torch.stack(
            [
                a[:, s:t].float()
                @ b[s:t].float()
                * scale_a[e * n : (e + 1) * n, None]
                * scale_b[e * k : (e + 1) * k][None, :]
                for e, (s, t) in enumerate(bounds)
            ]
        ).to(out_dtype)

    return mm


@pytest.mark.parametrize("name, grads_fast", [("fp8-rowwise", False), ("fp8-rowwise-fast-grads", True)])
def test_grouped_fp8_asks_for_the_recipes_accumulation_mode(monkeypatch, name, grads_fast):
    """The native grouped GEMMs run fprop in fast accumulation and dgrad/wgrad as ``fast_accum_grads`` says;
    fp8-rowwise-fast-grads emulates as fp8-rowwise bit for bit, and the native GEMMs agree with the emulation."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_on_cpu(calls), raising=False)
    recipe = get_recipe(name)
    moe, x = _case_moe("idle-experts", recipe)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))

    def run(r, native):
        quantize_experts(moe.experts, r, native=native)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(xi)
        return [
            y.float(),
            *(g.float() for g in torch.autograd.grad(y, [xi, moe.experts.gate_up, moe.experts.down], dy.to(y.dtype))),
        ]

    native = run(recipe, True)
    # forward: gate_up, down; backward: down's dgrad and wgrad, then gate_up's
    assert calls == [True, True] + [grads_fast] * 4
    emulated, rowwise = run(recipe, False), run(get_recipe("fp8-rowwise"), False)
    assert len(calls) == 6 and all(torch.equal(a, b) for a, b in zip(emulated, rowwise))
    assert all((a - b).norm() / b.norm() < 1e-2 for a, b in zip(native, emulated))


def _traceable_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum=False):
    """``torch._scaled_grouped_mm``'s shapes, for tracing on a CPU (which has no grouped FP8 GEMM)."""
    if b.dim() == 3:
        return (a.float() @ b[0].float() * scale_a[:, None]).to(out_dtype)
    return (a.float() @ b.float()).expand(offs.shape[0], -1, -1).to(out_dtype)


def _explain_native_fp8_layer(monkeypatch, moe: MoE | None = None):
    """torch._dynamo.explain of a native fp8-rowwise MoE layer's forward (``moe``: the layer, else a tiny one)."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _traceable_scaled_grouped_mm, raising=False)
    case, x = _case_moe("random", get_recipe("fp8-rowwise"))
    moe = moe or case
    quantize_experts(moe.experts, get_recipe("fp8-rowwise"), native=True)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe(x)

    torch._dynamo.reset()
    return torch._dynamo.explain(step)(x.requires_grad_())


def test_native_grouped_fp8_compiles_without_graph_breaks(monkeypatch):
    """Routing, the FP8 casts and the grouped GEMMs of a native MoE layer are one graph: a break inside the autograd
    Function (once a cached_property's lock on Python 3.11) would run its casts eagerly, op by op."""
    explained = _explain_native_fp8_layer(monkeypatch)
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]


def _explain_expert_parallel_layer(monkeypatch, chunks: int):
    """:func:`_explain_native_fp8_layer` of a layer under expert parallelism over one rank's gloo group (the
    exchanges are the identity), its local experts exchanged in ``chunks`` groups."""
    import torch.distributed as dist
    from torch.distributed import HashStore

    from lpbench.parallel.ep import ExpertParallel

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        moe = _case_moe("random", get_recipe("fp8-rowwise"))[0]
        moe.ep = ExpertParallel(dist.group.WORLD, 1, 0, moe.n_experts, chunks=chunks, experts=moe.experts)
        moe.count_group = dist.group.WORLD
        explained = _explain_native_fp8_layer(monkeypatch, moe)
        assert moe.ep.chunked() == (chunks > 1)
    finally:
        dist.destroy_process_group()
    assert all("ExpertParallel." in b.reason or "disable()" in b.reason for b in explained.break_reasons), [
        b.reason.splitlines()[0] for b in explained.break_reasons
    ]
    return explained


def _expert_graphs(explained) -> int:
    """How many of the explained graphs run the experts' grouped FP8 GEMMs (their autograd Function)."""
    return sum(
        any(n.target is torch.ops.higher_order.autograd_function_apply for n in g.graph.nodes) for g in explained.graphs
    )


def test_expert_parallel_breaks_the_graph_only_at_its_two_exchanges(monkeypatch):
    """Under expert parallelism the layer's graph breaks at the dispatch and the combine (their split sizes are host
    values) and nowhere else: the load-balancing count's all-reduce and the experts between the exchanges (the
    buffer, the FP8 casts, the grouped GEMMs) stay compiled instead of running eagerly, op by op."""
    explained = _explain_expert_parallel_layer(monkeypatch, chunks=1)
    # a break inside a nested call is reported once per frame it breaks: the exchanges' names, nothing else
    at = {
        name
        for b in explained.break_reasons
        for name in ("dispatch", "combine")
        if f"ExpertParallel.{name}" in b.reason
    }
    assert at == {"dispatch", "combine"} and explained.graph_break_count >= 2
    assert all("ExpertParallel." in b.reason for b in explained.break_reasons)
    assert _expert_graphs(explained) == 1


def test_chunked_exchange_compiles_each_groups_experts(monkeypatch):
    """``--ep-chunks 2``: torch.compile skips the chunked exchange's loop but not the experts it calls, so each
    group's buffer, FP8 casts and grouped GEMMs run as a compiled graph (a recursively skipped exchange ran them
    eagerly, op by op)."""
    explained = _explain_expert_parallel_layer(monkeypatch, chunks=2)
    assert _expert_graphs(explained) >= 1


def _stacked_weights(shape, seed=0):
    """Expert weights spanning 60 binades across rows, a zero row and an all-zero expert (scale 1)."""
    E, N, K = shape
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-30, 30, N)[None, :, None]
    w[1, 3] = 0.0
    w[2] = 0.0
    return w


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _same_codes(got, want) -> bool:
    return all(
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(_bits(a).cpu(), _bits(b).cpu())
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("name", ["fp8-rowwise", "fp8-tensorwise"])
@pytest.mark.parametrize("shape", [(4, 64, 32), (4, 32, 96)])
def test_weight_codes_are_each_experts_dense_quantization(name, shape):
    """:func:`grouped.weight_codes` gives, bit for bit, each expert's weight as the dense quantizer gives it:
    forward codes of w_e, data-gradient codes of w_eᵀ, with their decode scales."""
    r = get_recipe(name)
    fprop, dgrad = r.operand("weight", "fprop"), r.operand("weight", "dgrad")
    w = _stacked_weights(shape)
    wq, sw, wtq, swt = grouped.weight_codes(w, r)
    for e in range(shape[0]):
        ref = quantize_fp8(w[e], fprop.fmt, fprop.block, pow2=fprop.pow2)
        ref_t = quantize_fp8(w[e].t(), dgrad.fmt, dgrad.block, pow2=dgrad.pow2)
        assert torch.equal(_bits(wq[e]), _bits(ref.codes))
        assert torch.equal(sw[e], ref.scale.reshape(-1).expand(shape[1]))
        assert torch.equal(_bits(wtq[e]), _bits(ref_t.codes))
        assert torch.equal(swt[e], ref_t.scale.reshape(-1).expand(shape[2]))
    assert wtq.is_contiguous() and (sw[2] == 1).all()


def test_weight_codes_compile_once_per_weight_shape():
    """Static shapes, and recipes with the same weight quantization share a graph: an expert stack's two weight
    shapes compile two graphs, whichever of fp8-rowwise / fp8-rowwise-fast-grads asks."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(grouped._codes, backend=counter, dynamic=False, fullgraph=True)
    torch._dynamo.reset()
    for name in ("fp8-rowwise", "fp8-rowwise-fast-grads"):
        r = get_recipe(name)
        for shape in ((4, 64, 32), (4, 32, 64), (4, 64, 32)):
            compiled(_stacked_weights(shape), r.operand("weight", "fprop"), r.operand("weight", "dgrad"))
    assert counter.frame_count == 2


_CXX = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler"
)


_CPU_CASES = [(n, "cpu", s) for n in ("fp8-rowwise", "fp8-tensorwise") for s in ((4, 64, 32), (4, 32, 96))]
_CUDA_CASES = [
    ("fp8-rowwise", "cuda", (8, 768, 2048)),
    ("fp8-rowwise", "cuda", (8, 2048, 768)),
    ("fp8-tensorwise", "cuda", (8, 768, 2048)),
]


@pytest.mark.parametrize(
    "name, device, shape",
    [
        *(pytest.param(*c, marks=_CXX) for c in _CPU_CASES),
        *(pytest.param(*c, marks=pytest.mark.gpu) for c in _CUDA_CASES),
    ],
)
def test_compiled_weight_codes_are_the_eager_ones(name, device, shape):
    """The graph that :func:`grouped.weight_codes` compiles on CUDA for the weight cache (inductor's Triton kernels
    there, its C++ here) gives the eager ops' codes and scales bit for bit, in the same layouts."""
    r = get_recipe(name)
    w = _stacked_weights(shape, seed=3)
    want = grouped.weight_codes(w, r)  # eager on the CPU
    torch._dynamo.reset()
    got = grouped._compiled_codes(w.to(device), r.operand("weight", "fprop"), r.operand("weight", "dgrad"))
    assert _same_codes(got, want)
    if device == "cuda":  # the cache's call compiles there
        assert _same_codes(grouped.weight_codes(w.cuda(), r), want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cached_weight_codes_give_the_uncached_numbers(monkeypatch, device):
    """Gradient accumulation: FP8 grouped experts quantize each weight once (convert/weight_cache.py); the codes
    are those of the uncached call, bit for bit, reused until the weight changes (in place here). On CUDA with
    the native grouped GEMMs."""
    import copy

    from lpbench.convert import weight_cache

    r = get_recipe("fp8-rowwise")
    moe, x = _case_moe("random", r)
    moe, x = moe.to(device), x.to(device)
    quantize_experts(moe.experts, r, native=device == "cuda")
    plain = copy.deepcopy(moe)
    made = []
    monkeypatch.setattr(
        weight_cache, "weight_codes", lambda w, recipe, split: made.append(w) or quantize(w, recipe, split)
    )
    quantize = grouped.weight_codes
    dy = torch.randn(*x.shape[:-1], x.shape[-1], generator=torch.Generator().manual_seed(1)).to(device)

    def run(m):
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = m(xi)
        return [y, *torch.autograd.grad(y, [xi, m.experts.gate_up, m.experts.down], dy.to(y.dtype))]

    def same(a, b):
        return all(torch.equal(s, t) for s, t in zip(a, b))

    assert weight_cache.install(moe, torch.optim.AdamW(moe.parameters())) is not None
    uncached = run(plain)
    first, second = run(moe), run(moe)
    assert set(moe.experts.gemm.codes) == {"gate_up", "down"} and len(made) == 2
    assert same(first, uncached) and same(second, uncached)
    with torch.no_grad():
        for m in (moe, plain):
            m.experts.down.mul_(1.5)
    changed = run(moe)
    assert len(made) == 3 and same(changed, run(plain)) and not torch.equal(changed[0], first[0])


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [8, 32])
@pytest.mark.parametrize("name", ["fp8-rowwise", "fp8-rowwise-fast-grads"])
def test_native_grouped_fp8_matches_the_emulation_on_cuda(monkeypatch, name, experts):
    """The native grouped GEMMs (fast accumulation where the recipe asks) against the emulated grouped GEMMs that the
    CPU tests prove equal to the per-expert loop: the same codes, other accumulation and BF16 roundings.
    fp8-rowwise's precise gradient GEMMs of these small experts run lpbench's kernel (kernels/grouped_mm.py; compiled
    in test_grouped_fp8_with_the_group_amax_kernel_is_bit_identical), fast accumulation torch's."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs the grouped FP8 GEMM (compute capability 9.0)")
    from lpbench.precision.kernels import grouped_mm

    ours, real = [], grouped_mm.grouped_mm
    monkeypatch.setattr(grouped_mm, "grouped_mm", lambda *a: ours.append(a[1].dim()) or real(*a))
    cfg = dataclasses.replace(CFG, dim=256, ffn_dim=512, n_experts=experts, top_k=2)
    x = torch.randn(4, 500, 256, generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for native in (True, False):
        torch.manual_seed(1)
        moe = MoE(cfg).cuda()
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        quantize_experts(moe.experts, get_recipe(name), native=native)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = moe(xi)
        y.float().square().sum().backward()
        results.append([y.float(), xi.grad.float(), moe.experts.gate_up.grad, moe.experts.down.grad])
    for a, b in zip(*results):
        assert (a - b).norm() / b.norm() < 5e-2
    assert ours == ([3, 2, 3, 2] if name == "fp8-rowwise" else []), ours  # down's dgrad and wgrad, then gate_up's


def test_gradient_accumulation_trains_the_same_with_cached_weight_codes(monkeypatch):
    import lpbench.train.loop as loop
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS
    from lpbench.convert import weight_cache

    monkeypatch.setitem(MODELS, "moe-test", dataclasses.replace(CFG, n_layers=2, max_seq_len=64))
    cfg = RunConfig(
        model="moe-test", precision="fp8-rowwise", seq_len=16, mbs=1, gbs=2, steps=3, warmup_steps=1, device="cpu"
    )
    made = []
    quantize = grouped.weight_codes
    monkeypatch.setattr(
        weight_cache, "weight_codes", lambda w, recipe, split: made.append(w) or quantize(w, recipe, split)
    )
    cached = loop.train(cfg, log=lambda line: None)
    assert len(made) == 3 * 2 * 2  # steps x layers x weights: once per optimizer step
    monkeypatch.setattr(weight_cache, "install", lambda model, optimizer, bf16: None)
    uncached = loop.train(cfg, log=lambda line: None)
    assert [s["loss"] for s in cached.steps] == [s["loss"] for s in uncached.steps]
    assert [s["grad_norm"] for s in cached.steps] == [s["grad_norm"] for s in uncached.steps]


def test_routing_mixtral_and_qwen3():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.5, 0.25]])
    w_mix, c_mix, probs = route(logits, 2, "mixtral")
    assert c_mix.tolist() == [[0, 1], [1, 2]]
    e = math.exp(1.0)
    assert torch.allclose(w_mix[0], torch.tensor([e / (e + 1), 1 / (e + 1)]))
    w_q, c_q, _ = route(logits, 2, "qwen3")
    assert torch.equal(c_q, c_mix) and torch.allclose(w_q, w_mix)  # normalised top-k == softmax of top-k logits
    w_raw, _, _ = route(logits, 2, "qwen3", norm_topk=False)
    assert torch.allclose(w_raw, probs.gather(1, c_q)) and (w_raw.sum(1) < 1).all()


def test_aux_and_z_loss_by_hand():
    # 2 tokens, 2 experts, top-1: token 0 -> expert 0 (p 0.75), token 1 -> expert 0 (p 0.5 / 0.5 tie -> 0)
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    _, chosen, probs = route(logits, 1, "mixtral")
    counts = torch.bincount(chosen.flatten(), minlength=2)
    assert counts.tolist() == [2, 0]
    # E * sum_e f_e * P_e = 2 * (1.0 * mean(0.75, 0.5) + 0 * mean(0.25, 0.5)) = 1.25
    assert load_balancing_loss(probs, counts).item() == pytest.approx(1.25)
    # mean of logsumexp^2: lse0 = log(4), lse1 = log(2)
    assert z_loss(logits).item() == pytest.approx((math.log(4) ** 2 + math.log(2) ** 2) / 2)


def test_aux_losses_reach_the_router_only_through_their_coefficients():
    """With coefficients, the router's gradient is that of output·dy + coeff_aux·aux + coeff_z·z (x 1/GA)."""
    from lpbench.models.moe import configure_moe

    moe = _moe()
    x = torch.randn(1, 16, 32)
    y = moe(x)
    g0 = torch.autograd.grad(y.sum(), moe.router.weight)[0]
    configure_moe(moe, aux_coeff=0.1, z_coeff=0.01, grad_scale=0.5)
    y = moe(x)
    assert torch.equal(y, moe(x))  # the output itself is unchanged
    g1 = torch.autograd.grad(y.sum(), moe.router.weight)[0]
    logits = F.linear(x.reshape(-1, 32), moe.router.weight)
    _, chosen, probs = route(logits, 2, "mixtral")
    counts = torch.bincount(chosen.flatten(), minlength=4)
    extra = 0.5 * (0.1 * load_balancing_loss(probs, counts) + 0.01 * z_loss(logits))
    g_extra = torch.autograd.grad(extra, moe.router.weight)[0]
    assert torch.allclose(g1, g0 + g_extra, atol=1e-6)


def test_training_logs_expert_load_and_counts_every_routed_token(monkeypatch):
    import lpbench.train.loop as loop
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS

    monkeypatch.setitem(MODELS, "moe-test", dataclasses.replace(CFG, n_layers=2, max_seq_len=64))
    cfg = RunConfig(
        model="moe-test",
        precision="fp32",
        seq_len=16,
        mbs=2,
        gbs=4,
        steps=2,
        warmup_steps=1,
        device="cpu",
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
    )
    lines = []
    result = loop.train(cfg, log=lines.append)
    assert result.status == "ok"
    moe_lines = [line for line in lines if line.startswith("moe | load_balancing_loss:")]
    assert len(moe_lines) == 2
    counts = result.metrics["tokens_per_expert"]
    assert len(counts) == 2 and all(sum(layer) == 2 * 4 * 16 * 2 for layer in counts)  # steps x GBS x seq x top-k
    assert all(s["moe_aux_loss"] >= 2 * 0.99 for s in result.steps)  # >= 1 per layer (1 = balanced), 2 layers


def test_bad_moe_flags_exit_2(capsys):
    from lpbench.cli import main

    assert main(["run", "--model", "mixtral-8x7b", "--ep", "3", "--steps", "2", "--warmup-steps", "1"]) == 2
    assert "--ep 3 must divide" in capsys.readouterr().err
    assert main(["run", "--model", "tiny", "--moe-aux-loss-coeff", "0.01"]) == 2
    assert "dense" in capsys.readouterr().err
    assert (
        main(
            [
                "run",
                "--model",
                "mixtral-8x7b",
                "--tp",
                "2",
                "--ep",
                "2",
                "--nproc-per-node",
                "4",
                "--gbs",
                "16",
                "--precision",
                "fp8-rowwise",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "--tp and --ep do not combine" in err and len(err.strip().splitlines()) == 1


# The weight-gradient operands' group amaxes in one Triton pass (kernels/fp8_group.py) against the torch ops
# (grouped._reference_amax): under Triton's interpreter on the CPU, and on CUDA with the codes too.
_INTERPRET = grouped.capability.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
_GROUP_CASES = ["random", "idle-experts", "one-expert", "non-finite", "single-rows"]


def _group_operand(case: str, cols: int, dtype, n_groups: int = 6, seed: int = 0):
    """A :class:`grouped.Groups` buffer [rows, cols] as the MoE layer fills it (each expert's tokens, zeros between
    and after), its row groups, and the tokens' expert ids: values spanning 40 binades across columns."""
    g = torch.Generator().manual_seed(seed)
    tokens = {"random": 300, "idle-experts": 200, "one-expert": 150, "non-finite": 260, "single-rows": 5}[case]
    if case == "random":
        expert = torch.randint(0, n_groups, (tokens,), generator=g)
    elif case == "idle-experts":  # experts 0, 2 and the last get nothing
        expert = torch.tensor([1, 3, 4])[torch.randint(0, 3, (tokens,), generator=g)]
    elif case == "one-expert":
        expert = torch.full((tokens,), 2)
    elif case == "single-rows":  # one token each for a few experts: every tile spans several
        expert = torch.tensor([0, 1, 3, 4, 5])
    else:
        expert = torch.randint(0, n_groups, (tokens,), generator=g)
    groups, dest = grouped.Groups.of(expert.sort().values, n_groups)
    vals = torch.randn(tokens, cols, generator=g) * torch.logspace(-20, 20, cols)[None, :]
    if case == "non-finite":  # +inf, -inf and NaN in some experts' columns; one whole column NaN
        vals[3, 5], vals[100, 7], vals[200, 9] = float("inf"), float("-inf"), float("nan")
        vals[:, cols - 1] = float("nan")
    buf = torch.zeros(groups.rows, cols)
    buf[dest] = vals
    return buf.to(dtype), groups


def _amax_by_expert(t: torch.Tensor, groups) -> torch.Tensor:
    """[E, C]: the amax of |t| over each expert's rows (its tokens and the padding after them; NaN if a NaN is
    among them, 0 for an expert without rows), from the definition."""
    mag = t.float().abs()
    return torch.stack(
        [
            mag[groups.row_group == e].amax(0) if (groups.row_group == e).any() else mag.new_zeros(mag.shape[1])
            for e in range(groups.counts.numel())
        ]
    )


def _same_amax(got, want) -> bool:
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.skipif(not _INTERPRET, reason="needs Triton and TRITON_INTERPRET=1 (the kernel on the CPU)")
@pytest.mark.parametrize("case", _GROUP_CASES)
@pytest.mark.parametrize(
    "cols, dtype, tile",
    [
        (300, torch.bfloat16, {}),
        (96, torch.float32, dict(rows=32, cols=64)),
        (130, torch.bfloat16, dict(rows=64, cols=64)),
    ],
)
def test_group_amax_kernel_is_the_reference_under_the_interpreter(case, cols, dtype, tile):
    """The one-pass group column amaxes equal the block maxima scattered by expert, bit for bit (NaN where a NaN is
    in the expert's column, inf where an inf is, 0 for experts without tokens), on shapes that are not tile
    multiples, with tiles spanning several experts; and the decode scales made from them are the reference's."""
    from lpbench.precision.kernels.fp8_group import column_blocks, launch_group_amax
    from lpbench.precision.quantize import fp8_decode_scale, fp8_encode_scale

    t, groups = _group_operand(case, cols, dtype)
    spec = get_recipe("fp8-rowwise").operand("grad", "wgrad")
    E = groups.counts.numel()
    want = _amax_by_expert(t, groups)
    bits = torch.zeros(E, cols, dtype=torch.int32)
    row_bits = torch.full(
        (column_blocks(cols, **{k: v for k, v in tile.items() if k == "cols"}), groups.rows), -1, dtype=torch.int32
    )  # every entry written: none keeps this
    launch_group_amax(lambda k: k, t, groups.row_group, bits, row_bits, grouped.ALIGN, **tile)
    got = bits.view(torch.float32)
    assert _same_amax(got, want)
    assert (row_bits >= 0).all()  # every column block wrote its row maxima
    assert _same_amax(row_bits.amax(0).view(torch.float32), t.float().abs().amax(1))
    only_groups = torch.zeros(E, cols, dtype=torch.int32)
    launch_group_amax(lambda k: k, t, groups.row_group, only_groups, None, grouped.ALIGN, **tile)
    assert torch.equal(only_groups, bits)
    assert (got[groups.counts == 0] == 0).all()
    if case == "non-finite":
        assert got.isnan().any() and got.isinf().any() and got[:, -1].isnan().sum() == (groups.counts > 0).sum()
    dec = fp8_decode_scale(fp8_encode_scale(got, spec.fmt), got)
    ref = fp8_decode_scale(fp8_encode_scale(want, spec.fmt), want)
    assert torch.equal(dec.isnan(), ref.isnan()) and torch.equal(dec[~ref.isnan()], ref[~ref.isnan()])


@pytest.mark.skipif(not _INTERPRET, reason="needs Triton and TRITON_INTERPRET=1 (the kernel on the CPU)")
@pytest.mark.parametrize("counts", [[70, 0, 200, 33, 5], [1, 300, 2]])
def test_fp8_weight_gradient_into_fp32_under_the_interpreter(counts):
    """The grouped kernel adding FP8 weight gradients into FP32 reads each expert's rows only, though its slices
    start at multiples of the block (experts start at multiples of 16: codes of the expert before fill the first
    slice's other rows and must be masked out); an expert without rows keeps what the buffer held."""
    from lpbench.precision.kernels import grouped_mm as gm

    g = torch.Generator().manual_seed(3)
    group = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    groups, _ = grouped.Groups.of(group, len(counts))
    E, M, N = len(counts), 48, 40
    a = (torch.randn(M, groups.rows, generator=g) * 8).to(torch.float8_e4m3fn)  # codes in every row, padding too
    b = (torch.randn(N, groups.rows, generator=g) * 8).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(E, M, generator=g) + 0.5, torch.rand(E, N, generator=g) + 0.5
    before = torch.randn(E, M, N, generator=g)
    out = before.clone()
    gm.launch(
        lambda k: k,
        a,
        b,
        sa.reshape(-1),
        sb.reshape(-1),
        groups.offs,
        out,
        False,
        accumulate=True,
        config=(32, 32, gm.PROMOTE, 4, 1),
    )
    for e, (s, end) in enumerate(zip(groups.starts.tolist(), groups.offs.tolist())):
        product = (a[:, s:end].float() @ b[:, s:end].float().t()) * sa[e][:, None] * sb[e][None, :]
        magnitude = (a[:, s:end].float().abs() @ b[:, s:end].float().abs().t()) * sa[e][:, None] * sb[e][None, :]
        assert ((out[e] - before[e] - product).abs() <= 1e-5 * (magnitude + before[e].abs()) + 1e-6).all()
        if end == s:
            assert torch.equal(out[e], before[e])


def _grad_operands(t, groups, device):
    r = get_recipe("fp8-rowwise")
    E = groups.counts.numel()
    gid = groups.row_group.to(device)
    dgrad, wgrad = grouped._grad_codes(
        t.to(device), r.operand("grad", "dgrad"), r.operand("grad", "wgrad"), gid, E, None
    )
    spec_x = r.operand("input", "wgrad")
    return [*dgrad, *wgrad, *grouped._group_codes_t(t.to(device), spec_x, gid, E, None)]


def _interpreted_group_cast(x, row_enc, group, group_enc, fmt):
    """:func:`fp8_group.group_cast` run by Triton's interpreter into FP32 buffers, then converted by torch: the
    interpreter's own FP32 -> FP8 conversion is not the GPU's (it rounds some values a step off and turns NaN into
    -256), so the kernel's scaled, saturated values are checked here and the conversion on CUDA."""
    from lpbench.precision.kernels.fp8_group import launch_group_cast

    m, n = x.shape
    q = torch.full((m, n) if row_enc is not None else (0,), 7.0)
    qt = torch.full((n, m), 7.0)
    launch_group_cast(
        lambda k: k,
        x.contiguous(),
        None if row_enc is None else row_enc.reshape(-1).contiguous(),
        group,
        group_enc.contiguous(),
        q,
        qt,
        fmt.max,
    )
    return q.to(fmt.dtype), qt.to(fmt.dtype)


@pytest.mark.skipif(not _INTERPRET, reason="needs Triton and TRITON_INTERPRET=1 (the kernel on the CPU)")
@pytest.mark.parametrize("case", _GROUP_CASES)
@pytest.mark.parametrize("cols, dtype", [(200, torch.bfloat16), (96, torch.float32)])
def test_group_cast_kernel_under_the_interpreter(monkeypatch, case, cols, dtype):
    """The output gradient's data- and weight-gradient operands and the input's weight-gradient operand through the
    Triton amaxes and cast (its values converted by torch, :func:`_interpreted_group_cast`) are the torch ops' codes
    and decode scales bit for bit, in the same layouts: idle experts, one expert, inf and NaN, tiles that span
    experts and shapes that are not tile multiples."""
    t, groups = _group_operand(case, cols, dtype)
    want = _grad_operands(t, groups, "cpu")
    monkeypatch.setattr(grouped.capability, "fp8_cast_kernel", lambda t: t.dim() == 2)
    monkeypatch.setattr(grouped, "group_cast", _interpreted_group_cast)
    got = _grad_operands(t, groups, "cpu")
    assert _same_codes([g for g in got if g.dtype.itemsize == 1], [w for w in want if w.dtype.itemsize == 1])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(_bits(a), _bits(b)) if a.dtype.itemsize == 1 else _same_amax(a, b)
    if case == "non-finite":
        assert got[0].float().isnan().any() and got[1].isnan().any() and got[3].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", _GROUP_CASES)
@pytest.mark.parametrize("cols, dtype", [(200, torch.bfloat16), (4096, torch.bfloat16), (96, torch.float32)])
def test_grad_operands_on_cuda_are_the_cpu_reference(case, cols, dtype):
    """The output gradient's and the input's weight-gradient operands on CUDA (the Triton amaxes and casts) are the
    CPU torch ops' codes and decode scales bit for bit, in the same layouts (the CPU reference propagates NaN;
    CUDA's ``scatter_reduce`` does not, so the CPU is the reference here; NaN codes may differ in sign); and the
    amaxes are the definition's."""
    from lpbench.precision.kernels.fp8_group import group_amax

    if grouped.capability.triton is None:
        pytest.skip("needs Triton")
    t, groups = _group_operand(case, cols, dtype)
    got, want = _grad_operands(t, groups, "cuda"), _grad_operands(t, groups, "cpu")
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        if a.dtype.itemsize == 1:  # NaN codes compare as NaN: the GPU's conversion drops a NaN's sign, torch's keeps it
            nan = b.float().isnan()
            assert torch.equal(a.float().isnan().cpu(), nan) and torch.equal(_bits(a).cpu()[~nan], _bits(b)[~nan])
        else:
            assert _same_amax(a.cpu(), b)
    E = groups.counts.numel()
    cols_amax, rows_amax = group_amax(t.cuda(), groups.row_group.cuda(), E, grouped.ALIGN, row_amax=True)
    assert _same_amax(cols_amax.cpu(), _amax_by_expert(t, groups))
    assert _same_amax(rows_amax.cpu(), t.float().abs().amax(1))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8-rowwise", "fp8-rowwise-fast-grads"])
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_fp8_with_the_group_amax_kernel_is_bit_identical(monkeypatch, precise_casts, name, compiled):
    """A native grouped FP8 MoE layer (forward and backward, eager and compiled) gives the same outputs and gradients
    bit for bit with the Triton group amaxes and casts as with the torch ops, routing that leaves experts idle
    included. Eagerly the kernels are seen to run; compiled, the layer is one graph (no break sends the Function
    back to eager), so its backward runs them (the interpreter cannot trace the ops: it has no fake launch)."""
    from torch._dynamo.utils import counters

    from lpbench.precision.kernels import fp8_group

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs the grouped FP8 GEMM (compute capability 9.0)")
    cfg = dataclasses.replace(CFG, dim=256, ffn_dim=512, n_experts=8, top_k=2)
    x = torch.randn(2, 700, 256, generator=torch.Generator().manual_seed(0)).cuda()
    torch.manual_seed(1)
    moe = MoE(cfg).cuda()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        moe.router.weight[5:] *= 0.01  # skewed routing: some experts get few or no tokens
    quantize_experts(moe.experts, get_recipe(name), native=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).cuda()

    def run(kernel: bool):
        monkeypatch.setattr(grouped.capability, "fp8_cast_kernel", fp8_cast_kernel if kernel else (lambda t: False))
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(moe) if compiled else moe
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xi)
        out = [y, *torch.autograd.grad(y, [xi, moe.experts.gate_up, moe.experts.down], dy.to(y.dtype))]
        assert not counters["graph_break"], dict(counters["graph_break"])
        return out

    fp8_cast_kernel = grouped.capability.fp8_cast_kernel
    calls = []
    if not compiled:  # a side effect in a traced backward would itself break the graph
        monkeypatch.setattr(grouped, "group_amax", lambda *a, **k: calls.append(1) or fp8_group.group_amax(*a, **k))
    without = run(False)  # first: a break that the kernels did not bring fails here
    with_kernel = run(True)
    assert compiled or len(calls) == 4  # per weight: the output gradient's amaxes, the input's
    assert all(torch.equal(a, b) for a, b in zip(with_kernel, without))


@pytest.mark.skipif(not _INTERPRET, reason="needs Triton and TRITON_INTERPRET=1 (the kernel on the CPU)")
@pytest.mark.parametrize("case", CASES)
def test_grouped_fp8_backward_with_the_kernels_under_the_interpreter(monkeypatch, case):
    """The grouped FP8 Function with the Triton amaxes and casts (run by the interpreter on the CPU, the casts'
    values converted by torch; the GEMMs emulated): outputs and gradients bit for bit those of the torch ops; the
    output gradient's row and group amaxes come from one call, the input's group amaxes from another."""
    from lpbench.precision.kernels import fp8_group

    recipe = get_recipe("fp8-rowwise")
    moe, x = _case_moe(case, recipe)
    quantize_experts(moe.experts, recipe, native=False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    calls = []

    def run(kernel: bool):
        monkeypatch.setattr(
            grouped.capability,
            "fp8_cast_kernel",
            (lambda t: t.dim() == 2 and t.dtype == torch.bfloat16) if kernel else (lambda t: False),
        )
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(xi)
        return [y, *torch.autograd.grad(y, [xi, moe.experts.gate_up, moe.experts.down], dy.to(y.dtype))]

    monkeypatch.setattr(
        grouped, "group_amax", lambda *a, **k: calls.append(k.get("row_amax", False)) or fp8_group.group_amax(*a, **k)
    )
    monkeypatch.setattr(grouped, "group_cast", _interpreted_group_cast)
    with_kernel, without = run(True), run(False)
    assert sorted(calls) == [False, False, True, True]  # per weight (down, gate_up): dy's both, x's group amaxes
    assert all(torch.equal(a, b) for a, b in zip(with_kernel, without, strict=True))

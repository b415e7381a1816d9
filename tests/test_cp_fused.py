"""Context parallelism and the fused paths: compiled blocks, flash attention, the FP8 SwiGLU epilogue.

CPU, gloo, CP 2: the K/V all-gather and the chunked attention (its lower-right ``CausalBias`` masks made outside
the block) trace into the block's one graph, with no graph break, as the block without CP does; with packed
SFT's document mask too. The compiled CP model's loss and gradients equal the unsplit eager model's up to FP32
summation order. CUDA: the compiled chunked attention runs flash attention; the FP8 linear's SwiGLU epilogue
kernel still casts gate_up's gradient, and the fused NVFP4 quantizer its round-to-nearest operands, when CP
holds part of the tokens (their amaxes all-reduced).
"""

import pytest
import torch
import torch.distributed as dist


def _compiled_run(rank: int, cp_size: int, docs: bool) -> dict:
    """Graphs and graph breaks Dynamo counted for a 2-block tiny model with compiled blocks (CP 2 or none), and
    its loss's and gradients' max relative error against the unsplit eager model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lpbench.models import build_model
    from lpbench.models.registry import ModelConfig
    from lpbench.parallel.cp import apply_cp
    from lpbench.parallel.plan import compile_blocks

    cfg = ModelConfig("test-two-blocks", 2, 64, 128, 4, 2, 256, rope_theta=10_000.0, max_seq_len=128)
    ref, model = (build_model(cfg, device="cpu", seed=0) for _ in range(2))
    cp = apply_cp(model, dist.group.WORLD, rank, cp_size) if cp_size > 1 else None
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(model, head=False)
    gen = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 256, (2, 64), generator=gen), torch.randint(0, 256, (2, 64), generator=gen)
    doc = (torch.arange(64) >= 23).long().expand(2, 64) + (torch.arange(64) >= 40).long()
    args = [ids, labels] + ([doc] if docs else [])
    whole = ref(*args)
    whole.backward()
    loss = model(*(args if cp is None else cp.shard(args)))
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    if cp is not None:  # each rank's loss is its share of the mean x CP size
        for t in [loss := loss.detach().clone(), *grads]:
            dist.all_reduce(t)
            t /= cp_size
    errors = [float((loss - whole).abs() / whole.abs())]
    errors += [float((g - p.grad).abs().max() / p.grad.abs().max()) for g, p in zip(grads, ref.parameters())]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "error": max(errors),
    }


def _worker(rank: int) -> dict:
    return {f"cp{n}-{docs}": _compiled_run(rank, n, docs) for n in (1, 2) for docs in (False, True)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("cp-compile"))


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_a_compiled_block_under_cp_has_the_graphs_it_has_without(world2, docs):
    for rank in world2:
        plain, split = rank[f"cp1-{docs}"], rank[f"cp2-{docs}"]
        assert split["breaks"] == plain["breaks"] == 0, (plain, split)
        assert split["graphs"] == plain["graphs"], (plain, split)
        assert split["error"] < 1e-5 and plain["error"] < 1e-5, (plain, split)  # FP32 summation order


@pytest.mark.gpu
def test_compiled_cp_attention_keeps_flash_attention_on_cuda():
    """On CUDA the compiled chunked attention (a group of one, the keys whole) traces with no graph break, runs
    flash attention's kernel (its bottom-right causal alignment) and equals causal SDPA, forward and backward."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from lpbench.parallel.cp import ContextParallel

    one = ContextParallel(None, 0, 1)
    one.positions(1024, "cuda")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1024, 128, generator=gen).cuda().bfloat16() for h in (32, 8, 8))
    torch._dynamo.reset()
    counters.clear()
    attend = torch.compile(lambda q, k, v: one.attention(q, k, v, True))
    results = []
    for fn in (
        attend,
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    ):
        fn(*(t.clone().requires_grad_() for t in (q, k, v))).float().sum().backward()  # compiled before profiling
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = fn(*leaves)
            out.float().sum().backward()
        results.append([out, *(t.grad for t in leaves)])
        if fn is attend:
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
            assert any("_scaled_dot_product_flash_attention" in e.name for e in prof.events())
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_swiglu_epilogue_kernel_runs_under_cp(precise_casts, monkeypatch, request, recipe, compiled):
    """A fused FP8 gate+up linear whose tokens are a CP share (a group of one: the all-reduced amax is the
    rank's own) still casts its gradient in SwiGLU's backward kernel, bit for bit with SwiGLU after the linear."""
    import torch._dynamo
    from torch.distributed import HashStore

    from lpbench.parallel.cp import ContextParallel
    from lpbench.precision.kernels import swiglu as sw
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
        request.addfinalizer(dist.destroy_process_group)
    calls = []
    for name in ("backward_amax", "backward_cast"):
        original = getattr(sw.Epilogue, name)
        monkeypatch.setattr(sw.Epilogue, name, staticmethod(lambda *a, f=original: calls.append(1) or f(*a)))
    runs = []
    for fused in (True, False):
        torch.manual_seed(0)
        mod = QuantizedLinear.from_linear(
            torch.nn.Linear(96, 400, bias=False, device="cuda"), get_recipe(recipe), native=True
        )
        mod.cp_shard = ContextParallel(dist.group.WORLD, 0, 1)
        fn = (lambda x: sw.swiglu_of(mod, x)) if fused else (lambda x: sw.swiglu(mod(x)))
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn)
        out = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = (torch.randn(2, 40, 96, generator=g) * 3).cuda().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            y.backward(torch.randn(y.shape, generator=g).to("cuda", y.dtype))
            out += [y.detach(), x.grad, mod.weight.grad.clone()]
            mod.weight.grad = None
        runs.append(out)
    assert calls  # the epilogue kernel cast the split gradient
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_the_fused_nvfp4_quantizer_runs_under_cp(monkeypatch, request):
    """An NVFP4 linear (round-to-nearest gradients) whose tokens are a CP share (a group of one) quantizes its
    input and gradient in the fused kernel with the all-reduced amaxes: bit for bit with the unsplit linear."""
    from torch.distributed import HashStore

    from lpbench.parallel.cp import ContextParallel
    from lpbench.precision.kernels import nvfp4
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
        request.addfinalizer(dist.destroy_process_group)
    reduced = []
    original = nvfp4.quantize
    monkeypatch.setattr(nvfp4, "quantize", lambda *a, **kw: reduced.append(kw["reduce_amax"]) or original(*a, **kw))
    runs = []
    for split in (True, False):
        torch.manual_seed(0)
        mod = QuantizedLinear.from_linear(
            torch.nn.Linear(256, 128, bias=False, device="cuda"), get_recipe("nvfp4-no-sr"), native=False
        )
        if split:
            mod.cp_shard = ContextParallel(dist.group.WORLD, 0, 1)
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(2, 64, 256, generator=g) * 3).cuda().bfloat16().requires_grad_()
        y = mod(x)
        y.backward(torch.randn(y.shape, generator=g).to("cuda", y.dtype))
        runs.append([y.detach(), x.grad, mod.weight.grad])
    assert sum(r is not None for r in reduced) >= 2  # the input's and the gradient's copies, amaxes all-reduced
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

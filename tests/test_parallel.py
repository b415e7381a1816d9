"""DDP / FSDP2 / TP / FSDP x TP / EP on CPU (gloo): each layout trains exactly like one process.

Workers are spawned once per world size (a module fixture) and run every scenario; each
scenario is compared with a single-process run on the same global batch, in FP32 (MoE runs with
an auxiliary loss also on its logged value: the load balance of the whole global batch). The
distributed runs build their model on the meta device and initialise it after sharding, so
equal losses also show that meta init gives the single-process weights.
"""

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig

BASE = RunConfig(model="tiny", seq_len=32, mbs=8, gbs=8, steps=2, warmup_steps=1, precision="fp32", device="cpu")
ARCHS = {  # tiny members of the other families: QK-norm + GQA, GPT (bias, learned positions, tied), MoE
    m.name: m
    for m in (
        ModelConfig("test-qwen", 2, 64, 128, 4, 2, 512, head_dim=32, qk_norm=True, max_seq_len=256),
        ModelConfig(
            "test-gpt",
            2,
            64,
            256,
            4,
            4,
            512,
            norm="layer",
            activation="gelu",
            positions="learned",
            tie_embeddings=True,
            bias=True,
            max_seq_len=256,
        ),
        ModelConfig("test-moe", 2, 64, 128, 4, 2, 512, n_experts=4, top_k=2, max_seq_len=256),
    )
}
SCENARIOS = {
    2: {
        "ddp": dict(mbs=4),
        "ddp-ga": dict(mbs=2),
        "fsdp": dict(mbs=4, fsdp=True),
        "fsdp-ga": dict(mbs=2, fsdp=True),
        "tp": dict(tp=2),
        "tp-no-sp": dict(tp=2, sequence_parallel=False, mbs=4),
        **{f"tp-{name}": dict(tp=2, model=name) for name in ARCHS},
        "tp-no-sp-test-moe": dict(tp=2, model="test-moe", sequence_parallel=False, mbs=4),
        "ddp-test-moe": dict(mbs=4, model="test-moe"),
        "ep2-test-moe": dict(mbs=4, model="test-moe", ep=2),
        # gradient accumulation: DDP reduces the experts' .grad; split experts accumulate in FP32 buffers
        "ddp-ga-test-moe": dict(mbs=2, model="test-moe"),
        "ep2-ga-test-moe": dict(mbs=2, model="test-moe", ep=2),
        "ep2-fsdp-test-moe": dict(mbs=2, model="test-moe", ep=2, fsdp=True),
        "ep2-test-moe-aux": dict(mbs=4, model="test-moe", ep=2, moe_aux_loss_coeff=0.1),
        "ddp-test-moe-aux": dict(mbs=4, model="test-moe", moe_aux_loss_coeff=0.1),
    },
    4: {
        "fsdp-tp": dict(mbs=2, tp=2, fsdp=True),
        "fsdp-tp-ga-zero1": dict(mbs=1, tp=2, fsdp=True, fsdp_shard="zero1"),  # a recommended TP row's optimizer
        "ddp-tp": dict(mbs=4, tp=2),
        "ep4-test-moe": dict(mbs=2, model="test-moe", ep=4),
        "ep2-fsdp-test-moe": dict(mbs=2, model="test-moe", ep=2, fsdp=True),
        "ddp-tp-test-moe-aux": dict(mbs=4, tp=2, model="test-moe", moe_aux_loss_coeff=0.1),
        "fsdp-tp-test-moe": dict(mbs=2, tp=2, model="test-moe", fsdp=True),
    },
}


def _reference_key(kw: dict) -> str:
    return kw.get("model", "tiny") + ("-aux" if kw.get("moe_aux_loss_coeff") else "")


def _worker(rank: int, world: int) -> dict:
    MODELS.update(ARCHS)
    results = {}
    for name, kw in SCENARIOS[world].items():
        lines = []
        r = loop.train(BASE.with_(**kw).with_world(world), log=lines.append)
        results[name] = {
            "loss": [s["loss"] for s in r.steps],
            "grad_norm": [s["grad_norm"] for s in r.steps],
            "aux": [s.get("moe_aux_loss") for s in r.steps],
            "metrics": r.metrics,
            "status": r.status,
            "log_lines": len(lines),
        }
    results["tp_group_size"] = _tp_group_size_of_a_sharded_linear(world)
    if world == 2:
        results["refused"] = _tp_refuses_linears_that_are_not_tp_aware()
    return results


def _tp_group_size_of_a_sharded_linear(world: int) -> int | None:
    """FSDP (world 2) or FSDP x TP (world 4): the group a split linear's ``tp_shard`` names."""
    from lpbench.models import build_model
    from lpbench.parallel.plan import parallelize

    model = build_model(MODELS["tiny"], device="cpu")
    parallelize(
        model,
        BASE.with_(fsdp=True, tp=world // 2).with_world(world),
        torch.device("cpu"),
        torch.float32,
        use_compile=False,
    )
    split = getattr(model.layers[0].attn.qkv, "tp_shard", None)
    return None if split is None else torch.distributed.get_world_size(split.group)


def _tp_refuses_linears_that_are_not_tp_aware() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from lpbench.errors import UsageError
    from lpbench.models import build_model
    from lpbench.parallel.tp import apply_tp

    class OwnGemmLinear(torch.nn.Linear):
        pass

    model = build_model(MODELS["tiny"], device="cpu")
    qkv = model.layers[0].attn.qkv
    model.layers[0].attn.qkv = OwnGemmLinear(qkv.in_features, qkv.out_features, bias=False)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)))
    except UsageError as exc:
        return str(exc)
    return "accepted"


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("world2"), 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 4, tmp_path_factory.mktemp("world4"), 4)


@pytest.fixture(scope="module")
def reference():
    """Single-process runs: one micro-batch holding the whole global batch."""
    with pytest.MonkeyPatch.context() as mpatch:
        for name, m in ARCHS.items():
            mpatch.setitem(MODELS, name, m)
        runs = {name: loop.train(BASE.with_(model=name), log=lambda line: None) for name in ["tiny", *ARCHS]}
        runs["test-moe-aux"] = loop.train(BASE.with_(model="test-moe", moe_aux_loss_coeff=0.1), log=lambda line: None)
        return runs


def _assert_same_training(run: dict, ref) -> None:
    assert run["status"] == "ok"
    assert run["loss"] == pytest.approx([s["loss"] for s in ref.steps], rel=1e-5)
    assert run["grad_norm"] == pytest.approx([s["grad_norm"] for s in ref.steps], rel=1e-4)
    if ref.config.moe_aux_loss_coeff:
        assert run["aux"] == pytest.approx([s["moe_aux_loss"] for s in ref.steps], rel=1e-5)


@pytest.mark.parametrize("name", list(SCENARIOS[2]))
def test_two_ranks_train_like_one_process(name, world2, reference):
    _assert_same_training(world2[0][name], reference[_reference_key(SCENARIOS[2][name])])
    assert world2[1][name]["loss"] == world2[0][name]["loss"]  # every rank reports the global loss


@pytest.mark.parametrize("name", list(SCENARIOS[4]))
def test_fsdp_and_ddp_times_tp_on_a_2d_mesh(name, world4, reference):
    _assert_same_training(world4[0][name], reference[_reference_key(SCENARIOS[4][name])])
    m = world4[0][name]["metrics"]
    tp, ep = SCENARIOS[4][name].get("tp", 1), SCENARIOS[4][name].get("ep", 1)
    assert (m["world_size"], m["dp"], m["tp"], m["ep"]) == (4, 4 // tp, tp, ep)
    assert m["fsdp"] == (4 // tp if "fsdp" in name else 1)


def test_only_rank_0_logs_and_metrics_are_per_gpu(world2):
    for name in SCENARIOS[2]:
        assert world2[0][name]["log_lines"] > 0 and world2[1][name]["log_lines"] == 0
    m = world2[0]["fsdp"]["metrics"]
    assert (m["world_size"], m["dp"], m["tp"], m["fsdp"], m["num_gpus"]) == (2, 2, 1, 2, 2)
    assert m["tokens_per_sec_per_gpu"] == pytest.approx(8 * 32 / m["step_time_s"] / 2)
    assert world2[0]["tp"]["metrics"]["sequence_parallel"] is True
    # peak memory is the maximum over ranks: every rank reports the same
    peaks = [w["fsdp"]["metrics"]["peak_mem_allocated_gb"] for w in world2]
    assert peaks[0] == peaks[1] > 0


def test_tp_refuses_a_linear_subclass_that_is_not_tp_aware(world2):
    assert "OwnGemmLinear (layers.0.attn.qkv) does not support tensor parallelism yet" in world2[0]["refused"]


def test_split_linears_name_the_tp_group_also_under_fsdp(world2, world4):
    assert world2[0]["tp_group_size"] is None  # FSDP alone: no linear is split
    assert world4[0]["tp_group_size"] == 2  # FSDP x TP: the TP group, not the DP or world group


def test_clip_grad_norm_matches_torch_on_plain_parameters():
    from lpbench.parallel.dp import clip_grad_norm_

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    layer(torch.randn(3, 4) * 10).square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    ours = clip_grad_norm_(list(layer.parameters()), 1.0)
    ours_clipped = [p.grad.clone() for p in layer.parameters()]
    for p, g in zip(layer.parameters(), grads):
        p.grad = g
    theirs = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    assert float(ours) == pytest.approx(float(theirs)) and float(theirs) > 1.0
    assert all(torch.allclose(a, p.grad) for a, p in zip(ours_clipped, layer.parameters()))


@pytest.mark.parametrize("max_norm", [1.0, 1e6])  # clipping, and a norm under the limit
def test_clip_folded_into_fused_adamw_gives_the_clipped_update(max_norm):
    from lpbench.parallel.dp import clip_grad_norm_

    def run(fold: bool, clip: bool = True) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 8)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
        for step in range(3):
            layer(torch.randn(5, 16) * 10).square().sum().backward()
            if clip:
                norm = clip_grad_norm_(list(layer.parameters()), max_norm, opt if fold else None)
                assert float(norm) > 1.0
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in layer.parameters()]

    folded, clipped, unclipped = run(True), run(False), run(True, clip=False)
    for a, b, c in zip(folded, clipped, unclipped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (max_norm > 1e3) == torch.equal(a, c)  # the fold changed the update exactly when clipping


def _vocab_parallel_worker(rank: int, vocab: int) -> dict:
    import torch.distributed as dist

    from lpbench.parallel.tp import VocabParallel

    torch.manual_seed(0)
    logits = torch.randn(6, vocab, dtype=torch.float64).float() * 4
    labels = torch.tensor([0, vocab - 1, 5, -100, vocab // 2, 17])
    world = dist.get_world_size()
    part = VocabParallel(dist.group.WORLD, rank, world, vocab)
    start, width = rank * -(-vocab // world), -(-vocab // world)
    mine = logits[:, start : start + width].clone().requires_grad_(True)
    losses = part.cross_entropy(mine, labels)
    (losses * torch.arange(1.0, 7.0)).sum().backward()  # a gradient per token, as CP's sum and the mean give
    return {"losses": losses.tolist(), "grad": mine.grad.tolist(), "gathered": part.gather(mine.detach()).tolist()}


@pytest.mark.parametrize("vocab", [32, 33])  # 33: DTensor's chunks 17 and 16
def test_vocabulary_parallel_cross_entropy_is_the_whole_vocabularys(tmp_path, spawn_ranks, vocab):
    ranks = spawn_ranks(_vocab_parallel_worker, 2, tmp_path, vocab)
    torch.manual_seed(0)
    logits = (torch.randn(6, vocab, dtype=torch.float64).float() * 4).requires_grad_(True)
    labels = torch.tensor([0, vocab - 1, 5, -100, vocab // 2, 17])
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")  # 0 where ignored
    (losses * torch.arange(1.0, 7.0)).sum().backward()
    grad = torch.cat([torch.tensor(r["grad"]) for r in ranks], dim=1)
    for r in ranks:
        assert r["losses"] == pytest.approx(losses.tolist(), rel=1e-6, abs=1e-6) and r["losses"][3] == 0.0
        assert torch.equal(torch.tensor(r["gathered"]), logits.detach())
    torch.testing.assert_close(grad, logits.grad, rtol=1e-6, atol=1e-7)

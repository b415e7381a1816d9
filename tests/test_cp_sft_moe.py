"""Context parallelism with packed SFT (document masking), LoRA and MoE layers, on CPU (gloo), against one process.

Packed SFT: every rank keeps the whole sequences' document ids, its queries attend to the gathered keys of their
own document up to their place (:func:`lpbench.models.decoder.document_mask` with ``query``), positions restart
per document. One model's loss and every parameter's gradient under CP 2 equal the unsplit model's up to FP32
summation order (the softmax sums its keys in another grouping, each rank's weight gradient is a partial sum).
MoE: each rank routes its own tokens; the load-balancing loss counts the tokens of every data-parallel and CP
rank (``count_group``: the ``loss`` mesh), experts under EP are summed over their replicas on the CP ranks too.
LoRA (SFT's data, adapters per token, a frozen base stored as FP8 codes whose linears reduce their amaxes over
CP as trained ones do). Whole runs (CP 2; CP 2 x FSDP 2; CP 2 x EP 2; CP 2 x TP 2) match one process: FP32 to summation order at every step, BF16
within ``test_cp``'s tolerances (the same weights, BF16 roundings of sums in another order, amplified after the
first Adam step).

Under pipeline parallelism (PP 2 x CP 2, 4 ranks; PP 2 x CP 2 x EP 2 beside DP 2, 8 ranks) each stage splits its
sequences over its CP pair as CP alone does, the document ids reach every stage, the load-balancing loss of each
stage's MoE layers counts the tokens of the ``loss`` mesh, each stage's LoRA adapters are reduced over its CP pair
and its stored base's amaxes over CP: the same tolerances against one process (FP32: summation
order, the stages' gradient norms summed in another order; BF16: ``test_cp``'s). The zero-bubble schedules are run
too: their separate weight pass needs each stage's blocks left unsharded after the forward, and a rank holding both
ends of ``zbv``'s V its own copy of a tied embedding (:mod:`lpbench.parallel.pp`).
"""

import pytest
import torch
import torch.distributed as dist

import lpbench.train.loop as loop
from lpbench.config import RunConfig

BASE = RunConfig(
    model="tiny", seq_len=64, mbs=4, gbs=4, steps=3, warmup_steps=1, eval_every=3, eval_batches=1, device="cpu"
)
SFT = dict(workload="sft")
MOE = dict(model="tiny-moe", moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
LORA = dict(workload="lora", lora_base_storage="quantized")  # bases stored as codes where the recipe quantizes
PRECISIONS = ["fp32", "bf16"]
RUNS = {  # name -> (world, settings, precisions)
    "cp2-sft": (2, dict(cp=2, **SFT), PRECISIONS),
    "cp2-moe": (2, dict(cp=2, **MOE), PRECISIONS),
    "cp2-lora": (2, dict(cp=2, **LORA), ["fp32", "fp8-tensorwise"]),
    "cp2-fsdp2-sft": (4, dict(cp=2, mbs=2, **SFT), PRECISIONS),
    "cp2-fsdp2-moe": (4, dict(cp=2, mbs=2, **MOE), PRECISIONS),
    "cp2-ep2-moe": (4, dict(cp=2, ep=2, mbs=2, **MOE), PRECISIONS),
    "cp2-tp2-moe": (4, dict(cp=2, tp=2, **MOE), PRECISIONS),  # experts split by TP, summed over dp x cp
}
PP = dict(pp=2, cp=2, mbs=2, eval_batches=2)  # two micro-batches of 2 on one data-parallel rank
ZB = dict(vp=2, pp_schedule="zero-bubble")
ZBV = dict(vp=2, pp_schedule="zbv")
PP_RUNS = {  # name -> (world, settings, precisions, the reference's name)
    "pp2-cp2-sft": (4, dict(**PP, **SFT), PRECISIONS, "sft-mbs2"),
    "pp2-cp2-moe": (4, dict(**PP, **MOE), PRECISIONS, "moe-mbs2"),
    "pp2-cp2-lora": (4, dict(**PP, **LORA), RUNS["cp2-lora"][2], "lora-mbs2"),
    "pp2-vp2-cp2-zero-bubble-sft": (4, dict(**PP, **ZB, **SFT), ["fp32"], "sft-mbs2"),
    "pp2-vp2-cp2-zbv-sft": (4, dict(**PP, **ZBV, **SFT), ["fp32"], "sft-mbs2"),
    "pp2-vp2-cp2-zbv-moe": (4, dict(**PP, **ZBV, **MOE), ["fp32"], "moe-mbs2"),
    # DP 2: the load-balancing loss counts 4 sequences per micro-batch, as one process's micro-batches of 4
    "pp2-cp2-ep2-moe": (8, dict(pp=2, cp=2, ep=2, mbs=2, gbs=8, **MOE), ["fp32"], "moe-gbs8"),
}


def _doc_batch(seq: int = 64):
    """Two packed sequences of documents of uneven lengths (the last a padding run), labels partly -100."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, seq), generator=gen)
    labels = torch.randint(0, 256, (2, seq), generator=gen)
    labels[:, ::5] = -100
    doc = torch.zeros(2, seq, dtype=torch.long)
    for row, cuts in enumerate(([7, 30, 31, 50], [20, 44])):
        for k, cut in enumerate(cuts):
            doc[row, cut:] = k + 1
    doc[1, 60:] = -1
    return ids, labels, doc


def _sft_model_errors(rank: int) -> dict:
    """Max relative error of CP 2 against the unsplit model (FP32): the loss and every parameter's gradient on a
    packed batch (each rank's loss is its share of the mean x 2, so the mean over the ranks is the whole loss)."""
    from lpbench.models import build_model
    from lpbench.models.registry import MODELS
    from lpbench.parallel.cp import apply_cp

    ref, split = (build_model(MODELS["tiny"], device="cpu", seed=0) for _ in range(2))
    cp = apply_cp(split, dist.group.WORLD, rank, 2)
    ids, labels, doc = _doc_batch()
    whole = ref(ids, labels, doc_ids=doc)
    whole.backward()
    part = split(*cp.shard([ids, labels, doc]))
    part.backward()
    dist.all_reduce(part := part.detach().clone())
    errors = {"loss": float((part / 2 - whole).abs() / whole.abs())}
    for (name, p), q in zip(ref.named_parameters(), split.parameters()):
        dist.all_reduce(grad := q.grad.clone())
        errors[name] = float((grad / 2 - p.grad).abs().max() / p.grad.abs().max())
    return errors


def _trained(cfg: RunConfig) -> dict:
    r = loop.train(cfg, log=lambda line: None)
    return {
        "loss": [s["loss"] for s in r.steps],
        "grad_norm": [s["grad_norm"] for s in r.steps],
        "aux": [s.get("moe_aux_loss") for s in r.steps],
        "val_loss": r.metrics.get("val_loss"),
        "status": r.status,
        "error": r.error,
    }


def _worker(rank: int, world: int) -> dict:
    results = {}
    runs = [(name, *run[:3]) for name, run in [*RUNS.items(), *PP_RUNS.items()]]
    for name, size, kw, precisions in runs:
        if size == world:
            for precision in precisions:
                results[f"{name}-{precision}"] = _trained(BASE.with_(precision=precision, **kw).with_world(world))
    if world == 2:
        results["model-sft"] = _sft_model_errors(rank)
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("cp-sft-moe-2"), 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 4, tmp_path_factory.mktemp("cp-sft-moe-4"), 4)


@pytest.fixture(scope="module")
def world8(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 8, tmp_path_factory.mktemp("cp-sft-moe-8"), 8)


@pytest.fixture(scope="module")
def reference():
    """One process. Packed SFT's loss is each micro-batch's mean over its labels, so two data-parallel ranks of 2
    sequences each are one process accumulating two micro-batches of 2 (evaluating both); the MoE runs (every
    token labelled, the load-balancing loss counting the tokens of every data-parallel rank) are one micro-batch
    of 4. A pipeline's micro-batches of 2 are one process's (``-mbs2``); with DP 2 beside it, micro-batches of 4."""
    return {
        "sft-mbs4": {p: _trained(BASE.with_(precision=p, **SFT)) for p in PRECISIONS},
        "sft-mbs2": {p: _trained(BASE.with_(precision=p, mbs=2, eval_batches=2, **SFT)) for p in PRECISIONS},
        "moe": {p: _trained(BASE.with_(precision=p, **MOE)) for p in PRECISIONS},
        "moe-mbs2": {p: _trained(BASE.with_(precision=p, mbs=2, eval_batches=2, **MOE)) for p in PRECISIONS},
        "moe-gbs8": {"fp32": _trained(BASE.with_(precision="fp32", gbs=8, **MOE))},
        "lora": {p: _trained(BASE.with_(precision=p, **LORA)) for p in RUNS["cp2-lora"][2]},
        "lora-mbs2": {p: _trained(BASE.with_(precision=p, mbs=2, eval_batches=2, **LORA)) for p in RUNS["cp2-lora"][2]},
    }


def _assert_like_one_process(run: dict, ref: dict, precision: str, lora: bool = False) -> None:
    assert run["status"] == "ok", run["error"]
    if precision == "fp32":  # summation order only
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert run["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
        if ref["aux"][0] is not None:  # the load-balancing loss as one process counts the whole batch
            assert run["aux"] == pytest.approx(ref["aux"], rel=1e-5)
        return
    # as test_cp allows the quantized recipes (fp8-tensorwise LoRA: its first gradient norm 1.3e-3 off)
    assert run["loss"][0] == pytest.approx(ref["loss"][0], rel=5e-6 if lora else 5e-4)  # LoRA: B = 0, the base's
    # input codes those of one process when its amaxes are reduced over CP (without: 2.5e-5 to 7e-5 off)
    assert run["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=1e-2)
    assert run["loss"] == pytest.approx(ref["loss"], rel=5e-3)
    assert run["val_loss"] == pytest.approx(ref["val_loss"], rel=5e-3)


def test_document_masked_cp_equals_the_unsplit_model(world2):
    for rank in world2:
        errors = rank["model-sft"]
        assert max(errors.values()) < 1e-5, errors  # FP32 summation order only


@pytest.mark.parametrize("name,precision", [(n, p) for n, (size, _, ps) in RUNS.items() if size == 2 for p in ps])
def test_cp2_sft_lora_and_moe_train_like_one_process(world2, reference, name, precision):
    ref = reference[{"sft": "sft-mbs4"}.get(name[4:], name[4:])][precision]
    _assert_like_one_process(world2[0][f"{name}-{precision}"], ref, precision, lora=name.endswith("lora"))


@pytest.mark.parametrize("name", [n for n, (size, _, _) in RUNS.items() if size == 4])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_cp2_with_fsdp2_or_ep2_trains_like_one_process(world4, reference, name, precision):
    ref = reference["moe" if name.endswith("moe") else "sft-mbs2"][precision]
    _assert_like_one_process(world4[0][f"{name}-{precision}"], ref, precision)


@pytest.mark.parametrize(
    "name,precision",
    [  # 8 ranks on the CI's 2 cores: about a minute, left to --run-slow
        pytest.param(n, p, marks=[pytest.mark.slow] if size > 4 else [])
        for n, (size, _, ps, _) in PP_RUNS.items()
        for p in ps
    ],
)
def test_pipeline_with_cp_trains_packed_sft_lora_and_moe_like_one_process(request, reference, name, precision):
    size, _, _, ref = PP_RUNS[name]
    ranks = request.getfixturevalue(f"world{size}")
    run = ranks[0][f"{name}-{precision}"]
    assert all(r[f"{name}-{precision}"]["loss"] == run["loss"] for r in ranks)  # every stage reports the global loss
    _assert_like_one_process(run, reference[ref][precision], precision, lora=name.endswith("lora"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_cp_ranks_document_mask_gives_the_whole_sequences_rows(device, rank):
    """One CP 2 rank's queries over the whole sequence's keys under its document mask (flex's block mask on CUDA,
    SDPA's bool mask on CPU) equal those queries' rows of the unsplit document-masked attention."""
    from lpbench.models.decoder import _flex_attention, document_mask, document_runs
    from lpbench.parallel.cp import ContextParallel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, generator=gen).to(device, dtype) for h in (8, 2, 2))
    doc = torch.zeros(2, 256, dtype=torch.long)
    doc[0, 100:], doc[0, 200:], doc[1, 50:] = 1, 2, 1
    runs, _ = document_runs(doc.to(device))
    idx = ContextParallel(None, rank, 2).index(256, q.device)
    whole = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(runs, "sdpa"), enable_gqa=True
    )
    mask = document_mask(runs, query=idx)
    if device == "cuda":
        part = _flex_attention(q[:, :, idx], k, v, mask, True)
    else:
        part = torch.nn.functional.scaled_dot_product_attention(q[:, :, idx], k, v, attn_mask=mask, enable_gqa=True)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part, whole[:, :, idx], **tol)

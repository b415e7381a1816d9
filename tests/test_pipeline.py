"""Pipeline parallelism (``--pp``, ``--vp``) on CPU (gloo) against the single-process run of the same global batch.

Where the arithmetic is the same the run is bit for bit the single process's: each stage runs its blocks on the
same micro-batches in the same order, the loss is divided by the micro-batch count before the backward as one
process divides it, and the gradient norm is taken over the whole model's per-parameter norms in its order. So:
losses, gradient norms, validation losses (each stage's forward in order) and every final weight equal (1F1B,
interleaved and both zero-bubble schedules; bf16 / fp8-tensorwise / fp8-delayed / nvfp4, whose stochastic rounding
draws by step, micro-batch and module, not by process: lpbench.precision.noise). Exceptions, with their tolerance:

* a tied embedding (``tiny``): its two gradients (embedding, LM head) are summed across the first and last stage
  instead of accumulated by autograd in one process, another FP32 order: that weight alone may differ in its last
  bits (losses and norms still agree to rel 1e-6);
* with DP, TP or EP beside PP the single-process comparison is the other layouts' (test_parallel_layout.py):
  summation order over ranks (FP32 rel 1e-5; bf16 rel 2e-3);
* with CP beside PP (PP 2 x CP 2): CP's tolerances against one process (test_cp.py: attention and weight gradients
  summed over other blocks of tokens); against CP 2 alone, whose arithmetic it is, the first loss bit for bit and
  the rest within rel 1e-6, the validation loss within 1e-5 (the gradient norm summed over the stages: another FP32 order).
"""

import dataclasses
import hashlib
import json
import os
import shutil
import time

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.bench.runner import check_resume
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.models.registry import MODELS
from lpbench.parallel.pp import (
    BusyClock,
    balanced_sizes,
    bubble_theory,
    check_pipeline,
    even_sizes,
    head_units,
    rank_loads,
    rank_stages,
    stage_blocks,
    stage_owners,
    stage_sizes,
)

UNTIED = dataclasses.replace(MODELS["tiny"], name="test-pp-untied", tie_embeddings=False, n_layers=4)
UNTIED6 = dataclasses.replace(UNTIED, name="test-pp-untied6", n_layers=6)  # nvfp4 keeps blocks 0, 5 in BF16
BASE = RunConfig(
    model=UNTIED.name, seq_len=32, mbs=2, gbs=8, steps=3, warmup_steps=1, device="cpu", eval_every=3, eval_batches=3
)

CP_PRECISIONS = ("fp32", "bf16", "fp8-tensorwise", "fp8-delayed")
SCENARIOS = {
    2: {
        **{f"pp2-{p}": dict(pp=2, precision=p) for p in ("bf16", "fp8-tensorwise", "fp8-delayed")},
        "pp2-nvfp4": dict(pp=2, precision="nvfp4", model=UNTIED6.name),
        "pp2-vp2-bf16": dict(pp=2, vp=2, precision="bf16"),
        "pp2-vp2-fp8-delayed": dict(pp=2, vp=2, precision="fp8-delayed"),
        "pp2-tied-bf16": dict(pp=2, precision="bf16", model="tiny"),
        # the default split is balanced (3,1: the head counts 1.3 blocks); the even one and a split given per stage
        "pp2-even-bf16": dict(pp=2, pp_split="even", precision="bf16"),
        "pp2-vp2-given-bf16": dict(pp=2, vp=2, pp_split="2,1,1,2", precision="bf16", model=UNTIED6.name),
        "pp2-vp2-zero-bubble-bf16": dict(pp=2, vp=2, pp_schedule="zero-bubble", precision="bf16"),
        "pp2-zbv-bf16": dict(pp=2, vp=2, pp_schedule="zbv", precision="bf16"),
        "pp2-vp2-zero-bubble-fp8-tensorwise": dict(pp=2, vp=2, pp_schedule="zero-bubble", precision="fp8-tensorwise"),
        # the weight pass reruns the backward: each gradient's amax still recorded once (lpbench.passes)
        "pp2-vp2-zero-bubble-fp8-delayed": dict(pp=2, vp=2, pp_schedule="zero-bubble", precision="fp8-delayed"),
        "pp2-zbv-fp8-delayed": dict(pp=2, vp=2, pp_schedule="zbv", precision="fp8-delayed"),
        # and a recomputed block's forward, rerun in each of the two backward passes, takes its first pass's scales
        "pp2-zbv-fp8-delayed-recompute": dict(pp=2, vp=2, pp_schedule="zbv", precision="fp8-delayed", recompute="full"),
        # every block quantized: stochastic rounding on both ranks, interleaved, and in zbv's split backward
        "pp2-vp2-nvfp4-all": dict(pp=2, vp=2, precision="nvfp4-no-bf16-tail"),
        "pp2-zbv-nvfp4-all": dict(pp=2, vp=2, pp_schedule="zbv", precision="nvfp4-no-bf16-tail"),
        # CP 2 alone: what PP 2 x CP 2 (world 4) computes, stage by stage
        **{f"cp2-{p}": dict(cp=2, precision=p, seq_len=64) for p in CP_PRECISIONS},
        "cp2-nvfp4": dict(cp=2, precision="nvfp4", model=UNTIED6.name, seq_len=64),
    },
    4: {
        "pp4-bf16": dict(pp=4, precision="bf16"),
        "pp2-dp2-fsdp-fp32": dict(pp=2, fsdp=True, precision="fp32", gbs=8),
        # the distributed optimizer of a recommended row with PP (bench/recommended.py): FSDP2 zero1 per stage
        "pp2-dp2-zero1-fp32": dict(pp=2, fsdp=True, fsdp_shard="zero1", precision="fp32", gbs=8),
        "pp2-tp2-fp32": dict(pp=2, tp=2, precision="fp32"),
        "pp2-ep2-moe-fp32": dict(pp=2, ep=2, precision="fp32", model="tiny-moe", gbs=8),
        # each stage splits its sequences over its CP pair (64 tokens: NVFP4's 16-token blocks in each chunk); the
        # even split, whose two per-stage gradient norms sum to CP 2's within rel 1e-6 over three BF16 steps (the
        # balanced 3,1 groups the FP32 sum otherwise, and the third BF16 loss moves by 4e-6)
        **{f"pp2-cp2-{p}": dict(pp=2, cp=2, precision=p, seq_len=64, pp_split="even") for p in CP_PRECISIONS},
        "pp2-cp2-nvfp4": dict(pp=2, cp=2, precision="nvfp4", model=UNTIED6.name, seq_len=64),
        "pp2-vp2-cp2-zbv-bf16": dict(pp=2, vp=2, cp=2, pp_schedule="zbv", precision="bf16", seq_len=64),
    },
}


def _weights(module) -> dict:
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()
    return out


def _train(cfg: RunConfig) -> dict:
    box, real = {}, loop.build

    def build(*args, **kw):
        box["run"] = loop_run = real(*args, **kw)
        return loop_run

    loop.build = build
    try:
        r = loop.train(cfg, log=lambda line: None)
    finally:
        loop.build = real
    pipeline = box["run"].par.pipeline
    return {
        # receive buffers that still hold memory after the run (lpbench.parallel.pp.Stage lets each go once used)
        "held_buffers": None if pipeline is None else _held_buffers(pipeline.stages),
        "loss": [s["loss"] for s in r.steps],
        "grad_norm": [s["grad_norm"] for s in r.steps],
        "val_loss": [s.get("val_loss") for s in r.steps],
        "weights": _weights(box["run"].par.module),
        "metrics": {k: v for k, v in r.metrics.items() if isinstance(v, (int, float, str, list))},
        "status": r.status,
        "error": r.error,
    }


def _held_buffers(stages) -> int:
    infos = [i for s in stages for d in (s.args_recv_info, s.grad_recv_info) for infos in d.values() for i in infos]
    return sum(isinstance(getattr(i, "buffer", None), torch.Tensor) and not i.buffer.is_meta for i in infos)


def _worker(rank: int, world: int, ckpt: str) -> dict:
    MODELS.update({UNTIED.name: UNTIED, UNTIED6.name: UNTIED6})
    results = {}
    for name, kw in SCENARIOS[world].items():
        try:
            results[name] = _train(BASE.with_(**kw).with_world(world))
        except Exception as exc:  # noqa: BLE001 -- the test names the failure
            results[name] = {"status": "raised", "error": f"{type(exc).__name__}: {exc}"[:400]}
    # a PP 2 (world 4: PP 2 x CP 2) run saving after step 2, and its checkpoint resumed for step 3
    cfg = BASE.with_(pp=2, precision="fp8-delayed", **({} if world == 2 else dict(cp=2, seq_len=64)))
    cfg = cfg.with_world(world)
    results["saving"] = _train(cfg.with_(save_every=2, save_dir=ckpt))
    results["resumed"] = _train(cfg.with_(load=os.path.join(ckpt, "step-2")))
    return results


@pytest.fixture(scope="module")
def pp_ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks, pp_ckpt):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("pp2"), 2, str(pp_ckpt))


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 4, tmp_path_factory.mktemp("pp4"), 4, str(tmp_path_factory.mktemp("ckpt4")))


@pytest.fixture(scope="module")
def reference():
    """Single-process runs of every scenario's model and precision (the same GBS, MBS and micro-batches), on one
    thread as the ranks run."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setitem(MODELS, UNTIED.name, UNTIED)
        mpatch.setitem(MODELS, UNTIED6.name, UNTIED6)
        mpatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        runs = {}
        try:
            for kw in [*SCENARIOS[2].values(), *SCENARIOS[4].values()]:
                key = _key(kw)
                if key not in runs:
                    runs[key] = _train(BASE.with_(model=key[0], precision=key[1], seq_len=key[2]))
        finally:
            torch.set_num_threads(threads)
        return runs


def _key(kw: dict) -> tuple:
    """A scenario's single-process reference: model, precision, sequence length."""
    return kw.get("model", UNTIED.name), kw["precision"], kw.get("seq_len", BASE.seq_len)


def _merged(ranks: list, name: str) -> dict:
    weights = {}
    for r in ranks:
        assert r[name]["status"] == "ok", r[name]["error"]
        weights.update(r[name]["weights"])
    return weights


@pytest.mark.parametrize(
    "name",
    [
        "pp2-bf16",
        "pp2-even-bf16",
        "pp2-vp2-given-bf16",
        "pp2-fp8-tensorwise",
        "pp2-fp8-delayed",
        "pp2-nvfp4",
        "pp2-vp2-bf16",
        "pp2-vp2-fp8-delayed",
        "pp2-vp2-zero-bubble-bf16",
        "pp2-zbv-bf16",
        "pp2-vp2-zero-bubble-fp8-tensorwise",
        "pp2-vp2-zero-bubble-fp8-delayed",
        "pp2-zbv-fp8-delayed",
        "pp2-zbv-fp8-delayed-recompute",
        "pp2-vp2-nvfp4-all",
        "pp2-zbv-nvfp4-all",
    ],
)
def test_pipeline_trains_bit_for_bit_like_one_process(world2, reference, name):
    kw = SCENARIOS[2][name]
    ref = reference[_key(kw)]
    for r in world2:  # every rank reports the last stage's loss, and the validation loss
        assert r[name]["status"] == "ok", r[name]["error"]
        assert r[name]["loss"] == ref["loss"]
        assert r[name]["grad_norm"] == ref["grad_norm"]
        assert r[name]["val_loss"] == ref["val_loss"] and ref["val_loss"][-1] is not None
        assert r[name]["held_buffers"] == 0  # each receive buffer let go once its micro-batch used it
    assert _merged(world2, name) == ref["weights"]  # every block's weights, on the stage that holds it
    if kw["precision"].startswith("nvfp4"):  # stochastic rounding drew (without keyed draws the weights differ)
        assert world2[0][name]["metrics"]["quantized_linears"] > 0


@pytest.mark.parametrize(
    "name, blocks, first_rank",
    [
        ("pp2-bf16", "3,1", {0, 1, 2}),
        ("pp2-even-bf16", "2,2", {0, 1}),
        ("pp2-vp2-given-bf16", "2,1,1,2", {0, 1, 3}),  # rank 0: stages 0 and 2
        ("pp2-zbv-bf16", "1,1,1,1", {0, 3}),  # rank 0: stages 0 and 3
    ],
)
def test_each_rank_holds_its_stages_blocks_as_split(world2, name, blocks, first_rank):
    assert all(r[name]["metrics"]["pp_stage_blocks"] == blocks for r in world2)
    held = [{int(k.split(".")[1]) for k in r[name]["weights"] if k.startswith("layers.")} for r in world2]
    n_layers = sum(map(int, blocks.split(",")))
    assert held[0] == first_rank and held[1] == set(range(n_layers)) - first_rank


def test_pipeline_with_a_tied_embedding_differs_only_in_that_weight(world2, reference):
    ref, run = reference[("tiny", "bf16", BASE.seq_len)], world2[0]["pp2-tied-bf16"]
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    weights = _merged(world2, "pp2-tied-bf16")
    differ = {n for n in ref["weights"] if weights[n] != ref["weights"][n]}
    assert differ <= {"tok_embeddings.weight"}


def test_pipeline_checkpoint_resumes_exactly(world2):
    straight, resumed = world2[0]["saving"], world2[0]["resumed"]
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["metrics"]["resumed_from_step"] == 2
    assert resumed["loss"] == straight["loss"][2:] and resumed["grad_norm"] == straight["grad_norm"][2:]
    assert _merged(world2, "resumed") == _merged(world2, "saving")  # each stage's blocks, restored and stepped


def test_resuming_under_another_pipeline_is_refused_in_one_line(world2, pp_ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(MODELS, UNTIED.name, UNTIED)
    argv = ["run", "--model", UNTIED.name, "--precision", "fp8-delayed", "--seq-len", "32", "--mbs", "2"]
    argv += ["--gbs", "8", "--steps", "3", "--device", "cpu", "--load", str(pp_ckpt / "step-2")]
    assert main([*argv, "--results", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pp 2 (this run: 1)" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "db").exists()


def test_resuming_under_another_split_is_refused_in_one_line(world2, pp_ckpt, tmp_path, capsys, monkeypatch):
    """The checkpoint's stages hold 3,1 blocks (balanced); a checkpoint saved before --pp-split, without the counts
    in its lpbench.json, holds the even split's 2,2. The refusal names the --pp-split that resumes it."""
    monkeypatch.setitem(MODELS, UNTIED.name, UNTIED)
    cfg = BASE.with_(pp=2, precision="fp8-delayed", load=str(pp_ckpt / "step-2")).with_world(2)
    check_resume(cfg)
    with pytest.raises(UsageError, match="hold 3,1 blocks, this run's 2,2: resume with --pp-split 3,1$"):
        check_resume(cfg.with_(pp_split="even"))
    check_resume(cfg.with_(pp_split="3,1"))
    legacy = tmp_path / "legacy"
    shutil.copytree(pp_ckpt / "step-2", legacy)
    meta = json.loads((legacy / "lpbench.json").read_text())
    del meta["pp_stage_blocks"]
    (legacy / "lpbench.json").write_text(json.dumps(meta))
    check_resume(cfg.with_(load=str(legacy), pp_split="even"))
    argv = ["run", "--model", UNTIED.name, "--precision", "fp8-delayed", "--seq-len", "32", "--mbs", "2", "--gbs", "8"]
    argv += ["--steps", "3", "--device", "cpu", "--nproc-per-node", "2", "--pp", "2", "--load", str(legacy)]
    assert main([*argv, "--results", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err.strip()
    assert "hold 2,2 blocks, this run's 3,1: resume with --pp-split 2,2" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "db").exists()


def test_pipeline_reports_its_bubble_beside_the_theory(world2):
    m = world2[0]["pp2-vp2-bf16"]["metrics"]
    assert (m["pp"], m["vp"], m["pp_schedule"]) == (2, 2, "interleaved-1f1b")
    assert m["pp_bubble_theory"] == pytest.approx(1 / (4 * 2 + 1))
    assert 0.0 <= m["pp_bubble"] < 1.0
    by_rank = [float(b) for b in m["pp_bubble_ranks"].split(",")]
    assert len(by_rank) == 2 and sum(by_rank) / 2 == pytest.approx(m["pp_bubble"], abs=1e-3)
    assert m["pp_bubble_split"] >= m["pp_bubble_theory"]


class _Stage:
    """A stand-in for a PipelineStage whose forward keeps the device (``gpu``: a CUDA spin) or the host busy."""

    def __init__(self, seconds: float, gpu: bool):
        self.seconds, self.gpu = seconds, gpu

    def forward_one_chunk(self, chunk: int):
        if self.gpu:
            torch.cuda._sleep(int(self.seconds * 1.4e9))  # about ``seconds`` of spinning at 1.4 GHz or more
        else:
            time.sleep(self.seconds)


def _clocked_bubble(device: torch.device, busy: float, idle: float) -> float:
    """The bubble BusyClock measures over two busy chunks with an idle gap between them (a third of the time)."""
    stage = _Stage(busy, device.type == "cuda")
    clock = BusyClock([stage], device)
    clock.start(True)
    stage.forward_one_chunk(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    time.sleep(idle)  # nothing queued: the device idles
    stage.forward_one_chunk(1)
    return clock.stop()


def test_bubble_clock_counts_idle_time_between_chunks():
    assert 0.2 < _clocked_bubble(torch.device("cpu"), 0.05, 0.05) < 0.5  # a third idle; sleeps only ever run long


@pytest.mark.gpu
def test_bubble_clock_times_the_device_without_synchronising_it():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    stage = _Stage(0.2, True)
    clock = BusyClock([stage], device)
    clock.start(True)
    t0 = time.perf_counter()
    stage.forward_one_chunk(0)
    host = time.perf_counter() - t0
    clock.stop()
    assert host < stage.seconds / 2  # the timed call returned before its kernel ran: no synchronisation inside
    assert 0.2 < _clocked_bubble(device, 0.05, 0.05) < 0.5


@pytest.mark.parametrize("name", [n for n in SCENARIOS[4] if "-cp2-" not in n])
def test_pipeline_composes_with_other_layouts(world4, reference, name):
    kw = SCENARIOS[4][name]
    ref = reference[_key(kw)]
    run = world4[0][name]
    assert run["status"] == "ok", run["error"]
    assert all(r[name]["loss"] == run["loss"] and r[name]["held_buffers"] == 0 for r in world4)
    if name == "pp4-bf16":  # the same arithmetic
        assert run["loss"] == ref["loss"] and run["grad_norm"] == ref["grad_norm"]
        assert _merged(world4, name) == ref["weights"]
    else:  # summation order over the data- or tensor-parallel ranks
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_stage_cut_and_placement():
    assert stage_blocks(even_sizes(8, 4)) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_blocks(even_sizes(10, 4)) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]  # extras first
    assert rank_stages(1, 4, 2, "interleaved-1f1b") == [1, 5]
    assert rank_stages(0, 2, 2, "zbv") == [0, 3]
    assert stage_owners(4, 2, "interleaved-1f1b") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_owners(2, 2, "zbv") == [0, 1, 1, 0]  # the V
    assert bubble_theory(4, 5, 32) == pytest.approx(3 / (32 * 5 + 3))


@pytest.mark.parametrize(
    "n, pp, vp, schedule, head, sizes",
    [
        # 34.4 units over 8 ranks: seven stages of 4 blocks and the last of 2 + 2.4 leave 2 blocks, which go to the
        # later stages; the busiest stage has 5 units (even: 4 + 2.4 = 6.4)
        (32, 8, 1, "1f1b", 2.4, [4, 4, 4, 4, 4, 5, 5, 2]),
        # interleaved, rank r holding stages r and r + 4: ranks of 8, 9, 9 and 4 + 2 + 2.4 = 8.4 units (even: the
        # last rank 10.4)
        (32, 4, 2, "interleaved-1f1b", 2.4, [4, 4, 4, 4, 4, 5, 5, 2]),
        (32, 2, 1, "1f1b", 2.4, [17, 15]),  # 17 and 17.4 units (even: 16 and 18.4)
        (32, 2, 2, "zbv", 2.4, [9, 8, 9, 6]),  # rank 0 holds stages 0 and 3: 9 + 6 + 2.4 = 17.4; rank 1 17
        (10, 4, 1, "1f1b", 0.0, [2, 2, 3, 3]),  # no head: even, the blocks left over on the later stages
        (4, 4, 1, "1f1b", 5.0, [1, 1, 1, 1]),  # as many stages as blocks: nothing to balance
        (4, 2, 1, "1f1b", 1.3, [3, 1]),  # a tiny model: 3 and 2.3 units
        # a head heavier than the rest: the last rank keeps one block per stage, the others take every other block
        (8, 2, 2, "interleaved-1f1b", 10.0, [3, 1, 3, 1]),
    ],
)
def test_the_balanced_split_by_hand(n, pp, vp, schedule, head, sizes):
    assert balanced_sizes(n, stage_owners(pp, vp, schedule), head) == sizes


def test_the_head_counts_its_flops_in_blocks():
    m = MODELS["llama3-8b"]  # the megatron count per token, over 6 (forward and backward): GEMMs and causal attention
    block = 3 * 4096 * 14336 + 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 8192
    assert head_units(m, 8192) == pytest.approx(4096 * 128256 / block)  # 2.09
    moe = MODELS["mixtral-8x7b"]  # a MoE block: its two active experts' GEMMs
    block = 2 * 3 * 4096 * 14336 + 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 4096
    assert head_units(moe, 4096) == pytest.approx(4096 * 32000 / block)
    cfg = RunConfig(model="llama3-8b", seq_len=8192, gbs=32, pp=4, vp=2).with_world(4)
    assert stage_sizes(cfg, m) == [4, 4, 4, 4, 4, 5, 5, 2]
    assert stage_sizes(cfg.with_(pp_split="even"), m) == [4] * 8
    assert stage_sizes(cfg.with_(pp_split="4,4,4,4,4,4,5,3"), m) == [4, 4, 4, 4, 4, 4, 5, 3]
    assert stage_sizes(cfg.with_(pp=2, vp=1), m) == [17, 15]


def test_the_split_theory_counts_the_busiest_rank():
    """Whole blocks and the head do not divide evenly: the pipeline runs at its busiest rank's pace."""
    m, head = MODELS["llama3-8b"], head_units(MODELS["llama3-8b"], 8192)
    cfg = RunConfig(model="llama3-8b", seq_len=8192, gbs=32, pp=4, vp=2).with_world(4)
    loads = rank_loads(cfg, m)  # balanced: 4,4,4,4,4,5,5,2; rank r holds stages r and r + 4
    assert loads == pytest.approx([8, 9, 9, 6 + head])
    even = 3 / (32 * 2 + 3)
    assert bubble_theory(4, 2, 32, loads) == pytest.approx(1 - (1 - even) * (32 + head) / 4 / 9)  # 9.6 %
    assert bubble_theory(4, 2, 32, [8.5] * 4) == pytest.approx(even)  # equal ranks: the formula itself
    zbv = rank_loads(cfg.with_(vp=2, pp=2, pp_schedule="zbv", pp_split="9,8,9,6").with_world(2), m)
    assert zbv == pytest.approx([9 + 6 + head, 8 + 9])  # the V: rank 0 holds the first and the last stage


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--pp", "2", "--pp-split", "4,3", "--gbs", "8"], "give 2 block counts"),
        (["--pp", "2", "--vp", "2", "--pp-split", "3,3,1,3", "--gbs", "8"], "summing to tiny's 8 blocks"),
        (["--pp", "2", "--pp-split", "8,0", "--gbs", "8"], "each at least 1"),
        (["--pp", "2", "--pp-split", "halves", "--gbs", "8"], "give balanced, even or one block count per stage"),
        (["--pp-split", "even"], "--pp-split even needs pipeline parallelism"),
        (["--pp", "2", "--vp", "2", "--pp-schedule", "1f1b", "--gbs", "8"], "1f1b runs one stage per rank"),
        (["--pp", "2", "--gbs", "1"], "at least 2 micro-batches"),
        (["--pp", "2", "--vp", "2", "--gbs", "3"], "multiple of --pp 2"),
        (["--vp", "2"], "need pipeline parallelism"),
        (["--pp", "2", "--vp", "8", "--gbs", "8"], "16 pipeline stages"),
        (["--pp", "2", "--pp-schedule", "zbv", "--gbs", "8"], "needs --vp 2"),
        (["--pp", "2", "--vp", "2", "--pp-schedule", "zbv", "--gbs", "8", "--nproc-per-node", "4"], "dp 2"),
        (["--pp", "2", "--vp", "2", "--pp-schedule", "zero-bubble", "--fsdp", "--nproc-per-node", "4"], "dp 2"),
        (["--pp", "2", "--vp", "2", "--pp-schedule", "zbv", "--tp", "2", "--nproc-per-node", "4"], "ties its"),
    ],
)
def test_impossible_pipeline_layouts_exit_2_in_one_line(tmp_path, capsys, argv, words):
    argv = ["run", "--model", "tiny", "--steps", "1", "--mbs", "1", "--nproc-per-node", "2", *argv]
    code = main([*argv, "--results", str(tmp_path / "db")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1
    assert not (tmp_path / "db").exists()


def test_pipeline_rules_directly():
    check_pipeline(2, 2, None, 4)  # interleaved by default
    with pytest.raises(Exception, match="zbv"):
        check_pipeline(2, 1, "zbv", 4)
    check_pipeline(2, 2, "zbv", 4, dp=1)  # context parallel beside it: dp 1
    with pytest.raises(Exception, match="data parallelism"):
        check_pipeline(2, 2, "zero-bubble", 4, dp=2)


@pytest.mark.parametrize("name", [n for n in SCENARIOS[4] if "-cp2-" in n])
def test_pipeline_composes_with_context_parallel(world4, reference, name):
    """PP 2 x CP 2 against one process, with CP's tolerances (test_cp.py: its split attention sums the softmax
    and each rank's weight gradient over other blocks of tokens, so only FP32 agrees to summation order)."""
    kw = SCENARIOS[4][name]
    ref, run = reference[_key(kw)], world4[0][name]
    assert run["status"] == "ok", run["error"]
    assert all(r[name]["loss"] == run["loss"] for r in world4)  # every rank reports the global loss
    assert run["metrics"]["pp"] == 2 and run["metrics"]["cp"] == 2
    if kw["precision"] == "fp32":  # summation order only
        assert run["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert run["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert run["val_loss"][-1] == pytest.approx(ref["val_loss"][-1], rel=1e-5)
        return
    assert run["loss"][0] == pytest.approx(ref["loss"][0], rel=5e-4)
    assert run["grad_norm"][0] == pytest.approx(ref["grad_norm"][0], rel=1e-2)
    assert run["loss"] == pytest.approx(ref["loss"], rel=5e-3)
    assert run["val_loss"][-1] == pytest.approx(ref["val_loss"][-1], rel=5e-3)


@pytest.mark.parametrize("name", [n for n in SCENARIOS[4] if n.startswith("pp2-cp2-")])
def test_pipeline_with_context_parallel_is_context_parallel_bit_for_bit(world2, world4, name):
    """Cutting a CP 2 run into two pipeline stages changes the forward and backward arithmetic in nothing (the same
    chunks, the same gathers): the first loss is CP 2's bit for bit. The gradient norm is the stages' squared norms
    summed (FSDP's, one per stage) where CP 2 alone takes one FSDP norm: another FP32 order, so the clipped update
    may differ in its last bits, which rounding the weights to BF16 can make a BF16 step of a weight and FP8's
    rounding a code step (how often depends on the CPU's kernels): later losses agree to 1e-5 (FP8's to 1e-3), and
    later gradient norms, which such steps move more than the loss, to 1 %."""
    run, cp = world4[0][name], world2[0][name.replace("pp2-", "")]
    assert cp["status"] == "ok", cp["error"]
    assert run["loss"][0] == cp["loss"][0]
    assert run["grad_norm"][0] == pytest.approx(cp["grad_norm"][0], rel=1e-6, abs=0)
    rel = 1e-5 if name.endswith(("fp32", "bf16")) else 1e-3
    assert run["loss"] == pytest.approx(cp["loss"], rel=rel, abs=0)
    assert run["val_loss"][-1] == pytest.approx(cp["val_loss"][-1], rel=rel, abs=0)
    assert run["grad_norm"] == pytest.approx(cp["grad_norm"], rel=1e-2, abs=0)


def test_a_pipeline_with_context_parallel_resumes_exactly(world4):
    straight, resumed = world4[0]["saving"], world4[0]["resumed"]
    assert resumed["status"] == "ok", resumed["error"]
    assert resumed["metrics"]["resumed_from_step"] == 2
    assert resumed["loss"] == straight["loss"][2:] and resumed["grad_norm"] == straight["grad_norm"][2:]
    assert _merged(world4, "resumed") == _merged(world4, "saving")

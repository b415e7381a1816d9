"""The layout (ParallelDims) on CPU (gloo): HSDP, FSDP2's shard modes and reduce dtype, expert parallelism
with FSDP2 and DDP in every precision under the optimizer CUDA runs (fused AdamW), refusals.

Every layout is compared with the single-process run on the same global batch: bit-for-bit arithmetic
differs only in summation order (FP32: rel 1e-5 as in test_parallel.py); quantized recipes under expert
parallelism quantize each rank's grouped activations over the rows that rank received (a tensor-wise or
block amax over other rows than one process's), so their losses agree to the quantization's noise.
"""

import json
import os
import sqlite3
import subprocess
import sys

import pytest
import torch

import lpbench.train.loop as loop
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.parallel.dims import ParallelDims

BASE = RunConfig(model="tiny", seq_len=32, mbs=8, gbs=8, steps=2, warmup_steps=1, precision="fp32", device="cpu")
MOE = ModelConfig("test-moe-l", 2, 64, 128, 4, 2, 512, n_experts=4, top_k=2, max_seq_len=256)
MOE5 = ModelConfig("test-moe-l5", 5, 64, 128, 4, 2, 512, n_experts=4, top_k=2, max_seq_len=256)  # nvfp4 keeps 4 in BF16
EP_RECIPES = ["bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "mxfp8", "nvfp4"]


def _moe_for(precision: str) -> str:
    return MOE5.name if precision == "nvfp4" else MOE.name


SCENARIOS = {
    2: {
        **{
            f"ep2-{dp}-{p}": dict(model=_moe_for(p), ep=2, mbs=4, precision=p, fsdp=dp == "fsdp")
            for p in ["fp32", *EP_RECIPES]
            for dp in ("fsdp", "ddp")
        },
        "ep2-fsdp-ga-fp32": dict(model=MOE.name, ep=2, mbs=2, fsdp=True),
        "ep2-fsdp-compiled-fp32": dict(model=MOE.name, ep=2, mbs=4, fsdp=True, compile=True),
        # --ep-chunks: the all-to-all of each expert group beside the others' GEMMs (unchunked twin: same name less -chunks)
        "ep2-fsdp-chunks-fp32": dict(model=MOE.name, ep=2, mbs=4, fsdp=True, ep_chunks=2),
        "ep2-ddp-chunks-bf16": dict(model=MOE.name, ep=2, mbs=4, precision="bf16", ep_chunks=2),
        "ep2-fsdp-ga-chunks-fp32": dict(model=MOE.name, ep=2, mbs=2, fsdp=True, ep_chunks=2),
        "ep2-ddp-chunks-fp8-rowwise": dict(model=MOE.name, ep=2, mbs=4, precision="fp8-rowwise", ep_chunks=2),
        "ep2-fsdp-chunks-fp8-tensorwise": dict(
            model=MOE.name, ep=2, mbs=4, precision="fp8-tensorwise", fsdp=True, ep_chunks=2
        ),
        "ep2-ddp-chunks-fp8-delayed": dict(model=MOE.name, ep=2, mbs=4, precision="fp8-delayed", ep_chunks=2),
        "ep2-fsdp-compiled-chunks-fp32": dict(model=MOE.name, ep=2, mbs=4, fsdp=True, compile=True, ep_chunks=2),
        **{f"fsdp-ga-{s}": dict(mbs=1, fsdp=True, fsdp_shard=s) for s in ("zero3", "zero2", "zero1")},
        "fsdp-bf16-reduce": dict(mbs=4, fsdp=True, grad_reduce_dtype="bf16"),
        "ddp-bf16-reduce": dict(mbs=4, grad_reduce_dtype="bf16"),
    },
    4: {
        "hsdp": dict(mbs=2, fsdp=True, dp_replicate=2),
        "hsdp-ga-zero1": dict(mbs=1, fsdp=True, dp_replicate=2, fsdp_shard="zero1"),
        "hsdp-ep2": dict(model=MOE.name, mbs=2, fsdp=True, dp_replicate=2, ep=2),
        "ddp-tp-bf16-reduce": dict(mbs=4, tp=2, grad_reduce_dtype="bf16"),
    },  # FSDP2's replicate under TP
}


def _fused_adamw(real):
    """``build_optimizer`` as CUDA runs call it (fused AdamW), on the CPU."""
    return lambda model, cfg, fused: real(model, cfg, fused=True)


def _count_fsdp_collectives():
    """Count FSDP2's all-gathers and gradient reductions (its internal collectives, by call)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    counts = {"all_gather": 0, "reduce": 0, "a2a_async": 0}
    real_a2a = torch.distributed.all_to_all_single

    def a2a(*args, **kw):
        counts["a2a_async"] += bool(kw.get("async_op"))
        return real_a2a(*args, **kw)

    torch.distributed.all_to_all_single = a2a
    for name, key in (("foreach_all_gather", "all_gather"), ("foreach_reduce", "reduce")):
        real = getattr(group, name)

        def counted(*args, _real=real, _key=key, **kw):
            counts[_key] += 1
            return _real(*args, **kw)

        setattr(group, name, counted)
    return counts


def _mesh_ranks(world: int) -> dict:
    """Ranks of the named sub-meshes of an HSDP x EP layout on 4 ranks."""
    meshes = ParallelDims.of(BASE.with_(model=MOE.name, fsdp=True, dp_replicate=2, ep=2).with_world(world)).mesh("cpu")
    return {name: meshes[name].mesh.tolist() for name in ("dp", "fsdp", "ep", "ep_replicate", "dp_replicate")}


def _worker(rank: int, world: int) -> dict:
    MODELS.update({MOE.name: MOE, MOE5.name: MOE5})
    loop.build_optimizer = _fused_adamw(loop.build_optimizer)
    counts = _count_fsdp_collectives()
    results = {}
    for name, kw in SCENARIOS[world].items():
        counts.update(all_gather=0, reduce=0, a2a_async=0)
        try:
            r = loop.train(BASE.with_(**kw).with_world(world), log=lambda line: None)
        except Exception as exc:  # noqa: BLE001 -- the test names the failure
            results[name] = {"status": "raised", "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        results[name] = {
            "loss": [s["loss"] for s in r.steps],
            "grad_norm": [s["grad_norm"] for s in r.steps],
            "metrics": {k: v for k, v in r.metrics.items() if isinstance(v, (int, float, str, list))},
            "status": r.status,
            "error": r.error,
            "collectives": dict(counts),
        }
    if world == 4:
        results["mesh"] = _mesh_ranks(world)
    return results


@pytest.fixture(scope="module")
def world2(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("layout2"), 2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 4, tmp_path_factory.mktemp("layout4"), 4)


@pytest.fixture(scope="module")
def reference():
    """Single-process runs (torch's default AdamW on the CPU): the whole global batch in one micro-batch."""
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setitem(MODELS, MOE.name, MOE)
        mpatch.setitem(MODELS, MOE5.name, MOE5)
        runs = {"tiny": loop.train(BASE, log=lambda line: None)}
        for p in ["fp32", *EP_RECIPES]:
            runs[f"moe-{p}"] = loop.train(BASE.with_(model=_moe_for(p), precision=p), log=lambda line: None)
        return runs


def _reference_of(kw: dict, reference):
    return reference["tiny"] if "model" not in kw else reference[f"moe-{kw.get('precision', 'fp32')}"]


def _same_training(run: dict, ref, rel_loss: float = 1e-5, rel_norm: float = 1e-4) -> None:
    assert run["status"] == "ok", run.get("error")
    assert run["loss"] == pytest.approx([s["loss"] for s in ref.steps], rel=rel_loss)
    assert run["grad_norm"] == pytest.approx([s["grad_norm"] for s in ref.steps], rel=rel_norm)


@pytest.mark.parametrize("dp", ["fsdp", "ddp"])
@pytest.mark.parametrize("precision", ["fp32", *EP_RECIPES])
def test_expert_parallel_trains_like_one_process_under_fused_adamw(world2, reference, dp, precision):
    name = f"ep2-{dp}-{precision}"
    run, ref = world2[0][name], reference[f"moe-{precision}"]
    assert world2[1][name].get("loss") == run.get("loss")  # every rank reports the global loss
    if precision in ("fp32", "bf16"):  # the same arithmetic: summation order only
        _same_training(
            run, ref, rel_loss=1e-5 if precision == "fp32" else 2e-3, rel_norm=1e-4 if precision == "fp32" else 2e-2
        )
    else:  # each rank's grouped activations quantized over the rows it received (module doc)
        _same_training(run, ref, rel_loss=5e-3, rel_norm=5e-2)
    m = run["metrics"]
    assert (m["ep"], m["fsdp"]) == (2, 2 if dp == "fsdp" else 1)
    assert m["quantized_linears"] > 0 or precision in ("fp32", "bf16")


def test_expert_parallel_with_gradient_accumulation_under_fsdp(world2, reference):
    _same_training(world2[0]["ep2-fsdp-ga-fp32"], reference["moe-fp32"])


@pytest.mark.parametrize("name", [n for n in SCENARIOS[2] if "-chunks" in n])
def test_ep_chunks_are_bit_identical_to_one_exchange(world2, reference, name):
    run, twin = world2[0][name], world2[0][name.replace("-chunks", "")]
    assert run["status"] == "ok", run.get("error")
    assert (run["loss"], run["grad_norm"]) == (twin["loss"], twin["grad_norm"])  # exactly
    kw = SCENARIOS[2][name]
    if kw.get("precision") == "fp8-delayed":  # per-expert dense GEMMs with their histories (Looped): unchunked
        assert run["collectives"]["a2a_async"] == twin["collectives"]["a2a_async"] == 0
        return
    precision = kw.get("precision", "fp32")
    tolerance = {"fp32": (), "bf16": (2e-3, 2e-2)}.get(precision, (5e-3, 5e-2))  # as the unchunked test's
    _same_training(run, reference[f"moe-{precision}"], *tolerance)
    micro = 8 // (2 * kw["mbs"])
    # 2 steps x micro-batches x 2 MoE layers x (2 groups dispatched + 2 combined) x (forward, backward)
    assert run["collectives"]["a2a_async"] == 2 * micro * 2 * 4 * 2
    assert twin["collectives"]["a2a_async"] == 0


def test_compiled_expert_parallel_trains_like_one_process(world2, reference):
    """The blocks compiled around the exchanges (the experts between them in a graph of dynamic size)."""
    _same_training(world2[0]["ep2-fsdp-compiled-fp32"], reference["moe-fp32"])


def test_expert_parallel_logs_tokens_per_rank_and_their_imbalance(world2):
    m = world2[0]["ep2-ddp-fp32"]["metrics"]
    routed = sum(sum(layer) for layer in m["tokens_per_expert"])
    assert len(m["ep_tokens_per_rank"]) == 2 and sum(m["ep_tokens_per_rank"]) == routed == 2 * 8 * 32 * 2 * 2
    # rank r holds experts [2r, 2r+2): its tokens are theirs
    by_rank = [sum(layer[2 * r] + layer[2 * r + 1] for layer in m["tokens_per_expert"]) for r in range(2)]
    assert m["ep_tokens_per_rank"] == by_rank
    assert m["ep_imbalance_max"] >= max(by_rank) * 2 / routed >= 1.0


@pytest.mark.parametrize("shard", ["zero3", "zero2", "zero1"])
def test_fsdp_shard_modes_train_like_one_process(world2, reference, shard):
    _same_training(world2[0][f"fsdp-ga-{shard}"], reference["tiny"])


def test_fsdp_shard_modes_gather_less_and_reduce_once_per_step(world2):
    """GBS 8 = 4 micro-batches of 1 per rank, 2 steps (8 blocks + the root: 9 FSDP groups)."""
    gathers = {s: world2[0][f"fsdp-ga-{s}"]["collectives"]["all_gather"] for s in ("zero3", "zero2", "zero1")}
    reduces = {s: world2[0][f"fsdp-ga-{s}"]["collectives"]["reduce"] for s in ("zero3", "zero2", "zero1")}
    # a step: blocks twice a micro-batch (the last once), or once a micro-batch, or once; the root once
    assert gathers["zero3"] == 2 * (4 * (2 * 7 + 1) + 1)
    assert gathers["zero2"] == 2 * (4 * 8 + 1)
    assert gathers["zero1"] == 2 * 9
    assert set(reduces.values()) == {2 * 9}  # once per group and step in every mode


@pytest.mark.parametrize("name", ["fsdp-bf16-reduce", "ddp-bf16-reduce"])
def test_bf16_gradient_reduction_is_close_and_not_fp32(world2, reference, name):
    run = world2[0][name]
    _same_training(run, reference["tiny"], rel_loss=1e-3, rel_norm=1e-2)  # BF16 rounds each reduced gradient
    assert run["grad_norm"] != pytest.approx([s["grad_norm"] for s in reference["tiny"].steps], rel=1e-7)
    assert run["metrics"]["grad_reduce_dtype"] == "bf16"


def test_bf16_gradient_reduction_under_tp(world4, reference):
    run = world4[0]["ddp-tp-bf16-reduce"]
    _same_training(run, reference["tiny"], rel_loss=1e-3, rel_norm=1e-2)
    assert run["grad_norm"] != pytest.approx([s["grad_norm"] for s in reference["tiny"].steps], rel=1e-7)


@pytest.mark.parametrize("name", [name for name in SCENARIOS[4] if name.startswith("hsdp")])
def test_hsdp_trains_like_one_process(world4, reference, name):
    _same_training(world4[0][name], _reference_of(SCENARIOS[4][name], reference))
    m = world4[0][name]["metrics"]
    assert (m["dp"], m["dp_replicate"], m["dp_shard"]) == (4, 2, 2)


def test_hsdp_mesh_replicates_across_and_shards_within(world4):
    mesh = world4[0]["mesh"]
    assert mesh["fsdp"] == [[0, 1], [2, 3]]  # 2-D: replicas (rows) of shard groups (columns)
    assert mesh["dp"] == [0, 1, 2, 3] and mesh["dp_replicate"] == [0, 2]
    assert mesh["ep"] == [0, 1] and mesh["ep_replicate"] == [0, 2]  # EP inside one shard group


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pp", "2", "--nproc-per-node", "2"], "--pp 2 needs at least 2 micro-batches per step"),
        (["--cp", "2", "--seq-len", "30", "--nproc-per-node", "2"], "--seq-len 30 must be divisible by 4"),
        (["--dp-replicate", "2", "--nproc-per-node", "2"], "--dp-replicate 2 is HSDP's replica count: it needs --fsdp"),
        (
            ["--dp-replicate", "3", "--fsdp", "--nproc-per-node", "4"],
            "--dp-replicate 3 does not divide the data-parallel size 4",
        ),
        (["--dp-replicate", "4", "--fsdp", "--nproc-per-node", "4"], "--dp-replicate 4 leaves no ranks to shard over"),
        (
            ["--model", "tiny-moe", "--ep", "4", "--fsdp", "--dp-replicate", "2", "--nproc-per-node", "4"],
            "--ep 4 must divide the FSDP shard size 2",
        ),
        (["--model", "tiny-moe", "--ep", "4", "--nproc-per-node", "2"], "--ep 4 must divide the data-parallel size 2"),
        (["--model", "tiny-moe", "--ep", "2", "--tp", "2", "--nproc-per-node", "4"], "--tp and --ep do not combine"),
        (["--pp", "0"], "--pp must be positive"),
        (["--ep-chunks", "2", "--nproc-per-node", "2"], "--ep-chunks 2 needs --ep > 1"),
    ],
)
def test_impossible_layouts_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert main(["run", "--mbs", "1", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()


def test_layout_of_a_config():
    dims = ParallelDims.of(BASE.with_(model="tiny-moe", fsdp=True, dp_replicate=2, ep=2).with_world(8))
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.world_size) == (2, 4, 8, 8)
    assert dims.hsdp_enabled and dims.fsdp_enabled and dims.ep_enabled and not dims.ddp_enabled
    assert dims.sizes() == {"pp": 1, "rep": 2, "shard": 2, "ep": 2, "cp": 1, "tp": 1}
    ddp = ParallelDims.of(BASE.with_(model="tiny-moe", ep=2).with_world(4))
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.ddp_enabled) == (4, 1, True)
    assert ddp.sizes()["rep"] * ddp.sizes()["ep"] == 4
    assert BASE.with_(pp=1, cp=1, dp_replicate=1, fsdp_shard="zero3").key() == BASE.key()  # defaults keep keys
    cp = ParallelDims.of(BASE.with_(seq_len=64, cp=2).with_world(8))  # CP shards over every DP x CP rank
    assert (cp.dp_replicate, cp.dp_shard, cp.fsdp_enabled, cp.hsdp_enabled) == (1, 4, True, False)
    alone = ParallelDims.of(BASE.with_(fsdp=True, tp=2).with_world(2))  # --fsdp without data-parallel ranks: no-op
    assert (alone.fsdp_enabled, alone.dp) == (False, 1)
    hsdp = ParallelDims.of(BASE.with_(seq_len=64, cp=2, dp_replicate=2).with_world(8))
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.hsdp_enabled) == (2, 2, True)


def test_tiny_moe_runs_expert_parallel_under_fsdp_from_the_command_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lpbench",
            "run",
            "--model",
            "tiny-moe",
            "--ep",
            "2",
            "--fsdp",
            "--nproc-per-node",
            "2",
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--seq-len",
            "32",
            "--mbs",
            "2",
            "--gbs",
            "8",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 ranks (torchrun) | dp 2 (fsdp) x tp 1 | experts over ep 2 ranks" in out.stdout
    assert out.stdout.count("tokens per ep rank:") == 2
    with sqlite3.connect(tmp_path / "results.db") as db:
        ((metrics,),) = db.execute("SELECT metrics_json FROM runs").fetchall()
    m = json.loads(metrics)
    assert (m["ep"], m["fsdp"]) == (2, 2)
    assert sum(m["ep_tokens_per_rank"]) == 2 * 8 * 32 * 2 * 4  # steps x GBS x seq x top-k x layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dp", ["--fsdp", "--no-fsdp"])
@pytest.mark.parametrize("precision", ["bf16", "fp8-rowwise"])
def test_ep_chunks_are_bit_identical_on_nccl(tmp_path, dp, precision):
    """On CUDA the experts' grouped GEMMs (BF16, FP8 row-wise; their FP32 gradient buffers under accumulation)
    run each group of experts apart, with NCCL's asynchronous all-to-alls: --ep-chunks 2 trains as 1, bit for bit
    in BF16; in FP8 the weight gradients added into FP32 are summed in slices aligned in the grouped buffer, which
    a group's buffer places elsewhere (lpbench.parallel.ep's module doc): the first step's loss bit for bit (the
    forward is), the later ones within rounding."""
    losses = {}
    for chunks in ("1", "2"):
        results = tmp_path / chunks
        argv = ["run", "--model", "tiny-moe", "--ep", "2", dp, "--nproc-per-node", "2", "--precision", precision]
        argv += ["--seq-len", "256", "--mbs", "2", "--gbs", "16", "--steps", "4", "--warmup-steps", "1"]
        argv += ["--ep-chunks", chunks, "--results", str(results)]
        out = subprocess.run([sys.executable, "-m", "lpbench", *argv], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        with sqlite3.connect(results / "results.db") as db:
            losses[chunks] = db.execute("SELECT step, loss, grad_norm FROM steps ORDER BY step").fetchall()
    assert len(losses["1"]) == 4 and losses["2"][0][1] == losses["1"][0][1]  # step 1's loss
    if precision == "bf16":
        assert losses["2"] == losses["1"]
    else:
        assert [s[1:] for s in losses["2"]] == pytest.approx([s[1:] for s in losses["1"]], rel=1e-5)


_MIXED_STEP = """
import os, socket, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from lpbench.config import RunConfig
from lpbench.train.optim import build_optimizer
device = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl" if device == "cuda" else "gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
fully_shard(model[0], mesh=init_device_mesh(device, (1,)))  # DTensors beside plain tensors, as FSDP2 beside EP
model(torch.randn(4, 8, device=device)).square().sum().backward()
before = model[1].weight.detach().clone()
build_optimizer(model, RunConfig(), fused=True).step()
assert not torch.equal(before, model[1].weight)
dist.destroy_process_group()
print("stepped")
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_adamw_steps_fsdp_and_plain_parameters_together(device):
    """The optimizer CUDA runs build, over FSDP2's DTensors and plain parameters (EP's experts)."""
    out = subprocess.run(
        [sys.executable, "-c", _MIXED_STEP, device],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0 and "stepped" in out.stdout, out.stderr[-1500:]


_EIGHT_RANKS = """
import json, sys, warnings
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from lpbench.config import RunConfig
from lpbench.parallel.dims import ParallelDims
dist.init_process_group("fake", store=FakeStore(), rank=int(sys.argv[1]), world_size=8)
out = {}
for name, kw in {"hsdp-ep": dict(model="tiny-moe", fsdp=True, dp_replicate=2, ep=2),
                 "hsdp-tp": dict(fsdp=True, dp_replicate=2, tp=2), "ddp-ep": dict(model="tiny-moe", ep=4),
                 "cp-ep": dict(model="tiny-moe", cp=2, ep=2)}.items():
    meshes = ParallelDims.of(RunConfig(**kw).with_world(8)).mesh("cpu")
    out[name] = {n: None if meshes[n] is None else meshes[n].mesh.tolist()
                 for n in ("dp", "fsdp", "dp_replicate", "ep", "ep_replicate", "tp", "loss")}
print(json.dumps(out))
"""


def test_named_meshes_of_eight_ranks():
    """The rank groups rank 5 of 8 gets (a fake process group: no communication), where HSDP's 2-D mesh is cut
    from dims that were flattened (shard x ep)."""
    out = subprocess.run(
        [sys.executable, "-c", _EIGHT_RANKS, "5"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr[-1500:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["hsdp-ep"]["fsdp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # shard within 4, replicate across
    assert m["hsdp-ep"]["ep"] == [4, 5] and m["hsdp-ep"]["ep_replicate"] == [1, 3, 5, 7]
    assert m["hsdp-ep"]["dp_replicate"] == [1, 5] and m["hsdp-ep"]["tp"] is None
    assert m["hsdp-tp"]["fsdp"] == [[1, 3], [5, 7]] and m["hsdp-tp"]["tp"] == [4, 5]  # TP ranks adjacent
    assert m["hsdp-tp"]["dp"] == m["hsdp-tp"]["loss"] == [1, 3, 5, 7]
    assert m["ddp-ep"]["dp_replicate"] == list(range(8)) and m["ddp-ep"]["fsdp"] is None
    assert m["ddp-ep"]["ep"] == [4, 5, 6, 7] and m["ddp-ep"]["ep_replicate"] == [1, 5]
    assert m["cp-ep"]["ep"] == [5, 7] and m["cp-ep"]["ep_replicate"] == [0, 1, 4, 5]  # CP ranks hold the same experts
    assert m["cp-ep"]["dp"] == [1, 3, 5, 7] and m["cp-ep"]["loss"] == list(range(8))

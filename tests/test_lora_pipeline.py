"""LoRA and SFT under pipeline parallelism (``--pp``) against one process.

CPU, gloo, 2 ranks. Each run trains three steps with two micro-batches on 2 pipeline stages (and on 4, two per
rank, interleaved); the single process trains the same micro-batches with gradient accumulation. Losses and
gradient norms must agree bit for bit: every stage draws its blocks' adapters as the whole model's single
generator does (the other stages' draws skipped), a last stage's own copy of a frozen tied embedding stays
frozen, and packed samples' document ids reach every stage.
"""

import pytest

from lpbench.config import RunConfig

RUN = RunConfig(model="tiny", seq_len=32, mbs=1, gbs=2, steps=3, device="cpu")
RUNS = {
    "lora bf16": dict(workload="lora", precision="bf16"),
    "lora fp8-tensorwise stored vp2": dict(
        workload="lora", precision="fp8-tensorwise", lora_base_storage="quantized", vp=2
    ),
    "lora nvfp4 stored": dict(workload="lora", precision="nvfp4", lora_base_storage="quantized"),
    "lora nvfp4 stored vp2": dict(workload="lora", precision="nvfp4", lora_base_storage="quantized", vp=2),
    "lora nvfp4 vp2": dict(workload="lora", precision="nvfp4", vp=2),
    "sft bf16": dict(workload="sft", precision="bf16"),
}


def _worker(rank: int, world: int) -> dict:
    import lpbench.train.loop as loop

    results = {}
    for name, kw in RUNS.items():
        r = loop.train(RUN.with_(**kw, pp=2).with_world(world), log=lambda line: None)
        results[name] = {"status": r.status, "steps": [(s["loss"], s["grad_norm"]) for s in r.steps]}
    return results


@pytest.fixture(scope="module")
def piped(tmp_path_factory, spawn_ranks):
    return spawn_ranks(_worker, 2, tmp_path_factory.mktemp("lora-pp"), 2)


@pytest.mark.parametrize("name", list(RUNS))
def test_lora_and_sft_on_two_pipeline_stages_train_like_one_process(piped, name, one_thread):
    import lpbench.train.loop as loop

    kw = {k: v for k, v in RUNS[name].items() if k != "vp"}
    ref = loop.train(RUN.with_(**kw), log=lambda line: None)
    assert ref.status == "ok" and all(r[name]["status"] == "ok" for r in piped)
    want = [[s["loss"], s["grad_norm"]] for s in ref.steps]
    assert piped[0][name]["steps"] == piped[1][name]["steps"] == want

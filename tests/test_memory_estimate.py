"""The memory estimator: against a model counted by hand, against the bytes autograd really keeps, and
``lpbench memory``'s output and exit codes."""

import dataclasses

import pytest
import torch

from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.metrics.estimate import block_bytes_per_token, estimate
from lpbench.models import build_model
from lpbench.models.decoder import rope_tables
from lpbench.models.registry import ModelConfig
from lpbench import gemm
from lpbench.precision.recipes import get_recipe
from lpbench.train.workload import prepare_model

# 1 block, D 8, F 16, 2 heads of 4, 1 KV head, vocabulary 32
HAND = ModelConfig("hand", 1, 8, 16, 2, 1, 32, head_dim=4)
# parameters: embeddings 256, attn_norm 8, qkv 16x8 = 128, o 64, mlp_norm 8, gate_up 32x8 = 256, down 128,
# final norm 8, LM head 256: 1112, of which block linears 576 and block 592
PARAMS, LINEARS, BLOCK = 1112, 576, 592
# per token, eager, none: norms 2 x (4*8 input + 4*8 normalized + 4 rstd) = 136; QKV output 2*16, Q 2*8, K 2*4,
# attention output 2*8, log-sum-exp 4*2 = 80; qkv input 2*8; gate_up input 2*8, output 2*32, down input 2*16
EAGER = 136 + 80 + 16 + (16 + 64 + 32)


def test_parts_counted_by_hand():
    e = estimate(HAND, get_recipe("bf16"), seq_len=64, mbs=1, compiled=False, cuda=False)
    # the peak is the loss's backward: every block's activations, the head's three FP32 logit tensors, no
    # gradient yet (the optimizer set them to None), autocast's BF16 weight copies
    assert e.when == "the loss's backward"
    assert e.parts == {
        "master weights (fp32)": 4 * PARAMS,
        "optimizer states (fp32 AdamW)": 8 * PARAMS,
        "weight copies held for backward": 2 * LINEARS,
        "activations (none)": 64 * EAGER,
        "logits and loss": 64 * 32 * 12,
    }
    assert e.total == 12 * PARAMS + 2 * LINEARS + 64 * EAGER + 64 * 32 * 12
    # four tokens: the end of the backward (states, master weights and every FP32 gradient) is the peak
    short = estimate(HAND, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False)
    assert short.when == "the end of the backward" and short.total == 16 * PARAMS
    # the build: FP32 parameters and one parameter's FP32 values drawn whole (the embeddings: 32 x 8)
    assert e.build == 4 * PARAMS + 4 * 256 and e.gb == e.total / 2**30


def test_tensor_parallel_holds_its_share_of_the_vocabularys_logits():
    tp2 = estimate(HAND, get_recipe("bf16"), seq_len=64, mbs=1, tp=2, compiled=False, cuda=False)
    assert tp2.parts["logits and loss"] == 64 * 32 * 12 / 2  # the vocabulary-parallel loss: no gathered logits


def test_tied_embeddings_end_the_backward_with_a_second_gradient_of_the_shared_weight():
    """The head's gradient of a tied weight is its .grad when the embedding's backward makes its own (dense, FP32),
    which autograd then adds in place: at the end of the backward one more vocabulary x width gradient is live."""
    tied = dataclasses.replace(HAND, name="hand-tied", tie_embeddings=True)  # no LM head of its own: 1112 - 256
    e = estimate(tied, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False)
    assert e.when == "the end of the backward"
    assert e.parts["the tied embeddings' second gradient"] == 4 * 32 * 8
    assert e.total == 16 * (PARAMS - 256) + 4 * 32 * 8
    bf16 = estimate(tied, get_recipe("bf16"), seq_len=1, mbs=1, compiled=False, cuda=False, master_weights="bf16")
    assert bf16.parts["the tied embeddings' second gradient"] == 2 * 32 * 8
    untied = estimate(HAND, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False)
    assert "the tied embeddings' second gradient" not in untied.parts


def test_recompute_keeps_what_each_mode_says():
    r = get_recipe("bf16")
    assert block_bytes_per_token(HAND, r, "full") == 4 * 8  # the block input (FP32 residual stream)
    # input, then BF16 QKV output 16, attention output 8, gate_up output 32 + log-sum-exp 2 heads x 4 bytes
    assert block_bytes_per_token(HAND, r, "selective") == 4 * 8 + 2 * (16 + 8 + 32) + 8
    narrow = ModelConfig("hand-v4", 1, 8, 16, 2, 1, 4, head_dim=4)  # HAND with a vocabulary of 4
    params = 4 * 8 + BLOCK + 8 + 4 * 8
    full = estimate(narrow, r, seq_len=64, mbs=1, recompute="full", compiled=False, cuda=False, fused_loss=True)
    # the peak is the last block's rerun: its whole activations again, the LM head's FP32 gradient
    assert full.when == "the last block's rerun"
    assert full.parts == {
        "master weights (fp32)": 4 * params,
        "optimizer states (fp32 AdamW)": 8 * params,
        "gradients so far (LM head)": 4 * 4 * 8,
        "weight copies held for backward": 2 * LINEARS,  # eager: the checkpoint does not free them
        "activations (full)": 64 * 32,
        "one block recomputed": 64 * EAGER,
    }
    # compiled, a recomputed block holds no weight copy (its rerun casts again); the head's logits: 6 bytes each
    compiled = estimate(HAND, r, seq_len=64, mbs=1, recompute="full", cuda=False)
    assert "weight copies held for backward" not in compiled.parts
    assert compiled.when == "the last block's rerun"  # 6 bytes a logit (1536 B per token's 32) < the rerun
    assert compiled.total == 12 * PARAMS + 4 * 256 + 64 * 32 + 64 * block_bytes_per_token(
        HAND, r, "none", compiled=True
    )


def test_fsdp_divides_the_states_and_quantized_linears_keep_code_bytes():
    e = estimate(HAND, get_recipe("bf16"), seq_len=64, mbs=1, dp=4, fsdp=True)
    assert e.parts["optimizer states (fp32 AdamW)"] == 8 * PARAMS / 4
    assert e.parts["FSDP gathered weights"] == 2 * (2 * BLOCK + PARAMS - BLOCK)
    assert "weight copies held for backward" not in e.parts  # FSDP gathers BF16 weights: nothing cast
    f = estimate(HAND, get_recipe("fp8-tensorwise"), seq_len=64, mbs=1, compiled=False, cuda=False)
    assert f.parts["weight copies held for backward"] == LINEARS  # one byte per element (the dgrad copy)
    # the linears keep their inputs' FP8 copies, 1 byte: qkv 8, o 8 (a BF16 view before), gate_up 8, down 16
    assert f.parts["activations (none)"] == 64 * (EAGER - 16 + 8 + 8 - 16 + 8 - 32 + 16)


def test_the_chunked_loss_holds_one_chunk_and_on_cuda_every_logits_bf16_gradient():
    r = get_recipe("bf16")
    cpu = estimate(HAND, r, seq_len=64, mbs=1, compiled=False, cuda=False, fused_loss=True)
    # the input's BF16 gradient (2 x D a token) and one chunk (here every token) of FP32 logits, exp and softmax
    assert cpu.parts["logits and loss"] == 64 * (2 * 8 + 12 * 32)
    big = ModelConfig("hand-128k", 1, 8, 16, 2, 1, 131072, head_dim=4)
    gpu = estimate(big, r, seq_len=8192, mbs=1, fused_loss=True)
    # CUDA: 2048 tokens a chunk (2**28 logits), and the BF16 gradient of all 8192 x 131072 logits
    assert gpu.parts["logits and loss"] == 8192 * 2 * 8 + 12 * 2048 * 131072 + 2 * 8192 * 131072


def test_fsdp_ends_the_backward_with_the_roots_unsharded_gradients_and_their_reduce_scatter_input():
    wide = ModelConfig("hand-v", 1, 8, 16, 2, 1, 256, head_dim=4)  # embeddings and head 2048 each
    params, rest = 2 * 2048 + BLOCK + 8, 2 * 2048 + 8
    e = estimate(wide, get_recipe("bf16"), seq_len=1, mbs=1, dp=4, fsdp=True)
    assert e.when == "the end of the backward"
    assert e.parts == {
        "master weights (fp32)": 4 * params / 4,
        "optimizer states (fp32 AdamW)": 8 * params / 4,
        "gradients (fp32)": 4 * BLOCK / 4,  # the blocks', reduced and sharded
        "the root's gradients (unsharded, reduce-scatter input)": (2 + 4) * rest,  # BF16, and FP32 to reduce
    }


def test_gradient_accumulation_holds_the_earlier_micro_batches_gradients_and_the_weight_cache():
    r = get_recipe("bf16")
    # FSDP: unsharded gradients in the reduction dtype (not divided by the shards); no weight cache
    e = estimate(HAND, r, seq_len=64, mbs=1, dp=4, fsdp=True, grad_accum=2)
    assert e.parts["accumulated gradients"] == 4 * PARAMS
    assert "weight cache (per optimizer step)" not in e.parts
    half = estimate(HAND, r, seq_len=64, mbs=1, dp=4, fsdp=True, grad_accum=2, reduce_bytes=2)
    assert half.parts["accumulated gradients"] == 2 * PARAMS
    # one GPU: FP32 gradients, and the BF16 weight cache the backward reads instead of autocast's copies
    one = estimate(HAND, r, seq_len=64, mbs=1, grad_accum=2)
    assert one.parts["accumulated gradients"] == 4 * PARAMS
    assert one.parts["weight cache (per optimizer step)"] == 2 * LINEARS
    assert "weight copies held for backward" not in one.parts
    # BF16 master weights are what the linears read: nothing to cast, no cache
    half = estimate(HAND, r, seq_len=64, mbs=1, grad_accum=2, master_weights="bf16")
    assert "weight cache (per optimizer step)" not in half.parts and "weight copies held for backward" not in half.parts
    # the fused FP8 linears cache their codes in both layouts: 2 bytes an element, and hold no other copy
    fp8 = estimate(HAND, get_recipe("fp8-tensorwise"), seq_len=64, mbs=1, grad_accum=2)
    assert fp8.parts["weight cache (per optimizer step)"] == 2 * LINEARS
    assert "weight copies held for backward" not in fp8.parts
    fp8_half = estimate(HAND, get_recipe("fp8-tensorwise"), seq_len=64, mbs=1, grad_accum=2, master_weights="bf16")
    assert fp8_half.parts["weight cache (per optimizer step)"] == 2 * LINEARS  # the codes are cached still


def test_fsdp_shard_modes_keep_their_gathered_blocks_and_fp8_all_gather_its_shard_codes():
    four = ModelConfig("hand4", 4, 8, 16, 2, 1, 32, head_dim=4)  # 4 blocks of 592, the same root
    r, root = get_recipe("fp8-tensorwise"), PARAMS - BLOCK
    gathered = {}
    for shard in ("zero3", "zero2", "zero1"):
        e = estimate(four, r, seq_len=64, mbs=1, dp=4, fsdp=True, grad_accum=2, fsdp_shard=shard)
        assert e.when == "the loss's backward"
        gathered[shard] = e.parts["FSDP gathered weights"]
    assert gathered == {
        "zero3": 2 * (2 * BLOCK + root),
        "zero2": 2 * (4 * BLOCK + root),
        "zero1": 2 * (4 * BLOCK + root),
    }
    codes = estimate(HAND, r, seq_len=64, mbs=1, dp=4, fsdp=True, fsdp_fp8_all_gather=True).parts
    assert codes["FP8 all-gather shard codes"] == LINEARS / 4  # one byte a weight element, a quarter each


def test_experts_under_ep_accumulate_their_own_gradients_under_fsdp():
    moe = ModelConfig("hand-moe", 1, 8, 16, 2, 1, 32, head_dim=4, n_experts=4, top_k=2)
    experts = 4 * (32 * 8 + 8 * 16)  # 4 experts: gate_up [32, 8], down [8, 16]
    whole = sum(p.numel() for p in build_model(moe, device="meta").parameters())
    e = estimate(moe, get_recipe("bf16"), seq_len=64, mbs=1, dp=4, fsdp=True, grad_accum=2, ep=4)
    assert e.parts["accumulated gradients"] == 4 * (whole - experts) + 4 * experts / 4  # FSDP's whole, EP's own


def test_cp_splits_the_tokens_shards_the_weights_and_keeps_the_gathered_kv():
    e = estimate(HAND, get_recipe("bf16"), seq_len=128, mbs=1, cp=2, compiled=False, cuda=False)
    assert e.when == "the loss's backward"
    assert e.parts == {
        "master weights (fp32)": 4 * PARAMS / 2,  # FSDP over the 2 CP ranks
        "optimizer states (fp32 AdamW)": 8 * PARAMS / 2,
        "FSDP gathered weights": 2 * (2 * BLOCK + PARAMS - BLOCK),
        "activations (none)": 64 * EAGER,  # 128 tokens / CP 2
        # K and V of the whole sequence: 128 tokens x 1 KV head x 4 dims x 2 (K, V) x 2 bytes, in the one block
        "gathered K/V (CP)": 128 * 4 * 2 * 2,
        "logits and loss": 64 * 32 * 12,  # FSDP: the eager head's three FP32 logit tensors
    }
    full = estimate(HAND, get_recipe("bf16"), seq_len=128, mbs=1, cp=2, recompute="full", compiled=False, cuda=False)
    # its one block recomputed: no gathered K/V kept through the loss's backward (its rerun gathers them again)
    assert full.when == "the loss's backward" and "gathered K/V (CP)" not in full.parts
    assert "gathered K/V (CP)" not in estimate(HAND, get_recipe("bf16"), seq_len=128, mbs=1).parts


def test_packed_samples_hold_their_document_mask_under_cp_for_this_ranks_queries():
    sft = dict(seq_len=256, mbs=2, workload="sft", compiled=False)
    # SDPA's bool mask: a byte per query x key, the queries this rank's 128 of each sequence under CP 2
    assert estimate(HAND, get_recipe("bf16"), cp=2, cuda=False, **sft).parts["document mask"] == 2 * 128 * 256
    assert estimate(HAND, get_recipe("bf16"), cuda=False, **sft).parts["document mask"] == 2 * 256 * 256
    # flex's block tables on CUDA: 16 bytes per 128 x 128 block (1 x 2 under CP 2, 2 x 2 without)
    assert estimate(HAND, get_recipe("bf16"), cp=2, **sft).parts["document mask"] == 2 * 1 * 2 * 16
    assert estimate(HAND, get_recipe("bf16"), **sft).parts["document mask"] == 2 * 2 * 2 * 16
    assert "document mask" not in estimate(HAND, get_recipe("bf16"), seq_len=256, mbs=2, cp=2).parts


def test_lora_base_stored_quantized_is_its_codes_and_adapters_keep_bf16_inputs():
    kw = dict(seq_len=4, mbs=1, workload="lora", lora_rank=2, lora_quantized_base=True, compiled=False, cuda=False)
    e = estimate(HAND, get_recipe("fp8-tensorwise"), **kw)
    # codes 1 byte per block-linear element, the block's norms in BF16, embeddings and head FP32 (frozen)
    base = LINEARS + 2 * (BLOCK - LINEARS) + 4 * (PARAMS - BLOCK)
    assert e.parts["frozen base"] == base
    assert "weight copies held for backward" not in e.parts  # the stored codes are the operands
    # rank 2 adapters on qkv (8 in, 16 out), o (8, 8), gate_up (8, 32), down (16, 8)
    assert e.parts["master weights (fp32)"] == 4 * 2 * (24 + 16 + 40 + 24)
    assert e.parts["activations (none)"] == 4 * EAGER  # frozen linears keep no input, adapters the BF16 one
    # the streamed build: the base as stored and its largest weight (gate+up, 32 x 8) being quantized: its FP32
    # values, their BF16 cast, the scaled and the saturated FP32 values and the FP8 codes, 4 + 2 + 9 bytes an element
    assert e.build == base + (4 + 2 + 9) * 256
    # on 2 ranks (FSDP): each rank's half of the base, allocated at once, and that one whole weight
    two = estimate(HAND, get_recipe("fp8-tensorwise"), **kw, fsdp=True, dp=2)
    assert two.build == base / 2 + (4 + 2 + 9) * 256
    # MXFP8 scales W and Wᵀ along different dims: two stored copies, each 1 + 1/32 bytes an element
    mx = estimate(
        HAND, get_recipe("mxfp8"), seq_len=4, mbs=1, workload="lora", lora_quantized_base=True, compiled=False
    )
    assert mx.parts["frozen base"] == 2 * (1 + 1 / 32) * LINEARS + 2 * (BLOCK - LINEARS) + 4 * (PARAMS - BLOCK)
    # NVFP4: E2M1 codes two to a byte and an E4M3 scale per 16 x 16 weight tile (a 12-block model: its last 4 stay BF16)
    deep = ModelConfig("hand12", 12, 8, 16, 2, 1, 32, head_dim=4)
    nv = estimate(deep, get_recipe("nvfp4"), seq_len=4, mbs=1, workload="lora", lora_quantized_base=True)
    rest = PARAMS - BLOCK
    assert nv.parts["frozen base"] == ((0.5 + 1 / 256) * 8 + 2 * 4) * LINEARS + 12 * 2 * (BLOCK - LINEARS) + 4 * rest


def test_lora_base_sharded_by_fsdp_and_tp_and_gathered_as_its_codes():
    recipe = get_recipe("fp8-tensorwise")
    kw = dict(seq_len=4, mbs=1, workload="lora", lora_rank=2, lora_quantized_base=True, compiled=False, cuda=False)
    e = estimate(HAND, recipe, dp=2, tp=2, fsdp=True, **kw)
    # the frozen base over FSDP's 2 shards x TP's 2 ranks; two blocks gathered as codes (1 byte a linear
    # element, the norms in BF16) and the root's frozen FP32 in BF16, over TP's ranks
    assert e.parts["frozen base"] == (LINEARS + 2 * (BLOCK - LINEARS) + 4 * (PARAMS - BLOCK)) / 4
    assert e.parts["FSDP gathered weights"] == (2 * (LINEARS + 2 * (BLOCK - LINEARS)) + 2 * (PARAMS - BLOCK)) / 2
    bf16 = estimate(HAND, recipe, dp=2, fsdp=True, **{**kw, "lora_quantized_base": False})
    assert bf16.parts["FSDP gathered weights"] == 2 * 2 * BLOCK + 2 * (PARAMS - BLOCK)


@pytest.mark.parametrize(
    "name", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4"]
)
def test_stored_bytes_are_what_a_frozen_base_stores(name):
    from lpbench.metrics.estimate import stored_bytes
    from lpbench.precision.frozen import FrozenQuantizedLinear

    weight = torch.randn(512, 1024)
    stored = FrozenQuantizedLinear(weight, None, get_recipe(name))
    held = sum(p.numel() * p.element_size() for p in stored.parameters()) / weight.numel()
    assert stored_bytes(get_recipe(name)) == pytest.approx(held, abs=0.02)  # per-tensor and per-row scales: ~0
    # by hand: FP8 1 byte (one copy), MXFP8 2 x (1 + 1/32), NVFP4 1/2 + 1/256 (one copy of 16 x 16 tiles)
    assert stored_bytes(get_recipe("mxfp8")) == 2.0625 and stored_bytes(get_recipe("nvfp4")) == 0.5 + 1 / 256


CAL = ModelConfig("cal", 6, 256, 896, 8, 2, 512, max_seq_len=512)  # NVFP4 quantizes blocks 0 and 1


def kept_per_token(precision: str, compiled: bool) -> float:
    """What block 1 keeps for its backward per token, measured: the bytes of the distinct storages autograd
    saves (the block input counted as the FP32 residual stream it is), at two lengths, so weights cancel."""
    model = build_model(CAL, device="cpu")
    prepare_model(
        model,
        RunConfig(model="tiny", precision=precision, device="cpu"),
        get_recipe(precision),
        device=torch.device("cpu"),
        emulate=True,
        use_compile=compiled,
    )
    block = model.layers[1]
    if compiled:
        torch._inductor.config.emulate_precision_casts = True
        torch._dynamo.reset()
        block.compile()

    def saved(S):
        storages = {}
        h = torch.randn(2, S, CAL.dim, requires_grad=True)
        rope = rope_tables(CAL, S, torch.device("cpu"))
        with (
            torch.autograd.graph.saved_tensors_hooks(
                lambda t: storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                lambda t: t,
            ),
            torch.autocast("cpu", torch.bfloat16),
        ):
            out = block(h, rope)
        for t in (h, *rope):
            storages.pop(t.untyped_storage().data_ptr(), None)
        out.float().sum().backward()
        return sum(storages.values())

    saved(32)
    return (saved(128) - saved(64)) / (2 * 64) + 4 * CAL.dim


@pytest.mark.parametrize("precision", ["bf16", "fp8-tensorwise", "mxfp8", "nvfp4"])
def test_activation_formula_equals_what_autograd_keeps(precision, monkeypatch):
    monkeypatch.setattr(gemm, "_route", "bf16")  # torch's BF16 GEMMs, as on a GPU (not the FP32 route)
    assert kept_per_token(precision, False) == block_bytes_per_token(CAL, get_recipe(precision), "none")


def test_compiled_activation_formula_equals_what_autograd_keeps(monkeypatch):
    monkeypatch.setattr(gemm, "_route", "bf16")
    assert kept_per_token("bf16", True) == block_bytes_per_token(CAL, get_recipe("bf16"), "none", compiled=True)


def test_memory_command_says_whether_it_fits_and_what_would(capsys):
    argv = [
        "memory",
        "--model",
        "llama3-8b",
        "--seq-len",
        "8192",
        "--mbs",
        "1",
        "--gbs",
        "4",
        "--precision",
        "bf16",
        "--gpu",
        "h100",
        "--num-gpus",
        "4",
        "--fsdp",
    ]
    ga = [("8" if flag == "--gbs" else a) for flag, a in zip([""] + argv, argv)]
    assert main(ga) == 1  # GBS 8 on 4 GPUs: the accumulated unsharded gradients do not fit
    out = capsys.readouterr().out
    assert "predicted peak:" in out and "does not fit h100" in out and "would fit with: --recompute full" in out
    assert main(argv[:-3]) == 1  # one GPU: 16 bytes of states per parameter alone do not fit; more GPUs would
    assert "GPUs with --fsdp" in capsys.readouterr().out
    assert main(["memory", "--model", "tiny", "--precision", "bf16", "--gpu", "h100"]) == 0
    assert "fits h100" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", "tiny", "--recompute", "some"])
    assert exc.value.code == 2


GPU_RUNS = {
    "bf16 none": dict(precision="bf16"),
    "bf16 selective": dict(precision="bf16", recompute="selective"),
    "bf16 full": dict(precision="bf16", recompute="full"),
    "fp8-tensorwise none": dict(precision="fp8-tensorwise"),
    "bf16 GA 2": dict(precision="bf16", gbs=4),
    "lora fp8 base stored quantized": dict(
        precision="fp8-tensorwise", workload="lora", lora_base_storage="quantized", recompute="full"
    ),
}
# the estimator's known miss on this small model (benchmarks/RESULTS.md, 2026-11-27 19:24: the LoRA row predicts
# 5.5 GB for 4.2 measured): strict, so the test says when a fix makes it pass
UNDER = pytest.mark.xfail(strict=True, reason="the estimator misses this run's peak by over 10 % (issue 36)")
MISSES = ("lora fp8 base stored quantized",)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [pytest.param(run, id=name, marks=UNDER if name in MISSES else ()) for name, run in GPU_RUNS.items()]
)
def test_gpu_prediction_is_within_ten_percent_of_the_measured_peak(case):
    """A compiled llama3.2-1b run on CUDA (16 blocks, so that the blocks, not the head, hold most of the
    activations, as in the models the estimator is for): the step's predicted peak within 10 % of
    ``torch.cuda.max_memory_allocated`` over the steps, and (LoRA) the streamed build's within 10 % of its own."""
    from lpbench.train.loop import train

    cfg = RunConfig(
        model="llama3.2-1b",
        seq_len=2048,
        mbs=2,
        **{"gbs": 2, **case},
        steps=3,
        warmup_steps=1,
        eval_every=0,
        device="cuda",
        emulate=True,
    )
    result = train(cfg, log=lambda line: None)
    assert result.status == "ok", result.error
    m = result.metrics
    assert abs(m["predicted_peak_gb"] / m["peak_mem_allocated_gb"] - 1) <= 0.10, m
    if cfg.workload == "lora":
        assert abs(m["predicted_build_peak_gb"] / m["build_peak_gb"] - 1) <= 0.10, m


def test_a_lora_build_peaks_at_the_embeddings_where_they_outweigh_the_blocks():
    wide = ModelConfig("wide-vocab", 1, 8, 16, 2, 1, 4096, head_dim=4)  # embeddings and head 32768 each
    e = estimate(wide, get_recipe("fp8-tensorwise"), seq_len=4, mbs=1, workload="lora", lora_quantized_base=True)
    rest = 2 * 4096 * 8 + 8
    assert e.build == 4 * rest + 4 * 4096 * 8  # the FP32 embeddings and their values drawn whole


# 1 block, D 256, F 256, 2 heads of 128, 1 KV head, vocabulary 32: every matrix holds whole blocks of 256
WIDE = ModelConfig("wide", 1, 256, 256, 2, 1, 32, head_dim=128)
# matrices (blockwise fp8/8bit states): embeddings 32x256 = 8192, qkv 512x256 = 131072, o 65536, gate_up 131072,
# down 65536, LM head 8192: 409600; vectors (FP32 states): 3 norms of 256 = 768
MATRICES, VECTORS = 409600, 768
WIDE_BLOCK, WIDE_REST = 256 + 131072 + 65536 + 256 + 131072 + 65536, 8192 + 256 + 8192


@pytest.mark.parametrize(
    "states,per_matrix_element",
    [("fp32", 8), ("bf16", 4), ("fp8", 2 + 2 * 4 / 256), ("8bit", 2 + 2 * 4 / 256)],
)
def test_optimizer_states_and_master_weights_counted_by_hand(states, per_matrix_element):
    e = estimate(WIDE, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False, optimizer_states=states)
    vector_bytes = 8 if states in ("fp8", "8bit") else per_matrix_element  # too small for blocks: FP32
    assert e.parts[f"optimizer states ({states} AdamW)"] == per_matrix_element * MATRICES + vector_bytes * VECTORS
    assert e.parts["master weights (fp32)"] == 4 * (MATRICES + VECTORS)
    b = estimate(WIDE, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False, master_weights="bf16")
    assert b.when == "the end of the backward"  # 4 tokens: the gradients outweigh the activations
    assert b.parts["master weights (bf16)"] == b.parts["gradients (bf16)"] == 2 * (MATRICES + VECTORS)
    # 4096 tokens: the peak is the loss's backward, where the blocks hold autocast's BF16 casts of FP32 weights
    long = dict(seq_len=4096, mbs=1, compiled=False, cuda=False)
    fp32, bf16 = (estimate(WIDE, get_recipe("bf16"), master_weights=w, **long) for w in ("fp32", "bf16"))
    assert fp32.when == bf16.when == "the loss's backward"
    assert fp32.parts["weight copies held for backward"] == 2 * (WIDE_BLOCK - 2 * 256)  # the block's linears
    assert "weight copies held for backward" not in bf16.parts  # BF16 weights: autocast makes no copies


def test_offloaded_optimizer_leaves_the_gathered_bf16_blocks_on_the_gpu():
    e = estimate(WIDE, get_recipe("bf16"), seq_len=4, mbs=1, offload_optimizer=True, optimizer_states="8bit")
    assert not [k for k in e.parts if k.startswith(("master weights", "gradients", "optimizer states"))], e.parts
    assert estimate(WIDE, get_recipe("bf16"), seq_len=4, mbs=1, optimizer_states="8bit").parts["master weights (fp32)"]
    assert e.parts["FSDP gathered weights"] == 2 * (2 * WIDE_BLOCK + WIDE_REST)  # in use, prefetched, and the root


def test_memory_suggests_the_optimizer_settings_for_one_gpu(capsys):
    argv = ["memory", "--model", "llama3-8b", "--seq-len", "8192", "--mbs", "1", "--precision", "bf16", "--gpu", "h100"]
    assert main([*argv, "--recompute", "full", "--fused-loss"]) == 1
    out = capsys.readouterr().out
    assert "--master-weights bf16 --optimizer-states 8bit" in out or "--offload-optimizer" in out
    assert (
        main([*argv, "--recompute", "full", "--fused-loss", "--master-weights", "bf16", "--optimizer-states", "8bit"])
        == 0
    )
    assert "fits h100" in capsys.readouterr().out


def test_the_header_hints_zero1_where_its_prediction_fits_the_gpu():
    """FSDP2 accumulating under zero3: the hint names zero1 where its prediction fits 90 % of the GPU (llama3-8b@16L
    at seq 8192 on 2 ranks: about 81 GB, so an H200 and not an H100), never without accumulation, with
    zero1 asked for already, under a pipeline or where the GPU's memory is unknown."""
    from lpbench.train.memory_plan import fsdp_shard_hint, predict

    cfg = RunConfig(model="llama3-8b", num_layers=16, seq_len=8192, mbs=1, gbs=16, fsdp=True).with_world(2)
    zero1 = predict(cfg.with_(fsdp_shard="zero1"), "h200").gb
    assert 0.9 * 79.2 < zero1 < 0.9 * 139.8  # the two cards' memory in GB (metrics/hardware.py)
    hint = fsdp_shard_hint(cfg, "h200")
    assert hint.startswith("hint: --fsdp-shard zero1") and f"{zero1:.1f} of 139.8 GB" in hint
    assert fsdp_shard_hint(cfg, "h100") is None
    assert fsdp_shard_hint(cfg, None) is None
    assert fsdp_shard_hint(cfg.with_(gbs=2), "h200") is None  # GA 1: nothing gathered twice
    assert fsdp_shard_hint(cfg.with_(fsdp_shard="zero1"), "h200") is None
    assert fsdp_shard_hint(cfg.with_(fsdp=False), "h200") is None  # DDP
    assert hint.endswith("(add --grad-reduce-dtype bf16 to halve its gradient reduce-scatter)")
    assert "grad-reduce-dtype" not in fsdp_shard_hint(cfg.with_(grad_reduce_dtype="bf16"), "h200")


def test_the_hint_names_bf16_reduction_where_zero1_fits_only_with_it():
    """The full llama3-8b on 2 ranks: zero1 with FP32 gradient reduction is predicted above 90 % of an H200, with
    BF16 reduction below it, so the hint names the two flags together; with BF16 reduction asked for already,
    zero1 is named alone."""
    from lpbench.train.memory_plan import fsdp_shard_hint, predict

    cfg = RunConfig(model="llama3-8b", seq_len=8192, mbs=1, gbs=16, fsdp=True).with_world(2)
    fp32 = predict(cfg.with_(fsdp_shard="zero1"), "h200").gb
    bf16 = predict(cfg.with_(fsdp_shard="zero1", grad_reduce_dtype="bf16"), "h200").gb
    assert bf16 <= 0.9 * 139.8 < fp32
    hint = fsdp_shard_hint(cfg, "h200")
    assert hint.startswith("hint: --fsdp-shard zero1 --grad-reduce-dtype bf16 ") and f"({bf16:.1f} of 139.8 GB)" in hint
    assert fsdp_shard_hint(cfg.with_(grad_reduce_dtype="bf16"), "h200").startswith("hint: --fsdp-shard zero1 would")
    assert fsdp_shard_hint(cfg, "h100") is None


def test_memory_names_zero1_where_it_fits(capsys):
    argv = ["memory", "--model", "llama3-8b", "--num-layers", "16", "--seq-len", "8192", "--mbs", "1", "--gbs", "16"]
    argv += ["--fsdp", "--num-gpus", "2"]
    assert main([*argv, "--gpu", "h200"]) == 0
    assert "fits h200" in (out := capsys.readouterr().out) and "hint: --fsdp-shard zero1" in out
    assert main([*argv, "--gpu", "h200", "--fsdp-shard", "zero1"]) == 0
    assert "hint" not in capsys.readouterr().out


HAND4 = ModelConfig("hand4", 4, 8, 16, 2, 1, 32, head_dim=4)  # HAND with 4 blocks


@pytest.mark.parametrize(
    "vp, chunks",
    [
        (1, 2 * 2),  # 1F1B, PP 2: rank 0 keeps p - r = 2 micro-batches of its 2 blocks
        (2, 5 * 1),  # VP 2: stages of 1 block; rank 0 keeps (v-1)p + 2(p-1) + 1 = 5 stage-chunks
    ],
)
def test_pipeline_rank_keeps_the_micro_batches_its_schedule_has_in_flight(vp, chunks):
    """Rank 0 (the peak here): its chunks' activations, and each chunk's output, the FP32 hidden states it sent on
    (4 tokens x D 8 x 4 bytes), held for its backward; one receive posted ahead per stage; no head."""
    kw = dict(seq_len=4, mbs=1, grad_accum=4, compiled=False, cuda=False)
    e = estimate(HAND4, get_recipe("bf16"), pp=2, vp=vp, **kw)
    assert e.parts["activations (none)"] == 4 * EAGER * chunks  # 4 tokens a micro-batch, per block kept
    assert e.parts["stage outputs held for backward"] == 4 * 8 * 4 * chunks / (2 // vp)  # 1F1B: a chunk = 2 blocks
    assert e.parts["receive buffers posted ahead"] == 4 * 8 * 4 * vp
    assert "logits and loss" not in e.parts  # the first rank, the peak here, has no head
    # its 2 blocks' weights and the embedding, not the LM head (the final norm, a vector, counted on every rank)
    assert e.parts["master weights (fp32)"] == 4 * (2 * BLOCK + 256 + 8)


def test_pipeline_ranks_count_the_blocks_of_the_split():
    """Each rank is counted with its own blocks: 3 on rank 0 (2 micro-batches in flight), or 3 on the last rank (1
    in flight, and the logits), whichever peaks."""
    kw = dict(seq_len=4, mbs=1, grad_accum=4, compiled=False, cuda=False)
    first = estimate(HAND4, get_recipe("bf16"), pp=2, vp=1, pp_rank_blocks=[3, 1], **kw)
    assert first.parts["activations (none)"] == 4 * EAGER * 3 * 2 and "logits and loss" not in first.parts
    assert first.parts["master weights (fp32)"] == 4 * (3 * BLOCK + 256 + 8)  # the embedding, not the head
    last = estimate(HAND4, get_recipe("bf16"), pp=2, vp=1, pp_rank_blocks=[1, 3], **kw)
    assert last.parts["activations (none)"] == 4 * EAGER * 3 and last.parts["logits and loss"] > 0
    assert last.parts["master weights (fp32)"] == 4 * (3 * BLOCK + 8 + 256)  # the head, not the embedding
    # a middle rank of PP 3 holds neither; tied embeddings: the first and the last rank each hold a copy
    middle = estimate(HAND4, get_recipe("bf16"), pp_ends=(False, False), **kw)
    assert middle.parts["master weights (fp32)"] == 4 * (4 * BLOCK + 8)
    tied = dataclasses.replace(HAND4, tie_embeddings=True)
    assert estimate(tied, get_recipe("bf16"), pp_ends=(False, True), **kw).parts["master weights (fp32)"] == 4 * (
        4 * BLOCK + 8 + 256
    )


def test_the_predicted_peak_follows_the_runs_split():
    from lpbench.config import RunConfig
    from lpbench.train.memory_plan import predict, report

    cfg = RunConfig(model="llama3-8b", seq_len=8192, mbs=1, gbs=32, pp=2, fsdp=True, precision="bf16").with_world(4)
    assert "x pp 2 (blocks 17,15) |" in report(cfg, "h100")[0][0]  # `lpbench memory`'s first line
    balanced, even = predict(cfg).total, predict(cfg.with_(pp_split="even")).total
    assert balanced == predict(cfg.with_(pp_split="17,15")).total  # llama3-8b's balanced split at PP 2
    assert even == predict(cfg.with_(pp_split="16,16")).total and even < balanced  # rank 0 holds one block more


def test_pipeline_rank_keeps_the_gathered_kv_of_its_chunks_in_flight():
    """PP 2 x CP 2: rank 0 keeps 2 micro-batches of its 2 blocks, each with the whole sequence's K and V in BF16:
    2 bytes x (K, V) x 1 KV head x head_dim 4 x 8 tokens = 128 bytes a block, 4 blocks' worth in flight."""
    kw = dict(seq_len=8, mbs=1, grad_accum=4, compiled=False, cuda=False, cp=2)
    e = estimate(HAND4, get_recipe("bf16"), pp=2, vp=1, **kw)
    assert e.parts["gathered K/V (CP)"] == 2 * 2 * 1 * 4 * 8 * 4


def test_split_backward_pipeline_stages_keep_their_blocks_gathered_as_zero2():
    """Under zero-bubble and zbv (CP 2 beside them: FSDP2) a stage's blocks stay gathered from forward to backward
    (lpbench.parallel.pp.stage_fsdp_shard): the prediction is zero2's; interleaved 1F1B keeps zero3's two blocks."""
    from lpbench.train.memory_plan import predict

    cfg = RunConfig(model="tiny", seq_len=64, mbs=1, gbs=4, pp=2, vp=2, cp=2).with_world(4)

    def gathered(**kw):
        return predict(cfg.with_(**kw), "h100").parts["FSDP gathered weights"]

    for schedule in ("zero-bubble", "zbv"):
        assert gathered(pp_schedule=schedule) == gathered(pp_schedule=schedule, fsdp_shard="zero2")
    assert gathered(pp_schedule="zero-bubble") == gathered(fsdp_shard="zero2") > gathered()

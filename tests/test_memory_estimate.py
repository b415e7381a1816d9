"""The memory estimator: against a model counted by hand, against the bytes autograd really keeps, and
``lpbench memory``'s output and exit codes."""

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
    e = estimate(HAND, get_recipe("bf16"), seq_len=4, mbs=1, compiled=False, cuda=False)
    assert e.parts == {
        "master weights (fp32)": 4 * PARAMS,
        "gradients (fp32)": 4 * PARAMS,
        "optimizer states (fp32 AdamW)": 8 * PARAMS,
        "weight copies held for backward": 2 * LINEARS,
        "activations (none)": 4 * EAGER,
        "logits and loss": 4 * 32 * 14,
    }
    assert e.total == 16 * PARAMS + 2 * LINEARS + 4 * EAGER + 4 * 32 * 14


def test_recompute_keeps_what_each_mode_says():
    r = get_recipe("bf16")
    assert block_bytes_per_token(HAND, r, "full") == 4 * 8  # the block input (FP32 residual stream)
    # input, then BF16 QKV output 16, attention output 8, gate_up output 32 + log-sum-exp 2 heads x 4 bytes
    assert block_bytes_per_token(HAND, r, "selective") == 4 * 8 + 2 * (16 + 8 + 32) + 8
    full = estimate(HAND, r, seq_len=4, mbs=1, recompute="full", compiled=False, cuda=False).parts
    assert full["activations (full)"] == 4 * 32 and full["one block recomputed"] == 4 * EAGER


def test_fsdp_divides_the_states_and_quantized_linears_keep_code_bytes():
    e = estimate(HAND, get_recipe("bf16"), seq_len=4, mbs=1, dp=4, fsdp=True)
    assert e.parts["optimizer states (fp32 AdamW)"] == 8 * PARAMS / 4
    assert e.parts["FSDP gathered weights"] == 2 * (2 * BLOCK + PARAMS - BLOCK)
    assert "weight copies held for backward" not in e.parts or not e.parts["weight copies held for backward"]
    f = estimate(HAND, get_recipe("fp8-tensorwise"), seq_len=4, mbs=1, compiled=False, cuda=False)
    assert f.parts["weight copies held for backward"] == LINEARS  # one byte per element (the dgrad copy)
    # the linears keep their inputs' FP8 copies, 1 byte: qkv 8, o 8 (a BF16 view before), gate_up 8, down 16
    assert f.parts["activations (none)"] == 4 * (EAGER - 16 + 8 + 8 - 16 + 8 - 32 + 16)


def test_lora_base_stored_quantized_is_its_codes_and_adapters_keep_bf16_inputs():
    e = estimate(
        HAND,
        get_recipe("fp8-tensorwise"),
        seq_len=4,
        mbs=1,
        workload="lora",
        lora_rank=2,
        lora_quantized_base=True,
        compiled=False,
        cuda=False,
    )
    # codes 1 byte per block-linear element, the block's norms in BF16, embeddings and head FP32 (frozen)
    assert e.parts["frozen base"] == LINEARS + 2 * (BLOCK - LINEARS) + 4 * (PARAMS - BLOCK)
    assert not e.parts["weight copies held for backward"]  # the stored codes are the operands
    # rank 2 adapters on qkv (8 in, 16 out), o (8, 8), gate_up (8, 32), down (16, 8)
    assert e.parts["master weights (fp32)"] == 4 * 2 * (24 + 16 + 40 + 24)
    assert e.parts["activations (none)"] == 4 * EAGER  # frozen linears keep no input, adapters the BF16 one


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
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "predicted peak:" in out and "does not fit h100" in out and "--recompute selective" in out
    assert main(argv[:-3]) == 1  # one GPU: 16 bytes of states per parameter alone do not fit; on the CPU they would
    assert "would fit with: --offload-optimizer" in capsys.readouterr().out
    assert main(["memory", "--model", "tiny", "--precision", "bf16", "--gpu", "h100"]) == 0
    assert "fits h100" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--model", "tiny", "--recompute", "some"])
    assert exc.value.code == 2


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
    assert b.parts["master weights (bf16)"] == b.parts["gradients (bf16)"] == 2 * (MATRICES + VECTORS)
    assert not b.parts["weight copies held for backward"]  # BF16 weights: autocast makes no copies


def test_offloaded_optimizer_leaves_the_gathered_bf16_blocks_on_the_gpu():
    e = estimate(WIDE, get_recipe("bf16"), seq_len=4, mbs=1, offload_optimizer=True, optimizer_states="8bit")
    assert (
        e.parts["master weights (fp32)"] == e.parts["gradients (fp32)"] == e.parts["optimizer states (8bit AdamW)"] == 0
    )
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

import pytest

from lpbench.metrics.flops import days_to_train, flops_per_token, tflops_per_gpu
from lpbench.metrics.hardware import detect_gpu, mfu, peak_tflops
from lpbench.models import MODELS


def test_nemo_legacy_reproduces_nemo_table_llama3_8b():
    # NeMo's performance summary: Llama3-8B, seq 8192, 33,099 tokens/s/GPU <-> 1,917 TFLOP/s/GPU.
    fpt = flops_per_token(MODELS["llama3-8b"], 8192, "nemo-legacy")
    assert tflops_per_gpu(fpt, 33099) == pytest.approx(1917, rel=0.005)


@pytest.mark.parametrize("gpu,tokens,tflops", [("gb200", 19275, 1598), ("b200", 15457, 1282)])
def test_nemo_legacy_reproduces_nemo_table_mixtral_8x7b(gpu, tokens, tflops):
    # NeMo's performance summaries (25.04 on GB200, 25.02 on B200): Mixtral-8x7B on 64 GPUs, the recommended
    # row's layout; FLOPs counted on the top-2 experts a token uses.
    from lpbench.bench.recommended import lookup

    row = lookup("mixtral-8x7b", gpu, 64)
    assert (row.seq_len, row.mbs, row.gbs, row.ep) == (4096, 2, 256, 8)
    fpt = flops_per_token(MODELS[row.name], row.seq_len, "nemo-legacy")
    assert tflops_per_gpu(fpt, tokens) == pytest.approx(tflops, rel=0.001)


def test_mha_reproduces_nemotron4_recipe():
    fpt = flops_per_token(MODELS["nemotron4-15b"], 4096, "mha")
    assert fpt * 4096 == pytest.approx(434.5e12, rel=0.001)


def test_megatron_formula_by_hand_llama3_8b():
    h, L, V, s, ffn, q, kv = 4096, 32, 128256, 8192, 14336, 4096, 1024
    expected = 18 * h * ffn * L + 6 * (h * (q + 2 * kv) + q * h) * L + 6 * q * s * L + 6 * h * V
    assert flops_per_token(MODELS["llama3-8b"], s) == expected
    # The causal discount makes megatron smaller than nemo-legacy at long sequences.
    assert flops_per_token(MODELS["llama3-8b"], s) < flops_per_token(MODELS["llama3-8b"], s, "nemo-legacy")


def test_moe_counts_top_k_experts():
    mix = MODELS["mixtral-8x7b"]
    dense = flops_per_token(mix.__class__(**{**mix.__dict__, "n_experts": 0}), 4096)
    mlp_one = 18 * mix.dim * mix.ffn_dim * mix.n_layers
    assert flops_per_token(mix, 4096) == pytest.approx(dense + mlp_one)


def test_gpu_detection_and_mfu():
    assert detect_gpu("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert detect_gpu("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert detect_gpu("NVIDIA GB200").name == "GB200"
    assert detect_gpu("NVIDIA B200").name == "B200"
    assert detect_gpu("NVIDIA H200").bf16 == 989
    assert detect_gpu("Tesla T4") is None
    assert peak_tflops(detect_gpu("NVIDIA A100-SXM4-80GB"), "fp8") is None
    assert mfu(494.5, peak_tflops(detect_gpu("NVIDIA H100 80GB HBM3"), "bf16")) == pytest.approx(0.5)
    assert mfu(100.0, None) is None


def test_days_to_train():
    assert days_to_train(86400 * 1000 * 8, 1000, 8) == pytest.approx(1.0)

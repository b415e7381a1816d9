"""Streamed builds: a one-process model built on the meta device, converted, then materialized block by block
equals the model built whole (eager) bit for bit; a LoRA base stored quantized never has more than one block in
high precision; an HF checkpoint is read one parameter at a time and loads as the whole load does."""

import gc
import weakref

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.models import build_model
from lpbench.models.hf import export_hf_checkpoint, hf_values, load_hf_checkpoint
from lpbench.parallel import plan
from lpbench.precision.frozen import FrozenQuantizedLinear
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.recipes import get_recipe
from lpbench.train.workload import prepare_model

CPU = torch.device("cpu")


def built(cfg: RunConfig, device: str):
    """``cfg``'s model built on ``device`` (cpu: whole; meta: streamed by prepare_model), converted."""
    model = build_model(cfg.model_config(), device=device, seed=cfg.seed)
    prepare_model(model, cfg, get_recipe(cfg.precision), device=CPU, emulate=True, use_compile=False)
    return model


def assert_same(eager, streamed):
    a, b = eager.state_dict(), streamed.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert [type(m) for m in eager.modules()] == [type(m) for m in streamed.modules()]
    assert not any(t.is_meta for t in streamed.state_dict().values())
    if eager.cfg.tie_embeddings:
        assert streamed.lm_head.weight is streamed.tok_embeddings.weight


CASES = {
    "dense, tied embeddings": RunConfig(model="tiny", num_layers=3, device="cpu"),
    "dense, fp8-delayed": RunConfig(model="tiny", num_layers=3, precision="fp8-delayed", device="cpu"),
    "moe": RunConfig(model="tiny-moe", num_layers=2, precision="mxfp8", device="cpu"),
    "untied head": RunConfig(model="llama3.2-1b", num_layers=1, vocab_size=512, device="cpu"),
    "lora, bf16 base": RunConfig(model="tiny", num_layers=3, workload="lora", device="cpu"),
    "lora moe": RunConfig(model="tiny-moe", num_layers=2, workload="lora", precision="fp8-tensorwise", device="cpu"),
    **{
        f"lora, {p} base stored quantized": RunConfig(
            model="tiny", num_layers=6, workload="lora", lora_base_storage="quantized", precision=p, device="cpu"
        )
        for p in ("fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4")
    },
}


@pytest.mark.parametrize("case", CASES)
def test_streamed_build_equals_the_whole_build(case):
    cfg = CASES[case]
    eager, streamed = built(cfg, "cpu"), built(cfg, "meta")
    assert_same(eager, streamed)
    if cfg.lora_base_storage == "quantized":
        assert any(isinstance(m, FrozenQuantizedLinear) for m in streamed.modules())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(eager(x, x.roll(-1, 1)), streamed(x, x.roll(-1, 1)))


def test_a_quantized_base_is_never_in_high_precision_more_than_one_weight_at_a_time(monkeypatch):
    cfg = CASES["lora, nvfp4 base stored quantized"]
    model = build_model(cfg.model_config(), device="meta", seed=cfg.seed)
    values, live, frozen_on_meta = plan.initial_values, [], []

    def watched(*args, **kwargs):  # weak references to every whole value handed out
        frozen_on_meta.append(sum(isinstance(m, FrozenQuantizedLinear) for m in model.modules()))
        for name, full in values(*args, **kwargs):
            gc.collect()
            live.append(sum(ref() is not None for ref in refs))  # earlier values still alive
            refs.append(weakref.ref(full))
            yield name, full
            del full

    refs = []
    monkeypatch.setattr(plan, "initial_values", watched)
    prepare_model(model, cfg, get_recipe(cfg.precision), device=CPU, emulate=True, use_compile=False)
    kept = get_recipe(cfg.precision).last_bf16_layers  # NVFP4 keeps its last blocks in BF16, unquantized
    quantized = len(model.layers) - kept
    assert quantized >= 2 and frozen_on_meta[0] == 4 * quantized  # stored quantized before any value exists
    assert live and max(live) == 0  # each whole value freed before the next is read
    assert not any(isinstance(m, QuantizedLinear) for m in model.layers[:quantized].modules())
    assert not any(p.dtype == torch.bfloat16 for p in model.layers[:quantized].parameters() if p.ndim == 2)


HF = {
    "tied": dict(model="tiny", num_layers=2),
    "untied": dict(model="llama3.2-1b", num_layers=1, vocab_size=512),
    "qwen3-moe": None,  # saved by transformers: stacked experts assembled from one tensor per expert
}


def _qwen3_moe_checkpoint(path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)


@pytest.mark.parametrize("case", HF)
def test_hf_values_read_one_parameter_at_a_time_and_equal_the_whole_load(tmp_path, monkeypatch, case):
    path = tmp_path / "hf"
    if HF[case] is None:
        _qwen3_moe_checkpoint(path)
    else:
        cfg = RunConfig(**HF[case], device="cpu", seed=7)
        export_hf_checkpoint(build_model(cfg.model_config(), device="cpu", seed=7), path, torch.bfloat16)
    whole = load_hf_checkpoint(path)
    from safetensors import safe_open

    reads = []
    opened = safe_open

    class Counting:
        def __init__(self, *a, **k):
            self.inner = opened(*a, **k)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, key):
            reads.append(key)
            return self.inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr("safetensors.safe_open", Counting)
    params = dict(whole.named_parameters())
    it = hf_values(path, whole.cfg)
    names = []
    for name, full in it:
        names.append(name)
        assert torch.equal(full, params[name]), name
        # what has been read so far is this parameter's tensors and the earlier ones', nothing later
        later = {k for k, (lp, _, _) in _wmap(whole.cfg).items() if lp.partition("[")[0] not in names}
        assert not later & set(reads), name
    assert names == list(params)
    # the streamed build (meta, block by block) from the checkpoint equals the whole load
    cfg = RunConfig(model="hf:hf", hf_checkpoint=str(path), device="cpu")
    monkeypatch.undo()
    streamed = build_model(cfg.model_config(), device="meta")
    prepare_model(streamed, cfg, get_recipe("bf16"), device=CPU, emulate=True, use_compile=False)
    for name, p in streamed.named_parameters():
        assert torch.equal(p, params[name]), name


def _wmap(cfg):
    from lpbench.models.hf import hf_weight_map

    return hf_weight_map(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense, fp8-delayed", "lora, fp8-tensorwise base stored quantized"])
def test_gpu_streamed_build_equals_the_whole_build(case):
    """On CUDA (the generator on the GPU, native kernels where the GPU has them) as on the CPU."""
    cfg = CASES[case].with_(device="cuda")
    models = []
    for device in ("cuda", "meta"):
        model = build_model(cfg.model_config(), device=device, seed=cfg.seed)
        prepare_model(
            model, cfg, get_recipe(cfg.precision), device=torch.device("cuda"), emulate=True, use_compile=False
        )
        models.append(model)
    assert_same(*models)


@pytest.mark.gpu
def test_gpu_quantized_base_build_peak_is_the_stored_base_plus_one_weight(monkeypatch):
    """A LoRA base stored in FP8, built streamed on CUDA: the allocator's peak is far below the BF16 base
    alone, and within 10 % of the estimator's build peak."""
    from lpbench.metrics.estimate import GB
    from lpbench.models import MODELS
    from lpbench.models.registry import ModelConfig
    from lpbench.train.memory_plan import predict

    monkeypatch.setitem(MODELS, "gpu-build", ModelConfig("gpu-build", 16, 2048, 8192, 16, 8, 1024, family="llama"))
    cfg = RunConfig(
        model="gpu-build", workload="lora", lora_base_storage="quantized", precision="fp8-tensorwise", device="cuda"
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = build_model(cfg.model_config(), device="meta", seed=cfg.seed)
    prepare_model(model, cfg, get_recipe(cfg.precision), device=torch.device("cuda"), emulate=True, use_compile=False)
    peak = (torch.cuda.max_memory_allocated() - before) / GB
    bf16_base = 2 * sum(p.numel() for p in build_model(cfg.model_config(), device="meta").layers.parameters()) / GB
    assert peak < 0.8 * bf16_base, (peak, bf16_base)
    predicted = predict(cfg, torch.cuda.get_device_name()).build_gb
    assert abs(predicted / peak - 1) <= 0.10, (predicted, peak)

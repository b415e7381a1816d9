"""The convert layer: which converters a run gets, and that the SwiGLU converter changes kernels, not numbers."""

import dataclasses

import pytest
import torch

from lpbench.config import RunConfig
from lpbench.convert import MainGrads, Quantize, SwiGLU, WeightCache, converters_for
from lpbench.models import MODELS, build_model
from lpbench.models.moe import silu_mul
from lpbench.precision.kernels import swiglu
from lpbench.precision.recipes import get_recipe

MOE = dataclasses.replace(MODELS["tiny"], n_layers=1, vocab_size=128, n_experts=4, top_k=2)


@pytest.mark.parametrize("gbs, scope, cached", [(2, "block", False), (4, "block", True), (4, "model", False)])
def test_caches_only_with_accumulation_outside_one_whole_graph(gbs, scope, cached):
    cfg = RunConfig(model="tiny", precision="fp8-rowwise", mbs=2, gbs=gbs, compile_scope=scope)
    out = converters_for(cfg, get_recipe(cfg.precision), torch.device("cpu"), True, use_compile=True)
    assert isinstance(out[0], SwiGLU) and out.find(Quantize) is not None
    assert (out.find(WeightCache) is not None, out.find(MainGrads) is not None) == (cached, cached)


def test_swiglu_converter_gives_the_kernel_the_same_numbers():
    """The model's ``silu(g) * u`` and the converted model's SwiGLU (its hand-written backward where it runs, eager
    autograd's ops on a CPU): identical loss and gradients, dense MLP and experts alike."""
    cfg = dataclasses.replace(MOE, n_layers=2)
    results = []
    for convert in (False, True):
        model = build_model(cfg, device="cpu", seed=0)
        experts = model.layers[0].mlp.experts
        assert experts.act is silu_mul
        if convert:
            SwiGLU().convert(model)
            assert experts.act is swiglu.swiglu
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, tokens)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_swiglu_converter_gives_dense_mlps_the_epilogue_route():
    model = build_model(dataclasses.replace(MODELS["tiny"], n_layers=1), device="cpu", seed=0)
    SwiGLU().convert(model)
    assert model.layers[0].mlp.activate is swiglu.swiglu_of

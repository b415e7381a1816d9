"""Recipes as data and the layer policy: which linears are quantized, native vs emulated."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lpbench.errors import UsageError
from lpbench.convert.quantize import apply_recipe
from lpbench.precision import RECIPES, get_recipe
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.capability import native_supported
from lpbench.precision.recipes import Recipe


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_up, self.down = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


class MoE(nn.Module):
    def __init__(self, d, f, n=2):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(MLP(d, f) for _ in range(n))

    def forward(self, x):
        w = self.router(x).softmax(-1)
        return sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, d, f, moe=False):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn, self.mlp = Attn(d), (MoE(d, f) if moe else MLP(d, f))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Toy(nn.Module):
    def __init__(self, n_layers=2, d=64, f=128, vocab=64, moe_last=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, moe=moe_last and i == n_layers - 1) for i in range(n_layers))
        self.norm, self.lm_head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def test_every_linear_in_the_blocks_is_swapped_except_routers():
    model = Toy(n_layers=2, moe_last=True)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    out = apply_recipe(model, RECIPES["mxfp8"], device="cpu", emulate=True)
    assert out["path"] == "emulated" and out["skipped"] == []
    assert out["quantized"] == [
        "layers.0.attn.qkv", "layers.0.attn.o", "layers.0.mlp.gate_up", "layers.0.mlp.down",
        "layers.1.attn.qkv", "layers.1.attn.o",
        "layers.1.mlp.experts.0.gate_up", "layers.1.mlp.experts.0.down",
        "layers.1.mlp.experts.1.gate_up", "layers.1.mlp.experts.1.down",
    ]  # fmt: skip
    assert isinstance(model.layers[1].mlp.experts[1].down, QuantizedLinear)
    assert type(model.layers[1].mlp.router) is nn.Linear and type(model.lm_head) is nn.Linear
    assert list(model.state_dict()) == keys  # checkpoints stay interchangeable
    assert all(p is params[n] for n, p in model.named_parameters())  # optimizer references stay valid
    loss = model(torch.randint(0, 64, (2, 8))).logsumexp(-1).mean()
    loss.backward()
    assert model.layers[1].mlp.experts[0].down.weight.grad is not None


def test_first_and_last_layers_stay_bf16():
    model = Toy(n_layers=6)
    out = apply_recipe(model, RECIPES["nvfp4"], device="cpu", emulate=True)  # keeps the last 4
    assert {n.split(".")[1] for n in out["quantized"]} == {"0", "1"}
    model = Toy(n_layers=6)
    r = dataclasses.replace(RECIPES["fp8-tensorwise"], first_bf16_layers=1, last_bf16_layers=2)
    out = apply_recipe(model, r, device="cpu", emulate=True)
    assert {n.split(".")[1] for n in out["quantized"]} == {"1", "2", "3"}
    assert type(model.layers[0].attn.qkv) is nn.Linear and type(model.layers[5].mlp.down) is nn.Linear
    with pytest.warns(UserWarning, match="no linear was quantized"):
        apply_recipe(Toy(n_layers=4), RECIPES["nvfp4"], device="cpu", emulate=True)


def test_non_dividing_dims_are_skipped_with_a_warning():
    model = Toy(n_layers=1, d=64, f=48)  # 48 is not a multiple of 32 (mxfp8 block)
    with pytest.warns(UserWarning, match="layers.0.mlp.down"):
        out = apply_recipe(model, RECIPES["mxfp8"], device="cpu", emulate=True)
    assert out["skipped"] == ["layers.0.mlp.down"]
    assert "layers.0.mlp.gate_up" in out["quantized"]  # 64 -> 96 divides
    assert type(model.layers[0].mlp.down) is nn.Linear


def test_no_native_path_on_cpu_without_emulate():
    with pytest.raises(UsageError, match="--emulate"):
        apply_recipe(Toy(), RECIPES["fp8-tensorwise"], device="cpu", emulate=False)
    assert not native_supported(RECIPES["fp8-tensorwise"], "cpu")
    assert native_supported(RECIPES["bf16"], "cpu")


def test_unquantized_recipes_change_nothing():
    model = Toy()
    out = apply_recipe(model, "bf16", device="cpu", emulate=False)
    assert out == {"path": "native", "quantized": [], "skipped": [], "why_emulated": None}
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_model_without_layers():
    with pytest.raises(ValueError, match="model.layers"):
        apply_recipe(nn.Linear(64, 64), RECIPES["mxfp8"], device="cpu", emulate=True)


def test_recipes_are_data():
    expected = {"bf16", "fp32", "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-rowwise-gw-hp",
                "fp8-rowwise-fast-grads", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4"}  # fmt: skip
    assert set(RECIPES) == expected
    assert RECIPES["fp32"].compute_dtype == torch.float32
    caps = {n: r.native_capability for n, r in RECIPES.items()}
    assert caps["fp8-tensorwise"] == caps["fp8-delayed"] == (8, 9)
    assert caps["fp8-rowwise"] == caps["fp8-blockwise"] == (9, 0)
    assert caps["mxfp8"] == caps["nvfp4"] == (10, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["mxfp8"].block = 16
    with pytest.raises(UsageError, match="valid"):
        get_recipe("fp6")
    with pytest.raises(ValueError, match="pow2"):
        Recipe("x", "", scaling="block", block=128)
    with pytest.raises(ValueError, match="scaling"):
        Recipe("x", "", scaling="int8")


def test_recipe_operands():
    tw = RECIPES["fp8-tensorwise"]
    assert tw.operand("grad", "dgrad").fmt.name == "e5m2" and tw.operand("input", "fprop").fmt.name == "e4m3"
    e4m3_only = dataclasses.replace(tw, grad_format="e4m3")
    assert e4m3_only.operand("grad", "wgrad").fmt.name == "e4m3"
    assert RECIPES["fp8-rowwise-gw-hp"].operand("grad", "wgrad") is None
    assert RECIPES["fp8-rowwise-gw-hp"].operand("grad", "dgrad").block == (1, None)
    nv = RECIPES["nvfp4"]
    assert nv.operand("weight", "fprop").block == nv.operand("weight", "dgrad").block == (16, 16)
    assert nv.operand("grad", "wgrad").stochastic and not nv.operand("input", "wgrad").stochastic
    assert not dataclasses.replace(nv, stochastic_grads=False).operand("grad", "dgrad").stochastic
    assert dataclasses.replace(nv, weight_block_2d=False).operand("weight", "fprop").block == (1, 16)
    assert RECIPES["fp8-blockwise"].operand("weight", "fprop").block == (128, 128)
    assert RECIPES["fp8-blockwise"].operand("input", "wgrad").block == (1, 128)
    assert RECIPES["fp8-delayed"].operand("input", "fprop").scaling == "tensor"
    assert (
        dataclasses.replace(RECIPES["mxfp8"], mx_scale_rounding="floor").operand("input", "fprop").mx_rounding
        == "floor"
    )
    assert RECIPES["bf16"].operand("input", "fprop") is None
    with pytest.raises(ValueError, match="role"):
        nv.operand("bias", "fprop")


def train(recipe: str, d: int, steps=25, seed=0):
    torch.manual_seed(seed)
    model = Toy(n_layers=2, d=d, f=128, vocab=64)
    out = apply_recipe(model, dataclasses.replace(get_recipe(recipe), last_bf16_layers=0), device="cpu", emulate=True)
    assert len(out["quantized"]) == (8 if get_recipe(recipe).quantized else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(seed))  # memorised
    losses = []
    for step in range(steps):
        batch = data[step % 2 :: 2]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@functools.cache
def bf16_losses(d):
    return train("bf16", d)


@pytest.mark.parametrize("name", [n for n, r in RECIPES.items() if r.quantized])
def test_tiny_model_learns_in_every_recipe(name):
    d = max(64, RECIPES[name].dim_multiple)
    losses, ref = train(name, d), bf16_losses(d)
    assert losses[-1] < 0.6 * losses[0]
    assert abs(losses[-1] - ref[-1]) < 0.1 * ref[0]

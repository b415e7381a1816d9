"""``--backend torchao``: which recipes torchao runs where, and that its MXFP8 linear quantizes as lpbench does.

torchao's MXFP8 emulation runs on CPU, so its cast and its linear are compared with lpbench's here;
its NVFP4 training linear needs a Blackwell GPU (checked by the refusals below).
"""

import pytest
import torch

from lpbench.errors import UsageError
from lpbench.convert.quantize import apply_recipe
from lpbench.precision.linear import QuantizedLinear
from lpbench.precision.quantize import quantize_mx
from tests.test_policy import Toy


@pytest.fixture
def capability(monkeypatch):
    def fake(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return fake


def test_torchao_refuses_in_one_line_where_it_cannot_run(capability):
    with pytest.raises(UsageError, match="fp8-blockwise is lpbench-only"):
        apply_recipe(Toy(), "fp8-blockwise", device="cpu", emulate=True, backend="torchao")
    with pytest.raises(
        UsageError,
        match=r"runs fp8-tensorwise on a CUDA GPU \(torchao's Float8Linear: native from "
        r"compute capability 8.9, emulated below\); cpu has none: use --backend lpbench",
    ):
        apply_recipe(Toy(), "fp8-tensorwise", device="cpu", emulate=True, backend="torchao")
    with pytest.raises(UsageError, match="unknown backend 'te'"):
        apply_recipe(Toy(), "fp8-tensorwise", device="cpu", emulate=True, backend="te")
    capability((9, 0))
    with pytest.raises(
        UsageError,
        match=r"runs nvfp4 only on compute capability 10.x: torchao 0.18's NVFP4Linear has "
        r"no emulated mode \(KernelPreference.TRITON only: Triton casts that use SM "
        r"10.x FP4 conversions, cuBLAS NVFP4 GEMMs\); cuda has compute capability 9.0: "
        "use --backend lpbench, which emulates it",
    ):
        apply_recipe(Toy(), "nvfp4", device="cuda", emulate=True, backend="torchao")
    with pytest.raises(UsageError, match="emulates MXFP8 .* on compute capability 9.0; pass --emulate"):
        apply_recipe(Toy(), "mxfp8", device="cuda", emulate=False, backend="torchao")


def test_cli_refuses_torchao_nvfp4_on_cpu_with_exit_2(capsys, tmp_path):
    pytest.importorskip("torchao")  # without it, the run is refused for that first (the test below)
    from lpbench.cli import main

    assert (
        main(
            [
                "run",
                "--model",
                "tiny",
                "--precision",
                "nvfp4",
                "--backend",
                "torchao",
                "--steps",
                "2",
                "--warmup-steps",
                "1",
                "--results",
                str(tmp_path),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "runs nvfp4 only on compute capability 10.x: torchao 0.18's NVFP4Linear has no emulated mode" in err[0]
        and "cpu is not a CUDA GPU: use --backend lpbench" in err[0]
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--precision", "nvfp4", "--seq-len", "96", "--mbs", "1", "--gbs", "1"],
            "--backend torchao nvfp4 needs MBS x seq len a multiple of 128 (its wgrad blocks run along the tokens), got 96",
        ),
        (["--precision", "mxfp8", "--seq-len", "48", "--mbs", "1", "--gbs", "1"], "a multiple of 32"),
    ],
)
def test_cli_refuses_torchao_mx_runs_it_cannot_shape(argv, message, capsys, tmp_path):
    from lpbench.cli import main

    assert main(["run", "--model", "tiny", "--backend", "torchao", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_torchao_missing_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """Without torchao installed, ``--backend torchao`` is one line and exit 2 before training, not a run
    recorded as an error (issue 41, class 5)."""
    import importlib.util

    from lpbench.cli import main

    import lpbench.train.loop as loop

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find(name, *a))
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    assert (
        main(
            [
                "run",
                "--model",
                "tiny",
                "--precision",
                "mxfp8",
                "--emulate",
                "--backend",
                "torchao",
                "--steps",
                "2",
                "--warmup-steps",
                "1",
                "--results",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lpbench run: error: --backend torchao needs torchao: pip install 'lpbench[torchao]'"]
    assert not (tmp_path / "r").exists()


def test_an_older_torchao_is_named(monkeypatch):
    pytest.importorskip("torchao")
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if "moe_training" in name else find(name, *a)
    )
    with pytest.raises(UsageError, match=r"mxfp8 needs torchao 0.18 or later \(torchao.prototype.moe_training"):
        apply_recipe(Toy(), "mxfp8", device="cpu", emulate=True, backend="torchao")


def test_torchao_mx_runs_take_no_tensor_parallelism(monkeypatch):
    import importlib.util

    from lpbench.convert.torchao import run_problem

    find = importlib.util.find_spec  # as if torchao were installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchao" else find(name, *a))

    assert run_problem("mxfp8", 4096, 2) == "--backend torchao runs mxfp8 without tensor parallelism (--tp 1)"
    assert run_problem("nvfp4", 4096, 1) is None and run_problem("fp8-rowwise", 96, 2) is None


def test_torchaos_mxfp8_cast_equals_lpbenchs_reference_bit_for_bit():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(64, 256, generator=g)
        * 2.0 ** torch.randint(-20, 20, (64, 8), generator=g).float().repeat_interleave(32, 1)
    ).bfloat16()
    x[3, :32] = 0  # an all-zero block
    scale, codes = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    ref = quantize_mx(x)
    assert torch.equal(codes.view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8).reshape(ref.scale.shape), ref.scale.view(torch.uint8))


def test_torchao_mxfp8_linears_replace_the_same_linears():
    pytest.importorskip("torchao")
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    torch.manual_seed(0)
    lp, ao = Toy(d=64, f=128), Toy(d=64, f=128)
    ao.load_state_dict(lp.state_dict())
    info_lp = apply_recipe(lp, "mxfp8", device="cpu", emulate=True)
    info_ao = apply_recipe(ao, "mxfp8", device="cpu", emulate=True, backend="torchao")
    assert info_ao["path"] == "emulated" and "emulates MXFP8" in info_ao["why_emulated"]
    assert info_ao["quantized"] == info_lp["quantized"] and info_ao["quantized"]
    assert all(isinstance(ao.get_submodule(n), MXFP8Linear) for n in info_ao["quantized"])
    assert all(isinstance(lp.get_submodule(n), QuantizedLinear) for n in info_lp["quantized"])
    assert ao.layers[0].attn.qkv.weight is ao.get_submodule("layers.0.attn.qkv").weight  # parameters kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ao(torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1)))
    y.float().pow(2).mean().backward()
    assert y.dtype == torch.bfloat16 and ao.layers[0].attn.qkv.weight.grad.dtype == torch.float32


def test_torchao_mxfp8_linear_computes_what_lpbenchs_does():
    """Same input, BF16-exact weight and output gradient: the three GEMMs see the same codes and scales, so y and dX
    are bit-equal and dW differs only by torchao's BF16 rounding of it."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    lp, ao = Toy(n_layers=1), Toy(n_layers=1)
    lp.load_state_dict({k: v.bfloat16().float() for k, v in lp.state_dict().items()})  # torchao casts W to BF16 first
    ao.load_state_dict(lp.state_dict())
    apply_recipe(lp, "mxfp8", device="cpu", emulate=True)
    apply_recipe(ao, "mxfp8", device="cpu", emulate=True, backend="torchao")
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 64, 128, generator=g).bfloat16(), torch.randn(2, 64, 64, generator=g).bfloat16()
    outs = []
    for model in (lp, ao):
        mod = model.layers[0].mlp.down
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(xi)
        y.backward(dy)
        outs.append((y.float(), xi.grad.float(), mod.weight.grad))
    (y_lp, dx_lp, dw_lp), (y_ao, dx_ao, dw_ao) = outs
    assert torch.equal(y_ao, y_lp) and torch.equal(dx_ao, dx_lp)
    assert ((dw_ao - dw_lp).norm() / dw_lp.norm()).item() < 4e-3  # torchao rounds dW to BF16, lpbench keeps FP32

"""``--emulate``: allowed where the device lacks a format (on), refused there (off), or forced everywhere (always).

The dispatch runs on a faked device capability: Hopper's FP8 recipes and Blackwell's MXFP8/NVFP4 go native
unless forced; forced emulation computes what the emulated path computes, bit for bit.
"""

import dataclasses
import re

import pytest
import torch

from lpbench.bench.sweep_spec import expand
from lpbench.cli import build_parser, configs_from_args, main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.convert.quantize import apply_recipe
from lpbench.precision import get_recipe
from lpbench.precision.capability import FORCED, emulation_reason
from lpbench.precision.linear import QuantizedLinear
from tests.test_policy import Toy

NATIVE_ON = [
    ((9, 0), "fp8-tensorwise"),
    ((9, 0), "fp8-delayed"),
    ((9, 0), "fp8-rowwise"),
    ((9, 0), "fp8-rowwise-gw-hp"),
    ((9, 0), "fp8-blockwise"),
    ((10, 0), "mxfp8"),
    ((10, 0), "nvfp4"),
]


@pytest.fixture
def capability(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # fp8-blockwise's native GEMM needs cuBLAS from CUDA 12.9

    def fake(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    return fake


def _recipe(name):
    """The recipe with every block quantized (the toy has 2; nvfp4 keeps its last 4 in BF16)."""
    return dataclasses.replace(get_recipe(name), first_bf16_layers=0, last_bf16_layers=0)


def _toy():
    return Toy(d=128, f=128)  # every width a multiple of fp8-blockwise's 128


def _paths(model) -> set:
    return {m.native for m in model.modules() if isinstance(m, QuantizedLinear)}


# ---------------------------------------------------------------- the dispatch


@pytest.mark.parametrize("cap,name", NATIVE_ON)
def test_native_unless_forced(cap, name, capability):
    capability(cap)
    for emulate in (False, True):  # a device that has the format runs it natively, allowed to emulate or not
        model = _toy()
        info = apply_recipe(model, _recipe(name), device="cuda", emulate=emulate)
        assert (info["path"], info["why_emulated"], _paths(model)) == ("native", None, {True})
    model = _toy()
    info = apply_recipe(model, _recipe(name), device="cuda", emulate="always")
    assert (info["path"], info["why_emulated"], _paths(model)) == ("emulated", FORCED, {False})
    assert info["quantized"] and FORCED == "--emulate always (this device runs it natively)"


@pytest.mark.parametrize(
    "cap,name,reason",
    [
        ((9, 0), "mxfp8", "it needs compute capability 10.0, this GPU has 9.0"),
        ((9, 0), "nvfp4", "it needs compute capability 10.0, this GPU has 9.0"),
        ((8, 0), "fp8-tensorwise", "it needs compute capability 8.9, this GPU has 8.0"),
        (
            (10, 0),
            "fp8-blockwise",
            "its native GEMM (torch's F.scaled_mm, cuBLAS from CUDA 12.9) runs on Hopper (SM 9.x) only; this GPU has 10.0",
        ),
    ],
)
def test_a_device_without_the_format_gives_its_own_reason_when_forced(cap, name, reason, capability):
    capability(cap)
    with pytest.raises(
        UsageError, match=rf"precision {name} cannot run natively on cuda: {re.escape(reason)}.*pass --emulate"
    ):
        apply_recipe(_toy(), _recipe(name), device="cuda", emulate=False)
    for emulate in (True, "always"):
        model = _toy()
        info = apply_recipe(model, _recipe(name), device="cuda", emulate=emulate)
        assert info["path"] == "emulated" and info["why_emulated"].startswith(reason) and _paths(model) == {False}


def test_cpu_and_bf16_under_always():
    assert emulation_reason(get_recipe("fp8-tensorwise"), "cpu", "always") == "cpu has no low-precision GEMMs"
    info = apply_recipe(_toy(), "bf16", device="cpu", emulate="always")  # nothing quantized: nothing to emulate
    assert info == {"path": "native", "quantized": [], "skipped": [], "why_emulated": None}


@pytest.mark.parametrize(
    "cap,name",
    [
        ((9, 0), "fp8-tensorwise"),
        ((9, 0), "fp8-delayed"),
        ((9, 0), "fp8-rowwise"),
        ((9, 0), "fp8-blockwise"),
        ((10, 0), "mxfp8"),
        ((10, 0), "nvfp4"),
    ],
)
def test_forced_emulation_computes_what_the_emulated_path_computes(cap, name, capability):
    """A forced model on a faked GPU and an emulated one (CPU) from the same weights: the same loss, output and
    gradients, bit for bit, over two steps (delayed scaling's histories included; NVFP4's stochastic rounding
    drawn from the same seed)."""
    torch.manual_seed(0)
    forced, emulated = _toy(), _toy()
    emulated.load_state_dict(forced.state_dict())
    capability(cap)
    apply_recipe(forced, _recipe(name), device="cuda", emulate="always")
    apply_recipe(emulated, _recipe(name), device="cpu", emulate=True)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (forced, emulated):
        torch.manual_seed(2)
        outs = []
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(tokens)
            y.float().pow(2).mean().backward()
            outs += [y.detach(), *(p.grad.clone() for p in model.parameters())]
        results.append(outs)
    assert len(results[0]) == len(results[1]) > 2
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------- torchao


@pytest.mark.parametrize(
    "cap,name,native",
    [
        ((9, 0), "fp8-tensorwise", True),
        ((9, 0), "fp8-rowwise", True),
        ((8, 0), "fp8-tensorwise", False),
        ((10, 0), "mxfp8", True),
        ((9, 0), "mxfp8", False),
    ],
)
def test_torchao_path_forced_and_allowed(cap, name, native, capability):
    from lpbench.convert.torchao import path

    capability(cap)
    device = torch.device("cuda")
    if native:
        assert path(get_recipe(name), device, False) == path(get_recipe(name), device, True) == ("native", None)
    kind, reason = path(get_recipe(name), device, "always")
    assert kind == "emulated" and (reason.endswith(FORCED) if native else FORCED not in reason)
    assert ("Float8LinearConfig.emulate" if name.startswith("fp8") else "KernelPreference.EMULATED") in reason


def test_torchao_fp8_emulates_through_float8linearconfig(capability):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    capability((9, 0))
    for emulate, path in ((False, "native"), ("always", "emulated")):
        model = _toy()
        info = apply_recipe(model, "fp8-tensorwise", device="cuda", emulate=emulate, backend="torchao")
        linears = [model.get_submodule(n) for n in info["quantized"]]
        assert info["path"] == path and linears and all(isinstance(m, Float8Linear) for m in linears)
        assert {m.config.emulate for m in linears} == {path == "emulated"}
    capability((8, 0))
    with pytest.raises(
        UsageError,
        match=r"its native GEMMs need compute capability 8.9, this GPU has 8.0; "
        "pass --emulate",
    ):
        apply_recipe(_toy(), "fp8-tensorwise", device="cuda", emulate=False, backend="torchao")


def test_torchao_refuses_to_emulate_nvfp4_in_one_line(capability):
    capability((10, 0))
    with pytest.raises(
        UsageError,
        match=r"^--backend torchao cannot emulate nvfp4 \(--emulate always\): torchao "
        r"0.18's NVFP4Linear has no emulated mode .*use --backend lpbench",
    ):
        apply_recipe(_toy(), "nvfp4", device="cuda", emulate="always", backend="torchao")


# ---------------------------------------------------------------- one setting, declared once


def _run(*flags):
    return configs_from_args(build_parser().parse_args(["run", "--precision", "fp8-tensorwise", *flags]))[0]


def test_run_flag_config_file_and_sweep_key(tmp_path):
    assert [
        _run(*f).emulate for f in ([], ["--emulate"], ["--emulate", "always"], ["--emulate=always"], ["--no-emulate"])
    ] == [None, True, "always", "always", False]
    assert RunConfig(emulate=True).key() != RunConfig(emulate="always").key()
    spec = tmp_path / "run.yaml"
    spec.write_text("emulate: always\n")
    assert _run("--config", str(spec)).emulate == "always"
    assert _run("--config", str(spec), "--no-emulate").emulate is False  # the command line wins
    runs = expand({"name": "s", "model": "tiny", "precision": "fp8-tensorwise", "emulate": [True, "always"]}).runs
    assert [r.config.emulate for r in runs] == [True, "always"]
    converge = next(
        a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "converge" in a.choices
    ).choices["converge"]
    assert converge.parse_args(["--emulate", "always"]).emulate == "always"
    assert converge.parse_args([]).emulate is True


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--emulate", "sometimes"], "argument --emulate: invalid choice: 'sometimes' (choose from 'always')"),
    ],
)
def test_bad_emulate_flag_exits_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--precision", "fp8-tensorwise", *argv, "--results", str(tmp_path)])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bad_emulate_value_in_a_file_or_spec(tmp_path, capsys):
    spec = tmp_path / "run.yaml"
    spec.write_text("emulate: sometimes\n")
    assert main(["run", "--config", str(spec), "--results", str(tmp_path)]) == 2
    assert "emulate: expected bool or always, got 'sometimes'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--emulate is on, off or always, got 'sometimes'"):
        RunConfig(emulate="sometimes").validate()


# ---------------------------------------------------------------- on a Hopper GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["lpbench", "torchao"])
@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp"])
def test_forced_emulation_on_the_gpu_is_the_native_result_up_to_rounding(name, backend):
    """Native and forced-emulated runs of the same linears on a GPU that has FP8 GEMMs: the same output and
    gradients up to the native GEMMs' fast accumulation, summation order and BF16 output rounding."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a GPU with native FP8 row-wise GEMMs (compute capability 9.0)")
    if backend == "torchao":
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    native, forced = Toy(d=256, f=512).cuda(), Toy(d=256, f=512).cuda()
    forced.load_state_dict(native.state_dict())
    assert apply_recipe(native, name, device="cuda", emulate=False, backend=backend)["path"] == "native"
    info = apply_recipe(forced, name, device="cuda", emulate="always", backend=backend)
    assert info["path"] == "emulated" and info["why_emulated"].endswith(FORCED)
    tokens = torch.randint(0, 64, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    results = []
    for model in (native, forced):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(tokens)
        y.float().pow(2).mean().backward()
        results.append([y.float(), *(p.grad for p in model.parameters())])
    assert not torch.equal(results[0][0], results[1][0])  # two paths ran, not one twice
    # E5M2 gradients (fp8-tensorwise; 2 mantissa bits): the paths' small differences in y flip some of their
    # roundings, so the norms' weight gradients moved by up to 3.9 % on an H200 (E4M3 ones stayed under 2 %)
    tolerance = 6e-2 if get_recipe(name).grad_format == "e5m2" else 2e-2
    assert ((results[0][0] - results[1][0]).norm() / results[1][0].norm()).item() < 2e-2
    for got, want in zip(*results):
        assert ((got - want).norm() / want.norm()).item() < tolerance

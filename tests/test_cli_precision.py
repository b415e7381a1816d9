import json

import pytest

from lpbench.cli import main


def test_recipes_lists_every_recipe_with_its_path(capsys):
    assert main(["recipes", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {
        "bf16",
        "fp8-tensorwise",
        "fp8-delayed",
        "fp8-rowwise",
        "fp8-rowwise-gw-hp",
        "fp8-blockwise",
        "mxfp8",
        "nvfp4",
    } <= set(rows)
    assert rows["nvfp4"]["params"]["last_bf16_layers"] == "4"
    assert rows["mxfp8"]["path"] == "emulated"  # no CPU (nor Hopper) has MX GEMMs


def test_quant_error_orders_formats_by_precision(capsys):
    assert (
        main(
            [
                "quant-error",
                "--precision",
                "fp8-tensorwise,mxfp8,nvfp4",
                "--role",
                "input",
                "--distribution",
                "gaussian",
                "--shape",
                "128",
                "256",
                "--json",
            ]
        )
        == 0
    )
    sqnr = {r["recipe"]: r["sqnr_db"] for r in json.loads(capsys.readouterr().out)}
    assert sqnr["mxfp8"] > sqnr["nvfp4"] + 6  # 3 mantissa bits vs 1: far more than 6 dB apart
    assert 25 < sqnr["fp8-tensorwise"] < 40


def test_quant_error_pads_nvfp4_blocks(capsys):
    """NVFP4 zero-pads a shape its blocks do not divide, as Transformer Engine does."""
    assert main(["quant-error", "--precision", "nvfp4", "--shape", "100", "100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 9 and all(0.02 < r["rel_error"] < 0.3 for r in rows)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["quant-error", "--precision", "fp9"], "unknown precision 'fp9'"),
        (["quant-error", "--role", "bias"], "unknown role 'bias'"),
        (["quant-error", "--shape", "3"], "--shape takes two positive integers"),
        (
            ["quant-error", "--precision", "mxfp8", "--shape", "100", "100"],
            "mxfp8 input: shape (100, 100) is not divisible by the 1x32 quantization block",
        ),
    ],
)
def test_quant_error_bad_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_every_recipe_runs_from_the_cli_on_cpu(tmp_path, capsys):
    names = "bf16,fp8-tensorwise,fp8-delayed,fp8-rowwise,fp8-rowwise-gw-hp,fp8-blockwise,mxfp8,nvfp4"
    assert (
        main(
            [
                "run",
                "--model",
                "tiny",
                "--seq-len",
                "128",
                "--mbs",
                "2",
                "--gbs",
                "2",
                "--steps",
                "3",
                "--warmup-steps",
                "1",
                "--precision",
                names,
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("[emulated]") == 7 and "fp8-blockwise" in out
    assert out.count("GEMMs emulated: cpu has no low-precision GEMMs") == 7  # the reason, once per emulated run
    assert main(["report", "--results", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["precision"] for r in rows] == names.split(",")
    assert all(r["status"] == "ok" for r in rows)
    assert [r["path"] for r in rows] == ["native"] + ["emulated"] * 7
    assert [r["why_emulated"] for r in rows] == [None] + ["cpu has no low-precision GEMMs"] * 7  # recorded

"""benchmarks/moe.py and benchmarks/grouped_gemm.py refuse bad batch and routing options with exit 2 and one line,
before touching a GPU."""

import sys

import pytest


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mbs", "0"], "--gbs 1 must be a positive multiple of --mbs 0"),
        (["--gbs", "8", "--mbs", "3"], "--gbs 8 must be a positive multiple of --mbs 3"),
        (["--gbs", "0"], "--gbs 0 must be a positive multiple of --mbs 1"),
    ],
)
def test_moe_refuses_batches_that_do_not_divide(benchmark_script, monkeypatch, capsys, argv, message):
    moe = benchmark_script("moe")
    monkeypatch.setattr(sys, "argv", ["moe.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        moe.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"moe.py: {message}"


@pytest.mark.parametrize("skew", ["-0.1", "nan", "inf"])
def test_grouped_gemm_refuses_a_skew_that_is_not_a_finite_non_negative_number(
    benchmark_script, monkeypatch, capsys, skew
):
    grouped_gemm = benchmark_script("grouped_gemm")
    monkeypatch.setattr(sys, "argv", ["grouped_gemm.py", "--skew", skew])
    with pytest.raises(SystemExit) as exit_:
        grouped_gemm.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"grouped_gemm.py: --skew {float(skew)} must be a finite number >= 0"

"""GPU time of one call, for the benchmark scripts: Triton's ``do_bench`` (L2 flushed between calls),
as a median or as quartiles, and the one way the scripts print them."""

from __future__ import annotations

HOW = "us: median (p25-p75) of triton.testing.do_bench"


def quartiles_ms(fn, warmup: int = 25, rep: int = 200) -> tuple[float, float, float]:
    """(p25, median, p75) of ``fn``'s time in ms over ``rep`` ms of calls after ``warmup`` ms of them."""
    from triton.testing import do_bench

    p25, p50, p75 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.25, 0.5, 0.75])
    return p25, p50, p75


def median_ms(fn, warmup: int = 25, rep: int = 200) -> float:
    """``fn``'s median time in ms (``do_bench``'s ``return_mode="median"``)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def us_text(quartiles: tuple[float, float, float]) -> str:
    """``quartiles_ms``'s result as ``median (p25-p75)`` in microseconds."""
    p25, p50, p75 = quartiles
    return f"{p50 * 1e3:8.1f} ({p25 * 1e3:.1f}-{p75 * 1e3:.1f})"

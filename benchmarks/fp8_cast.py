"""The one-pass FP8 cast-transpose and the FP8 codes' transpose (``lpbench/precision/kernels/fp8_cast.py``) at
llama3-8b shapes: achieved bandwidth per launch shape (rows x columns x warps per program), with and without the
cast's amax reduction, against a device-to-device copy of the same tensor; every result checked against the
reference quantizer (codes, transposed codes, amax).

    python benchmarks/fp8_cast.py                      # CUDA only
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [  # (rows, cols, dtype, what)
    (8192, 4096, torch.bfloat16, "qkv/o/gate_up input, o/down grad"),
    (8192, 6144, torch.bfloat16, "qkv grad"),
    (8192, 14336, torch.bfloat16, "down input"),
    (8192, 28672, torch.bfloat16, "gate_up grad"),
    (28672, 4096, torch.float32, "gate_up weight (FP32 master)"),
]
CASTS = "128x128x8,64x128x4,128x64x4,64x64x2,64x256x8"
TRANSPOSES = "64x64x8,64x128x4,128x128x8,64x256x8"


def _launches(spec: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--casts", default=CASTS, help=f"ROWSxCOLSxWARPS,... of the cast (default {CASTS})")
    ap.add_argument(
        "--transposes", default=TRANSPOSES, help=f"the same for the codes' transpose (default {TRANSPOSES})"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_cast.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lpbench.metrics.timing import median_ms
    from lpbench.precision.formats import E4M3
    from lpbench.precision.kernels import fp8_cast
    from lpbench.precision.quantize import fp8_encode_scale, quantize_fp8

    def bench(fn):
        return median_ms(fn, warmup=25, rep=200)

    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(
        f"{'shape':<22} {'kernel':<10} {'launch':>9} {'amax':>5} {'us':>8} {'GB/s':>6} {'copy GB/s':>9} "
        f"{'exact':>5}  operand"
    )
    ok_all = True
    for m, n, dtype, what in SHAPES:
        x = (torch.randn(m, n, device="cuda") * 3).to(dtype)
        amax = x.float().abs().amax()
        enc = fp8_encode_scale(amax, E4M3)
        ref = quantize_fp8(x, E4M3)
        ref_q, ref_qt = ref.codes.view(torch.uint8), ref.codes.t().contiguous().view(torch.uint8)
        copy_ms = bench(lambda: x.clone())
        copy_bw = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        shape = f"{m}x{n} {str(dtype)[6:]}"

        def row(kernel, launch, with_amax, ms, nbytes, ok):
            nonlocal ok_all
            ok_all &= ok
            print(
                f"{shape:<22} {kernel:<10} {'x'.join(map(str, launch)):>9} {with_amax:>5} {ms * 1e3:8.1f} "
                f"{nbytes / ms / 1e6:6.0f} {copy_bw:9.0f} {str(ok):>5}  {what}",
                flush=True,
            )

        for launch in _launches(args.casts):
            for with_amax in (True, False):
                q = torch.zeros((m, n), device="cuda", dtype=torch.float8_e4m3fn)
                qt = torch.zeros((n, m), device="cuda", dtype=torch.float8_e4m3fn)
                got = fp8_cast.cast_transpose_into(x, enc, E4M3, q, qt, with_amax, launch)
                ok = (
                    torch.equal(q.view(torch.uint8), ref_q)
                    and torch.equal(qt.view(torch.uint8), ref_qt)
                    and (torch.equal(got, amax) if with_amax else got.numel() == 0)
                )
                ms = bench(lambda: fp8_cast.cast_transpose_into(x, enc, E4M3, q, qt, with_amax, launch))
                row("cast", launch, str(with_amax), ms, x.numel() * (x.element_size() + 2), ok)
        codes = ref.codes.cuda()
        for launch in _launches(args.transposes):
            qt = torch.zeros((n, m), device="cuda", dtype=torch.float8_e4m3fn)
            fp8_cast.launch_transpose(lambda k: k, codes, qt, launch)
            ok = torch.equal(qt.view(torch.uint8), ref_qt)
            ms = bench(lambda: fp8_cast.launch_transpose(lambda k: k, codes, qt, launch))
            row("transpose", launch, "-", ms, 2 * x.numel(), ok)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())

"""The grouped FP8 weight gradient's operand kernels (``lpbench/precision/kernels/fp8_group.py``) at the MoE
experts' shapes: the group column amaxes alone and with each row's amax (the output gradient's), against a torch
copy of the operand (the read-and-write bound) and torch's row amax; on request the amax kernel in other launch
shapes (``--launches``) and the group cast, both codes, in tile sizes (``--cast-launches``).

    python benchmarks/group_amax.py [--tokens 4096] [--launches 128x512x4x16,...] [--cast-launches 64x4,...]
    # CUDA only; run it from each tree to compare trees
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [  # (model, what, columns, experts, top-k)
    ("mixtral-8x7b", "gate_up grad", 2 * 14336, 8, 2),
    ("mixtral-8x7b", "down grad / x", 4096, 8, 2),
    ("mixtral-8x7b", "down input", 14336, 8, 2),
    ("qwen3-30b-a3b", "gate_up grad", 2 * 768, 128, 8),
    ("qwen3-30b-a3b", "down grad / x", 2048, 128, 8),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument(
        "--launches",
        default="",
        help="ROWSxCOLSxWARPSxBLOCK,... of the amax kernel to time too (group + row amax, launched directly)",
    )
    ap.add_argument(
        "--cast-launches",
        default="",
        help="TILExWARPS,... of group_cast's kernel to time (both codes, as for the output gradient)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("group_amax.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lpbench.metrics.timing import HOW, quartiles_ms, us_text
    from lpbench.precision.grouped import ALIGN, Groups
    from lpbench.precision.kernels.fp8_group import column_blocks, group_amax, launch_group_amax, launch_group_cast

    def us(fn):
        return us_text(quartiles_ms(fn, warmup=25, rep=200))

    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.tokens} tokens | BF16 | {HOW}")
    torch.manual_seed(0)
    for model, what, cols, experts, top_k in SHAPES:
        expert = torch.randint(0, experts, (args.tokens * top_k,), device="cuda").sort().values
        groups, _ = Groups.of(expert, experts)
        x = torch.randn(groups.rows, cols, device="cuda", dtype=torch.bfloat16)
        gid = groups.row_group
        for label, fn in (
            ("copy", lambda: x.clone()),
            ("torch row amax", lambda: x.abs().amax(1)),
            ("group amax", lambda: group_amax(x, gid, experts, ALIGN)),
            ("group + row amax", lambda: group_amax(x, gid, experts, ALIGN, row_amax=True)),
        ):
            print(f"{model:>14} {what:>14} {groups.rows:>6} x {cols:<6} {label:>17} {us(fn):>24}", flush=True)
        for launch in filter(None, args.launches.split(",")):
            rows, c, warps, block = (int(v) for v in launch.split("x"))
            bits = torch.zeros(experts, cols, dtype=torch.int32, device="cuda")
            row_bits = torch.empty(column_blocks(cols, c), groups.rows, dtype=torch.int32, device="cuda")
            fn = lambda: launch_group_amax(lambda k: k, x, gid, bits, row_bits, block, rows, c, warps)  # noqa: E731
            print(f"{model:>14} {what:>14} {groups.rows:>6} x {cols:<6} {launch:>17} {us(fn):>24}", flush=True)
        for launch in filter(None, args.cast_launches.split(",")):
            tile, warps = (int(v) for v in launch.split("x"))
            row_enc = torch.rand(groups.rows, device="cuda") + 0.5
            group_enc = torch.rand(experts, cols, device="cuda") + 0.5
            q = torch.empty(groups.rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
            qt = torch.empty(cols, groups.rows, dtype=torch.float8_e4m3fn, device="cuda")
            fn = lambda: launch_group_cast(  # noqa: E731
                lambda k: k, x, row_enc, gid, group_enc, q, qt, 448.0, tile, warps
            )
            print(
                f"{model:>14} {what:>14} {groups.rows:>6} x {cols:<6} {'cast ' + launch:>17} {us(fn):>24}", flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The packed-SFT document mask's cost on one GPU: lpbench's block mask against torch.compile(create_block_mask).

Builds flex attention's ``BlockMask`` for one packed sequence of random samples (lengths 200-3,000 tokens) three
times each way, a new sequence each time, and prints seconds per build: the first build of a compiled
``create_block_mask`` includes its compilation. Then times flex attention's forward + backward (the model's
compiled call, llama3-8b's heads) with lpbench's mask, first call and after. The builders' masks are compared
block for block.

    python benchmarks/block_mask.py --seq-len 16384            # add --skip-compiled to leave torch's out
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from lpbench.models.decoder import _flex_attention, document_mask, document_runs


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def packed_runs(seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 3000, (seq // 200 + 1,), generator=g)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[:seq]
    return document_runs(ids[None].cuda())[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--skip-compiled", action="store_true", help="leave out torch.compile(create_block_mask)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("block_mask.py: needs a CUDA GPU")
    S = args.seq_len
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | seq {S}")
    compiled = torch.compile(create_block_mask)
    for i in range(3):
        runs = packed_runs(S, i)
        dt, ours = timed(lambda: document_mask(runs, "flex"))
        line = f"build {i}: lpbench {dt:.3f} s"
        if not args.skip_compiled:
            dt, ref = timed(lambda: compiled(ours.mask_mod, 1, None, S, S, device="cuda"))
            same = torch.equal(ours.to_dense(), ref.to_dense())
            line += f" | torch.compile(create_block_mask) {dt:.3f} s | same blocks: {same}"
        print(line, flush=True)
    q = torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    for i in range(3):
        mask = document_mask(packed_runs(S, 10 + i), "flex")
        dt, _ = timed(lambda: _flex_attention(q, k, v, mask, True).sum().backward())
        print(f"flex attention fwd + bwd {i}: {dt:.3f} s", flush=True)


if __name__ == "__main__":
    main()

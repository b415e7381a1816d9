"""Peak memory of the LM head + cross-entropy, forward and backward, fused (chunked) against unfused,
eager on the CPU (each in its own process; peak resident set above the inputs', ``ru_maxrss``).

    python benchmarks/fused_loss_memory.py --tokens 4096 --dim 512 --vocab 32000
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time


def measure(fused: bool, tokens: int, dim: int, vocab: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    from lpbench.models.decoder import Linear
    from lpbench.models.fused_loss import linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen).requires_grad_()
    head = Linear(dim, vocab, bias=False)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if fused:
            loss = linear_cross_entropy(x, head.weight, labels)
        else:
            loss = F.cross_entropy(head(x).float(), labels)
    loss.backward()
    seconds = time.perf_counter() - t0
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20, seconds  # KiB -> GiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", choices=("fused", "unfused"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        gib, seconds = measure(args.child == "fused", args.tokens, args.dim, args.vocab)
        print(f"{gib} {seconds}")
        return 0
    logits_gib = args.tokens * args.vocab * 4 / 2**30
    print(f"CPU eager, tokens {args.tokens} dim {args.dim} vocab {args.vocab}: FP32 logits {logits_gib:.2f} GiB")
    out = {}
    for kind in ("unfused", "fused"):
        res = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--tokens",
                str(args.tokens),
                "--dim",
                str(args.dim),
                "--vocab",
                str(args.vocab),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        out[kind] = tuple(map(float, res.stdout.split()))
        print(
            f"{kind:8s} peak +{out[kind][0]:.2f} GiB  ({out[kind][0] / logits_gib:.2f}x the FP32 logits)  "
            f"{out[kind][1]:.2f} s"
        )
    print(f"fused / unfused peak: {out['fused'][0] / out['unfused'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

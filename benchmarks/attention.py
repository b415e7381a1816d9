"""Causal SDPA forward + backward through each PyTorch backend on one GPU, at a model's shapes.

Times ``F.scaled_dot_product_attention`` (is_causal, BF16, GQA) under each backend that takes
the shapes: Flash, cuDNN, memory-efficient, and cuDNN / Flash on K and V expanded to every
query head (for backends without GQA). Prints ms per forward + backward, TFLOP/s (causal
FLOPs: 2 matmuls x 2 x B·H·S²·D / 2 forward, 2.5x that backward) and the relative error of
the output and dQ against the Flash backend.

    python benchmarks/attention.py --model llama3-8b --seq-len 8192 --mbs 1
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lpbench.models import get_model_config

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--mbs", type=int, default=1)
    args = ap.parse_args()
    from lpbench.metrics.timing import median_ms

    cfg = get_model_config(args.model)
    B, S, H, KV, D = args.mbs, args.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.hd
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 4 * B * H * S * S * D / 2 * 3.5  # causal forward (2 matmuls) + backward (2.5x)
    print(
        f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.model}: B {B} S {S} "
        f"heads {H} kv {KV} head_dim {D} bf16 causal"
    )
    ref = None
    for name, expand in [
        ("flash", False),
        ("cudnn", False),
        ("efficient", False),
        ("cudnn", True),
        ("flash", True),
        ("default", False),
    ]:

        def step():
            kk, vv = (k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)) if expand else (k, v)
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand and H != KV)
            out.backward(dout)
            return out

        label = f"{name}{' (kv expanded)' if expand else ''}"
        try:
            ctx = sdpa_kernel([BACKENDS[name]]) if name in BACKENDS else torch.enable_grad()
            with ctx:
                q.grad = None
                out = step()
                got = (out.detach().float(), q.grad.float())
                ms = median_ms(lambda: (setattr(q, "grad", None), step()), warmup=50, rep=300)
        except RuntimeError as exc:
            print(f"{label:<24} not available: {str(exc).splitlines()[0][:120]}")
            continue
        if ref is None:
            ref = got
        err = [((a - b).norm() / b.norm()).item() for a, b in zip(got, ref)]
        print(f"{label:<24} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel err out {err[0]:.1e} dq {err[1]:.1e}")


if __name__ == "__main__":
    main()

"""Baseline: Hugging Face transformers' LlamaForCausalLM trained on the same mock data.

Same architecture as an lpbench zoo model, SDPA attention, torch.compile, fused AdamW, and
the same timing rule as `lpbench run` (median step time after the warm-up steps).
``--params bf16`` trains BF16 parameters directly (the usual HF recipe, no FP32 master
weights); ``--params fp32`` keeps FP32 parameters under BF16 autocast (lpbench's recipe).

    python benchmarks/hf_baseline.py --model llama3.2-1b --seq-len 4096 --mbs 2 --steps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lpbench.data.mock import MockLoader
from lpbench.metrics.flops import flops_per_token
from lpbench.metrics.hardware import detect_gpu, mfu, peak_tflops
from lpbench.metrics.profile import StepProfiler
from lpbench.models.registry import first_blocks, get_model_config, model_label


def hf_config(name: str, num_layers: int | None = None) -> LlamaConfig:
    m = first_blocks(get_model_config(name), num_layers)
    if m.family != "llama":
        raise SystemExit(f"{name} is not a llama-family model")
    return LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.dim,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.hd,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        attn_implementation="sdpa",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--num-layers", type=int, default=None, help="keep the first N blocks (default: all)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--params", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--profile-steps",
        metavar="A:B",
        default=None,
        help="profile steps A..B as `lpbench run --profile-steps` does (left out of the timing)",
    )
    ap.add_argument("--profile-dir", default="lpbench-results/profiles/hf-baseline")
    args = ap.parse_args()
    profile = tuple(int(v) for v in args.profile_steps.split(":")) if args.profile_steps else None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(args.model, args.num_layers))
    if args.params == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda" or None
    )
    fwd = torch.compile(model) if args.compile else model
    data = MockLoader(model.config.vocab_size, args.seq_len, args.mbs, seed=1234)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.params == "fp32")
    times, losses = [], []
    profiler = StepProfiler(profile, args.profile_dir, device, lambda line: print(line, flush=True))
    for step in range(args.steps):
        profiler.begin(step + 1)
        t0 = time.perf_counter()
        inputs, labels = (t.to(device) for t in next(data))
        with autocast:
            loss = fwd(input_ids=inputs, labels=inputs).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_time = time.perf_counter() - t0
        print(
            f"hf iteration {step + 1}/{args.steps} | lm loss: {losses[-1]:.4f} | "
            f"train_step_timing in s: {step_time:.4f}",
            flush=True,
        )
        record = {}
        profiler.end(step + 1, record)
        times.append(None if record.get("profiled") else step_time)  # profiler overhead: not timed
    step_time = statistics.median(t for t in times[args.warmup_steps :] if t is not None)
    tps = args.mbs * args.seq_len / step_time
    fpt = flops_per_token(first_blocks(get_model_config(args.model), args.num_layers), args.seq_len)
    gpu = detect_gpu(torch.cuda.get_device_name()) if device.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None
    print(
        "RESULT "
        + json.dumps(
            {
                "impl": f"hf-transformers ({args.params} params)",
                "model": model_label(args.model, args.num_layers),
                "seq_len": args.seq_len,
                "mbs": args.mbs,
                "step_time_s": step_time,
                "tokens_per_sec_per_gpu": tps,
                "tflops_per_gpu": fpt * tps / 1e12,
                "mfu": mfu(fpt * tps / 1e12, peak_tflops(gpu, "bf16")),
                "profile": profiler.close(),
                "peak_mem_gb": peak,
                "final_loss": losses[-1],
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()

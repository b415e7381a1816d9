"""Why would keeping NVFP4's last blocks in BF16 hurt? Gradient error and loss by layer group, same weights.

On one set of weights (a checkpoint's, e.g. the end of a converge run, or the model's init) and the
same batches, each variant computes the loss and every parameter's gradient; each is compared with
BF16's on those weights and batches:

- ``nvfp4`` (blocks 0..7 NVFP4, the last 4 BF16) and ``nvfp4-no-bf16-tail`` (all 12 NVFP4): if the
  BF16 tail made the quantized blocks' gradients worse, their per-block error would show it;
- NVFP4 on one group of blocks only (``nvfp4@0-3``, ``@4-7``, ``@8-11``): how much each group's
  quantization costs in loss and in the gradients of every block (errors travel down the backward).

Per block: the relative error ``||g - g_bf16|| / ||g_bf16||`` of the block's weight gradients (all its
linears and norms together) for one draw of the stochastic rounding, and the error of the mean over
``--repeats`` draws (what remains is bias, not rounding noise). Eager (no compile): the reference
path of each recipe, bit-exact with the compiled one.

    PYTHONPATH=. python benchmarks/nvfp4_tail.py --ckpt CKPT/step-K --data .corpus/prepared/docs_text_document
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from lpbench.config import RunConfig
from lpbench.data.loader import build_dataset
from lpbench.models import build_model
from lpbench.convert.quantize import apply_recipe
from lpbench.precision.recipes import get_recipe


def load_weights(model: torch.nn.Module, ckpt: str) -> None:
    """The model entries of a DCP checkpoint folder (``step-K``) into ``model``; every parameter must be there."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt, Path(tmp) / "ckpt.pt")
        state = torch.load(Path(tmp) / "ckpt.pt", weights_only=False)["model"]
    state = {re.sub(r"(^|\.)_orig_mod\.", r"\1", k): v for k, v in state.items()}
    own = model.state_dict()
    missing = [k for k, _ in model.named_parameters() if k not in state]
    if missing:
        raise SystemExit(f"nvfp4_tail: {ckpt} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def variants(n_blocks: int, tail: int) -> dict:
    nv = get_recipe("nvfp4")
    groups = [(i, min(i + tail, n_blocks)) for i in range(0, n_blocks, tail)]
    out = {"nvfp4": nv, "nvfp4-no-bf16-tail": get_recipe("nvfp4-no-bf16-tail")}
    for lo, hi in groups:
        out[f"nvfp4@{lo}-{hi - 1}"] = dataclasses.replace(
            nv, name=f"nvfp4@{lo}-{hi - 1}", first_bf16_layers=lo, last_bf16_layers=n_blocks - hi
        )
    return out


def loss_and_grads(model, batches, device, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(*batch.model_args(device))
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def group_of(name: str) -> str:
    m = re.match(r"layers\.(\d+)\.", name)
    return f"block {int(m.group(1)):2d}" if m else name.split(".")[0]


def rel_error(grads: dict, ref: dict, names: list[str]) -> float:
    num = sum(float((grads[n] - ref[n]).pow(2).sum()) for n in names)
    den = sum(float(ref[n].pow(2).sum()) for n in names)
    return (num / den) ** 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None, help="a checkpoint folder step-K (default: the model's initial weights)")
    p.add_argument("--model", default="llama-125m")
    p.add_argument("--data", default=".corpus/prepared/docs_text_document")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=16)
    p.add_argument("--batches", type=int, default=2, help="micro-batches per gradient (validation split)")
    p.add_argument("--repeats", type=int, default=3, help="stochastic-rounding draws per variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.monotonic()
    splits = build_dataset(args.data, seq_len=args.seq_len, seed=args.seed, vocab_size=None)
    cfg = RunConfig(model=args.model, vocab_size=splits.vocab_size, seq_len=args.seq_len)
    model_cfg = cfg.model_config()
    base = build_model(model_cfg, device=device, seed=args.seed)
    if args.ckpt:
        load_weights(base, args.ckpt)
    batches = list(itertools.islice(splits.valid_batches(args.mbs), args.batches))
    tail = get_recipe("nvfp4").last_bf16_layers
    print(
        f"nvfp4_tail: {args.model} ({model_cfg.n_layers} blocks, vocab {splits.vocab_size}), weights "
        f"{args.ckpt or 'at init'}, {args.batches} x {args.mbs} x {args.seq_len} validation tokens, "
        f"{args.repeats} SR draws, {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"eager",
        flush=True,
    )
    ref_loss, ref = loss_and_grads(base, batches, device, 0)
    blocks = sorted({group_of(n) for n in ref}, key=lambda g: (not g.startswith("block"), g))
    by_group = {g: [n for n in ref if group_of(n) == g] for g in blocks}
    rows = []
    for name, recipe in variants(model_cfg.n_layers, tail).items():
        model = copy.deepcopy(base)
        apply_recipe(model, recipe, device=device, emulate=True)
        draws = [loss_and_grads(model, batches, device, r) for r in range(args.repeats)]
        mean = {n: sum(g[n] for _, g in draws) / len(draws) for n in ref}
        losses = [loss for loss, _ in draws]
        one = {g: sum(rel_error(gr, ref, by_group[g]) for _, gr in draws) / len(draws) for g in blocks}
        avg = {g: rel_error(mean, ref, by_group[g]) for g in blocks}
        rows.append((name, sum(losses) / len(losses), one, avg))
        del model
        print(f"nvfp4_tail: {name} done ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\nloss on these batches: bf16 {ref_loss:.5f}")
    print("| variant | loss | vs bf16 | " + " | ".join(g.replace("block ", "b") for g in blocks) + " |")
    print("|---|---:|---:|" + "---:|" * len(blocks))
    for name, loss, one, avg in rows:
        print(
            f"| {name} (1 draw) | {loss:.5f} | {(loss - ref_loss) / ref_loss * 100:+.3f}% | "
            + " | ".join(f"{one[g]:.3f}" for g in blocks)
            + " |"
        )
        print(f"| {name} (mean of {args.repeats}) | | | " + " | ".join(f"{avg[g]:.3f}" for g in blocks) + " |")
    print(
        "\nentries: relative error of the gradient, ||g - g_bf16|| / ||g_bf16||, per block (all its parameters) "
        "and for the embedding, final norm and head"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

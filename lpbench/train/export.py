"""A run's model, LoRA adapters merged, as a Hugging Face checkpoint: from one process or a sharded run.

:func:`export_merged` is collective: every rank of the run calls it, and each parameter is gathered whole in
turn, in the decoder's order (FSDP2's and TP's DTensors by ``full_tensor``, TP's plain per-rank parts
(LoRA's bases) by an all-gather put back in the unsharded order, fused rows de-interleaved, a base stored
quantized gathered as its bytes and dequantized), its adapters' ``scaling · B A`` added as
``convert/lora.py: merge_lora`` adds them, so the files equal those of ``merge_lora`` then
``models/hf.py: export_hf_checkpoint`` in one process. Rank 0 writes one safetensors file per block (and one
for the rest) with the index transformers reads, so it holds one block's tensors at a time. The gathering is
ours because it inverts lpbench's own cuts (``parallel/plan.py: materialize``); torch's
``get_model_state_dict(full_state_dict=True)`` would gather everything at once and knows nothing of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lpbench.convert.lora import LoRALinear
from lpbench.errors import UsageError
from lpbench.models.decoder import Decoder
from lpbench.models.hf import SAFETENSORS_FILE, SAFETENSORS_INDEX, hf_config_dict, hf_weight_map
from lpbench.models.moe import Experts
from lpbench.parallel.tp import interleave


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()


def _unsplit(t: torch.Tensor, split, shape: torch.Size) -> torch.Tensor:
    """``t`` (a parameter gathered over its DTensor mesh) in the unsharded layout of ``shape``: TP's plain
    per-rank parts all-gathered, fused rows de-interleaved (``split``: the module's ``tp_shard``)."""
    if split is None and t.shape != shape:
        raise UsageError("exporting parameters split over ranks by --ep is not supported: export from --ep 1")
    if split is None or (split.dim != 0 and t.shape == shape):
        return t
    if t.shape != shape:  # plain per-rank parts, each rank's positions TPShard.index
        parts = [torch.empty_like(t) for _ in range(split.size)]
        dist.all_gather(parts, t.contiguous(), group=split.group)
        t = torch.cat(parts, split.dim)
        ranks = [dataclasses.replace(split, rank=r).index(torch.device("cpu")) for r in range(split.size)]
        positions = torch.cat(ranks)
    elif len(split.sections) > 1:  # a DTensor's rows, interleaved per rank
        positions = interleave(torch.arange(shape[0]), split.sections, split.size)
    else:
        return t
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    return out.index_copy_(split.dim, positions.to(t.device), t)


def _adapters(mod: LoRALinear) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B whole, in the unsharded order."""
    a, b = _whole(mod.lora_a), _whole(mod.lora_b)
    split = getattr(mod, "tp_shard", None)
    if split is not None:  # the split dim's parts are in each rank's TPShard.index order
        positions = torch.cat(
            [dataclasses.replace(split, rank=r).index(torch.device("cpu")) for r in range(split.size)]
        ).to(a.device)
        if split.dim == 0:
            b = torch.empty_like(b).index_copy_(0, positions, b)
        else:
            a = torch.empty_like(a).index_copy_(1, positions, a)
    return a, b


def _merged_weight(mod: LoRALinear, shape: torch.Size) -> torch.Tensor:
    """The base weight of ``mod`` plus its adapters' delta, whole, as ``merge_lora`` computes it."""
    base, split = mod.base, getattr(mod.base, "tp_shard", None)
    a, b = _adapters(mod)
    delta = (b.float() @ a.float()) * mod.scaling
    if hasattr(base, "dequantized"):  # stored quantized: its bytes gathered, dequantized, its TP parts gathered
        parts = {name: _whole(getattr(base, name)) for name in base._layout}
        w = _unsplit(base.dequantized(parts), split, shape)
        return (w + delta.to(w.device).float()).to(base.weight_dtype)
    w = _unsplit(_whole(base.weight), split, shape)
    return (w.float() + delta.to(w.device)).to(w.dtype)


def whole_values(model: nn.Module):
    """Yield ``(plain decoder parameter name, whole merged value)`` of ``model`` (one process or sharded; every rank
    must iterate it to the end together), in ``Decoder(model.cfg)``'s order, tied weights once."""
    cfg = model.cfg
    with torch.device("meta"):
        shapes = dict(Decoder(cfg).named_parameters())
    splits = {name: m.tp_shard for name, m in model.named_modules() if getattr(m, "tp_shard", None) is not None}
    for name, p in shapes.items():
        parent, _, leaf = name.rpartition(".")
        mod = model.get_submodule(parent)
        if isinstance(mod, LoRALinear):
            if leaf == "weight":
                yield name, _merged_weight(mod, p.shape)
            else:
                yield name, _unsplit(_whole(mod.base.bias), getattr(mod.base, "tp_shard", None), p.shape)
            continue
        if isinstance(mod, Experts) and (getattr(mod.gemm, "adapters", None) or getattr(mod.gemm, "tp", None)):
            raise UsageError("exporting LoRA experts or experts split by --tp is not supported: merge in one process")
        yield name, _unsplit(_whole(model.get_parameter(name)), splits.get(parent), p.shape)


def export_merged(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path | None:
    """Write ``model`` (adapters merged) to checkpoint folder ``path`` as transformers loads it: config.json, one
    safetensors file per block and one for the rest, and their index. Collective (see the module doc); rank 0
    writes and returns the folder, other ranks return None. ``dtype``: the stored dtype (None: each parameter's)."""
    from safetensors.torch import save_file

    model = getattr(model, "_orig_mod", model)
    cfg = model.cfg
    hf_config_dict(cfg)  # raises for architectures HF Llama/Qwen3 cannot hold
    main = not dist.is_initialized() or dist.get_rank() == 0
    by_param: dict[str, list] = {}
    for key, (lp, lo, hi) in hf_weight_map(cfg).items():
        by_param.setdefault(lp.partition("[")[0], []).append((key, lp, lo, hi))
    out, files, weight_map, stored = Path(path), [], {}, None
    pending: dict[str, torch.Tensor] = {}
    n_files = cfg.n_layers + 1

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}-of-{n_files:05d}.safetensors"
        tmp = out / f".{name}.tmp{os.getpid()}"
        save_file(pending, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / name)
        files.append(name)
        weight_map.update(dict.fromkeys(pending, name))
        pending.clear()

    if main:
        out.mkdir(parents=True, exist_ok=True)
    current = None
    for name, value in whole_values(model):
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "rest"
        if main and group != current and pending and current != "rest":
            flush()
        current = group
        if not main:
            continue
        for key, lp, lo, hi in by_param[name]:
            _, _, index = lp.partition("[")
            t = value[int(index[:-1])] if index else value
            t = t if lo is None else t[lo:hi]
            pending[key] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
            stored = stored or pending[key].dtype
        del value
    if not main:
        return None
    flush()
    if (out / SAFETENSORS_FILE).exists():  # a stale single file would hold other weights
        (out / SAFETENSORS_FILE).unlink()
    index = {"metadata": {"total_size": sum((out / f).stat().st_size for f in files)}, "weight_map": weight_map}
    tmp = out / f".{SAFETENSORS_INDEX}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / SAFETENSORS_INDEX)
    tmp = out / f".config.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(hf_config_dict(cfg, stored), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "config.json")
    return out

"""Hugging Face interop: Llama / Qwen3 checkpoints (``config.json`` + ``*.safetensors``) in and out,
Qwen3-MoE checkpoints in.

Local folders only (no hub access). The architecture comes from ``config.json``
(``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``); weights from
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``. Tensor names,
HF → lpbench (``i`` = layer)::

    model.embed_tokens.weight                        tok_embeddings.weight
    model.layers.i.input_layernorm.weight            layers.i.attn_norm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}  layers.i.attn.qkv.*   rows [q; k; v]
    model.layers.i.self_attn.o_proj.{weight,bias}    layers.i.attn.o.*
    model.layers.i.self_attn.{q,k}_norm.weight       layers.i.attn.{q,k}_norm.weight   (Qwen3)
    model.layers.i.post_attention_layernorm.weight   layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up}_proj.{weight,bias}  layers.i.mlp.gate_up.*  rows [gate; up]
    model.layers.i.mlp.down_proj.{weight,bias}       layers.i.mlp.down.*
    model.layers.i.mlp.gate.weight                   layers.i.mlp.router.weight        (Qwen3-MoE)
    model.layers.i.mlp.experts.e.{gate,up}_proj.weight  layers.i.mlp.experts.gate_up[e]  rows [gate; up]
    model.layers.i.mlp.experts.e.down_proj.weight    layers.i.mlp.experts.down[e]
    model.norm.weight                                norm.weight
    lm_head.weight                                   lm_head.weight   (absent when tied)

Both use the "rotate_half" RoPE layout, so q/k rows need no permutation (unlike Meta's original
checkpoints). Every problem with the input (missing or corrupt file, unsupported architecture or
RoPE type, missing tensor, wrong shape) raises :class:`lpbench.errors.UsageError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import fields
from pathlib import Path

import torch

from lpbench.errors import UsageError
from lpbench.models.decoder import Decoder
from lpbench.models.registry import ModelConfig, get_model_config
from lpbench.parsing import parse_json

PathLike = str | os.PathLike

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# transformers' class defaults for keys a config.json may omit
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "max_position_embeddings": 2048, "head_dim": None},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "max_position_embeddings": 32768, "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "max_position_embeddings": 32768, "head_dim": 128},
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
# safetensors' names of the dtypes that are not floats, as torch names them (for errors)
_INT_NAMES = {
    "BOOL": "bool",
    **{f"{k}{bits}": f"{name}{bits}" for k, name in (("I", "int"), ("U", "uint")) for bits in (8, 16, 32, 64)},
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


# --------------------------------------------------------------------------- config


def read_hf_config(path: PathLike) -> dict:
    """The JSON object of ``path/config.json`` (or of ``path`` itself when it is a file)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise UsageError(f"{f}: no such file (a Hugging Face checkpoint folder holds config.json)")
    try:
        cfg = parse_json(f.read_bytes(), str(f))
    except OSError as exc:
        raise UsageError(f"{f}: cannot read it ({exc.strerror})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{f}: not a JSON object")
    return cfg


_MISSING = object()
# Bounds far above any published model's: a config beyond them is a mistake or an attack, not a model to build.
MAX_DIM = 1 << 17  # hidden_size, intermediate_size, head_dim, moe_intermediate_size ...
MAX_DIMS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "vocab_size": 1 << 24,
    "num_experts": 4096,
    "num_local_experts": 4096,
    "num_experts_per_tok": 4096,
    "max_position_embeddings": 1 << 24,
}
MAX_PARAMS = 10**13


def _field(hf: dict, key: str, kind: type, where: str, default=_MISSING):
    """``hf[key]`` as ``kind`` (int, float, bool, str or list): missing or null gives ``default`` (required
    without one); a value of another type, or a non-finite number, is a UsageError naming the field."""
    value = hf.get(key)
    if value is None:
        if default is _MISSING:
            raise UsageError(f"{where}: {key} is missing")
        return default
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        bool: isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        what = {
            int: "an integer",
            float: "a finite number",
            bool: "true or false",
            str: "a string",
            list: "a list of strings",
        }[kind]
        raise UsageError(f"{where}: {key} must be {what}, got {value!r}")
    return float(value) if kind is float else value


def _arch(hf: dict, where: str) -> str:
    archs = _field(hf, "architectures", list, where, [])
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and _field(hf, "model_type", str, where, None) in ARCHITECTURES.values():
        return hf["model_type"]
    got = ", ".join(archs) or f"model_type {hf.get('model_type')!r}"
    raise UsageError(f"{where}: unsupported architecture {got}; lpbench reads {', '.join(ARCHITECTURES)}")


def _rope(hf: dict, family: str, where: str) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling tuple or None) from transformers 5 ``rope_parameters`` or the
    older top-level ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if params is not None and (not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values())):
        raise UsageError(f"{where}: per-layer-type rope_parameters are not supported")
    params = dict(params or {})
    legacy = hf.get("rope_scaling") or {}
    if not isinstance(legacy, dict):
        raise UsageError(f"{where}: rope_scaling must be an object, got {legacy!r}")
    merged = {**legacy, **params}
    top = {k: hf.get(k) for k in ("rope_theta", "partial_rotary_factor") if hf.get(k) is not None}
    merged = {**top, **{k: v for k, v in merged.items() if v is not None}}
    theta = _field(merged, "rope_theta", float, where, _DEFAULTS[family]["rope_theta"])
    if _field(merged, "partial_rotary_factor", float, where, 1.0) != 1.0:
        raise UsageError(f"{where}: partial_rotary_factor != 1 is not supported for {family}")
    kind = _field(merged, "rope_type", str, where, None) or _field(merged, "type", str, where, "default")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        scaling = (
            _field(merged, "factor", float, where),
            _field(merged, "low_freq_factor", float, where),
            _field(merged, "high_freq_factor", float, where),
            _field(merged, "original_max_position_embeddings", int, where),
        )
        if scaling[1] == scaling[2]:
            raise UsageError(f"{where}: llama3 rope scaling needs low_freq_factor != high_freq_factor")
        return theta, scaling
    raise UsageError(f"{where}: unsupported RoPE type {kind!r}; lpbench supports 'default' and 'llama3'")


def config_from_hf(path_or_config: PathLike | dict, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama / Qwen3 ``config.json`` (a folder, the file, or its dict)."""
    if isinstance(path_or_config, dict):
        hf, where = path_or_config, "config.json"
    else:
        hf, where = read_hf_config(path_or_config), str(path_or_config)
    family = _arch(hf, where)
    defaults = _DEFAULTS[family]

    def need(key, default=_MISSING):
        v = _field(hf, key, int, where, default)
        if v is not None and not 1 <= v <= MAX_DIMS.get(key, MAX_DIM):
            raise UsageError(f"{where}: {key} must be an integer from 1 to {MAX_DIMS.get(key, MAX_DIM):,}, got {v!r}")
        return v

    dim, ffn, layers = need("hidden_size"), need("intermediate_size"), need("num_hidden_layers")
    heads, vocab = need("num_attention_heads"), need("vocab_size")
    kv = need("num_key_value_heads", heads)
    if heads % kv:
        raise UsageError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = None if "head_dim" in hf and hf["head_dim"] is None else need("head_dim", defaults["head_dim"])
    head_dim = head_dim or dim // heads  # null: dim // heads, as transformers
    if family == "llama" and head_dim * heads == dim:
        head_dim = None  # the default (dim // heads), as in the zoo
    act = _field(hf, "hidden_act", str, where, "silu")
    if act != "silu":
        raise UsageError(f"{where}: hidden_act {act!r} is not supported (lpbench's gated MLP is SwiGLU)")
    attn_bias = _field(hf, "attention_bias", bool, where, False)
    mlp_bias = _field(hf, "mlp_bias", bool, where, False) if family == "llama" else False
    if attn_bias != mlp_bias:
        raise UsageError(
            f"{where}: attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported "
            f"(lpbench has one bias flag for every linear)"
        )
    moe = {}
    if family == "qwen3_moe":
        ffn = need("moe_intermediate_size")
        experts = need("num_experts", None) or need("num_local_experts", None)
        if experts is None:
            raise UsageError(f"{where}: num_experts must be a positive integer, got None")
        top_k = need("num_experts_per_tok")
        if hf.get("mlp_only_layers") or need("decoder_sparse_step", 1) != 1:
            raise UsageError(
                f"{where}: dense layers between MoE layers (mlp_only_layers, decoder_sparse_step) are not supported"
            )
        moe = dict(
            n_experts=experts,
            top_k=top_k,
            router="qwen3",
            router_norm_topk=_field(hf, "norm_topk_prob", bool, where, False),
        )
    if family in ("qwen3", "qwen3_moe"):
        if _field(hf, "use_sliding_window", bool, where, False):
            raise UsageError(f"{where}: use_sliding_window=true is not supported")
        types = set(_field(hf, "layer_types", list, where, None) or ["full_attention"])
        if types != {"full_attention"}:
            raise UsageError(f"{where}: layer_types {sorted(types)} are not supported (full attention only)")
    hd = head_dim or dim // heads
    params = 2 * vocab * dim + layers * (dim * hd * (2 * heads + 2 * kv) + 3 * dim * ffn * moe.get("n_experts", 1))
    if params > MAX_PARAMS:
        raise UsageError(
            f"{where}: {params:.2e} parameters, more than lpbench builds ({MAX_PARAMS:.0e}): "
            "check hidden_size, intermediate_size, num_hidden_layers and vocab_size"
        )
    theta, scaling = _rope(hf, family, where)
    return ModelConfig(
        name or f"hf:{Path(str(path_or_config)).name if not isinstance(path_or_config, dict) else family}",
        layers,
        dim,
        ffn,
        heads,
        kv,
        vocab,
        head_dim=head_dim,
        norm_eps=_field(hf, "rms_norm_eps", float, where, defaults["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=family != "llama",
        tie_embeddings=_field(hf, "tie_word_embeddings", bool, where, False),
        bias=attn_bias,
        max_seq_len=need("max_position_embeddings", defaults["max_position_embeddings"]),
        family="qwen3" if family == "qwen3_moe" else family,
        **moe,
    )


# Fields that do not change a model's shapes or GEMMs: a zoo name may label a checkpoint that differs in them.
_LABEL_FIELDS = ("name", "max_seq_len", "rope_theta", "rope_scaling", "norm_eps", "family")


def hf_label(path: str) -> str:
    """The model name of a run from HF checkpoint folder ``path`` without ``--model``."""
    return f"hf:{Path(path).resolve().name}"


def hf_model_config(model: str, path: str) -> ModelConfig:
    """``path``'s architecture, named ``model``: ``hf:...``, or a zoo model of the same shape
    (layers, widths, heads, vocabulary, norm, MLP, tying, biases; RoPE and eps come from the checkpoint)."""
    cfg = config_from_hf(path, name=model)
    if model.startswith("hf:"):
        return cfg
    zoo = get_model_config(model)
    diff = [
        f"{f.name} {getattr(zoo, f.name)} vs {getattr(cfg, f.name)}"
        for f in fields(ModelConfig)
        if f.name not in _LABEL_FIELDS and getattr(zoo, f.name) != getattr(cfg, f.name)
    ]
    if zoo.hd != cfg.hd:
        diff.append(f"head_dim {zoo.hd} vs {cfg.hd}")
    if diff:
        raise UsageError(
            f"--model {model} does not match --hf-checkpoint {path} ({', '.join(diff)}); "
            f"leave out --model to label the run {hf_label(path)}"
        )
    return cfg


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A ``config.json`` for ``cfg`` (Qwen3 when it has QK-norm, else Llama)."""
    problems = [
        what
        for what, bad in (
            ("LayerNorm", cfg.norm != "rms"),
            (f"{cfg.activation} MLP", cfg.activation != "swiglu"),
            ("learned positions", cfg.positions != "rope"),
            ("partial RoPE", cfg.rope_fraction != 1.0),
            ("MoE", bool(cfg.n_experts)),
            ("biases with QK-norm (Qwen3 MLPs have none)", cfg.qk_norm and cfg.bias),
        )
        if bad
    ]
    if problems:
        raise UsageError(f"{cfg.name}: cannot export as a Llama/Qwen3 checkpoint: {', '.join(problems)}")
    qwen = cfg.qk_norm
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy_scaling = None
    if cfg.rope_scaling is not None:
        f, lo, hi, orig = cfg.rope_scaling
        legacy_scaling = {
            "rope_type": "llama3",
            "factor": f,
            "low_freq_factor": lo,
            "high_freq_factor": hi,
            "original_max_position_embeddings": orig,
        }
        rope = {**legacy_scaling, "rope_theta": cfg.rope_theta}
    out = {
        "architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen else "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias,
        "attention_dropout": 0.0,
        "rope_parameters": rope,  # transformers >= 5
        "rope_theta": cfg.rope_theta,
        "rope_scaling": legacy_scaling,  # transformers 4
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if qwen:
        out.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=cfg.n_layers,
            layer_types=["full_attention"] * cfg.n_layers,
        )
    else:
        out.update(mlp_bias=cfg.bias, pretraining_tp=1)
    return out


# --------------------------------------------------------------------------- tensor names


def hf_weight_map(cfg: ModelConfig) -> dict[str, tuple[str, int | None, int | None]]:
    """HF tensor name → (lpbench parameter name, first row, end row); rows None: the whole tensor."""
    m: dict[str, tuple[str, int | None, int | None]] = {
        "model.embed_tokens.weight": ("tok_embeddings.weight", None, None),
        "model.norm.weight": ("norm.weight", None, None),
    }
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = ("lm_head.weight", None, None)
    q, kv, ffn = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd, cfg.ffn_dim
    for i in range(cfg.n_layers):
        hf, lp = f"model.layers.{i}.", f"layers.{i}."
        m[hf + "input_layernorm.weight"] = (lp + "attn_norm.weight", None, None)
        m[hf + "post_attention_layernorm.weight"] = (lp + "mlp_norm.weight", None, None)
        if cfg.qk_norm:
            m[hf + "self_attn.q_norm.weight"] = (lp + "attn.q_norm.weight", None, None)
            m[hf + "self_attn.k_norm.weight"] = (lp + "attn.k_norm.weight", None, None)
        for s in ("weight", "bias") if cfg.bias else ("weight",):
            m[f"{hf}self_attn.q_proj.{s}"] = (f"{lp}attn.qkv.{s}", 0, q)
            m[f"{hf}self_attn.k_proj.{s}"] = (f"{lp}attn.qkv.{s}", q, q + kv)
            m[f"{hf}self_attn.v_proj.{s}"] = (f"{lp}attn.qkv.{s}", q + kv, q + 2 * kv)
            m[f"{hf}self_attn.o_proj.{s}"] = (f"{lp}attn.o.{s}", None, None)
            if cfg.n_experts:
                continue
            m[f"{hf}mlp.gate_proj.{s}"] = (f"{lp}mlp.gate_up.{s}", 0, ffn)
            m[f"{hf}mlp.up_proj.{s}"] = (f"{lp}mlp.gate_up.{s}", ffn, 2 * ffn)
            m[f"{hf}mlp.down_proj.{s}"] = (f"{lp}mlp.down.{s}", None, None)
        if cfg.n_experts:
            m[hf + "mlp.gate.weight"] = (lp + "mlp.router.weight", None, None)
            for e in range(cfg.n_experts):
                x = f"{hf}mlp.experts.{e}."
                m[x + "gate_proj.weight"] = (f"{lp}mlp.experts.gate_up[{e}]", 0, ffn)
                m[x + "up_proj.weight"] = (f"{lp}mlp.experts.gate_up[{e}]", ffn, 2 * ffn)
                m[x + "down_proj.weight"] = (f"{lp}mlp.experts.down[{e}]", None, None)
    return m


def _param_view(params: dict, name: str) -> torch.Tensor:
    """The parameter (or one expert's slice of a stacked one, ``name[e]``) a weight-map entry names."""
    base, _, index = name.partition("[")
    return params[base] if not index else params[base][int(index[:-1])]


def safetensors_files(path: PathLike) -> list[Path]:
    """The weight files of a checkpoint folder: the index's shards, model.safetensors, or *.safetensors."""
    d = Path(path)
    if not d.is_dir():
        raise UsageError(f"{d}: not a checkpoint folder (config.json + *.safetensors)")
    index = d / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = parse_json(index.read_bytes(), str(index))["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(n, str) and n and "/" not in n for n in names):
                raise TypeError("shard names must be file names")
        except (KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"{index}: not a safetensors index (no weight_map): {exc}") from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise UsageError(f"{index}: lists missing shard(s) {', '.join(missing)}")
        return [d / n for n in names]
    if (d / SAFETENSORS_FILE).is_file():
        return [d / SAFETENSORS_FILE]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        extra = (
            " (PyTorch .bin checkpoints are not read: re-save with safe_serialization)" if any(d.glob("*.bin")) else ""
        )
        raise UsageError(f"{d}: no *.safetensors weights{extra}")
    return files


# --------------------------------------------------------------------------- load


def _read_error(f: Path, exc: BaseException) -> UsageError:
    return UsageError(f"{f}: not a readable safetensors file: {exc}")


class HFValue:
    """One parameter's values in a checkpoint, read when asked (:meth:`read`): all of them, or only the rows and
    columns a rank keeps. ``sources``: ``(file, handle, HF key, first row, end row, expert)`` of each HF tensor
    it is assembled from (fused QKV and gate+up rows, stacked experts)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device, sources: list):
        self.shape, self.dtype, self.device, self.sources = shape, dtype, device, sources

    def read(self, index: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The values (``index``: for each dim, the positions to keep, in order; None: all). Only the rows kept are
        read from the files (``safe_open(...).get_slice``), and only the columns kept when they are contiguous."""
        from safetensors import SafetensorError

        if index is None or any(src[5] for src in self.sources):  # stacked experts: read whole, then cut
            full = self.read_whole()
            for dim, positions in enumerate(index or []):
                full = full.index_select(dim, positions.to(full.device))
            return full
        rows = index[0].tolist()
        cols = index[1].tolist() if len(index) > 1 else None
        span = bool(cols) and cols == list(range(cols[0], cols[0] + len(cols)))
        out = torch.empty((len(rows), *([len(cols)] if cols is not None else self.shape[1:])), dtype=self.dtype)
        for f, fh, key, lo, hi, _ in self.sources:
            lo, hi = lo or 0, hi if hi is not None else self.shape[0]
            at = 0
            while at < len(rows):  # each run of consecutive rows inside this tensor, read as one slice
                if not lo <= rows[at] < hi:
                    at += 1
                    continue
                end = at + 1
                while end < len(rows) and rows[end] == rows[end - 1] + 1 and rows[end] < hi:
                    end += 1
                try:
                    piece = fh.get_slice(key)
                    r0, r1 = rows[at] - lo, rows[end - 1] + 1 - lo
                    t = piece[r0:r1, cols[0] : cols[-1] + 1] if span else piece[r0:r1]
                except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                    raise _read_error(f, exc) from None
                if cols is not None and not span:
                    t = t[:, cols]
                out[at:end].copy_(t)
                at = end
        return out.to(self.device)

    def read_whole(self) -> torch.Tensor:
        """All the values (every HF tensor read whole)."""
        from safetensors import SafetensorError

        full = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for f, fh, key, lo, hi, expert in self.sources:
            try:
                t = fh.get_tensor(key)
            except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                raise _read_error(f, exc) from None
            dst = full[int(expert)] if expert else full
            (dst if lo is None else dst[lo:hi]).copy_(t)
            del t
        return full


def hf_values(path: PathLike, cfg: ModelConfig, device: torch.device | str = "cpu", lazy: bool = False):
    """Yield ``(lpbench parameter name, full values)`` from checkpoint folder ``path``, in ``Decoder(cfg)``'s
    parameter order (:func:`lpbench.models.decoder.initial_values`' order), each assembled (fused QKV and
    gate+up rows, stacked experts) in the construction dtype on ``device`` when it is reached: only that
    parameter's tensors are read (``safe_open`` maps the files; a tensor's bytes are read when it is taken).
    ``lazy``: yield each as an :class:`HFValue`, read when and as far as the taker asks (a rank its own rows).

    Every problem is found before the first value: unexpected, missing or duplicated tensors, wrong shapes
    or non-floating-point dtypes (from the files' headers), unreadable files.
    """
    from safetensors import SafetensorError, safe_open

    wmap = hf_weight_map(cfg)
    sources: dict[str, list[tuple[str, int | None, int | None, str]]] = {}  # param -> (HF key, rows, index)
    for key, (lp, lo, hi) in wmap.items():
        base, _, index = lp.partition("[")
        sources.setdefault(base, []).append((key, lo, hi, index[:-1]))
    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[Path, object]] = {}
        unexpected: list[str] = []
        for f in safetensors_files(path):
            try:
                fh = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                keys = list(fh.keys())
            except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                raise _read_error(f, exc) from None
            for key in keys:
                if key not in wmap:
                    if not (key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and cfg.tie_embeddings)):
                        unexpected.append(key)
                    continue
                if key in where:
                    raise UsageError(f"{f.name}: tensor {key} appears in more than one file")
                where[key] = (f, fh)
        if unexpected:
            raise UsageError(
                f"{path}: unexpected tensor(s) {', '.join(unexpected[:4])}"
                f"{' ...' if len(unexpected) > 4 else ''} for a {cfg.family} model"
            )
        missing = [k for k in wmap if k not in where]
        if missing:
            raise UsageError(f"{path}: missing tensor(s) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        with torch.device("meta"):
            shapes = dict(Decoder(cfg).named_parameters())
        for name, srcs in sources.items():  # headers: shape and dtype of every tensor, before any is read
            for key, lo, hi, index in srcs:
                f, fh = where[key]
                try:
                    piece = fh.get_slice(key)
                    shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
                    raise _read_error(f, exc) from None
                dst = shapes[name][int(index)] if index else shapes[name]
                dst = dst if lo is None else dst[lo:hi]
                if not dtype.startswith(("F", "BF")):
                    held = _INT_NAMES.get(dtype, dtype.lower())
                    raise UsageError(f"{f.name}: tensor {key} holds {held}, not floating-point weights")
                if shape != tuple(dst.shape):
                    raise UsageError(
                        f"{f.name}: tensor {key} has shape {shape}, expected {tuple(dst.shape)} from config.json"
                    )
        for name, p in shapes.items():
            value = HFValue(p.shape, p.dtype, device, [(*where[key], key, *rows) for key, *rows in sources[name]])
            yield name, value if lazy else value.read_whole()


def check_hf_checkpoint(path: PathLike, cfg: ModelConfig) -> None:
    """Raise the UsageError :func:`hf_values` would for checkpoint folder ``path`` and ``cfg``, from the files'
    headers alone (no tensor is read)."""
    values = hf_values(path, cfg, lazy=True)
    next(values, None)
    values.close()


@torch.no_grad()
def load_hf_weights(model: Decoder, path: PathLike) -> Decoder:
    """Fill ``model``'s parameters from the safetensors files of checkpoint folder ``path`` (:func:`hf_values`:
    one parameter's tensors read at a time, cast to the parameter's dtype and device); every expected tensor
    must be present with its exact shape."""
    cfg = model.cfg
    params = dict(model.named_parameters())
    covered = {lp.partition("[")[0] for lp, _, _ in hf_weight_map(cfg).values()}
    if covered != set(params):  # the model is not a plain Decoder (LoRA wrappers ...)
        raise UsageError(
            f"{cfg.name}: cannot load HF weights into this model: parameters "
            f"{sorted(set(params) ^ covered)[:4]} do not match a Llama/Qwen3 layout"
        )
    for name, full in hf_values(path, cfg):
        params[name].copy_(full)
    return model


def load_hf_checkpoint(
    path: PathLike, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Decoder:
    """A :class:`Decoder` with the architecture and weights of HF checkpoint folder ``path``.

    Parameters are held in ``dtype`` (FP32 master weights by default, as for training) on
    ``device``; nothing is randomly initialised (the model is built on the meta device first).
    """
    cfg = config_from_hf(path)
    with torch.device("meta"):
        model = Decoder(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie again
        model.lm_head.weight = model.tok_embeddings.weight
    return load_hf_weights(model, path)


# --------------------------------------------------------------------------- export


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of ``model`` (fused weights split), in ``dtype`` (None: as stored)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise UsageError("export needs an lpbench Decoder (model.cfg)")
    hf_config_dict(cfg)  # raises for architectures HF Llama/Qwen3 cannot hold
    params = dict(model.named_parameters(remove_duplicate=False))
    wmap = hf_weight_map(cfg)
    expected = {lp for lp, _, _ in wmap.values()} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if set(params) != expected:
        extra = sorted(set(params) - expected)
        hint = (
            " (merge LoRA adapters first: lpbench.convert.lora.merge_lora)" if any("lora_" in n for n in extra) else ""
        )
        raise UsageError(
            f"{cfg.name}: parameters {extra[:4] or sorted(expected - set(params))[:4]} have no Hugging Face name{hint}"
        )
    out = {}
    for key, (lp, lo, hi) in wmap.items():
        t = params[lp].detach()
        if hasattr(t, "full_tensor"):  # DTensor (FSDP2 / TP): gather
            t = t.full_tensor()
        t = t if lo is None else t[lo:hi]
        out[key] = t.to(device="cpu", dtype=dtype or t.dtype).contiguous().clone()
    return out


def export_hf_checkpoint(model: torch.nn.Module, path: PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``path/config.json`` and ``path/model.safetensors`` that transformers loads as
    ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``. ``dtype``: the stored dtype (None: the parameters')."""
    from safetensors.torch import save_file

    tensors = hf_state_dict(model, dtype)
    stored = next(iter(tensors.values())).dtype
    cfg = getattr(model, "_orig_mod", model).cfg
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{SAFETENSORS_FILE}.tmp{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / SAFETENSORS_FILE)
    index = out / SAFETENSORS_INDEX
    if index.exists():  # a stale index would point transformers at old shards
        index.unlink()
    tmp = out / f".config.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(hf_config_dict(cfg, stored), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / "config.json")
    return out

"""RunConfig: everything that defines one run, frozen and validated before anything starts."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from lpbench.errors import UsageError
from lpbench.metrics.flops import FORMULAS
from lpbench.models.registry import ModelConfig, first_blocks, get_model_config, model_label, with_overrides
from lpbench.precision.capability import EMULATE_ALWAYS
from lpbench.precision.quantize import Scaling
from lpbench.precision.recipes import get_recipe

NOT_IN_KEY = ("save_every", "save_dir", "load", "profile_steps", "tensorboard")  # see RunConfig.key
WORKLOADS = ("pretrain", "sft", "lora")  # lpbench/train/workload.py
LORA_BASE_STORAGES = ("bf16", "quantized")
COMPILE_SCOPES = ("block", "model")  # lpbench/parallel/plan.py
FSDP_SHARDS = ("zero3", "zero2", "zero1")  # lpbench/parallel/dp.py
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
LAYOUT_SINCE_KEYS = ("pp", "cp", "dp_replicate", "fsdp_shard", "grad_reduce_dtype")  # see RunConfig.key
MAX_SIZE = 2**31 - 1  # sizes, counts and steps: what int32 indexing and the data pipeline hold
MAX_SEED = 2**63 - 1  # torch, numpy and random all take a seed below 2**63


def check_number(name: str, value, kind: type) -> None:
    """One numeric setting (flag or sweep-spec value) is usable: finite, and integers in range."""
    flag = f"--{name.replace('_', '-')}"
    if value is None:
        return
    if kind is float and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise UsageError(f"{flag} must be a finite number, got {value!r}")
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{flag} must be an integer, got {value!r}")
        top = MAX_SEED if name == "seed" else MAX_SIZE
        if not -top <= value <= top:
            raise UsageError(f"{flag} {value} is out of range (at most {top:,})")


def arg(help: str, default_text: str | None = None, **argparse_kw) -> dict:
    """Field metadata that makes a RunConfig field a command-line flag (:func:`add_config_args`).

    ``help`` is the flag's help without its default; ``default_text`` replaces "default X" where
    the default is not a plain value; ``argparse_kw`` go to ``add_argument`` (choices, metavar, aliases),
    except, for a bool field, ``words``: the strings it also takes (``--flag WORD``), and ``off``: the help of
    its ``--no-flag``.
    """
    return {"help": help, "default_text": default_text, **argparse_kw}


@dataclass(frozen=True)
class RunConfig:
    """One run. A field with ``arg(...)`` metadata is a flag of ``lpbench run`` (and, where named,
    of ``lpbench converge``) and a key of sweep specs; the rest are set by code or sweep specs."""

    model: str = field(default="tiny", metadata=arg(
        "model name from `lpbench models` (with --hf-checkpoint: hf:<folder>, or a zoo model of the "
        "checkpoint's shape to label the run)"))
    num_layers: int | None = field(default=None, metadata=arg(
        "keep the model's first N blocks (widths and vocabulary unchanged), as Megatron's --num-layers: measures "
        "a large model's blocks on one GPU; labelled model@NL, FLOPs and parameters counted for what ran", "all",
        metavar="N"))
    precision: str = "bf16"  # one recipe; `lpbench run --precision a,b` makes one config per recipe
    seq_len: int = field(default=256, metadata=arg("sequence length"))
    mbs: int = field(default=8, metadata=arg("micro batch size per GPU"))
    gbs: int = field(default=8, metadata=arg("global batch size; grad accumulation = GBS / (MBS x DP)"))
    steps: int = field(default=40, metadata=arg("optimizer steps"))
    warmup_steps: int = field(default=10, metadata=arg("first steps excluded from timing"))
    lr: float | None = field(default=None, metadata=arg(
        "peak learning rate", "3e-3 for the CPU-sized presets, 3e-4 otherwise"))
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int | None = None  # default: 10% of steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = field(default=1234, metadata=arg("random seed for weights and data"))
    device: str = field(default="auto", metadata=arg("auto (GPU if present), cpu, cuda or cuda:N"))
    compile: bool | None = field(default=None, metadata=arg("torch.compile the model", "on for CUDA, off for CPU"))
    compile_scope: str = field(default="block", metadata=arg(
        "what one compiled graph holds: each block and the output head apart (compiles one block's code for "
        "all), or the whole model (one process or DDP: slower to compile, fuses across blocks)",
        choices=COMPILE_SCOPES))
    fused_loss: bool = field(default=False, metadata=arg(
        "LM head + cross-entropy over chunks of tokens, never the whole batch's FP32 logits (exact: the unfused "
        "head's loss and gradients up to summation order); cuts memory where the head runs eagerly (CPU, "
        "--no-compile). Off by default: the compiled unfused head keeps no FP32 logits either and was faster"))
    emulate: bool | str | None = field(default=None, metadata=arg(
        "exact emulation (slower, same numerics) of the recipes this device cannot run natively; --emulate "
        "always: emulate even those it runs natively, to compare the two paths", "on for CPU, off on GPU",
        words=(EMULATE_ALWAYS,), off="refuse a recipe this device cannot run natively"))
    flops_formula: str = field(default="megatron", metadata=arg("model FLOPs formula: megatron, nemo-legacy or mha"))
    data: str = field(default="mock", metadata=arg(
        "mock (learnable random-walk tokens), mock-uniform (NeMo's uniform tokens), a text/JSONL/parquet file "
        "or folder, or a Megatron .bin/.idx prefix; for sft/lora: mock (prompt/response samples) or a "
        "JSONL/parquet file or folder of them"))
    workload: str = field(default="pretrain", metadata=arg(
        "pretrain; sft: packed prompt/response samples, loss on responses, attention per sample; lora: sft "
        "with a frozen base and trained low-rank adapters", choices=WORKLOADS))
    hf_checkpoint: str | None = field(default=None, metadata=arg(
        "start from a local Hugging Face Llama/Qwen3/Qwen3-MoE folder (config.json + *.safetensors): its architecture "
        "and weights instead of a randomly initialised --model", "none", metavar="PATH"))
    lora_rank: int = field(default=32, metadata=arg("LoRA adapter rank"))  # NeMo's and Megatron-Bridge's
    lora_alpha: float = field(default=32.0, metadata=arg("LoRA alpha; adapters are scaled by alpha / rank"))
    lora_targets: str = field(default="qkv,o,mlp", metadata=arg(
        "linears of every block that get adapters: qkv, o, mlp (or gate_up, up, down)"))
    lora_base_storage: str = field(default="bf16", metadata=arg(
        "frozen base weights in BF16, quantized by the recipe every step, or quantized once in the "
        "recipe's format with the BF16 copy freed (less memory, same numerics)", choices=LORA_BASE_STORAGES))
    backend: str = field(default="lpbench", metadata=arg(  # torchao: its training linears (FP8, MXFP8, NVFP4)
        "lpbench or torchao: run fp8-tensorwise/-rowwise/-rowwise-gw-hp through torchao's "
        "convert_to_float8_training, mxfp8 through its MXFP8Linear and nvfp4 through its NVFP4Linear (compute "
        "capability 10.x only) on the same linears, MoE experts with fp8-rowwise through "
        "torchao.prototype.moe_training (needs lpbench[torchao])"))
    moe_aux_loss_coeff: float = field(default=0.0, metadata=arg(
        "MoE load-balancing loss coefficient (Switch/Megatron: E x sum of token share x mean probability per "
        "expert, per layer; e.g. 0.01), applied as router gradients: lm loss stays the cross-entropy"))
    moe_z_loss_coeff: float = field(default=0.0, metadata=arg("MoE router z-loss coefficient (ST-MoE; e.g. 0.001)"))
    ep: int = field(default=1, metadata=arg(
        "expert-parallel size: each MoE layer's experts spread over this many data-parallel ranks, tokens "
        "exchanged all-to-all; must divide the experts and the data-parallel size"))
    dp: int = field(default=1, metadata=arg(
        "data-parallel size; DP = world size / TP, so only a check", "derived"))
    tp: int = field(default=1, metadata=arg("tensor-parallel size", aliases=("-tp",)))
    pp: int = field(default=1, metadata=arg("pipeline-parallel size (not supported yet: 1 only)"))
    cp: int = field(default=1, metadata=arg("context-parallel size (not supported yet: 1 only)"))
    dp_replicate: int = field(default=1, metadata=arg(
        "with --fsdp, HSDP: this many replicas of the FSDP shards (shard within a group of DP / N ranks, e.g. a "
        "node; gradients all-reduced across the replicas)", metavar="N"))
    fsdp: bool = field(default=False, metadata=arg(
        "shard the data-parallel dimension with FSDP2 (per-block groups, BF16 all-gather on CUDA, FP32 "
        "gradient reduce-scatter) instead of DDP"))
    fsdp_fp8_all_gather: bool = field(default=False, metadata=arg(
        "with --fsdp and fp8-tensorwise/-delayed: all-gather the quantized linears' weights as FP8 codes "
        "(1 byte/element) under one scale for the whole weight, used as gathered"))
    fsdp_shard: str = field(default="zero3", metadata=arg(
        "what FSDP2 keeps sharded between uses: zero3 (parameters re-gathered for every micro-batch's forward "
        "and backward), zero2 (gathered once per micro-batch, kept from forward to backward), zero1 "
        "(gathered once per optimizer step, kept unsharded across the micro-batches of gradient accumulation; "
        "most memory); gradients are reduce-scattered once per step in all three", choices=FSDP_SHARDS))
    grad_reduce_dtype: str = field(default="fp32", metadata=arg(
        "dtype of the data-parallel gradient reduction (FSDP2 reduce-scatter, DDP all-reduce)",
        choices=GRAD_REDUCE_DTYPES))
    sequence_parallel: bool = field(default=True, metadata=arg(
        "with --tp > 1, split norms and residuals along the sequence"))
    log_interval: int = field(default=1, metadata=arg("print a log line every N steps"))
    vocab_size: int | None = None  # overrides the zoo model's vocabulary (converge sizes it to the tokenizer)
    eval_every: int = field(default=0, metadata=arg(
        "validation loss every K steps and at the last step", "0: never", metavar="K"))
    eval_batches: int = field(default=0, metadata=arg(
        "micro-batches per evaluation", "0: the whole validation split", metavar="N"))
    # How a run is executed and observed, not what it is: left out of key() (see NOT_IN_KEY).
    save_every: int = field(default=0, metadata=arg(
        "write a checkpoint every K steps (not at the end unless K divides --steps) as --save-dir/step-K; "
        "needs --save-dir and one --precision", "0: never", metavar="K"))
    save_dir: str | None = field(default=None, metadata=arg(
        "folder for --save-every's checkpoints (model, optimizer, LR schedule, data position, RNG; written "
        "atomically, an existing step-K is replaced)", "none", metavar="DIR"))
    load: str | None = field(default=None, metadata=arg(
        "resume from a checkpoint: DIR/step-K, or DIR for its latest step-K; continues at step K+1 up to "
        "--steps, reproducing the uninterrupted run's losses; model, precision, shapes, parallel layout, "
        "data and seed must match the checkpoint's", "none", metavar="PATH"))
    profile_steps: str | None = field(default=None, metadata=arg(
        "profile steps A..B (inclusive; pick them after warm-up) with torch.profiler: a Chrome trace in "
        "RESULTS/profiles/<run key>/ and a GEMM / quantize / attention / comm / other time table; profiled "
        "steps are left out of the timing", "none", metavar="A:B"))
    tensorboard: str | None = field(default=None, metadata=arg(
        "also write each step's metrics as TensorBoard scalars to DIR/<model>-<precision>-<run key> (needs "
        "`pip install tensorboard`)", "none", metavar="DIR"))

    @property
    def grad_accum(self) -> int:
        """NeMo's gradient accumulation: GBS / (MBS x DP)."""
        return self.gbs // (self.mbs * self.dp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 3e-3 if self.model_config().dim <= 512 else 3e-4

    @property
    def lr_warmup(self) -> int:
        return self.lr_warmup_steps if self.lr_warmup_steps is not None else max(1, self.steps // 10)

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` "A:B" as (A, B), or None."""
        if self.profile_steps is None:
            return None
        first, sep, last = str(self.profile_steps).partition(":")
        try:
            return int(first), int(last if sep else first)
        except ValueError:
            raise UsageError(f"--profile-steps takes A:B (first and last step), got {self.profile_steps!r}") from None

    def model_config(self) -> ModelConfig:
        """The architecture: the zoo's ``model``, or ``hf_checkpoint``'s config.json labelled ``model``."""
        if self.hf_checkpoint is None:
            return with_overrides(first_blocks(get_model_config(self.model), self.num_layers),
                                  vocab_size=self.vocab_size)
        from lpbench.models.hf import hf_model_config

        return hf_model_config(self.model, self.hf_checkpoint)

    @property
    def label(self) -> str:
        """The model as tables and the results store name it: ``llama3-8b@16L`` when cut to 16 blocks."""
        return model_label(self.model, self.num_layers)

    def _validate_workload(self) -> None:
        if self.workload not in WORKLOADS:
            raise UsageError(f"unknown workload {self.workload!r}; valid: {', '.join(WORKLOADS)}")
        if self.workload != "lora":
            changed = [f.name for f in fields(self)
                       if f.name.startswith("lora_") and getattr(self, f.name) != f.default]
            if changed:
                raise UsageError(f"--{changed[0].replace('_', '-')} applies to --workload lora only "
                                 f"(this run is {self.workload})")
            return
        from lpbench.models.lora import expand_targets

        if self.lora_rank <= 0:
            raise UsageError(f"--lora-rank must be positive, got {self.lora_rank}")
        width = self.model_config().dim
        if self.lora_rank > width:
            raise UsageError(f"--lora-rank {self.lora_rank} exceeds {self.model}'s width {width}: an adapter of "
                             "that rank is no longer low-rank")
        if not self.lora_alpha > 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        expand_targets(self.lora_targets)
        if self.lora_base_storage not in LORA_BASE_STORAGES:
            raise UsageError(f"unknown --lora-base-storage {self.lora_base_storage!r}; "
                             f"valid: {', '.join(LORA_BASE_STORAGES)}")
        if self.tp > 1 or self.fsdp:
            raise UsageError("--workload lora runs on one GPU or data-parallel with DDP; "
                             "--tp and --fsdp are not supported for LoRA yet")
        if self.lora_base_storage == "quantized" and self.backend != "lpbench":
            raise UsageError("--lora-base-storage quantized needs --backend lpbench")

    def validate(self) -> "RunConfig":
        if self.num_layers is not None and self.hf_checkpoint is not None:
            raise UsageError("--num-layers cuts a zoo model; a --hf-checkpoint keeps its own blocks")
        for f in fields(self):
            if field_type(f) in (int, float):
                check_number(f.name, getattr(self, f.name), field_type(f))
        for f in fields(self):  # a switch that also takes words (--emulate always) set from code or a file
            value, words = getattr(self, f.name), f.metadata.get("words")
            if words and not (value is None or isinstance(value, bool) or value in words):
                raise UsageError(f"--{f.name.replace('_', '-')} is on, off or {' or '.join(words)}, got {value!r}")
        if self.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {self.seed}")
        model = self.model_config()
        get_recipe(self.precision)
        for name in ("seq_len", "mbs", "gbs", "steps", "dp", "tp", "log_interval"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= self.steps:
            raise UsageError(f"--warmup-steps ({self.warmup_steps}) must be less than --steps ({self.steps}): "
                             "no step would be timed")
        if self.gbs % (self.mbs * self.dp):
            raise UsageError(f"global batch {self.gbs} is not divisible by micro batch {self.mbs} "
                             f"x data-parallel size {self.dp}")
        for what, n in (("attention heads", model.n_heads), ("kv heads", model.n_kv_heads),
                        ("FFN width", model.ffn_dim)):
            if n % self.tp:
                raise UsageError(f"--tp {self.tp} does not divide {self.model}'s {n} {what}")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise UsageError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
        if (self.moe_aux_loss_coeff or self.moe_z_loss_coeff or self.ep > 1) and not model.n_experts:
            raise UsageError(f"--ep and --moe-*-loss-coeff apply to mixture-of-experts models; {self.model} is dense")
        if self.ep < 1 or model.n_experts % self.ep:  # the layout's rules: lpbench.parallel.dims.ParallelDims
            raise UsageError(f"--ep {self.ep} must divide {self.model}'s {model.n_experts} experts")
        if self.ep > 1 and self.workload == "lora":
            raise UsageError("--ep > 1 does not train LoRA adapters: use --ep 1")
        if self.tp > 1 and self.sequence_parallel and self.seq_len % self.tp:
            raise UsageError(f"sequence parallelism needs --seq-len ({self.seq_len}) divisible by --tp {self.tp} "
                             "(or --no-sequence-parallel)")
        if self.seq_len > model.max_seq_len:
            raise UsageError(f"--seq-len {self.seq_len} exceeds {self.model}'s limit of {model.max_seq_len}")
        from lpbench.precision.policy import BACKENDS

        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "torchao":
            from lpbench.precision.torchao_backend import run_problem

            if problem := run_problem(self.precision, self.mbs * self.seq_len, self.tp):
                raise UsageError(problem)
        if self.flops_formula not in FORMULAS:
            raise UsageError(f"unknown FLOP formula {self.flops_formula!r}; valid: {', '.join(FORMULAS)}")
        if self.fsdp_fp8_all_gather and not self.fsdp:
            raise UsageError("--fsdp-fp8-all-gather needs --fsdp")
        if self.fsdp_fp8_all_gather and (get_recipe(self.precision).scaling not in (Scaling.TENSOR, Scaling.DELAYED)
                                         or self.backend != "lpbench"):
            raise UsageError(f"--fsdp-fp8-all-gather needs precision fp8-tensorwise or fp8-delayed on the lpbench "
                             f"backend, not {self.precision} ({self.backend})")
        if self.fsdp_shard not in FSDP_SHARDS:
            raise UsageError(f"unknown --fsdp-shard {self.fsdp_shard!r}; valid: {', '.join(FSDP_SHARDS)}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise UsageError(f"unknown --grad-reduce-dtype {self.grad_reduce_dtype!r}; "
                             f"valid: {', '.join(GRAD_REDUCE_DTYPES)}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise UsageError(f"unknown --compile-scope {self.compile_scope!r}; valid: {', '.join(COMPILE_SCOPES)}")
        if self.compile_scope == "model" and (self.fsdp or self.tp > 1):
            raise UsageError("--compile-scope model needs one process or DDP; FSDP and TP compile each block")
        self._validate_workload()
        if self.lr is not None and self.lr <= 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.eval_every < 0 or self.eval_batches < 0:
            raise UsageError(f"--eval-every and --eval-batches must be >= 0, "
                             f"got {self.eval_every} and {self.eval_batches}")
        if self.vocab_size is not None and (self.vocab_size < 2 or self.hf_checkpoint):
            raise UsageError("vocab_size overrides a zoo model's vocabulary: >= 2, and not with --hf-checkpoint")
        if self.save_every < 0:
            raise UsageError(f"--save-every must be >= 0, got {self.save_every}")
        if bool(self.save_every) != bool(self.save_dir):
            raise UsageError("--save-every K needs --save-dir DIR" if self.save_every else
                             "--save-dir needs --save-every K (steps between checkpoints)")
        first, last = self.profile_range or (1, 1)
        if not 1 <= first <= last <= self.steps:
            raise UsageError(f"--profile-steps {self.profile_steps}: need 1 <= A <= B <= --steps ({self.steps})")
        return self

    def with_world(self, world_size: int, dp: int | None = None) -> "RunConfig":
        """This config on ``world_size`` ranks: DP = world / (TP x PP x CP) (``dp``, if given, must agree)."""
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name} must be positive, got {getattr(self, name)}")
        other = self.tp * self.pp * self.cp
        what = " x ".join(f"--{n} {getattr(self, n)}" for n in ("tp", "pp", "cp") if n == "tp" or getattr(self, n) > 1)
        if world_size % other:
            raise UsageError(f"world size {world_size} is not divisible by {what} "
                             "(start processes with --nproc-per-node, torchrun or srun)")
        if dp is not None and dp * other != world_size:
            raise UsageError(f"--dp {dp} x {what} = {dp * other} ranks, but the world size is {world_size}")
        return replace(self, dp=world_size // other)

    def with_(self, **kw) -> "RunConfig":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self) -> str:
        """Stable hash of the config: identifies a run across resumed sweeps.

        Checkpointing and profiling (NOT_IN_KEY) do not change what a run trains or measures
        (profiled steps are left out of the timing), so a resumed or profiled run keeps its key.
        """
        kept = {k: v for k, v in self.to_dict().items() if k not in NOT_IN_KEY}
        if self.num_layers is None:  # the full model keeps the key it had before --num-layers existed
            del kept["num_layers"]
        if not self.fused_loss:  # runs keep the keys they had before the fused loss existed
            del kept["fused_loss"]
        for name in LAYOUT_SINCE_KEYS:  # likewise the layout settings added later, at their defaults
            if kept[name] == RunConfig.__dataclass_fields__[name].default:
                del kept[name]
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def field_type(f) -> type:
    """The type of a RunConfig field: its annotation without ``| None``."""
    return {"int": int, "float": float, "bool": bool, "str": str}[str(f.type).split("|")[0].strip()]


def flag_fields(names=None) -> list:
    """The RunConfig fields that are flags (``arg`` metadata), or those of them in ``names``."""
    return [f for f in fields(RunConfig) if "help" in f.metadata and (names is None or f.name in names)]


def _shown(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) \
        else str(value)


def add_config_args(parser: argparse.ArgumentParser, names=None, defaults: dict | None = None,
                    default_texts: dict | None = None) -> None:
    """One flag per RunConfig field with ``arg`` metadata (or per field in ``names``), typed by its annotation.

    Without ``defaults`` every flag defaults to None, so an explicit flag can be told from a default
    (:func:`config_kwargs`); with it, a flag defaults to ``defaults.get(name, field default)``. The help
    ends with the default: ``default_texts[name]``, else the field's ``default_text`` (unless ``defaults``
    changes it), else the value.
    """
    for f in flag_fields(names):
        meta = dict(f.metadata)
        help_text, text, aliases = meta.pop("help"), meta.pop("default_text"), meta.pop("aliases", ())
        value = (defaults or {}).get(f.name, f.default)
        if f.name in (default_texts or {}) or f.name in (defaults or {}):  # the command's default, not the field's
            text = (default_texts or {}).get(f.name)
        meta["help"] = f"{help_text} (default {_shown(value)})" if text is None else f"{help_text} (default: {text})"
        meta["default"] = value if defaults is not None else None
        words, off = meta.pop("words", ()), meta.pop("off", None)
        if words:  # --flag [WORD] and --no-flag
            parser.add_argument("--" + f.name.replace("_", "-"), *aliases, nargs="?", const=True, choices=words,
                                metavar="|".join(words), **meta)
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=False,
                                default=meta["default"], help=off)
            continue
        if field_type(f) is bool:
            meta["action"] = argparse.BooleanOptionalAction
        else:
            meta["type"] = field_type(f)
        parser.add_argument("--" + f.name.replace("_", "-"), *aliases, **meta)


def config_kwargs(args: argparse.Namespace, names=None) -> dict:
    """The RunConfig fields ``args`` sets (flags given, or with a default other than None)."""
    return {f.name: getattr(args, f.name) for f in flag_fields(names) if getattr(args, f.name, None) is not None}

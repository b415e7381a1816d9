"""RunConfig: everything that defines one run, frozen and validated before anything starts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace

from lpbench.errors import UsageError
from lpbench.metrics.flops import FORMULAS
from lpbench.models.registry import ModelConfig, first_blocks, get_model_config, model_label, with_overrides
from lpbench.precision.recipes import get_recipe

NOT_IN_KEY = ("save_every", "save_dir", "load", "profile_steps")  # see RunConfig.key
WORKLOADS = ("pretrain", "sft", "lora")  # lpbench/train/workload.py
LORA_BASE_STORAGES = ("bf16", "quantized")
COMPILE_SCOPES = ("block", "model")  # lpbench/parallel/plan.py


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny"
    num_layers: int | None = None  # keep the model's first N blocks (widths, vocabulary kept); labelled model@NL
    precision: str = "bf16"
    seq_len: int = 256
    mbs: int = 8
    gbs: int = 8
    steps: int = 60
    warmup_steps: int = 10  # excluded from timing
    lr: float | None = None  # default: 3e-3 for CPU-sized presets (dim <= 512), else 3e-4
    min_lr_ratio: float = 0.1
    lr_warmup_steps: int | None = None  # default: 10% of steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compile: bool | None = None  # default: on for CUDA, off for CPU
    compile_scope: str = "block"  # "block": each block and the head apart; "model": one whole-model graph
    emulate: bool | None = None  # default: on for CPU; on GPU only when asked
    flops_formula: str = "megatron"
    data: str = "mock"
    workload: str = "pretrain"  # pretrain | sft | lora (see lpbench/train/workload.py)
    hf_checkpoint: str | None = None  # local HF Llama/Qwen3 folder: architecture and weights; model labels it
    lora_rank: int = 32  # workload lora only: adapter rank ...
    lora_alpha: float = 32.0  # ... and scale alpha / rank (NeMo's and Megatron-Bridge's defaults)
    lora_targets: str = "qkv,o,mlp"  # adapted linears of every block (lpbench.models.lora.TARGETS)
    lora_base_storage: str = "bf16"  # frozen base in the compute dtype, or "quantized" once in the recipe's format
    backend: str = "lpbench"  # "torchao": torchao's training linears on the same linears (FP8, MXFP8, NVFP4)
    dp: int = 1  # data-parallel size = world size / tp (see with_world)
    tp: int = 1  # tensor-parallel size
    fsdp: bool = False  # shard the data-parallel dimension with FSDP2 instead of DDP
    fsdp_fp8_all_gather: bool = False  # FSDP2 all-gathers fp8-tensorwise/-delayed weights in FP8
    sequence_parallel: bool = True  # with tp > 1: norms and residuals split along the sequence
    log_interval: int = 1
    vocab_size: int | None = None  # overrides the zoo model's vocabulary (converge sizes it to the tokenizer)
    eval_every: int = 0  # validation loss every K steps and at the last step (0: never)
    eval_batches: int = 0  # micro-batches per evaluation (0: every full one of the validation split)
    # How a run is executed and observed, not what it is: left out of key() (see NOT_IN_KEY).
    save_every: int = 0  # write a checkpoint every K steps (0: never) ...
    save_dir: str | None = None  # ... as save_dir/step-K (lpbench/train/checkpoint.py)
    load: str | None = None  # resume from this checkpoint, or the latest step-K in this folder
    profile_steps: str | None = None  # "A:B": torch.profiler over steps A..B (lpbench/metrics/profile.py)

    @property
    def grad_accum(self) -> int:
        """NeMo's gradient accumulation: GBS / (MBS x DP)."""
        return self.gbs // (self.mbs * self.dp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

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
        if self.fsdp_fp8_all_gather and (get_recipe(self.precision).scaling not in ("tensor", "delayed")
                                         or self.backend != "lpbench"):
            raise UsageError(f"--fsdp-fp8-all-gather needs precision fp8-tensorwise or fp8-delayed on the lpbench "
                             f"backend, not {self.precision} ({self.backend})")
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
        """This config on ``world_size`` ranks: DP = world / TP (``dp``, if given, must agree)."""
        if self.tp <= 0:
            raise UsageError(f"--tp must be positive, got {self.tp}")
        if world_size % self.tp:
            raise UsageError(f"world size {world_size} is not divisible by --tp {self.tp} "
                             "(start processes with --nproc-per-node, torchrun or srun)")
        if dp is not None and dp * self.tp != world_size:
            raise UsageError(f"--dp {dp} x --tp {self.tp} = {dp * self.tp} ranks, but the world size is {world_size}")
        return replace(self, dp=world_size // self.tp)

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
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]

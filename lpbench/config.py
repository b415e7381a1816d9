"""RunConfig: everything that defines one run, frozen and validated before anything starts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

from lpbench.errors import UsageError
from lpbench.metrics.flops import FORMULAS
from lpbench.models.registry import get_model_config
from lpbench.precision.recipes import get_recipe


@dataclass(frozen=True)
class RunConfig:
    model: str = "tiny"
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
    emulate: bool | None = None  # default: on for CPU; on GPU only when asked
    flops_formula: str = "megatron"
    data: str = "mock"
    backend: str = "lpbench"  # "torchao": torchao's Float8Linear on the same linears (FP8 recipes)
    dp: int = 1  # data-parallel size = world size / tp (see with_world)
    tp: int = 1  # tensor-parallel size
    fsdp: bool = False  # shard the data-parallel dimension with FSDP2 instead of DDP
    sequence_parallel: bool = True  # with tp > 1: norms and residuals split along the sequence
    log_interval: int = 1

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
        return 3e-3 if get_model_config(self.model).dim <= 512 else 3e-4

    @property
    def lr_warmup(self) -> int:
        return self.lr_warmup_steps if self.lr_warmup_steps is not None else max(1, self.steps // 10)

    def validate(self) -> "RunConfig":
        model = get_model_config(self.model)
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
        if self.flops_formula not in FORMULAS:
            raise UsageError(f"unknown FLOP formula {self.flops_formula!r}; valid: {', '.join(FORMULAS)}")
        if self.lr is not None and self.lr <= 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
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
        """Stable hash of the config: identifies a run across resumed sweeps."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

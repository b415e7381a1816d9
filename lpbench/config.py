"""RunConfig: everything that defines one run, frozen and validated before anything starts."""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from lpbench.errors import UsageError
from lpbench.metrics.flops import FORMULAS
from lpbench.models.registry import ModelConfig, first_blocks, get_model_config, model_label, with_overrides
from lpbench.precision.capability import EMULATE_ALWAYS
from lpbench.precision.quantize import Scaling
from lpbench.precision.recipes import get_recipe
from lpbench.sharding import fsdp_requested

WORKLOADS = ("pretrain", "sft", "lora")  # lpbench/train/workload.py
LORA_BASE_STORAGES = ("bf16", "quantized")
COMPILE_SCOPES = ("block", "model")  # lpbench/parallel/plan.py
DEFAULT_PRECISIONS = ("bf16", "fp8-tensorwise", "mxfp8", "nvfp4")  # `lpbench run` and `converge` compare these
FSDP_SHARDS = ("zero3", "zero2", "zero1")  # lpbench/parallel/dp.py
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble", "zbv")  # lpbench.parallel.pp: torch's classes
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
RECOMPUTES = ("none", "selective", "full")  # lpbench/parallel/recompute.py
OFFLOAD_NEEDS_GPU = (
    "--offload-optimizer moves AdamW's states from a GPU to the CPU (FSDP2's CPU offload); this run has no GPU"
)
MASTER_WEIGHTS = ("fp32", "bf16")  # lpbench/train/optim.py
OPTIMIZER_STATES = ("fp32", "bf16", "fp8", "8bit")  # lpbench/train/optim.py, lpbench/precision/optim_states.py
MAX_SIZE = 2**31 - 1  # sizes, counts and steps: what int32 indexing and the data pipeline hold
MAX_SEED = 2**63 - 1  # torch, numpy and random all take a seed below 2**63
SECTIONS = ("model", "precision", "parallel", "data", "optim", "observe", "other")  # --help groups, in order
# A setting's facts (``arg``'s keywords) and their values when a field does not state them.
FACTS = {
    "section": "other",
    "key": True,
    "resume": False,
    "layout": False,
    "converge": False,
    "sweep": True,
    "many": False,
    "derive": None,
}


def default_schedule(vp: int) -> str:
    """``--pp-schedule``'s default: 1F1B with one stage per rank, interleaved 1F1B with virtual stages."""
    return "1f1b" if vp == 1 else "interleaved-1f1b"


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


def arg(help: str, default_text: str | None = None, **kw) -> dict:
    """Field metadata declaring a RunConfig setting: a flag of ``lpbench run``, a ``--config`` key and a
    sweep key (:func:`add_config_args`), and the facts every other part of lpbench reads from it.

    ``help`` is the flag's help without its default; ``default_text`` replaces "default X" where
    the default is not a plain value. The facts (see :data:`FACTS` for the value a field that omits
    one gets):

    - ``section``: its group in ``--help`` (one of :data:`SECTIONS`);
    - ``key``: part of the run key (:meth:`RunConfig.key`); False for how a run is executed or
      observed (checkpoints, profiling), not what it trains or measures;
    - ``resume``: a checkpoint resumes only a run with the same value (shapes, layout, data order);
    - ``layout``: a parallel-layout or compilation column of the reports (runs differing in it are
      not compared);
    - ``converge``: also a flag of ``lpbench converge``;
    - ``sweep``: a sweep key (False: a setting of one run, e.g. its checkpoint folder);
    - ``many``: the flag takes a comma-separated list, one run per item (``--precision a,b``);
    - ``derive``: the default follows other settings: ``derive(config)`` gives it when unset (None).

    The other keywords go to ``add_argument`` (choices, metavar, aliases), except, for a bool
    field, ``words``: the strings it also takes (``--flag WORD``), and ``off``: the help of its
    ``--no-flag``.
    """
    return {"help": help, "default_text": default_text, **kw}


@dataclass(frozen=True)
class RunConfig:
    """One run: every setting declared once, as a field whose ``arg(...)`` metadata states its facts
    (flag, help, section, run key, resume, layout, converge, sweep). Settings are grouped by section;
    access stays flat (``cfg.tp``)."""

    # --- model: what is trained
    model: str = field(
        default="tiny",
        metadata=arg(
            "model name from `lpbench models` (with --hf-checkpoint: hf:<folder>, or a zoo model of the "
            "checkpoint's shape to label the run)",
            section="model",
            resume=True,
            converge=True,
        ),
    )
    num_layers: int | None = field(
        default=None,
        metadata=arg(
            "keep the model's first N blocks (widths and vocabulary unchanged), as Megatron's --num-layers: measures "
            "a large model's blocks on one GPU; labelled model@NL, FLOPs and parameters counted for what ran",
            "all",
            metavar="N",
            section="model",
            resume=True,
            converge=True,
        ),
    )
    vocab_size: int | None = field(
        default=None,
        metadata=arg(
            "override the zoo model's vocabulary (>= the data's token ids)",
            "the model's",
            metavar="N",
            section="model",
            resume=True,
        ),
    )
    hf_checkpoint: str | None = field(
        default=None,
        metadata=arg(
            "start from a local Hugging Face Llama/Qwen3/Qwen3-MoE folder (config.json + *.safetensors): its architecture "
            "and weights instead of a randomly initialised --model",
            "none",
            metavar="PATH",
            section="model",
        ),
    )
    workload: str = field(
        default="pretrain",
        metadata=arg(
            "pretrain; sft: packed prompt/response samples, loss on responses, attention per sample; lora: sft "
            "with a frozen base and trained low-rank adapters",
            choices=WORKLOADS,
            section="model",
            resume=True,
        ),
    )
    lora_rank: int = field(
        default=32,
        metadata=arg(  # NeMo's and Megatron-Bridge's
            "LoRA adapter rank", section="model", resume=True
        ),
    )
    lora_alpha: float = field(
        default=32.0, metadata=arg("LoRA alpha; adapters are scaled by alpha / rank", section="model")
    )
    lora_targets: str = field(
        default="qkv,o,mlp",
        metadata=arg(
            "linears of every block that get adapters: qkv, o, mlp (or gate_up, up, down)", section="model", resume=True
        ),
    )
    lora_base_storage: str = field(
        default="bf16",
        metadata=arg(
            "frozen base weights in BF16, quantized by the recipe every step, or quantized once in the "
            "recipe's format with the BF16 copy freed (less memory, same numerics)",
            choices=LORA_BASE_STORAGES,
            section="model",
        ),
    )
    moe_aux_loss_coeff: float = field(
        default=0.0,
        metadata=arg(
            "MoE load-balancing loss coefficient (Switch/Megatron: E x sum of token share x mean probability per "
            "expert, per layer; e.g. 0.01), applied as router gradients: lm loss stays the cross-entropy",
            section="model",
        ),
    )
    moe_z_loss_coeff: float = field(
        default=0.0, metadata=arg("MoE router z-loss coefficient (ST-MoE; e.g. 0.001)", section="model")
    )
    fused_loss: bool = field(
        default=False,
        metadata=arg(
            "LM head + cross-entropy over chunks of tokens, never the whole batch's FP32 logits (exact: the unfused "
            "head's loss and gradients up to summation order); cuts memory where the head runs eagerly (CPU, "
            "--no-compile); not under FSDP2 or CP, whose sharded LM head it does not take (the run header then says "
            "'LM loss unfused'); benchmarks/RESULTS.md compares the two",
            section="model",
        ),
    )

    # --- precision: how the GEMMs are computed
    precision: str = field(
        default="bf16",
        metadata=arg(
            "comma-separated recipes from `lpbench recipes` (RECIPE-no-INGREDIENT for an ablation), run one after "
            "another on the same work and compared against the first",
            f"{','.join(DEFAULT_PRECISIONS)}, emulating what the device lacks",
            metavar="A,B",
            many=True,
            section="precision",
            resume=True,
            converge=True,
        ),
    )
    backend: str = field(
        default="lpbench",
        metadata=arg(  # torchao: its training linears (FP8, MXFP8, NVFP4)
            "lpbench or torchao: run fp8-tensorwise/-rowwise/-rowwise-gw-hp through torchao's "
            "convert_to_float8_training, mxfp8 through its MXFP8Linear and nvfp4 through its NVFP4Linear (compute "
            "capability 10.x only) on the same linears, MoE experts with fp8-rowwise through "
            "torchao.prototype.moe_training (needs lpbench[torchao])",
            section="precision",
            resume=True,
        ),
    )
    emulate: bool | str | None = field(
        default=None,
        metadata=arg(
            "exact emulation (slower, same numerics) of the recipes this device cannot run natively; --emulate "
            "always: emulate even those it runs natively, to compare the two paths",
            "on for CPU, off on GPU",
            words=(EMULATE_ALWAYS,),
            off="refuse a recipe this device cannot run natively",
            section="precision",
            converge=True,
        ),
    )

    # --- parallel: where and how it runs
    device: str = field(
        default="auto", metadata=arg("auto (GPU if present), cpu, cuda or cuda:N", section="parallel", converge=True)
    )
    tp: int = field(
        default=1, metadata=arg("tensor-parallel size", aliases=("-tp",), section="parallel", resume=True, layout=True)
    )
    ep: int = field(
        default=1,
        metadata=arg(
            "expert-parallel size: each MoE layer's experts spread over this many data-parallel ranks, tokens "
            "exchanged all-to-all; must divide the experts and the data-parallel size",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    ep_chunks: int = field(
        default=1,
        metadata=arg(
            "with --ep: split each rank's experts into this many groups whose all-to-all runs asynchronously "
            "beside the other groups' expert GEMMs (grouped BF16/FP32 and FP8 row-/tensor-wise experts; "
            "bit-identical to 1, no overlap); each group's experts compile as a graph of their own; slower than "
            "1 on NVLink GPUs so far (docs/layout.md)",
            section="parallel",
            layout=True,
        ),
    )
    dp: int = field(
        default=1,
        metadata=arg(
            "data-parallel size; DP = world size / (TP x PP x CP), so only a check",
            "derived",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    pp: int = field(
        default=1,
        metadata=arg(
            "pipeline-parallel size: the blocks cut into this many stages of consecutive blocks, one per rank "
            "(embedding with the first, norm and LM head with the last; how many each: --pp-split); "
            "GBS / (MBS x DP) micro-batches per step",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    vp: int = field(
        default=1,
        metadata=arg(
            "virtual pipeline stages per rank (interleaved schedules): --pp x --vp stages, rank r holding stages "
            "r, r + PP, ...",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    pp_schedule: str | None = field(
        default=None,
        metadata=arg(
            "pipeline schedule (torch.distributed.pipelining): 1f1b, interleaved-1f1b, zero-bubble (interleaved, "
            "backward split into input and weight gradients) or zbv (zero bubble in a V, --vp 2)",
            "1f1b; interleaved-1f1b with --vp > 1",
            choices=PP_SCHEDULES,
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    pp_split: str = field(
        default="balanced",
        metadata=arg(
            "how the blocks are split over the pipeline stages: balanced (each rank's blocks plus, on the last "
            "stage's rank, the LM head counted as its FLOPs in blocks, as even as whole blocks allow), even (the "
            "first stages take the blocks left over), or one block count per stage in stage order (4,4,5,3)",
            metavar="balanced|even|N,N,...",
            section="parallel",
            layout=True,  # a checkpoint resumes on the same block counts, however asked (bench/runner.py)
        ),
    )
    cp: int = field(
        default=1,
        metadata=arg(
            "context-parallel size: each sequence split over this many ranks (2 x CP chunks, rank i holding chunks "
            "i and 2CP-1-i), attention over the whole sequence's keys (all-gathered), weights sharded with FSDP "
            "over the CP ranks too; every workload (packed samples keep their document masks), dense and MoE",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    dp_replicate: int = field(
        default=1,
        metadata=arg(
            "with --fsdp, HSDP: this many replicas of the FSDP shards (shard within a group of DP / N ranks, e.g. a "
            "node; gradients all-reduced across the replicas)",
            metavar="N",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=arg(
            "shard the data-parallel dimension with FSDP2 (per-block groups, BF16 all-gather on CUDA, FP32 "
            "gradient reduce-scatter) instead of DDP",
            section="parallel",
            resume=True,
            layout=True,
        ),
    )
    fsdp_fp8_all_gather: bool = field(
        default=False,
        metadata=arg(
            "with --fsdp and fp8-tensorwise/-delayed: all-gather the quantized linears' weights as FP8 codes "
            "(1 byte/element) under one scale for the whole weight, used as gathered",
            section="parallel",
            layout=True,
        ),
    )
    fsdp_shard: str = field(
        default="zero3",
        metadata=arg(
            "what FSDP2 keeps sharded between uses: zero3 (parameters re-gathered for every micro-batch's forward "
            "and backward), zero2 (gathered once per micro-batch, kept from forward to backward), zero1 "
            "(gathered once per optimizer step, kept unsharded across the micro-batches of gradient accumulation; "
            "most memory); gradients are reduce-scattered once per step in all three",
            choices=FSDP_SHARDS,
            section="parallel",
            layout=True,
        ),
    )
    grad_reduce_dtype: str = field(
        default="fp32",
        metadata=arg(
            "dtype of the data-parallel gradient reduction (FSDP2 reduce-scatter, DDP all-reduce)",
            choices=GRAD_REDUCE_DTYPES,
            section="parallel",
            resume=True,
        ),
    )
    sequence_parallel: bool = field(
        default=True,
        metadata=arg("with --tp > 1, split norms and residuals along the sequence", section="parallel", layout=True),
    )
    recompute: str = field(
        default="none",
        metadata=arg(
            "activation recomputation: none; selective (each block keeps its attention and every other GEMM's "
            "output, reruns the rest in the backward); full (each block keeps its input, reruns its forward); "
            "exact for every recipe",
            choices=RECOMPUTES,
            section="parallel",
            layout=True,
        ),
    )
    recompute_every: int = field(
        default=1,
        metadata=arg(
            "with --recompute: recompute every K-th block (blocks 0, K, 2K, ...)",
            metavar="K",
            section="parallel",
            layout=True,
        ),
    )
    compile: bool | None = field(
        default=None,
        metadata=arg(
            "torch.compile the model", "on for CUDA, off for CPU", section="parallel", layout=True, converge=True
        ),
    )
    compile_scope: str = field(
        default="block",
        metadata=arg(
            "what one compiled graph holds: each block and the output head apart (compiles one block's code for "
            "all), or the whole model (one process or DDP: slower to compile, fuses across blocks)",
            choices=COMPILE_SCOPES,
            section="parallel",
            layout=True,
        ),
    )

    # --- data: what the model reads, in which batches
    data: str = field(
        default="mock",
        metadata=arg(
            "mock (learnable random-walk tokens), mock-uniform (NeMo's uniform tokens), a text/JSONL/parquet file "
            "or folder, or a Megatron .bin/.idx prefix; for sft/lora: mock (prompt/response samples) or a "
            "JSONL/parquet file or folder of them",
            section="data",
            resume=True,
            converge=True,
        ),
    )
    seq_len: int = field(default=256, metadata=arg("sequence length", section="data", resume=True, converge=True))
    mbs: int = field(default=8, metadata=arg("micro batch size per GPU", section="data", resume=True, converge=True))
    gbs: int | None = field(
        default=None,
        metadata=arg(
            "global batch size; grad accumulation = GBS / (MBS x DP)",
            "MBS x DP",
            derive=lambda c: c.mbs * c.dp,
            section="data",
            resume=True,
            converge=True,
        ),
    )
    seed: int = field(
        default=1234, metadata=arg("random seed for weights and data", section="data", resume=True, converge=True)
    )

    # --- optim: the optimizer and its schedule
    steps: int = field(default=40, metadata=arg("optimizer steps", section="optim"))
    lr: float | None = field(
        default=None,
        metadata=arg(
            "peak learning rate", "3e-3 for the CPU-sized presets, 3e-4 otherwise", section="optim", converge=True
        ),
    )
    lr_warmup_steps: int | None = field(
        default=None,
        metadata=arg(
            "steps of linear learning-rate warm-up", "10%% of --steps, at least 1", metavar="N", section="optim"
        ),
    )
    min_lr_ratio: float = field(
        default=0.1, metadata=arg("cosine decay ends at this fraction of the peak learning rate", section="optim")
    )
    weight_decay: float = field(
        default=0.1, metadata=arg("AdamW's decoupled weight decay of the weight matrices", section="optim")
    )
    grad_clip: float = field(default=1.0, metadata=arg("clip the gradients' global norm to this", section="optim"))
    master_weights: str = field(
        default="fp32",
        metadata=arg(
            "dtype of the trained weights AdamW updates: fp32, or bf16 (the AdamW update computed in FP32 and "
            "rounded stochastically to BF16, from a seeded generator); comma-separated: one run each",
            metavar="|".join(MASTER_WEIGHTS),
            many=True,
            section="optim",
            resume=True,
            converge=True,
        ),
    )
    optimizer_states: str = field(
        default="fp32",
        metadata=arg(
            "how AdamW stores its two moments: fp32, bf16, fp8 (E4M3, one FP32 scale per 256 elements) or 8bit "
            "(blockwise dynamic quantization, 256 per block, as bitsandbytes and torchao's AdamW8bit); fp8 and 8bit "
            "apply to matrices whose last dimension is a multiple of 256 (the rest stay fp32); comma-separated: one "
            "run each",
            metavar="|".join(OPTIMIZER_STATES),
            many=True,
            section="optim",
            resume=True,
            converge=True,
        ),
    )
    offload_optimizer: bool = field(
        default=False,
        metadata=arg(
            "one GPU: keep the weights, gradients and AdamW states on the CPU and step there (FSDP2's "
            "CPUOffloadPolicy on a one-rank mesh, as torchtitan does); the GPU holds the BF16 weights of the "
            "blocks in use",
            section="optim",
            resume=True,
            layout=True,
        ),
    )

    # --- observe: what is measured and kept, not what is trained (most are out of the run key)
    warmup_steps: int | None = field(
        default=None,
        metadata=arg(
            "first steps excluded from timing",
            "min(10, steps / 2)",
            derive=lambda c: min(10, c.steps // 2),
            section="observe",
        ),
    )
    flops_formula: str = field(
        default="megatron",
        metadata=arg(
            "model FLOPs formula for TFLOP/s and MFU: megatron, nemo-legacy or mha",
            "megatron; with --gpu, the formula of the row's published table",
            aliases=("--formula",),
            section="observe",
            key=False,
        ),
    )  # converts the measured tokens/s: runs differing only in it are one run
    log_interval: int = field(
        default=1, metadata=arg("print a log line every N steps", section="observe", converge=True)
    )
    eval_every: int = field(
        default=0,
        metadata=arg(
            "validation loss every K steps and at the last step",
            "0: never",
            metavar="K",
            section="observe",
            converge=True,
        ),
    )
    eval_batches: int = field(
        default=0,
        metadata=arg(
            "micro-batches per evaluation",
            "0: the whole validation split",
            metavar="N",
            section="observe",
            converge=True,
        ),
    )
    save_every: int = field(
        default=0,
        metadata=arg(
            "write a checkpoint every K steps (not at the end unless K divides --steps) as --save-dir/step-K; "
            "needs --save-dir and one --precision",
            "0: never",
            metavar="K",
            section="observe",
            key=False,
            sweep=False,
        ),
    )
    save_dir: str | None = field(
        default=None,
        metadata=arg(
            "folder for --save-every's checkpoints (model, optimizer, LR schedule, data position, RNG; written "
            "atomically, an existing step-K is replaced)",
            "none",
            metavar="DIR",
            section="observe",
            key=False,
            sweep=False,
        ),
    )
    export_hf: str | None = field(
        default=None,
        metadata=arg(
            "at the end of the run write its model as a Hugging Face checkpoint in DIR (config.json, one safetensors "
            "file per block and their index; a LoRA run's adapters merged into the base), gathered one parameter at a "
            "time from any FSDP/TP layout; needs one --precision",
            "none",
            metavar="DIR",
            section="observe",
            key=False,
            sweep=False,
        ),
    )
    load: str | None = field(
        default=None,
        metadata=arg(
            "resume from a checkpoint: DIR/step-K, or DIR for its latest step-K; continues at step K+1 up to "
            "--steps, reproducing the uninterrupted run's losses; model, precision, shapes, parallel layout, "
            "data and seed must match the checkpoint's",
            "none",
            metavar="PATH",
            section="observe",
            key=False,
            sweep=False,
        ),
    )
    profile_steps: str | None = field(
        default=None,
        metadata=arg(
            "profile steps A..B (inclusive; pick them after warm-up) with torch.profiler: a Chrome trace in "
            "RESULTS/profiles/<run key>/ and a GEMM / quantize / attention / comm / other time table; profiled "
            "steps are left out of the timing",
            "none",
            metavar="A:B",
            section="observe",
            key=False,
        ),
    )
    profile_stacks: bool = field(
        default=True,
        metadata=arg(
            "record Python frames in --profile-steps (the table's quantize share reads them); off, the profiler "
            "adds little host time, so a host-bound step (idle GPU, e.g. expert parallel) keeps its shape; read "
            "such traces with benchmarks/trace_summary.py",
            section="observe",
            key=False,
        ),
    )
    tensorboard: str | None = field(
        default=None,
        metadata=arg(
            "also write each step's metrics as TensorBoard scalars to DIR/<model>-<precision>-<run key> (needs "
            "`pip install tensorboard`)",
            "none",
            metavar="DIR",
            section="observe",
            key=False,
        ),
    )
    wandb: str | None = field(
        default=None,
        metadata=arg(
            "also log each step's metrics to Weights & Biases, offline, into DIR (project lpbench, one run per "
            "precision; `wandb sync DIR/wandb/offline-run-*` uploads them later; needs `pip install wandb`)",
            "none",
            metavar="DIR",
            section="observe",
            key=False,
        ),
    )

    def __post_init__(self):
        """Fill the unset (None) settings whose default follows others (``derive``); ``derived`` names them."""
        derived = []
        for f in fields(self):
            rule = fact(f, "derive")
            if rule is not None and getattr(self, f.name) is None:
                object.__setattr__(self, f.name, rule(self))
                derived.append(f.name)
        object.__setattr__(self, "derived", tuple(derived))

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
            return with_overrides(
                first_blocks(get_model_config(self.model), self.num_layers), vocab_size=self.vocab_size
            )
        from lpbench.models.hf import hf_model_config

        return hf_model_config(self.model, self.hf_checkpoint)

    def pp_split_counts(self) -> list[int] | None:
        """``--pp-split``'s block counts per stage; None for ``balanced`` and ``even``."""
        if self.pp_split in ("balanced", "even"):
            return None
        return [int(n) for n in self.pp_split.split(",")]

    def _check_pp_split(self, n_layers: int) -> None:
        flag = f"--pp-split {self.pp_split}"
        if self.pp == 1:
            raise UsageError(f"{flag} needs pipeline parallelism (--pp > 1)")
        if self.pp_split == "even":
            return
        try:
            counts = self.pp_split_counts()
        except ValueError:
            raise UsageError(f"{flag}: give balanced, even or one block count per stage (4,4,5,3)") from None
        stages = self.pp * self.vp
        if len(counts) != stages or min(counts) < 1 or sum(counts) != n_layers:
            raise UsageError(
                f"{flag}: give {stages} block counts (--pp {self.pp} x --vp {self.vp} stages), each at least 1, "
                f"summing to {self.label}'s {n_layers} blocks"
            )

    @property
    def schedule(self) -> str:
        """The pipeline schedule: ``--pp-schedule``, or its default for ``--vp``."""
        return self.pp_schedule or default_schedule(self.vp)

    @property
    def label(self) -> str:
        """The model as tables and the results store name it: ``llama3-8b@16L`` when cut to 16 blocks."""
        return model_label(self.model, self.num_layers)

    def _validate_export(self) -> None:
        if self.pp > 1 or self.ep > 1:
            raise UsageError("--export-hf gathers FSDP and TP layouts only: run without --pp and --ep")
        from lpbench.models.hf import hf_config_dict

        hf_config_dict(self.model_config())  # an architecture HF Llama/Qwen3 can hold

    def _validate_workload(self) -> None:
        if self.workload not in WORKLOADS:
            raise UsageError(f"unknown workload {self.workload!r}; valid: {', '.join(WORKLOADS)}")
        if self.workload != "lora":
            changed = [
                f.name for f in fields(self) if f.name.startswith("lora_") and getattr(self, f.name) != f.default
            ]
            if changed:
                raise UsageError(
                    f"--{changed[0].replace('_', '-')} applies to --workload lora only (this run is {self.workload})"
                )
            return
        from lpbench.models.decoder import expand_targets

        if self.lora_rank <= 0:
            raise UsageError(f"--lora-rank must be positive, got {self.lora_rank}")
        width = self.model_config().dim
        if self.lora_rank > width:
            raise UsageError(
                f"--lora-rank {self.lora_rank} exceeds {self.model}'s width {width}: an adapter of "
                "that rank is no longer low-rank"
            )
        if not self.lora_alpha > 0:
            raise UsageError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        expand_targets(self.lora_targets)
        if self.lora_base_storage not in LORA_BASE_STORAGES:
            raise UsageError(
                f"unknown --lora-base-storage {self.lora_base_storage!r}; valid: {', '.join(LORA_BASE_STORAGES)}"
            )
        if self.fsdp_fp8_all_gather:
            raise UsageError(
                "--fsdp-fp8-all-gather casts trained weights; a LoRA base is frozen: "
                "use --lora-base-storage quantized (FSDP all-gathers its codes)"
            )
        if self.lora_base_storage == "quantized" and self.backend != "lpbench":
            raise UsageError("--lora-base-storage quantized needs --backend lpbench")
        if self.tp > 1 and self.backend != "lpbench":
            raise UsageError("--tp with --workload lora splits lpbench's linears only: use --backend lpbench")

    def _validate_cp(self, model) -> None:
        """Context parallelism's rules (:mod:`lpbench.parallel.cp`); one line each."""
        if self.cp == 1:
            return
        chunks, block = 2 * self.cp, get_recipe(self.precision).block
        if self.seq_len % chunks:
            raise UsageError(
                f"--cp {self.cp} cuts each sequence into {chunks} chunks: --seq-len {self.seq_len} must be divisible "
                f"by {chunks}"
            )
        if block and self.seq_len // chunks % block:
            raise UsageError(
                f"--cp {self.cp}: each chunk of {self.seq_len // chunks} tokens must hold whole {block}-token "
                f"blocks of {self.precision}: --seq-len must be a multiple of {chunks * block}"
            )
        if self.tp > 1 and self.sequence_parallel and self.seq_len // self.cp % self.tp:
            raise UsageError(
                f"sequence parallelism needs each CP rank's {self.seq_len // self.cp} tokens divisible by --tp "
                f"{self.tp} (or --no-sequence-parallel)"
            )
        if self.backend != "lpbench":
            raise UsageError(f"--cp needs --backend lpbench: {self.backend}'s linears reduce no amaxes over CP")

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
        for name in ("seq_len", "mbs", "gbs", "steps", "dp", "tp", "cp", "log_interval"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= self.steps:
            raise UsageError(
                f"--warmup-steps ({self.warmup_steps}) must be less than --steps ({self.steps}): no step would be timed"
            )
        if self.gbs % (self.mbs * self.dp):
            raise UsageError(
                f"global batch {self.gbs} is not divisible by micro batch {self.mbs} x data-parallel size {self.dp}"
            )
        for what, n in (
            ("attention heads", model.n_heads),
            ("kv heads", model.n_kv_heads),
            ("FFN width", model.ffn_dim),
        ):
            if n % self.tp:
                raise UsageError(f"--tp {self.tp} does not divide {self.model}'s {n} {what}")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            raise UsageError("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
        if (self.moe_aux_loss_coeff or self.moe_z_loss_coeff or self.ep > 1) and not model.n_experts:
            raise UsageError(f"--ep and --moe-*-loss-coeff apply to mixture-of-experts models; {self.model} is dense")
        if self.ep < 1 or model.n_experts % self.ep:  # the layout's rules: lpbench.parallel.dims.ParallelDims
            raise UsageError(f"--ep {self.ep} must divide {self.model}'s {model.n_experts} experts")
        if self.ep_chunks < 1 or (self.ep_chunks > 1 and self.ep == 1):
            raise UsageError(f"--ep-chunks {self.ep_chunks} needs --ep > 1 and is at least 1")
        if self.pp * self.vp > model.n_layers:  # the layout's other pipeline rules: ParallelDims
            raise UsageError(
                f"--pp {self.pp} x --vp {self.vp} = {self.pp * self.vp} pipeline stages need at least as many "
                f"blocks; {self.label} has {model.n_layers}"
            )
        if self.pp_split != "balanced":
            self._check_pp_split(model.n_layers)
        if self.pp > 1 and self.compile_scope == "model":
            raise UsageError("--compile-scope model compiles one graph; pipeline stages need --compile-scope block")
        if self.pp > 1 and self.pp_schedule == "zbv" and self.tp > 1 and model.tie_embeddings:
            raise UsageError(
                f"--pp-schedule zbv with --tp: {self.model} ties its embedding and LM head, which zbv puts on one "
                "rank in two stages that TP would split apart; use interleaved-1f1b or zero-bubble"
            )
        if self.ep > 1 and self.workload == "lora":
            raise UsageError("--ep > 1 does not train LoRA adapters: use --ep 1")
        if self.tp > 1 and self.sequence_parallel and self.seq_len % self.tp:
            raise UsageError(
                f"sequence parallelism needs --seq-len ({self.seq_len}) divisible by --tp {self.tp} "
                "(or --no-sequence-parallel)"
            )
        if self.seq_len > model.max_seq_len:
            raise UsageError(f"--seq-len {self.seq_len} exceeds {self.model}'s limit of {model.max_seq_len}")
        self._validate_cp(model)
        from lpbench.convert.quantize import BACKENDS

        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.backend == "torchao":
            from lpbench.convert.torchao import run_problem

            if problem := run_problem(self.precision, self.mbs * self.seq_len, self.tp):
                raise UsageError(problem)
        if self.flops_formula not in FORMULAS:
            raise UsageError(f"unknown FLOP formula {self.flops_formula!r}; valid: {', '.join(FORMULAS)}")
        if self.fsdp_fp8_all_gather and not self.fsdp:
            raise UsageError("--fsdp-fp8-all-gather needs --fsdp")
        if self.fsdp_fp8_all_gather and (
            get_recipe(self.precision).scaling not in (Scaling.TENSOR, Scaling.DELAYED) or self.backend != "lpbench"
        ):
            raise UsageError(
                f"--fsdp-fp8-all-gather needs precision fp8-tensorwise or fp8-delayed on the lpbench "
                f"backend, not {self.precision} ({self.backend})"
            )
        if self.fsdp_shard not in FSDP_SHARDS:
            raise UsageError(f"unknown --fsdp-shard {self.fsdp_shard!r}; valid: {', '.join(FSDP_SHARDS)}")
        if self.fsdp_shard != "zero3" and not fsdp_requested(self.fsdp, self.cp):
            raise UsageError(f"--fsdp-shard {self.fsdp_shard} needs FSDP2 (--fsdp, or --cp > 1)")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise UsageError(
                f"unknown --grad-reduce-dtype {self.grad_reduce_dtype!r}; valid: {', '.join(GRAD_REDUCE_DTYPES)}"
            )
        if self.compile_scope not in COMPILE_SCOPES:
            raise UsageError(f"unknown --compile-scope {self.compile_scope!r}; valid: {', '.join(COMPILE_SCOPES)}")
        if self.compile_scope == "model" and (fsdp_requested(self.fsdp, self.cp) or self.tp > 1):
            raise UsageError("--compile-scope model needs one process or DDP; FSDP, TP and CP compile each block")
        self._validate_workload()
        if self.recompute not in RECOMPUTES:
            raise UsageError(f"unknown --recompute {self.recompute!r}; valid: {', '.join(RECOMPUTES)}")
        if self.recompute_every < 1:
            raise UsageError(f"--recompute-every must be >= 1, got {self.recompute_every}")
        if self.recompute_every != 1 and self.recompute == "none":
            raise UsageError(f"--recompute-every {self.recompute_every} needs --recompute selective or full")
        self._validate_optimizer()
        if self.lr is not None and self.lr <= 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if self.eval_every < 0 or self.eval_batches < 0:
            raise UsageError(
                f"--eval-every and --eval-batches must be >= 0, got {self.eval_every} and {self.eval_batches}"
            )
        if self.vocab_size is not None and (self.vocab_size < 2 or self.hf_checkpoint):
            raise UsageError("vocab_size overrides a zoo model's vocabulary: >= 2, and not with --hf-checkpoint")
        if self.save_every < 0:
            raise UsageError(f"--save-every must be >= 0, got {self.save_every}")
        if self.export_hf is not None:
            self._validate_export()
        if bool(self.save_every) != bool(self.save_dir):
            raise UsageError(
                "--save-every K needs --save-dir DIR"
                if self.save_every
                else "--save-dir needs --save-every K (steps between checkpoints)"
            )
        first, last = self.profile_range or (1, 1)
        if not 1 <= first <= last <= self.steps:
            raise UsageError(f"--profile-steps {self.profile_steps}: need 1 <= A <= B <= --steps ({self.steps})")
        return self

    def _validate_optimizer(self) -> None:
        for name, valid in (("master_weights", MASTER_WEIGHTS), ("optimizer_states", OPTIMIZER_STATES)):
            if getattr(self, name) not in valid:
                raise UsageError(
                    f"unknown --{name.replace('_', '-')} {getattr(self, name)!r}; valid: {', '.join(valid)}"
                )
        if self.master_weights == "bf16" and get_recipe(self.precision).compute_dtype != torch.bfloat16:
            raise UsageError(f"--master-weights bf16 needs a recipe that computes in BF16, not {self.precision}")
        if self.offload_optimizer and self.world_size > 1:
            raise UsageError(
                f"--offload-optimizer runs on one GPU; this run has {self.world_size} ranks (shard the states over "
                "them with --fsdp instead)"
            )
        if self.offload_optimizer and self.device == "cpu":
            raise UsageError(OFFLOAD_NEEDS_GPU)
        if self.offload_optimizer and self.compile_scope == "model":
            raise UsageError("--offload-optimizer compiles each block; --compile-scope model does not apply")

    def with_world(self, world_size: int, dp: int | None = None) -> "RunConfig":
        """This config on ``world_size`` ranks: DP = world / (TP x PP x CP) (``dp``, if given, must agree)."""
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name} must be positive, got {getattr(self, name)}")
        other = self.tp * self.pp * self.cp
        what = " x ".join(f"--{n} {getattr(self, n)}" for n in ("tp", "pp", "cp") if n == "tp" or getattr(self, n) > 1)
        if world_size % other:
            raise UsageError(
                f"world size {world_size} is not divisible by {what} "
                "(start processes with --nproc-per-node, torchrun or srun)"
            )
        if dp is not None and dp * other != world_size:
            raise UsageError(f"--dp {dp} x {what} = {dp * other} ranks, but the world size is {world_size}")
        return self.with_(dp=world_size // other)

    def with_(self, **kw) -> "RunConfig":
        """This config with ``kw`` changed; the settings that were derived follow the change."""
        return replace(self, **{**{name: None for name in self.derived}, **kw})

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self) -> str:
        """The run key: identifies a run across resumed sweeps and in the results database (:func:`run_key`)."""
        return run_key(self.to_dict())

    @classmethod
    def default_text(cls, name: str) -> str:
        """A setting's default as its help states it: ``"MBS x DP"``, ``"256"``."""
        f = next(f for f in fields(cls) if f.name == name)
        return f.metadata.get("default_text") or _shown(f.default)

    def header(self) -> str:
        """What the run's log header adds to the settings: each default that followed other settings, the FLOP
        formula of its TFLOP/s and MFU, and the optimizer's precision: ``gbs 16 (default: MBS x DP) | TFLOP/s by
        the megatron formula | AdamW: fp32 master weights, fp32 states``."""
        parts = [
            f"{name.replace('_', ' ')} {getattr(self, name)} (default: {self.default_text(name)})"
            for name in self.derived
        ]
        return " | ".join([*parts, f"TFLOP/s by the {self.flops_formula} formula", self.optimizer_text()])

    def optimizer_text(self) -> str:
        """The optimizer as the run header states it: ``AdamW: fp32 master weights, 8bit states, offloaded to
        CPU``."""
        offload = ", offloaded to CPU" if self.offload_optimizer else ""
        return f"AdamW: {self.master_weights} master weights, {self.optimizer_states} states{offload}"


def spread(base: RunConfig, lists: dict[str, list]) -> list[RunConfig]:
    """One config per combination of the ``many`` settings' values in ``lists`` (name -> values; a setting not
    there keeps ``base``'s), the first setting's values outermost: ``--precision a,b --optimizer-states x,y`` is
    a/x, a/y, b/x, b/y."""
    names = [f.name for f in fields(RunConfig) if fact(f, "many") and lists.get(f.name)]
    combos = itertools.product(*(lists[n] for n in names))
    return [base.with_(**dict(zip(names, values))) for values in combos] or [base]


def run_labels(configs: list[RunConfig]) -> list[str]:
    """Each config's precision, with the other ``many`` settings that differ between ``configs``:
    ``fp8-tensorwise, optimizer-states bf16``."""
    varying = [
        f.name
        for f in fields(RunConfig)
        if fact(f, "many") and f.name != "precision" and len({getattr(c, f.name) for c in configs}) > 1
    ]
    return [", ".join([c.precision, *(f"{n.replace('_', '-')} {getattr(c, n)}" for n in varying)]) for c in configs]


def completed(settings: dict) -> dict:
    """``settings`` as stored by a run (``RunConfig.to_dict()``, or by an older lpbench), with what an older run
    did where a setting added since would state it otherwise by its default: a pipeline run from before
    ``--pp-split`` split its blocks evenly."""
    pp = settings.get("pp")
    if isinstance(pp, int) and pp > 1 and "pp_split" not in settings:
        return {**settings, "pp_split": "even"}
    return settings


def run_key(settings: dict) -> str:
    """The run key of a config (``RunConfig.to_dict()``, or one stored by an older lpbench, :func:`completed`): a
    hash of the settings that are in the key (``arg(key=True)``) and differ from their defaults, so a setting
    added later leaves every existing run's key as it was."""
    settings = completed(settings)
    kept = {}
    for f in fields(RunConfig):
        if f.name in settings and fact(f, "key") and settings[f.name] != f.default:
            kept[f.name] = settings[f.name]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def fact(f, name: str):
    """A field's fact ``name`` (see :func:`arg`): its declaration's, else the default in :data:`FACTS`."""
    return f.metadata.get(name, FACTS[name])


def settings(name: str) -> tuple[str, ...]:
    """The RunConfig fields whose fact ``name`` is true: ``settings("resume")``, ``settings("layout")`` ..."""
    return tuple(f.name for f in fields(RunConfig) if fact(f, name))


def field_type(f) -> type:
    """The type of a RunConfig field: its annotation without ``| None``."""
    return {"int": int, "float": float, "bool": bool, "str": str}[str(f.type).split("|")[0].strip()]


def flag_fields(names=None) -> list:
    """The RunConfig fields that are flags (``arg`` metadata), or those of them in ``names``."""
    return [f for f in fields(RunConfig) if "help" in f.metadata and (names is None or f.name in names)]


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return (
        ("on" if value else "off")
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def add_config_args(
    parser: argparse.ArgumentParser, names=None, defaults: dict | None = None, default_texts: dict | None = None
) -> None:
    """One flag per RunConfig field with ``arg`` metadata (or per field in ``names``), typed by its annotation,
    in one ``--help`` group per section when the flags span several.

    Without ``defaults`` every flag defaults to None, so an explicit flag can be told from a default
    (:func:`config_kwargs`); with it, a flag defaults to ``defaults.get(name, field default)``. The help
    ends with the default: ``default_texts[name]``, else the field's ``default_text`` (unless ``defaults``
    changes it), else the value. A ``many`` field's flag takes a comma-separated list.
    """
    from lpbench.console import csv_list

    chosen = flag_fields(names)
    sections = [s for s in SECTIONS if any(fact(f, "section") == s for f in chosen)]
    groups = {s: parser.add_argument_group(f"{s} settings") if len(sections) > 1 else parser for s in sections}
    for f in chosen:
        meta = {k: v for k, v in f.metadata.items() if k not in FACTS}
        help_text, text, aliases = meta.pop("help"), meta.pop("default_text"), meta.pop("aliases", ())
        value = (defaults or {}).get(f.name, f.default)
        if f.name in (default_texts or {}) or f.name in (defaults or {}):  # the command's default, not the field's
            text = (default_texts or {}).get(f.name)
        meta["help"] = f"{help_text} (default {_shown(value)})" if text is None else f"{help_text} (default: {text})"
        meta["default"] = value if defaults is not None else None
        group, flag = groups[fact(f, "section")], "--" + f.name.replace("_", "-")
        words, off = meta.pop("words", ()), meta.pop("off", None)
        if words:  # --flag [WORD] and --no-flag
            group.add_argument(flag, *aliases, nargs="?", const=True, choices=words, metavar="|".join(words), **meta)
            group.add_argument(
                "--no-" + f.name.replace("_", "-"),
                dest=f.name,
                action="store_const",
                const=False,
                default=meta["default"],
                help=off,
            )
            continue
        if fact(f, "many"):
            meta["type"] = csv_list
        elif field_type(f) is bool:
            meta["action"] = argparse.BooleanOptionalAction
        else:
            meta["type"] = field_type(f)
        group.add_argument(flag, *aliases, **meta)


def config_kwargs(args: argparse.Namespace, names=None) -> dict:
    """The RunConfig fields ``args`` sets (flags given, or with a default other than None); ``many`` fields
    (a list of values, one run each) are the caller's to spread."""
    return {
        f.name: getattr(args, f.name)
        for f in flag_fields(names)
        if getattr(args, f.name, None) is not None and not fact(f, "many")
    }

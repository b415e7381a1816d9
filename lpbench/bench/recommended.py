"""Recommended run configs: lpbench's counterpart of NeMo's ``recommended_model_configs``.

``lpbench/configs/recommended_model_configs.csv`` has one row per (task, model, system, GPU
count) and config, with NeMo's columns ``task,model,size,system,dtype,num_gpus,seq_len,tp,pp,
cp,ep,vp,mbs,gbs`` plus ``fsdp`` and ``source`` (where the row comes from; README's
"Recommended configs" explains each source). ``dtype`` lists the precision classes the row
serves (``bf16/fp8`` where the published BF16 and FP8 configs are the same), ``source`` its
sources joined by ``+``. ``lookup`` finds the row for a model on a GPU type and count;
``run_defaults`` turns it into RunConfig keyword arguments: the row's whole layout (TP, PP, VP, CP,
EP; DP follows from the launch's world size), never another layout than the one it names. A row with data
parallelism (DP > 1) and ``fsdp`` 0 runs as NeMo and Megatron-Bridge run it, with Megatron's distributed optimizer
(FP32 main weights and optimizer states sharded over the DP ranks, gradients reduce-scattered, the parameters
gathered once per optimizer step and kept whole in between): lpbench's equivalent is FSDP2 with ``--fsdp-shard
zero1`` (:data:`DISTRIBUTED_OPTIMIZER`; LoRA rows keep DDP, CP rows FSDP2 zero3 over DP x CP as lpbench's CP
runs); a row with ``fsdp`` 1 runs FSDP2 zero3. On fewer
GPUs than the row's, ``--num-layers`` may cut the model so the layout fits (the run's label then says
``@NL``); a layout the launch cannot hold is refused in one line.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from lpbench.errors import UsageError
from lpbench.sharding import fsdp_requested

CSV_NAME = "recommended_model_configs.csv"
INT_FIELDS = ("num_gpus", "seq_len", "tp", "pp", "cp", "ep", "vp", "mbs", "gbs", "fsdp")
# Row fields that are RunConfig settings, in RunConfig's order (a sweep's settings list them so)
RUN_FIELDS = ("tp", "ep", "pp", "vp", "cp", "fsdp", "seq_len", "mbs", "gbs")
# What a printed layout marks when a flag set it instead of the row
FLAG_FIELDS = ("seq_len", "mbs", "gbs", "tp", "pp", "vp", "cp", "ep", "fsdp", "fsdp_shard", "flops_formula")
# Megatron's distributed optimizer (``use_distributed_optimizer``), which NeMo's recipes run, as lpbench runs it
DISTRIBUTED_OPTIMIZER = {"fsdp": True, "fsdp_shard": "zero1"}


@dataclass(frozen=True)
class Source:
    """Where rows come from, and the FLOP formula (``--flops-formula``) of the TFLOP/s it published (None: it
    published none)."""

    description: str
    formula: str | None = None


SOURCES = {
    "nemo-25.04": Source("NeMo 25.04 performance summary (FP8 current scaling)", "nemo-legacy"),
    "nemo-25.04-fixed": Source(
        "NeMo 25.04 performance summary; the published row has its GBS/MBS cells shifted, "
        "GBS recomputed as GA x DP x MBS",
        "nemo-legacy",
    ),
    "nemo-25.07-nvfp4-bench": Source(
        "NeMo 25.07 recommended config, as used for every precision by the 8xB200 NVFP4 benchmark", "nemo-legacy"
    ),
    "mb-25.09": Source("Megatron-Bridge 25.09 performance summary (FP8)", "megatron"),
    "nemotron4-recipe": Source("Nemotron4 benchmark recipe (BF16/FP8, 16-2048 H100)", "mha"),
    "lpbench-h100-reused": Source("lpbench's choice: the H100 config reused on H200 (no published H200 config)"),
    "lpbench": Source("lpbench's choice, not from a published table (unmeasured)"),
}


@dataclass(frozen=True)
class Recommended:
    task: str
    model: str  # family as NeMo spells it ("llama3"); ``name`` is the lpbench zoo name
    size: str
    system: str
    dtype: str
    num_gpus: int
    seq_len: int
    tp: int
    pp: int
    cp: int
    ep: int
    vp: int
    mbs: int
    gbs: int
    fsdp: int
    source: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.size}" if self.size else self.model

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(self.dtype.split("/"))

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(self.source.split("+"))

    @property
    def formula(self) -> str:
        """The FLOP formula of the table the row comes from (its first source's), else lpbench's default."""
        return SOURCES[self.sources[0]].formula or "megatron"

    @property
    def dp(self) -> int:
        """Data-parallel size as NeMo derives it: GPUs / (TP x PP x CP)."""
        return max(1, self.num_gpus // (self.tp * self.pp * self.cp))

    @property
    def distributed_optimizer(self) -> bool:
        """Whether the row runs Megatron's distributed optimizer: data parallelism without FSDP or CP, and a task
        that trains every weight. LoRA keeps DDP: Megatron's optimizer shards only the adapters' states there and
        leaves the frozen base whole, while zero1 would shard the base and gather it every step, for no memory saved.
        A CP row keeps what lpbench's CP runs, FSDP2 zero3 over DP x CP: zero1 would hold every block's BF16 weights
        and FP32 gradients whole beside CP's activations, more than the 80 GB card of NeMo's llama3-8b H100 row
        holds in lpbench."""
        return not self.fsdp and self.cp == 1 and self.dp > 1 and self.task != "lora"

    @property
    def fsdp_shard(self) -> str:
        return DISTRIBUTED_OPTIMIZER["fsdp_shard"] if self.distributed_optimizer else "zero3"

    @property
    def grad_accum(self) -> int:
        return max(1, self.gbs // (self.mbs * self.dp))

    def title(self) -> str:
        return f"{self.name} {self.task} on {self.num_gpus}x {self.system} ({self.dtype} row, {self.source})"

    def describe(self, world: int | None = None, num_layers: int | None = None, **ran) -> str:
        """The layout that runs on ``world`` processes (default: the row's GPU count), on the model cut to
        ``num_layers`` blocks if given.

        ``ran``: :data:`FLAG_FIELDS` values set by flags instead of the row, marked so.
        """
        world = world or self.num_gpus
        v = {k: getattr(self, k) for k in FLAG_FIELDS if k not in ("fsdp", "flops_formula")}
        v.update(fsdp=bool(self.fsdp) or self.distributed_optimizer, flops_formula=self.formula)
        changed = {k for k, x in ran.items() if x is not None and x != v.get(k)}
        v.update({k: ran[k] for k in changed})
        if v["fsdp"] is False and "fsdp_shard" not in changed:  # DDP asked for: the row's shard does not apply
            v["fsdp_shard"] = "zero3"
        dp = max(1, world // (v["tp"] * v["pp"] * v["cp"]))
        mark = lambda k: " (flag)" if k in changed else ""  # noqa: E731
        dims = lambda *ks: "".join(f", {k.upper()} {v[k]}{mark(k)}" for k in ks if v[k] > 1)  # noqa: E731
        model = f"; the model cut to its first {num_layers} blocks (--num-layers)" if num_layers is not None else ""
        text = (
            f"{self.title()}{model}; runs as seq_len {v['seq_len']}{mark('seq_len')}, MBS {v['mbs']}{mark('mbs')}, "
            f"GBS {v['gbs']}{mark('gbs')}, TP {v['tp']}{mark('tp')}{dims('pp', 'vp', 'cp')}, "
            f"DP {dp}{data_parallel(v, dp, changed)}{dims('ep')}, GA {max(1, v['gbs'] // (v['mbs'] * dp))} "
            f"on {world} process(es)"
        )
        if world != self.num_gpus:
            text += (
                f" (the row: {self.num_gpus} GPUs, DP {self.dp}, GA {self.grad_accum}; start "
                f"{self.num_gpus} with --nproc-per-node, torchrun or srun to run it as listed)"
            )
        published = SOURCES[self.sources[0]].formula and f", as {self.sources[0]}'s table counts"
        return text + f"; TFLOP/s by the {v['flops_formula']} formula{mark('flops_formula') or published or ''}"


def data_parallel(v: dict, dp: int, changed: set) -> str:
    """How the ``dp`` data-parallel ranks of a described layout ``v`` hold the model: DDP (said only where a flag
    chose it), FSDP2 (also what CP runs without ``--fsdp``), or the distributed optimizer (FSDP2 zero1); "(flag)"
    where a flag chose it."""
    if dp == 1:
        return ""
    flag = " (flag)" if changed & {"fsdp", "fsdp_shard"} else ""
    if not fsdp_requested(v["fsdp"], v["cp"]):
        return f" (DDP){flag}" if flag else ""
    if v["fsdp_shard"] == DISTRIBUTED_OPTIMIZER["fsdp_shard"]:
        return f" (distributed optimizer: FSDP2 {v['fsdp_shard']}){flag}"
    return f" (FSDP{'' if v['fsdp_shard'] == 'zero3' else ' ' + v['fsdp_shard']}){flag}"


@lru_cache(maxsize=1)
def load() -> tuple[Recommended, ...]:
    text = resources.files("lpbench").joinpath("configs", CSV_NAME).read_text()
    rows = []
    for line_no, raw in enumerate(csv.DictReader(text.splitlines()), start=2):
        try:
            row = {k: (int(v) if k in INT_FIELDS else v.strip()) for k, v in raw.items()}
            rows.append(Recommended(**row))
        except (TypeError, ValueError) as exc:  # a broken shipped file is a bug, say where
            raise RuntimeError(f"{CSV_NAME} line {line_no}: {exc}") from None
    return tuple(rows)


def dtype_class(precision: str | None) -> str:
    """The table's dtype column for a precision recipe: bf16, fp8 or fp4."""
    if precision is None or precision in ("bf16", "fp32"):
        return "bf16"
    return "fp4" if precision.endswith("fp4") else "fp8"


def lookup(
    model: str, gpu: str, num_gpus: int | None = None, task: str = "pretrain", precision: str | None = None
) -> Recommended:
    """The recommended row for ``model`` on ``num_gpus`` GPUs of type ``gpu``.

    The dtype column is matched to ``precision`` (bf16 / fp8 / fp4 class), falling back to the
    fp8 row and then the bf16 row of the same config: precisions compared in one run share
    one config. ``num_gpus=None`` takes the smallest GPU count the table has.
    """
    system = gpu.strip().lower()
    rows = [r for r in load() if r.task == task]
    systems = sorted({r.system for r in rows})
    if system not in systems:
        raise UsageError(f"no recommended configs for GPU {gpu!r}; known: {', '.join(systems)}")
    on_system = [r for r in rows if r.system == system]
    mine = [r for r in on_system if r.name == model]
    if not mine:
        names = sorted({r.name for r in on_system})
        raise UsageError(f"no recommended {task} config for {model} on {system}; models with one: {', '.join(names)}")
    counts = sorted({r.num_gpus for r in mine})
    if num_gpus is None:
        num_gpus = counts[0]
    matches = [r for r in mine if r.num_gpus == num_gpus]
    if not matches:
        raise UsageError(
            f"no recommended {task} config for {model} on {num_gpus}x {system}; "
            f"GPU counts with one: {', '.join(map(str, counts))}"
        )
    wanted = dtype_class(precision)
    for dtype in dict.fromkeys((wanted, "fp8", "bf16")):
        for r in matches:
            if dtype in r.dtypes:
                return r
    return matches[0]


def run_defaults(rec: Recommended, given: dict | None = None) -> dict:
    """RunConfig keyword arguments from a recommended row for the settings not in ``given`` (those a user set), with
    the FLOP formula its table was published with; with virtual stages NeMo's interleaved 1F1B schedule
    (``pp_schedule``); with data parallelism and no FSDP the distributed optimizer (:data:`DISTRIBUTED_OPTIMIZER`),
    whose ``fsdp_shard`` does not apply where ``given`` turns FSDP off (DDP asked for)."""
    given = given or {}
    out = {k: bool(rec.fsdp) if k == "fsdp" else getattr(rec, k) for k in RUN_FIELDS}  # fsdp: 0/1 -> flag
    if rec.distributed_optimizer:
        out.update(DISTRIBUTED_OPTIMIZER)
        if given.get("fsdp") is False:
            del out["fsdp_shard"]
    if rec.vp > 1:
        out["pp_schedule"] = "interleaved-1f1b"
    out["flops_formula"] = rec.formula
    return {k: v for k, v in out.items() if k not in given}


def recommended_defaults(
    gpu: str | None,
    num_gpus: int | None,
    *,
    model: str,
    workload: str,
    precision: str | None,
    explicit: dict,
    world: int,
) -> dict:
    """``lpbench run --gpu G [--num-gpus N]``: the recommended row's RunConfig keyword arguments for the
    fields not in ``explicit`` ({} without ``--gpu``), for a launch of ``world`` processes.

    Prints the row used on stderr.
    """
    if num_gpus is not None and num_gpus <= 0:
        raise UsageError(f"--num-gpus must be positive, got {num_gpus}")
    if gpu is None and num_gpus is not None:
        raise UsageError("--num-gpus selects a recommended config and needs --gpu (e.g. --gpu h100 --num-gpus 8)")
    if gpu is None:
        return {}
    rec = lookup(model, gpu, num_gpus, task=workload, precision=precision)
    filled = run_defaults(rec, explicit)
    layout = {k: explicit.get(k, getattr(rec, k)) for k in ("tp", "pp", "cp")}
    ranks = layout["tp"] * layout["pp"] * layout["cp"]
    if any(k in filled for k in layout) and world % ranks:
        used = " x ".join(f"{k.upper()} {n}" for k, n in layout.items() if n > 1 or k == "tp")
        raise UsageError(
            f"the recommended config for {rec.name} on {rec.num_gpus}x {rec.system} uses {used} = {ranks} ranks, "
            f"but this launch has {world} process(es): start {rec.num_gpus} "
            f"(--nproc-per-node {rec.num_gpus}, torchrun or srun) or pass --tp/--pp/--cp"
        )
    ran = {k: explicit[k] for k in FLAG_FIELDS if k in explicit}
    text = rec.describe(world, explicit.get("num_layers"), **ran)
    print(f"lpbench: recommended config: {text}", file=sys.stderr)
    return filled

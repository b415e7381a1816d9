"""Pipeline parallelism (``--pp``, ``--vp``, ``--pp-schedule``) on ``torch.distributed.pipelining``.

The decoder's blocks are cut into ``pp × vp`` stages of consecutive blocks, in order: the embedding goes with
the first stage, the final norm, LM head and loss with the last. ``--pp-split balanced`` (the default,
:func:`balanced_sizes`) counts work in blocks: the LM head as its FLOPs per token over one block's
(:func:`head_units`, the megatron count of :mod:`lpbench.metrics.flops` at ``--seq-len``: 2.1 blocks for
llama3-8b at 8,192 tokens), the embedding (a lookup) and the loss as nothing. Every stage gets one block; the
others are dealt one at a time to the stage on the least-loaded pipeline rank (a rank's load: its stages'
blocks, plus the head on the last stage's rank), within that rank to its least-loaded stage, ties to the later
stage (whose rank keeps fewer micro-batches in flight). The busiest rank, which sets the pipeline's pace, so
carries as little as whole blocks allow, and each rank's stages are as even as its blocks allow. ``even``: the
first ``n mod (pp × vp)`` stages take one block more; a list (``4,4,5,3``): each stage's count.

Stage ``s`` runs on pipeline rank ``s mod pp`` (``1f1b``, ``interleaved-1f1b``, ``zero-bubble``: rank r
holds stages r, r + pp, ...), or in a V (``zbv``: rank r holds stages r and 2·pp − 1 − r). Each stage
is a :class:`lpbench.models.decoder.Decoder` that shares the whole model's modules but keeps only its
own (:func:`stage_module`), so parameter names are the whole model's: a stage's blocks keep their
global index (``layers.7``), the converters that ran on the whole model (NVFP4's BF16 first and last
blocks, by global index) stay as they are, and a checkpoint's keys name the same tensors on every
layout. A rank's stages together are its :func:`rank_view`, the module its optimizer, checkpoint,
gradient clipping and converters see.

The schedule is torch's (``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``) with the step's GBS / (MBS × DP) micro-batches. The last stage returns the
micro-batch's loss (the model's own head, chunked or not); the schedule's loss function divides it by
the micro-batch count and the gradients are not rescaled afterwards, the arithmetic of the unpipelined
``(loss / GA).backward()``.

Tied embeddings: where the first and last stages sit on different ranks, the last stage holds its own
copy of the embedding matrix as its LM head, initialised from the same draw; after the backward pass the
two gradients are summed over the pair of ranks (:meth:`Pipeline.sync_tied`), so both copies take the same
update, as Megatron's embedding group does. Only the first stage's copy enters the gradient norm. Where one
rank holds both (``zbv``'s V) the stages share the weight, unless FSDP2 shards them (each stage on its own,
which would shard the one weight twice): then the last stage has its copy too, and the two gradients are summed
on the rank. (zbv beside DDP, or beside TP with a tied embedding, is refused.)

Under context parallelism each stage splits its sequences over its CP group (:mod:`lpbench.parallel.cp`, applied
to each stage as to a whole model): the schedule is given each micro-batch's local chunks, and the hidden states a
stage sends are its CP rank's, received by the same CP rank of the next stage (``pp`` is the mesh's outermost dim).

Stochastic rounding draws by (step, micro-batch, module, operand), not by process: each stage's forward and
backward of one micro-batch runs under the draw key one process gives that micro-batch
(:mod:`lpbench.precision.noise`). Validation (:meth:`Pipeline.evaluate`) runs every stage's forward in stage order
with point-to-point sends, without the schedule.

Receive buffers: torch's ``PipelineStage`` allocates, at the first step, one activation buffer and one gradient
buffer for every micro-batch of every stage and keeps them all for the run — for seed 000's LoRA llama3-70b as
PP 4 × VP 20 at 32 micro-batches, 20 × 32 × 2 buffers of 64 MiB, 80 GB a GPU. :class:`Stage` allocates each buffer
when its receive is posted and lets it go once consumed (the activation then lives in the stage's autograd graph
until its micro-batch's backward, as it must), so a rank holds the buffers of its micro-batches in flight only.

What is ours and why: the stage cut (torch's ``pipeline()`` tracer splits an ``nn.Module`` by an FX graph,
which the quantized linears' autograd functions and MoE routing do not trace through) and its split by work
(torch's ``pipeline()`` places split points where it is told), the tie,
the micro-batch bookkeeping, the forward-only validation pass and the receive buffers' lifetime (:class:`Stage`);
the schedules and the training step's point-to-point transfers are torch's.
"""

from __future__ import annotations

import copy
import inspect
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from lpbench.config import PP_SCHEDULES, RunConfig, default_schedule
from lpbench.errors import UsageError
from lpbench.metrics.flops import flops_per_token
from lpbench.models.registry import ModelConfig
from lpbench.precision import noise

SCHEDULES = dict(  # --pp-schedule: torch's class
    zip(
        PP_SCHEDULES,
        ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"),
    )
)


SPLIT_BACKWARD = ("zero-bubble", "zbv")  # schedules whose weight gradients come in a later pass of their own


def check_pipeline(pp: int, vp: int, schedule: str | None, micro_batches: int, dp: int = 1) -> None:
    """The pipeline's layout rules (one line each, UsageError): virtual stages, schedule, micro-batch count and data
    parallelism beside a split backward (the model's, enough blocks for the stages, is
    :meth:`lpbench.config.RunConfig.validate`'s)."""
    if vp < 1:
        raise UsageError(f"--vp must be positive, got {vp}")
    if pp == 1:
        if vp > 1 or schedule is not None:
            raise UsageError("--vp and --pp-schedule need pipeline parallelism (--pp > 1)")
        return
    schedule = schedule or default_schedule(vp)
    if schedule not in SCHEDULES:
        raise UsageError(f"--pp-schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if schedule == "1f1b" and vp > 1:
        raise UsageError(f"--pp-schedule 1f1b runs one stage per rank: use interleaved-1f1b for --vp {vp}")
    if schedule == "zbv" and vp != 2:
        raise UsageError(f"--pp-schedule zbv runs two stages per rank in a V: it needs --vp 2, got {vp}")
    if schedule in SPLIT_BACKWARD and dp > 1:
        raise UsageError(
            f"--pp-schedule {schedule} does not run beside data parallelism (dp {dp}): torch's separate weight-gradient "
            "pass escapes DDP's and FSDP's gradient reduction over the data-parallel ranks; use 1f1b or interleaved-1f1b"
        )
    if micro_batches < pp:
        raise UsageError(
            f"--pp {pp} needs at least {pp} micro-batches per step; GBS / (MBS x DP) = {micro_batches}: raise --gbs"
        )
    if schedule != "1f1b" and micro_batches % pp:
        raise UsageError(
            f"--pp-schedule {schedule} needs the micro-batches per step (GBS / (MBS x DP) = {micro_batches}) "
            f"to be a multiple of --pp {pp}"
        )


def stage_fsdp_shard(fsdp_shard: str, schedule: str) -> str:
    """FSDP2's sharding of a pipeline stage's blocks: ``zero3`` becomes ``zero2`` (no resharding after the forward)
    under a split backward, whose input pass finds the weights' gradient nodes among the parameters the stage holds
    then; resharded ones are not those the forward used, and their gradients would be lost."""
    return "zero2" if fsdp_shard == "zero3" and schedule in SPLIT_BACKWARD else fsdp_shard


def head_units(m: ModelConfig, seq_len: int) -> float:
    """The LM head's training FLOPs per token in blocks: ``6 · dim · vocab`` over one block's share of the rest of
    :func:`lpbench.metrics.flops.flops_per_token` (the megatron count at ``seq_len``: the block's GEMMs, a MoE
    block's active experts, causal attention)."""
    head = 6.0 * m.dim * m.vocab_size
    return head / ((flops_per_token(m, seq_len) - head) / m.n_layers)


def balanced_sizes(n_layers: int, owners: list[int], head: float) -> list[int]:
    """The block count of each stage (``owners[s]``: the pipeline rank running stage ``s``; the last stage also
    runs the head, worth ``head`` blocks): every stage starts with one block, and the rest are dealt one at a time
    to the stage on the least-loaded rank (a rank's load: its stages' blocks, plus ``head`` on the last stage's
    rank), within that rank to its least-loaded stage, ties to the later stage."""
    n_stages = len(owners)
    sizes = [1] * n_stages
    stage_load = [1.0] * (n_stages - 1) + [1.0 + head]
    rank_load: dict[int, float] = {}
    for s, r in enumerate(owners):
        rank_load[r] = rank_load.get(r, 0.0) + stage_load[s]
    for _ in range(n_layers - n_stages):
        s = min(range(n_stages), key=lambda s: (rank_load[owners[s]], stage_load[s], -s))
        sizes[s] += 1
        stage_load[s] += 1
        rank_load[owners[s]] += 1
    return sizes


def even_sizes(n_layers: int, n_stages: int) -> list[int]:
    """``n_layers`` blocks split evenly over ``n_stages`` stages, the first ``n_layers mod n_stages`` taking one
    more."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (s < extra) for s in range(n_stages)]


def stage_sizes(cfg: RunConfig, m: ModelConfig) -> list[int]:
    """The block count of each of ``cfg``'s ``pp × vp`` stages of model ``m`` by ``--pp-split`` (module doc)."""
    n_stages = cfg.pp * cfg.vp
    if cfg.pp_split == "even":
        return even_sizes(m.n_layers, n_stages)
    if cfg.pp_split != "balanced":
        return cfg.pp_split_counts()
    return balanced_sizes(m.n_layers, stage_owners(cfg.pp, cfg.vp, cfg.schedule), head_units(m, cfg.seq_len))


def stage_blocks(sizes: list[int]) -> list[range]:
    """The global block indices of each stage, from the stages' block counts (consecutive, in stage order)."""
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def rank_blocks(cfg: RunConfig, m: ModelConfig) -> list[int]:
    """The blocks each pipeline rank holds (its stages' together), by rank."""
    sizes = stage_sizes(cfg, m)
    return [sum(sizes[s] for s in rank_stages(r, cfg.pp, cfg.vp, cfg.schedule)) for r in range(cfg.pp)]


def rank_stages(rank: int, pp: int, vp: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank ``rank`` runs, in order."""
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(vp)]


def stage_owners(pp: int, vp: int, schedule: str) -> list[int]:
    """The pipeline rank that runs each stage, in stage order (:func:`rank_stages` inverted)."""
    owners = [0] * (pp * vp)
    for r in range(pp):
        for s in rank_stages(r, pp, vp, schedule):
            owners[s] = r
    return owners


class Blocks(nn.ModuleDict):
    """A stage's blocks under their global indices (``layers.7`` as in the whole model); iterates over the
    blocks, as the whole model's ``nn.ModuleList`` does."""

    def __iter__(self):
        return iter(self.values())


def stage_module(model: nn.Module, blocks: range, first: bool, last: bool, untie: bool) -> nn.Module:
    """The decoder of one stage: ``model``'s modules shared, the others None. ``untie``: the last stage's LM head
    gets its own weight (a new parameter on ``model``'s device, not initialised, frozen where the embedding is),
    where ``model`` ties it."""
    stage = copy.copy(model)
    stage._modules = dict(model._modules)
    stage._parameters, stage._buffers = dict(model._parameters), dict(model._buffers)
    stage._forward_pre_hooks, stage._forward_hooks = type(model._forward_pre_hooks)(), type(model._forward_hooks)()
    stage.layers = Blocks({str(i): model.layers[i] for i in blocks})
    if not first:
        stage.tok_embeddings = stage.pos_embeddings = None
    if not last:
        stage.norm = stage.lm_head = None
    elif untie and model.lm_head.weight is model.tok_embeddings.weight:
        head = copy.copy(model.lm_head)
        head._parameters = dict(head._parameters)
        w = model.lm_head.weight  # trains, or stays frozen (LoRA), as the embedding does
        head.weight = nn.Parameter(torch.empty_like(w), requires_grad=w.requires_grad)
        stage.lm_head = head
    return stage


def rank_view(model: nn.Module, stages: list[nn.Module]) -> nn.Module:
    """One module holding a rank's stages (its parameters, buffers and state-dict keys as the whole model's): what
    the optimizer, the checkpoint and the converters see. Its ``forward_roots`` are the stages."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._forward_pre_hooks, view._forward_hooks = type(model._forward_pre_hooks)(), type(model._forward_hooks)()
    view.layers = Blocks({k: b for s in stages for k, b in s.layers.items()})
    for name in ("tok_embeddings", "pos_embeddings", "norm", "lm_head"):
        setattr(view, name, next((getattr(s, name) for s in stages if getattr(s, name) is not None), None))
    view.forward_roots = stages
    return view


def tie_groups(world: torch.Tensor, pp: int, first_rank: int, last_rank: int):
    """The process group of this rank's (first stage, last stage) pair, for every pair of the world mesh
    ``world`` (pp the outermost dim; a collective call); None where the two are one rank."""
    if first_rank == last_rank:
        return None
    columns = world.reshape(pp, -1).t()
    pairs = [[int(c[first_rank]), int(c[last_rank])] for c in columns]
    mine = None
    for pair in pairs:
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def _park(infos) -> None:
    """Replace each received tensor of ``infos`` (torch's ``_RecvInfo``) by a meta tensor of its shape, dtype and
    ``requires_grad``, freeing its memory; root inputs and absent gradients (no buffer) stay as they are."""
    for info in infos:
        b = getattr(info, "buffer", None)
        if isinstance(b, torch.Tensor) and not b.is_meta:
            info.buffer = torch.empty(b.shape, dtype=b.dtype, device="meta").requires_grad_(b.requires_grad)


def _unpark(infos, device: torch.device) -> None:
    """Give each parked buffer of ``infos`` memory on ``device`` again (uninitialised: a receive fills it)."""
    for info in infos:
        b = getattr(info, "buffer", None)
        if isinstance(b, torch.Tensor) and b.is_meta:
            info.buffer = torch.empty(b.shape, dtype=b.dtype, device=device).requires_grad_(b.requires_grad)


class Stage(PipelineStage):
    """torch's ``PipelineStage`` whose receive buffers exist only while a micro-batch needs them: allocated when
    the schedule posts the receive (``get_fwd_recv_ops``, ``get_bwd_recv_ops``), released by the stage once its
    forward or backward has taken them (the received activation stays alive in the autograd graph until the
    backward, the received gradient until it has been used). torch keeps every micro-batch's pair for the whole
    run (the module docstring). A buffer a same-rank stage hands over (``zbv``'s V) is released the same way."""

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        for infos in self.args_recv_info.values():
            _park(infos)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        for infos in self.grad_recv_info.values():
            _park(infos)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        _unpark(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if bwd_chunk_id in self.grad_recv_info:
            _unpark(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        _park(self.args_recv_info[fwd_chunk_id])
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        _park(self.grad_recv_info.get(bwd_chunk_id, ()))
        return out


class Pipeline:
    """A rank's stages and the schedule that runs a step's micro-batches through them.

    ``modules``: the stages as the schedule calls them (FSDP- or DDP-wrapped); ``ids``: their stage indices;
    ``examples``: ``(input, output)`` meta tensors of each stage, its shapes for the point-to-point transfers.
    ``tied``: this rank's copies of a trained tied embedding (the first stage's, the last stage's own), None where
    the model ties none, or the rank holds neither; ``tie_group``: the pair of ranks where they are apart;
    ``sizes``: every stage's block count (the split, for the log).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        ids: list[int],
        n_stages: int,
        schedule: str,
        micro_batches: int,
        device: torch.device,
        group,
        examples: list[tuple[torch.Tensor, torch.Tensor]],
        tie_group=None,
        tied: tuple[nn.Parameter | None, nn.Parameter | None] = (None, None),
        draws: tuple[int, int, int] = (0, 1, 0),
        sizes: list[int] | None = None,
    ):
        self.ids, self.n_stages, self.name, self.micro_batches = ids, n_stages, schedule, micro_batches
        self.device, self.examples, self.sizes = device, examples, sizes
        self.seed, self.dp, self.dp_rank = draws
        self.draw_step = 0  # the optimizer step the draws are keyed by (``step``)
        self.pp, self.group = dist.get_world_size(group), group
        self.vp = len(ids)
        self.stages = [
            Stage(m, i, n_stages, device, input_args=x, output_args=y, group=group)
            for m, i, (x, y) in zip(modules, ids, examples)
        ]
        cls = getattr(schedules, SCHEDULES[schedule])
        one = cls is schedules.Schedule1F1B
        self.schedule = cls(
            self.stages[0] if one else self.stages, micro_batches, loss_fn=self._loss, scale_grads=False
        )
        self.has_first, self.has_last = 0 in ids, n_stages - 1 in ids
        self.merges = "return_outputs" in inspect.signature(self.schedule.step).parameters
        self.losses: list[torch.Tensor] = []
        self.tie_group, self.tied = tie_group, tied
        self.clock = BusyClock(self.stages, device)
        for stage in self.stages:
            for name in BusyClock.METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._keyed(getattr(stage, name)))
        self.bubble: float | None = None  # the idle fraction of the last step measured (``measure``)

    def _keyed(self, fn):
        """``fn`` (a stage's forward or backward of one micro-batch) drawing stochastic rounding's noise by the
        micro-batch's place in the global batch, as one process draws (:mod:`lpbench.precision.noise`)."""

        def run(chunk: int, *args, **kwargs):
            with noise.drawing(self.seed, self.draw_step, chunk * self.dp + self.dp_rank, self.device):
                return fn(chunk, *args, **kwargs)

        return run

    def _loss(self, output: torch.Tensor, target) -> torch.Tensor:
        self.losses.append(output.detach())
        return output / self.micro_batches

    def step(self, batches: list[tuple], draw_step: int = 0, measure: bool = False) -> torch.Tensor:
        """Forward and backward of ``batches`` (``Batch.model_args`` of each micro-batch: input_ids, labels[,
        doc_ids]); returns the sum of the micro-batches' losses on the last stage's rank, else zero. ``draw_step``: the
        optimizer step stochastic rounding's draws are keyed by; ``measure``: time this rank's compute in the schedule
        (:class:`BusyClock`) and set ``bubble``."""
        self.draw_step = draw_step
        args = [torch.cat(parts) for parts in zip(*batches)]
        kwargs = {"labels": args[1]} | ({"doc_ids": args[2]} if len(args) > 2 else {})
        self.losses = []
        if self.merges:  # the outputs are the losses, kept by the loss function: not merged
            kwargs["return_outputs"] = False
        self.clock.start(measure)
        self.schedule.step(*args[:1] if self.has_first else (), target=args[1], **kwargs)
        if measure:
            self.bubble = self.clock.stop()
        self.sync_tied()
        if not self.losses:
            return torch.zeros((), device=args[0].device)
        return torch.stack(self.losses).sum()

    @torch.no_grad()
    def evaluate(self, args: tuple) -> torch.Tensor | None:
        """The loss of one micro-batch (``Batch.model_args``) without gradients: every stage's forward in stage
        order, each stage's rank receiving its input from the rank of the stage before and sending its output on;
        the loss on the last stage's rank, None elsewhere. Not the schedule's ``eval``: this runs any number of
        validation micro-batches on every schedule (the zero-bubble ones included) and keeps nothing for a
        backward pass."""
        kwargs = {"labels": args[1]} | ({"doc_ids": args[2]} if len(args) > 2 else {})
        owner = stage_owners(self.pp, self.vp, self.name)
        me = dist.get_rank(self.group)
        x = args[0]
        for s in range(self.n_stages):
            if owner[s] != me:
                continue
            i = self.ids.index(s)
            if s > 0 and owner[s - 1] != me:
                example = self.examples[i][0]
                x = torch.empty(example.shape, dtype=example.dtype, device=self.device)
                dist.recv(x, src=dist.get_global_rank(self.group, owner[s - 1]), group=self.group)
            x = self.stages[i].submod(x, **kwargs)
            if s < self.n_stages - 1 and owner[s + 1] != me:
                out = x.to(self.examples[i][1].dtype).contiguous()  # as the schedule sends it
                dist.send(out, dst=dist.get_global_rank(self.group, owner[s + 1]), group=self.group)
        return x if self.has_last else None

    def sync_tied(self) -> None:
        """Sum the tied embedding's two gradients (first stage's embedding, last stage's head): over their ranks, or
        on this rank where it holds both stages, each with its own copy."""
        first, head = self.tied
        if first is not None and head is not None and first is not head:
            if first.grad is not None:  # trained (LoRA freezes it)
                _local(first.grad).add_(_local(head.grad))
                _local(head.grad).copy_(_local(first.grad))
            return
        if self.tie_group is None:
            return
        p = first if first is not None else head
        dist.all_reduce(_local(p.grad), group=self.tie_group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A gradient's local tensor (this rank's shard of a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def bubble_theory(pp: int, vp: int, micro_batches: int, loads: list[float] | None = None) -> float:
    """The idle fraction of a (interleaved) 1F1B pipeline of equal ranks: (p − 1) / (m · v + p − 1). With ``loads``
    (each pipeline rank's work, :func:`rank_loads`) the busiest rank sets the pace and the others wait for it: the
    mean idle fraction becomes 1 − (1 − theory) · mean / max."""
    theory = (pp - 1) / (micro_batches * vp + pp - 1)
    if not loads:
        return theory
    return 1.0 - (1.0 - theory) * (sum(loads) / len(loads)) / max(loads)


def rank_loads(cfg: RunConfig, m: ModelConfig) -> list[float]:
    """Each pipeline rank's work per micro-batch in blocks, by rank: its stages' blocks (:func:`rank_blocks`), plus
    the LM head (:func:`head_units`) on the last stage's rank."""
    loads = [float(n) for n in rank_blocks(cfg, m)]
    loads[stage_owners(cfg.pp, cfg.vp, cfg.schedule)[-1]] += head_units(m, cfg.seq_len)
    return loads


class BusyClock:
    """Measures a rank's compute time inside a step: the stage's forward and backward calls as the schedule makes
    them (``PipelineStage.forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk``: the
    compute, after the schedule waited for its inputs; forward pre/post hooks on the stage modules would not
    separate the autograd engine's time). On CUDA each call is bracketed by two timing events on the current
    stream, and the step by two more: the device is synchronised once, when the step's last event has passed, and
    the busy time is the sum of the calls' elapsed times (what the device spent on them, whatever the host ran
    ahead), the wall time the step's first to last event. Elsewhere the host's clock times both. The bubble is
    one minus busy over wall time. A run measures it on one step only (``measure``)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: list, device: torch.device):
        self.cuda, self.on = device.type == "cuda", False
        self.spans: list = []  # (start, end) of each call: events on CUDA, else perf_counter times
        self.t0 = None  # the step's start (an event or a time)
        for stage in stages:
            for name in self.METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, on: bool) -> None:
        self.on, self.spans = on, []
        if on:
            self.t0 = self._mark()

    def stop(self) -> float:
        """The idle fraction since :meth:`start`: 1 − busy time / wall time."""
        t0, t1 = self.t0, self._mark()
        self.on = False
        if self.cuda:
            t1.synchronize()
            wall = t0.elapsed_time(t1)
            busy = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            wall, busy = t1 - t0, sum(b - a for a, b in self.spans)
        self.spans = []
        return max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0

    def _timed(self, fn):
        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = self._mark()
            out = fn(*args, **kwargs)
            self.spans.append((t0, self._mark()))
            return out

        return run

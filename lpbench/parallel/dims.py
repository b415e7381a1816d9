"""``ParallelDims``: the run's layout over the world, validated in one place, and its one device mesh.

Degrees (torchtitan's names): ``pp × dp_replicate × dp_shard × cp × tp`` = world size. The
``dp = dp_replicate × dp_shard`` data-parallel ranks read different data. DDP replicates over all
of them (``dp_replicate = dp``, ``dp_shard = 1``); FSDP2 shards over ``dp_shard = dp / dp_replicate``
ranks and, with ``--dp-replicate N > 1`` (HSDP), keeps N replicas of those shards. Expert parallelism
borrows ranks from data parallelism: ``ep`` consecutive data-parallel ranks form an expert-parallel
group, inside one FSDP shard group (``ep`` divides ``dp_shard``) or, under DDP, inside ``dp``.
Context parallelism (``cp``, :mod:`lpbench.parallel.cp`) always runs under FSDP2, sharded over
``dp_shard_cp``: its ranks hold one model between them, and with or without ``--fsdp`` the
data-parallel ranks shard it too (all ``dp × cp`` ranks, as Megatron's distributed optimizer shards
over its DP × CP group); ``--dp-replicate`` makes replicas of those shards (HSDP).

One mesh: ``init_device_mesh`` over the dims ``pp, rep, shard, ep, cp, tp`` (outermost first, TP
ranks adjacent so a TP group stays inside a node; only the dims larger than 1), where
``rep × shard × ep`` are the data-parallel ranks split as the layout needs. The named sub-meshes
every consumer takes its group from are views of it, flattened where they span several dims:

======================  ===========================================================================
``dp`` / ``batch``      every data-parallel rank: which data shard a rank reads
``dp_replicate``        DDP's all-reduce (all of ``dp``), or HSDP's replica dim
``dp_shard``            FSDP2's shard group (``dp_shard_cp`` adds the CP ranks, which shard too)
``fsdp``                what ``fully_shard`` gets: ``dp_shard_cp``, or 2-D ``(dp_replicate, dp_shard_cp)``
``ep``                  one expert-parallel group (all-to-all); ``ep_replicate``: the ranks holding
                        the same experts, CP ranks included (their gradients are summed over it)
``loss``                ranks whose losses are averaged (``dp × cp``), whose tokens the MoE counts sum
``cp``, ``tp``, ``pp``  context, tensor and pipeline parallel groups
======================  ===========================================================================

A name whose dims are all 1 (e.g. ``tp`` without TP) is None. Meshes are built once per layout and
device type and shared by the runs of one process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.parallel.pp import check_pipeline
from lpbench.sharding import shards_data_parallel, uses_fsdp

MESH_DIMS = ("pp", "rep", "shard", "ep", "cp", "tp")  # the mesh's own dims, outermost first


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    fsdp: bool  # FSDP2 wraps the model (lpbench/sharding.py says when), else DDP or nothing

    @classmethod
    def of(cls, cfg: RunConfig) -> "ParallelDims":
        """The layout ``cfg`` asks for (its ``dp`` already the world's, :meth:`RunConfig.with_world`), validated."""
        for name in ("dp", "dp_replicate", "tp", "pp", "cp", "ep"):
            if getattr(cfg, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
        sharded = shards_data_parallel(cfg.fsdp, cfg.dp, cfg.cp)
        if cfg.dp_replicate > 1 and not sharded:
            raise UsageError(
                f"--dp-replicate {cfg.dp_replicate} is HSDP's replica count: it needs --fsdp (or --cp) and "
                "data-parallel ranks (DDP already replicates over all of them)"
            )
        if cfg.dp % cfg.dp_replicate:
            raise UsageError(f"--dp-replicate {cfg.dp_replicate} does not divide the data-parallel size {cfg.dp}")
        check_pipeline(cfg.pp, cfg.vp, cfg.pp_schedule, cfg.grad_accum, cfg.dp)
        replicate = cfg.dp_replicate if sharded else cfg.dp
        dims = cls(replicate, cfg.dp // replicate, cfg.cp, cfg.tp, cfg.pp, cfg.ep, uses_fsdp(cfg.fsdp, cfg.dp, cfg.cp))
        dims.validate()
        return dims

    def validate(self) -> None:
        """Every layout rule that needs no model (the model's own — TP divides the heads, EP the experts — are
        :meth:`RunConfig.validate`'s); one line each."""
        if self.fsdp and self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1:
            raise UsageError(
                f"--dp-replicate {self.dp_replicate} leaves no ranks to shard over (data-parallel size "
                f"{self.dp}): drop --fsdp for DDP, or use a smaller --dp-replicate"
            )
        if self.ep > 1 and self.tp > 1:
            raise UsageError(
                "--tp and --ep do not combine: split the experts' FFN width with --tp or "
                "spread the experts over ranks with --ep"
            )
        if self.ep > 1 and self.dp % self.ep:
            raise UsageError(f"--ep {self.ep} must divide the data-parallel size {self.dp}")
        if self.ep > 1 and self.fsdp and self.dp_shard % self.ep:
            raise UsageError(
                f"--ep {self.ep} must divide the FSDP shard size {self.dp_shard} "
                f"(data-parallel {self.dp} / --dp-replicate {self.dp_replicate})"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp and self.dp_replicate > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_enabled and not self.fsdp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def sizes(self) -> dict[str, int]:
        """The mesh's dims and their sizes (1 included): the data-parallel ranks as ``rep × shard × ep``."""
        rep, shard = (self.dp_replicate, self.dp_shard // self.ep) if self.fsdp else (self.dp // self.ep, 1)
        return dict(zip(MESH_DIMS, (self.pp, rep, shard, self.ep, self.cp, self.tp)))

    def spans(self) -> dict[str, tuple[str, ...]]:
        """Each named sub-mesh as the mesh dims it spans (see the module doc)."""
        dp = ("rep", "shard", "ep")
        shard = ("shard", "ep") if self.fsdp else ()
        return {
            "dp": dp,
            "batch": dp,
            "dp_replicate": ("rep",) if self.fsdp else dp,
            "dp_shard": shard,
            "dp_shard_cp": (*shard, "cp"),
            "ep": ("ep",),
            "ep_replicate": ("rep", "shard", "cp") if self.ep > 1 else (),
            "loss": (*dp, "cp"),
            "cp": ("cp",),
            "tp": ("tp",),
            "pp": ("pp",),
        }

    def mesh(self, device_type: str) -> "Meshes":
        """The world mesh and its named sub-meshes (built once per layout and device type; a collective call)."""
        return _meshes(self, device_type)


class Meshes:
    """One layout's device mesh: ``meshes[name]`` is the named sub-mesh (None where its dims are all 1)."""

    def __init__(self, dims: ParallelDims, device_type: str):
        sizes = {k: v for k, v in dims.sizes().items() if v > 1}
        self.dims = dims
        self.world = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        by_span: dict[tuple[str, ...], DeviceMesh] = {}
        self.named: dict[str, DeviceMesh | None] = {}
        for name, span in dims.spans().items():
            span = tuple(d for d in span if d in sizes)
            if span and span not in by_span:
                by_span[span] = self.world[span[0]] if len(span) == 1 else self.world[span]._flatten(name)
            self.named[name] = by_span.get(span)
        fsdp = self.named["dp_shard_cp"] if dims.fsdp else None
        if fsdp is not None and dims.hsdp_enabled:  # 2-D: replicas outer, shards inner
            span = tuple(d for d in dims.spans()["dp_shard_cp"] if d in sizes)
            inner = span[0] if len(span) == 1 else fsdp.mesh_dim_names[0]
            with warnings.catch_warnings():  # slicing a flattened dim out of the root: the one way to a 2-D view
                warnings.simplefilter("ignore")
                fsdp = self.world[("rep", inner)]
        self.named["fsdp"] = fsdp

    def __getitem__(self, name: str) -> DeviceMesh | None:
        return self.named[name]

    def group(self, name: str):
        """The process group of sub-mesh ``name``, or None where it is one rank."""
        mesh = self.named[name]
        return None if mesh is None else mesh.get_group()

    def rank(self, name: str) -> int:
        """This rank's index in sub-mesh ``name`` (0 where it is one rank)."""
        mesh = self.named[name]
        return 0 if mesh is None else mesh.get_local_rank()


@lru_cache(maxsize=None)
def _meshes(dims: ParallelDims, device_type: str) -> Meshes:
    return Meshes(dims, device_type)

"""Scale-out on torch.distributed: DDP, FSDP2, DTensor tensor parallelism, torchrun and Slurm launch.

- :mod:`~lpbench.parallel.env`: rank/world from torchrun or srun, process group, reductions.
- :mod:`~lpbench.parallel.dims`: ``ParallelDims``, the layout validated in one place, and its one device mesh
  with the named sub-meshes every other module takes its groups from.
- :mod:`~lpbench.parallel.tp`: column/row-wise + sequence-parallel plans; each split linear's ``tp_shard``.
  The quantized linear's own FSDP hooks live in precision and convert (``fp8_allgather``,
  ``apply_fp8_all_gather``); GEMMs on TP shards in ``lpbench.gemm``.
- :mod:`~lpbench.parallel.ep`: expert parallelism (MoE experts spread over data-parallel ranks, all-to-all).
- :mod:`~lpbench.parallel.dp`: DDP / FSDP2 / HSDP wrapping, gradient-sync control, grad-norm clipping.
- :mod:`~lpbench.parallel.plan`: ``parallelize`` (TP -> compile -> FSDP/DDP on the layout's mesh), and
  ``materialize`` for models built on the meta device.
- :mod:`~lpbench.parallel.launch` and :mod:`~lpbench.parallel.slurm`: torchrun relaunch, sbatch scripts.
"""

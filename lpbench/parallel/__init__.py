"""Scale-out on torch.distributed: DDP, FSDP2, DTensor tensor parallelism, torchrun and Slurm launch.

- :mod:`~lpbench.parallel.env`: rank/world from torchrun or srun, process group, reductions.
- :mod:`~lpbench.parallel.tp`: column/row-wise + sequence-parallel plans; what a quantized linear needs
  (:func:`~lpbench.parallel.tp.local_linear`, each split linear's ``tp_shard``).
- :mod:`~lpbench.parallel.fp8_allgather`: FSDP2 all-gathers FP8 weights (fp8-tensorwise/delayed).
- :mod:`~lpbench.parallel.dp`: DDP / FSDP2 wrapping, gradient-sync control, grad-norm clipping.
- :mod:`~lpbench.parallel.plan`: ``parallelize`` (TP -> compile -> FSDP/DDP on a ``(dp, tp)`` mesh), and
  ``materialize`` for models built on the meta device.
- :mod:`~lpbench.parallel.launch` and :mod:`~lpbench.parallel.slurm`: torchrun relaunch, sbatch scripts.
"""

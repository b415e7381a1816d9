"""Scale-out on torch.distributed: DDP, FSDP2, DTensor tensor parallelism, torchrun and Slurm launch.

- :mod:`~lpbench.parallel.env`: rank/world from torchrun or srun, process group, reductions.
- :mod:`~lpbench.parallel.tp`: column/row-wise + sequence-parallel plans; the quantized-linear hooks
  :func:`~lpbench.parallel.tp.amax_group` and :func:`~lpbench.parallel.tp.local_linear`.
- :mod:`~lpbench.parallel.dp`: DDP / FSDP2 wrapping, gradient-sync control, grad-norm clipping.
- :mod:`~lpbench.parallel.plan`: ``parallelize`` (TP -> compile -> FSDP/DDP on a ``(dp, tp)`` mesh).
- :mod:`~lpbench.parallel.launch` and :mod:`~lpbench.parallel.slurm`: torchrun relaunch, sbatch scripts.
"""

"""Whether FSDP2 shards the model, and over which ranks: the one statement of the rule.

Context-parallel ranks (``cp > 1``) hold one model between them, so FSDP2 shards it over every
data-parallel x CP rank, with or without ``--fsdp``. Without CP, ``--fsdp`` shards over the
data-parallel ranks when there are several (``dp > 1``); with one it is a no-op.

The layout (``parallel/dims.py``), the config's checks, the memory plan and the memory estimator
(which takes loose settings, not a config) all ask here, so the rule sits below all of them.
"""

from __future__ import annotations


def fsdp_requested(fsdp: bool, cp: int) -> bool:
    """Whether a run asks for FSDP2: ``--fsdp``, or context parallel (``cp > 1``) with or without it."""
    return fsdp or cp > 1


def shards_data_parallel(fsdp: bool, dp: int, cp: int) -> bool:
    """Whether the data-parallel ranks shard the model (FSDP2, HSDP with replicas) rather than replicate it
    (DDP): FSDP2 asked for (:func:`fsdp_requested`) and ``dp > 1``."""
    return fsdp_requested(fsdp, cp) and dp > 1


def uses_fsdp(fsdp: bool, dp: int, cp: int) -> bool:
    """Whether FSDP2 wraps the model: it shards over the data-parallel ranks, or over the CP ranks (``cp > 1``).
    ``--fsdp`` with ``dp`` 1 and ``cp`` 1 is a no-op."""
    return shards_data_parallel(fsdp, dp, cp) or cp > 1

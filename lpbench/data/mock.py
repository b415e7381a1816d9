"""Mock data: seeded random tokens, as NeMo's / Megatron's mock datasets, for throughput runs.

Sample ``i`` is ``seq_len + 1`` tokens drawn by a generator seeded with ``(seed, stream, i)``;
so the sample index alone fixes the data, and a sampler position (see
:mod:`lpbench.data.sampler`) fixes every batch, on any rank, after any resume. Two kinds:

- ``walk`` (default, ``--data mock``): a random walk over the vocabulary, each next token the
  current one plus one of 8 fixed offsets (Zipf-weighted, entropy ~1.9 nats). Throughput is the
  same as for any tokens, but a model can learn it, so losses show whether a precision still
  learns like BF16 (uniform tokens only ever reach ln(vocab), for every precision).
- ``uniform`` (``--data mock-uniform``): tokens uniform in ``[0, vocab_size)``, exactly NeMo's
  mock dataset.
"""

from __future__ import annotations

import numpy as np

from lpbench.data.sampler import MicroBatchLoader, MicroBatchSampler
from lpbench.errors import UsageError


class RandomWalk:
    """The learnable mock tokens' walk over ``[0, vocab_size)``: each next token is the current one plus one of
    up to 8 offsets, drawn Zipf-weighted; the offsets are fixed by ``seed`` alone (every stream shares them).
    Mock pretraining sequences and mock SFT samples are both its paths."""

    OFFSETS = 8

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size = int(vocab_size)
        rng = np.random.default_rng([seed, 2**31])
        self.offsets = rng.choice(
            np.arange(1, self.vocab_size), size=min(self.OFFSETS, self.vocab_size - 1), replace=False
        )
        weights = 1.0 / np.arange(1, len(self.offsets) + 1)
        self.offset_probs = weights / weights.sum()

    def steps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` offsets drawn from ``rng``."""
        return self.offsets[rng.choice(len(self.offsets), size=n, p=self.offset_probs)]

    def path(self, start, steps: np.ndarray) -> np.ndarray:
        """``start`` and the ``len(steps)`` tokens the walk visits from it."""
        return (start + np.concatenate([[0], np.cumsum(steps)])) % self.vocab_size


class MockDataset:
    """Endless (or ``num_samples``-long) indexable source of random ``seq_len + 1`` windows.

    ``stream`` separates independent sets drawn from the same seed (0 train, 1 validation).
    """

    KINDS = ("walk", "uniform")

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int = 0,
        stream: int = 0,
        num_samples: int | None = None,
        kind: str = "walk",
    ):
        if vocab_size < 2:
            raise UsageError(f"mock data needs vocab_size >= 2, got {vocab_size}")
        if seq_len < 1:
            raise UsageError(f"seq_len must be >= 1, got {seq_len}")
        if seed < 0 or stream < 0:
            raise UsageError("mock data seed and stream must be >= 0")
        self.vocab_size, self.seq_len = int(vocab_size), int(seq_len)
        self.seed, self.stream = int(seed), int(stream)
        self.num_samples = num_samples
        if kind not in self.KINDS:
            raise UsageError(f"unknown mock data kind {kind!r}; valid: {', '.join(self.KINDS)}")
        self.kind = kind
        self.walk = RandomWalk(self.vocab_size, self.seed)

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("an endless MockDataset has no len(); use num_samples")
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """``seq_len + 1`` int64 tokens of sample ``index`` (inputs ``[:-1]``, labels ``[1:]``)."""
        index = int(index)
        if index < 0 or (self.num_samples is not None and index >= self.num_samples):
            raise IndexError(f"mock sample {index} out of range")
        rng = np.random.default_rng([self.seed, self.stream, index])
        if self.kind == "uniform":
            return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)
        steps = self.walk.steps(rng, self.seq_len)
        return self.walk.path(rng.integers(0, self.vocab_size), steps)

    def describe(self) -> str:
        size = "endless" if self.num_samples is None else f"{self.num_samples} sequences"
        what = "uniform random tokens" if self.kind == "uniform" else "random-walk tokens (learnable)"
        return (
            f"mock: {what}, vocab {self.vocab_size}, seq_len {self.seq_len}, "
            f"seed {self.seed}, stream {self.stream} ({size})"
        )


class MockLoader(MicroBatchLoader):
    """Yields ``(input_ids, labels)`` int64 mock micro-batches ``[micro_batch_size, seq_len]``.

    Rank ``r`` of ``world_size`` reads samples ``k*G + r*mbs ... + mbs`` at step ``k``
    (``G = mbs * world_size``); ``consumed_samples`` (global, a multiple of ``G``) resumes there.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        consumed_samples: int = 0,
        kind: str = "walk",
    ):
        dataset = MockDataset(vocab_size, seq_len, seed, kind=kind)
        sampler = MicroBatchSampler(None, micro_batch_size, rank=rank, world_size=world_size, seed=seed, shuffle=False)
        super().__init__(dataset, sampler)
        if consumed_samples:
            sampler.seek(consumed_samples)

"""Deterministic, resumable, data-parallel sampling of fixed-length sequences into micro-batches.

The global sample order is a chain of epochs; epoch ``e`` is a permutation of the sequence
indices seeded by ``(seed, e)`` (identity without shuffling; an endless counter for an endless
source). Each step takes the next *global micro-batch* of ``G = micro_batch_size * world_size``
indices of that order and rank ``r`` keeps the slice ``[r*mbs, (r+1)*mbs)``: ranks are disjoint
and together cover the global micro-batch. An epoch's last incomplete global micro-batch is
dropped, so ranks stay in lock-step and no sequence repeats within an epoch. The position is one
integer (global micro-batches taken), so a checkpoint resumes at exactly the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import numpy as np
import torch

from lpbench.data.tokenizer import Tokenizer
from lpbench.errors import UsageError


class MicroBatchSampler:
    """Yields each rank's index array for consecutive global micro-batches (see module doc)."""

    def __init__(
        self,
        num_samples: int | None,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if micro_batch_size < 1:
            raise UsageError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"need 0 <= rank < world_size, got rank {rank}, world {world_size}")
        self.num_samples = None if num_samples is None else int(num_samples)
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.global_micro_batch = micro_batch_size * world_size
        if self.num_samples is not None and self.num_samples < self.global_micro_batch:
            raise UsageError(
                f"{self.num_samples} sequences cannot fill one global micro-batch of "
                f"{self.global_micro_batch} (micro_batch_size x data-parallel ranks)"
            )
        self.step = 0  # global micro-batches consumed
        self._perm_epoch, self._perm = -1, None

    @property
    def batches_per_epoch(self) -> int | None:
        return None if self.num_samples is None else self.num_samples // self.global_micro_batch

    @property
    def consumed_samples(self) -> int:
        """Samples consumed by all ranks together (``step * G``)."""
        return self.step * self.global_micro_batch

    @property
    def epoch(self) -> int:
        bpe = self.batches_per_epoch
        return 0 if bpe is None else self.step // bpe

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def indices_at(self, step: int) -> np.ndarray:
        """This rank's sample indices for global micro-batch ``step`` (the sampler stays put)."""
        lo = self.rank * self.micro_batch_size
        if self.num_samples is None:
            start = step * self.global_micro_batch + lo
            return np.arange(start, start + self.micro_batch_size)
        epoch, b = divmod(step, self.batches_per_epoch)
        start = b * self.global_micro_batch + lo
        return self._order(epoch)[start : start + self.micro_batch_size].copy()

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield next(self)

    def __next__(self) -> np.ndarray:
        idx = self.indices_at(self.step)
        self.step += 1
        return idx

    def seek(self, consumed_samples: int) -> None:
        """Move to a global sample position (a multiple of the global micro-batch)."""
        if consumed_samples < 0 or consumed_samples % self.global_micro_batch:
            raise UsageError(
                f"consumed_samples {consumed_samples} is not a non-negative multiple "
                f"of the global micro-batch {self.global_micro_batch}"
            )
        self.step = consumed_samples // self.global_micro_batch

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_micro_batch": self.global_micro_batch,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume; the data, seed, shuffling and ``mbs * world_size`` must match the saved run."""
        for key in ("seed", "num_samples", "global_micro_batch", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise UsageError(
                    f"cannot resume the data sampler: checkpoint has {key}="
                    f"{state[key]!r}, this run has {getattr(self, key)!r}"
                )
        self.seek(int(state["consumed_samples"]))


@dataclass
class Batch:
    """One micro-batch, pretraining or packed SFT: int64 tensors ``[mbs, seq_len]``. It unpacks and
    indexes as ``(input_ids, labels)`` and reads by key (``batch["doc_ids"]``, ``batch.items()``)."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # -100 marks tokens without loss
    doc_ids: torch.Tensor | None = None  # packed SFT: the sample of each token (attention stays inside it)
    position_ids: torch.Tensor | None = None  # packed SFT: positions restarting at each sample
    sample_lengths: list[list[int]] | None = None  # packed SFT: the sample lengths of each sequence

    def __iter__(self):
        return iter((self.input_ids, self.labels))

    def __getitem__(self, key):
        return getattr(self, key) if isinstance(key, str) else (self.input_ids, self.labels)[key]

    def items(self) -> list[tuple[str, object]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def model_args(self, device) -> list[torch.Tensor]:
        """The model's arguments on ``device``: ``input_ids, labels``, plus ``doc_ids`` for packed SFT."""
        args = (self.input_ids, self.labels) + (() if self.doc_ids is None else (self.doc_ids,))
        return [t.to(device, non_blocking=True) for t in args]


class MicroBatchLoader:
    """Turns sampled indices into :class:`Batch` es: ``collate`` of the dataset's items (by default
    ``seq_len + 1`` tokens each: inputs ``[:-1]``, labels ``[1:]``).
    Endless: iterate for as many steps as the run needs; ``sampler.epoch`` tells the epoch.
    """

    def __init__(self, dataset, sampler: MicroBatchSampler, collate: Callable[[list], Batch] | None = None):
        self.dataset, self.sampler, self.collate = dataset, sampler, collate or collate_windows

    def __iter__(self) -> "MicroBatchLoader":
        return self

    def __next__(self) -> Batch:
        return self.collate([self.dataset[int(i)] for i in next(self.sampler)])

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def collate_windows(windows: list[np.ndarray]) -> Batch:
    """Stack ``seq_len + 1`` windows into a batch of inputs and labels."""
    tokens = torch.from_numpy(np.stack(windows).astype(np.int64, copy=False))
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def eval_batches(
    dataset,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    collate: Callable[[list], Batch] = collate_windows,
) -> Iterator[Batch]:
    """One in-order pass over a finite dataset, sharded like the training sampler.

    Nothing is dropped: the last global micro-batch may leave some ranks a short or no batch,
    so reduce summed loss and token counts across ranks, not per-batch means.
    """
    if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise UsageError("eval_batches needs micro_batch_size >= 1 and 0 <= rank < world_size")
    n, g = len(dataset), micro_batch_size * world_size
    for start in range(rank * micro_batch_size, n, g):
        stop = min(start + micro_batch_size, n)
        yield collate([dataset[i] for i in range(start, stop)])


@dataclass
class Splits:
    """A data set's ``train`` and ``valid`` splits, what they are, and their micro-batches (through
    ``collate``; a subclass says ``is_mock``)."""

    collate = staticmethod(collate_windows)

    train: object
    valid: object
    seq_len: int
    vocab_size: int
    eos_id: int | None
    seed: int
    source: str
    tokenizer: Tokenizer | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self, corpus: tuple[str, ...] = (), order: tuple[str, ...] = ()) -> str:
        """Several lines: where the data comes from, its tokenizer, ``corpus``, the splits, ``order``, notes."""
        tokenizer = () if self.tokenizer is None else (f"tokenizer: {self.tokenizer.description}",)
        return "\n".join(
            [
                f"data: {self.source}",
                *tokenizer,
                *corpus,
                self.train.describe(),
                self.valid.describe(),
                *order,
                *self.notes,
            ]
        )

    def train_loader(
        self, micro_batch_size: int, rank: int = 0, world_size: int = 1, shuffle: bool = True
    ) -> MicroBatchLoader:
        """Endless micro-batches for this rank, with state_dict/load."""
        n = None if self.is_mock else len(self.train)
        sampler = MicroBatchSampler(
            n, micro_batch_size, rank=rank, world_size=world_size, seed=self.seed, shuffle=shuffle and not self.is_mock
        )
        return MicroBatchLoader(self.train, sampler, self.collate)

    def valid_batches(self, micro_batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """One in-order pass over this rank's share of the validation sequences."""
        return eval_batches(self.valid, micro_batch_size, rank, world_size, self.collate)

"""Supervised fine-tuning data: prompt/response samples, packed with per-sample attention.

**Samples.** JSONL or parquet records (a file or a directory of them), in one of these forms,
detected from the first record unless ``prompt_key``/``response_key`` are given:

- ``{"prompt": ..., "response": ...}``
- ``{"input": ..., "output": ...}`` (NeMo's SFT JSONL)
- SQuAD: ``{"context": ..., "question": ..., "answers": {"text": [...]}}`` (or ``"answer": str``),
  rendered as NeMo does: prompt ``SQUAD_PROMPT.format(context=..., question=...)``, response
  ``" " + first answer``. Records without an answer (SQuAD v2 unanswerable) are skipped.

Prompt and response are tokenized separately (no BOS; an empty prompt becomes one EOS token):
``tokens = prompt + response + [EOS]``. As in NeMo, a sample of ``n + 1`` tokens occupies ``n``
positions: inputs ``tokens[:-1]``, labels ``tokens[1:]`` with -100 wherever the label is a prompt
token, so the loss covers the response and its EOS only. A sample longer than ``seq_len``
positions loses the start of its prompt (then the end of its response, without EOS); it is
counted in ``truncated``.

**Packing.** Samples (in a seeded random order) go best-fit into sequences of ``seq_len``
positions, each sequence padded at the end (pad = EOS, label -100). Each sequence carries
``doc_ids`` (sample ordinal in the sequence, -1 for padding) and ``position_ids`` (restarting at
each sample), so ``Decoder.forward(input_ids, labels, doc_ids=doc_ids)`` keeps attention inside
each sample; ``sample_lengths`` (positions per sample, padding excluded) feed the FLOP count
(:func:`lpbench.metrics.flops.packed_flops_per_token`).

**Mock** (``spec="mock"``): endless seeded sequences of random prompt/response samples with
lengths drawn uniformly from ``prompt_len`` and ``response_len`` (the last sample of a sequence is
shortened to fill it: no padding). Prompts are random walks over ``vocab_size - 1`` tokens (EOS is
``vocab_size - 1``) and each response continues its prompt's walk (each next token the current
one plus one of 8 fixed, Zipf-weighted offsets): learnable, so precisions can be compared.

Batches are :class:`lpbench.data.sampler.Batch` es of int64 tensors ``input_ids``, ``labels``, ``doc_ids``,
``position_ids`` (each [mbs, seq_len]) plus ``sample_lengths`` (list per sequence of its sample lengths).
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from lpbench.data import sources
from lpbench.data.mock import RandomWalk
from lpbench.data.sampler import Batch, Splits
from lpbench.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer
from lpbench.errors import UsageError

IGNORE_INDEX = -100
PAD_DOC = -1
SQUAD_PROMPT = "Context: {context} Question: {question} Answer:"
KEY_PAIRS = (("prompt", "response"), ("input", "output"))
MOCK_PROMPT_LEN = (64, 320)  # SQuAD-like: ~190 positions per sample on average
MOCK_RESPONSE_LEN = (4, 64)
MOCK_VALID_SEQUENCES = 16
SFT_EXTENSIONS = sources.JSONL_EXTENSIONS + sources.PARQUET_EXTENSIONS


# --------------------------------------------------------------------------- records → text pairs


def _answer_text(ans) -> str | None:
    if isinstance(ans, str):
        return ans
    if isinstance(ans, dict):
        return _answer_text(ans.get("text"))
    if isinstance(ans, (list, tuple)):
        return _answer_text(ans[0]) if ans else None
    return None


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """(location, record) for each record of a JSONL or parquet file."""
    fmt = sources.detect_format(path)
    if fmt == "jsonl":
        for lineno, rec in sources.jsonl_records(path):
            if not isinstance(rec, dict):
                raise UsageError(f"{path}:{lineno}: not a JSON object")
            yield f"{path}:{lineno}", rec
    elif fmt == "parquet":
        pf = sources.open_parquet(path)
        row = 0
        for batch in pf.iter_batches(batch_size=1024):
            for rec in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", rec
    else:
        raise UsageError(f"{path}: SFT data must be JSONL or parquet, not {fmt}")


def read_sft_pairs(
    paths,
    prompt_key: str | None = None,
    response_key: str | None = None,
    squad_prompt: str = SQUAD_PROMPT,
    stats: dict | None = None,
) -> Iterator[tuple[str, str]]:
    """(prompt, response) strings of every record under ``paths`` (see the module doc).

    Records with an empty or missing response are skipped and counted in ``stats["skipped"]``.
    """
    if (prompt_key is None) != (response_key is None):
        raise UsageError("give both prompt_key and response_key, or neither")
    stats = stats if stats is not None else {}
    stats.setdefault("skipped", 0)
    files = [f for f in sources.list_files(paths) if f.suffix.lower() in SFT_EXTENSIONS]
    if not files:
        raise UsageError(f"{paths}: no JSONL or parquet files for SFT")
    for f in files:
        mode = None
        for where, rec in _records(f):
            if mode is None:
                mode = _detect(rec, prompt_key, response_key, where)
            if mode == "squad":
                if "context" not in rec or "question" not in rec:
                    raise UsageError(f"{where}: SQuAD record without 'context' and 'question'")
                answer = _answer_text(rec.get("answers", rec.get("answer")))
                prompt = squad_prompt.format(context=rec["context"], question=rec["question"])
                response = f" {answer}" if answer else None
            else:
                pk, rk = mode
                if pk not in rec or rk not in rec:
                    raise UsageError(f"{where}: no {pk!r} and {rk!r} fields")
                prompt, response = rec[pk], rec[rk]
                for key, v in ((pk, prompt), (rk, response)):
                    if v is not None and not isinstance(v, str):
                        raise UsageError(f"{where}: field {key!r} is {type(v).__name__}, not a string")
                prompt = prompt or ""
            if not response:
                stats["skipped"] += 1
                continue
            yield prompt, response


def _detect(rec: dict, prompt_key, response_key, where) -> tuple[str, str] | str:
    if prompt_key is not None:
        if prompt_key not in rec or response_key not in rec:
            raise UsageError(f"{where}: no {prompt_key!r} and {response_key!r} fields (fields: {', '.join(rec)})")
        return prompt_key, response_key
    for pk, rk in KEY_PAIRS:
        if pk in rec and rk in rec:
            return pk, rk
    if "context" in rec and "question" in rec and ("answers" in rec or "answer" in rec):
        return "squad"
    raise UsageError(
        f"{where}: cannot tell prompt from response in fields {', '.join(rec)}; expected "
        f"prompt/response, input/output or SQuAD context/question/answers "
        f"(or choose with --prompt-key/--response-key)"
    )


def tokenize_pairs(
    pairs: Iterable[tuple[str, str]], tokenizer: Tokenizer, batch_size: int = 1024
) -> Iterator[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per pair, tokenized in batches."""
    for batch in sources.batched(pairs, batch_size):
        prompts = tokenizer.encode_batch([p for p, _ in batch])
        responses = tokenizer.encode_batch([r for _, r in batch])
        yield from zip(prompts, responses)


# --------------------------------------------------------------------------- samples and packing


def sample_tokens(
    prompt: Sequence[int], response: Sequence[int], eos_id: int, seq_len: int
) -> tuple[np.ndarray, int, bool]:
    """``(tokens, n_prompt, truncated)``: ``prompt + response + [EOS]`` cut to ``seq_len + 1`` tokens."""
    prompt = list(prompt) or [eos_id]
    response = list(response)
    if not response:
        raise UsageError("an SFT sample needs a non-empty response")
    truncated = False
    if len(prompt) + len(response) > seq_len:
        truncated = True
        keep = max(1, seq_len - len(response))
        prompt = prompt[-keep:]
    tokens = prompt + response + [eos_id]
    if len(tokens) > seq_len + 1:
        tokens = tokens[: seq_len + 1]
    return np.asarray(tokens, dtype=np.int64), len(prompt), truncated


def pack_best_fit(lengths: Sequence[int], seq_len: int, seed: int = 0) -> list[list[int]]:
    """Sample indices per sequence: each sample, in a seeded random order, goes into the fullest
    sequence it still fits in (best fit), or starts a new one."""
    if any(n < 1 or n > seq_len for n in lengths):
        raise UsageError(f"sample lengths must be in [1, {seq_len}]")
    order = np.random.default_rng([seed, 7]).permutation(len(lengths))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin index) of sequences with room
    for i in order:
        n = int(lengths[i])
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = seq_len, len(bins)
            bins.append([])
        bins[b].append(int(i))
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


def build_sequence(samples: Sequence[tuple[np.ndarray, int]], seq_len: int, pad_id: int) -> dict:
    """One packed sequence from ``(tokens, n_prompt)`` samples (see the module doc)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    doc_ids = np.full(seq_len, PAD_DOC, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    lengths, pos = [], 0
    for k, (tokens, n_prompt) in enumerate(samples):
        n = len(tokens) - 1
        if pos + n > seq_len:
            raise ValueError(f"samples overflow a sequence of {seq_len}")
        input_ids[pos : pos + n] = tokens[:-1]
        target = tokens[1:].copy()
        target[: max(0, n_prompt - 1)] = IGNORE_INDEX  # label j is token j+1: a prompt token for j+1 < n_prompt
        labels[pos : pos + n] = target
        doc_ids[pos : pos + n] = k
        position_ids[pos : pos + n] = np.arange(n)
        lengths.append(n)
        pos += n
    position_ids[pos:] = np.arange(seq_len - pos)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "doc_ids": doc_ids,
        "position_ids": position_ids,
        "sample_lengths": lengths,
    }


class PackedSFTDataset:
    """Tokenized samples packed into ``seq_len`` sequences; ``ds[i]`` is a dict (numpy arrays)."""

    def __init__(
        self, samples: Sequence[tuple[np.ndarray, int]], seq_len: int, pad_id: int, seed: int = 0, name: str = "train"
    ):
        self.samples, self.seq_len, self.pad_id, self.name = list(samples), int(seq_len), pad_id, name
        self.bins = pack_best_fit([len(t) - 1 for t, _ in self.samples], self.seq_len, seed)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> dict:
        return build_sequence([self.samples[j] for j in self.bins[range(len(self.bins))[i]]], self.seq_len, self.pad_id)

    @property
    def sample_lengths(self) -> list[list[int]]:
        return [[len(self.samples[j][0]) - 1 for j in b] for b in self.bins]

    def stats(self) -> dict:
        lens = [n for b in self.sample_lengths for n in b]
        positions = len(self.bins) * self.seq_len
        return {
            "samples": len(lens),
            "sequences": len(self.bins),
            "fill": sum(lens) / positions if positions else 0.0,
            "attention_seq_len": sum(n * n for n in lens) / positions if positions else 0.0,
            "loss_tokens": sum(len(t) - p for t, p in self.samples),
        }

    def describe(self) -> str:
        s = self.stats()
        if not s["sequences"]:
            return f"{self.name}: empty"
        return (
            f"{self.name}: {s['samples']:,} samples packed into {s['sequences']:,} sequences of "
            f"{self.seq_len} ({s['samples'] / s['sequences']:.1f} per sequence, {s['fill']:.1%} filled, "
            f"attention as if seq {s['attention_seq_len']:.0f}, {s['loss_tokens']:,} loss tokens)"
        )


class MockSFTDataset:
    """Endless (or ``num_samples``-long) seeded packed mock sequences (see the module doc)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        seed: int = 0,
        stream: int = 0,
        num_samples: int | None = None,
        prompt_len: tuple[int, int] = MOCK_PROMPT_LEN,
        response_len: tuple[int, int] = MOCK_RESPONSE_LEN,
    ):
        if vocab_size < 3:
            raise UsageError(f"mock SFT data needs vocab_size >= 3, got {vocab_size}")
        if seq_len < 2:
            raise UsageError(f"mock SFT data needs seq_len >= 2, got {seq_len}")
        for what, (lo, hi) in (("prompt_len", prompt_len), ("response_len", response_len)):
            if not 1 <= lo <= hi:
                raise UsageError(f"mock SFT {what} must be 1 <= min <= max, got {(lo, hi)}")
        self.vocab_size, self.seq_len, self.seed, self.stream = int(vocab_size), int(seq_len), int(seed), int(stream)
        self.num_samples, self.prompt_len, self.response_len = num_samples, tuple(prompt_len), tuple(response_len)
        self.eos_id = self.vocab_size - 1
        self.walk = RandomWalk(self.vocab_size - 1, self.seed)  # every token but EOS
        self.offsets = self.walk.offsets

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError("an endless MockSFTDataset has no len(); use num_samples")
        return self.num_samples

    def samples(self, index: int) -> list[tuple[np.ndarray, int]]:
        """The ``(tokens, n_prompt)`` samples packed into sequence ``index``."""
        rng = np.random.default_rng([self.seed, self.stream, int(index)])
        out, room = [], self.seq_len
        while room >= 2:
            lp = int(rng.integers(self.prompt_len[0], self.prompt_len[1] + 1))
            lr = int(rng.integers(self.response_len[0], self.response_len[1] + 1))
            if lp + lr > room:  # shorten the last sample to fill the sequence
                lr = min(lr, room - 1)
                lp = room - lr
            start = int(rng.integers(0, self.vocab_size - 1))
            walk = self.walk.path(start, self.walk.steps(rng, lp + lr - 1))
            tokens = np.concatenate([walk, [self.eos_id]]).astype(np.int64)
            out.append((tokens, lp))
            room -= lp + lr
        return out

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if index < 0 or (self.num_samples is not None and index >= self.num_samples):
            raise IndexError(f"mock SFT sequence {index} out of range")
        return build_sequence(self.samples(index), self.seq_len, self.eos_id)

    def describe(self) -> str:
        size = "endless" if self.num_samples is None else f"{self.num_samples} sequences"
        return (
            f"mock SFT: random-walk prompt/response samples (prompt {self.prompt_len[0]}-{self.prompt_len[1]}, "
            f"response {self.response_len[0]}-{self.response_len[1]} tokens), vocab {self.vocab_size} "
            f"(EOS {self.eos_id}), seq_len {self.seq_len}, seed {self.seed}, stream {self.stream} ({size})"
        )


# --------------------------------------------------------------------------- batches


def collate_sft(items: list[dict]) -> Batch:
    """Stack packed sequences into ``[mbs, seq_len]`` int64 tensors (+ ``sample_lengths`` lists)."""
    return Batch(
        **{
            k: torch.from_numpy(np.stack([it[k] for it in items]))
            for k in ("input_ids", "labels", "doc_ids", "position_ids")
        },
        sample_lengths=[list(it["sample_lengths"]) for it in items],
    )


@dataclass
class SFTData(Splits):
    """Train / validation packed SFT sequences and their story."""

    collate = staticmethod(collate_sft)

    train: PackedSFTDataset | MockSFTDataset
    valid: PackedSFTDataset | MockSFTDataset

    @property
    def is_mock(self) -> bool:
        return isinstance(self.train, MockSFTDataset)

    def flops_sample_lengths(self, max_sequences: int = 256) -> list[list[int]]:
        """Sample lengths of the training sequences (all of them; the first ``max_sequences`` for
        mock data), for a per-run FLOP count as NeMo computes it over its packed dataset
        (``lpbench.metrics.flops.packed_flops_per_token``). Per step, use a batch's ``sample_lengths``."""
        if self.is_mock:
            return [self.train[i]["sample_lengths"] for i in range(max_sequences)]
        return self.train.sample_lengths


def build_sft_dataset(
    spec: str,
    tokenizer: "Tokenizer | str | os.PathLike | None" = None,
    *,
    seq_len: int,
    seed: int = 0,
    vocab_size: int | None = None,
    prompt_key: str | None = None,
    response_key: str | None = None,
    squad_prompt: str = SQUAD_PROMPT,
    val_fraction: float = 0.01,
    val_samples: int | None = None,
    eos_token: str | None = None,
    prompt_len: tuple[int, int] = MOCK_PROMPT_LEN,
    response_len: tuple[int, int] = MOCK_RESPONSE_LEN,
) -> SFTData:
    """Packed SFT data from ``spec``: ``"mock"`` or a JSONL/parquet file or directory.

    ``tokenizer``: an object, a tokenizer.json path (or a checkpoint folder holding one) or
    ``"byte"``/None (byte-level). Mock data needs ``vocab_size`` (the model's). Validation holds
    out ``val_samples`` samples (default ``ceil(val_fraction * samples)``, 0 disables) chosen at
    random (seeded) before packing, so no sample is in both splits.
    """
    if seq_len < 2:
        raise UsageError(f"seq_len must be >= 2 for SFT, got {seq_len}")
    if not 0 <= val_fraction < 1:
        raise UsageError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if spec == "mock":
        if not vocab_size:
            raise UsageError("mock SFT data needs a vocab_size (the model's)")
        n_val = MOCK_VALID_SEQUENCES if val_samples is None else val_samples
        kw = dict(prompt_len=prompt_len, response_len=response_len)
        train = MockSFTDataset(vocab_size, seq_len, seed, stream=0, **kw)
        return SFTData(
            train=train,
            valid=MockSFTDataset(vocab_size, seq_len, seed, stream=1, num_samples=n_val, **kw),
            seq_len=seq_len,
            vocab_size=vocab_size,
            eos_id=train.eos_id,
            seed=seed,
            source=f"mock SFT (random-walk prompt/response samples, vocab {vocab_size}, seed {seed})",
        )
    if not os.path.exists(spec):
        raise UsageError(f"--data {spec}: not 'mock' or an existing JSONL/parquet file or directory")
    tok = get_tokenizer(tokenizer, eos_token) if tokenizer is not None else ByteTokenizer()
    stats: dict = {}
    samples, truncated = [], 0
    for p, r in tokenize_pairs(read_sft_pairs(spec, prompt_key, response_key, squad_prompt, stats), tok):
        if not r:
            stats["skipped"] += 1
            continue
        tokens, n_prompt, cut = sample_tokens(p, r, tok.eos_id, seq_len)
        samples.append((tokens, n_prompt))
        truncated += cut
    if not samples:
        raise UsageError(f"{spec}: no SFT samples with a response found")
    n_val = val_samples if val_samples is not None else (math.ceil(val_fraction * len(samples)) if val_fraction else 0)
    if n_val < 0 or n_val >= len(samples):
        raise UsageError(f"cannot hold out {n_val} of {len(samples)} SFT samples for validation")
    order = np.random.default_rng([seed, 3]).permutation(len(samples))
    valid_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
    vocab = vocab_size or tok.vocab_size
    top = max(int(t.max()) for t, _ in samples)
    if top >= vocab:
        raise UsageError(f"{spec}: token id {top} >= vocab size {vocab}")
    notes = [
        f"sft: {len(samples):,} samples ({truncated} truncated to {seq_len} positions, "
        f"{stats.get('skipped', 0)} skipped without a response), prompt tokens masked from the loss"
    ]
    return SFTData(
        train=PackedSFTDataset([samples[i] for i in train_idx], seq_len, tok.eos_id, seed, "train"),
        valid=PackedSFTDataset([samples[i] for i in valid_idx], seq_len, tok.eos_id, seed, "validation"),
        seq_len=seq_len,
        vocab_size=vocab,
        eos_id=tok.eos_id,
        seed=seed,
        source=sources.describe_source(spec),
        tokenizer=tok,
        notes=notes,
    )

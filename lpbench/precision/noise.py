"""Stochastic rounding's random draws, keyed by what is rounded, not by which process rounds it.

Inside a training step (:func:`drawing`: the run's seed, the optimizer step and the micro-batch, entered by the
training loop around each micro-batch and, under pipeline parallelism, around each stage's forward and backward
of one), the uniforms that round an operand of a quantized module are a function of (that key, the module's
index in the whole model (``noise_index``, numbered once by the converter on the whole model: :func:`number`),
the operand's role and GEMM) and each element's position in the whole, unsplit operand. What follows:

* pipeline parallelism: a stage draws for its blocks what one process draws for them, whichever rank holds the
  stage and in whatever order the schedule runs the micro-batches;
* tensor and context parallelism: each rank keeps its part of the whole operand's draw (the same key on every
  rank of the group);
* data parallelism (DDP, FSDP): a rank's micro-batch j is keyed j × DP + its data-parallel rank, the index one
  process gives the same samples (:mod:`lpbench.data.sampler`'s order), so each micro-batch's gradients are
  rounded with the uniforms one process uses for them;
* activation recomputation and a zero-bubble schedule's separate weight-gradient pass draw again what the first
  pass drew.

Not covered: expert parallelism, whose experts quantize tokens gathered from several ranks' micro-batches (an
operand one process never forms), and the torchao backend, whose linears draw from torch's generator.
Outside a step, or for a module without an index (built by hand rather than by the converter), the draws come
from torch's global generator, as ``torch.rand``'s.

Counter-based: each element's uniform is two rounds of a 32-bit integer hash (Chris Wellons' ``lowbias32``
constants) of its index and the key, in int64 tensor ops; 24 of the bits make an FP32 uniform in [0, 1). Hand
written because torch's generators take a seed as a Python int: deriving one from the module's index inside a
compiled block would specialise the graph on every block (or read a device tensor back). Here the key lives in
tensors (the context on the device, the module's buffer), so one compiled graph serves every block and
micro-batch, and the draws are the same bits on every device, eager or compiled. The fused CUDA quantizer
(``kernels/nvfp4.py``) takes the key as its Philox seed (:func:`seed31`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

M32 = 0xFFFFFFFF
SALTS = {"dgrad": 1, "wgrad": 2, "fused": 3, "fprop": 4}  # the GEMM an operand feeds ("fused": the quantizer of both)

_key: int | None = None  # the hash of (seed, step, micro-batch) of the draws now, or None outside a step
_active = False  # whether ``_key`` is set: what compiled code reads (a guard on a bool, not on every step's key)
_context: torch.Tensor | None = None  # ``_key`` as an int64 scalar on the training device


def hash32(x):
    """A bijection of 32-bit values (``lowbias32``), of an int or of an int64 tensor (each product stays below
    2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


@contextmanager
def drawing(seed: int, step: int, micro_batch: int, device: torch.device):
    """Key the draws inside the block by (``seed``, ``step``, ``micro_batch``); the previous key after it."""
    global _key, _context
    outer = _key
    if _context is None or _context.device != device:
        _context, outer = torch.zeros((), dtype=torch.int64, device=device), None
    _set(hash32(hash32(hash32(seed & M32) ^ (step & M32)) ^ (micro_batch & M32)))
    try:
        yield
    finally:
        _set(outer)


def _set(key: int | None) -> None:
    global _key, _active
    if key is not None and key != _key:
        _context.fill_(key)  # a kernel on the device's stream: no host sync
    _key, _active = key, key is not None


def key(module: nn.Module, role: str, gemm: str, device: torch.device) -> torch.Tensor | None:
    """The key of ``module``'s draws for its operand ``role`` of ``gemm`` now (an int64 scalar tensor), or None: no
    draw context on ``device``, or a module without an index."""
    index = getattr(module, "noise_index", None)
    if not _active or index is None or _context.device != device:
        return None
    return hash32(hash32(_context ^ index) ^ (SALTS[gemm] << 2 | ("input", "weight", "grad").index(role)))


def uniform(key: torch.Tensor | None, shape, device: torch.device) -> torch.Tensor:
    """FP32 uniforms in [0, 1) of ``shape`` drawn by ``key`` (element i of the flattened shape: a hash of i and
    the key); from torch's global generator without a key."""
    if key is None:
        return torch.rand(shape, device=device)
    i = torch.arange(torch.Size(shape).numel(), dtype=torch.int64, device=device).reshape(shape)
    h = hash32(hash32((i & M32) ^ key) ^ (i >> 32) ^ hash32(key ^ 0x68E31DA4))
    return (h >> 8).float() * 2.0**-24


def seed31(key: torch.Tensor | None) -> torch.Tensor | None:
    """The fused NVFP4 quantizer's Philox seed (int64, one element, below 2**31 − 1) from ``key``; None without one."""
    return None if key is None else (key % 0x7FFFFFFF).reshape(1)


def number(model: nn.Module, kinds: tuple[type, ...]) -> int:
    """Give every module of ``kinds`` in ``model`` (the whole model, before any split) its index, in module order,
    as the non-persistent int64 buffer ``noise_index`` (on the model's device); returns the count."""
    device = next(model.parameters()).device
    n = 0
    for m in model.modules():
        if isinstance(m, kinds):
            m._noise_index = n
            m.register_buffer("noise_index", torch.tensor(n, dtype=torch.int64, device=device), persistent=False)
            n += 1
    return n


@torch.no_grad()
def restore_index(module: nn.Module) -> None:
    """Write ``module``'s index into its buffer again (``to_empty`` leaves buffers undefined)."""
    if hasattr(module, "_noise_index"):
        module.noise_index.fill_(module._noise_index)

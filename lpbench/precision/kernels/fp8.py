"""Fused FP8 tensorwise quantization for CUDA (Triton), bit-exact with ``quantize_fp8``.

Hand-written because the GEMMs of an FP8 linear need each operand twice (row-major for one
GEMM, transposed for another) and the scale must match the reference bit for bit; the
bandwidth floor is one read for the amax plus one read that writes both copies. Kernels:

* ``absmax``: per-tensor max |x| (persistent grid, one atomic per program);
* ``cast_transpose``: encode scale = FP8_MAX / amax computed in-kernel with IEEE division
  (or taken from a delayed-scaling amax history), x × scale saturated and rounded to
  nearest even into FP8 codes in one pass over x; for delayed scaling the same pass records
  the amax, so the history update needs no extra read of x. The transposed copy is the
  transpose of those codes (1 byte read + 1 written per element). Writing it from the same
  pass (``tl.trans`` of the FP8 tile, or a store through transposed addresses) left wrong
  bytes with Triton 3.6 on an H100 (benchmarks/RESULTS.md), so it is not done there.

Both are registered as torch custom ops, so torch.compile keeps them as opaque nodes
instead of breaking the graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP32_MAX = 3.4028234663852886e38
_FP8 = {torch.float8_e4m3fn: (448.0, tl.float8e4nv), torch.float8_e5m2: (57344.0, tl.float8e5)}


@triton.jit
def _absmax_kernel(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, per_prog, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + idx, mask=(idx < n) & (off + tl.arange(0, BLOCK) < per_prog), other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.atomic_max(out_ptr, tl.max(acc, axis=0))


@triton.jit
def _encode_scale(amax, FP8_MAX: tl.constexpr):
    # IEEE division (div_rn): Triton's "/" on FP32 is approximate, the reference is exact.
    s = tl.where(amax > 0, tl.math.div_rn(tl.zeros_like(amax) + FP8_MAX, amax), 1.0)
    return tl.minimum(s, 3.4028234663852886e38)


@triton.jit
def _cast_kernel(x_ptr, amax_ptr, hist_ptr, amax_out_ptr, q_ptr, dec_ptr,
                           M, N, stride_xm, HIST_LEN,
                           FP8_MAX: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           DELAYED: tl.constexpr, RECORD_AMAX: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DELAYED:  # scale from max(history); while it is all zeros, the given amax stands in
        h = tl.load(hist_ptr + tl.arange(0, 1024), mask=tl.arange(0, 1024) < HIST_LEN, other=0.0)
        ref = tl.max(h, axis=0)
        ref = tl.where(ref > 0, ref, tl.load(amax_ptr))
    else:
        ref = tl.load(amax_ptr)
    scale = _encode_scale(ref, FP8_MAX)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(dec_ptr, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if RECORD_AMAX:
        tl.atomic_max(amax_out_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    y = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX).to(OUT)
    tl.store(q_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], y, mask=mask)


@triton.jit
def _update_history_kernel(hist_ptr, amax_ptr, HIST_LEN, BLOCK: tl.constexpr):
    """Shift the history by one and record amax at index 0 (non-finite amax recorded as 0)."""
    idx = tl.arange(0, BLOCK)
    h = tl.load(hist_ptr + idx, mask=idx < HIST_LEN - 1, other=0.0)
    tl.debug_barrier()
    tl.store(hist_ptr + idx + 1, h, mask=idx < HIST_LEN - 1)
    a = tl.load(amax_ptr)
    finite = (a == a) & (a < float("inf"))
    tl.store(hist_ptr, tl.where(finite, a, 0.0))


def _check(x: torch.Tensor, fp8_dtype: torch.dtype) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)}")
    if fp8_dtype not in _FP8:
        raise ValueError(f"unsupported FP8 dtype {fp8_dtype}")


@torch.library.custom_op("lpbench::absmax", mutates_args=())
def absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an FP32 scalar tensor."""
    x = x.contiguous()
    out = torch.zeros((), device=x.device, dtype=torch.float32)
    n = x.numel()
    block = 4096
    programs = max(1, min(triton.cdiv(n, block), torch.cuda.get_device_properties(x.device).multi_processor_count * 8))
    per_prog = triton.cdiv(triton.cdiv(n, programs), block) * block
    _absmax_kernel[(triton.cdiv(n, per_prog),)](x, out, n, per_prog, BLOCK=block, num_warps=8)
    return out


@absmax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("lpbench::cast_transpose", mutates_args=())
def cast_transpose(x: torch.Tensor, amax: torch.Tensor, history: torch.Tensor | None, fp8_dtype: torch.dtype,
                   write_t: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x quantized tensorwise: (codes [M, N], transposed codes [N, M], FP32 decode scale, amax of x).

    Encode scale = FP8_MAX / amax (current scaling), or FP8_MAX / max(history) with a
    delayed-scaling history (then ``amax`` is used only while the history is all zeros, and
    the returned amax of x, measured in the same pass, is what the history records next).
    The transposed codes come back empty unless ``write_t``; the returned amax is zero unless a
    history is given.
    """
    _check(x, fp8_dtype)
    M, N = x.shape
    fp8_max, out = _FP8[fp8_dtype]
    if history is not None and history.numel() > 1024:
        raise ValueError("amax histories longer than 1024 are not supported by the fused kernel")
    q = torch.empty((M, N), device=x.device, dtype=fp8_dtype)
    dec = torch.empty((), device=x.device, dtype=torch.float32)
    amax_out = torch.zeros((), device=x.device, dtype=torch.float32)
    bm, bn = 64, 128
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    delayed = history is not None
    _cast_kernel[grid](x, amax, history if delayed else amax, amax_out, q, dec,
                       M, N, x.stride(0), history.numel() if delayed else 0,
                       FP8_MAX=fp8_max, OUT=out, BM=bm, BN=bn, DELAYED=delayed, RECORD_AMAX=delayed, num_warps=8)
    qt = q.t().contiguous() if write_t else q.new_empty((0,))
    return q, qt, dec, amax_out


@cast_transpose.register_fake
def _(x, amax, history, fp8_dtype, write_t):
    M, N = x.shape
    return (x.new_empty((M, N), dtype=fp8_dtype),
            x.new_empty((N, M) if write_t else (0,), dtype=fp8_dtype), x.new_empty((), dtype=torch.float32),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("lpbench::update_amax_history", mutates_args=("history",))
def update_amax_history(history: torch.Tensor, amax: torch.Tensor) -> None:
    """In place: shift ``history`` by one, record ``amax`` at index 0 (as the reference does)."""
    n = history.numel()
    _update_history_kernel[(1,)](history, amax, n, BLOCK=triton.next_power_of_2(max(n, 2)), num_warps=4)


@update_amax_history.register_fake
def _(history, amax):
    return None

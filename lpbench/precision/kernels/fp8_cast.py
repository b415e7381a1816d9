"""FP8 casts in one pass: codes, transposed codes and the amax, and delayed scaling's scale and history.

Hand-written (Triton) because torch.compile cannot do it: the kernel that writes the
transposed copy is a tiled element-wise kernel, and inductor will not reduce a whole-tensor
amax inside it, so the compiled cast reads the operand twice (once to cast, once for the amax
the next step's scale needs). Here each tile is read once, cast, stored row-major and
transposed, and its amax folded into one FP32 by an integer atomic max on the bit patterns (for
non-negative floats the integer order is the float order, and NaN sorts above +inf, so a NaN
anywhere gives NaN, as ``abs().amax()`` does). Tensorwise scaling passes the scale of the amax
its producer reduced; delayed scaling takes three launches per operand and no host sync:

1. :func:`history_scale`: the encode scale from the amax history; while the history is empty
   (the first step) the current amax stands in (``delayed_encode_scale``), so this launch reads
   the operand then, and never after (its loads are masked off on the device);
2. :func:`delayed_cast`: the cast above, with that scale;
3. :func:`record_amax`: the decode scale, and the amax shifted into the history.

Before, the scale and decode ops were small compiled kernels of their own and the history update
a custom op that Python dispatched on every call. Scales divide in FP64 and round once, as the
reference does (Triton's FP32 ``/`` is approximate). Used for 16-bit and FP32 CUDA operands when
Triton is present; everything else takes the compiler-fused ops of ``fp8_linear.cast``, with
which this is bit-exact (``gpu`` tests). The kernels are ``triton_op``s: torch.compile launches
them from its generated code, without the Python dispatch of an opaque custom op on every call.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton
from lpbench.precision.formats import FloatFormat

TILE = 128  # rows and columns per program of the cast (benchmarks/fp8_cast.py: 128x8 the fastest on an H200)
WARPS = 8  # warps per program
AMAX_BLOCK = 8192  # elements per program of the amax


def _launch(launcher, x, q, qt, encode_scale, fp8_max, write_t, tile=None, warps=None, first=None,
            down=1.0) -> torch.Tensor:
    """Run the cast of ``x`` into ``q`` (and ``qt``); the amax of x (FP32). With ``first``, an encode
    scale of NaN means "none yet": the kernel takes ``fp8_encode_scale(first) * down`` instead."""
    m, n = x.shape
    tile, warps = tile or TILE, warps or WARPS
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, tile))
    launcher(_cast_kernel)[grid](x, q, qt, encode_scale, encode_scale if first is None else first, amax_bits, m, n,
                                 FMAX=fp8_max, DOWN=down, FALLBACK=first is not None, WRITE_T=write_t, BM=tile,
                                 BN=tile, num_warps=warps)
    return amax_bits.view(torch.float32)


@kernel_op("lpbench::fp8_cast_transpose", ())
def _cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                    write_t: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if write_t else (0,), dtype=dtype, device=x.device)
    return q, qt, _launch(wrap_triton, x, q, qt, encode_scale, fp8_max, write_t)


@kernel_op("lpbench::fp8_cast_transpose_delayed", ())
def _cast_transpose_delayed(x: torch.Tensor, encode_scale: torch.Tensor, first: torch.Tensor, fp8_max: float,
                            down: float, dtype: torch.dtype, write_t: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if write_t else (0,), dtype=dtype, device=x.device)
    return q, qt, _launch(wrap_triton, x, q, qt, encode_scale, fp8_max, write_t, first=first, down=down)


@kernel_op("lpbench::amax_unless", ())
def _amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    wrap_triton(_amax_kernel)[(triton.cdiv(numel, AMAX_BLOCK),)](x, skip, amax_bits, numel, BLOCK=AMAX_BLOCK,
                                                                 num_warps=8)
    return amax_bits.view(torch.float32)


@kernel_op("lpbench::fp8_history_scale", ())
def _history_scale(x: torch.Tensor, history: torch.Tensor, fp8_max: float,
                   down: float) -> tuple[torch.Tensor, torch.Tensor]:
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    enc = torch.empty((), dtype=torch.float32, device=x.device)
    numel, length = x.numel(), history.numel()
    wrap_triton(_history_scale_kernel)[(triton.cdiv(numel, AMAX_BLOCK),)](
        x, history, amax_bits, enc, numel, length, FMAX=fp8_max, DOWN=down, BLOCK=AMAX_BLOCK,
        HBLOCK=triton.next_power_of_2(max(length, 2)), num_warps=8)
    return amax_bits.view(torch.float32), enc


@kernel_op("lpbench::fp8_record_amax", ("history",))
def _record_amax(history: torch.Tensor, encode_scale: torch.Tensor, first: torch.Tensor, amax: torch.Tensor,
                 fp8_max: float, down: float, record: bool) -> torch.Tensor:
    dec = torch.empty((), dtype=torch.float32, device=history.device)
    length = history.numel()
    wrap_triton(_record_kernel)[(1,)](history, encode_scale, first, amax, dec, length, FMAX=fp8_max, DOWN=down,
                                      RECORD=record, HBLOCK=triton.next_power_of_2(max(length, 2)), num_warps=4)
    return dec


def cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, write_t: bool):
    """(codes, transposed codes or empty, amax of x): saturating round-to-nearest-even cast of
    x × encode_scale, in one read of x (CUDA; see :func:`lpbench.precision.capability.fp8_cast_kernel`)."""
    return _cast_transpose(x.contiguous(), encode_scale.float().reshape(()), fmt.max, fmt.dtype, write_t)


def cast_transpose_into(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, q: torch.Tensor,
                        qt: torch.Tensor, tile: int | None = None, warps: int | None = None, first=None,
                        margin: int = 0) -> torch.Tensor:
    """:func:`cast_transpose` (with ``first``: :func:`delayed_cast`'s) into given ``q`` [M, N] and ``qt`` [N, M]
    (eager only: a plain kernel launch, for buffers that outlive the call); returns the amax of x.
    ``tile``/``warps``: the launch shape (``benchmarks/fp8_cast.py`` times the choices)."""
    return _launch(lambda k: k, x.contiguous(), q, qt, encode_scale.float().reshape(()), fmt.max, True, tile, warps,
                   first, 2.0 ** -margin)


def amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """amax of |x| (FP32), or 0 without reading x where the boolean scalar ``skip`` is true."""
    return _amax_unless(x.contiguous(), skip.reshape(()).to(torch.int8))


def history_scale(x: torch.Tensor, history: torch.Tensor, fmt: FloatFormat, margin: int):
    """Delayed scaling's encode scale for ``x``, in one launch: (first, enc), where ``enc`` is
    ``delayed_encode_scale(history, ·)`` if the history holds an amax (x not read, ``first`` 0), else NaN
    and ``first`` the amax of x, from which :func:`delayed_cast` and :func:`record_amax` take the scale."""
    return _history_scale(x.contiguous(), history, fmt.max, 2.0 ** -margin)


def delayed_cast(x: torch.Tensor, enc: torch.Tensor, first: torch.Tensor, fmt: FloatFormat, margin: int,
                 write_t: bool):
    """:func:`cast_transpose` with :func:`history_scale`'s (first, enc): (codes, transposed codes, amax)."""
    return _cast_transpose_delayed(x.contiguous(), enc, first, fmt.max, 2.0 ** -margin, fmt.dtype, write_t)


def record_amax(history: torch.Tensor, enc: torch.Tensor, first: torch.Tensor, amax: torch.Tensor,
                fmt: FloatFormat, margin: int) -> torch.Tensor:
    """The decode scale of a :func:`delayed_cast` (NaN if its ``amax`` is not finite), and ``amax``
    recorded in ``history`` (in place, as ``quantize.update_amax_history``), in one launch."""
    return _record_amax(history, enc, first, amax, fmt.max, 2.0 ** -margin, True)


def tensorwise_cast_into(x: torch.Tensor, fmt: FloatFormat, q: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """Tensorwise scaling of ``x`` into ``q`` and ``qt`` in three launches (amax, cast, decode scale; eager, for
    the weight cache: the compiled path reduces the amax inside the operand's producer instead); the decode scale."""
    none = torch.zeros(1, device=x.device)  # an empty history: the current amax gives the scale
    first, enc = history_scale(x, none, fmt, 0)
    amax = cast_transpose_into(x, enc, fmt, q, qt, first=first)
    return _record_amax(none, enc, first, amax, fmt.max, 1.0, False)


if triton is not None:

    @triton.jit
    def _bits_of_abs(x):
        """|x| as int32 bits: ordered like the floats, NaN above +inf."""
        return tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)

    @triton.jit
    def _encode(ref, FMAX: tl.constexpr, DOWN: tl.constexpr):
        """``fp8_encode_scale(ref) * DOWN`` (DOWN = 2**-margin): FMAX / ref divided in FP64 and rounded once,
        as the reference (``quantize._div``) does; 1 where ref is not positive; capped at the FP32 max."""
        s = tl.where(ref > 0, _div(FMAX, ref), 1.0)
        return tl.minimum(s, 3.4028234663852886e38) * DOWN

    @triton.jit
    def _div(num: tl.constexpr, den):
        """FP32 num / den correctly rounded: an IEEE FP64 division (Triton's FP32 ``/`` is approximate)."""
        return (tl.full(den.shape, num, tl.float64) / den.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _cast_kernel(x_ptr, q_ptr, qt_ptr, enc_ptr, first_ptr, amax_ptr, M, N, FMAX: tl.constexpr,
                     DOWN: tl.constexpr, FALLBACK: tl.constexpr, WRITE_T: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        enc = tl.load(enc_ptr)
        if FALLBACK:  # delayed scaling before any history: the scale of the current amax
            enc = tl.where(enc != enc, _encode(tl.load(first_ptr), FMAX, DOWN), enc)
        y = x * enc
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))  # saturate; NaN stays NaN
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(_bits_of_abs(x), axis=1), axis=0))

    @triton.jit
    def _history_scale_kernel(x_ptr, hist_ptr, amax_ptr, enc_ptr, numel, HIST_LEN, FMAX: tl.constexpr,
                              DOWN: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        hidx = tl.arange(0, HBLOCK)
        hmax = tl.load(hist_ptr)  # the last record; the whole history in program 0, or where the record is 0
        if pid == 0:
            hmax = tl.max(tl.load(hist_ptr + hidx, mask=hidx < HIST_LEN, other=0.0), axis=0)
            tl.store(enc_ptr, tl.where(hmax > 0, _encode(hmax, FMAX, DOWN), float("nan")))
        if hmax <= 0:
            hmax = tl.max(tl.load(hist_ptr + hidx, mask=hidx < HIST_LEN, other=0.0), axis=0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < numel) & ((hmax > 0) == 0)  # x is read only while the history is empty
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.atomic_max(amax_ptr, tl.max(_bits_of_abs(x), axis=0))

    @triton.jit
    def _record_kernel(hist_ptr, enc_ptr, first_ptr, amax_ptr, dec_ptr, HIST_LEN, FMAX: tl.constexpr,
                       DOWN: tl.constexpr, RECORD: tl.constexpr, HBLOCK: tl.constexpr):
        enc = tl.load(enc_ptr)
        enc = tl.where(enc != enc, _encode(tl.load(first_ptr), FMAX, DOWN), enc)
        a = tl.load(amax_ptr)
        finite = (a == a) & (a < float("inf"))
        tl.store(dec_ptr, tl.where(finite, _div(1.0, enc), float("nan")))
        if RECORD:  # shift the history by one, record the amax (non-finite as 0)
            idx = tl.arange(0, HBLOCK)
            h = tl.load(hist_ptr + idx, mask=idx < HIST_LEN - 1, other=0.0)
            tl.debug_barrier()
            tl.store(hist_ptr + idx + 1, h, mask=idx < HIST_LEN - 1)
            tl.store(hist_ptr, tl.where(finite, a, 0.0))

    @triton.jit
    def _amax_kernel(x_ptr, skip_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < numel) & (tl.load(skip_ptr) == 0)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.atomic_max(amax_ptr, tl.max(_bits_of_abs(x), axis=0))

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
   (the first step) the current amax stands in (``delayed_encode_scale``): this launch then reads
   the operand (at most ``SCALE_PROGRAMS`` programs, each looping over its share) and the last
   program to finish turns the amax into the scale; with a history its loads are masked off;
2. :func:`cast_transpose`: the cast above, with that scale;
3. :func:`record_amax`: the decode scale, and the amax shifted into the history.

The cast never computes a scale itself: a cast kernel that resolved the first step's scale
(an FP64 division) took 221 registers a thread instead of 127 on an H200 (13 % occupancy) and
cast 16-bit operands ~1.75x slower than tensorwise scaling's copy of the same kernel (llama3-8b@16L:
22.6 against 13.0 ms per micro-batch); and the scale launch ran one program per 8,192 elements,
each with its own atomic, even when it read nothing (62 us for a gate_up gradient).
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
AMAX_BLOCK = 8192  # elements per program (per loop trip) of the amax
SCALE_PROGRAMS = 1024  # the most programs of the delayed scale launch (each loops over its share of x)


def _launch(launcher, x, q, qt, encode_scale, fp8_max, write_t, tile=None, warps=None) -> torch.Tensor:
    """Run the cast of ``x`` into ``q`` (and ``qt``); the amax of x (FP32)."""
    m, n = x.shape
    tile, warps = tile or TILE, warps or WARPS
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(m, tile), triton.cdiv(n, tile))
    launcher(_cast_kernel)[grid](x, q, qt, encode_scale, amax_bits, m, n, FMAX=fp8_max, WRITE_T=write_t, BM=tile,
                                 BN=tile, num_warps=warps)
    return amax_bits.view(torch.float32)


@kernel_op("lpbench::fp8_cast_transpose", ())
def _cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fp8_max: float, dtype: torch.dtype,
                    write_t: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if write_t else (0,), dtype=dtype, device=x.device)
    return q, qt, _launch(wrap_triton, x, q, qt, encode_scale, fp8_max, write_t)


@kernel_op("lpbench::amax_unless", ())
def _amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    wrap_triton(_amax_kernel)[(triton.cdiv(numel, AMAX_BLOCK),)](x, skip, amax_bits, numel, BLOCK=AMAX_BLOCK,
                                                                 num_warps=8)
    return amax_bits.view(torch.float32)


@kernel_op("lpbench::fp8_history_scale", ())
def _history_scale(x: torch.Tensor, history: torch.Tensor, fp8_max: float, down: float) -> torch.Tensor:
    scratch = torch.zeros(2, dtype=torch.int32, device=x.device)  # the amax's bits, the programs' ticket
    enc = torch.empty((), dtype=torch.float32, device=x.device)
    numel, length = x.numel(), history.numel()
    blocks = triton.cdiv(numel, AMAX_BLOCK)
    programs = min(blocks, SCALE_PROGRAMS)
    wrap_triton(_history_scale_kernel)[(programs,)](
        x, history, scratch, enc, numel, length, triton.cdiv(blocks, programs), FMAX=fp8_max, DOWN=down,
        BLOCK=AMAX_BLOCK, HBLOCK=triton.next_power_of_2(max(length, 2)), num_warps=8)
    return enc


@kernel_op("lpbench::fp8_record_amax", ("history",))
def _record_amax(history: torch.Tensor, encode_scale: torch.Tensor, amax: torch.Tensor, record: bool) -> torch.Tensor:
    dec = torch.empty((), dtype=torch.float32, device=history.device)
    length = history.numel()
    wrap_triton(_record_kernel)[(1,)](history, encode_scale, amax, dec, length, RECORD=record,
                                      HBLOCK=triton.next_power_of_2(max(length, 2)), num_warps=4)
    return dec


def cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, write_t: bool):
    """(codes, transposed codes or empty, amax of x): saturating round-to-nearest-even cast of
    x × encode_scale, in one read of x (CUDA; see :func:`lpbench.precision.capability.fp8_cast_kernel`)."""
    return _cast_transpose(x.contiguous(), encode_scale.float().reshape(()), fmt.max, fmt.dtype, write_t)


def cast_transpose_into(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, q: torch.Tensor,
                        qt: torch.Tensor, tile: int | None = None, warps: int | None = None) -> torch.Tensor:
    """:func:`cast_transpose` into given ``q`` [M, N] and ``qt`` [N, M] (eager only: a plain kernel launch, for
    buffers that outlive the call); returns the amax of x. ``tile``/``warps``: the launch shape
    (``benchmarks/fp8_cast.py`` times the choices)."""
    return _launch(lambda k: k, x.contiguous(), q, qt, encode_scale.float().reshape(()), fmt.max, True, tile, warps)


def amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """amax of |x| (FP32), or 0 without reading x where the boolean scalar ``skip`` is true."""
    return _amax_unless(x.contiguous(), skip.reshape(()).to(torch.int8))


def history_scale(x: torch.Tensor, history: torch.Tensor, fmt: FloatFormat, margin: int) -> torch.Tensor:
    """Delayed scaling's encode scale for ``x`` in one launch: ``delayed_encode_scale(history, amax of x)``,
    where x is read only while the history is empty (the current amax stands in)."""
    return _history_scale(x.contiguous(), history, fmt.max, 2.0 ** -margin)


def record_amax(history: torch.Tensor, enc: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The decode scale of a cast with encode scale ``enc`` (NaN if its ``amax`` is not finite), and ``amax``
    recorded in ``history`` (in place, as ``quantize.update_amax_history``), in one launch."""
    return _record_amax(history, enc, amax, True)


def tensorwise_cast_into(x: torch.Tensor, fmt: FloatFormat, q: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """Tensorwise scaling of ``x`` into ``q`` and ``qt`` in three launches (amax and scale, cast, decode scale;
    eager, for the weight cache: the compiled path reduces the amax inside the operand's producer instead); the
    decode scale."""
    none = torch.zeros(1, device=x.device)  # an empty history: the current amax gives the scale
    enc = history_scale(x, none, fmt, 0)
    return _record_amax(none, enc, cast_transpose_into(x, enc, fmt, q, qt), False)


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
    def _cast_kernel(x_ptr, q_ptr, qt_ptr, enc_ptr, amax_ptr, M, N, FMAX: tl.constexpr, WRITE_T: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * tl.load(enc_ptr)
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))  # saturate; NaN stays NaN
        q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(_bits_of_abs(x), axis=1), axis=0))

    @triton.jit
    def _history_scale_kernel(x_ptr, hist_ptr, scratch_ptr, enc_ptr, numel, HIST_LEN, TRIPS, FMAX: tl.constexpr,
                              DOWN: tl.constexpr, BLOCK: tl.constexpr, HBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        hidx = tl.arange(0, HBLOCK)
        hmax = tl.load(hist_ptr)  # the last record; the whole history in program 0, or where the record is 0
        if (pid == 0) | (hmax <= 0):
            hmax = tl.max(tl.load(hist_ptr + hidx, mask=hidx < HIST_LEN, other=0.0), axis=0)
        if hmax > 0:
            if pid == 0:
                tl.store(enc_ptr, _encode(hmax, FMAX, DOWN))
        else:  # an empty history: the amax of x, then the last program to finish takes its scale
            bits = tl.zeros((BLOCK,), dtype=tl.int32)
            for trip in range(0, TRIPS):  # program p reads blocks p, p + programs, ...
                offs = (pid + trip * tl.num_programs(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                bits = tl.maximum(bits, _bits_of_abs(tl.load(x_ptr + offs, mask=offs < numel, other=0.0)))
            tl.atomic_max(scratch_ptr, tl.max(bits, axis=0))
            if tl.atomic_add(scratch_ptr + 1, 1) == tl.num_programs(0) - 1:  # acq_rel: every program's max is in
                amax = tl.atomic_max(scratch_ptr, 0).to(tl.float32, bitcast=True)
                tl.store(enc_ptr, _encode(amax, FMAX, DOWN))

    @triton.jit
    def _record_kernel(hist_ptr, enc_ptr, amax_ptr, dec_ptr, HIST_LEN, RECORD: tl.constexpr, HBLOCK: tl.constexpr):
        a = tl.load(amax_ptr)
        finite = (a == a) & (a < float("inf"))
        tl.store(dec_ptr, tl.where(finite, _div(1.0, tl.load(enc_ptr)), float("nan")))
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

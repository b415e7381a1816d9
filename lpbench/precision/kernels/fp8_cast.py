"""FP8 casts in one pass: codes, transposed codes and the amax; delayed scaling's update; FP8 transposes.

Hand-written (Triton) because torch.compile cannot do it: the kernel that writes the
transposed copy is a tiled element-wise kernel, and inductor will not reduce a whole-tensor
amax inside it, so the compiled cast reads the operand twice. Here each tile is read once, cast,
stored row-major and transposed, and its amax folded into one FP32 by an integer atomic max on the
bit patterns (for non-negative floats the integer order is the float order, and NaN sorts above
+inf, so a NaN anywhere gives NaN, as ``abs().amax()`` does).

* tensorwise scaling: the scale of the amax (:func:`tensorwise_cast_into`: the scale launch, the
  cast, the decode scale), or of the amax its producer reduced (the compiled path; the cast then
  reduces no amax);
* delayed scaling (Transformer Engine's rule, ``quantize.delayed_update``): the cast reads the
  module's persistent scale buffer, so it needs nothing computed first; :func:`record_amax` then
  gives the decode scale of that cast and, in the same single-program launch, shifts the amax into
  the history and recomputes the scale for the next cast (two launches per operand, no host sync);
* :func:`transpose_codes`: the transposed copy of FP8 codes, one byte in and one out per element.
  On the compiled path the producer of a 16-bit operand (RMSNorm, SwiGLU, ...) writes the row-major
  codes itself (``fp8_linear``), and wgrad's transposed codes are made from those: exact (the same
  bytes), and half the traffic of transposing the 16-bit operand.

Scales divide in FP64 and round once, as the reference does (Triton's FP32 ``/`` is approximate),
in their own launch: no cast kernel computes a scale (it costs the cast occupancy). Used for 16-bit
and FP32 CUDA operands when Triton is present; everything else takes the compiler-fused ops of
``fp8_linear.cast``, with which this is bit-exact (``gpu`` tests). The kernels are ``triton_op``s:
torch.compile launches them from its generated code, without an opaque custom op's Python dispatch.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from lpbench.precision.capability import kernel_op, tl, triton  # None without Triton
from lpbench.precision.formats import FloatFormat

CAST_LAUNCH = (64, 128, 4)  # rows, columns and warps per program of the cast (benchmarks/fp8_cast.py)
AMAX_BLOCK = 8192  # elements per program (per loop trip) of the amax
SCALE_PROGRAMS = 1024  # the most programs of the tensorwise scale launch (each loops over its share of x)
TRANSPOSE_LAUNCH = (64, 256, 8)  # rows, columns and warps per program of the FP8 codes' transpose


def _launch(launcher, x, q, qt, encode_scale, fp8_max, write_t, amax=True, launch=None) -> torch.Tensor:
    """Run the cast of ``x`` into ``q`` (and ``qt``); the amax of x (FP32), or an empty tensor if not ``amax``
    (the kernel then skips its reduction: a fifth of its time at llama3-8b shapes on an H200)."""
    m, n = x.shape
    bm, bn, warps = launch or CAST_LAUNCH
    amax_bits = torch.zeros(() if amax else (0,), dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    launcher(_cast_kernel)[grid](
        x, q, qt, encode_scale, amax_bits, m, n, FMAX=fp8_max, WRITE_T=write_t, AMAX=amax, BM=bm, BN=bn, num_warps=warps
    )
    return amax_bits.view(torch.float32)


@kernel_op("lpbench::fp8_cast_transpose", ())
def _cast_transpose(
    x: torch.Tensor, encode_scale: torch.Tensor, fp8_max: float, dtype: torch.dtype, write_t: bool, amax: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if write_t else (0,), dtype=dtype, device=x.device)
    return q, qt, _launch(wrap_triton, x, q, qt, encode_scale, fp8_max, write_t, amax)


@kernel_op("lpbench::fp8_amax_scale", ())
def _amax_scale(x: torch.Tensor, fp8_max: float) -> torch.Tensor:
    scratch = torch.zeros(2, dtype=torch.int32, device=x.device)  # the amax's bits, the programs' ticket
    enc = torch.empty((), dtype=torch.float32, device=x.device)
    numel = x.numel()
    blocks = triton.cdiv(numel, AMAX_BLOCK)
    programs = min(blocks, SCALE_PROGRAMS)
    wrap_triton(_amax_scale_kernel)[(programs,)](
        x, scratch, enc, numel, triton.cdiv(blocks, programs), FMAX=fp8_max, BLOCK=AMAX_BLOCK, num_warps=8
    )
    return enc


@kernel_op("lpbench::fp8_record_amax", ("history", "scale"))
def _record_amax(
    history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    after: torch.Tensor,
    scaled_max: float,
    most_recent: bool,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    dec = torch.empty((), dtype=torch.float32, device=history.device)
    old = torch.empty((), dtype=torch.float32, device=history.device)
    length, n = history.numel(), amax.numel()
    ablock = min(triton.next_power_of_2(max(n, 2)), 4096)
    wrap_triton(_record_kernel)[(1,)](
        history,
        scale,
        amax,
        after,
        dec,
        old,
        length,
        n,
        SMAX=scaled_max,
        MOST_RECENT=most_recent,
        RECORD=record,
        HBLOCK=triton.next_power_of_2(max(length, 2)),
        ABLOCK=ablock,
        ATRIPS=triton.cdiv(n, ablock),
        num_warps=4,
    )
    return dec, old


def launch_transpose(launcher, q: torch.Tensor, qt: torch.Tensor, launch=None) -> None:
    """Write ``q.t()`` of FP8 codes [M, N] into ``qt`` [N, M]."""
    m, n = q.shape
    bm, bn, warps = launch or TRANSPOSE_LAUNCH
    src, dst = (q, qt) if q.is_cuda else (q.view(torch.uint8), qt.view(torch.uint8))  # the interpreter: bytes
    launcher(_transpose_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](src, dst, m, n, BM=bm, BN=bn, num_warps=warps)


@kernel_op("lpbench::fp8_transpose_codes", ())
def _transpose_codes(q: torch.Tensor) -> torch.Tensor:
    m, n = q.shape
    qt = torch.empty((n, m), dtype=q.dtype, device=q.device)
    launch_transpose(wrap_triton, q, qt)
    return qt


def cast_transpose(x: torch.Tensor, encode_scale: torch.Tensor, fmt: FloatFormat, write_t: bool, amax: bool = True):
    """(codes, transposed codes or empty, amax of x or empty if not ``amax``): saturating round-to-nearest-even
    cast of x × encode_scale, in one read of x (CUDA; see :func:`lpbench.precision.capability.fp8_cast_kernel`)."""
    return _cast_transpose(x.contiguous(), encode_scale.float().reshape(()), fmt.max, fmt.dtype, write_t, amax)


def cast_transpose_into(
    x: torch.Tensor,
    encode_scale: torch.Tensor,
    fmt: FloatFormat,
    q: torch.Tensor,
    qt: torch.Tensor,
    amax: bool = True,
    launch=None,
) -> torch.Tensor:
    """:func:`cast_transpose` into given ``q`` [M, N] and ``qt`` [N, M] (eager only: a plain kernel launch, for
    buffers that outlive the call); returns the amax of x (empty if not ``amax``). ``launch``: (rows, columns,
    warps) per program (``benchmarks/fp8_cast.py`` times the choices)."""
    return _launch(lambda k: k, x.contiguous(), q, qt, encode_scale.float().reshape(()), fmt.max, True, amax, launch)


def record_amax(
    history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    codes: torch.Tensor,
    scaled_max: float,
    algo: str = "max",
) -> torch.Tensor:
    """The decode scale of the cast that made ``codes`` with the encode scale ``scale`` (NaN if its ``amax`` is
    not finite); then, in the same launch and in place, ``amax`` recorded in ``history`` and ``scale`` updated
    for the next cast (``quantize.delayed_update``; ``scaled_max``: ``quantize.delayed_scaled_max``).
    ``amax``: the operand's amax, or partial amaxes (e.g. one per row) that this launch reduces.

    ``codes`` is passed to the kernel unread: it makes the update depend on the cast, so no compiler
    schedules the update (a write of ``scale``) before the kernel that casts with ``scale``."""
    return _record_amax(history, scale, amax.float().reshape(-1), codes, scaled_max, algo == "most_recent", True)[0]


def transpose_codes(q: torch.Tensor) -> torch.Tensor:
    """``q.t().contiguous()`` of FP8 codes [M, N] (CUDA; the same bytes, moved in tiles)."""
    return _transpose_codes(q.contiguous())


def tensorwise_cast_into(x: torch.Tensor, fmt: FloatFormat, q: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """Tensorwise scaling of ``x`` into ``q`` and ``qt`` in three launches (amax and scale, cast, decode scale;
    eager, for the weight cache: the compiled path reduces the amax inside the operand's producer instead); the
    decode scale."""
    enc = _amax_scale(x.contiguous(), fmt.max)
    amax = cast_transpose_into(x, enc, fmt, q, qt)
    return _record_amax(enc.new_zeros(1), enc, amax, q, fmt.max, False, False)[0]


if triton is not None:

    @triton.jit
    def _bits_of_abs(x):
        """|x| as int32 bits: ordered like the floats, NaN above +inf."""
        return tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)

    @triton.jit
    def _encode(ref, FMAX: tl.constexpr):
        """``fp8_encode_scale(ref)``: FMAX / ref divided in FP64 and rounded once, as the reference
        (``quantize._div``) does; 1 where ref is not positive; capped at the FP32 max."""
        s = tl.where(ref > 0, _div(FMAX, ref), 1.0)
        return tl.minimum(s, 3.4028234663852886e38)

    @triton.jit
    def _saturate(y, FMAX: tl.constexpr):
        """y clamped to ±FMAX, NaN kept (the reference's saturating cast, before rounding to FP8)."""
        return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))

    @triton.jit
    def _div(num: tl.constexpr, den):
        """FP32 num / den correctly rounded: an IEEE FP64 division (Triton's FP32 ``/`` is approximate)."""
        return (tl.full(den.shape, num, tl.float64) / den.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _cast_kernel(
        x_ptr,
        q_ptr,
        qt_ptr,
        enc_ptr,
        amax_ptr,
        M,
        N,
        FMAX: tl.constexpr,
        WRITE_T: tl.constexpr,
        AMAX: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
    ):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _saturate(x * tl.load(enc_ptr), FMAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if WRITE_T:
            tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)
        if AMAX:
            tl.atomic_max(amax_ptr, tl.max(tl.max(_bits_of_abs(x), axis=1), axis=0))

    @triton.jit
    def _amax_scale_kernel(x_ptr, scratch_ptr, enc_ptr, numel, TRIPS, FMAX: tl.constexpr, BLOCK: tl.constexpr):
        """Tensorwise: the amax of x, then the last program to finish writes its encode scale."""
        pid = tl.program_id(0)
        bits = tl.zeros((BLOCK,), dtype=tl.int32)
        for trip in range(0, TRIPS):  # program p reads blocks p, p + programs, ...
            offs = (pid + trip * tl.num_programs(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            bits = tl.maximum(bits, _bits_of_abs(tl.load(x_ptr + offs, mask=offs < numel, other=0.0)))
        tl.atomic_max(scratch_ptr, tl.max(bits, axis=0))
        if tl.atomic_add(scratch_ptr + 1, 1) == tl.num_programs(0) - 1:  # acq_rel: every program's max is in
            amax = tl.atomic_max(scratch_ptr, 0).to(tl.float32, bitcast=True)
            tl.store(enc_ptr, _encode(amax, FMAX))

    @triton.jit
    def _record_kernel(
        hist_ptr,
        scale_ptr,
        amax_ptr,
        after_ptr,
        dec_ptr,
        old_ptr,
        HIST_LEN,
        AMAX_N,
        SMAX: tl.constexpr,
        MOST_RECENT: tl.constexpr,
        RECORD: tl.constexpr,
        HBLOCK: tl.constexpr,
        ABLOCK: tl.constexpr,
        ATRIPS: tl.constexpr,
    ):
        """The decode scale of the cast with the scale at ``scale_ptr`` and that scale (``old_ptr``); with RECORD,
        delayed scaling's update (``quantize.delayed_update``): amax (the max of AMAX_N partial amaxes, NaN if
        any is NaN) shifted into the history unless 0, the scale recomputed. ``after_ptr``: unread (a
        dependency, see ``record_amax``)."""
        bits = tl.zeros((ABLOCK,), dtype=tl.int32)
        for trip in tl.static_range(ATRIPS):  # unrolled: one trip for a whole amax, a few for row amaxes
            offs = trip * ABLOCK + tl.arange(0, ABLOCK)
            bits = tl.maximum(bits, _bits_of_abs(tl.load(amax_ptr + offs, mask=offs < AMAX_N, other=0.0)))
        a = tl.max(bits, axis=0).to(tl.float32, bitcast=True)
        s = tl.load(scale_ptr)
        finite = (a == a) & (a < float("inf"))
        tl.store(dec_ptr, tl.where(finite, _div(1.0, s), float("nan")))
        tl.store(old_ptr, s)
        if RECORD:
            if a != 0:
                idx = tl.arange(0, HBLOCK)
                h = tl.load(hist_ptr + idx, mask=idx < HIST_LEN - 1, other=0.0)
                tl.debug_barrier()
                tl.store(hist_ptr + idx + 1, h, mask=idx < HIST_LEN - 1)
                tl.store(hist_ptr, a)
                if MOST_RECENT:
                    ref = a
                else:  # fmaxf: NaN entries ignored
                    ref = tl.maximum(tl.max(tl.where(h == h, h, 0.0), axis=0), tl.where(a == a, a, 0.0))
                if (ref == ref) & (ref > 0) & (ref < float("inf")):
                    tl.store(scale_ptr, tl.minimum(_div(SMAX, ref), 3.4028234663852886e38))

    @triton.jit
    def _transpose_kernel(q_ptr, qt_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        q = tl.load(q_ptr + rm[:, None] * N + rn[None, :], mask=mask)
        tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q, mask=mask)

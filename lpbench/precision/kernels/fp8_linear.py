"""The native FP8 tensorwise / delayed kernel of the quantized linear (SM89+): compiler-fused casts, three ``torch._scaled_mm``.

The reference quantized linear's arithmetic (``lpbench.precision.linear``) for the ``tensor`` and ``delayed``
scalings: identical codes and scales, GEMMs equal up to summation order (and the recipe's fast accumulation):

    fprop  Y  = Xq · Wqᵀ        (X row-major, W row-major)
    dgrad  dX = dYq · (Wᵀq)ᵀ    (dY row-major, the transposed W copy)
    wgrad  dW = dYᵀq · (Xᵀq)ᵀ   (both transposed copies)

Tensorwise: the amax is a plain torch reduction that torch.compile fuses into the operand's producer; CUDA
operands are then cast by the tiled Triton kernel of ``kernels/fp8_cast.py``, which writes the row-major and
the transposed copy in one read. The scales are the reference's own functions, exact eager or compiled.
Delayed: the scale is the module's persistent buffer (``lpbench.precision.delayed``), so on the compiled path a
16-bit operand is cast by plain torch ops that inductor fuses into its producer (RMSNorm, SwiGLU), the
transposed copy is made from the codes (``fp8_cast.transpose_codes``), and one launch gives the decode scale
and updates history and scale. Gate_up's gradient comes from SwiGLU's backward kernel, which runs as the
linear's epilogue (:meth:`Fused.epilogue_operands`) and writes the gradient's codes (delayed) or amax
(tensorwise) itself. ``emulate_precision_casts`` (set by ``parallel.plan`` whenever it compiles) keeps the
producer's rounding to BF16 inside fused kernels, so codes, amaxes and scales are the reference's bit for bit.
Eager code and FP32 master weights take the one-pass Triton cast. Under tensor parallelism the amax is
all-reduced before the update. A weight the weight cache keeps in FP8 (:func:`cache_weight`) is not cast again.
"""

from __future__ import annotations

import torch

from lpbench.precision import capability, fp8_allgather
from lpbench.precision.formats import FloatFormat
from lpbench.precision.kernels import fp8_cast
from lpbench.precision.quantize import Scaling, fp8_decode_scale, fp8_encode_scale


def cast(t: torch.Tensor, amax: torch.Tensor, enc: torch.Tensor, fmt: FloatFormat, write_t: bool):
    """(codes, transposed codes or empty, FP32 decode scale): saturating round-to-nearest-even cast of t × enc.

    The decode scale is NaN when ``amax`` (of t) is not finite, as in the reference.
    """
    q = _codes(t, enc, fmt).contiguous()
    return q, (q.t().contiguous() if write_t else q.new_empty((0,))), fp8_decode_scale(enc, amax)


def _codes(t: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Saturating round-to-nearest-even codes of t × scale (NaN stays NaN), as plain torch ops."""
    return (t.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def producer_cast(t: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(row-major codes, amax of each row of |t|) of ``t`` cast with the known encode ``scale``: plain torch ops
    for inductor to fuse into the kernel that produces ``t``. Row maxima are a row reduction that fuses into a
    producer that reduces rows itself (RMSNorm) or writes them (SwiGLU); ``fp8_cast.record_amax`` reduces them
    (no launch of its own)."""
    return _codes(t, scale, fmt), t.float().abs().amax(dim=-1)


def _quantize(mod, role: str, t: torch.Tensor, write_t: bool, out=None, amax=None):
    """(codes, transposed codes, decode scale) of ``t`` for ``role`` under mod's recipe.

    ``mod.reduce_amax`` makes the amax the whole tensor's under tensor parallelism. Delayed
    scaling casts with the module's persistent scale, then records the amax and updates the scale
    (``lpbench.precision.delayed``). ``out``: (codes, transposed codes) buffers the one-pass kernel
    writes into (eager only; other paths return new tensors). ``amax``: tensorwise, t's amax if the
    kernel that produced t reduced it (no TP).
    """
    recipe = mod.recipe
    fmt = recipe.element_format(role)
    if role == "weight" and (pre := fp8_allgather.gathered(mod, t)) is not None:  # FSDP all-gathered it in FP8
        return pre[0], pre[0].t().contiguous() if write_t else pre[0].new_empty((0,)), pre[1]
    kernel = capability.fp8_cast_kernel(t)

    def one_pass(enc, amax=True):  # one tiled pass writes both copies (inductor's transposed write is slow)
        if out is not None:
            return (*out, fp8_cast.cast_transpose_into(t.detach(), enc, fmt, *out, amax))
        return fp8_cast.cast_transpose(t.detach(), enc, fmt, write_t, amax)

    if recipe.scaling is not Scaling.DELAYED:
        if kernel and out is not None and not mod.split(role):  # eager: three launches
            return (*out, fp8_cast.tensorwise_cast_into(t.detach(), fmt, *out))
        if amax is None:
            # the max of the row maxima (the same value, max is exact in any order): inductor fuses a row reduction
            # into the kernel that produces t (SwiGLU for down's input), where a whole-tensor one recomputed SwiGLU
            amax = mod.reduce_amax(role, t.detach().abs().amax(dim=-1).amax().float())
        enc = fp8_encode_scale(amax, fmt)
        if kernel:
            q, qt, _ = one_pass(enc, amax=False)  # the amax is known: the cast skips its reduction
            return q, qt, fp8_decode_scale(enc, amax)
        return cast(t, amax, enc, fmt, write_t)
    if not kernel:
        amax = mod.reduce_amax(role, t.detach().abs().amax().float())
        return cast(t, amax, mod.record_amax(role, amax), fmt, write_t)
    scale = mod.cast_scale(role)  # the buffer (a rerun of a checkpointed forward: the first pass's scale)
    if t.element_size() == 2 and torch.compiler.is_compiling():
        # the producer's kernel writes the row-major codes and reduces the amax (inductor fuses these ops into
        # it; emulate_precision_casts keeps its rounding to 16 bits, so the codes are the reference's); wgrad's
        # copy is transposed from the codes, one byte per element each way
        q, amax = producer_cast(t.detach(), scale, fmt)
        qt = fp8_cast.transpose_codes(q) if write_t else q.new_empty((0,))
    else:  # one read of t: both copies and the amax
        q, qt, amax = one_pass(scale)
    if mod.split(role):
        amax = mod.reduce_amax(role, amax.amax())
    return q, qt, _record(mod, role, amax, q)


def _record(mod, role: str, amax: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Delayed scaling: the decode scale of codes ``q`` cast with the scale buffer as it stands; ``amax`` recorded,
    the scale updated (once per pass: ``DelayedScaling.once``)."""
    return mod.once(
        lambda: fp8_cast.record_amax(
            mod.amax_history(role), mod.scale_buffer(role), amax, q, mod.scaled_max(role), mod.recipe.amax_compute_algo
        )
    )


def cache_weight(mod) -> None:
    """Cast ``mod.weight`` now into ``mod``'s buffers ``fp8_weight`` [N, K], ``fp8_weight_t`` [K, N] and
    ``fp8_weight_scale`` (:mod:`lpbench.convert.weight_cache` made them), exactly as the linear's
    forward would (delayed scaling records the weight's amax here, once per cast)."""
    with torch.no_grad(), torch.autocast(mod.weight.device.type, enabled=False):
        bufs = mod.fp8_weight, mod.fp8_weight_t
        q, qt, dec = _quantize(mod, "weight", mod.weight, True, out=bufs)
        for buf, new in zip((*bufs, mod.fp8_weight_scale), (q, qt, dec.reshape(()))):
            if new is not buf:
                buf.copy_(new)


class Fused:
    """:class:`lpbench.precision.linear.QuantizedLinearFn`'s kernel for native FP8 tensorwise / delayed
    linears that ``capability.fused_fp8_linear`` takes. An operand is (codes, FP32 decode scale); every
    copy comes from :func:`_quantize`, whose one pass writes the transposed copy as well (the row-wise
    one always: the pass writes it anyway); the GEMMs are ``torch._scaled_mm`` into ``out_dtype``."""

    @staticmethod
    def operands(mod, t, role, gemm, row, col):
        if role == "weight" and getattr(mod, "fp8_weight", None) is not None:  # cast once per step (weight_cache)
            q, qt, dec = mod.fp8_weight, mod.fp8_weight_t, mod.fp8_weight_scale
        else:
            q, qt, dec = _quantize(mod, role, t, col)
        return (q, dec), ((qt, dec) if col else None)

    @staticmethod
    def stored_operand(q):
        """A frozen base's stored QTensor (one scale for the tensor) as an operand: (codes, decode scale)."""
        return q.codes, q.scale.float().reshape(())

    @staticmethod
    def stored_t(codes: torch.Tensor) -> torch.Tensor:
        """A frozen base's codes transposed for dgrad: in tiles on CUDA (a strided copy of bytes is slow)."""
        return fp8_cast.transpose_codes(codes) if codes.is_cuda else codes.t().contiguous()

    @staticmethod
    def epilogue_operands(mod, epilogue, y, grad, row, col):
        """:meth:`operands` of the gradient of ``y`` (``role`` "grad") from ``grad``, the gradient of
        ``epilogue.forward(y)``: its codes (delayed) or amax (tensorwise) come out of the epilogue's backward
        kernel, which reads y once (``kernels/swiglu.py``); bit-exact with casting ``epilogue.backward(y, grad)``.
        Where this rank holds part of the gradient (TP's columns, CP's tokens) the kernel's amax is all-reduced to
        the whole gradient's before it scales (tensorwise) or is recorded (delayed: the codes are cast with the
        scale buffer, which every part shares)."""
        if not epilogue.fuses_cast(y, grad):
            return Fused.operands(mod, epilogue.backward(y, grad), "grad", "dgrad", row, col)
        fmt, split = mod.recipe.element_format("grad"), mod.split("grad")
        if mod.recipe.scaling is Scaling.DELAYED:
            scale = mod.scale_buffer("grad") if torch.compiler.is_compiling() else mod.cast_scale("grad")
            q, qt, amax = epilogue.backward_cast(y, grad, scale, fmt, col)
            dec = _record(mod, "grad", mod.reduce_amax("grad", amax.amax()) if split else amax, q)
        else:
            g, amax = epilogue.backward_amax(y, grad)
            q, qt, dec = _quantize(mod, "grad", g, col, amax=mod.reduce_amax("grad", amax) if split else amax)
        return (q, dec), ((qt, dec) if col else None)

    @staticmethod
    def mm(mod, a, b, out_dtype, bias=None, fast_accum=False):
        y = torch._scaled_mm(a[0], b[0].t(), scale_a=a[1], scale_b=b[1], out_dtype=out_dtype, use_fast_accum=fast_accum)
        return y if bias is None else y + bias.to(out_dtype)

"""The experts' quantized kernels (one per Experts module, chosen by :func:`experts_kernel` at conversion):
every expert's ``x_e · W_eᵀ`` over the expert-sorted buffer of :class:`lpbench.models.moe.Groups` (weights
stacked ``[E, N, K]``), each expert's tokens getting the numbers the dense linear of its recipe gives them.

* compute dtype with the weight cache's BF16 copy or an FP32 gradient buffer (:class:`GroupedBf16`): the
  model's own grouped GEMM (:func:`lpbench.models.moe.grouped_matmul`) around them.
* FP8 row-wise and tensor-wise (:class:`GroupedFp8`, :class:`EmulatedGroupedFp8`): hand-written because torch has the GEMM
  (``torch._scaled_grouped_mm``, Hopper) but not the quantization of grouped operands: rows are
  quantized per token, the weights per expert row; tensor-wise takes one scale per expert's
  tokens; the weight gradient quantizes along each expert's tokens (one scale per expert and
  column). Codes and scales are those of ``QuantizedLinear`` on that expert's tokens. Precise
  accumulation of small experts runs lpbench's own grouped GEMM (``kernels/grouped_mm.py``: torch's
  was slower there than BF16). On other devices the GEMM is emulated per expert exactly as the dense
  linear's emulation. The weights' codes can be computed once per optimizer step
  (:func:`weight_codes`, the weight cache's). The native GEMM takes E4M3 operands only, so recipes
  with E5M2 gradients (fp8-tensorwise) run natively per expert (below).
* weight gradients into FP32 buffers (``main_grad``, :mod:`lpbench.convert.main_grads`): the compute-dtype and
  FP8 grouped paths add them there (:func:`add_wgrad`) and hand autograd none for the weight.
* everything else (:class:`Looped`: delayed scaling with its per-expert histories, blockwise, MX, NVFP4) runs
  each expert's tokens through the dense quantized linear's own GEMMs (``ExpertGemms``): exact by
  construction; emulation is about the numbers, not speed.
"""

from __future__ import annotations

import torch

from lpbench import gemm
from lpbench.models.moe import ALIGN, ROWS_ALIGN, Groups, GroupedMM, grouped_matmul  # noqa: F401 (ROWS_ALIGN: for callers)
from lpbench.precision import capability
from lpbench.precision.formats import decode, encode
from lpbench.gemm import hp_mm, mm_fp32
from lpbench.precision.kernels import grouped_mm
from lpbench.precision.kernels.fp8_group import group_amax, group_cast
from lpbench.precision.quantize import Scaling, all_reduce_max, fp8_decode_scale, fp8_encode_scale

GROUPED_FP8_SCALINGS = (Scaling.ROW, Scaling.TENSOR)  # FP8 scalings with a grouped GEMM (GroupedFp8)


class GroupedBf16(GroupedMM):
    """The compute-dtype grouped GEMMs with the weight cache's BF16 copy of each weight (``codes``) and the FP32
    buffers its gradient is added into (``main_grads``)."""

    name = "GroupedBf16"

    def __init__(self, tp=None):
        self.tp, self.codes, self.main_grads = tp, {}, {}

    def __call__(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        main_grad, cached = self.main_grads.get(name), self.codes.get(name)
        return grouped_linear(
            x, w, groups, cached if main_grad is not None else gemm.cast_once(w, cached, x), main_grad
        )


class GroupedFp8(GroupedMM):
    """The experts' kernel for FP8 row-wise / tensor-wise recipes on the device's grouped FP8 GEMMs
    (:class:`_Fp8GroupedFn`), with each weight's codes this optimizer step (``codes``, the weight cache's) and the FP32
    buffers its gradient is added into (``main_grads``) where the converters give them."""

    name, native = "GroupedFp8", True
    wgrad_dtype = torch.bfloat16  # the grouped FP8 GEMM's only output, as the dense native GEMM's

    def __init__(self, recipe):
        self.recipe, self.codes, self.main_grads = recipe, {}, {}

    def __call__(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        return _Fp8GroupedFn.apply(x, w, groups, self, name, *self.codes.get(name, (None,) * 4))

    def scaled(self, a, sa, b, sb, groups: Groups, fast_accum: bool, out_dtype) -> torch.Tensor:
        """:func:`_scaled_grouped` of FP8 codes on the device's GEMMs."""
        return _scaled_grouped(a, sa, b, sb, groups, fast_accum, out_dtype)

    def add_wgrad(self, out, a, sa, b, sb, groups: Groups, fast_accum: bool) -> None:
        """``out[e] += a_e · b_eᵀ`` of FP8 codes (:func:`add_wgrad`'s layout): on Hopper in the GEMM's epilogue."""
        if grouped_mm.takes_wgrad_into(a, b, out):
            grouped_mm.wgrad_into(out, a, b, groups.offs, sa, sb, fast_accum)
        else:
            _accumulate(out, self.scaled(a, sa, b, sb, groups, fast_accum, self.wgrad_dtype))


class EmulatedGroupedFp8(GroupedFp8):
    """:class:`GroupedFp8` with every GEMM emulated per expert exactly as the dense linear's emulation (FP32
    products of the decoded codes)."""

    native, wgrad_dtype = False, torch.float32

    def scaled(self, a, sa, b, sb, groups: Groups, fast_accum: bool, out_dtype) -> torch.Tensor:
        return _emulated_scaled_grouped(a, sa, b, sb, groups, out_dtype)

    def add_wgrad(self, out, a, sa, b, sb, groups: Groups, fast_accum: bool) -> None:
        _accumulate(out, self.scaled(a, sa, b, sb, groups, fast_accum, self.wgrad_dtype))


class Looped(torch.nn.ModuleDict):
    """The experts' kernel for every other recipe: each expert's rows through its own dense quantized GEMMs
    (:func:`looped`; per weight name a list of :class:`lpbench.precision.linear.ExpertGemms`, which hold their
    delayed-scaling state)."""

    name, tp = "Looped", None

    def __init__(self, recipe, native: bool, names, n_experts: int, device):
        from lpbench.precision.linear import ExpertGemms

        super().__init__(
            {name: torch.nn.ModuleList(ExpertGemms(recipe, native, device) for _ in range(n_experts)) for name in names}
        )
        self.recipe = recipe

    def forward(self, experts, name: str, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        return looped(x, w, groups, self[name])

    def set_tp(self, tp, experts) -> None:
        """Every expert's GEMMs quantize their TP slice as the whole weight, as a split dense linear's do."""
        self.tp = tp
        for name, gemms in self.items():
            for g in gemms:
                g.tp_shard = tp.shard(name, getattr(experts, name).shape)

    def narrow(self, start: int, length: int) -> None:
        """Keep experts ``[start, start + length)`` (expert parallelism)."""
        for gemms in self.values():
            del gemms[start + length :]
            del gemms[:start]


def experts_kernel(recipe, native: bool, names, n_experts: int, device):
    """The experts' kernel of a quantized ``recipe``, chosen once: :class:`GroupedFp8` (:class:`EmulatedGroupedFp8`
    where emulated) for the FP8 scalings with a
    grouped GEMM (torch's native one takes E4M3 operands only, so E5M2 gradients run natively per expert), else
    :class:`Looped`."""
    if recipe.scaling in GROUPED_FP8_SCALINGS and not (native and recipe.grad_format != "e4m3"):
        return GroupedFp8(recipe) if native else EmulatedGroupedFp8(recipe)
    return Looped(recipe, native, names, n_experts, device)


def grouped_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    groups: Groups,
    cast: torch.Tensor | None = None,
    main_grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x_e · w_eᵀ`` for every expert in ``x``'s dtype (w cast to it, or ``cast``: w already cast, as
    ``weight_cache.cast_once`` gives it, or the weight cache's copy itself with ``main_grad``): rows of ``x``
    [rows, K] by ``groups``. ``main_grad``: the FP32 buffer ``w``'s gradient is added into (:func:`add_wgrad`),
    ``w`` itself then gets none."""
    if main_grad is not None:
        w16 = cast if cast is not None and cast.dtype == x.dtype else None
        return _GroupedIntoFn.apply(x, w, w16, groups, main_grad)
    w = w.to(x.dtype) if cast is None or cast.dtype != x.dtype else cast
    return grouped_matmul(x, w, groups)


class _GroupedIntoFn(torch.autograd.Function):
    """:func:`grouped_linear` whose weight gradient is added into ``main_grad``: the forward and data gradient the
    grouped GEMMs of ``x``'s dtype (``w16``: the weight in it, else cast here), the weight gradient
    :func:`add_wgrad`'s."""

    @staticmethod
    def forward(ctx, x, w, w16, groups: Groups, main_grad):
        w16 = w.detach().to(x.dtype) if w16 is None else w16
        ctx.save_for_backward(x, w16)
        ctx.groups, ctx.main_grad = groups, main_grad
        return grouped_matmul(x, w16, groups)

    @staticmethod
    def backward(ctx, dy):
        x, w16 = ctx.saved_tensors
        groups = ctx.groups
        dx = grouped_matmul(dy, w16.transpose(1, 2), groups) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            add_wgrad(ctx.main_grad, dy.t(), x.t(), groups)
        return dx, None, None, None, None


@torch.library.custom_op("lpbench::accumulate_", mutates_args=("out",))
def _accumulate(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``out += grad`` in ``out``'s dtype, as one op a compiled backward keeps (an input mutated in backward)."""
    out.add_(grad)


@_accumulate.register_fake
def _(out, grad):
    return None


def add_wgrad(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: Groups) -> None:
    """``out[e] += a_e · b_eᵀ`` over each expert's rows (the weight gradient into its FP32 buffer ``out`` [E, M, N]):
    ``a`` [M, rows] and ``b`` [N, rows] in the compute dtype (FP8 codes: :meth:`GroupedFp8.add_wgrad`). On Hopper
    lpbench's grouped GEMM adds its FP32 product in its epilogue (:func:`kernels.grouped_mm.wgrad_into`;
    ``benchmarks/grouped_gemm.py`` measures it against casting and adding the BF16 output). Elsewhere the GEMM's
    output is added (:func:`_accumulate`)."""
    if grouped_mm.takes_wgrad_into(a, b, out):
        grouped_mm.wgrad_into(out, a, b, groups.offs, None, None, False)
    else:
        _accumulate(out, _hp_wgrad(a.t(), b.t(), groups))


def _group_fp8(
    t: torch.Tensor,
    spec,
    group: torch.Tensor,
    n_groups: int,
    along_rows: bool = False,
    block: int = ALIGN,
    amax_group=None,
):
    """FP8 codes of ``t`` [R, C] and FP32 decode scales, as the dense linear quantizes each group's rows.

    Along C (``along_rows`` False): a scale per row (row-wise) or per group (tensor-wise), returned
    [R]. Along the rows of each group (the weight-gradient GEMM's reduction over tokens): a scale per
    group and column (row-wise) or per group, returned [n_groups, C].

    Group amaxes reduce each ``block`` rows first (no block straddles two groups: ALIGN in a
    :class:`Groups` buffer, an expert's rows in stacked weights) and scatter only the block maxima:
    max is exact in any order, and the scatter's atomics, one per element, had cost more than the
    GEMMs they feed (on CUDA the weight-gradient operands take :func:`_grad_codes` instead).
    ``amax_group``: the TP group whose ranks hold the other parts of the scaling groups
    (:func:`_amax_group`); the amaxes are all-reduced (MAX) over it.
    """
    t = t.float()
    mag = t.abs()
    if spec.scaling is Scaling.TENSOR or along_rows:
        R, C = mag.shape
        blocks = mag.view(R // block, block, C).amax(1)
        block_group = group[::block]
    if spec.scaling is Scaling.TENSOR:
        amax_g = all_reduce_max(
            mag.new_zeros(n_groups).scatter_reduce(0, block_group, blocks.amax(1), "amax"), amax_group
        )
        amax = amax_g[group][:, None] if not along_rows else amax_g[:, None].expand(n_groups, t.shape[1])
    elif along_rows:
        amax = all_reduce_max(
            mag.new_zeros(n_groups, C).scatter_reduce(0, block_group[:, None].expand_as(blocks), blocks, "amax"),
            amax_group,
        )
    else:
        amax = all_reduce_max(mag.amax(1, keepdim=True), amax_group)
    enc = fp8_encode_scale(amax, spec.fmt, pow2=spec.pow2)
    codes = encode(t * (enc[group] if along_rows else enc), spec.fmt)
    dec = fp8_decode_scale(enc, amax)
    return codes, (dec if along_rows else dec[:, 0])


def _grad_codes(dy: torch.Tensor, dgrad, wgrad, group: torch.Tensor, n_groups: int, split):
    """The output gradient's FP8 operands: for the data gradient (``dgrad`` its spec, None if not wanted) codes
    [R, C] and scales [R] as :func:`_group_fp8` along C; for the weight gradient (``wgrad``) the codes along each
    expert's rows transposed, [C, R] as the grouped GEMM takes them, and scales [n_groups, C]; None where not
    wanted. Where both are row-wise and the kernels take ``dy``, two reads of it (:mod:`kernels.fp8_group`: the
    row and group amaxes, then both codes); else the torch ops."""
    ag_d = dgrad and _amax_group(split, "grad", "dgrad", dgrad)
    ag_w = wgrad and _amax_group(split, "grad", "wgrad", wgrad)
    row_wise = dgrad and wgrad and dgrad.scaling is Scaling.ROW and wgrad.scaling is Scaling.ROW
    if row_wise and dgrad.fmt == wgrad.fmt and capability.fp8_cast_kernel(dy):
        cols, rows = group_amax(dy, group, n_groups, ALIGN, row_amax=True)
        row_amax, col_amax = all_reduce_max(rows[:, None], ag_d), all_reduce_max(cols, ag_w)
        enc_r = fp8_encode_scale(row_amax, dgrad.fmt, pow2=dgrad.pow2)
        enc_c = fp8_encode_scale(col_amax, wgrad.fmt, pow2=wgrad.pow2)
        q, qt = group_cast(dy, enc_r, group, enc_c, dgrad.fmt)
        return (q, fp8_decode_scale(enc_r, row_amax)[:, 0]), (qt, fp8_decode_scale(enc_c, col_amax))
    return (
        _group_fp8(dy, dgrad, group, n_groups, amax_group=ag_d) if dgrad else None,
        _group_codes_t(dy, wgrad, group, n_groups, ag_w) if wgrad else None,
    )


def _group_codes_t(t: torch.Tensor, spec, group: torch.Tensor, n_groups: int, amax_group):
    """The weight-gradient operand of ``t`` [R, C]: codes along each group's rows transposed, [C, R], and scales
    [n_groups, C]; row-wise by the kernels where they take ``t`` (two reads), else the torch ops."""
    if spec.scaling is Scaling.ROW and capability.fp8_cast_kernel(t):
        amax = all_reduce_max(group_amax(t, group, n_groups, ALIGN)[0], amax_group)
        enc = fp8_encode_scale(amax, spec.fmt, pow2=spec.pow2)
        return group_cast(t, None, group, enc, spec.fmt)[1], fp8_decode_scale(enc, amax)
    q, s = _group_fp8(t, spec, group, n_groups, along_rows=True, amax_group=amax_group)
    return q.t().contiguous(), s


def _amax_group(split, role: str, gemm: str, spec):
    """The TP group over which operand ``role`` of ``gemm``'s scaling groups span, or None: exactly
    :meth:`lpbench.precision.linear.QuantizedGemms._quantize`'s rule for a split dense linear. ``split``: the
    weight's :class:`lpbench.parallel.tp.TPShard` (dim 0: out features, so the gradient is split too; dim 1:
    in features, so the input is split too)."""
    if split is None or role not in ("weight", "grad" if split.dim == 0 else "input"):
        return None
    dim = 1 if gemm == ("dgrad" if split.dim == 0 else "fprop") else 0  # the operand's split dim in ``gemm``
    return split.group if spec.block[dim] is None else None


def _scaled_grouped(a, sa, b, sb, groups: Groups, fast_accum: bool, out_dtype) -> torch.Tensor:
    """Grouped ``a · bᵀ`` of FP8 codes with FP32 decode scales applied to the output, on the device's GEMMs.

    2-D × 3-D (forward, data gradient): a [rows, K], sa [rows], b [E, N, K], sb [E, N] -> [rows, N].
    2-D × 2-D (weight gradient; ``b`` 2-D): a [N, rows], sa [E, N], b [K, rows], sb [E, K] -> [E, N, K],
    each expert reducing over its own rows.
    ``torch._scaled_grouped_mm``, or lpbench's kernel where it is the faster (:mod:`kernels.grouped_mm`:
    precise accumulation of small experts); :func:`_emulated_scaled_grouped` gives the same products emulated.
    """
    wgrad = b.dim() == 2
    if grouped_mm.takes(a, b, fast_accum, out_dtype):
        y = grouped_mm.grouped_mm(a, b, sa, sb, groups.offs)
    else:  # torch's takes the weight gradient's scales flat
        sa, sb = sa.reshape(-1).contiguous(), (sb.reshape(-1) if wgrad else sb).contiguous()
        y = torch._scaled_grouped_mm(
            a, b.transpose(-2, -1), sa, sb, offs=groups.offs, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return y if wgrad else groups.clear_tail(y)


@torch.compiler.disable
def _emulated_scaled_grouped(a, sa, b, sb, groups: Groups, out_dtype) -> torch.Tensor:
    wgrad = b.dim() == 2
    va, vb = decode(a, _fmt(a)), decode(b, _fmt(b))
    if wgrad:
        out = [
            (mm_fp32(va[:, s : s + c].contiguous(), vb[:, s : s + c].contiguous()) * sa[e][:, None]) * sb[e][None, :]
            for e, (s, c) in enumerate(groups.host)
        ]
        return torch.stack(out).to(out_dtype)
    parts = [
        ((mm_fp32(va[s : s + c], vb[e]) * sa[s : s + c, None]) * sb[e][None, :]).to(out_dtype)
        for e, (s, c) in enumerate(groups.host)
    ]
    return groups.pieces(parts, vb.shape[1], parts[0] if parts else va.to(out_dtype))


def _fmt(codes: torch.Tensor):
    from lpbench.precision.formats import E4M3, E5M2

    return E4M3 if codes.dtype == torch.float8_e4m3fn else E5M2


def _weight_fprop(w: torch.Tensor, recipe, split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [E, N, K] and decode scales [E, N] of stacked weights ``w`` for the forward GEMM."""
    spec = recipe.operand("weight", "fprop")
    return _stacked_codes(w, spec, _amax_group(split, "weight", "fprop", spec))


def _weight_dgrad(w: torch.Tensor, recipe, split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [E, K, N] and decode scales [E, K] of ``wᵀ`` for the data-gradient GEMM (scaled along N)."""
    spec = recipe.operand("weight", "dgrad")
    return _stacked_codes(w.transpose(1, 2), spec, _amax_group(split, "weight", "dgrad", spec))


def _stacked_codes(w: torch.Tensor, spec, amax_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [E, N, K] and decode scales [E, N] of stacked ``w`` [E, N, K] (a view too), scaled along K."""
    E, N, K = w.shape
    group = torch.arange(E, device=w.device).repeat_interleave(N)
    wq, sw = _group_fp8(w.reshape(E * N, K), spec, group, E, block=N, amax_group=amax_group)
    return wq.view(E, N, K), sw.view(E, N)


def _codes(w: torch.Tensor, fprop, dgrad) -> tuple[torch.Tensor, ...]:
    return (*_stacked_codes(w, fprop), *_stacked_codes(w.transpose(1, 2), dgrad))


# One graph per weight shape (static; an expert stack has two, gate_up and down): inductor fuses each copy's
# amax, scales and cast, where the eager ops made ~25 launches per weight with FP32 temporaries (the
# transposed copy, |w|, w x scale, the clamp; benchmarks/RESULTS.md).
_compiled_codes = torch.compile(_codes, dynamic=False, fullgraph=True)


@torch.no_grad()
def weight_codes(w: torch.Tensor, recipe, split=None) -> tuple[torch.Tensor, ...]:
    """(forward codes, scales, data-gradient codes, scales) of stacked weights ``w`` (under TP this rank's
    slice, ``split`` its TPShard): what :class:`GroupedFp8` computes on every call, computed once to be
    reused while ``w`` does not change. On CUDA by one compiled graph (the same ops, so the same codes and
    scales bit for bit: amaxes are exact in any order, the scales divide in FP64, the casts saturate and
    round to nearest even); eagerly elsewhere and where an amax is all-reduced over a TP group."""
    fprop, dgrad = recipe.operand("weight", "fprop"), recipe.operand("weight", "dgrad")
    groups = _amax_group(split, "weight", "fprop", fprop), _amax_group(split, "weight", "dgrad", dgrad)
    with torch.autocast(w.device.type, enabled=False):
        if w.is_cuda and all(g is None for g in groups):
            return _compiled_codes(w, fprop, dgrad)
        return (*_stacked_codes(w, fprop, groups[0]), *_stacked_codes(w.transpose(1, 2), dgrad, groups[1]))


class _Fp8GroupedFn(torch.autograd.Function):
    """:class:`GroupedFp8`'s projection ``name``: x in the compute dtype, w the master weight (its TP slice quantized
    as the whole weight, :func:`_amax_group`), ``wq, sw, wtq, swt`` its :func:`weight_codes` or None (quantized in
    this call); the weight gradient is added into the kernel's ``main_grads[name]`` where it has one, and ``w``
    then gets none."""

    @staticmethod
    def forward(ctx, x, w, groups: Groups, kernel, name: str, wq, sw, wtq, swt):
        E, recipe, split = w.shape[0], kernel.recipe, kernel.split(name, w)
        with torch.autocast(x.device.type, enabled=False):
            spec = recipe.operand("input", "fprop")
            xq, sx = _group_fp8(x, spec, groups.row_group, E, amax_group=_amax_group(split, "input", "fprop", spec))
            if wq is None:
                wq, sw = _weight_fprop(w, recipe, split)
            y = kernel.scaled(xq, sx, wq, sw, groups, recipe.fast_accum_fprop, x.dtype)
        ctx.save_for_backward(x, w, *((wtq, swt) if wtq is not None else ()))
        ctx.groups, ctx.kernel, ctx.split, ctx.main_grad = groups, kernel, split, kernel.main_grads.get(name)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, *dgrad_codes = ctx.saved_tensors
        groups, kernel, split = ctx.groups, ctx.kernel, ctx.split
        recipe, E = kernel.recipe, w.shape[0]
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            dgrad_spec = recipe.operand("grad", "dgrad") if ctx.needs_input_grad[0] else None
            wgrad_spec = recipe.operand("grad", "wgrad") if ctx.needs_input_grad[1] else None
            dgrad_op, wgrad_op = _grad_codes(dy, dgrad_spec, wgrad_spec, groups.row_group, E, split)
            if ctx.needs_input_grad[0]:
                wtq, swt = dgrad_codes or _weight_dgrad(w, recipe, split)
                dx = kernel.scaled(*dgrad_op, wtq, swt, groups, recipe.fast_accum_grads, x.dtype)
            if ctx.needs_input_grad[1]:
                dw = _fp8_wgrad(ctx, dy, x, w, wgrad_op, wgrad_spec)
        return dx, dw, None, None, None, None, None, None, None


def _fp8_wgrad(ctx, dy, x, w, wgrad_op, wgrad_spec):
    """:class:`_Fp8GroupedFn`'s weight gradient in ``w``'s dtype, or None: added into ``ctx.main_grad``."""
    groups, kernel, main_grad = ctx.groups, ctx.kernel, ctx.main_grad
    if wgrad_spec is None:  # weight gradient in the compute dtype
        if main_grad is None:
            return _hp_wgrad(dy, x, groups).to(w.dtype)
        add_wgrad(main_grad, dy.t(), x.t(), groups)
        return None
    spec_x, fast = kernel.recipe.operand("input", "wgrad"), kernel.recipe.fast_accum_grads
    xqt, sx = _group_codes_t(x, spec_x, groups.row_group, w.shape[0], _amax_group(ctx.split, "input", "wgrad", spec_x))
    if main_grad is not None:
        kernel.add_wgrad(main_grad, wgrad_op[0], wgrad_op[1], xqt, sx, groups, fast)
        return None
    return kernel.scaled(*wgrad_op, xqt, sx, groups, fast, kernel.wgrad_dtype).to(w.dtype)


@torch.compiler.disable
def _hp_wgrad(dy: torch.Tensor, x: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Every expert's ``dy_eᵀ · x_e`` in the compute dtype with FP32 accumulation, as the dense linear."""
    return torch.stack([hp_mm(dy[s : s + c].t(), x[s : s + c].t(), x.dtype) for s, c in groups.host])


@torch.compiler.disable
def looped(x: torch.Tensor, w: torch.Tensor, groups: Groups, gemms) -> torch.Tensor:
    """Each expert's rows through its dense quantized GEMMs (``gemms[e]``, an ExpertGemms)."""
    parts = [gemms[e]._linear(x[s : s + c], w[e], None) for e, (s, c) in enumerate(groups.host)]
    return groups.pieces(parts, w.shape[1], x)

"""The quantized Linear: three GEMMs, each quantizing its operands along its own reduction dim.

    fprop  Y  = X · Wᵀ    reduction over in_features   (X rows, W rows)
    dgrad  dX = dY · W    reduction over out_features  (dY rows, W columns)
    wgrad  dW = dYᵀ · X   reduction over tokens        (dY columns, X columns)

Every GEMM is written as ``A · Bᵀ`` with both operands quantized along their last dim; the
column-wise copies (Wᵀ, Xᵀ, dYᵀ) are quantized from the high-precision tensor, never from
the row-wise copy. Hand-written (not torchao / TE) so the same code emulates every recipe
exactly on any device:

* emulated path: operands are dequantized to values that BF16 holds exactly (E4M3/E5M2
  codes, codes × power-of-two or E4M3 block scales), multiplied with FP32 accumulation, and
  scales that are constant along the reduction dim (tensor, row, NVFP4 global) are applied
  to the FP32 output, as the hardware does. Equal to a native GEMM up to summation order.
  NVFP4 activations and gradients on CUDA come from the fused quantizer (``kernels/nvfp4.py``,
  bit-exact with the reference) already in this form: BF16 values and a global scale.
* native path (CUDA): the scaling's kernel from ``capability.NATIVE`` (:func:`kernel_for`, the classes below),
  chosen once per module; a shape a native GEMM does not take runs the emulation (same numerics).
  A recipe's ``fast_accum_fprop`` runs the native forward GEMM in Hopper's fast accumulation
  (as TE and torchao do; dgrad and wgrad accumulate in FP32 unless ``fast_accum_grads``, as
  torchao's MoE GEMMs): not bit-reproducible, so the emulation accumulates in FP32 throughout and
  the two differ there by more than summation order.

Autocast: inputs are cast to the autocast dtype, then all quantization and GEMMs run with
autocast disabled; the output has the input's compute dtype, dW the weight's dtype. Delayed
scaling keeps its amax histories and scales as buffers (``amax_history_{input,weight,grad}``,
``delayed_scale_{input,weight,grad}``; :mod:`lpbench.precision.delayed`), so they are checkpointed.
The token dim is zero-padded for the wgrad GEMM when its block needs it (MoE experts see any number
of tokens); zeros change neither amax nor the product.

Tensor parallelism (``tp_shard``, set by :func:`lpbench.parallel.tp.apply_tp`): the GEMMs run
on the local shards, and each shard is quantized as the unsharded tensor would be: the amax of
a scaling group that spans the split (tensor and delayed scaling, rows along a split reduction
dim, NVFP4's global scale) is all-reduced (MAX) over the TP group, stochastic rounding uses the
unsharded tensor's draws, and blocks never straddle shards (``apply_tp`` checks
``tp_multiple``). A weight that FSDP all-gathered in FP8 (:mod:`lpbench.precision.fp8_allgather`)
is used as gathered, not quantized again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lpbench import passes
from lpbench.precision import capability, fp8_allgather, noise
from lpbench.precision.delayed import DelayedScaling
from lpbench.precision.formats import E2M1
from lpbench.gemm import compute_dtype, hp_mm, local_linear, mm_fp32
from lpbench.precision.kernels import block_scaled
from lpbench.precision.kernels.fp8_linear import Fused
from lpbench.precision.quantize import (
    RHT_SIZE,
    QSpec,
    Scaling,
    QTensor,
    all_reduce_max,
    apply_rht,
    quantize,
    scale_to_float,
)
from lpbench.precision.recipes import Recipe


def _operand(q) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16-exact GEMM operand and the factor its GEMM output rows get ([rows, 1] or scalar), of a
    QTensor or of a copy that the fused NVFP4 quantizer (``kernels/nvfp4.py``) made."""
    if not isinstance(q, QTensor):
        return q.values, q.global_scale
    g = q.global_scale if q.global_scale is not None else torch.ones((), device=q.codes.device)
    if q.block[1] == q.codes.shape[1]:  # one scale across the reduction dim: apply to the output
        return q.values(), scale_to_float(q.scale).repeat_interleave(q.block[0], 0) * g
    return q.values() * q.block_scales(), g


@torch.library.custom_op("lpbench::blockwise_mm", mutates_args=())
def _blockwise_mm_op(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """BF16 a · bᵀ of FP8 codes with 1x128 a-scales [M, K/128] and 1x128 [N, K/128] or 128x128
    [N/128, K/128] b-scales (row-major FP32), laid out here as cuBLAS reads them: 1x128 scales
    K-block-major (strides (1, rows)), 128x128 ones as the [K/128, N/128] view. A custom op, so
    that torch.compile keeps the layouts and does not break its graph at ``F.scaled_mm``."""
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    if scale_b.shape[0] == b.shape[0]:
        sb, kind_b = scale_b.t().contiguous().t(), ScalingType.BlockWise1x128
    else:
        sb, kind_b = scale_b.t(), ScalingType.BlockWise128x128
    sa, none = scale_a.t().contiguous().t(), SwizzleType.NO_SWIZZLE
    kind_a = ScalingType.BlockWise1x128
    return scaled_mm(a, b.t(), sa, kind_a, sb, kind_b, swizzle_a=none, swizzle_b=none, output_dtype=torch.bfloat16)


@_blockwise_mm_op.register_fake
def _(a, scale_a, b, scale_b):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def _scaled_mm(a: QTensor, b: QTensor, fast_accum: bool) -> torch.Tensor:
    """Native FP8 a · bᵀ: tensorwise (scalar scales) or rowwise ([M, 1] and [1, N] scales)."""
    sa, sb = a.scale.float(), b.scale.float()
    if sa.numel() == 1 and sb.numel() == 1:
        sa, sb = sa.reshape(()), sb.reshape(())
    else:
        sb = sb.t().contiguous()
    return torch._scaled_mm(
        a.codes, b.codes.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )


class Emulated:
    """:class:`QuantizedLinearFn`'s kernel with lpbench's quantizers (:meth:`QuantizedGemms._operands`,
    :meth:`QuantizedGemms._weight_operands`) and the exact emulated GEMM: BF16-exact operands, FP32 accumulation,
    scales constant along the reduction dim applied to the FP32 output; bias added in FP32, rounded once to
    ``out_dtype``. The native kernels below keep these operands and replace :meth:`gemm`.

    ``operands`` gives ``t`` quantized as operand ``role`` of ``gemm`` if ``row`` and its transposed copy if
    ``col`` (wgrad's of X and dY; dgrad's Wᵀ of the weight), None for a copy not asked for. ``takes`` is the
    kernel's shape check; where it fails the module runs ``fallback``. ``token_multiple``: what the wgrad GEMM's
    token dim is zero-padded to; :meth:`fp4_operand` and :meth:`stored_t` shape the NVFP4 quantizer's copies and a
    stored weight's transposed codes as the GEMM reads them."""

    name, native, fallback, token_multiple = "Emulated", False, None, 1

    @staticmethod
    def fp4_operand(copy, block: int):
        """The fused NVFP4 quantizer's copy (``kernels/nvfp4.py``) as this kernel's operand: its BF16 values."""
        return copy

    @staticmethod
    def stored_t(codes: torch.Tensor) -> torch.Tensor:
        """Stored codes transposed for the GEMM (a view)."""
        return codes.t()

    @staticmethod
    def takes(x: torch.Tensor, weight_shape: tuple[int, int]) -> bool:
        return True

    @staticmethod
    def stored_operand(q: QTensor):
        """A stored weight's QTensor (a frozen base's, ``precision/frozen.py``) as this kernel's operand."""
        return q

    @staticmethod
    def operands(mod, t, role, gemm, row, col):
        return mod._weight_operands(t, col) if role == "weight" else mod._operands(t, role, gemm, row, col)

    @classmethod
    def mm(cls, mod, a, b, out_dtype, bias=None, fast_accum=False):
        y = cls.gemm(a, b, fast_accum)
        return (y if bias is None else y.float() + bias.float()).to(out_dtype)

    @staticmethod
    def gemm(a, b, fast_accum: bool = False) -> torch.Tensor:
        """a · bᵀ of two operands quantized along their last (reduction) dim: FP32 here (the emulation accumulates
        in FP32 whatever ``fast_accum`` says), the BF16 output of the native kernels below (cast to ``out_dtype``
        by :meth:`mm`, no FP32 round trip: a BF16 value is exact in either)."""
        (va, sa), (vb, sb) = _operand(a), _operand(b)
        return mm_fp32(va, vb) * sa * (sb.t() if sb.dim() else sb)


class Native(Emulated):
    """What every native kernel shares: codes and scales as operands (token dim in multiples of 16, row-major)."""

    name, native, token_multiple = "Native", True, 16

    @staticmethod
    def fp4_operand(copy, block: int):
        return None if copy is None else QTensor(copy.codes, copy.scale, (1, block), E2M1, copy.global_scale)

    @staticmethod
    def stored_t(codes: torch.Tensor) -> torch.Tensor:
        return codes.t().contiguous()  # torch._scaled_mm wants row-major operands


class NativeScaledMM(Native):
    """FP8 tensorwise / delayed / row-wise GEMMs by ``torch._scaled_mm`` (``fast_accum``: Hopper's fast mode)."""

    name, native = "NativeScaledMM", True

    @staticmethod
    def gemm(a, b, fast_accum: bool = False) -> torch.Tensor:
        return _scaled_mm(a, b, fast_accum)


class NativeBlockwise(Native):
    """FP8 1x128 / 128x128 blockwise GEMMs by ``F.scaled_mm``, for shapes it takes
    (:func:`lpbench.precision.capability.blockwise_shape`); emulated otherwise."""

    name, native = "NativeBlockwise", True

    @staticmethod
    def gemm(a, b, fast_accum: bool = False) -> torch.Tensor:
        if not capability.blockwise_shape(a, b):
            return Emulated.gemm(a, b)
        return _blockwise_mm_op(a.codes, a.scale.float().contiguous(), b.codes, b.scale.float().contiguous())


class NativeBlockScaled(Native):
    """MXFP8 / NVFP4 GEMMs by ``F.scaled_mm`` on compute capability 10.x (``kernels/block_scaled.py``), for operands
    it takes; emulated otherwise."""

    name, native = "NativeBlockScaled", True

    @staticmethod
    def gemm(a, b, fast_accum: bool = False) -> torch.Tensor:
        return block_scaled.mm(a, b) if block_scaled.takes(a, b) else Emulated.gemm(a, b)


class FusedFp8(Fused, Native):
    """The fused FP8 tensorwise / delayed linear (``kernels/fp8_linear.py``) for calls whose GEMM dims are
    multiples of 16; :class:`NativeScaledMM` for the others."""

    name, native, fallback = "FusedFp8", True, NativeScaledMM

    @staticmethod
    def takes(x: torch.Tensor, weight_shape: tuple[int, int]) -> bool:
        return capability.fused_fp8_linear(x, weight_shape)


def _with_subclasses(kernel) -> list:
    return [kernel] + [k for sub in kernel.__subclasses__() for k in _with_subclasses(sub)]


KERNELS = {k.name: k for k in _with_subclasses(Emulated)}  # every kernel class above, by name


def kernel_for(recipe: Recipe, native: bool):
    """The kernel of a quantized linear of ``recipe``: the scaling's native kernel (``capability.NATIVE``) if
    ``native``, else :class:`Emulated`."""
    return KERNELS[capability.NATIVE[recipe.scaling]] if native else Emulated


def _split(operand) -> tuple[list, callable]:
    """An operand's tensors (a QTensor, a kernel's tuple of tensors, a tensor or None), for ``save_for_backward``,
    and the function that makes the operand again from them (it holds no tensor of its own)."""
    if isinstance(operand, QTensor):
        block, fmt = operand.block, operand.fmt
        return [operand.codes, operand.scale, operand.global_scale], lambda t: QTensor(t[0], t[1], block, fmt, t[2])
    if isinstance(operand, tuple):  # the fused FP8 kernel's (codes, scale), kernels/nvfp4.py's Copy
        kind = type(operand)
        return list(operand), (tuple if kind is tuple else lambda t: kind(*t))
    return [operand], lambda t: t[0]


class QuantizedLinearFn(torch.autograd.Function):
    """The one autograd Function of every quantized linear (QuantizedLinear, an MoE expert's ExpertGemms,
    LoRA's frozen base): ``x · weightᵀ + bias`` and its gradients, with the operands and GEMMs of ``kernel``
    (the module's, :func:`kernel_for`). Operands are the kernel's own; this only wires the three GEMMs. A frozen base passes no weight: its stored operands are read (Wᵀ in the backward, not held
    from the forward) and it gets no weight gradient.

    ``epilogue`` (the gate+up linear's SwiGLU, ``precision/kernels/swiglu.py: Epilogue``; only with a kernel that has
    ``epilogue_operands``, no bias and quantized wgrad): the output is ``epilogue.forward(x · weightᵀ)``, and
    the backward has the kernel quantize the gradient of ``x · weightᵀ`` inside the epilogue's backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, mod, kernel, epilogue=None):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            ctx.quantized_wgrad = need_dw and mod.recipe.operand("input", "wgrad") is not None
            xq, ctx.x_wgrad = kernel.operands(mod, x2, "input", "fprop", True, ctx.quantized_wgrad)
            if weight is None:
                wq, ctx.w_dgrad = mod.weight_operand("fprop", kernel), None
            else:
                wq, ctx.w_dgrad = kernel.operands(mod, weight, "weight", "fprop", True, need_dx)
            y = kernel.mm(mod, xq, wq, x.dtype, bias, mod.recipe.fast_accum_fprop)
            ctx.mod, ctx.kernel, ctx.epilogue, ctx.x_shape, ctx.x_dtype = mod, kernel, epilogue, x.shape, x.dtype
            ctx.w_dtype = None if weight is None else weight.dtype
            x_wgrad, ctx.x_wgrad_of = _split(ctx.x_wgrad)  # saved as tensors: activation recomputation frees them
            ctx.x_wgrad = None
            ctx.save_for_backward(
                x2 if need_dw and not ctx.quantized_wgrad else None, y if epilogue else None, *x_wgrad
            )
            if epilogue is not None:
                y = epilogue.forward(y)
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        mod, kernel = ctx.mod, ctx.kernel
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            x2, y, *x_wgrad = ctx.saved_tensors
            ctx.x_wgrad = ctx.x_wgrad_of(x_wgrad)
            with passes.backward_pass(ctx):  # a zero-bubble weight pass: the gradient's amax recorded once
                if ctx.epilogue is None:
                    gq, gq_wgrad = kernel.operands(mod, dy2, "grad", "dgrad", need_dx, ctx.quantized_wgrad)
                else:  # dy2 is the gradient of the epilogue's output
                    gq, gq_wgrad = kernel.epilogue_operands(mod, ctx.epilogue, y, dy2, need_dx, ctx.quantized_wgrad)
            if need_dx:
                wt = mod.weight_operand("dgrad", kernel) if ctx.w_dgrad is None else ctx.w_dgrad
                dx = kernel.mm(mod, gq, wt, ctx.x_dtype, None, mod.recipe.fast_accum_grads).reshape(ctx.x_shape)
            if ctx.quantized_wgrad:
                dw = kernel.mm(mod, gq_wgrad, ctx.x_wgrad, ctx.w_dtype, None, mod.recipe.fast_accum_grads)
            elif need_dw:
                dw = hp_mm(dy2.t(), x2.t(), ctx.x_dtype).to(ctx.w_dtype)
            if ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(ctx.w_dtype)
        if torch.compiler.is_compiling() or not torch._C._autograd._get_current_graph_task_keep_graph():
            ctx.w_dgrad = ctx.x_wgrad = None  # freed now; kept where the graph is (a zero-bubble weight pass reruns it)
        return dx, dw, db, None, None, None


class QuantizedGemms(DelayedScaling):
    """The recipe's three GEMMs of ``x · weightᵀ`` on plain tensors (:meth:`_linear`), with the state they
    keep (delayed-scaling histories, :class:`DelayedScaling`; TP shard): the part of QuantizedLinear that does not own a weight,
    shared with MoE experts (:class:`ExpertGemms`), whose weights are slices of a stacked parameter."""

    tp_shard = None  # lpbench.parallel.tp.TPShard when apply_tp split it: its group, split dim, sections
    cp_shard = None  # lpbench.parallel.cp.ContextParallel under CP: activations and gradients hold its tokens

    def _init_gemms(self, recipe: Recipe, native: bool, device, roles=("input", "weight", "grad")) -> None:
        if not recipe.quantized:
            raise ValueError(f"recipe {recipe.name} has no quantized GEMMs")
        self.recipe, self.kernel = recipe, kernel_for(recipe, native)
        self._init_histories(device, roles)

    @property
    def native(self) -> bool:
        """Whether the module's kernel runs the device's low-precision GEMMs (else the exact emulation)."""
        return self.kernel.native

    def describe(self) -> str:
        return f"recipe={self.recipe.name}, path={'native' if self.native else 'emulated'}, kernel={self.kernel.name}"

    @property
    def tp_multiple(self) -> int:
        """What every rank's part of a tensor-parallel section must divide by: the recipe's block (else 1)."""
        return self.recipe.block or 1

    def _tp_group(self, role: str):
        """The TP group if TP splits operand ``role``: the weight; the input (row-wise) or gradient (column-wise)."""
        tp = self.tp_shard
        return tp.group if tp is not None and role in ("weight", "grad" if tp.dim == 0 else "input") else None

    def _cp(self, role: str):
        """The CP split of operand ``role``'s tokens (activations and gradients), or None."""
        return None if role == "weight" else self.cp_shard

    def split(self, role: str) -> bool:
        """Whether this rank holds only part of operand ``role`` (a TP shard, or its CP share of the tokens)."""
        return self._tp_group(role) is not None or self._cp(role) is not None

    def reduce_amax(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """The amax of this rank's part of operand ``role``: under TP and CP, all-reduced to the whole tensor's."""
        cp = self._cp(role)
        return all_reduce_max(amax, (self._tp_group(role), None if cp is None else cp.group))

    def _quantize(self, t: torch.Tensor, role: str, gemm: str, encode_scale=None) -> QTensor:
        """``t`` quantized as operand ``role`` of ``gemm``; a TP shard or CP share exactly as in the whole tensor.

        TP splits dim 1 of the operand where ``gemm`` reduces over the split features (dgrad
        column-wise, fprop row-wise), else dim 0; CP splits the tokens (dim 0, dim 1 of wgrad's
        transposed layout). Scaling groups spanning a split dim take the amax of all parts;
        stochastic rounding draws for the whole operand and keeps this rank's part (keyed draws inside a training
        step, :mod:`lpbench.precision.noise`).
        """
        spec, tp, cp = self.recipe.operand(role, gemm), self.tp_shard, self._cp(role)
        splits = []  # (dim, group, whole size, this rank's positions along dim)
        if self._tp_group(role) is not None:
            dim = 1 if gemm == ("dgrad" if tp.dim == 0 else "fprop") else 0
            splits.append((dim, tp.group, sum(tp.sections), lambda: tp.index(t.device)))
        if cp is not None:
            dim = 1 if gemm == "wgrad" else 0
            n = t.shape[dim]
            splits.append((dim, cp.group, n * cp.size, lambda: cp.token_index(n, t.device)))
        key = noise.key(self, role, gemm, t.device) if spec.stochastic else None
        if not splits and key is None:
            return quantize(t, spec, encode_scale=encode_scale)
        draws = None
        if spec.stochastic:
            shape = list(t.shape)
            for dim, _, whole, _ in splits:
                shape[dim] = whole
            draws = noise.uniform(key, shape, t.device)
            for dim, _, _, index in splits:
                draws = draws.index_select(dim, index())
        groups = tuple(g for dim, g, _, _ in splits if spec.scaling is Scaling.NVFP4 or spec.block[dim] is None)
        return quantize(t, spec, encode_scale=encode_scale, noise=draws, amax_group=groups or None)

    def _operands(self, t: torch.Tensor, role: str, gemm: str, row: bool, col: bool):
        """``t`` [tokens, C] quantized as operand ``role`` of ``gemm`` if ``row``, and of wgrad
        (transposed, :meth:`_wgrad_layout`) if ``col``; None for a copy not asked for. Delayed scaling
        records ``t``'s amax either way.

        NVFP4 with 1x16 blocks on a BF16 CUDA operand takes the fused quantizer (``kernels/nvfp4.py``,
        bit-exact with the reference): two reads of ``t`` for both copies; a TP or CP part of the operand
        all-reduces the kernel's amaxes, unless it rounds stochastically (the kernel draws by local place). The native path takes its codes and block scales as QTensors (it writes the emulation's
        BF16 operands as well: one extra write, left until a Blackwell GPU can measure it).
        """
        recipe, encode_scale = self.recipe, self._delayed_scale(role, t)
        split, stochastic = self.split(role), recipe.operand(role, gemm).stochastic
        if recipe.scaling is Scaling.NVFP4 and not (split and stochastic) and (row or col):
            from lpbench.precision.kernels import nvfp4

            if recipe.block == nvfp4.BLOCK and capability.nvfp4_kernel(t):
                copies = nvfp4.quantize(
                    t,
                    row=row,
                    col=col,
                    rht=recipe.rht_wgrad,
                    signs=recipe.rht_signs,
                    stochastic=stochastic,
                    seed=noise.seed31(noise.key(self, role, "fused", t.device)) if stochastic else None,
                    with_codes=self.native,
                    reduce_amax=(lambda amax: self.reduce_amax(role, amax)) if split else None,
                )
                return tuple(self.kernel.fp4_operand(c, nvfp4.BLOCK) for c in copies)
        spec_col = recipe.operand(role, "wgrad")
        return (
            self._quantize(t, role, gemm, encode_scale) if row else None,
            self._quantize(self._wgrad_layout(t, spec_col), role, "wgrad", encode_scale) if col else None,
        )

    def _weight_operands(self, weight: torch.Tensor, dgrad: bool) -> tuple[QTensor, QTensor | None]:
        """The weight quantized for fprop and (if ``dgrad``) dgrad, or as FSDP all-gathered it in FP8.

        Where the dgrad copy's blocks are the fprop copy's transposed (square 2-D blocks, e.g. NVFP4's
        16x16, or one scale for the whole tensor) it is the fprop copy transposed, not quantized again.
        """
        gathered = fp8_allgather.gathered(self, weight)
        if gathered is not None:
            codes, dec = gathered
            wq = QTensor(codes, dec.reshape(1, 1), tuple(codes.shape), self.recipe.element_format("weight"))
            return wq, wq.t() if dgrad else None
        enc = self._delayed_scale("weight", weight)
        wq = self._quantize(weight, "weight", "fprop", enc)
        if not dgrad:
            return wq, None
        spec = self.recipe.operand("weight", "fprop")
        if spec == self.recipe.operand("weight", "dgrad") and spec.block[0] == spec.block[1] and not spec.stochastic:
            return wq, wq.t()
        return wq, self._quantize(weight.t(), "weight", "dgrad", enc)

    def _wgrad_layout(self, t: torch.Tensor, spec: QSpec) -> torch.Tensor:
        """[tokens, C] → [C, tokens'] for the wgrad GEMM: zero-pad, transpose, optional RHT."""
        multiple = math.lcm(spec.block[1] or 1, RHT_SIZE if self.recipe.rht_wgrad else 1, self.kernel.token_multiple)
        t = F.pad(t, (0, 0, 0, -t.shape[0] % multiple)).t()
        return apply_rht(t, self.recipe.rht_signs) if self.recipe.rht_wgrad else t

    def _kernel_for(self, x: torch.Tensor, weight_shape: tuple[int, int]):
        """The kernel of this call: the module's where it takes ``x`` and a weight of ``weight_shape``, else its
        fallback."""
        return self.kernel if self.kernel.takes(x, weight_shape) else self.kernel.fallback

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue=None) -> torch.Tensor:
        """The GEMMs on plain tensors (under TP, this rank's shards), then ``epilogue`` (see :class:`QuantizedLinearFn`;
        inside its Function where the kernel takes it, else applied to the output with autograd)."""
        if x.numel() == 0:  # e.g. an MoE expert that got no tokens
            y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))  # no FLOPs
            return y if epilogue is None else epilogue.apply(y)
        kernel = self._kernel_for(x, weight.shape)
        if epilogue is None or (
            hasattr(kernel, "epilogue_operands") and bias is None and self.recipe.operand("input", "wgrad") is not None
        ):
            return QuantizedLinearFn.apply(x, weight, bias, self, kernel, epilogue)
        return epilogue.apply(QuantizedLinearFn.apply(x, weight, bias, self, kernel))


class QuantizedLinear(QuantizedGemms, nn.Linear):
    """``nn.Linear`` whose three GEMMs follow a precision recipe (same parameters and names)."""

    tp_aware = True  # runs its GEMMs on tensor-parallel shards (local_linear)

    def __init__(self, in_features, out_features, bias=True, *, recipe: Recipe, native=False, device=None, dtype=None):
        nn.Linear.__init__(self, in_features, out_features, bias, device=device, dtype=dtype)
        self._init_gemms(recipe, native, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, *, native: bool = False) -> QuantizedLinear:
        """A QuantizedLinear sharing ``linear``'s parameter objects."""
        q = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            recipe=recipe,
            native=native,
            device="meta",
        )
        q.weight, q.bias = linear.weight, linear.bias
        q._init_histories(linear.weight.device)
        return q

    @property
    def takes_epilogue(self) -> bool:
        """Whether :meth:`forward` takes an ``epilogue`` (precision/kernels/swiglu.py's ``swiglu_of``): not under tensor
        parallelism, whose parallel style converts the module's output after ``forward``."""
        return not isinstance(self.weight, DTensor)

    def forward(self, x: torch.Tensor, epilogue=None) -> torch.Tensor:
        """``x · weightᵀ + bias``, then ``epilogue`` (e.g. SwiGLU, :class:`QuantizedLinearFn`) if one is given."""
        x = x.to(compute_dtype(x))
        if epilogue is None:
            return local_linear(self, x, self._linear)
        if not self.takes_epilogue:
            raise ValueError("an epilogue under tensor parallelism: apply it to the module's output instead")
        return self._linear(x, self.weight, self.bias, epilogue)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.describe()}"


class ExpertGemms(QuantizedGemms, nn.Module):
    """One MoE expert's projection: the recipe's GEMMs and their state, the weight passed in per call."""

    def __init__(self, recipe: Recipe, native: bool = False, device=None):
        nn.Module.__init__(self)
        self._init_gemms(recipe, native, device)

    def extra_repr(self) -> str:
        return self.describe()

"""Frozen linears stored quantized: a LoRA base weight quantized once, its high-precision copy freed.

A frozen weight never changes, so quantizing it every step (as :class:`QuantizedLinear` does for a
trained weight) repeats the same work and keeping its BF16 copy costs memory. A
:class:`FrozenQuantizedLinear` holds, from construction on, exactly the weight operands that
``QuantizedLinear`` builds each step from the same weight:

    fprop  Y  = X · Wᵀ   W  quantized along in_features   (``recipe.operand("weight", "fprop")``)
    dgrad  dX = dY · W   Wᵀ quantized along out_features  (``recipe.operand("weight", "dgrad")``)

One copy serves both GEMMs when the recipe quantizes W and Wᵀ alike (one scale per tensor, or
square 2-D blocks: FP8 tensorwise / delayed / blockwise, NVFP4); row-wise and MX recipes scale
along each GEMM's own reduction dim, so they keep two copies (MXFP8: about BF16's bytes).
Inputs and output gradients are quantized per step exactly as in ``QuantizedLinear`` (delayed
scaling keeps input and grad amax histories and scales; the weight is cast once with the scale
Transformer Engine's rule gives after recording its amax, FP8_MAX / amax / 2**margin: a frozen
weight's history never holds another amax); there is no weight-gradient GEMM. So outputs and input gradients equal
those of a ``QuantizedLinear`` over the same frozen weight. The module runs its recipe's kernel, the fused FP8 one
included (``kernels/fp8_linear.py``): the kernel reads the stored codes as its operands (``stored_operand``) and
transposes the shared copy's codes for dgrad (``stored_t``: in tiles on CUDA).

Codes and scales are frozen uint8 parameters holding raw bytes (E2M1 codes packed two per byte),
flat, their dtypes and shapes kept aside: ``Module.to(dtype)`` cannot cast them, DDP broadcasts them
whatever NCCL supports, and FSDP2 shards them like any parameter and all-gathers them as the bytes
they are (``parallel/dp.py`` keeps them out of the parameter dtype), so a sharded base is
gathered as its codes and scales, never in BF16. FSDP2's all-gather extension
(``fsdp_pre_all_gather``, as ``fp8_allgather.py`` uses for trained weights) is not needed here: a
frozen weight's codes never change, so the shard itself is what is sent.

Under tensor parallelism (:meth:`FrozenQuantizedLinear.tp_local`) each rank keeps the rows (column-wise
split) or columns (row-wise) of the stored codes and scales that its shard of the weight has; the split
never cuts a quantization block (``tp_multiple``), so the local operands are exactly those of the whole
weight. The caller (``convert/lora.py``) then runs the split's communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lpbench.precision.formats import pack_e2m1, unpack_e2m1
from lpbench.gemm import compute_dtype
from lpbench.precision.linear import QuantizedGemms, QuantizedLinear, QuantizedLinearFn
from lpbench.precision.quantize import QTensor, Scaling, delayed_scaled_max, delayed_update, quantize
from lpbench.precision.recipes import Recipe


class FrozenQuantizedLinear(QuantizedGemms, nn.Module):
    """A frozen linear whose weight is stored only in the recipe's quantized format (see the module doc):
    :class:`QuantizedLinearFn` without a weight, so with the stored operands and no weight gradient."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe, *, native: bool = False):
        super().__init__()
        self._init_gemms(recipe, native, weight.device, roles=("input", "grad"))
        (self.out_features, self.in_features), self.weight_dtype = weight.shape, weight.dtype
        frozen = isinstance(bias, nn.Parameter) and not bias.requires_grad  # kept: a meta model's name for it
        self.bias = bias if bias is None or frozen else nn.Parameter(bias.detach(), requires_grad=False)
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._blocks: dict[str, tuple] = {}
        spec_f, spec_d = recipe.operand("weight", "fprop"), recipe.operand("weight", "dgrad")
        self.shared = spec_f == spec_d and spec_f.block[0] == spec_f.block[1]
        w = weight.detach()
        enc = None
        if recipe.scaling is Scaling.DELAYED:  # the scale TE's rule gives once this weight's amax is recorded
            enc = torch.ones((), device=w.device)
            delayed_update(
                torch.zeros(1, device=w.device),
                enc,
                w.abs().amax().float(),
                delayed_scaled_max(recipe.element_format("weight"), recipe.margin),
            )
        self._store("w", quantize(w, spec_f, encode_scale=enc))
        if not self.shared:
            self._store("wt", quantize(w.t(), spec_d, encode_scale=enc))

    @classmethod
    def from_linear(cls, linear: QuantizedLinear) -> FrozenQuantizedLinear:
        """The stored form of ``linear`` (its recipe, path and delayed-scaling histories and scales)."""
        new = cls(linear.weight, linear.bias, linear.recipe, native=linear.native)
        if hasattr(linear, "_noise_index"):  # its stochastic rounding's draws (lpbench.precision.noise)
            new._noise_index = linear._noise_index
            new.register_buffer("noise_index", linear.noise_index.clone(), persistent=False)
        if linear.recipe.scaling is Scaling.DELAYED:
            for role in ("input", "grad"):
                new.amax_history(role).copy_(linear.amax_history(role))
                new.scale_buffer(role).copy_(linear.scale_buffer(role))
        return new

    @torch.no_grad()
    def stored_values(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole values of this module's stored parameters (flat bytes, by name) for the whole weight
        ``weight``: quantized as construction quantizes it, then cut to this rank's rows or columns as
        :meth:`tp_local` cut this module (its ``tp_shard``, set under tensor parallelism). A model built on the
        meta device gets its stored base from these, one weight at a time."""
        whole = FrozenQuantizedLinear(weight.to(self.weight_dtype), None, self.recipe, native=self.native)
        shard = getattr(self, "tp_shard", None)
        if shard is not None:
            whole.tp_local(shard.dim, shard.index(weight.device))
        if whole._layout != self._layout:
            raise ValueError(f"stored operands {whole._layout} do not match this module's {self._layout}")
        return {name: getattr(whole, name).detach() for name in self._layout}

    @property
    def tp_multiple(self) -> int:
        """A tensor-parallel split must keep whole blocks (``parallel/tp.py: apply_tp`` checks it)."""
        return self.recipe.block or 1

    def _put(self, name: str, t: torch.Tensor) -> None:
        self._layout[name] = (t.dtype, tuple(t.shape))
        setattr(self, name, nn.Parameter(t.contiguous().reshape(-1).view(torch.uint8), requires_grad=False))

    def _get(self, name: str, parts: dict | None = None) -> torch.Tensor:
        dtype, shape = self._layout[name]
        return (parts or {}).get(name, getattr(self, name)).view(dtype).reshape(shape)

    def _store(self, name: str, q: QTensor) -> None:
        codes = q.codes
        if q.fmt.dtype is None:  # an odd width (NVFP4 pads partial blocks) packs with a zero code at the end
            codes = pack_e2m1(F.pad(codes, (0, codes.shape[1] % 2))).view(torch.uint8)
        self._put(f"{name}_codes", codes)
        self._put(f"{name}_scale", q.scale)
        if q.global_scale is not None:
            self._put(f"{name}_global", q.global_scale)
        self._blocks[name] = (q.block, q.fmt, q.codes.shape[1])

    def _stored(self, name: str, parts: dict | None = None) -> QTensor:
        block, fmt, width = self._blocks[name]
        codes = self._get(f"{name}_codes", parts)
        if fmt.dtype is None:
            codes = unpack_e2m1(codes)[:, :width]
        glob = self._get(f"{name}_global", parts) if f"{name}_global" in self._layout else None
        return QTensor(codes, self._get(f"{name}_scale", parts), block, fmt, glob)

    @torch.no_grad()
    def dequantized(self, parts: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The weight this module holds, dequantized (FP32; under TP this rank's rows or columns) from its fprop
        copy: what :meth:`merge_lora_delta` adds to. ``parts``: its stored parameters' whole bytes by name, where
        they are sharded (FSDP)."""
        return self._stored("w", parts).dequantize()

    @torch.no_grad()
    def tp_local(self, dim: int, index: torch.Tensor) -> None:
        """Keep this rank's part of the stored weight: rows (``dim`` 0) or columns (``dim`` 1) ``index``
        of W (the unsharded positions, in local order: ``parallel/tp.py: TPShard.index``); Wᵀ's copy is
        cut along the other dim. Whole blocks only (``tp_multiple``); the bias follows the rows."""
        for name in list(self._blocks):
            q = self._stored(name)
            axis = dim if name == "w" else 1 - dim
            codes = q.codes.index_select(axis, index.to(q.codes.device))
            if q.scale.numel() == 1:  # one scale for the whole tensor: the block is now the local tensor
                scale, block = q.scale, tuple(codes.shape)
            else:
                blocks = torch.unique_consecutive(index // q.block[axis])
                scale, block = q.scale.index_select(axis, blocks.to(q.scale.device)), q.block
            for part in ("codes", "scale", "global"):
                self._layout.pop(f"{name}_{part}", None)
                self._parameters.pop(f"{name}_{part}", None)
            self._store(name, QTensor(codes, scale, block, q.fmt, q.global_scale))
        if dim == 0 and self.bias is not None:
            self.bias = nn.Parameter(
                self.bias.detach().index_select(0, index.to(self.bias.device)), requires_grad=False
            )
        if dim == 0:
            self.out_features = len(index)
        else:
            self.in_features = len(index)

    def weight_operand(self, gemm: str, kernel):
        """The stored weight operand of ``gemm`` as ``kernel`` reads it: W for "fprop", Wᵀ for "dgrad" (quantized
        along the last dim; the shared copy's codes transposed by the kernel)."""
        q = self._stored("w" if gemm == "fprop" or self.shared else "wt")
        if gemm == "dgrad" and self.shared:
            q = QTensor(kernel.stored_t(q.codes), q.scale.t(), (q.block[1], q.block[0]), q.fmt, q.global_scale)
        return kernel.stored_operand(q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(compute_dtype(x))
        if x.numel() == 0:  # e.g. an MoE expert that got no tokens
            y = x.new_zeros(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        kernel = self._kernel_for(x, (self.out_features, self.in_features))
        return QuantizedLinearFn.apply(x, None, self.bias, self, kernel)

    @torch.no_grad()
    def merge_lora_delta(self, delta: torch.Tensor) -> QuantizedLinear:
        """``lora.merge_lora``'s hook: a frozen QuantizedLinear with weight dequantize(W) + delta."""
        w = self.dequantized()
        w = w + delta.to(w.device).float()
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device=w.device, dtype=self.weight_dtype
        )
        linear.weight.copy_(w)
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        linear.requires_grad_(False)
        return QuantizedLinear.from_linear(linear, self.recipe, native=self.native)

    def extra_repr(self) -> str:
        copies = "one copy for fprop and dgrad" if self.shared else "fprop and dgrad copies"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"stored quantized ({copies}), {self.describe()}"
        )

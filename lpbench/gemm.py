"""The compute dtype's GEMMs: BF16 GEMMs fast on every CPU (the BF16 or the FP32 route, chosen once per process),
FP32-accumulated GEMMs of BF16-exact operands, GEMMs on tensor-parallel shards (:func:`local_linear`) and the
two all-reduces of hand-split tensor-parallel layers (:class:`GradAllReduce`, :class:`AllReduce`: MoE experts, LoRA).

Below ``models`` and ``precision`` (both call it), so neither imports the other for a GEMM.

BF16 GEMMs that are fast on every CPU:

PyTorch's BF16 matmul is fast only on CPUs with BF16 matrix instructions (AVX512-BF16, AMX, Arm's
BF16 extension); elsewhere it is emulated, far slower than FP32 (``benchmarks/cpu_routes.py``). On such a CPU a BF16 GEMM is computed here as an FP32 GEMM over the BF16 operands:
a product of two BF16 values is exact in FP32 and both routes accumulate in FP32, so only the
summation order differs, and the output is rounded to BF16 as the BF16 GEMM rounds it (gradients
too: autograd rounds them where the BF16 graph does). Hand-written because autocast has no such
policy; lpbench's linears call :func:`linear`, attention :func:`attention` and the quantized GEMMs
:func:`mm_fp32` instead of anything patching torch.

``LPBENCH_CPU_GEMM=bf16|fp32`` forces a route (default ``auto``: from the CPU's capability).
"""

from __future__ import annotations

import os
import platform

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

ENV = "LPBENCH_CPU_GEMM"
ROUTES = ("bf16", "fp32")


def native_bf16_cpu() -> str | None:
    """The CPU's BF16 matrix feature (``amx_bf16``, ``avx512_bf16``, ``arm_bf16``), or None."""
    cpu = getattr(torch, "cpu", None)
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx_bf16"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512_bf16"
    if platform.machine().lower() in ("aarch64", "arm64"):
        if platform.system() == "Darwin":  # Apple M2 and later
            import subprocess

            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True)
            return "arm_bf16" if out.stdout.strip() == "1" else None
        try:
            with open("/proc/cpuinfo") as f:
                features = {w for line in f if line.lower().startswith("features") for w in line.split()}
        except OSError:
            return None
        return "arm_bf16" if "bf16" in features else None
    return None


def decide_route() -> str:
    """``bf16`` or ``fp32`` as ``LPBENCH_CPU_GEMM`` forces or the CPU's capability decides; the bad value if invalid."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced != "auto":
        return forced
    return "bf16" if native_bf16_cpu() else "fp32"


def route() -> str:
    """``bf16`` (torch's BF16 GEMMs) or ``fp32`` (FP32 GEMMs over BF16 operands) for CPU BF16 GEMMs."""
    if _route not in ROUTES:
        from lpbench.errors import UsageError

        raise UsageError(f"{ENV}={_route!r}: valid values are auto, bf16, fp32")
    return _route


def describe() -> str:
    """The route and why, for a run's first log line."""
    forced = os.environ.get(ENV, "auto").strip().lower() in ROUTES
    if route() == "fp32":
        why = f"{ENV}=fp32" if forced else f"no native BF16 on this CPU: {torch.backends.cpu.get_cpu_capability()}"
        return f"CPU BF16 GEMMs as FP32 ({why})"
    why = f"{ENV}=bf16" if forced else native_bf16_cpu()
    return f"CPU BF16 GEMMs native ({why})"


def fp32_route(x: torch.Tensor) -> bool:
    """Whether a GEMM of ``x`` (in its compute dtype, :func:`compute_dtype`) takes the FP32 route."""
    return x.device.type == "cpu" and route() == "fp32" and compute_dtype(x) == torch.bfloat16


_route = decide_route()  # once per process, at import: compiled code reads it as a constant


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear of ``x`` computes in: the autocast dtype if autocast is on, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, except that a BF16 linear (under BF16 autocast, or of BF16 x and weight) on a
    CPU with the FP32 route is an FP32 GEMM over the BF16-rounded operands, rounded to BF16."""
    if not fp32_route(x) or not (torch.is_autocast_enabled("cpu") or weight.dtype == torch.bfloat16):
        return F.linear(x, weight, bias)
    bf16 = torch.bfloat16
    with torch.autocast("cpu", enabled=False):
        b = None if bias is None else bias.to(bf16).float()
        return F.linear(x.to(bf16).float(), weight.to(bf16).float(), b).to(bf16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; in BF16 on a CPU with the FP32 route, in FP32 over the
    BF16 q, k, v with the output rounded to BF16. Unlike a GEMM this differs from the BF16 kernel by
    more than summation order: that kernel rounds its softmax probabilities to BF16 before
    multiplying them with v, the FP32 route does not (it is the more exact of the two)."""
    if not fp32_route(q):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with torch.autocast("cpu", enabled=False):
        q, k, v = (t.bfloat16().float() for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, **kwargs).bfloat16()


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 a · bᵀ of operands exactly representable in BF16, accumulated in FP32.

    CUDA multiplies them as BF16 with FP32 output; a CPU always in FP32 (both routes: torch has no
    CPU BF16 GEMM with FP32 output, and the products are exact either way).
    """
    if a.is_cuda:
        return torch.mm(a.bfloat16(), b.bfloat16().t(), out_dtype=torch.float32)
    return a.float() @ b.float().t()


def hp_mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unquantized a · bᵀ with operands rounded to ``dtype``, FP32 accumulation and result."""
    if a.is_cuda and dtype != torch.float32:
        return torch.mm(a.to(dtype), b.to(dtype).t(), out_dtype=torch.float32)
    return a.to(dtype).float() @ b.to(dtype).float().t()


class _CastOnce(torch.autograd.Function):
    """``w.to(w16.dtype)`` with the cast already done: forward returns the cached ``w16``, backward casts
    the gradient back to ``w``'s dtype, as the cast's own backward does (so training is bit-identical)."""

    @staticmethod
    def forward(ctx, w, w16):
        ctx.dtype = w.dtype
        return w16.view_as(w16)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def cast_once(w: torch.Tensor, cached: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``w`` as the autocast GEMM on ``x`` would use it, from ``cached`` (its BF16 copy, :mod:`lpbench.convert.weight_cache`), or
    None where that copy does not apply (no copy, autocast off or to another dtype)."""
    kind = x.device.type
    if cached is None or not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) != cached.dtype:
        return None
    return _CastOnce.apply(w, cached)


def local_linear(module: nn.Linear, x: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn(x, weight, bias)`` on the plain local shards of a tensor-parallel linear.

    For a Linear subclass with its own GEMMs (a quantized linear): call this from ``forward``
    and declare ``tp_aware = True`` (:func:`lpbench.parallel.tp.apply_tp` refuses Linear subclasses without it).
    Column-wise (weight ``Shard(0)``): the output is ``Shard(-1)``. Row-wise (``Shard(1)``):
    a partial sum, reduced by the parallel style, with the replicated bias added after the
    reduction. Not tensor parallel: ``fn`` on the module's own tensors. Differentiable.
    """
    w, b = module.weight, module.bias
    if not isinstance(w, DTensor):
        return fn(x, w, b)
    mesh, (placement,) = w.device_mesh, w.placements
    if placement == Shard(0):  # column-wise: x replicated, its gradient a partial sum over ranks
        y = fn(x.to_local(grad_placements=[Partial()]), w.to_local(), None if b is None else b.to_local())
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
    if placement == Shard(1):  # row-wise: x sharded on its last dim, the output a partial sum
        y = DTensor.from_local(fn(x.to_local(), w.to_local(), None), mesh, [Partial()], run_check=False)
        return y if b is None else y + b
    raise ValueError(f"local_linear: unsupported weight placement {placement}")


class GradAllReduce(torch.autograd.Function):
    """Identity; the gradient all-reduced (summed) over ``group``: a tensor-parallel input whose ranks each
    contribute part of its gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllReduce(torch.autograd.Function):
    """Partial sums summed over ``group`` (a tensor-parallel output); the gradient passes unchanged (each rank's
    part saw all of it)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None

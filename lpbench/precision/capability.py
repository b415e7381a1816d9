"""What this device and this torch can run natively, and the one decision native or emulated.

A recipe runs natively when :func:`why_emulated` gives None: the GPU has the recipe's
``native_capability`` and torch has what ``NATIVE`` lists for its scaling, unless the run asks
for emulation everywhere (``--emulate always``, :func:`emulation_reason`). Inside a native
recipe, a call whose shape or dtype no native kernel takes runs the emulated path (same numerics):
the predicates below say which kernel takes which call. Everything that decides availability is
here; the kernels only run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lpbench.precision.quantize import QTensor, Scaling

try:  # the one check for Triton (the kernels import it from here)
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch ships without Triton
    triton = tl = None


def kernel_op(name: str, mutates_args=()):
    """``torch.library.triton_op`` where Triton is installed; the plain function elsewhere (never
    called there: no CUDA), so a CPU-only torch does not warn "Triton not available" at import."""
    return torch.library.triton_op(name, mutates_args=mutates_args) if triton is not None else (lambda fn: fn)


EMULATE_ALWAYS = "always"  # --emulate always: emulate even where the device runs the recipe natively
FORCED = "--emulate always (this device runs it natively)"

# Each scaling's native kernel (``lpbench.precision.linear.KERNELS``; its compute capability is the recipe's
# ``native_capability``): the one entry a new scaling kind adds here.
NATIVE = {
    Scaling.TENSOR: "FusedFp8",  # torch._scaled_mm, compiler-fused casts (kernels/fp8_linear.py)
    Scaling.DELAYED: "FusedFp8",
    Scaling.ROW: "NativeScaledMM",  # torch._scaled_mm with row scales
    Scaling.BLOCK: "NativeBlockwise",  # F.scaled_mm BlockWise1x128/128x128 (cuBLAS from CUDA 12.9, Hopper only)
    Scaling.MX: "NativeBlockScaled",  # F.scaled_mm BlockWise1x32 (kernels/block_scaled.py; MXFP8 only)
    Scaling.NVFP4: "NativeBlockScaled",  # F.scaled_mm BlockWise1x16 (kernels/block_scaled.py)
}


def why_emulated(recipe, device: torch.device | str) -> str | None:
    """Why ``device`` cannot run the quantized recipe's GEMMs natively; None when it can. The one place that
    decides: every quantized recipe whose check passes here runs lpbench's native kernels."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type} has no low-precision GEMMs"
    if recipe.scaling not in NATIVE or recipe.native_capability is None:
        return f"lpbench has no native kernel for {recipe.scaling} scaling yet"
    capability = torch.cuda.get_device_capability(device)
    if recipe.scaling is Scaling.BLOCK and not blockwise_gemm(capability):
        return (
            f"its native GEMM (torch's F.scaled_mm, cuBLAS from CUDA 12.9) runs on Hopper (SM 9.x) only; "
            f"this GPU has {capability[0]}.{capability[1]}, torch CUDA {torch.version.cuda}"
        )
    if capability < recipe.native_capability:
        major, minor = recipe.native_capability
        return f"it needs compute capability {major}.{minor}, this GPU has {capability[0]}.{capability[1]}"
    if recipe.scaling in (Scaling.MX, Scaling.NVFP4):
        if recipe.scaling is Scaling.MX and recipe.fwd_format == "e2m1":
            return "torch's CUDA MXFP4 GEMM needs a build with FBGEMM GenAI kernels, which stock wheels lack"
        return block_scaled_unavailable()
    return None


def emulation_reason(recipe, device: torch.device | str, emulate: bool | str) -> str | None:
    """Why the quantized recipe's GEMMs run emulated on ``device`` in a run with ``emulate`` (True: where the
    device lacks them; False: never; ``"always"``: everywhere); None when they run natively. A recipe the device
    cannot run natively gets the device's reason whatever ``emulate`` says: the caller refuses it unless allowed."""
    reason = why_emulated(recipe, device)
    if reason is None and emulate == EMULATE_ALWAYS:
        return FORCED
    return reason


def native_supported(recipe, device: torch.device | str) -> bool:
    """True when ``device`` runs the recipe's GEMMs natively (lpbench has the kernel and the GPU the format)."""
    return not recipe.quantized or why_emulated(recipe, device) is None


def blockwise_gemm(capability: tuple[int, int]) -> bool:
    """``F.scaled_mm``'s FP8 blockwise GEMM: Hopper (SM 9.x) with cuBLAS from CUDA 12.9 on."""
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return hasattr(F, "scaled_mm") and cuda >= (12, 9) and capability[0] == 9


def block_scaled_unavailable() -> str | None:
    """Why this torch cannot call the MXFP8/NVFP4 block-scaled GEMMs (None when it can)."""
    kinds = getattr(getattr(F, "ScalingType", None), "BlockWise1x16", None)
    if not hasattr(F, "scaled_mm") or kinds is None or not hasattr(F, "SwizzleType"):
        return (
            f"torch {torch.__version__} has no F.scaled_mm with 1x32/1x16 block scaling "
            "(ScalingType.BlockWise1x32/1x16, SwizzleType.SWIZZLE_32_4_4)"
        )
    return None


def blockwise_shape(a: QTensor, b: QTensor) -> bool:
    """Whether ``F.scaled_mm`` takes blockwise a · bᵀ: 1x128 blocks for a, 1x128 or 128x128 for b,
    every dim a multiple of 128, and (128x128 b) a multiple of 4 scale columns, so that cuBLAS's
    padded scale layout is the plain one."""
    (m, k), n = a.codes.shape, b.codes.shape[0]
    ok = a.block == (1, 128) and b.block in ((1, 128), (128, 128)) and not (m % 128 or n % 128 or k % 128)
    return ok and (b.block[0] == 1 or (k // 128) % 4 == 0)


def fused_fp8_linear(x: torch.Tensor, weight_shape: tuple[int, int]) -> bool:
    """Whether the fused FP8 tensorwise/delayed linear takes the call of input ``x`` and a weight of
    ``weight_shape`` [out, in]: CUDA, every GEMM dim a multiple of 16 (what ``torch._scaled_mm`` takes)."""
    tokens = x.numel() // x.shape[-1]
    return x.is_cuda and tokens % 16 == 0 and weight_shape[0] % 16 == 0 and weight_shape[1] % 16 == 0


def fp8_cast_kernel(t: torch.Tensor) -> bool:
    """Whether the one-pass FP8 cast kernel takes ``t``: a plain 2-D CUDA tensor (16-bit activations and
    gradients, FP32 master weights; a tensor-parallel DTensor is not one)."""
    return (
        triton is not None
        and t.is_cuda
        and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and t.dim() == 2
        and not isinstance(t, DTensor)
    )


def nvfp4_kernel(x: torch.Tensor) -> bool:
    """Whether the fused NVFP4 quantizer takes ``x``: a 2-D BF16 CUDA tensor."""
    return triton is not None and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2

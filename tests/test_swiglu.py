"""SwiGLU's hand-written backward (``lpbench/precision/kernels/swiglu.py``) against eager autograd of ``silu(gate) * up``:
bit for bit on CUDA and on the CPU route, and the Triton kernel's indexing under the interpreter."""

import os

import pytest
import torch
import torch.nn.functional as F

from lpbench.precision.kernels import swiglu as sw
from lpbench.precision import capability

SPECIALS = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 89.0, -104.0, 3e38, -3e38, float("inf"), float("-inf"), float("nan")]


def _eager(gate_up, grad):
    """(output, gradient of gate_up) by eager autograd of the model's former expression."""
    x = gate_up.detach().clone().requires_grad_()
    gate, up = x.chunk(2, dim=-1)
    y = F.silu(gate) * up
    y.backward(grad)
    return y.detach(), x.grad


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(shape, generator=g) * 4).to(dtype)
    gate_up.view(-1)[: 2 * len(SPECIALS) : 2] = torch.tensor(SPECIALS, dtype=dtype)  # specials in gate and up
    gate_up.view(-1)[1 : 2 * len(SPECIALS) : 2] = torch.tensor(SPECIALS[::-1], dtype=dtype)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    return gate_up.to(device), grad.to(device)


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_is_eager_autograd_on_cpu(dtype):
    """The Function's output and its CPU backward (eager autograd's ops) are the plain expression's bit for bit."""
    gate_up, grad = _inputs((3, 7, 2 * 40), dtype, "cpu")
    x = gate_up.clone().requires_grad_()
    y = sw.swiglu(x)
    y.backward(grad)
    want_y, want_grad = _eager(gate_up, grad)
    _same(y.detach(), want_y)
    _same(x.grad, want_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(8192, 2 * 1024), (3, 37, 2 * 200), (65, 2 * 768)])
def test_kernel_is_eager_autograd_on_cuda(dtype, shape):
    """The Triton backward is eager CUDA autograd's gradient bit for bit, specials (±0, subnormal-range,
    overflow of exp, ±inf, NaN) included, on shapes that leave partial blocks."""
    gate_up, grad = _inputs(shape, dtype, "cuda")
    x = gate_up.clone().requires_grad_()
    sw.swiglu(x).backward(grad)
    _same(x.grad, _eager(gate_up, grad)[1])


@pytest.mark.gpu
def test_compiled_swiglu_uses_the_kernel_and_is_eager_autograd(precise_casts):
    """Under torch.compile the backward is the kernel's (an opaque op to inductor): eager autograd's bit for bit,
    where inductor's own lowering of the expression is not guaranteed to be."""
    gate_up, grad = _inputs((4, 512, 2 * 1536), torch.bfloat16, "cuda", seed=1)
    x = gate_up.clone().requires_grad_()
    torch.compile(sw.swiglu)(x).backward(grad)
    _same(x.grad, _eager(gate_up, grad)[1])


@pytest.mark.skipif(
    capability.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need Triton's interpreter (TRITON_INTERPRET=1)",
)
def test_kernel_indexing_under_the_interpreter():
    """Partial blocks in both dims, both halves in the right place: the interpreter's exp is numpy's, not CUDA's,
    so close (a cancelling 1 + x(1 - s) magnifies exp's last bit) rather than bit for bit."""
    gate_up, grad = _inputs((37, 2 * 200), torch.float32, "cpu")
    gate_up, grad = gate_up.nan_to_num(0.0, 0.0, 0.0).clamp(-20, 20), grad
    out = torch.full_like(gate_up, float("nan"))
    sw.launch_backward(lambda kernel: kernel, gate_up, grad, out, launch=(16, 64, 4))
    torch.testing.assert_close(out, sw.reference_backward(gate_up, grad), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- SwiGLU as the gate+up linear's epilogue
def _epilogue_steps(recipe, device, fused, compiled=False, shape=(2, 40, 96), ffn=200, steps=3):
    """Outputs, input and weight gradients, and delayed histories/scales of ``swiglu_of`` on a quantized linear
    over ``steps`` steps, with SwiGLU as its epilogue (``fused``) or after it (``swiglu(linear(x))``)."""
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    torch.manual_seed(0)
    mod = QuantizedLinear.from_linear(
        torch.nn.Linear(shape[-1], 2 * ffn, bias=False, device=device), get_recipe(recipe), native=True
    )
    fn = (lambda x: sw.swiglu_of(mod, x)) if fused else (lambda x: sw.swiglu(mod(x)))
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(shape, generator=g) * 3).to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fn(x)
        y.backward(torch.randn(y.shape, generator=g).to(device, y.dtype))
        out += [y.detach(), x.grad, mod.weight.grad.clone()]
        mod.weight.grad = None
    if recipe == "fp8-delayed":
        out += [getattr(mod, f)(role) for f in ("amax_history", "scale_buffer") for role in ("input", "weight", "grad")]
    return out


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise"])
def test_epilogue_is_swiglu_after_the_linear_on_cpu(monkeypatch, recipe):
    """On the CPU route (the fused FP8 linear via CPU ``_scaled_mm`` where the recipe has it, else the reference
    kernel, which applies SwiGLU after its Function): SwiGLU as the epilogue gives the same outputs, gradients
    and delayed histories as SwiGLU after the linear, bit for bit."""
    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: True)
    for a, b in zip(_epilogue_steps(recipe, "cpu", True), _epilogue_steps(recipe, "cpu", False), strict=True):
        _same(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_epilogue_kernel_casts_the_gradient_as_the_linear_would(precise_casts, recipe, compiled):
    """On CUDA the fused linear quantizes gate_up's gradient inside SwiGLU's backward kernel (codes and amax for
    delayed, the amax for tensorwise): outputs, gradients and histories equal SwiGLU after the linear, bit for
    bit, eager and compiled; tokens (80) and ffn (200) leave partial tiles."""
    for a, b in zip(
        _epilogue_steps(recipe, "cuda", True, compiled), _epilogue_steps(recipe, "cuda", False, compiled), strict=True
    ):
        _same(a, b)


def _check_epilogues(launch_backward, gate_up, grad, fmt, launch=None, exact_fp8=True):
    """The kernel's amax and cast epilogues against its plain gradient: the same gradient and its amax; the
    codes of the gradient × a scale that saturates some values, row-major and transposed (not ``exact_fp8``:
    within FP8's rounding step, for the interpreter, which does not round FP8 to nearest)."""
    from lpbench.precision.kernels.fp8_linear import _codes

    plain = torch.empty_like(gate_up)
    launch_backward(lambda k: k, gate_up, grad, plain, launch=launch)
    with_amax = torch.empty_like(gate_up)
    bits = launch_backward(lambda k: k, gate_up, grad, with_amax, launch=launch, amax=True)
    _same(with_amax, plain)
    _same(bits.view(torch.float32).amax(), plain.float().abs().amax())
    finite = plain.float().nan_to_num(0.0, 0.0, 0.0).abs().amax()
    enc = (fmt.max / (finite * 0.7)).to(gate_up.device)
    q = torch.empty(gate_up.shape, dtype=fmt.dtype, device=gate_up.device)
    qt = torch.empty(gate_up.shape[::-1], dtype=fmt.dtype, device=gate_up.device)
    bits = launch_backward(lambda k: k, gate_up, grad, q, launch=launch, amax=True, cast=(enc, fmt.max, qt))
    want = _codes(plain, enc, fmt)
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())
    if exact_fp8:
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(q.float(), want.float(), rtol=0.5, atol=0)
    _same(bits.view(torch.float32).amax(), plain.float().abs().amax())


@pytest.mark.skipif(
    capability.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need Triton's interpreter (TRITON_INTERPRET=1)",
)
def test_kernel_epilogues_under_the_interpreter():
    from lpbench.precision.formats import E5M2

    gate_up, grad = _inputs((37, 2 * 200), torch.bfloat16, "cpu")
    _check_epilogues(
        sw.launch_backward,
        gate_up.nan_to_num(0.0, 0.0, 0.0).clamp(-20, 20),
        grad,
        E5M2,
        launch=(16, 64, 4),
        exact_fp8=False,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 2 * 1024), (65, 2 * 768), (3 * 37, 2 * 200)])
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_epilogues_on_cuda(shape, specials, dtype):
    """As under the interpreter, with the default launches; with specials the amax is NaN (as ``abs().amax()``)."""
    from lpbench.precision.formats import E4M3, E5M2

    gate_up, grad = _inputs(shape, dtype, "cuda")
    if not specials:
        gate_up = gate_up.nan_to_num(0.0, 0.0, 0.0).clamp(-20, 20)
    for fmt in (E4M3, E5M2):
        _check_epilogues(sw.launch_backward, gate_up, grad, fmt)

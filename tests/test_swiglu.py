"""SwiGLU's hand-written backward (``lpbench/models/swiglu.py``) against eager autograd of ``silu(gate) * up``:
bit for bit on CUDA and on the CPU route, and the Triton kernel's indexing under the interpreter."""

import os

import pytest
import torch
import torch.nn.functional as F

from lpbench.models import swiglu as sw
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
    gate_up.view(-1)[: 2 * len(SPECIALS): 2] = torch.tensor(SPECIALS, dtype=dtype)  # specials in gate and up
    gate_up.view(-1)[1: 2 * len(SPECIALS): 2] = torch.tensor(SPECIALS[::-1], dtype=dtype)
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


@pytest.mark.skipif(capability.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels on CPU need Triton's interpreter (TRITON_INTERPRET=1)")
def test_kernel_indexing_under_the_interpreter():
    """Partial blocks in both dims, both halves in the right place: the interpreter's exp is numpy's, not CUDA's,
    so close (a cancelling 1 + x(1 - s) magnifies exp's last bit) rather than bit for bit."""
    gate_up, grad = _inputs((37, 2 * 200), torch.float32, "cpu")
    gate_up, grad = gate_up.nan_to_num(0.0, 0.0, 0.0).clamp(-20, 20), grad
    out = torch.full_like(gate_up, float("nan"))
    sw.launch_backward(lambda kernel: kernel, gate_up, grad, out, launch=(16, 64, 4))
    torch.testing.assert_close(out, sw.reference_backward(gate_up, grad), rtol=1e-4, atol=1e-5)

"""LM head + cross-entropy over chunks of tokens: the [tokens, vocab] logits never exist in FP32.

Run eagerly, the unfused head keeps the logits [N, V] in the compute dtype for backward, and the
loss and its backward each make FP32 copies of them (4 bytes x N x V: 4.2 GB at 8192 tokens of a
128K vocabulary). Here the forward takes ``chunk`` tokens at a time through the same GEMM, softmax in
FP32 and the logits' gradient, rounds that gradient to the compute dtype as the unfused backward
does, and computes both GEMMs of the backward before returning: the input's per chunk; the
weight's on CUDA as one GEMM over a buffer of the rounded logits' gradient (the unfused GEMM, in
the compute dtype), on a CPU, which multiplies in FP32 anyway, chunk by chunk into an FP32 sum
rounded once (so no [tokens, vocab] array exists). Nothing of the logits is kept for backward,
which only hands the two gradients on. Compiled on CUDA, the unfused head already keeps no FP32
logits (inductor fuses the softmax), so there this is no smaller and no faster (benchmarks/RESULTS.md), and
it is opt-in (``--fused-loss``).

The gradient of the logits must be scaled before it is rounded, so the scale that ``backward``
will bring (1 / gradient accumulation in training) is given to the forward as ``grad_scale``;
``backward`` multiplies by ``grad / grad_scale``, exactly 1.0 when it matches. So the loss and the
gradients of hidden states and weight equal the unfused path's up to FP32 summation order.
Hand-written because PyTorch has no chunked linear + cross-entropy; the GEMMs are
:mod:`lpbench.gemm`'s, so a CPU takes the same BF16 route as every other linear.
"""

from __future__ import annotations

import torch

from lpbench import gemm

IGNORE_INDEX = -100
CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 24}  # FP32 logits of one chunk: 1 GiB on CUDA, 64 MiB elsewhere


def default_chunk(vocab_size: int, device: torch.device) -> int:
    """Tokens per chunk: about :data:`CHUNK_ELEMENTS` logits (2,093 tokens of a 128K vocabulary on CUDA)."""
    return max(1, CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"] // vocab_size)


def _chunk_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """FP32 logits of a chunk, their log-sum-exp and the summed loss of its labelled tokens."""
    logits = gemm.linear(x, weight).float()
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels != IGNORE_INDEX
    target = logits.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    return logits, lse, valid, torch.where(valid, lse - target, 0.0).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, grad_scale, chunk):
        n = (labels != IGNORE_INDEX).sum()
        scale = torch.full((), grad_scale, device=x.device) / n  # as cross_entropy's backward: grad / n
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = grad_logits = None
        if ctx.needs_input_grad[1] and x.is_cuda:
            grad_logits = x.new_empty(x.shape[0], weight.shape[0])
        elif ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, device=x.device, dtype=torch.float32)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits, lse, valid, part = _chunk_loss(x[rows], weight, labels[rows])
            loss = loss + part
            # d(mean loss)/d(logits) = (softmax - onehot) / n on labelled tokens, times the caller's scale
            probs = torch.exp(logits - lse[:, None])
            probs.scatter_add_(1, torch.where(valid, labels[rows], 0)[:, None], -valid[:, None].float())
            g = (probs * torch.where(valid, scale, 0.0)[:, None]).to(x.dtype)
            if grad_x is not None:
                grad_x[rows] = gemm.linear(g, weight.t())
            if grad_logits is not None:
                grad_logits[rows] = g
            elif grad_w is not None:
                grad_w += gemm.mm_fp32(g.t(), x[rows].t())
        if grad_logits is not None:
            grad_w = gemm.linear(grad_logits.t(), x.t())
        elif grad_w is not None:
            grad_w = grad_w.to(x.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.grad_scale = grad_scale
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        grad_x, grad_w = ctx.saved_tensors
        factor = grad / ctx.grad_scale  # 1.0 when backward brings the scale the forward assumed
        return (
            None if grad_x is None else grad_x * factor.to(grad_x.dtype),
            None if grad_w is None else grad_w * factor.to(grad_w.dtype),
            None,
            None,
            None,
        )


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grad_scale: float = 1.0, chunk: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy (FP32) of ``x @ weight.T`` against ``labels`` (-100 ignored), chunked over tokens.

    ``x`` [..., D] and ``weight`` [V, D] are cast to the compute dtype (autocast's, else x's) as a
    linear would cast them; ``grad_scale`` is the gradient the loss will get in backward.
    """
    dtype = gemm.compute_dtype(x)
    x, weight, labels = x.reshape(-1, x.shape[-1]).to(dtype), weight.to(dtype), labels.reshape(-1)
    chunk = chunk or default_chunk(weight.shape[0], x.device)
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(x, weight, labels, float(grad_scale), chunk)
        total = sum(
            _chunk_loss(x[i : i + chunk], weight, labels[i : i + chunk])[3] for i in range(0, x.shape[0], chunk)
        )
        return total / (labels != IGNORE_INDEX).sum()

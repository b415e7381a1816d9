"""Chunked LM head + cross-entropy: the unfused head's loss and gradients up to summation order."""

import pytest
import torch
import torch.nn.functional as F

from lpbench.models import build_model
from lpbench.models.decoder import Linear, configure_loss
from lpbench.models.fused_loss import linear_cross_entropy
from lpbench.models.registry import get_model_config, with_overrides
from lpbench import gemm

N, D, V, CHUNK = 40, 32, 96, 16  # three chunks, the last one short


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def inputs(seed: int):
    x, w = randn(N, D, seed=seed), randn(V, D, seed=seed + 1, scale=0.3)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed + 2))
    labels[torch.randperm(N, generator=torch.Generator().manual_seed(seed + 3))[:7]] = -100
    return x, w, labels


def run(fused: bool, x, w, labels, autocast: bool, accum: int):
    """Loss and gradients of x and w with the loss backward-scaled by 1 / accum, as training does."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if fused:
            loss = linear_cross_entropy(x, w, labels, grad_scale=1.0 / accum, chunk=CHUNK)
        else:
            head = Linear(D, V, bias=False)
            head.weight = torch.nn.Parameter(w)
            loss = F.cross_entropy(head(x).float(), labels, ignore_index=-100)
            w = head.weight
    (loss / accum).backward()
    return loss.detach(), x.grad, w.grad


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("accum", [1, 3, 8])
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16", "fp32"])
def test_loss_and_gradients_equal_unfused(autocast, accum):
    for seed in (0, 10):  # fresh inputs: the same function on any input
        x, w, labels = inputs(seed)
        loss, gx, gw = run(True, x, w, labels, autocast, accum)
        ref_loss, ref_gx, ref_gw = run(False, x, w, labels, autocast, accum)
        assert loss.dtype == torch.float32 and gx.dtype == ref_gx.dtype and gw.dtype == ref_gw.dtype
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
        # BF16: the logits and their gradient rounded where the unfused path rounds them; a rare last-bit
        # flip from the order of FP32 sums is all that may differ (an extra rounding would be ~1e-3)
        tol = 2e-4 if autocast else 1e-6
        assert rel(gx, ref_gx) <= tol and rel(gw, ref_gw) <= tol
        assert torch.all(gx[labels == -100] == 0) and torch.all(gx[labels != -100].abs().sum(-1) > 0)


def test_bf16_gemms_take_the_cpu_route(monkeypatch):
    """Every GEMM goes through the gemm module: per chunk the logits and the input's gradient (gemm.linear,
    BF16 out) and the weight's gradient (gemm.mm_fp32, summed in FP32)."""
    calls = []
    for name in ("linear", "mm_fp32"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, _n=name, _f=real, **k: calls.append((_n, a[0].shape)) or _f(*a, **k))
    x, w, labels = inputs(0)
    run(True, x, w, labels, autocast=True, accum=1)
    per_chunk = lambda n: [("linear", (n, D)), ("linear", (n, V)), ("mm_fp32", (V, n))]
    assert calls == per_chunk(16) + per_chunk(16) + per_chunk(8)


def test_no_grad_gives_the_same_loss():
    x, w, labels = inputs(5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, labels, chunk=CHUNK)
    assert loss.item() == pytest.approx(run(True, x, w, labels, True, 1)[0].item(), rel=1e-6)


def tiny_model():
    cfg = with_overrides(get_model_config("tiny"), vocab_size=V)
    return build_model(cfg, device="cpu", seed=3)


def test_decoder_training_step_equals_unfused():
    """A model's loss and every parameter's gradient (tied embeddings too) are the unfused head's."""
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    grads = []
    for fused in (True, False):
        model = tiny_model()
        assert configure_loss(model, fused, 0.5) is fused
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels)
        (loss / 2).backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, g), (ref_loss, ref_g) = grads
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert g.keys() == ref_g.keys()
    for name in g:
        assert rel(g[name], ref_g[name]) <= 2e-4, name


def test_not_fused_where_the_head_is_not_a_plain_linear():
    model = tiny_model()
    model.lm_head = torch.nn.Linear(model.cfg.dim, V, bias=False)  # e.g. a recipe's replacement
    assert configure_loss(model, True, 1.0) is False and model.fused_loss_scale is None


@pytest.mark.gpu
def test_cuda_loss_and_gradients_equal_unfused():
    """On CUDA the weight's gradient is one BF16 GEMM over the buffered logits' gradient, as unfused."""
    x, w, labels = (t.cuda() for t in inputs(20))
    out = []
    for fused in (True, False):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (
                linear_cross_entropy(xx, ww, labels, 1 / 3, chunk=CHUNK)
                if fused
                else F.cross_entropy(F.linear(xx, ww).float(), labels, ignore_index=-100)
            )
        (loss / 3).backward()
        out.append((loss.detach(), xx.grad, ww.grad))
    (loss, gx, gw), (ref_loss, ref_gx, ref_gw) = out
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    assert rel(gx, ref_gx) <= 2e-4 and rel(gw, ref_gw) <= 2e-4

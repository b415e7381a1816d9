"""lpbench's grouped FP8 GEMM (kernels/grouped_mm.py) against the definition: each expert's decoded codes through an
FP32 matmul, times the row and column decode scales, rounded to BF16."""

import pytest
import torch

from lpbench.precision import grouped

pytestmark = pytest.mark.gpu

# expert row counts: uneven with an idle expert; every row to one expert; qwen3-like small experts
COUNTS = {"uneven": [70, 0, 200, 33, 5], "one-expert": [0, 0, 300, 0], "small": [24] * 40}


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the kernel runs on SM 9.x")


def _layout(counts):
    padded = [(c + grouped.ALIGN - 1) // grouped.ALIGN * grouped.ALIGN for c in counts]
    offs = torch.tensor(padded).cumsum(0).to(torch.int32).cuda()
    starts = [int(o) - p for o, p in zip(offs.tolist(), padded)]
    return offs, list(zip(starts, counts)), int(offs[-1]) + 48  # a buffer with rows after the last expert


def _assert_gemm_close(got: torch.Tensor, ref: torch.Tensor, ref_abs: torch.Tensor) -> None:
    """``got`` (BF16) is ``ref`` (FP32) but for BF16's rounding and the GEMM's own summation: the FP8 tensor cores
    sum each 128-long slice in reduced precision before the FP32 promotion (errors up to 0.36 % of the sum of the
    products' magnitudes ``ref_abs`` were seen on an H200), so the bound is relative to ``ref_abs``; a wrong row,
    expert or scale misses by the size of the result itself (~sqrt(K) times more)."""
    err = (got.float() - ref).abs()
    assert (err <= 2**-8 * ref.abs() + 2**-7 * ref_abs).all(), (err / ref_abs).max()


def _codes(*shape, gen):
    """E4M3 codes spread over the format's range (powers of two from 2^-6 to 2^6, both signs)."""
    mag = torch.randn(*shape, generator=gen) * torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())
    return mag.clamp(-448, 448).to(torch.float8_e4m3fn).cuda()


@pytest.mark.parametrize("case", COUNTS)
def test_forward_grouped_mm_is_the_reference(case):
    """2-D x 3-D (forward and data gradient): every expert's rows times its weight, rows after the last expert left
    as they were, the zero padding rows of each expert zero."""
    _hopper()
    from lpbench.precision.kernels import grouped_mm as gm

    gen = torch.Generator().manual_seed(0)
    counts = COUNTS[case]
    E, N, K = len(counts), 384, 512
    offs, spans, R = _layout(counts)
    a, b = _codes(R, K, gen=gen), _codes(E, N, K, gen=gen)
    for s, c in spans:  # the grouped buffer's padding rows are zeros
        a[s + c : s + (-c % grouped.ALIGN) + c] = 0
    sa, sb = (torch.rand(R, generator=gen) + 0.5).cuda(), (torch.rand(E, N, generator=gen) + 0.5).cuda()
    out = torch.full((R, N), 7.0, dtype=torch.bfloat16, device="cuda")
    gm.launch(lambda k: k, a, b, sa, sb.reshape(-1), offs, out, False)
    ref, ref_abs = torch.full((R, N), 7.0, device="cuda"), torch.zeros(R, N, device="cuda")
    for e, (s, c) in enumerate(spans):
        end = int(offs[e])
        scale = sa[s:end, None] * sb[e][None, :]
        ref[s:end] = (a[s:end].float() @ b[e].float().t()) * scale
        ref_abs[s:end] = (a[s:end].float().abs() @ b[e].float().abs().t()) * scale
    _assert_gemm_close(out, ref, ref_abs)
    assert torch.equal(out[int(offs[-1]) :].float(), ref[int(offs[-1]) :])
    done = int(offs[-1])
    assert torch.equal(gm.grouped_mm(a, b, sa, sb, offs)[:done], out[:done])  # the op
    # torch's precise grouped GEMM sums in the same order: the same bits
    theirs = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16)
    assert torch.equal(theirs[:done], out[:done])


@pytest.mark.parametrize("case", COUNTS)
def test_weight_gradient_grouped_mm_is_the_reference(case):
    """2-D x 2-D (weight gradient): each expert reduces over its own rows only; an expert without rows gets zeros."""
    _hopper()
    from lpbench.precision.kernels import grouped_mm as gm

    gen = torch.Generator().manual_seed(1)
    counts = COUNTS[case]
    E, M, N = len(counts), 320, 256
    offs, spans, R = _layout(counts)
    a, b = _codes(M, R, gen=gen), _codes(N, R, gen=gen)
    sa, sb = (torch.rand(E, M, generator=gen) + 0.5).cuda(), (torch.rand(E, N, generator=gen) + 0.5).cuda()
    got = gm.grouped_mm(a, b, sa, sb, offs)
    theirs = torch._scaled_grouped_mm(a, b.t(), sa.reshape(-1), sb.reshape(-1), offs=offs, out_dtype=torch.bfloat16)
    assert torch.equal(got, theirs)  # torch's precise grouped GEMM sums in the same order: the same bits
    start = 0
    for e, end in enumerate(offs.tolist()):
        ae, be, scale = a[:, start:end].float(), b[:, start:end].float(), sa[e][:, None] * sb[e][None, :]
        _assert_gemm_close(got[e], (ae @ be.t()) * scale, (ae.abs() @ be.abs().t()) * scale)
        if end == start:
            assert not got[e].any()
        start = end


def test_takes_only_precise_small_experts_on_hopper():
    """The kernel replaces torch's only where it was measured faster: precise accumulation into BF16 of experts whose
    weights have fewer than SMALL_EXPERT elements."""
    _hopper()
    from lpbench.precision.kernels import grouped_mm as gm

    E, K = 8, 256
    x = torch.zeros(1024, K, dtype=torch.float8_e4m3fn, device="cuda")
    small = torch.zeros(E, gm.SMALL_EXPERT // K - 128, K, dtype=torch.float8_e4m3fn, device="cuda")
    large = torch.zeros(E, gm.SMALL_EXPERT // K, K, dtype=torch.float8_e4m3fn, device="cuda")
    assert gm.takes(x, small, False, torch.bfloat16)
    assert not gm.takes(x, large, False, torch.bfloat16)
    assert not gm.takes(x, small, True, torch.bfloat16)
    assert not gm.takes(x, small, False, torch.float32)
    assert not gm.takes(x[:, :200], small[..., :200], False, torch.bfloat16)  # not a multiple of BK
    dy_t, x_t = torch.zeros(small.shape[1], 1024, device="cuda"), torch.zeros(K, 1024, device="cuda")
    assert gm.takes(dy_t, x_t, False, torch.bfloat16)  # weight gradient: [N, rows] x [K, rows]
    assert not gm.takes(torch.zeros(large.shape[1], 1024, device="cuda"), x_t, False, torch.bfloat16)


@pytest.mark.parametrize("operands", ["fp8", "bf16"])
@pytest.mark.parametrize("case", COUNTS)
def test_weight_gradient_into_an_fp32_buffer_is_the_reference(case, operands):
    """The weight gradient added into an FP32 buffer (what the buffer held plus each expert's FP32 product, never
    rounded to BF16): FP8 codes with their scales, or BF16 operands as autograd holds them (dy [R, M] and x [R, N],
    read transposed); an expert without rows leaves its slice as it was."""
    _hopper()
    from lpbench.precision.kernels import grouped_mm as gm

    gen = torch.Generator().manual_seed(2)
    counts = COUNTS[case]
    E, M, N = len(counts), 320, 256
    offs, spans, R = _layout(counts)
    if operands == "fp8":
        a, b = _codes(M, R, gen=gen), _codes(N, R, gen=gen)
        sa, sb = (torch.rand(E, M, generator=gen) + 0.5).cuda(), (torch.rand(E, N, generator=gen) + 0.5).cuda()
    else:
        a = torch.randn(R, M, generator=gen).bfloat16().cuda().t()
        b = torch.randn(R, N, generator=gen).bfloat16().cuda().t()
        sa = sb = None
    assert gm.takes_wgrad_into(a, b, torch.empty(E, M, N, device="cuda"))
    before = torch.randn(E, M, N, generator=gen).cuda()
    out = before.clone()
    gm.wgrad_into(out, a, b, offs, sa, sb)
    start = 0
    for e, end in enumerate(offs.tolist()):
        ae, be = a[:, start:end].float(), b[:, start:end].float()
        scale = sa[e][:, None] * sb[e][None, :] if sa is not None else 1.0
        product, magnitude = (ae @ be.t()) * scale, (ae.abs() @ be.abs().t()) * scale
        # FP32 out: only the GEMM's own summation (FP8's 128-long slices; BF16 in FP32) and the final add round
        err = (out[e] - before[e] - product).abs()
        assert (err <= 2**-20 * before[e].abs() + 2**-7 * magnitude + 1e-6).all(), (err / magnitude).max()
        if end == start:
            assert torch.equal(out[e], before[e])
        start = end

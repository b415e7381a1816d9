"""The fast FP8 tensorwise and delayed casts against the reference quantizer: identical codes and scales.

The casts are plain torch ops that torch.compile fuses, or Triton kernels; the ops are checked eagerly
and compiled on CPU and, compiled by inductor, on CUDA (``gpu`` tests); the Triton kernels on CUDA and,
under Triton's interpreter (``TRITON_INTERPRET=1``), on CPU.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpbench.precision import capability
from lpbench.precision.formats import E4M3, E5M2
from lpbench.precision.kernels.fp8_linear import cast, producer_cast
from lpbench.precision.quantize import delayed_scaled_max, delayed_update, fp8_encode_scale, quantize_fp8

SHAPES = [(256, 512), (1000, 300), (64, 4096), (4097, 130)]


def _tensorwise(x, fmt, write_t=True):
    amax = x.abs().amax().float()
    return cast(x, amax, fp8_encode_scale(amax, fmt), fmt, write_t)


def _same(q, qt, dec, ref):
    assert torch.equal(q.cpu().view(torch.uint8), ref.codes.view(torch.uint8))
    if qt.numel():
        assert torch.equal(qt.cpu().view(torch.uint8), ref.codes.t().contiguous().view(torch.uint8))
    assert torch.equal(dec.cpu().reshape(()), ref.scale.reshape(())) or (dec.isnan().all() and ref.scale.isnan().all())


def _inputs(shape, dtype, device="cpu"):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])
    return x.to(dtype).to(device)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_matches_reference_on_cpu(shape, dtype, fmt):
    x = _inputs(shape, dtype)
    _same(*_tensorwise(x, fmt), quantize_fp8(x, fmt))


@pytest.mark.parametrize("amax_case", ["zero", "tiny", "inf", "nan"])
def test_edge_scales_match_reference(amax_case):
    x = torch.randn(64, 32)
    x = {
        "zero": x * 0,
        "tiny": x * 1e-40,
        "inf": x.index_put_((torch.tensor(3), torch.tensor(4)), torch.tensor(float("inf"))),
        "nan": x.index_put_((torch.tensor(3), torch.tensor(4)), torch.tensor(float("nan"))),
    }[amax_case]
    q, qt, dec = _tensorwise(x, E4M3)
    ref = quantize_fp8(x, E4M3)
    if amax_case in ("inf", "nan"):
        assert dec.isnan() and ref.scale.isnan()
    else:
        _same(q, qt, dec, ref)


def test_encode_scale_is_the_correctly_rounded_quotient():
    # amaxes whose FP32 quotient torch's scalar division (reciprocal, then multiply) gets wrong
    amax = torch.rand(100_000, dtype=torch.float64).float() * 1000 + 1e-3
    exact = (torch.full_like(amax, 448.0, dtype=torch.float64) / amax.double()).float()
    assert torch.equal(fp8_encode_scale(amax, E4M3), exact)
    assert not torch.equal(448.0 / amax, exact)  # the double rounding the scale must avoid exists


def test_delayed_scale_matches_reference():
    x = torch.randn(512, 256, dtype=torch.bfloat16) * 3
    amax, enc = x.abs().amax().float(), torch.tensor(37.3)  # a stored scale that saturates some values
    _same(*cast(x, amax, enc, E4M3, True), quantize_fp8(x, E4M3, encode_scale=enc))
    q, rows = producer_cast(x, enc, E4M3)
    assert torch.equal(q.view(torch.uint8), quantize_fp8(x, E4M3, encode_scale=enc).codes.view(torch.uint8))
    assert torch.equal(rows, x.float().abs().amax(dim=-1)) and torch.equal(rows.amax(), amax)


def _norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _swiglu(x, w):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler"
)
@pytest.mark.parametrize("producer", [_norm, _swiglu], ids=["rmsnorm", "swiglu"])
def test_cast_fused_into_its_producer_is_the_cast_of_the_materialised_operand(precise_casts, producer):
    """Inductor fuses ``producer_cast`` into the kernel that makes the operand; with emulate_precision_casts
    (as ``run`` compiles) the BF16 rounding of the operand is kept, so the codes and the amax are those of
    the BF16 tensor the unfused producer writes, bit for bit (without it they are not: the fused kernel
    casts the unrounded FP32 value)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 512, generator=g) * torch.logspace(-2, 2, 512)).bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).bfloat16()
    enc = torch.tensor(448.0 / 300)
    fused = torch.compile(lambda x, w, enc: producer_cast(producer(x, w), enc, E4M3))
    q, rows = fused(x, w, enc)
    t = torch.compile(producer)(x, w)  # the unfused producer: its BF16 output materialised
    ref = quantize_fp8(t, E4M3, encode_scale=enc)
    assert torch.equal(q.view(torch.uint8), ref.codes.view(torch.uint8))
    assert torch.equal(rows, t.float().abs().amax(dim=-1))


INTERPRETED = pytest.mark.skipif(
    capability.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU need Triton's interpreter (TRITON_INTERPRET=1)",
)
AMAXES = [0.0, 3.0, 10.0, 0.0, 5.0, float("inf"), 2.0, float("nan"), 7.5, 1e-39, 0.5, 6.0, 1e-38, 3e38]


def _device_or_interpreter(device):
    return pytest.param(device, marks=pytest.mark.gpu if device == "cuda" else INTERPRETED)


@pytest.mark.parametrize("device", [_device_or_interpreter("cuda"), _device_or_interpreter("cpu")])
@pytest.mark.parametrize(
    "length, margin, algo, fmt",
    [(1024, 0, "max", E4M3), (5, 2, "max", E5M2), (1, 0, "max", E4M3), (4, 1, "most_recent", E4M3)],
)
def test_record_kernel_is_the_reference_update(device, length, margin, algo, fmt):
    """The Triton update (decode scale of the cast, history, scale in one launch) against ``delayed_update``;
    the amax given whole, as 3 partial amaxes or as 5,000 (more than one loop trip of the reduction)."""
    from lpbench.precision.kernels import fp8_cast

    history, scale = torch.zeros(length, device=device), torch.ones((), device=device)
    ref_history, ref_scale = torch.zeros(length), torch.ones(())
    smax = delayed_scaled_max(fmt, margin)
    for step, a in enumerate(AMAXES):
        amax = torch.tensor(a)
        parts = [
            amax,
            torch.tensor([a * 0.5, a, 0.0]),
            torch.full((5000,), a * 0.5).index_fill(0, torch.tensor(4321), a),
        ]
        dec = fp8_cast.record_amax(history, scale, parts[step % 3].to(device), history, smax, algo)
        want = quantize_fp8(torch.tensor([[a]]), fmt, encode_scale=ref_scale).scale.reshape(())
        assert torch.equal(dec.cpu(), want) or (dec.isnan().item() and want.isnan().item()), step
        delayed_update(ref_history, ref_scale, amax, smax, algo)
        assert torch.equal(scale.cpu(), ref_scale), (step, scale.item(), ref_scale.item())
        assert torch.equal(history.cpu().nan_to_num(-1.0), ref_history.nan_to_num(-1.0)), step


@pytest.mark.parametrize("device", [_device_or_interpreter("cuda"), _device_or_interpreter("cpu")])
@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (130, 70), (257, 1000)])
def test_transpose_codes_moves_the_bytes(device, shape):
    from lpbench.precision.kernels import fp8_cast

    codes = torch.randint(0, 256, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    qt = fp8_cast.transpose_codes(codes.to(device))
    assert qt.dtype == codes.dtype and qt.shape == shape[::-1] and qt.is_contiguous()
    assert torch.equal(qt.cpu().view(torch.uint8), codes.t().contiguous().view(torch.uint8))


def _fwd_bwd(mod, weight, bias, step, device):
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(step)).to(device).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = mod(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + step)).to(device)
    y.backward(dy.to(y.dtype))
    out = (y.float(), x.grad.float(), weight.grad.float(), bias.grad.float())
    weight.grad = bias.grad = None
    return out


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler"
)
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_compiled_fast_linear_equals_eager_on_cpu(monkeypatch, precise_casts, recipe):
    """torch.compile of the fast path (CPU ``_scaled_mm``) computes the eager fast path's codes:
    the BF16 rounding of the autocast input is kept (``emulate_precision_casts``, as ``run`` sets)."""
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: True)
    torch._dynamo.reset()
    mods = [QuantizedLinear.from_linear(torch.nn.Linear(256, 384), get_recipe(recipe), native=True) for _ in range(2)]
    mods[1].load_state_dict(mods[0].state_dict())
    compiled = torch.compile(mods[1])
    for step in range(2):
        eager = _fwd_bwd(mods[0], mods[0].weight, mods[0].bias, step, "cpu")
        comp = _fwd_bwd(compiled, mods[1].weight, mods[1].bias, step, "cpu")
        assert torch.equal(eager[1], comp[1]) and torch.equal(eager[2], comp[2])  # dx, dW: same codes, same GEMMs
        assert (eager[0] - comp[0]).norm() / eager[0].norm() < 5e-3  # y: the bias add may round once or twice
    if recipe == "fp8-delayed":
        for role in ("input", "weight", "grad"):
            assert torch.equal(mods[0].amax_history(role), mods[1].amax_history(role))
            assert torch.equal(mods[0].scale_buffer(role), mods[1].scale_buffer(role))


# ------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_compiled_cast_matches_reference_on_cuda(shape, dtype, fmt):
    torch._dynamo.reset()
    fn = torch.compile(_tensorwise, dynamic=False)
    x = _inputs(shape, dtype, "cuda")
    _same(*fn(x, fmt), quantize_fp8(x.cpu(), fmt))  # the CPU reference: IEEE arithmetic throughout


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fast_linear_matches_emulated_reference(precise_casts, recipe, compiled):
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    torch.manual_seed(0)
    torch._dynamo.reset()
    fast = QuantizedLinear.from_linear(torch.nn.Linear(256, 384, device="cuda"), get_recipe(recipe), native=True)
    ref = QuantizedLinear.from_linear(torch.nn.Linear(256, 384, device="cuda"), get_recipe(recipe), native=False)
    ref.load_state_dict(fast.state_dict())
    for step in range(3):  # delayed scaling: steps 2 and 3 use the recorded history
        got = _fwd_bwd(torch.compile(fast) if compiled else fast, fast.weight, fast.bias, step, "cuda")
        want = _fwd_bwd(ref, ref.weight, ref.bias, step, "cuda")
        for a, b in zip(got, want):
            assert (a - b).norm() / b.norm() < 5e-3  # same codes and scales; BF16 outputs, other summation order
    if recipe == "fp8-delayed":
        for role in ("input", "weight", "grad"):
            assert torch.equal(fast.amax_history(role), ref.amax_history(role))
            assert torch.equal(fast.scale_buffer(role), ref.scale_buffer(role))


@pytest.mark.parametrize(
    "recipe, fprop_fast, grads_fast",
    [
        ("fp8-tensorwise", True, False),
        ("fp8-delayed", True, False),
        ("fp8-tensorwise-no-fast-accum", False, False),
        ("fp8-tensorwise+fast-grads", True, True),
    ],
)
def test_the_recipe_decides_which_gemms_accumulate_fast(monkeypatch, recipe, fprop_fast, grads_fast):
    """As TE and torchao's linears: fast accumulation in fprop only, dgrad and wgrad in FP32; all three with
    ``fast_accum_grads`` (as torchao's MoE GEMMs)."""
    import dataclasses

    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    calls, scaled_mm = [], torch._scaled_mm

    def recording(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return scaled_mm(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(capability, "fused_fp8_linear", lambda x, w: True)
    monkeypatch.setattr(torch, "_scaled_mm", recording)
    name, _, fast_grads = recipe.partition("+")
    r = dataclasses.replace(get_recipe(name), fast_accum_grads=bool(fast_grads))
    mod = QuantizedLinear.from_linear(torch.nn.Linear(256, 384), r, native=True)
    _fwd_bwd(mod, mod.weight, mod.bias, 0, "cpu")
    assert calls == [fprop_fast, grads_fast, grads_fast]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_one_pass_delayed_cast_matches_reference_on_cuda(shape, dtype, fmt):
    from lpbench.precision.kernels import fp8_cast

    x = _inputs(shape, torch.float32).clamp(-6e4, 6e4).to(dtype)
    enc = fmt.max / (x.float().abs().max() * 0.7)  # a stored scale that saturates some values

    for write_t, with_amax in ((True, True), (False, True), (True, False)):
        q, qt, amax = fp8_cast.cast_transpose(x.cuda(), enc.cuda(), fmt, write_t, with_amax)
        ref = quantize_fp8(x, fmt, encode_scale=enc)
        assert torch.equal(q.cpu().view(torch.uint8), ref.codes.view(torch.uint8))
        if write_t:
            assert torch.equal(qt.cpu().view(torch.uint8), ref.codes.t().contiguous().view(torch.uint8))
        else:
            assert qt.numel() == 0
        if with_amax:
            assert torch.equal(amax.cpu(), x.float().abs().amax())
        else:
            assert amax.numel() == 0


@pytest.mark.gpu
def test_one_pass_amax_propagates_nan_and_inf():
    from lpbench.precision.kernels import fp8_cast

    x = torch.randn(300, 700, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    x[7, 9] = float("inf")
    assert fp8_cast.cast_transpose(x, one, E4M3, True)[2].item() == float("inf")
    x[100, 600] = float("nan")
    assert fp8_cast.cast_transpose(x, one, E4M3, True)[2].isnan()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "role, dtype", [("input", torch.bfloat16), ("grad", torch.bfloat16), ("weight", torch.float32)]
)
@pytest.mark.parametrize("compiled", [False, True])
def test_tensorwise_one_pass_cast_matches_reference_on_cuda(shape, role, dtype, compiled):
    """CUDA operands take the Triton cast-transpose after the amax: the reference's codes and scale."""
    from lpbench.precision.kernels.fp8_linear import _quantize
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    recipe = get_recipe("fp8-tensorwise")
    mod = QuantizedLinear.from_linear(torch.nn.Linear(16, 16, device="cuda"), recipe, native=True)
    fmt = recipe.element_format(role)
    x = _inputs(shape, torch.float32).clamp(-6e4, 6e4).to(dtype)
    assert capability.fp8_cast_kernel(x.cuda())
    torch._dynamo.reset()
    fn = torch.compile(_quantize, dynamic=False) if compiled else _quantize
    for write_t in (True, False):
        _same(*fn(mod, role, x.cuda(), write_t), quantize_fp8(x, fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, compiled", [(s, False) for s in SHAPES] + [(SHAPES[1], True), (SHAPES[3], True)])
@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, E4M3), (torch.bfloat16, E5M2), (torch.float32, E4M3)])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_cast_matches_reference_on_cuda(precise_casts, shape, dtype, fmt, margin, compiled):
    """Delayed scaling's CUDA path (cast with the stored scale, then decode scale and update in one launch;
    compiled 16-bit operands: the producer's torch ops and the codes' transpose): the reference's codes,
    decode scale, history and scale over steps with a first scale of 1, a zero amax and an Inf."""
    import dataclasses

    from lpbench.precision.kernels.fp8_linear import _quantize
    from lpbench.precision.linear import QuantizedLinear
    from lpbench.precision.recipes import get_recipe

    recipe = dataclasses.replace(get_recipe("fp8-delayed"), margin=margin)
    mod = QuantizedLinear.from_linear(torch.nn.Linear(16, 16, device="cuda"), recipe, native=True)
    role = "input" if fmt is E4M3 else "grad"
    ref_history, ref_scale = torch.zeros(recipe.amax_history_len), torch.ones(())
    torch._dynamo.reset()
    fn = torch.compile(_quantize, dynamic=False) if compiled else _quantize
    for step in range(4):
        x = _inputs(shape, torch.float32).clamp(-6e4, 6e4).mul(1 + step).to(dtype)
        if step == 1:
            x.zero_()  # recorded nowhere, the scale kept
        if step == 3:
            x[1, 2] = float("inf")  # the decode scale turns NaN, the history holds the Inf
        ref = quantize_fp8(x, fmt, encode_scale=ref_scale)
        delayed_update(ref_history, ref_scale, x.float().abs().amax(), delayed_scaled_max(fmt, margin))
        q, qt, dec = fn(mod, role, x.cuda(), True)
        if step < 3:
            _same(q, qt, dec, ref)
        else:
            assert dec.isnan() and ref.scale.isnan()
        assert torch.equal(mod.amax_history(role).cpu(), ref_history)
        assert torch.equal(mod.scale_buffer(role).cpu(), ref_scale)


@pytest.mark.gpu
def test_delayed_scale_of_a_tiny_amax_keeps_its_subnormal_decode_scale():
    from lpbench.precision.kernels import fp8_cast

    x = torch.full((64, 64), 1e-39, device="cuda")
    history, scale = torch.zeros(16, device="cuda"), torch.ones((), device="cuda")
    for _ in range(2):  # the second cast: the scale of the first one's amax, the FP32 max
        q, _, amax = fp8_cast.cast_transpose(x, scale.clone(), E4M3, False)
        dec = fp8_cast.record_amax(history, scale, amax, q, E4M3.max)
    ref = quantize_fp8(x.cpu(), E4M3, encode_scale=torch.tensor(torch.finfo(torch.float32).max))
    assert torch.equal(dec.cpu().reshape(()), ref.scale.reshape(())) and ref.scale.item() > 0
    assert torch.equal(q.cpu().view(torch.uint8), ref.codes.view(torch.uint8))


class _NormSwiGLU(torch.nn.Module):
    """RMSNorm -> gate_up -> SwiGLU -> down, the producers whose casts the compiled delayed path fuses;
    ``unfused``: a graph break after each producer, so its BF16 output is written and cast apart."""

    def __init__(self, recipe, unfused):
        from lpbench.precision.linear import QuantizedLinear

        super().__init__()
        self.norm = torch.nn.RMSNorm(256, device="cuda")
        self.gate_up = QuantizedLinear(256, 1024, bias=False, recipe=recipe, native=True, device="cuda")
        self.down = QuantizedLinear(512, 256, bias=False, recipe=recipe, native=True, device="cuda")
        self.unfused = unfused

    def forward(self, x):
        h = self.norm(x)
        if self.unfused:
            torch._dynamo.graph_break()
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        if self.unfused:
            torch._dynamo.graph_break()
        return self.down(a)


@pytest.mark.gpu
def test_casts_fused_into_their_producers_are_the_unfused_casts_on_cuda(precise_casts):
    """The compiled delayed path with the casts in the RMSNorm and SwiGLU kernels (forward) and SwiGLU's
    backward (gate_up's gradient), against the same model with graph breaks after each producer: the same
    outputs, the linears' weight gradients, histories and scales, bit for bit, over three steps (the first at
    scale 1.0); the input's and the norm weight's gradients up to FP32 rounding (RMSNorm's backward, which no
    cast touches, compiles into another graph and reduces in another order)."""
    from lpbench.precision.recipes import get_recipe

    recipe = get_recipe("fp8-delayed")
    torch.manual_seed(0)
    fused, unfused = _NormSwiGLU(recipe, False), _NormSwiGLU(recipe, True)
    unfused.load_state_dict(fused.state_dict())
    torch._dynamo.reset()
    runs = [torch.compile(m) for m in (fused, unfused)]
    for step in range(3):
        outs = []
        for run, mod in zip(runs, (fused, unfused)):
            x = (torch.randn(2, 512, 256, generator=torch.Generator().manual_seed(step)) * (1 + step)).cuda()
            x.requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):  # as training runs: BF16 operands
                y = run(x)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9 + step)).cuda().to(y.dtype))
            outs.append({"y": y, "dx": x.grad, **{n: p.grad.clone() for n, p in mod.named_parameters()}})
            mod.zero_grad(set_to_none=True)
        assert outs[0]["y"].dtype == torch.bfloat16
        for name in outs[0]:
            if name in ("dx", "norm.weight"):  # RMSNorm's own backward: FP32 rounding may differ
                assert (outs[0][name] - outs[1][name]).abs().max() <= 1e-5 * outs[1][name].abs().max(), step
            else:
                assert torch.equal(outs[0][name], outs[1][name]), (step, name)
        for name, buf in fused.named_buffers():
            assert torch.equal(buf, unfused.get_buffer(name)), (step, name)
    assert fused.gate_up.delayed_scale_input.item() != 1.0  # the scales moved


@pytest.mark.skipif(capability.triton is not None, reason="the warning is torch's where Triton is missing")
def test_the_triton_kernels_import_without_a_warning_where_triton_is_missing():
    code = "import lpbench.precision.kernels.fp8_cast, lpbench.precision.kernels.nvfp4"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "Triton not available" not in done.stderr, done.stderr

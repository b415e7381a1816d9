"""Optimizer-state and master-weight precision: the formats against references written from their definitions,
the low-precision AdamW against torch's AdamW with its states passed through those references, resume, FSDP2."""

import copy
import math
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from lpbench.precision import optim_states as fmt
from lpbench.precision.formats import E4M3, round_to_format
from lpbench.train import optim
from lpbench.train.optim import BETAS, EPS, LowPrecisionAdamW, decode, quantizes

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(16, 256), (8, 512), (10, 100), (32,)]  # quantized, quantized, not a whole block, a vector


# ---------------------------------------------------------------- references, from the definitions
def ref_8bit(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Blockwise dynamic quantization then decoding: per block of 256 along the last dimension, x / absmax (FP32,
    absmax at least 1e-12) to the nearest map entry (a tie to the larger), decoded as entry x absmax (FP32)."""
    qmap = fmt.dynamic_map(signed).numpy().astype(np.float64)
    rows = x.float().cpu().numpy().reshape(-1, 256)
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        absmax = np.float32(max(np.abs(row).max(), np.float32(1e-12)))
        normed = (row / absmax).astype(np.float32).astype(np.float64)
        dist = np.abs(normed[:, None] - qmap[None, :])  # exact: differences of FP32 values near each other
        nearest = 255 - np.argmin(dist[:, ::-1], axis=1)  # the last of the nearest: ties go to the larger
        out[r] = (qmap[nearest].astype(np.float32) * absmax).astype(np.float32)
    return torch.from_numpy(out.reshape(x.shape)).float().to(x.device)


def ref_fp8(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with one scale per block of 256: encode scale 448 / amax (correctly rounded FP32; 1 for a zero
    block), elements x * scale rounded to nearest even and saturated, decoded as code x (1 / scale)."""
    rows = x.float().reshape(-1, 256)
    amax = rows.abs().amax(dim=1, keepdim=True)
    enc = torch.where(amax > 0, (448.0 / amax.double()).float(), torch.ones_like(amax))
    dec = (1.0 / enc.double()).float()
    return (round_to_format(rows * enc, E4M3) * dec).reshape(x.shape)


def ref_sr(x: float, r: int) -> float:
    """FP32 -> BF16 stochastic rounding of one value with 16 random bits ``r``: away from zero when r < the
    lower 16 bits of x, else truncated."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    out = (bits & 0xFFFF0000) + (0x10000 if r < (bits & 0xFFFF) else 0)
    return struct.unpack("<f", struct.pack("<I", out))[0]


def ref_states(t: torch.Tensor, states: str, signed: bool) -> torch.Tensor:
    """A moment after being stored: FP32 as is, BF16 rounded to nearest, fp8/8bit through the references."""
    if states == "bf16":
        return t.bfloat16().float()
    if states in ("fp8", "8bit") and t.ndim >= 2 and t.numel() >= 4096 and t.shape[-1] % 256 == 0:
        return ref_fp8(t) if states == "fp8" else ref_8bit(t, signed)
    return t


# ---------------------------------------------------------------- the formats
def test_dynamic_maps_are_bitsandbytes_maps():
    signed, unsigned = fmt.dynamic_map(True), fmt.dynamic_map(False)
    for qmap in (signed, unsigned):
        assert qmap.shape == (256,) and bool((qmap[1:] > qmap[:-1]).all())  # 256 distinct values, sorted
        assert qmap.max() == 1.0 and 0.0 in qmap.tolist()
    assert unsigned.min() == 0.0 and -0.993 < signed.min() < -0.992  # 0.1 .. 1 grid of 64: last mean 0.99297
    assert (signed > 0).sum() == 128 and (signed < 0).sum() == 127  # +1 has no negative twin
    assert float(signed[signed > 0].min()) == pytest.approx(0.55e-6)  # 10**-6 x the one mean of exponent 0


@pytest.mark.parametrize("signed", [True, False])
def test_8bit_quantizer_matches_the_reference(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 512, generator=g) * torch.logspace(-6, 2, 12)[:, None]
    x[3] = 0.0  # an all-zero block
    if not signed:
        x = x.square()
    qmap = fmt.dynamic_map(signed)
    x[5, :256] = qmap[torch.randint(0, 256, (256,), generator=g)]  # map entries
    x[5, 0] = 1.0
    x[6, :255] = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()  # midpoints (ties where representable)
    x[6, 255] = 1.0  # absmax 1: the quotients are these values
    codes, absmax = fmt.quantize_8bit(x, signed)
    assert codes.dtype == torch.uint8 and absmax.shape == (12, 2)
    assert torch.equal(fmt.dequantize_8bit(codes, absmax, signed), ref_8bit(x, signed))


def test_fp8_states_match_the_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 768, generator=g) * torch.logspace(-8, 3, 6)[:, None]
    x[2] = 0.0
    codes, scale = fmt.quantize_e4m3(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    assert torch.equal(fmt.dequantize_e4m3(codes, scale), ref_fp8(x))


def test_bf16_stochastic_rounding_is_the_definition_and_unbiased():
    g = torch.Generator().manual_seed(2)
    x = torch.cat(
        [
            torch.randn(500, generator=g) * 10.0 ** torch.randint(-30, 30, (500,), generator=g),
            torch.tensor([0.0, -0.0, 3.0]),
        ]
    )
    bits = torch.randint(0, 1 << 16, x.shape, generator=g, dtype=torch.int32)
    got = fmt.bf16_stochastic_round(x, bits)
    assert got.dtype == torch.bfloat16
    assert [struct.pack("<f", v) for v in got.float().tolist()] == [
        struct.pack("<f", ref_sr(v, r)) for v, r in zip(x.tolist(), bits.tolist())
    ]
    # over all 2**16 random values the mean is the FP32 value exactly: each rounds up with probability frac / 2**16
    for v in (1.0 + 2**-9 + 2**-20, -7.3e-5, 3.0e30):
        every = fmt.bf16_stochastic_round(torch.full((1 << 16,), v), torch.arange(1 << 16, dtype=torch.int32))
        assert every.double().mean().item() == torch.tensor(v).item()
        assert len(set(every.float().tolist())) == 2  # only the two neighbours
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.3895314e38])
    out = fmt.bf16_stochastic_round(special, torch.zeros(4, dtype=torch.int32)).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 3.3895314e38


# ---------------------------------------------------------------- the optimizer
def _params(dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]


def _grads(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) * 10.0 ** (step % 3 - 2) for s in SHAPES]


def _groups(params):
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _lowp(params, states, lr=1e-2):
    return LowPrecisionAdamW(_groups(params), lr=lr, weight_decay=0.1, states=states, seed=7)


def test_fp32_weights_and_states_are_torchs_adamw():
    ours, theirs = _params(), _params()
    a, b = _lowp(ours, "fp32"), torch.optim.AdamW(_groups(theirs), lr=1e-2, betas=BETAS, eps=EPS, foreach=False)
    for step in range(4):
        for p, q, g in zip(ours, theirs, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        a.step(), b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"]) for p, q in zip(ours, theirs))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master", ["fp32", "bf16"])
@pytest.mark.parametrize("states", ["fp32", "bf16", "fp8", "8bit"])
def test_each_variant_matches_adamw_with_states_through_the_reference(states, master, device, monkeypatch):
    """The reference: torch's single-tensor AdamW in FP32 on the FP32 view of the weights; after each step its
    moments are replaced by what the format stores (reference quantizers) and a BF16 weight by the reference SR
    of the FP32 result with the bits the optimizer drew (recorded)."""
    if states == "fp32" and master == "fp32":
        pytest.skip("torch's AdamW itself: test_fp32_weights_and_states_are_torchs_adamw")
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    ours = [torch.nn.Parameter(p.detach().to(device)) for p in _params(dtype)]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = _lowp(ours, states)
    reference = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=BETAS, eps=EPS, foreach=False)
    drawn = []
    real = fmt.random_bits
    monkeypatch.setattr(fmt, "random_bits", lambda *a: drawn.append(real(*a)) or drawn[-1])
    order = [i for i, s in enumerate(SHAPES) if len(s) >= 2] + [i for i, s in enumerate(SHAPES) if len(s) < 2]
    for step in range(4):
        for p, q, g in zip(ours, ref, _grads(step)):
            p.grad, q.grad = g.to(device, dtype), g.to(device, dtype).float()
        drawn.clear()
        opt.step()
        reference.step()
        for i, q in enumerate(ref):
            st = reference.state[q]
            st["exp_avg"].copy_(ref_states(st["exp_avg"], states, signed=True))
            st["exp_avg_sq"].copy_(ref_states(st["exp_avg_sq"], states, signed=False))
            if master == "bf16":
                bits = drawn[order.index(i)].flatten().tolist()
                sr = [ref_sr(v, r) for v, r in zip(q.flatten().tolist(), bits)]
                q.data = torch.tensor(sr, device=device).reshape(q.shape)
        for p, q in zip(ours, ref):
            assert p.dtype == dtype and torch.equal(p.float(), q), (states, master, step, p.shape)
    for p, q in zip(ours, ref):  # the stored moments decode to the reference's
        st = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            value = decode(st[key], st.get(f"{key}_scale"), signed=key == "exp_avg")
            assert torch.equal(value, reference.state[q][key]), (key, p.shape)
        expected = torch.uint8 if states == "8bit" else torch.float8_e4m3fn
        if quantizes(p, states):
            assert st["exp_avg"].dtype == expected and st["exp_avg_scale"].shape == (*p.shape[:-1], p.shape[-1] // 256)
    if states == "8bit":  # one byte per element of the two matrices, FP32 for the others
        stored = sum(st["exp_avg"].element_size() * st["exp_avg"].numel() for st in opt.state.values())
        assert stored == 16 * 256 + 8 * 512 + 4 * (10 * 100 + 32)


def test_sr_draws_depend_on_seed_step_and_parameter_and_replay():
    def run(seed):
        ps = _params(torch.bfloat16)
        opt = LowPrecisionAdamW(_groups(ps), lr=1e-3, weight_decay=0.1, states="fp32", seed=seed)
        for step in range(3):
            for p, g in zip(ps, _grads(step)):
                p.grad = g.bfloat16()
            opt.step()
        return ps

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("states", ["bf16", "fp8", "8bit"])
def test_state_dict_round_trips_and_resumes_exactly(states):
    """Save after 2 steps, load into a fresh optimizer, 2 more steps: the uninterrupted run's weights and states."""
    straight, resumed = _params(torch.bfloat16), _params(torch.bfloat16)
    a, b = _lowp(straight, states), _lowp(resumed, states)
    for step in range(2):
        for p, q, g in zip(straight, resumed, _grads(step)):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        a.step(), b.step()
    saved = copy.deepcopy(b.state_dict())
    b = _lowp(resumed, states, lr=0.5)  # a new optimizer: everything comes from the state dict
    b.load_state_dict(saved)
    for key, value in saved["state"][0].items():  # codes stay codes (torch casts states to the weight's dtype)
        now = b.state[resumed[0]][key]
        assert now.dtype == value.dtype and torch.equal(
            now.view(torch.uint8) if now.element_size() == 1 else now,
            value.view(now.dtype).view(torch.uint8) if now.element_size() == 1 else value,
        )
    for step in range(2, 4):
        for p, q, g in zip(straight, resumed, _grads(step)):
            p.grad, q.grad = g.bfloat16(), g.bfloat16()
        a.step(), b.step()
    assert all(torch.equal(p, q) for p, q in zip(straight, resumed))


def test_lr_zero_step_changes_no_weight():
    """``torch.distributed.checkpoint`` makes an empty optimizer's states with one step at LR 0."""
    ps = _params(torch.bfloat16)
    before = [p.detach().clone() for p in ps]
    opt = _lowp(ps, "8bit", lr=0.0)
    for p, g in zip(ps, _grads(0)):
        p.grad = g.bfloat16()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before))


# ---------------------------------------------------------------- buckets against the per-parameter update
class PerParameterAdamW(LowPrecisionAdamW):
    """The update as lpbench first wrote it, one parameter (and row chunk) at a time: the buckets' reference."""

    @torch.no_grad()
    def step(self, closure=None):
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    state = self.state[p] or self._init_state(p)
                    state["step"] += 1
                    self._update_one(p, state, group, index)

    def _update_one(self, p, state, group, index):
        step = state["step"].item()
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        param, grad = optim._local(p), optim._local(p.grad)
        moments = [(key, optim._local(state[key]), state.get(f"{key}_scale")) for key in ("exp_avg", "exp_avg_sq")]
        sr = param.dtype == torch.bfloat16
        gen = self._generator(param.device, step, index, optim._offset(p)) if sr else None
        rows = max(1, optim.CHUNK // max(1, math.prod(param.shape[1:])))
        for lo in range(0, max(1, len(param)), rows):
            rs = slice(lo, lo + rows)
            w, g = param[rs], grad[rs].float()
            wf = w.float() if sr else w
            m, v = (
                decode(s[rs], None if sc is None else optim._local(sc)[rs], signed=k == "exp_avg")
                if sc is not None or s.dtype != torch.float32
                else s[rs]
                for k, s, sc in moments
            )
            wf.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            wf.addcdiv_(m, denom, value=-step_size)
            for (key, s, sc), value in zip(moments, (m, v)):
                if sc is not None:
                    codes, scales = (
                        fmt.quantize_8bit(value, signed=key == "exp_avg")
                        if s.dtype == torch.uint8
                        else fmt.quantize_e4m3(value)
                    )
                    s[rs].copy_(codes)
                    optim._local(sc)[rs].copy_(scales)
                elif s.dtype != torch.float32:
                    s[rs].copy_(value)
            if sr:
                w.copy_(fmt.bf16_stochastic_round(wf, fmt.random_bits(wf.shape, gen, wf.device)))


MANY_SHAPES = [(16, 256), (8, 512), (10, 100), (32,), (40, 256), (3, 7), (24, 256), (64,)]


def _same_state(a: LowPrecisionAdamW, b: LowPrecisionAdamW, pa, pb) -> bool:
    for p, q in zip(pa, pb):
        for key, x in a.state[p].items():
            y = b.state[q][key]
            if x.dtype != y.dtype or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
    return True


def _run_pair(states, master, device="cpu", compiled=False, steps=3):
    """The bucketed optimizer and the per-parameter one from the same weights and gradients; a parameter misses a
    gradient at step 1 (its step count then lags: a bucket of its own)."""
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    g = torch.Generator().manual_seed(11)
    init = [(torch.randn(s, generator=g) * 0.1).to(device, dtype) for s in MANY_SHAPES]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in init] for _ in range(2))
    a = LowPrecisionAdamW(_groups(ours), lr=1e-2, weight_decay=0.1, states=states, seed=7, compiled=compiled)
    b = PerParameterAdamW(_groups(ref), lr=1e-2, weight_decay=0.1, states=states, seed=7)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(ours, ref)):
            grad = (torch.randn(p.shape, generator=g) * 10.0 ** (step % 3 - 2)).to(device, dtype)
            p.grad, q.grad = (None, None) if (step, i) == (1, 2) else (grad, grad.clone())
        a.step(), b.step()
    return a, b, ours, ref


@pytest.mark.parametrize("master", ["fp32", "bf16"])
@pytest.mark.parametrize("states", ["fp32", "bf16", "fp8", "8bit"])
def test_buckets_are_the_per_parameter_update(states, master, monkeypatch):
    """Bit for bit, with pieces of large tensors and several buckets (CHUNK of 2048 elements: (40, 256) is cut
    into 5 pieces, the buckets hold several parameters' pieces)."""
    monkeypatch.setattr(optim, "CHUNK", 2048)
    a, b, ours, ref = _run_pair(states, master)
    assert all(p.dtype == q.dtype and torch.equal(p, q) for p, q in zip(ours, ref))
    assert _same_state(a, b, ours, ref)


def _dispatched(opt_class, n: int, master: str, states: str = "8bit") -> Counter:
    """The ATen operations (views and aliases excluded: they launch nothing) of the second step of ``opt_class``
    over ``n`` matrices of 4096 elements, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in ("detach", "alias", "lift_fresh"):
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    params = [torch.nn.Parameter(torch.randn(16, 256).to(dtype)) for _ in range(n)]
    opt = opt_class([{"params": params, "weight_decay": 0.1}], lr=1e-2, weight_decay=0.1, states=states)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        with Count() as count:
            opt.step()
    return count.ops


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_operations_per_step_do_not_grow_with_the_parameter_count(master):
    """Four matrices or forty, as many operations per step; with BF16 weights, one random draw per parameter more
    (each parameter's bits come from its own generator) and nothing else. The per-parameter loop grows."""
    few, many = _dispatched(LowPrecisionAdamW, 4, master), _dispatched(LowPrecisionAdamW, 40, master)
    extra = many - few
    assert extra == (Counter(randint=36) if master == "bf16" else Counter()), extra
    assert sum(few.values()) < 80
    old_few, old_many = _dispatched(PerParameterAdamW, 4, master), _dispatched(PerParameterAdamW, 40, master)
    assert sum(old_many.values()) > 9 * sum(old_few.values()) > 9 * sum(few.values())


def test_a_compiled_update_that_differs_falls_back_to_the_eager_one(monkeypatch):
    """The compiled update is checked against the eager one on its first bucket of each kind: one that differs
    (here: made to) is dropped with a warning, and the step is still the per-parameter one bit for bit."""

    def off_by_one_ulp(w, g, m, v, bits, scalars, *rest):
        new = optim.fused_update(w, g, m, v, bits, scalars, *rest)
        return (torch.nextafter(new[0].float(), torch.full_like(new[0].float(), 9.0)).to(new[0].dtype), *new[1:])

    monkeypatch.setattr(optim, "compiled_update", lambda: off_by_one_ulp)
    with pytest.warns(UserWarning, match="differs from the eager one on cpu"):
        a, b, ours, ref = _run_pair("8bit", "bf16", compiled=True)
    assert all(torch.equal(p, q) for p, q in zip(ours, ref)) and _same_state(a, b, ours, ref)
    assert a._compiled_ok == {torch.device("cpu"): False}


def test_same_bits_compares_bits_and_absent_scales():
    a = (torch.tensor([1.0, -0.0]), (torch.tensor([3], dtype=torch.uint8), None))
    assert optim.same_bits(a, (torch.tensor([1.0, -0.0]), (torch.tensor([3], dtype=torch.uint8), None)))
    assert not optim.same_bits(a, (torch.tensor([1.0, 0.0]), (torch.tensor([3], dtype=torch.uint8), None)))  # -0
    assert not optim.same_bits(a, (torch.tensor([1.0, -0.0]), (torch.tensor([3], dtype=torch.int8), None)))
    assert not optim.same_bits(a, (torch.tensor([1.0, -0.0]), (torch.tensor([3], dtype=torch.uint8), torch.ones(1))))


def test_the_compiled_update_is_one_graph_per_kind_of_bucket(monkeypatch):
    """On CPU (inductor's C++): the compiled update traces whole, compiles once per kind of bucket (a quantized one,
    one with FP32 states) and not again on later steps, whose scalars change; its results match the eager update
    to rounding (CPU inductor does not reproduce eager CPU's vectorized multiply-adds, so the bits are checked on
    GPU: test_the_compiled_update_is_the_per_parameter_update_on_gpu)."""
    import torch._dynamo

    monkeypatch.setattr(optim, "CHUNK", 8192)
    monkeypatch.setattr(optim, "same_bits", lambda a, b: True)  # keep the compiled update in use
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    optim.compiled_update.cache_clear()
    counters.clear()
    try:
        a, b, ours, ref = _run_pair("8bit", "bf16", compiled=True, steps=3)
    finally:
        optim.compiled_update.cache_clear()  # compiled for this CHUNK
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.float(), q.float(), atol=1e-2, rtol=0)  # a BF16 ulp or two of |w| < 1


@pytest.mark.gpu
@pytest.mark.parametrize("master", ["fp32", "bf16"])
@pytest.mark.parametrize("states", ["fp32", "bf16", "fp8", "8bit"])
def test_the_compiled_update_is_the_per_parameter_update_on_gpu(states, master, recwarn):
    """On CUDA the compiled update (the default there) matches the eager per-parameter update bit for bit, with no
    fallback to the eager one."""
    a, b, ours, ref = _run_pair(states, master, device="cuda", compiled=True)
    assert not [w for w in recwarn if "differs from the eager one" in str(w.message)]
    assert all(a._compiled_ok.values())
    assert all(torch.equal(p, q) for p, q in zip(ours, ref)) and _same_state(a, b, ours, ref)


# ---------------------------------------------------------------- FSDP2 on 2 gloo ranks
FSDP_SHAPES = [(6, 512), (5, 256), (512,), (3, 100)]  # uneven rows across 2 ranks; a 1-D and a partial-block one


def _fsdp_worker(rank, states, master):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    g = torch.Generator().manual_seed(5)
    full = [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in FSDP_SHAPES]
    optim.CHUNK = 1024  # pieces of 2 rows of 512: several buckets per rank
    params, ref = ([torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full] for _ in range(2))
    opt, ref_opt = (
        cls([{"params": ps, "weight_decay": 0.1}], lr=1e-2, weight_decay=0.1, states=states, seed=7)
        for cls, ps in ((LowPrecisionAdamW, params), (PerParameterAdamW, ref))
    )
    for step in range(3 if master == "fp32" else 1):
        gg = torch.Generator().manual_seed(50 + step)
        for p, q in zip(params, ref):
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gg).to(dtype), mesh, [Shard(0)])
            q.grad = p.grad.clone()
        opt.step(), ref_opt.step()
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(params, ref))
    same &= all(
        torch.equal(optim._local(x).view(torch.uint8), optim._local(ref_opt.state[q][k]).view(torch.uint8))
        for p, q in zip(params, ref)
        for k, x in opt.state[p].items()
        if k != "step"
    )
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(torch.nn.ParameterList(params), opt)  # the states as DCP sees them
    kinds = sorted({type(v).__name__ for st in sd["state"].values() for k, v in st.items() if k != "step"})
    return {"weights": [p.full_tensor().float().tolist() for p in params], "state_kinds": kinds, "same": same}


@pytest.mark.parametrize("states,master", [("8bit", "fp32"), ("fp8", "fp32"), ("bf16", "fp32"), ("8bit", "bf16")])
def test_fsdp2_shards_match_one_process(states, master, spawn_ranks, tmp_path):
    """Each rank's bucketed update is the per-parameter one on its shards, bit for bit. Against one process:
    FP32 weights, 3 steps: bit for bit (every block lies within a row, and FSDP2 splits rows). BF16 weights: each
    rank draws its own part's random bits, so after a step each weight is one of the two BF16 neighbours of the FP32
    result the single process rounded: within one BF16 ulp of its weight."""
    ranks = spawn_ranks(_fsdp_worker, 2, tmp_path, states, master)
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in FSDP_SHAPES]
    opt = LowPrecisionAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, weight_decay=0.1, states=states, seed=7)
    for step in range(3 if master == "fp32" else 1):
        gg = torch.Generator().manual_seed(50 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gg).to(dtype)
        opt.step()
    assert ranks[0]["state_kinds"] == ["DTensor"]  # sharded states: each rank saves its own
    assert all(r["same"] for r in ranks)  # the buckets of each rank's shards: the per-parameter update bit for bit
    for r in ranks:
        for got, p in zip(r["weights"], params):
            got = torch.tensor(got)
            if master == "fp32":
                assert torch.equal(got, p.float())
            else:
                big = torch.maximum(got.abs(), p.float().abs())
                ulp = torch.ldexp(torch.ones(()), torch.frexp(big).exponent - 8)  # BF16: 8 significant bits
                assert bool(((got - p.float()).abs() <= ulp).all())


# ---------------------------------------------------------------- the command line
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--optimizer-states", "4bit"], "unknown --optimizer-states '4bit'"),
        (["--master-weights", "fp16"], "unknown --master-weights 'fp16'"),
        (
            ["--master-weights", "bf16", "--precision", "fp32"],
            "--master-weights bf16 needs a recipe that computes in BF16",
        ),
        (["--offload-optimizer", "--nproc-per-node", "2"], "--offload-optimizer runs on one GPU"),
        (["--offload-optimizer", "--device", "cpu"], "this run has no GPU"),
    ],
)
def test_bad_values_exit_2_with_one_line(flags, message, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lpbench", "run", "--dry-run", *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not list(tmp_path.iterdir())


def test_converge_takes_lists_of_states_and_master_weights(tmp_path):
    from lpbench.bench.converge import build_configs, run_name
    from lpbench.cli import build_parser
    from lpbench.config import run_labels

    args = build_parser().parse_args(
        [
            "converge",
            "--precision",
            "fp8-tensorwise",
            "--optimizer-states",
            "bf16,fp32",
            "--master-weights",
            "bf16",
            "--tokens",
            "4096",
            "--results",
            str(tmp_path),
        ]
    )
    configs, _ = build_configs(args)
    assert [(c.precision, c.optimizer_states, c.master_weights) for c in configs] == [
        ("fp8-tensorwise", "bf16", "bf16"),
        ("fp8-tensorwise", "fp32", "bf16"),
    ]
    assert len({c.key() for c in configs}) == 2  # in the run key
    assert run_labels(configs) == ["fp8-tensorwise, optimizer-states bf16", "fp8-tensorwise, optimizer-states fp32"]
    assert run_name(configs[0], configs[0].seed, run_labels(configs)[0]) == "fp8-tensorwise-optimizer-states-bf16"
    assert "AdamW: bf16 master weights, bf16 states" in configs[0].header()


def test_run_spreads_the_lists_over_runs():
    from lpbench.cli import build_parser, configs_from_args

    args = build_parser().parse_args(["run", "--precision", "bf16,fp8-tensorwise", "--optimizer-states", "8bit,fp8"])
    configs = configs_from_args(args)
    assert [(c.precision, c.optimizer_states) for c in configs] == [
        ("bf16", "8bit"),
        ("bf16", "fp8"),
        ("fp8-tensorwise", "8bit"),
        ("fp8-tensorwise", "fp8"),
    ]


# ---------------------------------------------------------------- a run, saved and resumed
WIDE = ("test-optim", 2, 256, 256, 4, 2, 512)  # 2 blocks of width 256: every matrix holds whole blocks of 256
WIDE_RUN = dict(
    model="test-optim",
    seq_len=16,
    mbs=2,
    gbs=2,
    steps=4,
    warmup_steps=1,
    precision="bf16",
    device="cpu",
    master_weights="bf16",
    optimizer_states="8bit",
)


@pytest.fixture
def blocks_of_256(monkeypatch):
    """A run of a model whose matrices hold whole blocks of 256 (so fp8/8bit states are quantized)."""
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS, ModelConfig

    monkeypatch.setitem(MODELS, "test-optim", ModelConfig(*WIDE, max_seq_len=64))
    return RunConfig(**WIDE_RUN)


def test_a_run_with_bf16_weights_and_8bit_states_resumes_exactly(blocks_of_256, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    import lpbench.train.loop as loop

    def train(cfg):
        result = loop.train(cfg, log=lambda line: None)
        assert result.status == "ok"
        return [(s["loss"], s["grad_norm"]) for s in result.steps]

    straight = train(blocks_of_256)
    assert train(blocks_of_256.with_(save_every=2, save_dir=str(tmp_path))) == straight
    saved = FileSystemReader(str(tmp_path / "step-2")).read_metadata().state_dict_metadata
    codes = [k for k in saved if k.startswith("optim.state.") and k.endswith(".exp_avg")]
    assert codes and any(saved[k].properties.dtype == torch.uint8 for k in codes)
    assert any(k.endswith("exp_avg_sq_scale") for k in saved)
    resumed = train(blocks_of_256.with_(load=str(tmp_path / "step-2")))
    assert straight[:2] + resumed == straight  # bit for bit


def test_offload_needs_a_gpu(blocks_of_256, monkeypatch):
    import lpbench.train.loop as loop
    from lpbench.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="this run has no GPU"):
        loop.train(blocks_of_256.with_(device="auto", offload_optimizer=True), log=lambda line: None)


@pytest.mark.parametrize("master,states", [("fp32", "fp32"), ("bf16", "8bit")])
def test_offloaded_shards_train_like_one_process(master, states, blocks_of_256):
    """--offload-optimizer's layout, FSDP2 with CPUOffloadPolicy on a mesh of this process alone, on the CPU (where
    nothing moves and nothing is pinned): the optimizer the run builds for it (torch's fused AdamW, or
    LowPrecisionAdamW) on the offloaded CPU DTensors, after gradient clipping over them, trains as on the plain model
    (the first step bit for bit; then up to the rounding of the norm, which DTensor sums in another order)."""
    from lpbench.models import build_model
    from lpbench.models.registry import get_model_config
    from lpbench.parallel.dp import apply_fsdp, clip_grad_norm_, one_rank_mesh
    from lpbench.parallel.env import shutdown
    from lpbench.train.optim import build_optimizer

    cfg = blocks_of_256.with_(master_weights=master, optimizer_states=states)
    dtype = torch.bfloat16 if master == "bf16" else torch.float32

    def train(offload: bool):
        model = build_model(get_model_config(cfg.model), device="cpu", seed=0).to(dtype)
        if offload:
            model = apply_fsdp(model, one_rank_mesh(torch.device("cpu")), None, torch.float32, offload=True)
        params = [p for p in model.parameters()]
        opt = build_optimizer(model, cfg, fused=True)
        out = []
        for step in range(3):
            x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step))
            loss = model(x, x.roll(-1, 1))
            loss.backward()
            norm = clip_grad_norm_(params, 0.5, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append((loss.item(), norm.item()))
        return out, opt

    try:
        (plain, _), (offloaded, opt) = train(False), train(True)
    finally:
        shutdown()
    assert offloaded[0] == plain[0]  # the first step's loss and norm: bit for bit
    torch.testing.assert_close(offloaded, plain, rtol=1e-5, atol=0)  # then the DTensor norm's rounding
    assert (opt.defaults.get("fused") is True) == (states == "fp32")  # torch's fused AdamW runs on CPU DTensors
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("states", ["fp8", "8bit"])
def test_quantized_states_of_a_dtensor_are_made_where_its_part_lies(states):
    """Codes and scales of a DTensor parameter are DTensors over the very tensors made for them, beside its local
    part: FSDP2's CPU offload keeps the parts of a CUDA mesh on the CPU, where ``DTensor.from_local`` would have
    copied them to the GPU (the offloaded GPU test's failure)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lpbench.parallel.dp import one_rank_mesh
    from lpbench.parallel.env import shutdown

    made = []
    zeros = torch.zeros

    def recording_zeros(*args, **kwargs):
        made.append(zeros(*args, **kwargs))
        return made[-1]

    try:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 1024), one_rank_mesh(torch.device("cpu")), [Shard(0)]))
        opt = LowPrecisionAdamW([p], lr=1e-2, weight_decay=0.0, states=states)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "zeros", recording_zeros)
            state = opt._init_state(p)
    finally:
        shutdown()
    stored = [state[k] for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")]
    with torch.no_grad():  # to_local is then the local part itself, not a view of it
        assert len(made) == 4 and all(t.to_local() is m for t, m in zip(stored, made))
    assert [tuple(t.shape) for t in stored] == [(4, 1024), (4, 4)] * 2
    assert all(t.placements == p.placements for t in stored)


@pytest.mark.gpu
@pytest.mark.parametrize("master,states", [("fp32", "fp32"), ("bf16", "8bit")])
def test_offloaded_optimizer_trains_like_the_gpu_one_in_less_gpu_memory(master, states, blocks_of_256, tmp_path):
    """FSDP2 on one rank with CPU offload: the same losses up to FSDP2's BF16 embeddings (autocast keeps them FP32)
    and the CPU's optimizer arithmetic (and, with BF16 weights, the CPU generator's other stochastic-rounding
    bits: twice the tolerance), less GPU memory, and an exact resume."""
    import lpbench.train.loop as loop

    cfg = blocks_of_256.with_(device="cuda", compile=False, master_weights=master, optimizer_states=states, steps=6)

    def train(c):
        result = loop.train(c, log=lambda line: None)
        assert result.status == "ok", result.error
        return result

    try:
        on_gpu, offloaded = train(cfg), train(cfg.with_(offload_optimizer=True))
        a, b = [s["loss"] for s in on_gpu.steps], [s["loss"] for s in offloaded.steps]
        assert max(abs(x - y) for x, y in zip(a, b)) < (2e-2 if master == "bf16" else 1e-2)
        assert offloaded.metrics["peak_mem_allocated_gb"] < on_gpu.metrics["peak_mem_allocated_gb"]
        saving = train(cfg.with_(offload_optimizer=True, save_every=3, save_dir=str(tmp_path)))
        resumed = train(cfg.with_(offload_optimizer=True, load=str(tmp_path / "step-3")))
        assert [s["loss"] for s in saving.steps[3:]] == [s["loss"] for s in resumed.steps]
    finally:
        from lpbench.parallel.env import shutdown

        shutdown()  # the one-rank process group the offloaded runs started


def test_sweep_keys_make_a_grid_and_bad_values_leave_no_run():
    from lpbench.bench.sweep_spec import expand
    from lpbench.errors import UsageError

    spec = {"name": "t", "model": "tiny", "precision": ["bf16", "fp8-tensorwise"], "optimizer_states": ["fp32", "8bit"]}
    runs = expand({**spec, "master-weights": "bf16", "offload_optimizer": "off"}).runs
    assert [(r.config.precision, r.config.optimizer_states, r.config.master_weights) for r in runs] == [
        ("bf16", "fp32", "bf16"),
        ("bf16", "8bit", "bf16"),
        ("fp8-tensorwise", "fp32", "bf16"),
        ("fp8-tensorwise", "8bit", "bf16"),
    ]
    with pytest.raises(UsageError, match="unknown --optimizer-states '4bit'"):
        expand({**spec, "optimizer_states": ["4bit"]})


LOOP_SCENARIOS = {"fsdp": dict(fsdp=True), "ddp": dict()}


def _loop_worker(rank, out):
    import os

    import lpbench.train.loop as loop
    from lpbench.config import RunConfig
    from lpbench.models.registry import MODELS, ModelConfig

    MODELS["test-optim"] = ModelConfig(*WIDE, max_seq_len=64)
    base = RunConfig(**{**WIDE_RUN, "mbs": 1})
    results = {}
    for name, kw in LOOP_SCENARIOS.items():
        cfg = base.with_(**kw).with_world(2)
        folder = os.path.join(out, name)
        runs = [
            loop.train(c, log=lambda line: None)
            for c in (cfg, cfg.with_(save_every=2, save_dir=folder), cfg.with_(load=folder + "/step-2"))
        ]
        results[name] = [[(s["loss"], s["grad_norm"]) for s in r.steps] for r in runs]
    return results


def test_two_ranks_with_bf16_weights_and_8bit_states_save_and_resume_exactly(spawn_ranks, tmp_path):
    """FSDP2 and DDP on two gloo ranks through the training loop and distributed checkpoints."""
    for rank in spawn_ranks(_loop_worker, 2, tmp_path, str(tmp_path)):
        for name in LOOP_SCENARIOS:
            straight, saving, resumed = rank[name]
            assert len(straight) == 4 and saving == straight and saving[:2] + resumed == straight, name

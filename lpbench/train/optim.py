"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay.

torch's fused and foreach AdamW update a parameter group with one multi-tensor kernel, which takes
tensors of one kind only: plain tensors, or DTensors of one mesh. A model under FSDP2 with expert
parallelism holds both (FSDP-sharded DTensors, each rank's own experts as plain tensors), as does
TP with tensor-parallel experts; so each decay group is split by kind (:func:`by_kind`).

FP32 master weights with FP32 states (the default) are torch's AdamW (fused on CUDA). Any other
``--master-weights`` / ``--optimizer-states`` is :class:`LowPrecisionAdamW`: torch's single-tensor AdamW
arithmetic in FP32, its states stored in BF16, blockwise E4M3 or 8-bit dynamic quantization
(:mod:`lpbench.precision.optim_states`) and BF16 parameters rounded stochastically. torch's fused and foreach
kernels keep the states in the parameter's dtype and round to nearest, so they take none of these; torchao's
low-bit optimizers do, but torchao is optional (the formats module says why lpbench carries its own). Its update
runs on flat buckets of many parameters, on CUDA as one torch.compile'd function (:func:`compiled_update`), whose
fused kernels read and write each element once; inductor writes those kernels from the same torch ops the eager
update runs, so a hand-written Triton kernel would add code without adding speed, and the compiled update is
checked bit for bit against the eager one before it is trusted (:meth:`LowPrecisionAdamW._fused`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lpbench.config import RunConfig
from lpbench.precision import optim_states as fmt

BETAS, EPS = (0.9, 0.95), 1e-8
CHUNK = 1 << 24  # elements updated at once: bounds the FP32 temporaries of a large tensor


def by_kind(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` split into lists of one kind each (plain; DTensor per mesh), in order of first appearance;
    ``[params]`` when they are all of one kind."""
    kinds: dict = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(kinds.values()) or [params]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` (this rank's part) as a tensor of the same kind as ``p``: a DTensor of global ``shape`` placed
    as ``p`` is (its sharded dimensions lead) whose local part is ``local`` itself, where it lies (FSDP2's CPU
    offload keeps the parts of a CUDA mesh on the CPU; ``DTensor.from_local`` would copy them to the GPU, so the
    DTensor is made as FSDP2 makes its own); or ``local`` itself."""
    if not isinstance(p, DTensor):
        return local
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(p.device_mesh, p.placements, tensor_meta=meta), requires_grad=False)


def quantizes(p: torch.Tensor, states: str) -> bool:
    """Whether ``p``'s states are ``fp8`` or ``8bit`` codes (:func:`lpbench.precision.optim_states.blockwise` of its
    local part; the whole tensor's size decides, so every rank of a layout answers alike)."""
    return states in ("fp8", "8bit") and fmt.blockwise(tuple(_local(p).shape), p.numel())


def _offset(p: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's part of ``p`` starts in the whole tensor (replicas share it)."""
    if not isinstance(p, DTensor):
        return (0,) * p.ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1])


Moment = tuple[torch.Tensor, "torch.Tensor | None"]  # (values, None) or (codes, block scales)


def adamw_update(
    w: torch.Tensor,
    g: torch.Tensor,
    m: Moment,
    v: Moment,
    bits: torch.Tensor | None,
    decay: float,
    step_size: float,
    bias_correction2: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[torch.Tensor, Moment, Moment]:
    """One AdamW update of flat tensors: weights ``w`` (FP32, or BF16 rounded stochastically with ``bits``),
    gradients ``g`` and the two moments as stored; returns the new weights and moments as they are stored.

    torch's single-tensor AdamW arithmetic, op for op, in FP32: ``decay`` is 1 - lr x weight decay, ``step_size``
    lr / (1 - beta1**step), ``bias_correction2`` sqrt(1 - beta2**step)."""
    wf, g = w.float(), g.float()
    m_value, v_value = decode(*m, signed=True), decode(*v, signed=False)
    wf = wf * decay
    m_value = m_value.lerp(g, 1 - beta1)
    v_value = (v_value * beta2).addcmul(g, g, value=1 - beta2)
    denom = (v_value.sqrt() / bias_correction2) + eps
    wf = wf.addcdiv(m_value, denom, value=-step_size)
    return _stored(wf, bits, m_value, m, v_value, v)


def fused_update(
    w: torch.Tensor,
    g: torch.Tensor,
    m: Moment,
    v: Moment,
    bits: torch.Tensor | None,
    scalars: torch.Tensor,
    beta2: float,
    eps: float,
) -> tuple[torch.Tensor, Moment, Moment]:
    """:func:`adamw_update` with the step's scalars in a FP32 tensor ``scalars`` = (decay, -step_size,
    1 / bias_correction2, 1 - beta1), each computed in double and then rounded, for :func:`compiled_update`: one
    graph then serves every step. Written as eager CUDA evaluates :func:`adamw_update`: a division by a Python
    number is a multiplication by its reciprocal (taken in double, rounded to FP32), ``addcdiv`` a fused
    multiply-add of the value and the quotient, and ``lerp`` by a weight below 0.5 (1 - beta1) a fused
    multiply-add of the weight and the difference; each fused multiply-add is an ``addcmul`` with a tensor
    operand, which inductor lowers to one."""
    decay, neg_step_size, inv_bias_correction2, weight = scalars.unbind()
    wf, g = w.float(), g.float()
    m_value, v_value = decode(*m, signed=True), decode(*v, signed=False)
    wf = wf * decay
    m_value = torch.addcmul(m_value, g - m_value, weight)
    v_value = (v_value * beta2).addcmul(g, g, value=1 - beta2)
    denom = (v_value.sqrt() * inv_bias_correction2) + eps
    wf = torch.addcmul(wf, neg_step_size, m_value / denom)
    return _stored(wf, bits, m_value, m, v_value, v)


def _stored(
    wf: torch.Tensor, bits: torch.Tensor | None, m_value: torch.Tensor, m: Moment, v_value: torch.Tensor, v: Moment
) -> tuple[torch.Tensor, Moment, Moment]:
    w = wf if bits is None else fmt.bf16_stochastic_round(wf, bits)
    return w, _encode(m_value, *m, signed=True), _encode(v_value, *v, signed=False)


def decode(stored: torch.Tensor, scale: torch.Tensor | None, signed: bool) -> torch.Tensor:
    """A moment in FP32 from what is stored: values, or codes and block scales (``signed``: the first moment)."""
    if scale is None:
        return stored.float()
    if stored.dtype == torch.uint8:
        return fmt.dequantize_8bit(stored, scale, signed=signed)
    return fmt.dequantize_e4m3(stored, scale)


def _encode(value: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None, signed: bool) -> Moment:
    """A FP32 moment as ``stored`` holds it: its dtype (BF16 rounded to nearest even), or codes and block scales."""
    if scale is None:
        return value.to(stored.dtype), None
    if stored.dtype == torch.uint8:
        return fmt.quantize_8bit(value, signed=signed)
    return fmt.quantize_e4m3(value)


@functools.cache
def compiled_update():
    """:func:`fused_update` compiled (whole graph, static shapes: every bucket holds :data:`CHUNK` elements), with
    eager numerics: no fused multiply-adds but those the lowering writes on purpose (``emulate_precision_casts``),
    divisions correctly rounded (``eager_numerics.division_rounding``, or ``emulate_divison_rounding``, so spelt,
    in the torch versions without the former)."""
    options = {"emulate_precision_casts": True}
    config = torch._inductor.config
    if hasattr(config, "eager_numerics"):
        options["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_divison_rounding"):
        options["emulate_divison_rounding"] = True
    return torch.compile(fused_update, fullgraph=True, dynamic=False, options=options)


def same_bits(a: tuple, b: tuple) -> bool:
    """Whether two (nested) tuples of tensors (or None) hold the same bits."""
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        x is y is None
        or (
            x is not None
            and y is not None
            and x.dtype == y.dtype
            and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        )
        for x, y in zip(flat_a, flat_b)
    )


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in ``states`` (``fp32``, ``bf16``, ``fp8``, ``8bit``) and whose BF16
    parameters are updated with stochastic rounding.

    Each step, per parameter: its value and gradient in FP32 (a BF16 parameter's FP32 view), the moments decoded to
    FP32, torch's single-tensor AdamW update (decay, ``lerp`` of the first moment, ``mul``/``addcmul`` of the second,
    ``addcdiv`` by the bias-corrected denominator) in FP32, the moments encoded back (BF16: rounded to nearest;
    ``fp8``, ``8bit``: each block of 256 along the last dimension rescaled), and a BF16 parameter rounded
    stochastically (:func:`lpbench.precision.optim_states.bf16_stochastic_round`). FP32 parameters with FP32
    states give torch's ``AdamW(foreach=False)`` bit for bit.

    The update runs on buckets, not parameters: the parameters that share a group, a step count, a device, a dtype
    and a kind of states are cut into pieces of whole rows (at most :data:`CHUNK` elements each, which bounds the FP32
    temporaries), the pieces packed into buckets of at most :data:`CHUNK` elements, and each bucket's weights,
    gradients and moments concatenated, updated by one call of :func:`adamw_update` and copied back with one
    multi-tensor copy. The update is elementwise and the quantized states' blocks lie within rows, so a bucket
    computes what each parameter alone would, and the operations per step grow with the elements, not with the
    number of parameters (the random bits aside: see below). With ``compiled`` (the default on CUDA) the update is
    :func:`compiled_update`, whose fused kernels read and write each element once instead of once per operation;
    every bucket is then padded to :data:`CHUNK` elements so that one graph serves them all. torch's fused and
    foreach AdamW kernels cannot do this work (they keep the states in the parameter's dtype and round to
    nearest), and a Triton kernel of our own would duplicate what inductor generates from these torch ops.

    The random bits of a parameter at a step come from a generator seeded with (``seed``, step, the parameter's
    index, where this rank's part starts), drawn piece by piece (one draw per parameter and piece), so a run is
    deterministic, a resumed run draws what the uninterrupted one drew, and replicas of one tensor round alike.
    DTensor parameters (FSDP2, TP) are updated on their local parts, whose blocks are the whole tensor's
    (:func:`quantizes`); their states are DTensors placed like the parameter, which ``torch.distributed.checkpoint``
    saves and loads.
    """

    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float,
        states: str = "fp32",
        seed: int = 0,
        compiled: bool | None = None,
    ):
        super().__init__(params, dict(lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay))
        self.states, self.seed, self.compiled = states, seed, compiled
        self._compiled_ok: dict[torch.device, bool] = {}  # False: the compiled update was found to differ
        self._compiled_checked: set[tuple] = set()

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        local = _local(p)
        for key in ("exp_avg", "exp_avg_sq"):
            if quantizes(p, self.states):
                dtype = torch.uint8 if self.states == "8bit" else torch.float8_e4m3fn
                scales = (*local.shape[:-1], local.shape[-1] // fmt.BLOCK)
                state[key] = _like(p, torch.zeros(local.shape, dtype=dtype, device=local.device), tuple(p.shape))
                state[f"{key}_scale"] = _like(
                    p, torch.zeros(scales, device=local.device), (*p.shape[:-1], p.shape[-1] // fmt.BLOCK)
                )
            else:
                dtype = torch.bfloat16 if self.states == "bf16" else torch.float32
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _generator(self, device: torch.device, *key) -> torch.Generator:
        digest = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = []  # (group, index, parameter) of every parameter with a gradient
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    if not self.state[p]:
                        self._init_state(p)
                    live.append((group, index, p))
        if not live:
            return loss
        counts = [self.state[p]["step"] for _, _, p in live]
        torch._foreach_add_(counts, 1)
        runs: dict[tuple, list] = {}
        for (group, index, p), step in zip(live, torch.stack(counts).tolist()):
            key = (id(group), step, _local(p).device, p.dtype, quantizes(p, self.states))
            runs.setdefault(key, [group, step, []])[2].append((index, p))
        for group, step, members in runs.values():
            self._update_run(group, step, members)
        return loss

    def _update_run(self, group: dict, step: float, members: list) -> None:
        """Update parameters of one group, step, device, dtype and kind of states, a bucket at a time."""
        beta1, beta2 = group["betas"]
        device = _local(members[0][1]).device
        scalars = dict(
            decay=1 - group["lr"] * group["weight_decay"],
            step_size=group["lr"] / (1 - beta1**step),
            bias_correction2=(1 - beta2**step) ** 0.5,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
        )
        bucket, size = [], 0
        for index, p in members:
            local = _local(p)
            sr = local.dtype == torch.bfloat16
            gen = self._generator(device, step, index, _offset(p)) if sr else None
            rows = max(1, CHUNK // max(1, math.prod(local.shape[1:])))  # whole rows: blocks lie within rows
            for lo in range(0, len(local), rows):
                rs = slice(lo, lo + rows)
                piece = local[rs]
                if size + piece.numel() > CHUNK:
                    self._update_bucket(bucket, scalars, step)
                    bucket, size = [], 0
                bits = fmt.random_bits(piece.shape, gen, device) if sr else None
                bucket.append((p, rs, bits))
                size += piece.numel()
        if bucket:
            self._update_bucket(bucket, scalars, step)

    def _update_bucket(self, bucket: list, scalars: dict, step: float) -> None:
        """Gather the pieces ``(parameter, rows, random bits)``, update them at once, copy the results back."""
        tensors = []  # per piece: the rows of weight, gradient, moments (and their scales)
        for p, rs, _ in bucket:
            state = self.state[p]
            keys = [k for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale") if k in state]
            tensors.append([_local(t)[rs] for t in (p, p.grad, *(state[k] for k in keys))])
        scaled = len(tensors[0]) == 6
        device = tensors[0][0].device
        compiled = (device.type == "cuda" if self.compiled is None else self.compiled) and self._compiled_ok.get(
            device, True
        )
        pad = CHUNK - sum(t[0].numel() for t in tensors) if compiled else 0
        flat = [
            _cat([piece[i] for piece in tensors], pad // fmt.BLOCK if scaled and i in (3, 5) else pad)
            for i in range(len(tensors[0]))
        ]
        bits = _cat([b for _, _, b in bucket], pad) if bucket[0][2] is not None else None
        w, g, *moments = flat
        m, v = (tuple(moments[:2]), tuple(moments[2:])) if scaled else ((moments[0], None), (moments[1], None))
        new = (
            adamw_update(w, g, m, v, bits, **scalars) if not compiled else self._fused(w, g, m, v, bits, scalars, step)
        )
        w, (m, m_scale), (v, v_scale) = new
        dst, src = [], []
        outputs = [w, m, m_scale, v, v_scale] if scaled else [w, m, v]
        for k, out in zip([i for i in range(len(tensors[0])) if i != 1], outputs):  # all but the gradient
            rows = [piece[k] for piece in tensors]
            sizes = [r.numel() for r in rows]
            parts = out.split([*sizes, out.numel() - sum(sizes)])
            dst += rows
            src += [part.view(r.shape) for part, r in zip(parts, rows)]
        torch._foreach_copy_(dst, src)

    def _fused(
        self, w, g, m: Moment, v: Moment, bits, scalars: dict, step: float
    ) -> tuple[torch.Tensor, Moment, Moment]:
        """:func:`compiled_update` of a bucket. The first bucket of each kind on a device is also updated eagerly
        at its first step and at its second (the first whose moments are not zero), and the two compared bit for
        bit: where they differ (a torch whose inductor lowers these ops otherwise), the optimizer warns and stays
        eager on that device, and this bucket keeps the eager result."""
        if m[0].dtype == torch.uint8:  # the maps, made before the compiled update reads them
            fmt.tables(True, w.device), fmt.tables(False, w.device)
        values = [scalars["decay"], -scalars["step_size"], 1 / scalars["bias_correction2"], 1 - scalars["beta1"]]
        tensor = torch.tensor(values, dtype=torch.float32).to(w.device, non_blocking=True)
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        with torch._dynamo.config.patch(**{limit: 64}):  # a graph per kind of bucket (dtypes), at most 8
            new = compiled_update()(w, g, m, v, bits, tensor, scalars["beta2"], scalars["eps"])
        kind = (w.device, w.dtype, m[0].dtype, m[1] is None, v[0].dtype, bits is None, min(step, 2))
        if kind not in self._compiled_checked:
            self._compiled_checked.add(kind)
            eager = adamw_update(w, g, m, v, bits, **scalars)
            if not same_bits(new, eager):
                warnings.warn(
                    f"the compiled optimizer update differs from the eager one on {w.device}; updating eagerly",
                    stacklevel=4,
                )
                self._compiled_ok[w.device] = False
                return eager
        return new

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, but each state tensor keeps its stored dtype (torch casts them to the parameter's, which would
        turn codes into values)."""
        saved = [state_dict["state"].get(i) for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for p, before in zip(params, saved):
            for key, value in (before or {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device)


def _cat(pieces: list[torch.Tensor], pad: int) -> torch.Tensor:
    """The pieces flattened and concatenated, then ``pad`` zeros."""
    flat = [t.reshape(-1) for t in pieces]
    if pad:
        flat.append(flat[0].new_zeros(pad))
    return torch.cat(flat)


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW, one parameter group per decay and kind of tensor (see the module doc): torch's (fused with
    ``fused``, on CUDA or, offloaded, on the CPU; else its default: foreach on CUDA) for FP32 parameters and states,
    else :class:`LowPrecisionAdamW`."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": same, "weight_decay": decay}
        for decay, chosen in (
            (cfg.weight_decay, [p for p in params if p.ndim >= 2]),
            (0.0, [p for p in params if p.ndim < 2]),
        )
        for same in by_kind(chosen)
    ]
    if cfg.optimizer_states != "fp32" or any(p.dtype != torch.float32 for p in params):
        return LowPrecisionAdamW(
            groups, lr=cfg.peak_lr, weight_decay=cfg.weight_decay, states=cfg.optimizer_states, seed=cfg.seed
        )
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=BETAS, eps=EPS, fused=fused or None)


def lr_factor(step: int, cfg: RunConfig) -> float:
    """Multiplier of the peak LR at ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio."""
    warm = cfg.lr_warmup
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))

"""AdamW with decoupled weight decay on matrices only, and linear warm-up + cosine decay.

torch's fused and foreach AdamW update a parameter group with one multi-tensor kernel, which takes
tensors of one kind only: plain tensors, or DTensors of one mesh. A model under FSDP2 with expert
parallelism holds both (FSDP-sharded DTensors, each rank's own experts as plain tensors), as does
TP with tensor-parallel experts; so each decay group is split by kind (:func:`by_kind`).

FP32 master weights with FP32 states (the default) are torch's AdamW (fused on CUDA). Any other
``--master-weights`` / ``--optimizer-states`` is :class:`LowPrecisionAdamW`, torch's single-tensor AdamW
arithmetic in FP32 on each parameter in turn, its states stored in BF16, blockwise E4M3 or 8-bit
dynamic quantization (:mod:`lpbench.precision.optim_states`) and BF16 parameters rounded stochastically.
torch's fused and foreach kernels keep the states in the parameter's dtype and round to nearest, so they
take none of these; torchao's low-bit optimizers do, but torchao is optional (the formats module says why
lpbench carries its own).
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch.distributed.tensor import DTensor

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
    as ``p`` is (its sharded dimensions lead), or ``local`` itself."""
    if not isinstance(p, DTensor):
        return local
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=tuple(stride))


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


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in ``states`` (``fp32``, ``bf16``, ``fp8``, ``8bit``) and whose BF16
    parameters are updated with stochastic rounding.

    Each step, per parameter: its value and gradient in FP32 (a BF16 parameter's FP32 view), the moments decoded to
    FP32, torch's single-tensor AdamW update (decay, ``lerp`` of the first moment, ``mul``/``addcmul`` of the second,
    ``addcdiv`` by the bias-corrected denominator) in FP32, the moments encoded back (BF16: rounded to nearest;
    ``fp8``, ``8bit``: each block of 256 along the last dimension rescaled), and a BF16 parameter rounded
    stochastically (:func:`lpbench.precision.optim_states.bf16_stochastic_round`). FP32 parameters with FP32
    states give torch's ``AdamW(foreach=False)`` bit for bit.

    The random bits of a parameter at a step come from a generator seeded with (``seed``, step, the parameter's
    index, where this rank's part starts), so a run is deterministic, a resumed run draws what the
    uninterrupted one drew, and replicas of one tensor round alike. DTensor parameters (FSDP2, TP) are updated
    on their local parts, whose blocks are the whole tensor's (:func:`quantizes`); their states are DTensors
    placed like the parameter, which ``torch.distributed.checkpoint`` saves and loads.
    """

    def __init__(self, params, lr: float, weight_decay: float, states: str = "fp32", seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay))
        self.states, self.seed = states, seed
        self._generators: dict[torch.device, torch.Generator] = {}

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
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        digest = hashlib.sha256(repr((self.seed, *key)).encode()).digest()
        return g.manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p] or self._init_state(p)
                state["step"] += 1
                self._update(p, state, group, index)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict, index: int) -> None:
        step = state["step"].item()
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        param, grad = _local(p), _local(p.grad)
        moments = [(key, _local(state[key]), state.get(f"{key}_scale")) for key in ("exp_avg", "exp_avg_sq")]
        sr = param.dtype == torch.bfloat16
        gen = self._generator(param.device, step, index, _offset(p)) if sr else None
        rows = max(1, CHUNK // max(1, math.prod(param.shape[1:])))  # whole rows: blocks lie within rows
        for lo in range(0, max(1, len(param)), rows):
            rs = slice(lo, lo + rows)
            w, g = param[rs], grad[rs].float()
            wf = w.float() if sr else w
            m, v = (self._decode(s[rs], None if sc is None else _local(sc)[rs], k) for k, s, sc in moments)
            wf.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            wf.addcdiv_(m, denom, value=-step_size)
            for (key, s, sc), value in zip(moments, (m, v)):
                self._encode(value, s[rs], None if sc is None else _local(sc)[rs], key)
            if sr:
                w.copy_(fmt.bf16_stochastic_round(wf, fmt.random_bits(wf.shape, gen, wf.device)))

    @staticmethod
    def _decode(stored: torch.Tensor, scale: torch.Tensor | None, key: str) -> torch.Tensor:
        """A moment in FP32: the stored tensor itself when FP32 (updated in place), else decoded."""
        if scale is None:
            return stored if stored.dtype == torch.float32 else stored.float()
        if stored.dtype == torch.uint8:
            return fmt.dequantize_8bit(stored, scale, signed=key == "exp_avg")
        return fmt.dequantize_e4m3(stored, scale)

    @staticmethod
    def _encode(value: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None, key: str) -> None:
        if scale is None:
            if stored.dtype != torch.float32:
                stored.copy_(value)  # BF16: round to nearest even
            return
        codes, scales = (
            fmt.quantize_8bit(value, signed=key == "exp_avg")
            if stored.dtype == torch.uint8
            else fmt.quantize_e4m3(value)
        )
        stored.copy_(codes)
        scale.copy_(scales)

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


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW, one parameter group per decay and kind of tensor (see the module doc): torch's (fused with
    ``fused``, else its default: foreach on CUDA) for FP32 parameters and states, else :class:`LowPrecisionAdamW`."""
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

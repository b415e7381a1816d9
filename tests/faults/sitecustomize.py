"""Test-only failure injection for sweep children, outside the package.

A test puts this folder on ``PYTHONPATH`` and sets ``LPBENCH_FAULT``: every Python process it
starts then imports this ``sitecustomize`` first, which wraps ``lpbench.train.loop.train`` so
that the run whose RunConfig matches fails as asked (see :func:`install_fault`).
"""

import os
import signal
import sys
import time

FAULT_ENV = "LPBENCH_FAULT"


def install_fault(cfg) -> str | None:
    """TEST-ONLY failure injection, from ``LPBENCH_FAULT`` (never set it for real runs).

    ``LPBENCH_FAULT="[FIELD=VALUE[,FIELD=VALUE]:]KIND[@STEP][;...]"``: the first entry whose
    conditions match this run's RunConfig applies (``env.NAME=VALUE``: the environment's, e.g. ``env.RANK=1``). KIND at optimizer step STEP (default 1):
    ``diverge`` (the loss becomes NaN), ``error`` (an exception), ``oom`` (a CUDA
    OutOfMemoryError the loop catches), ``oom-exit`` (an OOM message, then the process exits
    without a row), ``crash`` (SIGKILL itself), ``hang`` (sleep forever). Implemented with
    global module hooks, so the training loop has no test code in it.
    """
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text:
        return None
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        cond, _, action = entry.rpartition(":")
        pairs = [c.split("=", 1) for c in cond.split(",") if c.strip()]
        if any(len(p) != 2 for p in pairs):
            raise RuntimeError(f"{FAULT_ENV}: bad condition in {entry!r}")
        if all(_value(cfg, k.strip()) == v.strip() for k, v in pairs):
            kind, _, at = action.partition("@")
            hook_fault(kind.strip(), int(at or 1), cfg.grad_accum)
            return entry
    return None


def _value(cfg, key: str) -> str:
    return str(os.environ.get(key[4:]) if key.startswith("env.") else getattr(cfg, key, None))


def hook_fault(kind: str, at_step: int, grad_accum: int) -> None:
    import torch
    from torch.nn.modules import module as nn_module

    if kind not in ("diverge", "error", "oom", "oom-exit", "crash", "hang"):
        raise RuntimeError(f"{FAULT_ENV}: unknown fault {kind!r}")
    state = {"depth": 0, "calls": 0}

    def pre(mod, args):
        state["depth"] += 1

    def post(mod, args, out):
        state["depth"] -= 1
        if state["depth"]:
            return None  # an inner module: only the model's own forward (one per micro-batch) counts
        state["calls"] += 1
        step = (state["calls"] - 1) // grad_accum + 1
        if step < at_step:
            return None
        if kind == "diverge":
            return out * float("nan")
        if kind == "error":
            raise RuntimeError(f"{FAULT_ENV}: injected error at step {step}")
        if kind == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB ({FAULT_ENV} at step {step})")
        if kind == "oom-exit":
            print(
                f"torch.OutOfMemoryError: CUDA out of memory ({FAULT_ENV} at step {step})", file=sys.stderr, flush=True
            )
            os._exit(1)
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(3600)

    nn_module.register_module_forward_pre_hook(pre)
    nn_module.register_module_forward_hook(post)


if os.environ.get(FAULT_ENV, "").strip():
    from lpbench.train import loop

    _train = loop.train

    def _train_with_fault(cfg, *args, **kwargs):
        install_fault(cfg)
        return _train(cfg, *args, **kwargs)

    loop.train = _train_with_fault

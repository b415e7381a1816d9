"""``--tensorboard DIR``: each step's metrics as TensorBoard scalars, through torch.utils.tensorboard.

One folder per run, ``DIR/<model>-<precision>-<run key>``, so TensorBoard overlays the precisions
of a comparison. Optional: it needs the ``tensorboard`` package, and says so in one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lpbench.errors import UsageError

SCALARS = {"loss": "train/loss", "val_loss": "validation/loss", "step_time_s": "perf/step_time_s",
           "tokens_per_sec_per_gpu": "perf/tokens_per_sec_per_gpu", "tflops_per_gpu": "perf/model_tflops_per_gpu",
           "peak_mem_gb": "memory/peak_gb", "lr": "optim/lr", "grad_norm": "optim/grad_norm"}


def require_tensorboard() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")


def run_dir(root: str, model: str, precision: str, key: str) -> Path:
    return Path(root) / f"{model.replace('/', '_')}-{precision}-{key}"


class StepWriter:
    """``add(rec)`` per step, ``close()`` at the end; a no-op without a folder."""

    def __init__(self, root: str | None, model: str, precision: str, key: str):
        self.writer = None
        if root:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir(root, model, precision, key)))

    def add(self, rec: dict) -> None:
        if self.writer is None:
            return
        for field, tag in SCALARS.items():
            value = rec.get(field)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(tag, value, rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

"""``--tensorboard DIR`` and ``--wandb DIR``: each step's metrics as TensorBoard scalars (through
torch.utils.tensorboard) and as Weights & Biases metrics, under the same names.

TensorBoard: one folder per run, ``DIR/<model>-<precision>-<run key>``, so TensorBoard overlays the
precisions of a comparison. W&B: one run per precision of project ``lpbench``, named the same, with
the run's config, written offline under ``DIR`` (runs have no network; ``wandb sync`` uploads them).
Both are optional packages; a missing one is named in one line before any work.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from lpbench.errors import UsageError

SCALARS = {
    "loss": "train/loss",
    "val_loss": "validation/loss",
    "step_time_s": "perf/step_time_s",
    "tokens_per_sec_per_gpu": "perf/tokens_per_sec_per_gpu",
    "tflops_per_gpu": "perf/model_tflops_per_gpu",
    "peak_mem_gb": "memory/peak_gb",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
}


def require_tensorboard() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")


def require_wandb() -> None:
    if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb needs the wandb package: pip install wandb")


def run_dir(root: str, model: str, precision: str, key: str) -> Path:
    return Path(root) / f"{model.replace('/', '_')}-{precision}-{key}"


class StepWriter:
    """``add(rec)`` per step, ``close()`` at the end; a no-op without a folder for either."""

    def __init__(
        self,
        root: str | None,
        model: str,
        precision: str,
        key: str,
        wandb_dir: str | None = None,
        config: dict | None = None,
    ):
        self.writer = self.wandb = None
        if root:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir(root, model, precision, key)))
        if wandb_dir:
            require_wandb()
            import wandb

            Path(wandb_dir).mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(
                project="lpbench",
                name=run_dir("", model, precision, key).name,
                dir=str(wandb_dir),
                mode="offline",
                config=config or {},
            )

    def add(self, rec: dict) -> None:
        values = {
            tag: rec[field]
            for field, tag in SCALARS.items()
            if isinstance(rec.get(field), (int, float)) and not isinstance(rec.get(field), bool)
        }
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, rec["step"])
        if self.wandb is not None:
            self.wandb.log(values, step=rec["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()

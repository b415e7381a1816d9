"""Checkpoints: save a run every K steps and resume it exactly, with torch.distributed.checkpoint.

A checkpoint is a folder ``SAVE_DIR/step-K`` holding DCP's files (``.metadata``, ``*.distcp``)
and ``lpbench.json`` (lpbench version, step, the config fields a resume must match, and the
records of steps 1..K: loss, LR, validation loss ..., so a resumed run reports its whole curve). It
contains the model (parameters and buffers), the optimizer, the LR scheduler, the data position,
the step, and per rank: RNG states (torch CPU and CUDA, numpy, python) and persistent buffers
(the delayed-scaling amax histories and scales differ between data-parallel ranks; a checkpoint
saved before fp8-delayed kept its scales is refused with one line). Model and optimizer go
through ``get_state_dict``/``set_state_dict``, so one process, DDP and FSDP2 save and load alike
(each rank writes its shards; the folder must be on a filesystem all ranks see). MoE experts split
over ranks (``--ep``, or ``--tp``'s slices of them) are plain tensors that differ between ranks
under one name, which DCP would keep one copy of: they and their optimizer state are saved per rank
like the RNG states, so a checkpoint resumes on the same ``--ep``/``--tp``/``--dp`` layout only
(the config check names the difference).

Saving is atomic: every rank writes into ``SAVE_DIR/.step-K.tmp-PID`` (PID: rank 0's), rank 0
adds ``lpbench.json`` and renames the folder to ``step-K``. An existing ``step-K`` is swapped
with the new folder in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so a kill at any instant
leaves the old or the new ``step-K`` under its name; filesystems without it fall back to two
renames. A run killed mid-save leaves only the temporary folder, which ``--load`` ignores. A save
that fails (a full disk ...) removes its temporary folder and ends the run with the cause named;
the steps measured so far are kept.

Loading runs no code from the checkpoint. ``lpbench.json`` (JSON) lists every file with its size
and the SHA-256 of DCP's ``.metadata``; ``--load`` checks them before reading anything else. DCP
pickles ``.metadata``: it is read by ``_MetadataUnpickler``, which admits only DCP's metadata
types, torch dtypes/sizes/layouts and paths, and may reference no file outside the manifest. The
shards are read by DCP with ``torch.load(weights_only=True)``, which builds tensors only. Only
the metadata is hashed: hashing every shard would cost seconds per GB at each save.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lpbench import __version__
from lpbench.errors import UsageError
from lpbench.parallel.ep import expert_params
from lpbench.parallel.dims import ParallelDims
from lpbench.precision.delayed import SCALE, is_delayed_state

META_FILE = "lpbench.json"
STEP_DIR = re.compile(r"step-(\d+)")
# Config fields a checkpoint must share with the run that resumes it (shapes, layout, data order).
MATCH_FIELDS = ("model", "num_layers", "vocab_size", "precision", "backend", "workload", "lora_rank", "lora_targets",
                "seq_len", "mbs", "gbs", "dp", "tp", "ep", "fsdp", "data", "seed")


def find_checkpoint(path: str | os.PathLike) -> Path:
    """``--load PATH``: PATH itself if it is a checkpoint, else its latest ``step-K`` folder."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"--load {path}: no such file or directory")
    if STEP_DIR.fullmatch(path.name) or (path / META_FILE).exists():
        return path
    steps = [(int(m.group(1)), p) for p in path.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    if not steps:
        raise UsageError(f"--load {path}: no checkpoint (no step-K folder) in it")
    return max(steps)[1]


def read_metadata(ckpt: Path) -> dict:
    """``lpbench.json`` of a checkpoint folder; UsageError when it or DCP's metadata is missing or garbled."""
    if not ckpt.is_dir():
        raise UsageError(f"--load {ckpt}: not a checkpoint folder")
    try:
        meta = json.loads((ckpt / META_FILE).read_text())
        meta["step"], meta["config"], meta["history"] = int(meta["step"]), dict(meta["config"]), list(meta["history"])
        if not all(isinstance(rec, dict) for rec in meta["history"]):
            raise TypeError("a step record is not an object")
    except FileNotFoundError:
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({META_FILE} is missing)") from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({META_FILE} is garbled)") from None
    if not (ckpt / ".metadata").is_file():
        raise UsageError(f"--load {ckpt}: corrupt checkpoint (DCP's .metadata is missing)")
    problem = _manifest_problem(ckpt, meta.get("files"))
    if problem:
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({problem})")
    return meta


def validated(cfg):
    """``cfg.validate()``, its layout (:class:`ParallelDims`), and with ``--load`` the checkpoint checked against
    ``cfg`` (RunConfig reads no disk)."""
    cfg.validate()
    ParallelDims.of(cfg)
    if cfg.load is not None:
        check_resumable(cfg)
    return cfg


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict:
    """Every file of a saved checkpoint folder: its size, and the SHA-256 of DCP's ``.metadata``."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != META_FILE:
            files[path.name] = {"bytes": path.stat().st_size}
            if path.name == ".metadata":
                files[path.name]["sha256"] = _sha256(path)
    return files


def _manifest_problem(ckpt: Path, files) -> str | None:
    """What in ``ckpt`` differs from the manifest ``files`` written at save time, or None."""
    if not isinstance(files, dict) or not isinstance(files.get(".metadata"), dict):
        return f"{META_FILE} has no file manifest"
    for name, entry in files.items():
        path = ckpt / str(name)
        if not isinstance(entry, dict) or os.sep in str(name) or str(name) in (".", ".."):
            return f"bad manifest entry {name!r}"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, {entry.get('bytes')} were saved"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{name} differs from what was saved (SHA-256)"
    return None


def _metadata_types() -> set[tuple[str, str]]:
    """(module, name) of the globals a DCP ``.metadata`` pickle may reference: data types only."""
    allowed = {(dcp_metadata.__name__, name) for name, obj in vars(dcp_metadata).items()
               if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__}
    allowed |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    allowed |= {("torch", name) for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}
    allowed |= {(module, cls) for module in ("pathlib", "pathlib._local")
                for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only checkpoint metadata types: no code runs."""

    allowed = _metadata_types()

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f".metadata references {module}.{name}, which is not checkpoint metadata")
        return super().find_class(module, name)


class _VerifiedReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``_MetadataUnpickler``, shards only from the manifest."""

    def __init__(self, path: Path, files: dict):
        super().__init__(str(path))
        self.folder, self.files = Path(path), set(files)

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        with open(self.folder / (".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP metadata")
        shards = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        if not shards <= self.files:
            raise pickle.UnpicklingError(f".metadata names files outside the manifest: {sorted(map(str, shards - self.files))}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def check_resumable(cfg) -> tuple[Path, dict]:
    """The checkpoint ``cfg.load`` names and its metadata, if ``cfg`` can resume from it."""
    ckpt = find_checkpoint(cfg.load)
    meta = read_metadata(ckpt)
    saved = meta["config"]
    diff = [f"{k} {saved.get(k)!r} (this run: {getattr(cfg, k)!r})" for k in MATCH_FIELDS
            if saved.get(k) != getattr(cfg, k)]
    if diff:
        raise UsageError(f"--load {ckpt}: checkpoint does not match this run: {'; '.join(diff)}")
    if meta["step"] >= cfg.steps:
        raise UsageError(f"--load {ckpt}: checkpoint is at step {meta['step']}, --steps {cfg.steps} leaves "
                         "nothing to train")
    if cfg.profile_range and cfg.profile_range[1] <= meta["step"]:
        raise UsageError(f"--profile-steps {cfg.profile_steps}: the run resumed from {ckpt} starts at step "
                         f"{meta['step'] + 1}")
    return ckpt, meta


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _persistent_buffers(module: torch.nn.Module):
    """(name, buffer) of the buffers a state dict holds (not the non-persistent ones, e.g. RoPE tables)."""
    for prefix, m in module.named_modules():
        for name, buffer in m.named_buffers(recurse=False):
            if name not in m._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Saves (``maybe_save`` after each step) and resumes (``resume`` before the loop) one run."""

    def __init__(self, cfg, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, data,
                 device: torch.device, log: Callable[[str], None]):
        self.cfg, self.module, self.optimizer, self.scheduler, self.data = cfg, module, optimizer, scheduler, data
        self.device, self.log = device, log
        self.rank, self.world = _rank()
        self.pid = os.getpid()
        if cfg.save_every:
            try:
                Path(cfg.save_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--save-dir {cfg.save_dir}: cannot create it ({exc.strerror})") from None
        if cfg.save_every and self.world > 1:  # one temporary folder name for all ranks: rank 0's pid
            box = [self.pid]
            dist.broadcast_object_list(box, src=0)
            self.pid = box[0]

    def _state(self, step: int) -> dict:
        """What DCP saves, or the template it loads into.

        ``rank.<r>`` holds what may differ between ranks (each rank saves and loads its own): RNG
        states, persistent buffers (amax histories record each rank's inputs and gradients; the
        model's copy of a buffer is deduplicated to one rank's).
        """
        model, optim = get_state_dict(self.module, self.optimizer)
        split = self._split_experts()
        local = {"rng": _rng_state(self.device),
                 "buffers": {name: b.detach().clone() for name, b in _persistent_buffers(self.module)},
                 "experts": {name: model.pop(name) for name in split},
                 "experts_optim": {name: optim["state"].pop(name) for name in split if name in optim["state"]}}
        return {"model": model, "optim": optim, "rank": {str(self.rank): local},
                "train": {"step": step, "scheduler": self.scheduler.state_dict(), "data": self.data.state_dict()}}

    def _split_experts(self) -> list[str]:
        """State-dict names of the expert weights that differ between ranks (expert or tensor parallel)."""
        model = getattr(self.module, "module", self.module)  # DDP wraps the model
        ids = {id(p) for p in expert_params(model)[0]}
        return [name for name, p in model.named_parameters() if id(p) in ids]

    def resume(self) -> tuple[int, list[dict]]:
        """Load ``cfg.load`` (if set) into the run; returns the step it was saved after (0: none) and the
        records of the steps up to it."""
        if self.cfg.load is None:
            return 0, []
        ckpt, meta = check_resumable(self.cfg)
        state = self._state(0)
        if any(is_delayed_state(k, SCALE) for k in state["model"]) and not any(  # the file's keys read only then
                is_delayed_state(k, SCALE) for k in _VerifiedReader(ckpt, meta["files"]).read_metadata().state_dict_metadata):
            raise UsageError(f"--load {ckpt}: no delayed-scaling scales in it (saved before fp8-delayed kept a "
                             "persistent scale per operand); resume it with the lpbench that saved it")
        try:
            with _single_process_ok():
                dcp.load(state, storage_reader=_VerifiedReader(ckpt, meta["files"]), no_dist=self.world == 1)
        except (Exception, CheckpointException) as exc:  # damaged files: unpickling, I/O, missing keys ...
            raise UsageError(f"--load {ckpt}: corrupt checkpoint ({_cause(exc)})") from None
        train, local = state["train"], state["rank"][str(self.rank)]
        state["model"].update(local["experts"])
        state["optim"]["state"].update(local["experts_optim"])
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(train["scheduler"])
        self.data.load_state_dict(train["data"])
        with torch.no_grad():
            for name, buffer in _persistent_buffers(self.module):
                buffer.copy_(local["buffers"][name])
        _set_rng_state(local["rng"], self.device)
        step = int(train["step"])
        note = f" (saved by a run of {meta['steps']} steps; the LR schedule follows --steps {self.cfg.steps})" \
            if meta.get("steps") != self.cfg.steps else ""
        self.log(f"lpbench: resumed from {ckpt} at step {step}{note}")
        return step, meta["history"]

    def saves(self, step: int) -> bool:
        """Whether :meth:`maybe_save` writes a checkpoint after ``step``."""
        return bool(self.cfg.save_every) and step % self.cfg.save_every == 0

    def maybe_save(self, step: int, history: list[dict]) -> Path | None:
        """Write ``save_dir/step-K`` atomically when ``step`` is a multiple of ``save_every``; ``history``
        is the records of steps 1..K (rank 0's), kept in ``lpbench.json``."""
        if not self.saves(step):
            return None
        root = Path(self.cfg.save_dir)
        final, tmp = root / f"step-{step}", root / f".step-{step}.tmp-{self.pid}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            with _single_process_ok():
                dcp.save(self._state(step), checkpoint_id=tmp, no_dist=self.world == 1)
            if self.rank == 0:
                keys = {k: getattr(self.cfg, k) for k in MATCH_FIELDS}
                meta = {"lpbench": __version__, "step": step, "steps": self.cfg.steps, "world_size": self.world,
                        "config": keys, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": _manifest(tmp),
                        "history": history}
                with open(tmp / META_FILE, "w") as f:
                    json.dump(meta, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                _publish(tmp, final)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # a failed save must not fill the disk further
            raise CheckpointSaveError(f"checkpoint {final} not saved: {_cause(exc)}") from None
        if self.world > 1:
            dist.barrier()
        self.log(f"lpbench: saved checkpoint {final}")
        return final


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the run ends with this error and keeps its measured steps."""


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, atomically replacing an existing ``final``."""
    root = final.parent
    if not final.exists():
        os.rename(tmp, final)
    elif _exchange(tmp, final):  # one step: the new folder is step-K, the old one is at tmp
        _fsync_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # no atomic exchange on this filesystem: move the old one aside, then the new one in
        old = root / tmp.name.replace(".tmp-", ".old-")
        os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(root)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


_ERRNO_CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only filesystem", errno.EACCES: "permission denied"}


def _cause(exc: BaseException) -> str:
    """One line on what went wrong (the first rank's exception inside DCP's CheckpointException)."""
    if isinstance(exc, CheckpointException):
        exc = next(iter(exc.failures.values()))[0]
    seen = exc
    while seen is not None and not isinstance(seen, OSError):  # DCP may wrap the OSError
        seen = seen.__cause__ or seen.__context__
    named = _ERRNO_CAUSES.get(getattr(seen, "errno", None))
    detail = (str(exc).strip().splitlines() or [""])[0][:120]
    text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return f"{named} ({text})" if named else text


@contextmanager
def _single_process_ok():
    """Silence DCP's warning that one process saves or loads alone (intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

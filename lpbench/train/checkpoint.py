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
(the config check names the difference). A LoRA run's checkpoint holds the adapters and their optimizer
state, not the frozen base (rebuilt from the seed or ``--hf-checkpoint`` when it resumes; under TP its
shards are plain per-rank tensors): the adapters alone, which with the base make the adapted model.

Saving is atomic: every rank writes into ``SAVE_DIR/.step-K.tmp-PID`` (PID: rank 0's), rank 0
adds ``lpbench.json`` and renames the folder to ``step-K``. An existing ``step-K`` is swapped
with the new folder in one ``renameat2(RENAME_EXCHANGE)`` (Linux), so a kill at any instant
leaves the old or the new ``step-K`` under its name; filesystems without it fall back to two
renames. A run killed mid-save leaves only the temporary folder, which ``--load`` ignores. A save
that fails (a full disk ...) removes its temporary folder and ends the run with the cause named;
the steps measured so far are kept.

Loading runs no code from the checkpoint, and nothing in it is pickled but DCP's own ``.metadata``.
Every item DCP stores is a tensor: the step, the LR scheduler's and the data sampler's state, the
optimizer's hyperparameters and the python and numpy RNG states go in one JSON document per rank,
stored as a ``uint8`` tensor (``rank.R.json``); the torch RNG states are tensors already.
``lpbench.json`` (JSON) lists every file with its size and SHA-256, checked before anything else
is read. ``.metadata`` is read by ``_MetadataUnpickler``, which admits only DCP's metadata types,
torch dtypes/sizes/layouts and paths, and may reference no file outside the manifest; a checkpoint
whose metadata lists any non-tensor ("bytes") item, which DCP would unpickle, is refused before any
shard is read, and ``_VerifiedReader`` reads tensors only (DCP reads those with
``torch.load(weights_only=True)``). Checkpoints of the older format, which pickled those items,
are refused with one line saying so.
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
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lpbench import __version__
from lpbench.config import settings
from lpbench.errors import UsageError
from lpbench.parallel.ep import expert_params
from lpbench.parallel.pp import stage_sizes
from lpbench.precision.delayed import SCALE, is_delayed_state

META_FILE = "lpbench.json"
FORMAT = 2  # 2: every DCP item a tensor, a SHA-256 per file; 1 (no "format" key) pickled the non-tensor state
STEP_DIR = re.compile(r"step-(\d+)")


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
    except (ValueError, KeyError, TypeError, RecursionError):
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({META_FILE} is garbled)") from None
    if meta.get("format") != FORMAT:
        raise UsageError(
            f"--load {ckpt}: saved by lpbench {meta.get('lpbench', '?')} in a checkpoint format that "
            "pickles the step, RNG and scheduler state, which could run code on loading; this lpbench "
            "loads no pickled data (resume it with the lpbench that saved it)"
        )
    if not (ckpt / ".metadata").is_file():
        raise UsageError(f"--load {ckpt}: corrupt checkpoint (DCP's .metadata is missing)")
    problem = _manifest_problem(ckpt, meta.get("files"))
    if problem:
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({problem})")
    try:
        meta["dcp"] = _VerifiedReader(ckpt, meta["files"]).read_metadata()
    except _PickledItems as exc:
        raise UsageError(f"--load {ckpt}: refused: {exc}") from None
    except Exception as exc:  # a damaged or crafted .metadata: refused by the unpickler, truncated ...
        raise UsageError(f"--load {ckpt}: corrupt checkpoint ({_cause(exc)})") from None
    return meta


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict:
    """Every file of a saved checkpoint folder: its size and SHA-256."""
    return {
        path.name: {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != META_FILE
    }


def _manifest_problem(ckpt: Path, files) -> str | None:
    """What in ``ckpt`` differs from the manifest ``files`` written at save time, or None."""
    if not isinstance(files, dict) or not isinstance(files.get(".metadata"), dict):
        return f"{META_FILE} has no file manifest"
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or os.sep in str(name)
            or str(name) in (".", "..")
            or not isinstance(entry.get("sha256"), str)
        ):
            return f"bad manifest entry {str(name)[:80]!r}"
    for name, entry in files.items():  # sizes first: a missing or truncated file is named without hashing
        path = ckpt / str(name)
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, {entry.get('bytes')} were saved"
    for name, entry in files.items():
        if _sha256(ckpt / str(name)) != entry["sha256"]:
            return f"{name} differs from what was saved (SHA-256)"
    return None


def _metadata_types() -> set[tuple[str, str]]:
    """(module, name) of the globals a DCP ``.metadata`` pickle may reference: data types only."""
    allowed = {
        (dcp_metadata.__name__, name)
        for name, obj in vars(dcp_metadata).items()
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
    }
    allowed |= {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
    }
    allowed |= {("torch", name) for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}
    allowed |= {
        (module, cls)
        for module in ("pathlib", "pathlib._local")
        for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    }
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only checkpoint metadata types: no code runs."""

    allowed = _metadata_types()

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f".metadata references {module}.{name}, which is not checkpoint metadata")
        return super().find_class(module, name)


class _PickledItems(ValueError):
    """A checkpoint holds items that DCP would unpickle."""


class _VerifiedReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``_MetadataUnpickler``, shards only from the manifest,
    tensors only: a checkpoint with non-tensor (pickled) items is refused before any of them is read."""

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
            raise pickle.UnpicklingError(
                f".metadata names files outside the manifest: {sorted(map(str, shards - self.files))}"
            )
        pickled = sorted(
            k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, dcp_metadata.TensorStorageMetadata)
        )
        if pickled:
            raise _PickledItems(
                f"it holds {len(pickled)} pickled item(s) ({', '.join(pickled[:3])}"
                f"{' ...' if len(pickled) > 3 else ''}), which could run code; lpbench loads "
                "tensors only"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def read_data(self, plan, planner):
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise _PickledItems("a pickled item was asked for; lpbench loads tensors only")
        return super().read_data(plan, planner)


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _persistent_buffers(module: torch.nn.Module):
    """(name, buffer) of the buffers a state dict holds (not the non-persistent ones, e.g. RoPE tables)."""
    for prefix, m in module.named_modules():
        for name, buffer in m.named_buffers(recurse=False):
            if name not in m._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def _json_tensor(value) -> torch.Tensor:
    """``value`` as JSON in a ``uint8`` tensor: how a checkpoint stores what is not a tensor."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _from_json_tensor(tensor: torch.Tensor):
    return json.loads(bytes(tensor.numpy()).decode())


def _rng_state(device: torch.device) -> tuple[dict, dict]:
    """This process's RNG states: (tensors, the JSON-able rest)."""
    tensors = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return tensors, {"numpy": [name, keys.tolist(), pos, has_gauss, cached], "python": [version, list(internal), gauss]}


def _set_rng_state(tensors: dict, rest: dict, device: torch.device) -> None:
    torch.set_rng_state(tensors["torch"])
    name, keys, pos, has_gauss, cached = rest["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = rest["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda":
        torch.cuda.set_rng_state(tensors["cuda"], device)


class Checkpointer:
    """Saves (``maybe_save`` after each step) and resumes (``resume`` before the loop) one run."""

    def __init__(
        self,
        cfg,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        data,
        device: torch.device,
        log: Callable[[str], None],
    ):
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

    def _state(self, step: int) -> tuple[dict, dict]:
        """What DCP saves, or the template it loads into (tensors only), and the JSON-able rest.

        ``rank.<r>`` holds what may differ between ranks (each rank saves and loads its own): RNG
        states, persistent buffers (amax histories record each rank's inputs and gradients; the
        model's copy of a buffer is deduplicated to one rank's), and ``json``, the rest as JSON:
        the step, scheduler and sampler state and the optimizer's hyperparameters (the same on
        every rank) and the python and numpy RNG states.
        """
        model, optim = get_state_dict(self.module, self.optimizer)
        for name in self._frozen():
            model.pop(name, None)
        split = self._split_experts()
        rng, rest = _rng_state(self.device)
        rest.update(
            step=step,
            scheduler=self.scheduler.state_dict(),
            data=self.data.state_dict(),
            param_groups=optim.pop("param_groups"),
        )
        local = {
            "rng": rng,
            "buffers": {name: b.detach().clone() for name, b in _persistent_buffers(self.module)},
            "experts": {name: model.pop(name) for name in split},
            "experts_optim": {name: optim["state"].pop(name) for name in split if name in optim["state"]},
        }
        return {"model": model, "optim": optim, "rank": {str(self.rank): local}}, rest

    def _frozen(self) -> list[str]:
        """State-dict names of a LoRA run's frozen parameters (the base), which its checkpoints leave out."""
        if self.cfg.workload != "lora":
            return []
        model = getattr(self.module, "module", self.module)  # DDP wraps the model
        return [name for name, p in model.named_parameters() if not p.requires_grad]

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
        ckpt = find_checkpoint(self.cfg.load)  # checked against the config before the run (bench/runner.py)
        meta = read_metadata(ckpt)
        state, template = self._state(0)
        saved = meta["dcp"].state_dict_metadata
        if any(is_delayed_state(k, SCALE) for k in state["model"]) and not any(
            is_delayed_state(k, SCALE) for k in saved
        ):
            raise UsageError(
                f"--load {ckpt}: no delayed-scaling scales in it (saved before fp8-delayed kept a "
                "persistent scale per operand); resume it with the lpbench that saved it"
            )
        local = state["rank"][str(self.rank)]
        blob = saved.get(f"rank.{self.rank}.json")
        if blob is None or len(blob.size) != 1 or blob.properties.dtype != torch.uint8:
            raise UsageError(f"--load {ckpt}: corrupt checkpoint (no training state of rank {self.rank})")
        local["json"] = torch.empty(blob.size, dtype=torch.uint8)
        try:
            with _single_process_ok():
                dcp.load(state, storage_reader=_VerifiedReader(ckpt, meta["files"]), no_dist=self.world == 1)
            rest = _from_json_tensor(local["json"])
            for group, now in zip(rest["param_groups"], template["param_groups"], strict=True):
                group.update({k: tuple(group[k]) for k, v in now.items() if isinstance(v, tuple)})  # betas
            state["optim"]["param_groups"] = rest["param_groups"]
            state["model"].update(local["experts"])
            state["optim"]["state"].update(local["experts_optim"])
            set_state_dict(
                self.module,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=StateDictOptions(strict=not self._frozen()),
            )
            self.scheduler.load_state_dict(rest["scheduler"])
            self.data.load_state_dict(rest["data"])
            with torch.no_grad():
                for name, buffer in _persistent_buffers(self.module):
                    buffer.copy_(local["buffers"][name])
            _set_rng_state(local["rng"], rest, self.device)
            step = int(rest["step"])
        except UsageError:
            raise
        except (Exception, CheckpointException) as exc:  # damaged files: I/O, missing keys, bad JSON ...
            raise UsageError(f"--load {ckpt}: corrupt checkpoint ({_cause(exc)})") from None
        note = (
            f" (saved by a run of {meta['steps']} steps; the LR schedule follows --steps {self.cfg.steps})"
            if meta.get("steps") != self.cfg.steps
            else ""
        )
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
            state, rest = self._state(step)
            state["rank"][str(self.rank)]["json"] = _json_tensor(rest)
            with _single_process_ok():
                dcp.save(state, checkpoint_id=tmp, no_dist=self.world == 1)
            if self.rank == 0:
                keys = {k: getattr(self.cfg, k) for k in settings("resume")}
                meta = {
                    "lpbench": __version__,
                    "format": FORMAT,
                    "step": step,
                    "steps": self.cfg.steps,
                    "world_size": self.world,
                    "config": keys,
                    "pp_stage_blocks": stage_sizes(self.cfg, self.cfg.model_config()) if self.cfg.pp > 1 else None,
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "files": _manifest(tmp),
                    "history": history,
                }
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


_ERRNO_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
}


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

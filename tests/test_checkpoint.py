"""Checkpoints: a resumed run reproduces the uninterrupted one bit for bit; bad checkpoints exit 2."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import lpbench.train.loop as loop
from lpbench.bench.runner import execute
from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.errors import UsageError
from lpbench.models.registry import MODELS, ModelConfig
from lpbench.train.checkpoint import META_FILE, find_checkpoint

MODEL_ARGS = ("test-ckpt", 2, 64, 128, 4, 2, 512)  # 2 blocks, dim 64, vocab 512: fast on CPU
BASE = RunConfig(model="test-ckpt", seq_len=32, mbs=4, gbs=4, steps=6, warmup_steps=1, precision="bf16", device="cpu")
CLI = [
    "run",
    "--model",
    "test-ckpt",
    "--precision",
    "bf16",
    "--device",
    "cpu",
    "--seq-len",
    "32",
    "--mbs",
    "4",
    "--gbs",
    "4",
    "--steps",
    "4",
    "--warmup-steps",
    "1",
]


def _register_model() -> None:
    MODELS["test-ckpt"] = ModelConfig(*MODEL_ARGS, max_seq_len=256)
    MODELS["test-ckpt-moe"] = ModelConfig("test-ckpt-moe", *MODEL_ARGS[1:], max_seq_len=256, n_experts=4, top_k=2)


@pytest.fixture(autouse=True, scope="module")
def registered_model():
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setitem(MODELS, "test-ckpt", ModelConfig(*MODEL_ARGS, max_seq_len=256))
        yield


def _train(cfg: RunConfig):
    result = loop.train(cfg, log=lambda line: None)
    assert result.status == "ok"
    return result


def _trace(result, key: str = "loss") -> list[float]:
    return [s[key] for s in result.steps]


@pytest.mark.parametrize(
    "kw", [{}, {"mbs": 2}, {"precision": "fp8-delayed", "mbs": 2}], ids=["bf16", "bf16-ga2", "fp8-delayed-ga2"]
)
def test_resume_reproduces_the_uninterrupted_run_exactly(kw, tmp_path):
    cfg = BASE.with_(**kw)
    straight = _train(cfg)
    saving = _train(cfg.with_(save_every=3, save_dir=str(tmp_path)))
    assert _trace(saving) == _trace(straight)  # saving does not disturb the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-6"]

    resumed = _train(cfg.with_(load=str(tmp_path / "step-3")))
    assert [s["step"] for s in resumed.steps] == [4, 5, 6] and resumed.metrics["resumed_from_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert _trace(saving, key)[:3] + _trace(resumed, key) == _trace(straight, key)  # bit for bit
    saved = FileSystemReader(str(tmp_path / "step-3")).read_metadata().state_dict_metadata
    assert any(k.startswith("optim.state.") for k in saved)
    if cfg.precision == "fp8-delayed":  # the amax histories and scales, whose loss effect the resume must carry
        assert any(k.endswith("amax_history_grad") for k in saved) and any(
            k.endswith("delayed_scale_grad") for k in saved
        )
    meta = json.loads((tmp_path / "step-3" / META_FILE).read_text())
    assert meta["step"] == 3 and meta["config"]["precision"] == cfg.precision and meta["config"]["mbs"] == cfg.mbs


def test_a_delayed_checkpoint_without_scales_is_refused_with_one_line(monkeypatch, tmp_path):
    """A checkpoint saved before fp8-delayed kept its scales (histories only) cannot resume the run exactly."""
    import lpbench.train.checkpoint as ckpt

    state = ckpt.Checkpointer._state

    def without_scales(self, step):  # what an older lpbench saved
        out, rest = state(self, step)
        for part in (out["model"], *(r["buffers"] for r in out["rank"].values())):
            for name in [k for k in part if "delayed_scale_" in k]:
                del part[name]
        return out, rest

    cfg = BASE.with_(precision="fp8-delayed", steps=2)
    with monkeypatch.context() as patch:
        patch.setattr(ckpt.Checkpointer, "_state", without_scales)
        _train(cfg.with_(save_every=2, save_dir=str(tmp_path)))
    with pytest.raises(
        UsageError, match=r"no delayed-scaling scales in it .* resume it with the lpbench that saved it"
    ):
        loop.train(cfg.with_(load=str(tmp_path / "step-2"), steps=3), log=lambda line: None)


KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from lpbench.models.registry import MODELS, ModelConfig
    MODELS["test-ckpt"] = ModelConfig(*{model_args!r}, max_seq_len=256)
    import lpbench.train.checkpoint as ckpt
    from lpbench.config import RunConfig
    from lpbench.train.loop import train

    real_save, saves = ckpt.dcp.save, []

    def save(state, **kw):  # the second save dies after writing its shards, before the rename
        real_save(state, **kw)
        saves.append(1)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt.dcp.save = save
    train(RunConfig(**json.loads(sys.argv[1])), log=print)
""")


def test_a_kill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    cfg = BASE.with_(save_every=2, save_dir=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT.format(model_args=MODEL_ARGS), json.dumps(cfg.to_dict())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "iteration 4/6" in proc.stdout and "iteration 5/6" not in proc.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith(".step-4.tmp-") and names[1:] == ["step-2"]
    assert any(p.suffix == ".distcp" for p in (tmp_path / names[0]).iterdir())  # shards written ...
    assert not (tmp_path / names[0] / META_FILE).exists()  # ... but never completed
    assert find_checkpoint(tmp_path) == tmp_path / "step-2"

    resumed = _train(BASE.with_(load=str(tmp_path)))
    assert [s["step"] for s in resumed.steps] == [3, 4, 5, 6]
    assert _trace(resumed) == _trace(_train(BASE))[2:]


def test_load_takes_the_latest_step_folder(tmp_path):
    for name in ("step-2", "step-10", "step-9", ".step-12.tmp-99", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-11").write_text("a file, not a checkpoint")
    assert find_checkpoint(tmp_path) == tmp_path / "step-10"  # numeric, not lexicographic
    assert find_checkpoint(tmp_path / "step-2") == tmp_path / "step-2"


def test_saving_over_an_existing_step_replaces_it(tmp_path):
    _train(BASE.with_(steps=2, save_every=2, save_dir=str(tmp_path)))
    _train(BASE.with_(steps=2, save_every=2, save_dir=str(tmp_path), seed=7))
    assert [p.name for p in tmp_path.iterdir()] == ["step-2"]  # no temporary or replaced folder left
    assert json.loads((tmp_path / "step-2" / META_FILE).read_text())["config"]["seed"] == 7


def test_checkpoint_flags_do_not_change_the_run_key():
    flags = dict(save_every=2, save_dir="ckpt", load="ckpt", profile_steps="2:3")
    assert BASE.with_(**flags).key() == BASE.key() != BASE.with_(precision="fp8-delayed").key()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint of BASE at step 2 (of 4)."""
    root = tmp_path_factory.mktemp("saved")
    _train(BASE.with_(steps=4, save_every=2, save_dir=str(root)))
    return root / "step-2"


def _damage(kind: str, ckpt: Path, tmp_path: Path) -> Path:
    if kind == "missing":
        return tmp_path / "nowhere"
    if kind == "empty":
        return tmp_path
    copy = tmp_path / "step-2"
    shutil.copytree(ckpt, copy)
    if kind == "no-metadata":
        (copy / META_FILE).unlink()
    elif kind == "garbled-metadata":
        (copy / META_FILE).write_text("{not json")
    elif kind == "no-dcp-metadata":
        (copy / ".metadata").unlink()
    elif kind == "missing-shards":
        for shard in copy.glob("*.distcp"):
            shard.unlink()
    elif kind == "garbled-shards":
        for shard in copy.glob("*.distcp"):
            shard.write_bytes(os.urandom(shard.stat().st_size // 2))
    return copy


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "no such file or directory"),
        ("empty", "no checkpoint (no step-K folder) in it"),
        ("no-metadata", "corrupt checkpoint (lpbench.json is missing)"),
        ("garbled-metadata", "corrupt checkpoint (lpbench.json is garbled)"),
        ("no-dcp-metadata", "corrupt checkpoint (DCP's .metadata is missing)"),
        ("missing-shards", "corrupt checkpoint (__0_0.distcp is missing)"),
        ("garbled-shards", "corrupt checkpoint (__0_0.distcp has "),
    ],
)
def test_a_bad_checkpoint_is_refused_with_exit_2(kind, message, saved, tmp_path, capsys):
    path = _damage(kind, saved, tmp_path)
    assert main([*CLI, "--load", str(path), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--precision", "fp8-delayed"], "precision 'bf16' (this run: 'fp8-delayed')"),
        (["--seq-len", "64"], "seq_len 32 (this run: 64)"),
        (["--mbs", "2"], "mbs 4 (this run: 2)"),
        (["--steps", "2"], "checkpoint is at step 2, --steps 2 leaves nothing to train"),
        (["--profile-steps", "1:2"], "starts at step 3"),
    ],
)
def test_a_mismatched_checkpoint_is_refused_with_exit_2(flags, message, saved, tmp_path, capsys):
    assert main([*CLI, *flags, "--load", str(saved), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.db").exists()


def test_a_setting_the_checkpoint_predates_counts_as_its_default(saved, tmp_path):
    """A checkpoint saved before a resume setting existed (its lpbench.json lacks it) resumes a run that leaves
    the setting at its default, and is refused by one that sets it."""
    from lpbench.bench.runner import validated

    copy = tmp_path / "step-2"
    shutil.copytree(saved, copy)
    meta = json.loads((copy / META_FILE).read_text())
    del meta["config"]["seed"]  # as if the seed were a setting added after the save
    (copy / META_FILE).write_text(json.dumps(meta))
    validated(BASE.with_(steps=4, load=str(copy)))
    with pytest.raises(UsageError, match="seed 1234 \\(this run: 7\\)"):
        validated(BASE.with_(steps=4, seed=7, load=str(copy)))


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--save-every", "2"], "--save-every K needs --save-dir DIR"),
        (["--save-dir", "{dir}"], "--save-dir needs --save-every K"),
        (["--save-every", "-1", "--save-dir", "{dir}"], "--save-every must be >= 0"),
        (
            ["--precision", "bf16,fp8-delayed", "--save-every", "2", "--save-dir", "{dir}"],
            "--save-dir, --load and --export-hf take a single --precision",
        ),
        (["--save-every", "2", "--save-dir", "{file}/ckpt"], "cannot create it ({file} is a file, not a folder)"),
    ],
)
def test_checkpoint_flags_are_validated(flags, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    flags = [f.format(dir=tmp_path / "ckpt", file=tmp_path / "file") for f in flags]
    assert main([*CLI, *flags, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message.format(file=tmp_path / "file") in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_cli_saves_and_resumes(tmp_path, capsys):
    ckpt, results = tmp_path / "ckpt", str(tmp_path / "results")
    assert main([*CLI, "--save-every", "2", "--save-dir", str(ckpt), "--results", results]) == 0
    straight = [
        line.split("lm loss: ")[1].split(" ")[0]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("iteration")
    ]
    assert main([*CLI, "--load", str(ckpt / "step-2"), "--results", results]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt / 'step-2'} at step 2" in out
    resumed = [line.split("lm loss: ")[1].split(" ")[0] for line in out.splitlines() if line.startswith("iteration")]
    assert resumed == straight[2:] and len(resumed) == 2
    assert "ok (resumed from step 2)" in out  # the summary table says the run did not start here
    assert main(["report", "--results", results, "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.count("resumed from step 2") == 1  # the resumed run is marked; the one that saved is not


class _Evil:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _rewrite_metadata(ckpt: Path, payload: bytes) -> None:
    """Replace DCP's .metadata and update the manifest to match, as a crafted checkpoint would."""
    import hashlib

    (ckpt / ".metadata").write_bytes(payload)
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"][".metadata"] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (ckpt / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("craft", ["code", "outside-file"])
def test_loading_a_crafted_checkpoint_runs_no_code(craft, saved, tmp_path, capsys):
    import pickle

    ckpt = tmp_path / "step-2"
    shutil.copytree(saved, ckpt)
    marker = tmp_path / "code-ran"
    if craft == "code":
        payload = pickle.dumps(_Evil(marker))
    else:  # genuine metadata types, but pointing DCP at a file the checkpoint never wrote
        metadata = FileSystemReader(str(saved)).read_metadata()
        for info in metadata.storage_data.values():
            info.relative_path = "../../elsewhere.distcp"
        payload = pickle.dumps(metadata)
    _rewrite_metadata(ckpt, payload)
    assert main([*CLI, "--load", str(ckpt), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert "corrupt checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert ("not checkpoint metadata" if craft == "code" else "outside the manifest") in err
    assert not marker.exists()


def test_a_checkpoint_altered_after_saving_is_refused(saved, tmp_path, capsys):
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved, ckpt)
    data = bytearray((ckpt / ".metadata").read_bytes())
    data[-2] ^= 1  # same size, different bytes
    (ckpt / ".metadata").write_bytes(bytes(data))
    assert main([*CLI, "--load", str(ckpt), "--results", str(tmp_path / "results")]) == 2
    assert "corrupt checkpoint (.metadata differs from what was saved (SHA-256))" in capsys.readouterr().err


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (no except clause of lpbench catches a BaseException)."""


def test_replacing_a_step_is_atomic_under_a_kill_at_any_instant(tmp_path, monkeypatch):
    """A kill before or after any filesystem step of a save over step-K leaves a loadable step-K."""
    import lpbench.train.checkpoint as ckpt

    first = BASE.with_(steps=2, save_every=2)
    for kill_at in range(1, 20):
        root = tmp_path / str(kill_at)
        _train(first.with_(save_dir=str(root)))
        calls = []
        real = {name: getattr(os, name) for name in ("rename", "replace")} | {"rmtree": shutil.rmtree}

        def step(name):
            def call(*args, **kw):
                calls.append(name)
                if len(calls) == kill_at:
                    raise _Killed
                return real[name](*args, **kw)

            return call

        with monkeypatch.context() as m:
            m.setattr(os, "rename", step("rename"))
            m.setattr(os, "replace", step("replace"))
            m.setattr(shutil, "rmtree", step("rmtree"))
            if hasattr(ckpt, "_exchange"):
                real["exchange"] = ckpt._exchange
                m.setattr(ckpt, "_exchange", step("exchange"))
            try:  # DCP turns a kill inside its own save into an error the run ends with
                result = loop.train(first.with_(save_dir=str(root), seed=7), log=lambda line: None)
                finished = result.status == "ok"
                assert finished or "_Killed" in result.error
            except _Killed:
                finished = False
        assert find_checkpoint(root) == root / "step-2", (kill_at, calls, os.listdir(root))
        meta = ckpt.read_metadata(root / "step-2")  # complete: every file as saved
        assert meta["config"]["seed"] == (7 if finished else meta["config"]["seed"])
        if finished:
            break
    assert finished and kill_at > 2  # the save took several steps, each one survived


def test_a_full_disk_while_saving_keeps_the_measured_steps(tmp_path, monkeypatch, capsys):
    import errno

    import lpbench.train.checkpoint as ckpt
    from lpbench.bench.store import ResultsStore

    real_save = ckpt.dcp.save

    def save(state, checkpoint_id, **kw):
        if Path(checkpoint_id).name.startswith(".step-4."):
            Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(ckpt.dcp, "save", save)
    results = tmp_path / "results"
    assert (
        main(
            [*CLI, "--steps", "6", "--save-every", "2", "--save-dir", str(tmp_path / "ckpt"), "--results", str(results)]
        )
        == 1
    )
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    [run] = ResultsStore(results).runs()
    assert run["status"] == "error" and "disk full" in run["error"] and "step-4" in run["error"]
    assert [s["step"] for s in ResultsStore(results).steps(run["id"])] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]  # no half-written folder left


# ----------------------------------------------------------------------------- two ranks (gloo)
SCENARIOS = {
    "ddp": dict(mbs=1),
    "fsdp-fp8-delayed": dict(mbs=1, fsdp=True, precision="fp8-delayed"),
    # MoE experts split over the ranks: each rank's experts (EP) or slices of them (TP) differ
    "ep2-moe": dict(mbs=1, model="test-ckpt-moe", ep=2, moe_aux_loss_coeff=0.01),
    "tp2-moe": dict(mbs=2, model="test-ckpt-moe", tp=2, precision="fp32"),
    # LoRA: the adapters (DTensors under TP) and their optimizer state; the base, stored quantized, left out
    "lora-fsdp": dict(mbs=1, fsdp=True, workload="lora", lora_base_storage="quantized", precision="fp8-tensorwise"),
    "lora-tp2": dict(mbs=2, tp=2, workload="lora", lora_base_storage="quantized", precision="fp8-tensorwise"),
}


def _worker(rank: int, out: str) -> dict:
    _register_model()
    results = {}
    for name, kw in SCENARIOS.items():  # GA 2: gbs 4 = mbs 1 x dp 2 x 2 micro-batches
        cfg = BASE.with_(steps=4, **kw).with_world(2)
        folder = os.path.join(out, name)
        straight = loop.train(cfg, log=lambda line: None)
        saving = loop.train(cfg.with_(save_every=2, save_dir=folder), log=lambda line: None)
        resumed = loop.train(cfg.with_(load=folder + "/step-2"), log=lambda line: None)
        results[name] = {
            "straight": _trace(straight),
            "saving": _trace(saving),
            "resumed": _trace(resumed),
            "files": sorted(os.listdir(folder + "/step-2")),
            "model_keys": [
                k
                for k in FileSystemReader(folder + "/step-2").read_metadata().state_dict_metadata
                if k.startswith("model.")
            ],
        }
        if kw.get("ep"):  # another expert layout: refused before any work
            try:
                execute(cfg.with_(ep=1, load=folder + "/step-2"), results_dir=out)  # the runner checks resumes
            except UsageError as exc:
                results[name]["other_ep"] = str(exc)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, spawn_ranks) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    return spawn_ranks(_worker, 2, out, str(out))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_save_and_resume_exactly(name, two_ranks):
    for rank in two_ranks:
        run = rank[name]
        assert len(run["straight"]) == 4 and run["saving"] == run["straight"]
        assert run["saving"][:2] + run["resumed"] == run["straight"]
    assert {".metadata", META_FILE, "__0_0.distcp", "__1_0.distcp"} <= set(two_ranks[0][name]["files"])  # both wrote
    if "ep" in SCENARIOS[name]:
        assert "checkpoint does not match this run: ep 2 (this run: 1)" in two_ranks[0][name]["other_ep"]
    keys = two_ranks[0][name]["model_keys"]
    if SCENARIOS[name].get("workload") == "lora":  # the adapters alone
        assert keys and all(".lora_a" in k or ".lora_b" in k or "amax_history" in k or "scale" in k for k in keys)
    else:
        assert any(k.endswith("attn.qkv.weight") for k in keys)


@pytest.mark.parametrize("key", ["save_every", "save_dir", "load"])
def test_a_sweep_refuses_checkpoint_settings(key):
    from lpbench.bench.sweep import expand
    from lpbench.errors import UsageError

    with pytest.raises(UsageError, match=f"spec key {key}: checkpoints belong to one run"):
        expand({"name": "s", "model": "tiny", key: 2 if key == "save_every" else "ckpt"})


# ----------------------------------------------------------------------------- pickled items (issue 41, class 1)
class _System:
    """Unpickling this runs a shell command that creates the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


PLANTED = ("train.step", "rank.0.rng.python", "optim.param_groups.0.lr", "rank.0.json")


def _plant(src: Path, dst: Path, marker: Path) -> None:
    """Copy checkpoint ``src`` to ``dst`` with an os.system pickle in every non-tensor item and in each item of
    ``PLANTED``, the manifest rewritten to match (sizes and SHA-256), as a crafted checkpoint would be."""
    import hashlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(src)).read_metadata().state_dict_metadata
    tensors = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=FileSystemReader(str(src)), no_dist=True)
    evil = {k: _System(marker) for k in (*PLANTED, *(k for k in saved if k not in tensors))}
    dst.mkdir(parents=True)
    dcp.save({**{k: v for k, v in tensors.items() if k not in evil}, **evil}, checkpoint_id=dst, no_dist=True)
    meta = json.loads((src / META_FILE).read_text())
    meta["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(dst.iterdir())
        if p.is_file()
    }
    (dst / META_FILE).write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def converge_saved(tmp_path_factory) -> Path:
    """`lpbench converge` checkpoints of bf16 at step 3 (of 6): DIR/bf16/step-3."""
    root = tmp_path_factory.mktemp("converge")
    assert (
        main(
            [
                *CONVERGE,
                "--tokens",
                "192",
                "--results",
                str(root / "results"),
                "--save-every",
                "3",
                "--save-dir",
                str(root / "saved"),
            ]
        )
        == 0
    )
    return root / "saved"


CONVERGE = [
    "converge",
    "--data",
    "mock",
    "--model",
    "tiny",
    "--precision",
    "bf16",
    "--eval-every",
    "0",
    "--seq-len",
    "32",
    "--mbs",
    "2",
    "--gbs",
    "2",
    "--device",
    "cpu",
    "--log-interval",
    "100",
]


@pytest.mark.parametrize("entry", ["run --load STEP", "run --load DIR", "converge --load DIR"])
def test_a_payload_in_any_checkpoint_item_never_runs(entry, saved, converge_saved, tmp_path, capsys):
    """Every entry point that loads refuses, in one line and exit 2, a checkpoint whose non-tensor items
    (which DCP unpickles) carry code; the code does not run, whatever the manifest says."""
    marker = tmp_path / "payload-ran"
    if entry.startswith("converge"):
        _plant(converge_saved / "bf16" / "step-3", tmp_path / "ckpt" / "bf16" / "step-3", marker)
        argv = [*CONVERGE, "--tokens", "384", "--load", str(tmp_path / "ckpt")]
    else:
        _plant(saved, tmp_path / "ckpt" / "step-2", marker)
        argv = [*CLI, "--load", str(tmp_path / "ckpt" / "step-2" if entry.endswith("STEP") else tmp_path / "ckpt")]
    capsys.readouterr()
    assert main([*argv, "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert not marker.exists(), "the checkpoint's payload ran"
    assert len(err.strip().splitlines()) == 1 and "pickled item" in err and "Traceback" not in err, err
    assert not (tmp_path / "results").exists()


def test_a_checkpoint_of_the_pickling_format_is_refused_saying_why(saved, tmp_path, capsys):
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved, ckpt)
    meta = json.loads((ckpt / META_FILE).read_text())
    del meta["format"]  # as lpbench wrote it before: its step, RNG and scheduler state pickled
    (ckpt / META_FILE).write_text(json.dumps(meta))
    assert main([*CLI, "--load", str(ckpt), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pickles the step, RNG and scheduler state" in err, err


def test_every_file_of_a_checkpoint_is_hashed_and_checked(saved, tmp_path, capsys):
    ckpt = tmp_path / "step-2"
    shutil.copytree(saved, ckpt)
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # same size, one bit flipped in a tensor
    shard.write_bytes(bytes(data))
    assert main([*CLI, "--load", str(ckpt), "--results", str(tmp_path / "results")]) == 2
    assert f"corrupt checkpoint ({shard.name} differs from what was saved (SHA-256))" in capsys.readouterr().err


def test_an_hf_pytorch_bin_checkpoint_is_never_unpickled(tmp_path, capsys, monkeypatch):
    """A ``pytorch_model.bin`` beside config.json is refused without being read: it is a pickle."""
    from lpbench.models.hf import hf_config_dict

    marker = tmp_path / "payload-ran"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config_dict(MODELS["test-ckpt"])))
    torch.save({"model.embed_tokens.weight": _System(marker)}, folder / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    assert main([*CLI, "--hf-checkpoint", str(folder), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ".bin checkpoints are not read" in err and not marker.exists(), err

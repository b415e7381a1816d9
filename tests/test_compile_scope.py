"""--compile-scope: per-block compilation (default) or one whole-model graph."""

import shutil

import pytest
import torch

from lpbench.cli import main
from lpbench.config import RunConfig
from lpbench.models import build_model
from lpbench.models.registry import get_model_config, with_overrides
from lpbench.parallel.plan import parallelize

TINY = with_overrides(get_model_config("tiny"), n_layers=2)


def _parallelize(scope: str):
    model = build_model(TINY, device="cpu", seed=0)
    par = parallelize(model, RunConfig(compile_scope=scope), torch.device("cpu"), torch.float32, use_compile=True)
    return model, par


def test_block_scope_compiles_each_block_and_the_head_not_the_model():
    model, par = _parallelize("block")
    assert par.forward is model
    assert all(block._compiled_call_impl is not None for block in model.layers)
    assert "head" in vars(model)  # the compiled head shadows Decoder.head on this instance


def test_model_scope_compiles_one_graph():
    model, par = _parallelize("model")
    assert isinstance(par.forward, torch._dynamo.eval_frame.OptimizedModule) and par.forward._orig_mod is model
    assert all(block._compiled_call_impl is None for block in model.layers)
    assert "head" not in vars(model)


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler"
)
def test_block_compiled_loss_and_gradients_equal_eager():
    ids = torch.randint(0, TINY.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = build_model(TINY, device="cpu", seed=0)
        if compiled:  # block scope: the model is called as it is, its blocks and head compiled
            parallelize(model, RunConfig(), torch.device("cpu"), torch.float32, use_compile=True)
        loss = model(ids, ids.roll(-1, 1))
        loss.backward()
        results.append((loss.detach(), model.layers[0].mlp.down.weight.grad))
    (loss_e, grad_e), (loss_c, grad_c) = results
    assert torch.allclose(loss_c, loss_e, rtol=1e-5)
    assert ((grad_c - grad_e).norm() / grad_e.norm()) < 1e-4


@pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor's CPU backend needs a C++ compiler"
)
@pytest.mark.parametrize("broken", [False, True])
def test_a_compiled_run_says_when_its_graphs_break(monkeypatch, broken):
    """A compiled run logs the first step's graph breaks, with the commonest reason, and stores their count (a break
    runs the code between the graphs eagerly: a recomputed block's whole forward); a run without any says nothing.
    The break here: a warnings filter in the attention, which Dynamo cannot trace."""
    import warnings

    from lpbench.models import decoder
    from lpbench.train.loop import train

    if broken:
        attention = decoder.Attention.forward

        def filtered(self, *args, **kwargs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="never raised")
                return attention(self, *args, **kwargs)

        monkeypatch.setattr(decoder.Attention, "forward", filtered)
    torch._dynamo.reset()
    lines = []
    cfg = RunConfig(model="tiny", steps=2, warmup_steps=1, seq_len=32, mbs=2, gbs=2, compile=True, eval_every=0)
    result = train(cfg.with_(device="cpu"), log=lines.append)
    said = [line for line in lines if "torch.compile broke its graphs" in line]
    if broken:
        assert len(said) == 1 and "(most often: " in said[0] and result.metrics["compile_graph_breaks"] >= 2
    else:
        assert not said and "compile_graph_breaks" not in result.metrics


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--compile-scope", "model", "--fsdp", "--nproc-per-node", "2", "--mbs", "4"],
            "--compile-scope model needs one process or DDP; FSDP, TP and CP compile each block",
        ),
    ],
)
def test_model_scope_is_refused_under_fsdp_and_tp(argv, message, capsys, tmp_path):
    assert main(["run", "--model", "tiny", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_run_records_the_compile_scope_that_ran(tmp_path):
    from lpbench.bench.store import ResultsStore, RunRecord
    from lpbench.report.tables import summary_rows
    from lpbench.train.loop import train

    cfg = RunConfig(
        model="tiny",
        seq_len=16,
        mbs=1,
        gbs=1,
        steps=2,
        warmup_steps=1,
        precision="fp32",
        device="cpu",
        compile_scope="model",
    )  # compile defaults to off on CPU: nothing compiled
    result = train(cfg, log=lambda line: None)
    assert result.metrics["compile"] is False and result.metrics["compile_scope"] == "off"
    store = ResultsStore(tmp_path)
    store.add_run(
        RunRecord(
            config=cfg.to_dict(),
            status="ok",
            error=None,
            metrics=result.metrics,
            steps=result.steps,
            env=result.env,
            run_key=cfg.key(),
            group_id="g",
            workload="pretrain",
        )
    )
    (row,) = summary_rows(store.runs())
    assert row["compile_scope"] == "off" and row["compile"] is False

"""When FSDP2 shards the model (lpbench/sharding.py): the rule's truth table, and the layout and the memory
estimator following it."""

import pytest

from lpbench.config import RunConfig
from lpbench.metrics.estimate import estimate
from lpbench.models.registry import ModelConfig
from lpbench.parallel.dims import ParallelDims
from lpbench.precision.recipes import get_recipe
from lpbench.sharding import fsdp_requested, shards_data_parallel, uses_fsdp

# fsdp, dp, cp -> the data-parallel ranks shard, FSDP2 wraps the model
TABLE = [
    (False, 1, 1, False, False),  # one process
    (False, 2, 1, False, False),  # DDP
    (False, 1, 2, False, True),  # CP shards over its ranks without --fsdp
    (False, 2, 2, True, True),  # ... and over every DP x CP rank
    (True, 1, 1, False, False),  # --fsdp with nothing to shard over: a no-op
    (True, 2, 1, True, True),
    (True, 1, 2, False, True),
    (True, 2, 2, True, True),
]
HAND = ModelConfig("hand", 1, 8, 16, 2, 1, 32, head_dim=4)  # 1112 parameters (test_memory_estimate.py)


@pytest.mark.parametrize("fsdp, dp, cp, sharded, wrapped", TABLE)
def test_the_rule(fsdp, dp, cp, sharded, wrapped):
    assert fsdp_requested(fsdp, cp) == (fsdp or cp == 2)
    assert (shards_data_parallel(fsdp, dp, cp), uses_fsdp(fsdp, dp, cp)) == (sharded, wrapped)


@pytest.mark.parametrize("fsdp, dp, cp, sharded, wrapped", TABLE)
def test_the_layout_and_the_estimate_follow_the_rule(fsdp, dp, cp, sharded, wrapped):
    cfg = RunConfig(model="tiny", seq_len=64, mbs=1, gbs=dp, fsdp=fsdp, cp=cp, device="cpu").with_world(dp * cp)
    dims = ParallelDims.of(cfg)
    assert (dims.fsdp_enabled, dims.ddp_enabled) == (wrapped, dp > 1 and not wrapped)
    assert (dims.dp_replicate, dims.dp_shard) == ((1, dp) if sharded else (dp, 1))
    e = estimate(HAND, get_recipe("fp32"), seq_len=64, mbs=1, dp=dp, cp=cp, fsdp=fsdp, cuda=False)
    assert e.parts["master weights (fp32)"] == 4 * 1112 / ((dp if sharded else 1) * cp)

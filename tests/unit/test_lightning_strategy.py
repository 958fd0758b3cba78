"""The `phalanx_ddp` strategy is in Lightning's two registries and refuses a shard level (pure: builds no
process group; marked `trainers`: needs the trainers extra). Its training runs: tests/e2e/test_lightning.py."""

from __future__ import annotations

import pytest

from phalanx.errors import ShardingError
from tests.helpers.trainers import require

pytestmark = pytest.mark.trainers


def test_phalanx_ddp_is_registered_for_fabric_and_the_trainer():
    require("lightning")
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from phalanx.integrations.lightning import PhalanxDDPStrategy, PhalanxFabricStrategy

    assert STRATEGY_REGISTRY["phalanx_ddp"]["strategy"] is PhalanxFabricStrategy
    assert StrategyRegistry["phalanx_ddp"]["strategy"] is PhalanxDDPStrategy
    assert isinstance(StrategyRegistry.get("phalanx_ddp"), PhalanxDDPStrategy)
    assert isinstance(STRATEGY_REGISTRY.get("phalanx_ddp"), PhalanxFabricStrategy)


@pytest.mark.parametrize("api", ["fabric", "trainer"])
def test_a_shard_level_is_refused_with_what_to_do(api):
    require("lightning")
    from phalanx.integrations.lightning import PhalanxDDPStrategy, PhalanxFabricStrategy

    strategy = {"fabric": PhalanxFabricStrategy, "trainer": PhalanxDDPStrategy}[api]
    with pytest.raises(ShardingError, match=r"seen shard='optimizer'.*shard_optimizer"):
        strategy(shard="optimizer")
    assert strategy(shard="none")._ddp_kwargs == {"shard": "none"}

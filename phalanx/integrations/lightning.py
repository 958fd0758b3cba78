"""Lightning's `phalanx_ddp` strategy, for Fabric and for the Trainer: Lightning's DDP strategy with
phalanx's DistributedDataParallel in place of torch's.

Importing this module registers the name in both registries:

    import phalanx.integrations.lightning      # registers strategy="phalanx_ddp"
    trainer = lightning.Trainer(strategy="phalanx_ddp", accelerator="cpu", devices=2)
    fabric = lightning.Fabric(strategy="phalanx_ddp", accelerator="cpu", devices=2)

Lightning's own DDP strategies test `isinstance(model, torch's DDP)` in several places (unwrapping for
checkpoints, no_sync for gradient accumulation, manual optimization, teardown); these subclasses
answer the same questions for phalanx's class. Everything else (launch, process group, samplers,
precision, checkpoint I/O) is Lightning's DDP strategy unchanged. Needs the `trainers` extra.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.fabric.strategies.ddp import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook, prepare_for_backward
from lightning.pytorch.strategies import StrategyRegistry as TRAINER_STRATEGIES
from lightning.pytorch.strategies.ddp import DDPStrategy as TrainerDDPStrategy
from torch.nn import Module

from ..engine.ddp import DistributedDataParallel
from ..errors import ShardingError, explain

NAME = "phalanx_ddp"


def check_no_shard(kwargs: dict) -> None:
    """Lightning builds and steps the optimizers itself, never through `model.shard_optimizer`: no shard level."""
    shard = kwargs.get("shard", "none")
    if shard != "none":
        raise ShardingError(explain(
            "strategy='phalanx_ddp' replicates the model: Lightning steps its optimizers itself, not the sharded "
            "optimizer a shard level needs", seen=f"shard={shard!r}", expected="shard='none' (the default)",
            fix="Leave out shard=, or train with phalanx.DistributedDataParallel(..., shard=...) and "
                "model.shard_optimizer(optimizer) in a loop of your own (docs/sharding.md)."))


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Fabric's `no_backward_sync(model)`: phalanx DDP's `no_sync()`."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(explain("no_backward_sync needs the module Fabric set up with strategy='phalanx_ddp'",
                                    seen=type(module).__name__, expected="phalanx.DistributedDataParallel",
                                    fix="Pass the model returned by fabric.setup()."))
        return module.no_sync()


class PhalanxFabricStrategy(FabricDDPStrategy):
    """Fabric's DDP strategy on phalanx's DistributedDataParallel (`Fabric(strategy="phalanx_ddp")`).

    Keyword arguments go to DistributedDataParallel, as with Fabric's DDPStrategy
    (`PhalanxFabricStrategy(find_unused_parameters=True, bucket_cap_mb=...)`).
    """

    def __init__(self, *args, **kwargs):
        check_no_shard(kwargs)
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _NoSync()

    def setup_module(self, module: Module) -> DistributedDataParallel:
        return DistributedDataParallel(module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)

    def get_module_state_dict(self, module: Module) -> dict:
        return super().get_module_state_dict(module.module if isinstance(module, DistributedDataParallel) else module)

    def load_module_state_dict(self, module: Module, state_dict: dict, strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(NAME, cls, description="DDP on phalanx.DistributedDataParallel", override=True,
                                   start_method="popen")


class PhalanxDDPStrategy(TrainerDDPStrategy):
    """The Trainer's DDP strategy on phalanx's DistributedDataParallel (`Trainer(strategy="phalanx_ddp")`).

    Keyword arguments go to DistributedDataParallel, as with Lightning's DDPStrategy; `ddp_comm_hook` (and
    its state and wrapper) is registered on the CPU too (Lightning's registers it on GPUs only).
    """

    def __init__(self, *args, **kwargs):
        check_no_shard(kwargs)
        super().__init__(*args, **kwargs)

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)

    def pre_backward(self, closure_loss) -> None:
        """Manual optimization: `manual_backward` averages the gradients (reducer.prepare_for_backward)."""
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    def post_backward(self, closure_loss) -> None:
        """Nothing to flush: torch's static graph defers the first all-reduce, phalanx's never does."""

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrap, as Lightning's DDPStrategy does for torch's class
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(NAME, cls, description="DDP on phalanx.DistributedDataParallel", override=True,
                                   start_method="popen")


PhalanxFabricStrategy.register_strategies(FABRIC_STRATEGIES)
PhalanxDDPStrategy.register_strategies(TRAINER_STRATEGIES)

"""`OptimizerView`: a torch optimizer standing for one it wraps, as sharded models hand back.

Its param groups, state and defaults are the wrapped optimizer's own objects (shared, not copied),
so an LR scheduler or a GradScaler given the view acts on the wrapped optimizer, and hyperparameters
set on either are seen by both. Subclasses decide what step() and the state dicts do.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from ..errors import ShardingError, StrayOptimizerError, explain

# The scaler passes itself to an optimizer that unscales on its own (our step makes the overflow check
# global, which needs the scaler's per-device results); torch warns that this way may change one day.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)

_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                "_optimizer_load_state_dict_post_hooks")


class OptimizerView(torch.optim.Optimizer):
    """Base of the optimizers that sharded models return (torch.optim.Optimizer's constructor is not
    called: there are no parameters of its own to register)."""

    _step_supports_amp_scaling = True  # GradScaler hands itself to step(): the overflow check is global

    @staticmethod
    def _check_wrappable(optimizer, rank: int) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OptimizerView):
            raise ShardingError(explain("shard_optimizer() takes a torch optimizer built over the model's parameters",
                                        rank=rank, seen=f"a {type(optimizer).__name__}",
                                        expected="a torch.optim.Optimizer",
                                        fix="Pass e.g. torch.optim.AdamW(model.parameters(), lr=...)."))

    def _wrap(self, optimizer: torch.optim.Optimizer, rank: int) -> None:
        self.optimizer = optimizer
        self.rank = rank
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        for name in _HOOK_TABLES:
            setattr(self, name, OrderedDict())

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """The wrapped optimizer's step (between this view's step hooks), skipped on every rank when GradScaler
        saw an overflow on any; subclasses add what comes before and after."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_step()
        if grad_scaler is not None and self._overflowed(grad_scaler):
            return loss  # skipped on every rank: the parameters are unchanged everywhere
        for hook in self._optimizer_step_pre_hooks.values():
            hook(self, (), {})
        self._stepping = True
        try:
            self.optimizer.step()
        finally:
            self._stepping = False
        for hook in self._optimizer_step_post_hooks.values():
            hook(self, (), {})
        self._after_step()
        return loss

    def _only_through_view(self) -> None:
        """Refuse a step of the wrapped optimizer called directly: only this view's step() does what comes
        before and after it (the parameters' all-gather), so a direct one would leave ranks apart, silently."""
        self._stepping = False
        # The hook lives in the wrapped optimizer: it holds this view weakly (no cycle keeps either alive
        # after the user drops them), and a view that is gone makes any direct step a stray one.
        view, rank, name = weakref.ref(self), self.rank, type(self).__name__

        def refuse(optimizer, args, kwargs):
            me = view()
            if me is None or not me._stepping:
                raise StrayOptimizerError(explain(
                    f"{type(optimizer).__name__}.step() was called on the optimizer given to shard_optimizer(), "
                    "which only updates this rank's chunk", rank=rank, seen="optimizer.step()",
                    expected=f"the step of the {name} that shard_optimizer() returned",
                    fix="Step what shard_optimizer() returns: optimizer = model.shard_optimizer(optimizer)."))

        self.optimizer.register_step_pre_hook(refuse)

    def _before_step(self) -> None:
        """Runs before the step (and before the overflow check)."""

    def _after_step(self) -> None:
        """Runs after a step that was taken."""

    def _overflowed(self, scaler) -> bool:
        """Collective: whether GradScaler saw an overflow on any rank (see _overflowed_anywhere)."""
        raise NotImplementedError

    def _overflowed_anywhere(self, scaler, group, device: torch.device, wait=None) -> bool:
        """For step(grad_scaler=...): unscale (unless the user did) and agree across ranks on whether any
        gradient overflowed. Each rank sees its own shards only, and the scaler's update must be the same
        everywhere, so its per-device flags are overwritten with the agreed one (collective)."""
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        found = state["found_inf_per_device"]
        flag = torch.tensor([sum(v.item() for v in found.values())], dtype=torch.float32, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        work.wait() if wait is None else wait(work, "the all-reduce of GradScaler's overflow flag")
        for value in found.values():
            value.fill_(float(flag))
        return bool(flag)

    def _rebind(self) -> None:
        """After the wrapped optimizer loaded a state dict (which replaces its groups and state)."""
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __getstate__(self):
        raise ShardingError(explain(f"a {type(self).__name__} cannot be pickled: it is tied to this process's model",
                                    rank=self.rank, fix="Save optimizer.state_dict() (collective) instead."))

    def add_param_group(self, param_group: dict) -> None:
        raise ShardingError(explain(f"add_param_group() is not available on a {type(self).__name__}",
                                    rank=self.rank, seen="a new param group after shard_optimizer()",
                                    fix="Put every group in the optimizer before calling shard_optimizer()."))

"""join(): ranks with fewer batches finish early and shadow the collectives of the ranks still training.

Each iteration of the others starts with one all-reduce (MAX) of what it synchronizes (bit 0
gradients, bit 1 buffers); a joined rank mirrors the buffer broadcast and the gradient exchange
with zeros (the exchange's `shadow`). When all ranks are done, the model of the last rank to finish
is broadcast, so replicas end identical. torch's `Join` context drives it through `DDPJoinHook`;
`JoinMixin` gives the DDP front torch's `Joinable` surface (`join()`, `join_hook`, ...).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from ..bucket.shard_levels import unsupported_with_sharding
from ..diagnose import recorder
from .replicas import broadcast_coalesced, shared_states

SYNCS_GRADIENTS, SYNCS_BUFFERS = 1, 2


class JoinMixin:
    """torch's Joinable interface, mixed into DistributedDataParallel (beside torch's `Joinable`)."""

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for ranks with different numbers of batches (as torch's).

        >>> with model.join():                              # doctest: +SKIP
        ...     for batch in my_shard:                      # ranks may differ in length
        ...         model(batch).sum().backward(); optimizer.step()
        """
        if self.shard != "none" and enable:
            raise unsupported_with_sharding("join()", self.shard, "Give every rank the same number of batches "
                                            "(phalanx.DistributedSampler does), or use shard='none'.")
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> DDPJoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._control_device

    @property
    def join_process_group(self):
        return self.process_group


class DDPJoinHook(JoinHook):
    """Lets a rank that ran out of data shadow the collectives of the ranks still training."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """On a rank out of data: mirror one iteration of the ranks still training."""
        ddp = self.ddp
        ddp._guard.enabled = False
        flags = announce_sync(ddp, 0)
        if flags & SYNCS_BUFFERS and ddp._has_buffers:
            ddp._sync_buffers(True, src=find_common_rank(ddp, -1, False))
        if flags & SYNCS_GRADIENTS:
            ddp._reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """After join: every rank adopts the model of the (highest) last rank to finish, and its optimizer state
        (replicas/audit.py: the replica audit then checks that they agree)."""
        ddp = self.ddp
        src, step, steps = all_reduce_max(ddp, [dist.get_rank() if is_last_joiner else -1, ddp._guard.step,
                                                ddp._audit.steps])
        broadcast_coalesced([t for _, t in shared_states(ddp.module, ddp._ignored)], src,
                            ddp.process_group, wait=ddp._guard.wait_work)
        ddp._guard.step = step
        ddp._guard.end()
        ddp._guard.enabled = True
        ddp._join_config = _JoinConfig.construct_disabled_join_config()
        ddp._audit.after_join(src, steps)


def all_reduce_max(ddp, values: list[int]) -> list[int]:
    """Element-wise maximum over the ranks of the model's group (a join control collective)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=ddp._control_device)
    entry = recorder.begin(recorder.JOIN, -1, tensor.numel(), tensor.dtype)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ddp.process_group, async_op=True)
    ddp._guard.wait_work(work, "a join control all-reduce")
    recorder.done(entry)
    return tensor.tolist()


def announce_sync(ddp, flags: int) -> int:
    """Tell joined ranks what this iteration synchronizes (SYNCS_GRADIENTS | SYNCS_BUFFERS)."""
    return all_reduce_max(ddp, [flags])[0]


def find_common_rank(ddp, rank: int, candidate: bool) -> int:
    """The highest rank among the candidates: the source of a broadcast while some ranks have joined."""
    return all_reduce_max(ddp, [rank if candidate else -1])[0]


def count_active_ranks(join_work) -> int:
    """The number of ranks still training, from the all-reduce Join.notify_join_context launched."""
    value = join_work.get_future().wait()
    tensor = value[0] if isinstance(value, list) else value
    return max(1, int(torch.as_tensor(tensor).item()))

"""A DDP model moved in-process onto the next generation of the world: the ranks left after a loss.

Data parallelism keeps a whole replica on every rank, bitwise equal after each step, so ranks that
survive the loss of others need no restart and no checkpoint read: they meet on a new process group
(the old one cannot be trusted: a Gloo collective on it may wait on a dead peer, and cannot be
aborted) and go on. `regroup(group)` rebuilds what was built from the old group (the host topology,
the step guard, the exchange, shared memory among the ranks left included, and the reducer's buckets)
and drops the gradients of the step in flight, which the survivors redo. The parameters do not move.

Sharded levels keep a part of the state on each rank. With shard="optimizer" or "gradients" the model
regroups like an unsharded one (its exchange cut again for the new world) and its ShardedOptimizer puts the
optimizer state back together from the ranks left and the copies they keep of their peers' shards
(sharding/shard_copies/). shard="parameters" (FSDP2) refuses: the run falls back to its checkpoint.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..bucket.shard_levels import unsupported_with_sharding
from ..errors import WorldConfigError, explain
from ..exchange.choose import choose_exchange
from ..sharding.shard_copies import COPIES_ENV, copies_on
from ..world import generation, joining
from ..world.group import collective_device
from .replicas import check_same_signature


class RegroupMixin:
    """`regroup`, mixed into DistributedDataParallel (which provides `_build_engine` and the engine's state)."""

    # DiLoCo under live recovery: whether every host's exchange settles alike (_agree_on_commits); None otherwise. A
    # class default, so that the per-step question finds it: a missing attribute costs nn.Module's __getattr__ and
    # an exception, tens of microseconds a step on the commit's critical path.
    _hosts_settle: bool | None = None

    def regroup(self, process_group) -> None:
        """Train on `process_group` from the next forward on, in place of the group the model had.

        Collective over `process_group`: each of its ranks calls it, in the same order with respect to other
        DDP models. The gradients of a step not yet applied are dropped (set to None): redo that step on the
        new group. A comm hook registered before is registered again on the new engine.

        >>> survivors = torch.distributed.new_group([0, 1], use_local_synchronization=True)  # doctest: +SKIP
        >>> model.regroup(survivors)
        """
        if process_group is None or process_group == dist.GroupMember.NON_GROUP_MEMBER:
            raise WorldConfigError(explain(
                "regroup needs the process group this rank trains on next", rank=dist.get_rank(),
                seen=repr(process_group), expected="a group this rank is a member of",
                fix="Pass the group every surviving rank made (dist.new_group(survivors, ...)), on each survivor."))
        if self.shard != "none" and not getattr(self, "_shards_copied", False):
            raise unsupported_with_sharding("regroup()", self.shard, "A lost rank took its shards with it: restart "
                                            "from the newest checkpoint (phalanx run does), or use shard='none', or "
                                            "'optimizer' or 'gradients' with their shard copies on (under live "
                                            "recovery, unless PHALANX_SHARD_COPIES=0).")
        if self._reducer is not None:
            self._reducer.remove()  # the old hooks would launch buckets on the old group
            self._reducer.exchange.close()
        for handle in getattr(self, "_gather_waits", None) or ():
            handle.remove()  # they wait on the old exchange's all-gathers
        self._gather_waits = None
        self.process_group = process_group
        self._group_rank0 = dist.get_global_rank(process_group, 0)
        self._control_device = collective_device(process_group, self._named_params[0][1].device)
        self._hosts = None  # which ranks share a host: asked again of the ranks left
        check_same_signature(self.module, process_group, self._control_device)
        for _, parameter in self._named_params:
            parameter.grad = None  # the step in flight is redone on the new group
        self._build_engine()
        if self._comm_hook is not None:
            self._reducer.set_exchange(choose_exchange(process_group, self._guard, self._reducer.params, owner=self,
                                                       comm_hook=self._comm_hook))
        self._audit.due("regroup")  # the replicas are compared at the end of the next optimizer step

    def _follow_generations(self) -> None:
        """With live recovery on (world/generation.py), regroup onto each new generation of the world. Only a
        model on the whole world: the ranks of a group of the user's own are the user's to rebuild."""
        if generation.live_recovery() and self._on_the_world:
            generation.on_regroup(self._onto_generation)

    def _onto_generation(self, survivors) -> None:
        if self.outer_step is None:
            self.regroup(survivors.group)
            return
        # across_hosts=DiLoCo: the host's ranks in the new world, its outer step's groups made again (diloco/live.py)
        self.regroup(self.outer_step.regroup(survivors))
        self._agree_on_commits(survivors.group)

    def _live_sharding(self):
        """For shard_optimizer(): what a ShardedOptimizer needs to follow the generations (the model's ranks by
        host, its current exchange), when this model follows them; else None."""
        if not (generation.live_recovery() and self._on_the_world):
            return None
        if not copies_on():
            generation.say_mode(False, f"{COPIES_ENV}=0: no copy of a rank's optimizer shard is kept")
            joining.refuse(f"{COPIES_ENV}=0: a sharded model does not follow the run's generations")
            return None
        self._shards_copied = True
        model = weakref.ref(self)

        def hosts():
            groups = getattr(model(), "_hosts", None)
            return [list(ranks) for ranks in groups.topology.hosts] if groups is not None else None

        return hosts, lambda: model()._reducer.exchange

    def _steps_settle_alike(self) -> bool:
        """Whether the coming step's collectives end the same way on every rank (live recovery then needs no
        per-step commit): a shared-memory exchange, after the one-time rebuild (whose broadcast is Gloo's), and
        no map of used parameters (a Gloo all-reduce after the exchange). Under DiLoCo the commit is the whole
        world's while each host exchanges alone: every rank answers alike (_agree_on_commits)."""
        reducer = self._reducer
        if self._hosts_settle is not None:  # asked once a step (its last backward)
            fresh, self._engine_fresh = self._engine_fresh, False
            return reducer is not None and self._hosts_settle and not fresh
        return (reducer is not None and reducer.rebuilt and not reducer.tolerate_unused
                and reducer.exchange.settles_alike)

    def _agree_on_commits(self, group) -> None:
        """DiLoCo under live recovery, collective over `group` (the world that trains), once the engine was built:
        whether the steps commit, the same answer on every rank. Each host's exchange is its own (one rank: nothing
        to exchange), so they answer alike only if all settle alike; the first step after a build commits on
        every rank (shared memory's one-time rebuild broadcasts over Gloo)."""
        reducer = self._reducer
        alike = not reducer.tolerate_unused and (self.process_group.size() == 1 or reducer.exchange.settles_alike)
        flag = torch.tensor([int(alike)], dtype=torch.int32, device=collective_device(group, self._control_device))
        generation.wait_for(dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True),
                            "DiLoCo's agreement on per-step commits")
        self._hosts_settle, self._engine_fresh = bool(flag.item()), True


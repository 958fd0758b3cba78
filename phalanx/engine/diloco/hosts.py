"""Where `across_hosts=px.DiLoCo(...)` starts: the checks that need the world, the model's process group cut to its
host, and the model's outer step (an OuterStep across hosts, a OneHost on one)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...bucket.shard_levels import unsupported_with_sharding
from ...errors import AcrossHostsError, explain
from ...log import logger
from ...world import generation
from ...world.topology import HostGroups, host_topology
from . import fragments
from .config import DiLoCo
from .live import LiveOuter, make_groups
from .outer import OuterStep


def split_across_hosts(config, group, params: list[torch.Tensor], buffers: list[torch.Tensor], shard: str,
                       on_the_world: bool):
    """(the process group of this rank's host, its OuterStep) for a DDP model with `across_hosts=config`, built on
    `group` (the whole world); `buffers`: those DDP broadcasts. Collective on `group`. On one host: (`group`, a
    OneHost, which steps nothing), said once."""
    rank = dist.get_rank()
    if not isinstance(config, DiLoCo):
        raise AcrossHostsError(explain(
            "DistributedDataParallel across_hosts takes a phalanx.DiLoCo", rank=rank,
            seen=f"across_hosts={config!r}", expected="px.DiLoCo(every=H), or None (the exact exchange)",
            fix="Pass across_hosts=px.DiLoCo(every=100), say."))
    if fragments.split([p.numel() for p in params], config.fragments) is None:
        most = max(d for d in range(1, max(1, len(params)) + 1) if config.every % d == 0)
        raise AcrossHostsError(explain(
            "DiLoCo fragments cuts the model's parameters into whole-parameter fragments", rank=rank,
            seen=f"fragments={config.fragments} for {len(params)} parameters",
            expected=f"fragments <= {len(params)} (one parameter at least in each)",
            fix=f"Pass fragments={most} (the most that divides every={config.every}), or fewer."))
    if shard != "none":
        raise unsupported_with_sharding(f"across_hosts={config}", shard, "Use shard='none' with DiLoCo (the "
                                        "sharded levels inside a host come later).")
    if not on_the_world:
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(...) builds its groups from the whole world", rank=rank,
            seen="a process_group of the user's", expected="process_group=None",
            fix="Leave process_group unset: phalanx makes the host and cross-host groups itself."))
    live = generation.live_recovery()
    if live and config.delay:
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(delay>0) does not follow live recovery: a fragment's average on its way when a host "
            "is lost could be merged on some hosts and not on others", rank=rank,
            seen=f"delay={config.delay} with live recovery on", expected="delay=0 (fragments= may stay)",
            fix="Pass delay=0 under live recovery, or turn live recovery off (a lost host then restarts the run "
                "from its newest checkpoint)."))
    topology = host_topology(group, generation.all_gather_objects)
    if not topology.spans_hosts:
        logger.info("across_hosts=%s on one host: exact DDP, no outer step", config)
        if not live:
            return group, OneHost(config)
        # Under live recovery an outer step that waits for hosts to come (a joiner starts in a world of its own).
        outer = OuterStep(config, params, buffers, group, None, 1, topology.local, topology.local_size)
        outer.live = LiveOuter((), generation.current(), topology)
        return group, outer
    if not topology.uniform:
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(...) needs the same number of ranks on every host", rank=rank,
            seen=f"ranks per host {[len(r) for r in topology.hosts]}", expected="e.g. 2 hosts x 4 ranks",
            fix="Start as many ranks on every node (--nproc-per-node)."))
    logger.info("across_hosts=%s: exact DDP inside each of %s, an outer step across hosts every %d optimizer "
                "steps; the replica audit compares the ranks of a host", config, topology.describe(), config.every)
    if live:  # groups made by name, as after a regroup (live.py)
        now = generation.current()
        host, network, chunks = make_groups(topology, now.members, now.number)
        outer = OuterStep(config, params, buffers, host, network, len(topology.hosts), topology.local,
                          topology.local_size, chunks)
        outer.live = LiveOuter((host, network), now, topology)
        return host, outer
    hosts = HostGroups(topology, group).build()
    return hosts.host, OuterStep(config, params, buffers, hosts.host, hosts.network, len(topology.hosts),
                                 topology.local, topology.local_size)


class OneHost:
    """`model.outer_step` on one host: no outer step (the model is exact DDP). In a checkpoint's state it stands
    where an OuterStep stands on several hosts, so a run resumes at another host count: from a checkpoint of
    several hosts it goes on from the model as saved (host 0's); its own state starts a fresh period there."""

    spans_hosts = False

    def __init__(self, config: DiLoCo):
        self.config = config

    def state_dict(self) -> dict:
        return {"every": self.config.every, "hosts": 1}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to load: the outer momentum and the synced parameters have no use on one host."""

    def before_optimizer_step(self, optimizer) -> None:
        """Nothing to count on one host."""

    def after_optimizer_step(self) -> None:
        """No outer step on one host."""

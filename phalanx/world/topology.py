"""Which host each rank runs on, and the process groups of a two-level (host, network) exchange.

A host is the launcher's node: `GROUP_RANK` (the node rank `phalanx run` and torchrun give their
workers), SLURM's `SLURM_NODEID` under srun, never `gethostname()`: two network namespaces on one
machine are two hosts although they share its name (and its /dev/shm). `host_topology` gathers
every rank's host once; `HostGroups` builds a group per host and a group per local index across
hosts, every rank building every group in the same order (what `dist.new_group` requires).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import WorldConfigError, explain
from .group import live_group

XHOST_CHOICES = ("auto", "flat", "hier")


def host_key(environ: Mapping[str, str] | None = None) -> str:
    """This process's host, as its launcher names it: the node rank, not the machine's name.

    >>> host_key({"GROUP_RANK": "1", "RANK": "5", "LOCAL_RANK": "1"})
    'node1'
    >>> host_key({"SLURM_NODEID": "3", "SLURM_PROCID": "7", "SLURM_STEP_ID": "0"})
    'node3'
    >>> host_key({"RANK": "5", "LOCAL_RANK": "1"})   # set by hand: ranks are dealt node by node
    'first-rank4'
    >>> host_key({"RANK": "5", "WORLD_SIZE": "6"})   # no LOCAL_RANK: one node, as discovery reads it
    'first-rank0'
    """
    env = os.environ if environ is None else environ
    if "GROUP_RANK" in env and ("RANK" in env or "WORLD_SIZE" in env):
        return f"node{int(env['GROUP_RANK'])}"
    if "SLURM_NODEID" in env and ("SLURM_PROCID" in env and "RANK" not in env):
        return f"node{int(env['SLURM_NODEID'])}"
    if "RANK" in env:  # LOCAL_RANK as discovery.py reads it: by default rank % LOCAL_WORLD_SIZE (WORLD_SIZE)
        rank = int(env["RANK"])
        local = int(env.get("LOCAL_RANK", rank % int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))))
        return f"first-rank{rank - local}"
    return "node0"


def xhost_choice(environ: Mapping[str, str] | None = None) -> str:
    """`PHALANX_XHOST`: "flat" or "hier" forces the exchange across hosts, "auto" (unset) lets phalanx choose."""
    env = os.environ if environ is None else environ
    raw = env.get("PHALANX_XHOST", "auto").strip().lower() or "auto"
    if raw not in XHOST_CHOICES:
        raise WorldConfigError(explain("PHALANX_XHOST has an unknown value", seen=repr(raw),
                                       expected=" | ".join(XHOST_CHOICES),
                                       fix="Set PHALANX_XHOST=flat or hier to force a choice, or unset it."))
    return raw


@dataclass(frozen=True)
class Topology:
    """The ranks of a process group by host. `hosts[h]` lists the group ranks on host h (hosts in the
    order of their lowest rank, ranks ascending); this rank is `hosts[host][local]`."""

    hosts: tuple[tuple[int, ...], ...]
    host: int
    local: int
    xhost: str = "auto"  # PHALANX_XHOST, the same on every rank (checked)
    key: str = "node0"  # this rank's host as host_key() names it (shared-memory segments carry it)

    @property
    def spans_hosts(self) -> bool:
        return len(self.hosts) > 1

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks (what the per-local-index network groups need)."""
        return len({len(ranks) for ranks in self.hosts}) == 1

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host])

    def hierarchical(self) -> bool:
        """Whether the two-level exchange applies: ranks span hosts, some host holds more than one rank,
        every host the same number, and PHALANX_XHOST does not say "flat"."""
        fits = self.spans_hosts and max(len(r) for r in self.hosts) > 1 and self.uniform
        return fits and self.xhost != "flat"

    def describe(self) -> str:
        sizes = [len(r) for r in self.hosts]
        return f"{len(self.hosts)} host(s) x {sizes} rank(s)"


def topology_from_keys(keys: list, rank: int) -> Topology:
    """The topology of a group whose rank j reported `keys[j]` = (host key, PHALANX_XHOST).

    >>> topology_from_keys([("node0", "auto"), ("node0", "auto"), ("node1", "auto"), ("node1", "auto")], 2)
    Topology(hosts=((0, 1), (2, 3)), host=1, local=0, xhost='auto', key='node1')
    """
    choices = {choice for _, choice in keys}
    if len(choices) > 1:
        seen = {j: choice for j, (_, choice) in enumerate(keys)}
        raise WorldConfigError(explain("ranks disagree on PHALANX_XHOST", rank=rank, seen=f"(rank: value) {seen}",
                                       expected="the same value on every rank",
                                       fix="Set PHALANX_XHOST alike in every node's environment, or unset it."))
    order: dict[str, list[int]] = {}
    for j, (key, _) in enumerate(keys):
        order.setdefault(key, []).append(j)
    hosts = tuple(tuple(ranks) for ranks in sorted(order.values()))
    host = next(h for h, ranks in enumerate(hosts) if rank in ranks)
    return Topology(hosts, host, hosts[host].index(rank), choices.pop(), keys[rank][0])


def host_topology(group=None, gather=None) -> Topology:
    """Collective on `group` (default: the world): every rank's host, gathered; the same answer everywhere.
    `gather(mine, group, what)`: every rank's object in rank order; the engines pass generation.all_gather_objects,
    whose waits a loss ends at once under live recovery (a regroup gathers the survivors' hosts here, and a second
    loss then must not hold them for the group's timeout); this module, which the generations' watch imports,
    cannot import it. Default: dist.all_gather_object."""
    group = group if group is not None else dist.group.WORLD
    mine = (host_key(), xhost_choice())
    if gather is not None:
        return topology_from_keys(gather(mine, group, "the ranks' hosts"), dist.get_rank(group))
    keys = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, mine, group=group)
    return topology_from_keys(keys, dist.get_rank(group))


class HostGroups:
    """The topology of a process group and, built on demand, the groups of the two-level exchange: `host`
    (this host's ranks, for shared memory) and `network` (the ranks with this local index, one per host,
    for Gloo; only when every host holds as many ranks).

    `build()` is collective on the whole world: every rank creates every group, hosts first, then local
    indices, in the same order (`dist.new_group`'s rule). Whoever calls it decides alike on every rank.
    """

    def __init__(self, topology: Topology, group=None):
        self.topology = topology
        self.group = group if group is not None else dist.group.WORLD
        # Whether the group is the whole world, the world torch's default group was made with: never once ranks were
        # lost or joined (a joiner's default group is a world it never talks to: world/joining.py).
        self.whole_world = dist.get_world_size(self.group) == dist.get_world_size() and live_group() is None
        self.host = self.network = None
        self._built = False

    def build(self) -> HostGroups:
        if self._built:
            return self
        if dist.get_world_size(self.group) != dist.get_world_size():
            raise WorldConfigError(explain(
                "host groups are built from the whole world", rank=dist.get_rank(),
                seen=f"a process group of {dist.get_world_size(self.group)} ranks",
                expected=f"the world's {dist.get_world_size()} ranks",
                fix="Use the flat exchange for a subgroup (PHALANX_XHOST=flat)."))
        ranks = dist.get_process_group_ranks(self.group)  # group rank -> global rank
        topology = self.topology
        for h, members in enumerate(topology.hosts):
            made = dist.new_group([ranks[j] for j in members])
            if h == topology.host:
                self.host = made
        if topology.uniform:
            for j in range(len(topology.hosts[0])):
                made = dist.new_group([ranks[members[j]] for members in topology.hosts])
                if j == topology.local:
                    self.network = made
        self._built = True
        return self

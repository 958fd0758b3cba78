"""DiLoCo under live recovery: the outer step's groups made again for each generation of the world, and an outer
step redone on the hosts left when a host is lost during it.

The outer state (synced parameters, outer momentum, step count) is the same on every host after each outer step, so
the hosts left hold it whole: a host lost in mid-period takes only its own progress since the last sync, and the next
outer step averages over the hosts left. An outer step is applied on every rank left or on none: a commit through the
store after its average (once per outer step); a loss before that regroups the ranks left, which send it again from
the same parameters. A rank taken in (a host that returns) was handed the outer state and starts from the synced
parameters, not from another host's progress. With one host left the model is exact DDP there (no outer step); a
host that comes back starts a new period from that host's parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import AcrossHostsError, PeerDiedError, explain
from ...log import logger
from ...world import generation, joining
from ...world import group as world
from ...world.generations import release
from ...world.topology import Topology, host_topology
from .exchange import Exact, exchange

_made: dict[int, int] = {}  # generation number -> DiLoCo models whose groups were made in it (names them alike)


def make_groups(topology: Topology, members: tuple[int, ...], number: int):
    """(this host's group, the cross-host group of this local index or None, chunks) for a generation of `members`
    (global ranks, by group rank) cut by `topology`, made by name: only their members take part (the world's default
    group holds lost ranks, and a joiner's is a world of its own). Chunks: the fewest ranks on a host; a rank of a
    larger host past them has no cross-host group."""
    k = _made[number] = _made.get(number, 0) + 1
    name = f"phalanx/{world.attempt()}/generation{number}/diloco{k}"
    # Made as the generation's own groups are (generation_group: its connect and collective timeouts).
    host = generation.generation_group(sorted(members[j] for j in topology.hosts[topology.host]),
                                       f"{name}/host{topology.host}")
    chunks = min(len(ranks) for ranks in topology.hosts)
    network = None
    if topology.local < chunks:
        network = generation.generation_group(sorted(members[ranks[topology.local]] for ranks in topology.hosts),
                                              f"{name}/local{topology.local}")
    return host, network, chunks


class LiveOuter:
    """What an OuterStep needs to follow the generations: the groups it made (released at the next regroup) and the
    members it had (a regroup that lost some aborts them rather than waiting on them)."""

    def __init__(self, made: tuple, before, topology: Topology):
        self.made = [group for group in made if group is not None]
        self.members, self.number = before.members, before.number
        self.layout = [len(ranks) for ranks in topology.hosts]  # ranks per host, as last said

    @torch.no_grad()
    def regroup(self, outer, survivors) -> object:
        """Collective over generation `survivors`: the host and cross-host groups made for it, `outer` bound to
        them, and the host group returned (the DDP model's next process group)."""
        if self.number == joining.SOLO and not outer._handed:
            raise AcrossHostsError(explain(
                "a rank taken into a run with across_hosts=DiLoCo(...) was handed no outer state", rank=dist.get_rank(),
                seen="state without model.outer_step", expected="state['outer'] = model.outer_step in the state of "
                "checkpointer.restore(state) and checkpointer.step(state), on every rank",
                fix="Put model.outer_step in the Checkpointer's state (docs/diloco.md): the synced parameters, the "
                    "outer momentum and the step count come with it."))
        before = outer.hosts
        topology = host_topology(survivors.group, generation.all_gather_objects)
        if topology.spans_hosts:
            host, network, chunks = make_groups(topology, survivors.members, survivors.number)
            made = (host, network)
        else:  # one host: the model is exact DDP on the generation's group, no outer step
            host, network, chunks, made = survivors.group, None, 1, ()
        lost = bool(set(self.members) - set(survivors.members))
        release.set_aside(self.made, lost)  # freed once every follower moved off them
        self.made = [group for group in made if group is not None]
        self.members, self.number = survivors.members, survivors.number
        if outer._handed:  # taken in: the synced parameters every host holds, not a host's progress since
            for p, s in zip(outer.params, outer.synced):
                p.copy_(s)
        elif before == 1 and topology.spans_hosts:  # a host came back to a world of one: a new period from here
            for s, p in zip(outer.synced, outer.params):
                s.copy_(p)
        hosts, layout = len(topology.hosts), [len(ranks) for ranks in topology.hosts]
        outer.host, outer.network, outer.hosts = host, network, hosts
        outer.local, outer.local_size, outer.chunks = topology.local, topology.local_size, chunks
        # The residuals were of the chunks cut for the old hosts: they start at zero, as on a resume at another count.
        outer.exchange = exchange(outer.config.compress, network, hosts) if network is not None else Exact(None, hosts)
        if layout != self.layout:
            _say(before, topology, outer.steps)
        self.layout = layout
        return host

    def sync_now(self, outer, k: int) -> None:
        """Fragment k's outer step (delay=0), applied on every rank or on none: a loss before its commit regroups the
        ranks left and sends it again, from the same parameters, over the hosts left (none left: no outer step)."""
        while outer.hosts > 1:
            try:
                outer._send(k)
                sync = outer.in_flight.pop()
                outer._arrive(sync)
                if sync.fragment == 0 and outer.buffers and outer.network is not None:  # before the commit: redone
                    outer._broadcast_buffers()
                failed_elsewhere = not generation.commit_step()
            except RuntimeError as lost:  # PeerFailedError is one
                outer.in_flight.clear()
                if not (generation.is_loss(lost) and generation.recovers_in_process()):
                    raise  # a loop that cannot regroup (no global batch): the run restarts from its checkpoint
                generation.fail_step()
                generation.recover(lost)
                continue
            if failed_elsewhere:
                generation.recover(PeerDiedError(f"another rank could not apply DiLoCo's outer step at step "
                                                 f"{outer.steps}"))
                continue
            outer._merge(sync, buffers=False)
            return


def _say(before: int, topology: Topology, step: int) -> None:
    if not world.is_main():
        return
    hosts = len(topology.hosts)
    if hosts == 1 and before > 1:
        logger.warning("across_hosts=DiLoCo: one host left after step %d: exact DDP on it, no outer step, until "
                       "a host returns", step)
    elif hosts > 1 and before == 1:
        logger.info("across_hosts=DiLoCo: %s after step %d: an outer step across hosts again, a new period from "
                    "this host's parameters", topology.describe(), step)
    elif hosts > 1:
        logger.info("across_hosts=DiLoCo: %s after step %d: the next outer step averages over them",
                    topology.describe(), step)

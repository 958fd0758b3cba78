"""`across_hosts=px.DiLoCo(every=H)`: exact DDP inside each host, an outer optimizer step across hosts every H steps.

Inside a host the model is an ordinary DDP on the host's ranks (shared memory, bitwise replicas). Across hosts
nothing moves for H optimizer steps; then each host's pseudo-gradient, the parameters at the last sync minus
now, is averaged over the hosts, an outer optimizer (Nesterov SGD by default) steps a copy of the synced
parameters with it, and every replica takes the result. Replicas on different hosts differ between outer steps:
that is the method (DiLoCo, Douillard et al. 2023), not drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..bucket.shard_levels import unsupported_with_sharding
from ..diagnose import step_clock
from ..errors import AcrossHostsError, explain
from ..log import logger
from ..world import generation, step_count
from ..world.topology import HostGroups, host_topology


@dataclass(frozen=True)
class DiLoCo:
    """The DiLoCo mode of `DistributedDataParallel(..., across_hosts=px.DiLoCo(every=H))`.

    Every `every` optimizer steps the hosts average their pseudo-gradients and an outer SGD (`outer_lr`,
    `momentum`, `nesterov`) steps the synced parameters. With momentum 0 the outer step is plain SGD (Nesterov
    needs a momentum), so every=1, outer_lr=1, momentum=0 under an inner SGD is the synchronous step.

    >>> DiLoCo(every=100)
    DiLoCo(every=100, outer_lr=0.7, momentum=0.9, nesterov=True)
    >>> model = px.DistributedDataParallel(net, across_hosts=px.DiLoCo(every=100))   # doctest: +SKIP
    """

    every: int
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise AcrossHostsError(explain(
                "DiLoCo every is the number of optimizer steps between two outer steps", seen=f"every={self.every!r}",
                expected="an int >= 1", fix="Pass every=100, say (the outer step's period, H; docs/diloco.md)."))
        for name, low, high in (("outer_lr", 0.0, math.inf), ("momentum", 0.0, 1.0)):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not (value > low if name == "outer_lr" else low <= value < high):
                expected = "a finite number > 0" if name == "outer_lr" else "a number in [0, 1)"
                raise AcrossHostsError(explain(
                    f"DiLoCo {name} is out of range", seen=f"{name}={value!r}", expected=expected,
                    fix=f"Pass {name}={DiLoCo.__dataclass_fields__[name].default} (the default)."))
        if not isinstance(self.nesterov, bool):
            raise AcrossHostsError(explain("DiLoCo nesterov is a flag", seen=f"nesterov={self.nesterov!r}",
                                           expected="True or False", fix="Pass nesterov=True (the default)."))


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
    if shard != "none":
        raise unsupported_with_sharding(f"across_hosts={config}", shard, "Use shard='none' with DiLoCo (the "
                                        "sharded levels inside a host come later).")
    if not on_the_world:
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(...) builds its groups from the whole world", rank=rank,
            seen="a process_group of the user's", expected="process_group=None",
            fix="Leave process_group unset: phalanx makes the host and cross-host groups itself."))
    if generation.live_recovery():
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(...) does not follow live recovery yet", rank=rank,
            seen="live recovery on", expected="a fixed world (restarts resume from the checkpoint)",
            fix="Turn live recovery off for this job, or use across_hosts=None."))
    topology = host_topology(group)
    if not topology.spans_hosts:
        logger.info("across_hosts=%s on one host: exact DDP, no outer step", config)
        return group, OneHost(config)
    if not topology.uniform:
        raise AcrossHostsError(explain(
            "across_hosts=DiLoCo(...) needs the same number of ranks on every host", rank=rank,
            seen=f"ranks per host {[len(r) for r in topology.hosts]}", expected="e.g. 2 hosts x 4 ranks",
            fix="Start as many ranks on every node (--nproc-per-node)."))
    hosts = HostGroups(topology, group).build()
    logger.info("across_hosts=%s: exact DDP inside each of %s, an outer step across hosts every %d optimizer "
                "steps; the replica audit compares the ranks of a host", config, topology.describe(), config.every)
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


class OuterStep:
    """The outer half of DiLoCo for one model: counts its optimizer steps and, every `config.every`, averages
    the pseudo-gradient over the hosts and steps the synced parameters. Put it in the checkpoint's state
    (`state["outer"] = model.outer_step`): its state_dict holds the synced parameters, the outer optimizer and
    the step count; each host's own parameters and inner optimizer state ride in the per-rank part."""

    spans_hosts = True

    def __init__(self, config: DiLoCo, params: list[torch.Tensor], buffers: list[torch.Tensor], host, network,
                 hosts: int, local: int, local_size: int):
        self.config = config
        self.params, self.buffers = params, buffers
        self.host, self.network = host, network
        self.hosts, self.local, self.local_size = hosts, local, local_size
        self.synced = [p.detach().clone() for p in params]  # the outer optimizer's parameters
        momentum = config.momentum
        self.outer = torch.optim.SGD(self.synced, lr=config.outer_lr, momentum=momentum,
                                     nesterov=config.nesterov and momentum > 0)
        self.steps = 0  # optimizer steps of the model, counted on across restores
        self.outer_steps = 0
        self.bytes_across_hosts = 0  # pseudo-gradient bytes this rank all-reduced across hosts (its chunks)
        self.inner_optimizers: list = []  # the optimizers that stepped the model, in the order they first did
        self._pending: dict[int, dict] = {}  # a restored host's inner optimizer state, applied at its first step
        self._loaded = None  # the outer state a restore brought: "hosts", "one host" (OneHost's), None
        step_count.follow(self)

    def before_optimizer_step(self, optimizer) -> None:
        """An optimizer of the model is about to step: known from now on (its state is this host's, in the
        checkpoint's per-rank part), and given the state a restore left for it."""
        if optimizer not in self.inner_optimizers:
            self.inner_optimizers.append(optimizer)
            pending = self._pending.pop(len(self.inner_optimizers) - 1, {})
            for (i, name), value in pending.items():
                optimizer.state[self.params[i]][name] = value.to(self.params[i].device)  # a checkpoint's: CPU

    def after_optimizer_step(self) -> None:
        """One optimizer step of the model ended (each synchronized iteration once): the outer step when due."""
        self.steps += 1
        if self.steps % self.config.every == 0:
            self.step()

    @torch.no_grad()
    def step(self) -> None:
        """The outer step: pseudo-gradients averaged over the hosts, the outer optimizer's step, every replica set
        (and the buffers DDP broadcasts taken from host 0)."""
        sent = self.bytes_across_hosts
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([(self.synced[i] - self.params[i]).reshape(-1) for i in indices])
            average = self._average(flat)
            offset = 0
            for i in indices:
                n = self.synced[i].numel()
                self.synced[i].grad = average[offset:offset + n].view_as(self.synced[i])
                offset += n
        self.outer.step()
        for p, s in zip(self.params, self.synced):
            p.copy_(s)
            s.grad = None
        if self.buffers:  # each host's forwards broadcast its own: every host takes host 0's (BatchNorm's stats)
            source = dist.get_global_rank(self.network, 0)
            for buffer in self.buffers:
                dist.broadcast(buffer, source, group=self.network)
        self.outer_steps += 1
        step_clock.add_outer_step(self.bytes_across_hosts - sent)  # StepLog's outer_steps, bytes_across_hosts

    def _average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of `flat` over the hosts, on every rank. The host's ranks hold the same pseudo-gradient, so
        local rank j all-reduces only chunk j with local rank j of every other host (the groups of the two-level
        exchange: L flows of S/L bytes in parallel, no host-wide reduction first), and the host's ranks then
        all-gather their chunks."""
        chunk = -(-flat.numel() // self.local_size)
        padded = torch.zeros(chunk * self.local_size, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        chunks = list(padded.split(chunk))
        mine = chunks[self.local]
        dist.all_reduce(mine, group=self.network)
        self.bytes_across_hosts += mine.numel() * mine.element_size()
        if self.local_size > 1:
            dist.all_gather(chunks, mine.clone(), group=self.host)
        return padded[:flat.numel()].div_(self.hosts)

    # -- the checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What every host shares: the synced parameters, the outer optimizer's state, the step counts."""
        return {"every": self.config.every, "hosts": self.hosts, "steps": self.steps, "outer_steps": self.outer_steps,
                "synced": [s.detach().clone() for s in self.synced], "outer": self.outer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The outer state every host shares; from a checkpoint of one host (no synced parameters), nothing."""
        if "synced" not in state:  # saved on one host (OneHost): a fresh period from the restored model
            self._loaded = "one host"
            return
        synced = state["synced"]
        shapes = [tuple(s.shape) for s in self.synced]
        if [tuple(s.shape) for s in synced] != shapes:
            raise AcrossHostsError(explain(
                "the DiLoCo state holds other parameters than this model", rank=dist.get_rank(),
                seen=f"shapes {[tuple(s.shape) for s in synced]}", expected=f"shapes {shapes}",
                fix="Restore into the model the state was saved with."))
        for mine, saved in zip(self.synced, synced):
            mine.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        self._loaded = "hosts"

    @torch.no_grad()
    def follow_restore(self, step: int) -> None:
        """A Checkpointer restored the run. Without this object in its state the synced parameters would be the
        ones this model started with, and the next outer step would undo the restored progress: sync here."""
        if self._loaded == "hosts":
            return
        for s, p in zip(self.synced, self.params):
            s.copy_(p)
        if dist.get_rank() == 0 and self._loaded is None:
            logger.warning("the checkpoint restored at step %d holds no DiLoCo state: the outer momentum starts "
                           "afresh and each host goes on from host 0's parameters; put model.outer_step in the "
                           "Checkpointer's state (docs/diloco.md) for an exact resume", step)

    def follow_save(self) -> None:
        """step_count's follower: nothing to do at a save (the Checkpointer calls state_dict)."""

    def rank_random_state(self) -> dict[str, torch.Tensor]:
        """This rank's own part of the checkpoint (the Checkpointer gathers it from every rank): its host's
        parameters and inner optimizer state, which differ from the other hosts' between outer steps."""
        mine = {"layout": torch.tensor([dist.get_world_size(), self.hosts], dtype=torch.int64)}
        mine.update({f"param/{i}": p.detach() for i, p in enumerate(self.params)})
        for k, optimizer in enumerate(self.inner_optimizers):
            for i, p in enumerate(self.params):
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        mine[f"inner/{k}/{i}/{key}"] = value.detach()
        return mine

    @torch.no_grad()
    def load_rank_random_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Back to this host's own parameters and inner optimizer state, when the checkpoint has the same hosts;
        else (another host count) every host goes on from the checkpoint's model, host 0's as saved."""
        layout = saved.get("layout")
        if layout is None or layout.tolist() != [dist.get_world_size(), self.hosts]:
            return
        for i, p in enumerate(self.params):
            p.copy_(saved[f"param/{i}"])
        # The optimizers are known once they step (the same order as when saved): their state is set then.
        self.inner_optimizers, self._pending = [], {}
        for key, value in saved.items():
            if key.startswith("inner/"):
                _, k, i, name = key.split("/", 3)
                self._pending.setdefault(int(k), {})[int(i), name] = value.clone()

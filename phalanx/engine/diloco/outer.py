"""`OuterStep`: the outer half of `across_hosts=px.DiLoCo(...)` for one model, across hosts.

Inside a host the model is an ordinary DDP on the host's ranks (shared memory, bitwise replicas). Across hosts
nothing moves for H optimizer steps; then each host's pseudo-gradient, the parameters at the last sync minus
now, is averaged over the hosts, an outer optimizer (Nesterov SGD by default) steps a copy of the synced
parameters with it, and every replica takes the result. Replicas on different hosts differ between outer steps:
that is the method (DiLoCo, Douillard et al. 2023), not drift.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...diagnose import step_clock
from ...errors import AcrossHostsError, explain
from ...log import logger
from ...world import step_count
from .config import DiLoCo
from .exchange import exchange


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
        self.exchange = exchange(config.compress, network, hosts)
        self.steps = 0  # optimizer steps of the model, counted on across restores
        self.outer_steps = 0
        self.bytes_across_hosts = 0  # pseudo-gradient bytes this rank sent across hosts (its chunks)
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
        indices = list(range(len(self.params)))
        groups, sent = [], 0
        for g, group in enumerate(self._by_dtype(indices)):
            flat = torch.cat([(self.synced[i] - self.params[i]).reshape(-1) for i in group])
            chunk = -(-flat.numel() // self.local_size)
            mine = flat.new_zeros(chunk)
            mine[:max(0, min(chunk, flat.numel() - self.local * chunk))] = flat[self.local * chunk:][:chunk]
            sent += self.exchange.wire_bytes(mine)
            groups.append((group, self.exchange.average(mine, f"0/{g}"), flat.numel()))
        self.bytes_across_hosts += sent
        for group, mine, n in groups:
            average = self._gather_in_host(mine, n)
            offset = 0
            for i in group:
                size = self.synced[i].numel()
                self.synced[i].grad = average[offset:offset + size].view_as(self.synced[i])
                offset += size
        self.outer.step()
        for p, s in zip(self.params, self.synced):
            p.copy_(s)
            s.grad = None
        if self.buffers:  # each host's forwards broadcast its own: every host takes host 0's (BatchNorm's stats)
            source = dist.get_global_rank(self.network, 0)
            for buffer in self.buffers:
                dist.broadcast(buffer, source, group=self.network)
        self.outer_steps += 1
        step_clock.add_outer_step(sent)  # StepLog's outer_steps, bytes_across_hosts

    def _by_dtype(self, indices: list[int]) -> list[list[int]]:
        """`indices` grouped by their parameters' dtype (one flat pseudo-gradient each), in first-seen order."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in indices:
            by_dtype.setdefault(self.params[i].dtype, []).append(i)
        return list(by_dtype.values())

    def _gather_in_host(self, mine: torch.Tensor, n: int) -> torch.Tensor:
        """The whole averaged pseudo-gradient of `n` values from each local rank's averaged chunk: the host's ranks
        hold the same pseudo-gradient, so local rank j averages only chunk j across hosts (with local rank j of
        every other host: L flows of S/L bytes in parallel, no host-wide reduction first), then they all-gather."""
        if self.local_size == 1:
            return mine[:n]
        padded = mine.new_empty(mine.numel() * self.local_size)
        chunks = list(padded.split(mine.numel()))
        dist.all_gather(chunks, mine, group=self.host)
        return padded[:n]

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
        parameters and inner optimizer state, which differ from the other hosts' between outer steps, and the
        compression's residuals of its chunks."""
        mine = {"layout": torch.tensor([dist.get_world_size(), self.hosts], dtype=torch.int64)}
        mine.update({f"param/{i}": p.detach() for i, p in enumerate(self.params)})
        mine.update(self.exchange.state())  # what compression left out of this rank's chunks, sent next time
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
            self.exchange.load_state({})  # other chunks: the error feedback starts afresh
            return
        self.exchange.load_state(saved)
        for i, p in enumerate(self.params):
            p.copy_(saved[f"param/{i}"])
        # The optimizers are known once they step (the same order as when saved): their state is set then.
        self.inner_optimizers, self._pending = [], {}
        for key, value in saved.items():
            if key.startswith("inner/"):
                _, k, i, name = key.split("/", 3)
                self._pending.setdefault(int(k), {})[int(i), name] = value.clone()

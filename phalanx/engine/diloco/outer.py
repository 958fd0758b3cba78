"""`OuterStep`: the outer half of `across_hosts=px.DiLoCo(...)` for one model, across hosts.

Inside a host the model is an ordinary DDP on the host's ranks (shared memory, bitwise replicas). Across hosts
nothing moves for H optimizer steps; then each host's pseudo-gradient, the parameters at the last sync minus
now, is averaged over the hosts, an outer optimizer (Nesterov SGD by default) steps a copy of the synced
parameters with it, and every replica takes the result. Replicas on different hosts differ between outer steps:
that is the method (DiLoCo, Douillard et al. 2023), not drift. With fragments (Streaming DiLoCo) each fragment of
the parameters goes through this on its own staggered schedule, its average merged `delay` steps after it was
sent, the exchange overlapped with those inner steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...diagnose import step_clock
from ...errors import AcrossHostsError, explain
from ...log import logger
from ...world import generation, step_count
from . import fragments
from .config import DiLoCo
from .exchange import Link, exchange


@dataclass
class Sync:
    """One fragment's pseudo-gradient on its way across hosts: sent after optimizer step `due - delay`, merged
    after step `due`. `results` holds this rank's averaged chunks (futures of the cross-host link) until it
    `arrived`, then the whole averaged pseudo-gradient of each dtype group, the same on every rank."""

    fragment: int
    due: int
    groups: list[list[int]]  # the fragment's parameter indices, by dtype
    sizes: list[int]  # each group's number of values
    results: list
    arrived: bool
    snapshot: list[torch.Tensor] | None  # this host's parameters of the fragment as sent (with a delay)
    nbytes: int  # what this rank sent across hosts for it


class OuterStep:
    """The outer half of DiLoCo for one model: counts its optimizer steps and, every `config.every` (per fragment,
    staggered), averages the pseudo-gradient over the hosts and steps the synced parameters. Put it in the
    checkpoint's state (`state["outer"] = model.outer_step`): its state_dict holds the synced parameters, the
    outer optimizer, the step count and the averages on their way; each host's own parameters, inner optimizer
    state and compression residuals ride in the per-rank part."""

    def __init__(self, config: DiLoCo, params: list[torch.Tensor], buffers: list[torch.Tensor], host, network,
                 hosts: int, local: int, local_size: int, chunks: int | None = None):
        self.config = config
        self.params, self.buffers = params, buffers
        self.host, self.network = host, network
        self.hosts, self.local, self.local_size = hosts, local, local_size
        # The pseudo-gradient is cut into `chunks` (the fewest ranks on a host: a loss may leave hosts unequal);
        # local rank j < chunks averages chunk j across hosts, the others of its host only gather.
        self.chunks = local_size if chunks is None else chunks
        self.synced = [p.detach().clone() for p in params]  # the outer optimizer's parameters
        momentum = config.momentum
        self.outer = torch.optim.SGD(self.synced, lr=config.outer_lr, momentum=momentum,
                                     nesterov=config.nesterov and momentum > 0)
        self.exchange = exchange(config.compress, network, hosts)
        self.link = Link(background=config.delay > 0)
        self.fragments = fragments.split([p.numel() for p in params], config.fragments)  # hosts.py checked F
        self.in_flight: list[Sync] = []  # sent, not merged yet: in the order sent, which is the order due
        self.steps = 0  # optimizer steps of the model, counted on across restores
        self.outer_steps = 0  # fragments merged (F per `every` steps)
        self.bytes_across_hosts = 0  # pseudo-gradient bytes this rank sent across hosts (its chunks)
        self.inner_optimizers: list = []  # the optimizers that stepped the model, in the order they first did
        self._pending: dict[int, dict] = {}  # a restored host's inner optimizer state, applied at its first step
        self._loaded = None  # the outer state a restore brought: "hosts", "one host" (OneHost's), None
        self._handed = False  # an outer state was loaded, not yet followed by its restore: a joiner's, at its regroup
        self.live = None  # live recovery (live.py): how the outer step is redone after a loss, the groups remade
        step_count.follow(self)

    @property
    def spans_hosts(self) -> bool:
        """Whether the model's hosts are several now (under live recovery a world of one host has no outer step)."""
        return self.hosts > 1

    def before_optimizer_step(self, optimizer) -> None:
        """An optimizer of the model is about to step: known from now on (its state is this host's, in the
        checkpoint's per-rank part), and given the state a restore left for it."""
        if optimizer not in self.inner_optimizers:
            self.inner_optimizers.append(optimizer)
            pending = self._pending.pop(len(self.inner_optimizers) - 1, {})
            for (i, name), value in pending.items():
                optimizer.state[self.params[i]][name] = value.to(self.params[i].device)  # a checkpoint's: CPU

    def after_optimizer_step(self) -> None:
        """One optimizer step of the model ended (each synchronized iteration once): the fragments due are sent,
        the averages due are merged (with delay 0, those just sent)."""
        self.steps += 1
        if self.hosts == 1:  # under live recovery, the world fell to one host: exact DDP until a host returns
            return
        for k in fragments.due(self.steps, self.config.every, self.config.fragments):
            if self.live is not None:  # delay=0 (hosts.py): sent and merged now, redone on the hosts left on a loss
                self.live.sync_now(self, k)
                continue
            self._send(k)
        while self.in_flight and self.in_flight[0].due <= self.steps:
            self._merge(self.in_flight.pop(0))

    @torch.no_grad()
    def _send(self, k: int) -> None:
        """Fragment k's pseudo-gradient, this rank's chunk of each dtype group, onto the cross-host link."""
        groups = self._by_dtype(self.fragments[k])
        results, sizes, sent = [], [], 0
        for g, group in enumerate(groups):
            flat = torch.cat([(self.synced[i] - self.params[i]).reshape(-1) for i in group])
            chunk = -(-flat.numel() // self.chunks)
            mine = flat.new_zeros(chunk)
            if self.local >= self.chunks:  # a host left with more ranks than another: its chunk comes from a peer
                results.append(self.link.submit(lambda zeros: zeros, mine))
                sizes.append(flat.numel())
                continue
            mine[:max(0, min(chunk, flat.numel() - self.local * chunk))] = flat[self.local * chunk:][:chunk]
            sent += self.exchange.wire_bytes(mine)
            results.append(self.link.submit(self.exchange.average, mine, f"{k}/{g}"))
            sizes.append(flat.numel())
        snapshot = [self.params[i].detach().clone() for i in self.fragments[k]] if self.config.delay else None
        self.bytes_across_hosts += sent
        self.in_flight.append(Sync(k, self.steps + self.config.delay, groups, sizes, results, False, snapshot, sent))

    def _arrive(self, sync: Sync) -> None:
        """Wait for `sync`'s chunks and put the whole averages together in the host (collective on the host)."""
        if not sync.arrived:
            sync.results = [self._gather_in_host(r.result(), n) for r, n in zip(sync.results, sync.sizes)]
            sync.arrived = True

    @torch.no_grad()
    def _merge(self, sync: Sync, buffers: bool = True) -> None:
        """The outer step of one fragment: its average into the outer optimizer (the other fragments have no
        gradient: it skips them), and the host's replica set to the result. With a delay the host's own progress
        since the send is kept on top: the inner steps that overlapped the exchange are not thrown away."""
        self._arrive(sync)
        for group, average in zip(sync.groups, sync.results):
            offset = 0
            for i in group:
                size = self.synced[i].numel()
                self.synced[i].grad = average[offset:offset + size].view_as(self.synced[i])
                offset += size
        self.outer.step()
        snapshot = sync.snapshot or [None] * len(self.fragments[sync.fragment])
        for i, sent in zip(self.fragments[sync.fragment], snapshot):
            p, s = self.params[i], self.synced[i]
            p.copy_(s if sent is None else s + (p - sent))
            s.grad = None
        if buffers and sync.fragment == 0 and self.buffers and self.network is not None:  # host 0's, once a period
            self.link.submit(self._broadcast_buffers).result()
        self.outer_steps += 1
        step_clock.add_outer_step(sync.nbytes)  # StepLog's outer_steps, bytes_across_hosts

    def regroup(self, survivors):
        """Live recovery: generation `survivors` is the world now; the host group the model trains on in it."""
        return self.live.regroup(self, survivors)

    def _broadcast_buffers(self) -> None:
        source = dist.get_global_rank(self.network, 0)
        for buffer in self.buffers:
            dist.broadcast(buffer, source, group=self.network)

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
        gathered = dist.all_gather(chunks, mine, group=self.host, async_op=True)
        generation.wait_for(gathered, "DiLoCo's gather in the host")
        return padded[:n]  # the first `chunks` chunks hold the whole average

    # -- the checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What every host shares: the synced parameters, the outer optimizer's state, the step counts, and the
        fragments' averages on their way (arrived at the save: follow_save), each with the step it merges at."""
        if not all(sync.arrived for sync in self.in_flight):
            raise AcrossHostsError(explain(
                "model.outer_step.state_dict() was called with fragments' averages still on their way",
                rank=dist.get_rank(), seen=f"{sum(not s.arrived for s in self.in_flight)} in flight at step "
                f"{self.steps}", expected="every average arrived, as Checkpointer.save() makes them on every rank",
                fix="Save through px.Checkpointer (state['outer'] = model.outer_step)."))
        in_flight = [{"fragment": sync.fragment, "due": sync.due, "bytes": sync.nbytes,
                      "average": [a.detach().clone() for a in sync.results]} for sync in self.in_flight]
        # On one host (live recovery) the model is exact DDP: its parameters are where the next period starts from.
        synced = self.synced if self.hosts > 1 else self.params
        return {"every": self.config.every, "hosts": self.hosts, "steps": self.steps, "outer_steps": self.outer_steps,
                "synced": [s.detach().clone() for s in synced], "outer": self.outer.state_dict(),
                "fragments": self.config.fragments, "in_flight": in_flight}

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
        in_flight = state.get("in_flight", [])  # none in a checkpoint from before streaming
        if in_flight and state["fragments"] != self.config.fragments:
            raise AcrossHostsError(explain(
                "the DiLoCo state has fragments' averages on their way, cut in another number of fragments",
                rank=dist.get_rank(), seen=f"fragments={state['fragments']} in the checkpoint",
                expected=f"fragments={self.config.fragments}, as this model's DiLoCo(...) says",
                fix=f"Resume with fragments={state['fragments']}; change it at a later save (or from one saved "
                    "with nothing in flight)."))
        self.outer.load_state_dict(state["outer"])
        self.steps, self.outer_steps = int(state["steps"]), int(state["outer_steps"])
        device = self.synced[0].device
        self.in_flight = [
            Sync(entry["fragment"], int(entry["due"]), self._by_dtype(self.fragments[entry["fragment"]]),
                 [a.numel() for a in entry["average"]], [a.to(device) for a in entry["average"]], True, None,
                 int(entry["bytes"])) for entry in in_flight]
        self._loaded, self._handed = "hosts", True

    @torch.no_grad()
    def follow_restore(self, step: int) -> None:
        """A Checkpointer restored the run. Without this object in its state the synced parameters would be the
        ones this model started with, and the next outer step would undo the restored progress: sync here."""
        self._handed = False
        if self._loaded == "hosts":
            for sync in self.in_flight:  # saved at another host count: the progress since the send counts from here
                if self.config.delay and sync.snapshot is None:
                    sync.snapshot = [self.params[i].detach().clone() for i in self.fragments[sync.fragment]]
            return
        self.in_flight = []
        for s, p in zip(self.synced, self.params):
            s.copy_(p)
        if dist.get_rank() == 0 and self._loaded is None:
            logger.warning("the checkpoint restored at step %d holds no DiLoCo state: the outer momentum starts "
                           "afresh and each host goes on from host 0's parameters; put model.outer_step in the "
                           "Checkpointer's state (docs/diloco.md) for an exact resume", step)

    def follow_save(self) -> None:
        """A checkpoint is taken now, on every rank: the averages on their way arrive first (they are what they will
        be; only the time they are merged at is the schedule's), so that the state holds them whole."""
        for sync in self.in_flight:
            self._arrive(sync)

    def rank_random_state(self) -> dict[str, torch.Tensor]:
        """This rank's own part of the checkpoint (the Checkpointer gathers it from every rank): its host's
        parameters and inner optimizer state, which differ from the other hosts' between outer steps, the
        compression's residuals of its chunks, and its parameters as sent of the fragments on their way."""
        mine = {"layout": torch.tensor([dist.get_world_size(), self.hosts], dtype=torch.int64)}
        mine.update({f"param/{i}": p.detach() for i, p in enumerate(self.params)})
        mine.update(self.exchange.state())  # what compression left out of this rank's chunks, sent next time
        for n, sync in enumerate(self.in_flight):
            mine.update({f"snapshot/{n}/{j}": t for j, t in enumerate(sync.snapshot or [])})
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
        for n, sync in enumerate(self.in_flight):  # load_state_dict ran first: the averages are back
            if f"snapshot/{n}/0" in saved:
                sync.snapshot = [saved[f"snapshot/{n}/{j}"].to(self.params[i].device).clone()
                                 for j, i in enumerate(self.fragments[sync.fragment])]
        # The optimizers are known once they step (the same order as when saved): their state is set then.
        self.inner_optimizers, self._pending = [], {}
        for key, value in saved.items():
            if key.startswith("inner/"):
                _, k, i, name = key.split("/", 3)
                self._pending.setdefault(int(k), {})[int(i), name] = value.clone()

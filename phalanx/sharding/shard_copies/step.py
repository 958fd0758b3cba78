"""`ShardCopies`: one ShardedOptimizer's copies, kept step by step (see the package docstring).

Before each step, a snapshot of this rank's chunk and of its wards' parameter chunks; after it, this rank's new
chunk state sent to its keeper beside the parameters' all-gather, its wards' received into spare buffers, and
the step's commit. The snapshot and the copies reuse the buffers of the step before. After a loss or a join the
whole state is put together (reassembly.py) and cut again for the new world, whose wards' copies are cut from it
here too (`rebind`), as they are from a whole state loaded with load_state_dict (`take_whole`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...bucket.shard_plan import cut_bucket
from ...errors import PeerDiedError, explain
from ...world import generation
from . import reassembly
from .keepers import keepers
from .packing import Layout, Packed, agree_on_layout, check_keys, pack


class ShardCopies:
    """The keeper's side and the owner's side of the copies, for one ShardedOptimizer (see the package docstring).

    `owner` is the ShardedOptimizer: its `exchange` (shards and buckets of the current world), its wrapped
    optimizer's `state` keyed by piece tensors, and `hosts()`, the model's ranks by host."""

    def __init__(self, owner, hosts):
        self.owner, self.hosts = owner, hosts
        self.layout: Layout | None = None  # None until the ranks agreed on one (no state anywhere before)
        self.copies: dict[int, Packed] = {}  # ward (group rank) -> its chunk state after the last committed step
        self.snapshot = None  # during a step: this rank's pieces and its wards' parameter chunks before it
        self.rolling_back = False  # during a regroup after a loss inside the step: back to the snapshot
        self.committing = False  # the step reached its commit (a failure then needs no fail_step of its own)
        self.joining = False  # a joiner, until taken in: it holds none of the state it is to receive
        self._bind()

    def _forget_buffers(self) -> None:
        """Drop the buffers kept for reuse (the chunks change with the world)."""
        self._spare_snapshot = None  # the last step's snapshot, written over by the next one
        self._spare_copies: dict[int, Packed] = {}  # copies replaced, received into by the next refresh
        self._outgoing: Packed | None = None  # this rank's packed chunk state, sent to its keeper

    def _bind(self) -> None:
        """The current world's ranks, keeper and wards (after each regroup)."""
        exchange = self.owner.exchange
        self._forget_buffers()
        self.rank, self.world_size = exchange.rank, exchange.world_size
        topology = self.hosts()
        hosts = topology if topology else [list(range(self.world_size))]
        kept = keepers(hosts)
        self.keeper = kept.get(self.rank, self.rank)
        self.wards = sorted(r for r, keeper in kept.items() if keeper == self.rank and r != self.rank)
        self.keepers = kept
        self.ward_shards = {w: [cut_bucket(b, w, self.world_size) for b in exchange.buckets] for w in self.wards}

    def _own_state(self, piece):
        return self.owner.state.get(piece.tensor)

    # -- a step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def before_step(self) -> None:
        """Snapshot this rank's pieces (parameters and state) and its wards' parameter chunks (into the buffers of
        the step before, once there are some)."""
        before, self._spare_snapshot = self._spare_snapshot, None
        own_before, wards_before = before if before is not None else ({}, {})
        own = {}
        for piece_list in self.owner._pieces.values():
            for piece in piece_list:
                key = id(piece.tensor)
                old_param, old_state = own_before.get(key, (None, None))
                own[key] = (_copied(piece.tensor, old_param), _copied_state(self.owner.state.get(piece.tensor),
                                                                            old_state))
        wards = {}
        for w, shards in self.ward_shards.items():
            old = wards_before.get(w)
            wards[w] = [[_copied(piece.tensor, old[b][j] if old else None) for j, piece in enumerate(shard.pieces)]
                        for b, shard in enumerate(shards)]
        self.snapshot = (own, wards)

    @torch.no_grad()
    def after_step(self) -> None:
        """Complete the all-gather, refresh the copies, commit (see the package docstring). Raises a loss
        (generation.is_loss) or PeerDiedError when the step cannot count; ShardedOptimizer.step rolls back."""
        exchange = self.owner.exchange
        exchange.gather_parameters()
        arriving, works = self._start_refresh()  # beside the all-gather
        exchange.wait_gathered()
        self._finish_refresh(works)
        self.committing = True
        if not generation.commit_step():
            raise PeerDiedError(explain("another rank could not finish the sharded optimizer step",
                                        rank=dist.get_rank(), seen="the step's commit failed",
                                        fix="The ranks left roll the step back and redo it (live recovery)."))
        for w, packed in arriving.items():  # the copies replaced become the next refresh's buffers
            self._spare_copies[w], self.copies[w] = self.copies.get(w), packed
        self._spare_snapshot, self.snapshot = self.snapshot, None

    def _start_refresh(self) -> tuple[dict[int, Packed], list]:
        """Start sending this rank's new chunk state to its keeper and receiving each ward's into spare buffers:
        ({ward: its buffers}, the transfers to finish)."""
        if self.keeper == self.rank:
            return {}, []
        if self.layout is None:
            if not self._anyone_has_state():  # collective: a rank may hold no state while others do
                return {}, []
            self.layout = agree_on_layout(self.owner, self.owner.exchange.group)
        check_keys(self.layout, self.owner)
        exchange = self.owner.exchange
        group = exchange.group
        mine = self._outgoing = pack(self.layout, exchange.shards, exchange.buckets, self._own_state, self._outgoing)
        arriving = {}
        for w, shards in self.ward_shards.items():
            spare = self._spare_copies.pop(w, None)
            arriving[w] = spare if spare is not None else Packed(
                [torch.empty_like(t) for t in mine.state],
                [torch.empty(len(s.pieces), self.layout.piece_width, dtype=torch.float64, device=t.device)
                 for s, t in zip(shards, mine.state)])
        works = [dist.isend(t, group_dst=self.keeper, group=group) for t in mine.tensors()]
        for w, packed in arriving.items():
            works += [dist.irecv(t, group_src=w, group=group) for t in packed.tensors()]
        return arriving, works

    @staticmethod
    def _finish_refresh(works: list) -> None:
        for work in works:  # aside: a timed wait that expired would abort a receive
            generation.wait_for(work, "the shard copies' refresh", aside=True)

    def _anyone_has_state(self) -> bool:
        flag = torch.tensor([1.0 if any(self.owner.state.values()) else 0.0], device=self.owner._control_device())
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.owner.exchange.group, async_op=True)
        generation.wait_for(work, "the shard copies' first look at the optimizer state")
        return bool(flag.item())

    # -- after a loss, a join or a load: the whole state, and the copies cut from it --------------------

    def whole_state(self, survivors, old_members: tuple[int, ...]) -> tuple[dict, list | None]:
        """The whole state put together from the ranks left (reassembly.whole_state)."""
        return reassembly.whole_state(self, survivors, old_members)

    def rebind(self, entries: dict) -> None:
        """On the new world (the owner re-targeted at its exchange): the wards' copies cut from the whole state
        `entries` that every rank holds now, without a transfer."""
        self.snapshot, self.joining = None, False
        self._bind()
        self.copies = {}
        if self.layout is None or not entries:
            return
        by_index = {i: self.owner._numbers.get(id(p)) for b in self.owner.exchange.buckets
                    for i, p in zip(b.indices, b.params)}
        for w, shards in self.ward_shards.items():
            def state_of(piece, by_index=by_index):
                entry = entries.get(by_index.get(piece.index))
                if entry is None:
                    return None
                return {key: (value.reshape(-1)[piece.start:piece.stop] if key in self.layout.per_element
                              else value) for key, value in entry.items()}
            self.copies[w] = pack(self.layout, shards, self.owner.exchange.buckets, state_of)

    def handed_layout(self) -> list | None:
        """The layout, as a joiner is handed it (see expect())."""
        layout = self.layout
        return None if layout is None else [list(layout.per_element), dict(layout.scalars)]

    def expect(self, layout: list | None) -> None:
        """A joiner, with the layout handed_layout() gave on the ranks that train: the regroup that takes it in
        gives it its chunk of the state (whole_state, where it adds zeros to the sums of theirs)."""
        self.joining = True
        self.layout = None if layout is None else Layout(*layout)

    def take_whole(self, state_dict: dict) -> None:
        """After load_state_dict(state_dict) (torch's whole format, on every rank): the wards' copies from it."""
        entries = state_dict.get("state", {})
        if self.keeper == self.rank or not entries:
            return
        if self.layout is None:
            first = next(iter(entries.values()))
            shape = next((v.shape for v in first.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
                         torch.Size([]))
            self.layout = Layout(*Layout.describe(first, shape))
        self.rebind(entries)


def _copied(tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """`tensor`'s values, in `into` when it fits (a buffer of the step before), else in a new tensor."""
    if into is not None and into.shape == tensor.shape and into.dtype == tensor.dtype:
        return into.copy_(tensor)
    return tensor.clone()


def _copied_state(state, into):
    if not state:
        return None
    into = into or {}
    return {key: _copied(value, into.get(key)) if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}

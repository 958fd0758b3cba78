"""Copies of every rank's optimizer shard on another rank, so that live recovery outlives a lost shard.

With shard="optimizer" or "gradients" a rank holds the optimizer state of its own chunk of every bucket
(bucket/shard_plan.py) and no other rank does: lost, it would take that state along. Under live recovery
(world/generation.py) each rank's chunk state is also held by its *keeper*, the rank with its local index
on the next host (the next rank, on one host), refreshed after every step. After a loss the ranks left put
the whole state together, each giving its own chunk and its lost wards' copies, and cut it again for the
new world; nothing is read from disk. A rank that joins (checkpoint/handover.py) is handed the layout and the
world its state was cut for instead of the state: it gives zeros to the same sums, and takes its new chunk from them.

A step, around the wrapped optimizer's (ShardedOptimizer.step):
- before: a snapshot of this rank's chunk (parameters and state) and of its wards' parameter chunks;
- after: the parameters' all-gather, this rank's new chunk state sent to its keeper while its wards'
  arrive in spare buffers, then a commit through the store: the step counts once every rank got that far.
  A loss before that rolls every rank left back to the snapshots, and the step is redone on the new world
  (the loader hands it out again; the step the loop already saw says `undone`).
Two ranks lost together, one the other's keeper, leave a chunk with no copy: the run then falls back to its
newest checkpoint (MembershipError, which `phalanx run` answers with a restart). So does any loss with the copies
turned off (`PHALANX_SHARD_COPIES=0`), which saves their cost (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..bucket.shard_plan import BucketShard, cut_bucket
from ..errors import MembershipError, PeerDiedError, ShardingError, explain
from ..log import logger
from ..world import generation

COPIES_ENV = "PHALANX_SHARD_COPIES"


def copies_on() -> bool:
    """Whether sharded models keep copies of their optimizer shards under live recovery (`PHALANX_SHARD_COPIES=0`
    turns them off: a loss then restarts the run from its newest checkpoint, and a healthy step costs nothing)."""
    return os.environ.get(COPIES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def keepers(hosts: list[list[int]]) -> dict[int, int]:
    """Each rank's keeper, from the ranks of each host: the rank with its local index (modulo that host's ranks)
    on the next host; on one host, the next rank. A rank alone in its world keeps its own (no copy).

    >>> keepers([[0, 1], [2, 3], [4, 5]])
    {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    >>> keepers([[0, 1, 2]])
    {0: 1, 1: 2, 2: 0}
    >>> keepers([[0], [1, 2]])
    {0: 1, 1: 0, 2: 0}
    """
    if len(hosts) == 1:
        ranks = hosts[0]
        return {rank: ranks[(i + 1) % len(ranks)] for i, rank in enumerate(ranks)}
    kept = {}
    for h, ranks in enumerate(hosts):
        following = hosts[(h + 1) % len(hosts)]
        for i, rank in enumerate(ranks):
            kept[rank] = following[i % len(following)]
    return kept


class Layout:
    """What a chunk's state holds, the same on every rank: the keys kept per element (packed after each other,
    a chunk each, in the bucket's dtype) and the scalar ones (a float64 each per piece, after a presence flag),
    with what each scalar was (a tensor's dtype and device, or a Python number's type) to give it back as such."""

    def __init__(self, per_element: list[str], scalars: dict[str, tuple]):
        self.per_element, self.scalars = sorted(per_element), scalars
        self.scalar_keys = sorted(scalars)

    @staticmethod
    def describe(state: dict, shape: torch.Size) -> tuple[list[str], dict[str, tuple]]:
        per_element, scalars = [], {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == shape and value.dim() > 0:
                per_element.append(key)
            elif isinstance(value, torch.Tensor):
                scalars[key] = ("tensor", str(value.dtype).split(".")[-1], str(value.device))
            elif isinstance(value, (bool, int, float)):
                scalars[key] = ("number", type(value).__name__, "")
        return per_element, scalars

    def scalar_value(self, key: str, number: float, here: torch.device):
        """The scalar `key` as it was, from its number; a tensor that was on an accelerator goes on `here`, this
        rank's (the layout names the device of the rank that described it: another GPU on another rank)."""
        kind, name, device = self.scalars[key]
        if kind == "tensor":
            where = torch.device(device)
            return torch.tensor(number, dtype=getattr(torch, name), device=where if where.type == "cpu" else here)
        return {"bool": bool, "int": int, "float": float}[name](number)

    @property
    def piece_width(self) -> int:
        return 1 + len(self.scalar_keys)


class Packed:
    """One rank's chunk state, bucket by bucket: `state[b]` (keys x chunk, the bucket's dtype) and `scalars[b]`
    (pieces x (presence + scalar keys), float64)."""

    def __init__(self, state: list[torch.Tensor], scalars: list[torch.Tensor]):
        self.state, self.scalars = state, scalars

    def tensors(self) -> list[torch.Tensor]:
        return self.state + self.scalars


class ShardCopies:
    """The keeper's side and the owner's side of the copies, for one ShardedOptimizer (see the module docstring).

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

    # -- packing ------------------------------------------------------------------------------------

    def _agree_on_layout(self, group, size: int) -> None:
        """Collective over `group` (of `size` ranks), once state exists: the keys every rank's state has (a rank may
        hold none)."""
        mine = ([], {})
        for piece_list in self.owner._pieces.values():
            for piece in piece_list:
                found = self.owner.state.get(piece.tensor)
                if found:
                    mine = Layout.describe(found, piece.tensor.shape)
                    break
            if mine[0] or mine[1]:
                break
        everyone = [None] * size
        dist.all_gather_object(everyone, mine, group=group)
        per_element = sorted({key for keys, _ in everyone for key in keys})
        scalars = {}
        for _, found in everyone:
            scalars.update(found)
        self.layout = Layout(per_element, scalars)

    def _pack(self, shards: list[BucketShard], state_of, into: Packed | None = None) -> Packed:
        """A rank's chunk state laid out as `self.layout` says; `state_of(piece)` gives a piece's state (or None).
        `into`: buffers of an earlier pack of the same chunks, written over (what a piece without state leaves in
        them is flagged absent)."""
        packed = [self._pack_bucket(shard, bucket.storage, state_of,
                                    None if into is None else (into.state[b], into.scalars[b]))
                  for b, (shard, bucket) in enumerate(zip(shards, self.owner.exchange.buckets))]
        return Packed([state for state, _ in packed], [flags for _, flags in packed])

    def _pack_bucket(self, shard: BucketShard, storage: torch.Tensor, state_of, into: tuple | None = None) -> tuple:
        layout = self.layout
        if into is None:
            packed = torch.zeros(len(layout.per_element), shard.chunk, dtype=storage.dtype, device=storage.device)
            flags = torch.zeros(len(shard.pieces), layout.piece_width, dtype=torch.float64, device=storage.device)
        else:
            packed, flags = into
        for row, piece in enumerate(shard.pieces):
            found = state_of(piece)
            flags[row, 0] = 1.0 if found else 0.0
            if not found:
                continue
            for k, key in enumerate(layout.per_element):
                value = found.get(key)
                if value is not None:
                    packed[k, piece.offset:piece.offset + piece.numel].copy_(value.reshape(-1))
            for k, key in enumerate(layout.scalar_keys):
                value = found.get(key)
                if value is not None:
                    flags[row, 1 + k] = float(value)
        return packed, flags

    def _own_state(self, piece):
        return self.owner.state.get(piece.tensor)

    def _check_keys(self) -> None:
        """The state this rank holds fits the agreed layout (an optimizer whose state keys change mid-run does not)."""
        known = set(self.layout.per_element) | set(self.layout.scalars)
        for piece_list in self.owner._pieces.values():
            for piece in piece_list:
                found = self.owner.state.get(piece.tensor) or {}
                extra = set(found) - known
                if extra:
                    raise ShardingError(explain(
                        "the optimizer's state grew keys after its first step: the shard copies cannot hold them",
                        rank=dist.get_rank(), seen=sorted(extra), expected=sorted(known),
                        fix="Use an optimizer whose state keys are set at its first step, or turn live recovery "
                            "off (--min-world-size 0)."))
                for key in self.layout.per_element:
                    value = found.get(key)
                    if value is not None and value.dtype != piece.tensor.dtype:
                        raise ShardingError(explain(
                            "the shard copies keep optimizer state in the parameters' dtype", rank=dist.get_rank(),
                            seen=f"state {key!r} in {value.dtype} for a {piece.tensor.dtype} parameter",
                            expected=str(piece.tensor.dtype),
                            fix="Keep the optimizer's state in the parameters' dtype, or turn live recovery off "
                                "(--min-world-size 0)."))

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
        """Complete the all-gather, refresh the copies, commit (see the module docstring). Raises a loss
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
            self._agree_on_layout(self.owner.exchange.group, self.world_size)
        self._check_keys()
        exchange = self.owner.exchange
        group = exchange.group
        mine = self._outgoing = self._pack(exchange.shards, self._own_state, self._outgoing)
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

    # -- after a loss: the whole state, cut again ----------------------------------------------------

    @torch.no_grad()
    def whole_state(self, survivors, old_members: tuple[int, ...]) -> tuple[dict, list | None]:
        """Collective over the new generation's group: ({parameter index: its whole state} in torch's format, keyed
        as the owner's `_numbers`; and on a roll-back each bucket's whole parameters before the step, else None).
        `old_members` held the state, cut for their world. Raises MembershipError when a lost rank's chunk has no
        copy left."""
        exchange = self.owner.exchange  # the old world's, still (a joiner's: its world of one)
        old_size = len(old_members)
        lost = {i for i, member in enumerate(old_members) if member not in survivors.members}
        rolling_back = self.rolling_back and self.snapshot is not None
        orphans = sorted(old_members[r] for r in lost if self.keepers.get(r, r) in lost | {r})
        if orphans and (self.layout is not None or rolling_back):  # no state yet, and no step to undo: no loss
            logger.error("rank(s) %s lost with the rank(s) that kept their optimizer shards: no copy is left; the "
                         "run falls back to its newest checkpoint", orphans)
            raise MembershipError(explain(
                "a lost rank's optimizer shard has no copy left", rank=dist.get_rank(),
                seen=f"rank(s) {orphans} lost together with their keepers", expected="at most one of each pair",
                fix="The run restarts from its newest checkpoint (phalanx run does it, under --max-restarts)."))
        if self.layout is None and not lost:  # a world of one keeps no copies, so never agreed on one: now
            self._agree_on_layout(survivors.group, survivors.world_size)
        group, layout = survivors.group, self.layout
        own, ward_params = self.snapshot if rolling_back else ({}, {})
        mine = [] if self.joining else [self.rank] + [w for w in self.wards if w in lost]
        states, scalars, params = [], [], []
        for b, bucket in enumerate(exchange.buckets):
            cuts = {r: cut_bucket(bucket, r, old_size) for r in range(old_size)}
            chunk, storage = cuts[0].chunk, bucket.storage
            rows = [0]
            for r in range(old_size):
                rows.append(rows[-1] + len(cuts[r].pieces))
            keys = len(layout.per_element) if layout else 0
            whole = torch.zeros(keys, chunk * old_size, dtype=storage.dtype, device=storage.device)
            flags = torch.zeros(rows[-1], layout.piece_width if layout else 1, dtype=torch.float64,
                                device=storage.device)
            before = torch.zeros(chunk * old_size, dtype=storage.dtype, device=storage.device) \
                if rolling_back else None
            for r in mine:
                at = slice(r * chunk, (r + 1) * chunk)
                if r == self.rank:
                    if layout:
                        state_of = (lambda piece: own[id(piece.tensor)][1]) if rolling_back else self._own_state
                        whole[:, at], flags[rows[r]:rows[r + 1]] = self._pack_bucket(exchange.shards[b], storage,
                                                                                     state_of)
                    if rolling_back:
                        for piece in exchange.shards[b].pieces:
                            before[at][piece.offset:piece.offset + piece.numel] = own[id(piece.tensor)][0].reshape(-1)
                else:
                    if layout and r in self.copies:
                        whole[:, at], flags[rows[r]:rows[r + 1]] = self.copies[r].state[b], self.copies[r].scalars[b]
                    if rolling_back:
                        for piece, value in zip(cuts[r].pieces, ward_params[r][b]):
                            before[at][piece.offset:piece.offset + piece.numel] = value.reshape(-1)
            for tensor in (whole, flags) + ((before,) if rolling_back else ()):
                generation.wait_for(dist.all_reduce(tensor, group=group, async_op=True), "the optimizer's re-shard")
            states.append(whole)
            scalars.append((flags, rows, cuts))
            params.append(before)
        return self._entries(states, scalars), (params if rolling_back else None)

    def _entries(self, states, scalars) -> dict:
        """{parameter number: state} from the buckets' whole state (the scalars of a parameter's first piece)."""
        layout, exchange, entries = self.layout, self.owner.exchange, {}
        if layout is None:
            return entries
        for b, bucket in enumerate(exchange.buckets):
            flags, rows, cuts = scalars[b]
            chunk = cuts[0].chunk
            for i, p, offset in zip(bucket.indices, bucket.params, bucket.offsets):
                number = self.owner._numbers.get(id(p))
                if number is None:
                    continue
                r = offset // chunk
                row = next(rows[r] + j for j, piece in enumerate(cuts[r].pieces) if piece.index == i)
                if flags[row, 0] == 0:
                    continue  # never stepped: no state, as in the unsharded optimizer
                entry = {key: states[b][k, offset:offset + p.numel()].view(p.shape).clone()
                         for k, key in enumerate(layout.per_element)}
                for k, key in enumerate(layout.scalar_keys):
                    entry[key] = layout.scalar_value(key, float(flags[row, 1 + k]), states[b].device)
                entries[number] = entry
        return entries

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
            self.copies[w] = self._pack(shards, state_of)

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

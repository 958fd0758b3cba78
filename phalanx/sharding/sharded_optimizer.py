"""`ShardedOptimizer`: the user's torch optimizer, updating only the chunks this rank owns.

`DistributedDataParallel(..., shard="optimizer" | "gradients").shard_optimizer(opt)` re-targets
`opt` at the pieces of the parameters in this rank's chunks (shard_plan.py): its state exists for
those elements only, its step updates them in place, and the exchange then all-gathers the
parameters. Param groups, hyperparameters, LR schedulers and GradScaler keep working on the
returned object, which is a `torch.optim.Optimizer`. `state_dict()` is collective and returns
torch's own format for the whole model, as the unsharded optimizer would, gathered bucket by bucket;
`load_state_dict()` takes that format from any world size or shard mode and keeps its own pieces.
"""

from __future__ import annotations

import torch

from ..bucket.shard_plan import Piece
from ..errors import ShardingError, explain
from ..exchange.sharded import ShardedExchange, all_gather
from ..world import generation
from .optimizer_view import OptimizerView
from .shard_copies import ShardCopies

# Optimizers that read whole tensors (norms, factored moments, line searches): their update of a piece
# would differ from their update of the parameter.
WHOLE_TENSOR_OPTIMIZERS = ("LBFGS", "SparseAdam", "Adafactor", "Muon")
HANDED_OVER = "phalanx_handed_over"  # the key of a joiner's state dict that says what it is to receive (see below)


class ShardedOptimizer(OptimizerView):
    """Wraps `optimizer` (built over the DDP model's parameters) so each rank steps its own chunks only.

    step() ends with the parameters' all-gather complete. With `overlap_forward`, it returns once the
    all-gathers are under way: the next forward waits for each layer's parameters as it reaches them
    (on a process group; in shared memory the all-gather is a copy, done within the step anyway).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, exchange: ShardedExchange, params: list, names: list[str],
                 overlap_forward: bool = False, live=None):
        kind = type(optimizer).__name__
        rank = exchange.rank
        self._check_wrappable(optimizer, rank)
        if kind in WHOLE_TENSOR_OPTIMIZERS:
            raise ShardingError(explain(
                f"{kind} cannot be sharded: its update reads whole tensors, and each rank holds pieces",
                rank=rank, seen=kind, expected="an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...)",
                fix="Use an elementwise optimizer, or shard='none'."))
        # State it already holds (Adagrad's accumulators from the start, or a loaded checkpoint) is cut
        # into pieces like any state dict.
        existing = optimizer.state_dict() if any(optimizer.state.values()) else None
        index_of = {id(p): i for i, p in enumerate(params)}
        self._groups = []  # the model's parameters of each group, as the user passed them
        for number, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in index_of:
                    raise ShardingError(explain(
                        f"param group {number} of the {kind} holds a tensor the sharded model does not train",
                        rank=rank, seen=f"a tensor of shape {tuple(p.shape)}",
                        expected="only trainable parameters of the DistributedDataParallel model",
                        fix="Build the optimizer over model.parameters() (frozen ones are left out of the model's "
                            "buckets), or optimize extra tensors with an optimizer of their own."))
            self._groups.append(list(group["params"]))
        # each parameter's index in torch's state dict format: its position over the param groups
        self._numbers = {id(p): n for n, p in enumerate(p for params in self._groups for p in params)}
        self._index_of = index_of
        self._target(optimizer, exchange)
        self._wrap(optimizer, rank)
        self._only_through_view()
        self._names = names
        self.overlap_forward = overlap_forward
        # The replica audit's (engine/replicas/): checks of the state before each step reads it (before the
        # copies' snapshot), and what a step that counted ends with.
        self.step_checks: list = []
        self.after_step_hooks: list = []
        # Live recovery (world/generation.py): copies of this rank's shard on another rank, and a re-shard
        # onto each new world. `live`: (the model's ranks by host, the model's current exchange), or None.
        self._copies = None
        if live is not None:
            hosts, self._exchange_of = live
            self._members = generation.current().members
            self._copies = ShardCopies(self, hosts)
            generation.on_regroup(self._onto_generation)
        if existing is not None:
            self.load_state_dict(existing)

    def _target(self, optimizer: torch.optim.Optimizer, exchange: ShardedExchange) -> None:
        """Point `optimizer`'s param groups at this rank's pieces of `exchange`'s chunks."""
        pieces: dict[int, list[Piece]] = {}
        for shard in exchange.shards:
            for piece in shard.pieces:
                pieces.setdefault(piece.index, []).append(piece)
        for group, params in zip(optimizer.param_groups, self._groups):
            group["params"] = [piece.tensor for p in params for piece in pieces.get(self._index_of[id(p)], [])]
        self.exchange = exchange
        self._pieces = pieces

    # -- one step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """The step of this rank's chunks, then the parameters' all-gather. Under live recovery a loss before
        every rank finished the step (and refreshed its shard's copy) rolls it back on the ranks left, which
        regroup and redo it: the loader hands it out again (shard_copies/)."""
        copies = self._copies_now()
        if copies is None:
            loss = super().step(closure, grad_scaler)
        else:
            copies.committing = False
            try:
                loss = super().step(closure, grad_scaler)
            except Exception as lost:
                if not generation.is_loss(lost):
                    raise
                if not copies.committing:
                    generation.fail_step()  # the others' commit of this step fails too
                copies.rolling_back = True
                try:
                    generation.recover(lost, redoing=True, undone=True)
                finally:
                    copies.rolling_back = False
                return None
        for hook in self.after_step_hooks:
            hook()
        return loss

    def _copies_now(self):
        """The shard copies, when a loss is to be recovered in-process (a global-batch loop under live recovery)."""
        if self._copies is not None and generation.live_recovery() and generation.recovers_in_process():
            return self._copies
        return None

    def _before_step(self) -> None:
        self.exchange.wait_gathered()
        for check in self.step_checks:
            check()
        if self._copies_now() is not None:
            self._copies.before_step()

    def _after_step(self) -> None:
        """All-gather the updated chunks (collective); complete it unless the next forward is to wait for it."""
        if self._copies_now() is not None:
            self._copies.after_step()  # the all-gather completed, the copies refreshed, the step committed
            return
        self.exchange.gather_parameters()
        if not self.overlap_forward:
            self.exchange.wait_gathered()

    @torch.no_grad()
    def _onto_generation(self, survivors) -> None:
        """After the model's regroup: the whole state put together by the ranks left (rolled back to before the
        step when it could not count), and this rank's pieces of it on the model's new exchange."""
        entries, before = self._copies.whole_state(survivors, self._members)
        if before is not None:  # the parameters as they were before the step, on every rank left
            for bucket, whole in zip(self.exchange.buckets, before):
                for p, offset in zip(bucket.params, bucket.offsets):
                    p.copy_(whole[offset:offset + p.numel()].view(p.shape))
        self._target(self.optimizer, self._exchange_of())
        self._load_whole({"state": entries, "param_groups": self._saved_groups()})
        self._members = survivors.members
        self._copies.rebind(entries)

    def _saved_groups(self) -> list[dict]:
        """The param groups in torch's state dict format: hyperparameters as they are now, parameter indices."""
        return [{**{k: v for k, v in group.items() if k != "params"},
                 "params": [self._numbers[id(p)] for p in params]}
                for group, params in zip(self.optimizer.param_groups, self._groups)]

    def wait_parameters(self) -> None:
        """With overlap_forward=True: return once every parameter holds every rank's last update (the
        forward waits for each layer's on its own; reading parameters elsewhere needs this first)."""
        self.exchange.wait_gathered()

    def _overflowed(self, scaler) -> bool:
        return self._overflowed_anywhere(scaler, self.exchange.group, self._control_device(),
                                         self.exchange.guard.wait_work)

    def _control_device(self) -> torch.device:
        return next((b.storage.device for b in self.exchange.buckets), torch.device("cpu"))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the chunks' gradients and the model's `.grad`, as the wrapped optimizer would."""
        self.optimizer.zero_grad(set_to_none)
        for group in self._groups:
            for p in group:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    # -- checkpoints ------------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self, to: int | None = None) -> dict | None:
        """Collective: torch's optimizer state dict of the whole model, as the unsharded optimizer would
        give it, assembled bucket by bucket. With `to` (a rank of the model's group) only that rank gets
        it and the others return None."""
        self.exchange.wait_gathered()
        group = self.exchange.group
        me = self.exchange.rank
        wanted = to is None or to == me
        inner = self.optimizer.state_dict()  # hyperparameters and the pieces' own state
        param_groups = []
        for saved, params in zip(inner["param_groups"], self._groups):
            indices = [self._numbers[id(p)] for p in params]
            param_groups.append({**saved, "params": indices})
        # What each parameter's state holds: keys, and the values that are not per element (e.g. "step").
        mine = {}
        for pieces in self._pieces.values():
            for piece in pieces:
                found = self.state.get(piece.tensor)
                if found:
                    mine[piece.index] = {key: self._describe(key, value, piece) for key, value in found.items()}
        everyone = generation.all_gather_objects(mine, group, "a sharded state's layout")
        layout = {}
        for rank_layout in everyone:
            for index, entries in rank_layout.items():
                layout.setdefault(index, entries)
        state = {}
        for shard, bucket in zip(self.exchange.shards, self.exchange.buckets):
            keys = sorted({(key, entry[1]) for i in bucket.indices if i in layout
                           for key, entry in layout[i].items() if entry[0] == "shard"})
            gathered = {}
            for key, dtype_name in keys:  # one bucket of one state tensor in flight at a time
                dtype = getattr(torch, dtype_name.split(".")[-1])
                own = torch.zeros(shard.chunk, dtype=dtype, device=bucket.storage.device)
                for piece in shard.pieces:
                    value = self.state.get(piece.tensor, {}).get(key)
                    if value is not None and _per_element(value, piece):
                        own[piece.offset:piece.offset + piece.numel].copy_(value.reshape(-1))
                full = torch.empty(shard.padded, dtype=dtype, device=bucket.storage.device)
                generation.wait_for(all_gather(full, own, group=group, async_op=True), "a sharded state's gather")
                if wanted:
                    gathered[key] = full
            if not wanted:
                continue
            for i, p, offset in zip(bucket.indices, bucket.params, bucket.offsets):
                if i not in layout or id(p) not in self._numbers:
                    continue
                entry = {}
                for key, (kind, value) in layout[i].items():
                    entry[key] = (gathered[key][offset:offset + p.numel()].view(p.shape).clone()
                                  if kind == "shard" else value)
                state[self._numbers[id(p)]] = entry
        if not wanted:
            return None
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def _describe(self, key: str, value, piece: Piece) -> tuple:
        """("shard", dtype) for state held per element, ("value", value) for the rest (e.g. "step")."""
        if _per_element(value, piece):
            return "shard", str(value.dtype)
        if isinstance(value, torch.Tensor) and value.dim() > 0 and not piece.whole:
            raise ShardingError(explain(
                f"{type(self.optimizer).__name__} keeps state {key!r} that is not per element", rank=self.exchange.rank,
                seen=f"shape {tuple(value.shape)} for a piece of {self._names[piece.index]} of {piece.numel} elements",
                expected=f"shape {tuple(piece.tensor.shape)} or a scalar",
                fix="Use an elementwise optimizer with sharding, or shard='none'."))
        return "value", value

    def handover_state_dict(self) -> dict:
        """What a rank joining the run is handed (checkpoint/handover.py) in place of state_dict(): the param
        groups, and the world the state is cut for, not the state. The regroup that takes the joiner in cuts the
        state again for the new world (ShardCopies.whole_state), so no rank gathers all of it twice."""
        if self._copies is None:  # not following the generations: the whole state (collective over the members)
            return self.state_dict()
        return {"state": {}, "param_groups": self._saved_groups(),
                HANDED_OVER: {"members": list(self._members), "layout": self._copies.handed_layout()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's optimizer state dict of the whole model (saved sharded or not, at any world size):
        this rank keeps the state of its own pieces (and under live recovery its wards' copies)."""
        handed = state_dict.get(HANDED_OVER)
        if handed is not None and self._copies is None:
            raise ShardingError(explain(
                "this rank joins a run whose sharded optimizer state is cut again when it is taken in, and its "
                "ShardedOptimizer does not follow the run's generations", rank=self.exchange.rank,
                seen="a ShardedOptimizer without live recovery", expected="one built by model.shard_optimizer() on a "
                "model of the whole world, with live recovery on",
                fix="Build the model and optimizer as the ranks that train do (the same script and settings)."))
        self._load_whole(state_dict)
        if handed is not None:
            self._members = tuple(handed["members"])
            self._copies.expect(handed["layout"])
        elif self._copies is not None:
            self._copies.take_whole(state_dict)

    def _load_whole(self, state_dict: dict) -> None:
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self._groups) or any(
                len(saved["params"]) != len(params) for saved, params in zip(saved_groups, self._groups)):
            raise ValueError(explain(
                "loaded state dict has a different number of parameter groups or parameters",
                rank=self.exchange.rank, seen=[len(g["params"]) for g in saved_groups],
                expected=[len(params) for params in self._groups],
                fix="Build the optimizer with the same param groups as the one that was saved."))
        saved_state = state_dict["state"]
        pieces_state, inner_groups, number = {}, [], 0
        for saved, params in zip(saved_groups, self._groups):
            inner_indices = []
            for saved_index, p in zip(saved["params"], params):
                entry = saved_state.get(saved_index)
                for piece in self._pieces.get(self._index_of[id(p)], []):
                    if entry is not None:
                        pieces_state[number] = {key: _slice_for(value, piece, p) for key, value in entry.items()}
                    inner_indices.append(number)
                    number += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": inner_indices})
        self.optimizer.load_state_dict({"state": pieces_state, "param_groups": inner_groups})
        self._rebind()


def _per_element(value, piece: Piece) -> bool:
    """Whether an optimizer state value holds one entry per element of the piece (sharded with it)."""
    return isinstance(value, torch.Tensor) and value.shape == piece.tensor.shape


def _slice_for(value, piece: Piece, param: torch.Tensor):
    """This piece's part of a saved state value of `param`."""
    if piece.whole or not (isinstance(value, torch.Tensor) and value.shape == param.shape):
        return value
    return value.reshape(-1)[piece.start:piece.stop].clone()

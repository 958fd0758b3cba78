"""The sharded optimizer state against the copies its keepers hold (shard="optimizer" / "gradients").

At the sharded levels each rank alone holds the optimizer state of its chunk: no other rank computes it, so
no majority can vouch for it. Under live recovery each rank sends its chunk state to its keeper after every
step (sharding/shard_copies/): that copy is the replicated view. Two checks use it:
- every step, before the optimizer reads it, this rank's state must still be what it packed and sent at the
  end of the last step (nothing may change it in between): a difference is a change no step made (a flipped
  bit, a stray write). It is put back from the packed copy at once (audit="heal": the step then runs on the
  state every copy agrees on) and reported at the next audit;
- at each audit, the keeper's copy of every ward must fingerprint as the ward's packed state (checked
  across the ranks, in the audit's one all-gather); a copy that differs is sent again.
Without live recovery's copies (or with PHALANX_SHARD_COPIES=0) the sharded state has no replicated view and
is not checked; the parameters, whole on every rank, are.
What the first check misses: a change of the packed copy itself between its transfer and the next step
would be taken for a change of the state, and the state put back from it.
"""

from __future__ import annotations

import weakref

import torch

from .fingerprint import combine, fingerprint, salt


class ShardStateCheck:
    """The checks of one ShardedOptimizer's state (see the module docstring); `names`: the model's parameter
    names by index; `heal`: put a changed state back at once (else only report it)."""

    def __init__(self, optimizer, names: list[str], heal: bool):
        self._optimizer = weakref.ref(optimizer)  # it holds this check's callbacks: no cycle keeps either alive
        self.names, self.heal = names, heal
        self.findings: list[dict] = []  # changes found since the last audit, reported there

    @property
    def optimizer(self):
        return self._optimizer()

    @property
    def copies(self):
        optimizer = self.optimizer
        copies = optimizer._copies if optimizer is not None else None
        return copies if copies is not None and copies.layout is not None else None

    # -- every step, before the state is read --------------------------------------------------------

    @torch.no_grad()
    def before_step(self, step: int, rank: int) -> None:
        copies = self.copies
        packed = copies._outgoing if copies is not None else None
        if packed is None:
            return
        layout, state = copies.layout, self.optimizer.state
        shards = self.optimizer.exchange.shards
        diffs, where = [], []
        for b, shard in enumerate(shards):
            for piece in shard.pieces:
                found = state.get(piece.tensor)
                if not found:
                    continue
                for k, key in enumerate(layout.per_element):
                    value = found.get(key)
                    if value is not None:
                        reference = packed.state[b][k, piece.offset:piece.offset + piece.numel]
                        diffs.append((value.reshape(-1) != reference).any())
                        where.append((b, piece, key))
        if not diffs or not bool(torch.stack(diffs).any()):  # one read on the host per step
            return
        for (b, piece, key), differs in zip(where, diffs):
            if not bool(differs):
                continue
            value = state[piece.tensor][key]
            reference = packed.state[b][layout.per_element.index(key), piece.offset:piece.offset + piece.numel]
            element = int((value.reshape(-1) != reference).nonzero()[0, 0]) + piece.start
            self.findings.append({"rank": rank, "step": step, "key": key, "parameter": self.names[piece.index],
                                  "element": element, "healed": self.heal})
            if self.heal:
                value.copy_(reference.view_as(value))

    # -- at an audit -------------------------------------------------------------------------------

    def fingerprints(self, device: torch.device) -> list[torch.Tensor]:
        """[whether this rank has a packed state, its fingerprint, Σ over its wards of the fingerprints of the
        copies it keeps, each weighted by ward_weight(ward)] as three int64 tensors."""
        copies = self.copies
        packed = copies._outgoing if copies is not None else None
        if packed is None:
            zero = torch.zeros((), dtype=torch.int64, device=device)
            return [zero, zero, zero]
        wards = [(w, copies.copies[w]) for w in copies.wards if w in copies.copies]
        return [torch.ones((), dtype=torch.int64, device=device), _packed_fingerprint(packed, device),
                combine([_packed_fingerprint(p, device) for _, p in wards], [ward_weight(w) for w, _ in wards],
                        device)]

    def keepers(self) -> dict[int, int] | None:
        copies = self.copies
        return dict(copies.keepers) if copies is not None else None

    @torch.no_grad()
    def send_copies_again(self) -> None:
        """Collective: every rank sends its packed state to its keeper again, which keeps it as its copy."""
        copies = self.copies
        if copies is None or copies.keeper == copies.rank:
            return
        arriving, works = copies._start_refresh()
        copies._finish_refresh(works)
        copies.copies.update(arriving)


def ward_weight(ward: int) -> int:
    return salt(f"ward {ward}")


def _packed_fingerprint(packed, device: torch.device) -> torch.Tensor:
    parts = [fingerprint(t) for t in packed.tensors()]
    return combine(parts, [salt(f"packed {i}") for i in range(len(parts))], device)

"""The replica audit: proof, every N optimizer steps, that every rank holds the same model and optimizer state.

Data parallelism rests on one invariant: after every step every rank holds the same parameters and optimizer
state. Every `every` steps (and after a regroup, a join, a heal or a restore) each rank fingerprints every
parameter and each parameter's optimizer state (fingerprint.py), and one all-gather of those numbers
compares them. A rank that differs is named, with the first entry that differs, the step it was found at and
the last step at which all agreed. With 3 or more ranks the majority's state is broadcast to the ranks that
differ and the run goes on (`audit="heal"`); with 2, with no majority, or with `audit="raise"`, every rank
raises ReplicaMismatchError. Either way the checkpoints saved since the last agreement are set aside (the
Checkpointer listens: `listen()`), so a restore goes back to a state every rank agreed on.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

from ...diagnose import progress, recorder
from ...errors import ReplicaMismatchError, explain
from ...log import logger
from ...world import generation, step_count
from . import optimizer_hooks
from .differences import first_difference
from .fingerprint import compare, fingerprint, salt, state_fingerprint, states_fingerprints, value_fingerprint, wrap
from .nonfinite import MODES as NONFINITE_MODES
from .nonfinite import NonFiniteCheck
from .shard_state import ShardStateCheck, ward_weight
from .signature import broadcast_coalesced

DEFAULT_EVERY = 200  # measured: under 0.5 % of a step on the bench models (docs/benchmarks.md)
EVERY_ENV = "PHALANX_AUDIT_EVERY"  # the default of audit_every, for a whole job (a test suite: 1)
MODES = ("heal", "raise")
HEADER = 3  # a row's first entries: the step, the sharded-state changes found, whether it holds a packed state
_listeners: weakref.WeakSet = weakref.WeakSet()


def listen(listener) -> None:
    """`listener.audit_agreed()` after every audit that agreed, `listener.audit_diverged(step)` after one that did
    not (every rank calls both, together): the Checkpointer's, to trust checkpoints and set suspect ones aside."""
    _listeners.add(listener)


def check_settings(every, mode, on_nonfinite, rank: int) -> int:
    """The audit's arguments of DistributedDataParallel, or ValueError saying which and what it takes; returns
    audit_every (None: PHALANX_AUDIT_EVERY, else DEFAULT_EVERY)."""
    if every is None:
        raw = os.environ.get(EVERY_ENV, "").strip()
        every = int(raw) if raw.isdigit() else DEFAULT_EVERY
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(explain("audit_every must be a number of optimizer steps", rank=rank,
                                       seen=f"audit_every={every!r}", expected="an int >= 0 (0: no audit)",
                                       fix=f"Pass audit_every={DEFAULT_EVERY} (the default), or 0 to turn it off."))
    for name, value, allowed in (("audit", mode, MODES), ("on_nonfinite", on_nonfinite, NONFINITE_MODES)):
        if value not in allowed:
            raise ValueError(explain(f"DistributedDataParallel {name} is one of {list(allowed)}", rank=rank,
                                           seen=f"{name}={value!r}", expected=" or ".join(map(repr, allowed)),
                                           fix=f"Pass {name}={allowed[0]!r} (the default)."))
    return every


class ReplicaAudit:
    """One DDP model's audit and its non-finite check (see the module docstring)."""

    def __init__(self, ddp, every: int, mode: str, on_nonfinite: str):
        self._ddp = weakref.ref(ddp)
        self.every, self.mode = every, mode
        self.steps = step_count.restored() or 0  # synchronized iterations done: the step numbers the loop sees
        self.agreed_at = self.steps  # the constructor's broadcast gave every rank rank 0's model
        self._audited = self.steps
        self._counted = self.steps  # the iteration whose optimizer step was counted last
        self._micro = 0  # forwards with gradients since the last synchronized one
        self._due: list[str] = []
        # The optimizers that stepped the model, in the order they first did: the same on every rank.
        self._optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._warned = False
        self.shard_check: ShardStateCheck | None = None
        # What else follows the model's optimizer steps (across_hosts=DiLoCo's OuterStep): each listener's
        # before_optimizer_step(optimizer) at every step() call, after_optimizer_step() once per iteration.
        self.listeners: list = []
        # The flags live with the gradients (a GPU's: a copy to a CPU group's device would wait for the backward);
        # on a GPU, under "raise", they are read once there, at a later optimizer step: no wait for the device.
        device = ddp._named_params[0][1].device
        late = on_nonfinite == "raise" and not ddp._guard.reads_back(device)
        self.check = NonFiniteCheck(on_nonfinite, device, late) if on_nonfinite != "off" else None
        self._names = [name for name, _ in ddp.module.named_parameters() if name not in ddp._ignored]
        self._params = [p for name, p in ddp.module.named_parameters() if name not in ddp._ignored]
        optimizer_hooks.watch(self, self._params)
        step_count.follow(self)

    # -- what the model and its optimizers tell it ------------------------------------------------

    def forward(self, will_sync: bool) -> None:
        """DDP's forward, with gradients on: the synchronized one ends a step's micro-batches."""
        if not will_sync:
            self._micro += 1
            return
        if self.check is not None:
            self.check.forward()  # a verdict of a backward no optimizer step followed is dropped
            self.check.micro_batch = self._micro
        self._micro = 0
        self.steps += 1
        if self.check is not None:
            self.check.step = self.steps

    def sharded(self, optimizer, names: list[str]) -> None:
        """shard_optimizer() made `optimizer` (a ShardedOptimizer): its steps end the model's steps."""
        self.shard_check = ShardStateCheck(optimizer, names, heal=self.mode == "heal")
        optimizer_hooks.claim(optimizer.optimizer, self)
        optimizer.step_checks.append(self._shard_step_check)
        optimizer.after_step_hooks.append(self.after_optimizer_step)

    def _shard_step_check(self) -> None:
        ddp = self._ddp()
        if ddp is not None:
            self.shard_check.before_step(self.steps, dist.get_rank(ddp.process_group))

    def before_optimizer_step(self, optimizer) -> None:
        """An optimizer of this model is about to step: the non-finite verdict of its gradients first."""
        for listener in self.listeners:
            listener.before_optimizer_step(optimizer)
        if self.check is not None and self.check.pending:
            ddp = self._ddp()
            if ddp is not None:
                self.check.before_step(ddp)

    def after_optimizer_step(self, optimizer=None) -> None:
        """An optimizer stepped this model (each synchronized iteration counts once): audit when due."""
        if optimizer is not None and self.shard_check is None and optimizer not in self._optimizers:
            self._optimizers[optimizer] = len(self._optimizers)
        if self._counted == self.steps:
            return
        self._counted = self.steps
        for listener in self.listeners:
            listener.after_optimizer_step()
        if self.every and self.steps // self.every > self._audited // self.every:
            self._due.append("every")
        ddp = self._ddp()
        if self._due and ddp is not None and not ddp._join_config.enable:  # in join(): at its end (after_join)
            self.run(self._due[0])

    def follow_restore(self, step: int) -> None:
        """A checkpoint was restored at `step`: every rank loaded the same state; audit it at the next step."""
        self.steps = self._counted = self._audited = self.agreed_at = step
        self._due.append("restore")

    def follow_save(self) -> None:
        """A checkpoint is saved now (nothing to do: the Checkpointer keeps track of its saves)."""

    def due(self, reason: str) -> None:
        """Audit at the end of the next optimizer step (after a regroup: `reason`)."""
        self._due.append(reason)

    def after_join(self, source: int, steps: int) -> None:
        """Collective, at the end of join(): the model was adopted from global rank `source`, the last rank to
        finish; so is its optimizer state (the others stepped fewer times), then the replicas are audited.
        `steps`: the most iterations any rank made (a rank out of data made fewer)."""
        ddp = self._ddp()
        self.steps = self._counted = steps
        if ddp is None or ddp.process_group.size() == 1:
            return
        for optimizer in self._ordered_optimizers():
            _adopt_state(optimizer, source, ddp.process_group)
        self.run("join")

    # -- the audit ----------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, reason: str) -> bool:
        """Collective: compare the replicas; True when they agreed (after a heal, if one was needed)."""
        self._due = []
        self._audited = self.steps
        ddp = self._ddp()
        if ddp is None or ddp._reducer is None:
            return True
        group = ddp.process_group
        if group.size() == 1:
            self.agreed_at = self.steps
            return True
        if ddp.shard != "none":
            ddp._reducer.exchange.wait_gathered()
        try:
            rows = self._gather(self._row(ddp), group)
        except RuntimeError as lost:
            if not generation.is_loss(lost):
                raise
            generation.recover(lost)  # the ranks left regroup; they audit after their next step
            return False
        self.steps = max(row[0] for row in rows)
        verdict = compare([row[HEADER:-2] for row in rows])  # the last two: each rank's own (shard_state.py)
        changed = [rank for rank, row in enumerate(rows) if row[1]]
        copies_off = self._copies_differing(rows)
        if verdict.agree and not changed and not copies_off:
            self.agreed_at = self.steps
            for listener in list(_listeners):
                listener.audit_agreed()
            return True
        return self._disagreed(ddp, group, reason, verdict, changed, copies_off)

    def _row(self, ddp) -> torch.Tensor:
        device = ddp._control_device
        shards = self.shard_check.fingerprints(device) if self.shard_check is not None else [torch.zeros(
            (), dtype=torch.int64, device=device)] * 3
        changes = len(self.shard_check.findings) if self.shard_check is not None else 0
        parts = [torch.tensor([self.steps, changes], dtype=torch.int64, device=device), shards[0].reshape(1)]
        parts.append(torch.stack([fingerprint(p).to(device) for p in self._params]))
        optimizers = self._ordered_optimizers()
        states = [_merged(optimizer.state.get(p) for optimizer in optimizers) for p in self._params]
        parts += [states_fingerprints(states, device), torch.tensor([self._groups_fingerprint(optimizers)],
                                                                     device=device), torch.stack(shards[1:])]
        return torch.cat(parts)

    def _gather(self, row: torch.Tensor, group) -> list[list[int]]:
        everyone = [torch.empty_like(row) for _ in range(group.size())]
        entry = recorder.begin(recorder.AUDIT, -1, row.numel(), row.dtype)
        generation.wait_for(dist.all_gather(everyone, row, group=group, async_op=True), "the replica audit")
        recorder.done(entry)
        return [r.tolist() for r in everyone]

    def _ordered_optimizers(self) -> list:
        """The optimizers that stepped this model, in the same order on every rank (the order they first did)."""
        return sorted(self._optimizers, key=self._optimizers.get)

    def _groups_fingerprint(self, optimizers: list) -> int:
        """The optimizers' hyperparameters (every param group's plain options: numbers, strings, tuples of them)."""
        total = 0
        for number, optimizer in enumerate(optimizers):
            for index, group in enumerate(optimizer.param_groups):
                options = tuple(sorted((str(k), v) for k, v in group.items() if k != "params" and _plain(v)))
                total = wrap(total + salt(f"{number}.{index}") * value_fingerprint(options))
        return total

    def _copies_differing(self, rows: list[list[int]]) -> list[int]:
        """The keepers whose copies of their wards' states differ from what the wards packed."""
        keepers = self.shard_check.keepers() if self.shard_check is not None else None
        if not keepers:
            return []
        packed, kept = len(rows[0]) - 2, len(rows[0]) - 1
        expected: dict[int, int] = {}
        for ward, keeper in keepers.items():
            if keeper != ward and rows[ward][2]:
                expected[keeper] = wrap(expected.get(keeper, 0) + ward_weight(ward) * rows[ward][packed])
        return sorted(k for k, value in expected.items() if rows[k][2] and rows[k][kept] != value)

    def _entry(self, column: int, group) -> tuple[str, torch.Tensor | None]:
        """Error path: what column `column` of the rows holds, and its tensor here (collective for state)."""
        count = len(self._params)
        if column < count:
            return f"parameter {self._names[column]!r}", self._params[column]
        if column >= 2 * count:
            return "the optimizers' hyperparameters (param_groups)", None
        param, name = self._params[column - count], self._names[column - count]
        state = _merged(optimizer.state.get(param) for optimizer in self._ordered_optimizers())
        mine = {str(k): int(state_fingerprint({k: v}, torch.device("cpu"))) for k, v in state.items()}
        everyone = generation.all_gather_objects(mine, group, "the replica audit's optimizer state prints")
        keys = sorted({k for found in everyone for k in found})
        key = next((k for k in keys if len({found.get(k) for found in everyone}) > 1), None)
        value = next((v for k, v in state.items() if str(k) == key), None)
        return (f"optimizer state {key!r} of {name!r}" if key else f"the optimizer state of {name!r}",
                value if isinstance(value, torch.Tensor) and key else None)

    def _describe(self, verdict, group) -> str:
        """Error path: the ranks that differ, the first entry that differs, and the values each side holds."""
        label, tensor = self._entry(verdict.columns[0], group)
        if verdict.majority is not None:
            differing = verdict.differing
            verb = "differs" if len(differing) == 1 else "differ"
            text = f"{_ranks(differing)} {verb} from {_ranks(verdict.majority)} at {label}"
        else:
            text = f"{' and '.join(map(_ranks, verdict.sides))} hold different values of {label}"
        found = first_difference(tensor, group) if tensor is not None else None
        if found is not None:
            position, values = found
            held = "; ".join(f"{_ranks(side)}: {values[side[0]]!r}" for side in verdict.sides)
            text += f" element {position} ({held})"
        more = len(verdict.columns) - 1
        return text + (f", and {more} entries more" if more else "")

    def _disagreed(self, ddp, group, reason, verdict, changed, copies_off) -> bool:
        me, size = dist.get_rank(group), group.size()
        parts, differing = [], sorted(set(verdict.differing) | set(changed) | set(copies_off))
        if not verdict.agree:
            parts.append(self._describe(verdict, group))
        if changed:  # which sharded state changed where: gathered only now, on the error path
            everyone = generation.all_gather_objects(self.shard_check.findings, group,
                                                     "the replica audit's sharded state findings")
            for f in (f for found in everyone for f in found):
                parts.append(f"rank {f['rank']}'s optimizer state {f['key']!r} of {f['parameter']!r} (element "
                             f"{f['element']}) changed between steps {f['step'] - 1} and {f['step']}, which no step "
                             "does" + (": put back from the copy its keeper holds" if f["healed"] else ""))
        if copies_off:
            parts.append(f"the copies {_ranks(copies_off)} keep of their wards' optimizer state differ from the wards'")
        what = "; ".join(parts)
        when = f"found at the audit after step {self.steps} ({reason}), all agreed at step {self.agreed_at}"
        for listener in list(_listeners):
            listener.audit_diverged(self.agreed_at)
        healable = self.mode == "heal" and (verdict.agree or (verdict.majority is not None and size >= 3))
        source = verdict.majority[0] if healable and not verdict.agree else None
        progress.event("replica_mismatch", step=self.steps, agreed_at=self.agreed_at, ranks=differing,
                       entry=what, healed=healable, source=source)
        if not healable:
            why = ("audit='raise'" if self.mode == "raise" else
                   f"no majority to heal from among {size} ranks: {' against '.join(map(str, verdict.sides))}")
            raise ReplicaMismatchError(explain(
                f"the replicas differ: {what}; {when}", rank=dist.get_rank(), seen=f"{_ranks(differing)} apart",
                expected="every rank the same parameters and optimizer state",
                fix=f"The run stops ({why}). Restart it: Checkpointer.restore() picks the newest checkpoint saved "
                    "before the last agreement (those saved since are set aside as *.suspect). If it happens again, "
                    "look for rank-dependent randomness in the optimizer or a comm hook, or at those ranks' memory."),
                ranks=differing, sides=verdict.sides, entry=what, step=self.steps, agreed_at=self.agreed_at)
        if source is not None:
            self._heal_from(ddp, dist.get_global_rank(group, source), group)
        if copies_off:
            self.shard_check.send_copies_again()
        if self.shard_check is not None:
            self.shard_check.findings = []
        if me == 0:
            logger.warning("replica audit: %s; %s: %s, the run goes on%s", what, when,
                           f"healed from rank {source}" if source is not None else "healed",
                           "" if self._warned else " (checkpoints saved since the agreement are set aside)")
        self._warned = True
        if not self.run("heal"):
            raise ReplicaMismatchError(explain(
                "the replicas still differ after a heal", rank=dist.get_rank(), seen=what,
                expected="every rank the same", fix="Restart from the last checkpoint; report it as a bug."),
                ranks=differing, sides=verdict.sides, entry=what, step=self.steps, agreed_at=self.agreed_at)
        return True

    def _heal_from(self, ddp, source: int, group) -> None:
        """Collective: global rank `source`'s parameters, and its optimizers' state (unsharded), on every rank."""
        broadcast_coalesced(self._params, source, group)
        if self.shard_check is None:
            for optimizer in self._ordered_optimizers():
                _adopt_state(optimizer, source, group)


def _plain(value) -> bool:
    """A value whose repr is the same on every rank that holds it (no object's address in it)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _merged(states) -> dict | None:
    """One parameter's state over the optimizers that hold it (one, usually)."""
    found = [state for state in states if state]
    if len(found) <= 1:
        return found[0] if found else None
    merged = {}
    for number, state in enumerate(found):
        merged.update({f"{number}.{key}" if key in merged else key: value for key, value in state.items()})
    return merged


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _adopt_state(optimizer, source: int, group) -> None:
    """Collective: `optimizer`'s state as global rank `source` holds it, on every rank of `group`."""
    held = [optimizer.state_dict() if dist.get_rank() == source else None]
    dist.broadcast_object_list(held, src=source, group=group)
    if dist.get_rank() != source:
        optimizer.load_state_dict(held[0])

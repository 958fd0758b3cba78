"""A NaN or Inf gradient, named on the rank that made it, before the exchange spreads it to every rank.

When a bucket leaves this rank (its exchange copied this rank's gradients in, the collective not started), the
exchange hands its flat gradients here: one sum per bucket (float32, float64 for float64 buckets), kept on the
device as a finite/not flag, nothing read back; the shared-memory exchange's copy says it on the way instead
(`seen`). Every rank must learn whether any rank saw one. Where the exchange can carry it to every rank (on the CPU,
tagged), it does, and nothing else crosses (`folds`, `folded`): where each bucket's summed step tag is read on every
rank (the all-reduce, two-level and posted shared-memory exchanges), a rank that saw one writes NaN for its tag, so
the sum is NaN everywhere; the split shared-memory exchange, which checks a rank's own chunk as it sums it, after
the tag left, has each rank publish its verdict in its stamp before the barrier every rank then passes. Otherwise,
at the end of backward, one all-reduce of two numbers (how many ranks saw one, and the step tag) tells every rank.
The verdict is read when an optimizer is about to step the model, so no rank applies a step another refuses: then
every rank raises NonFiniteGradientError naming the rank, step, micro-batch and first parameter, or, with
on_nonfinite="skip", drops the step's gradients (set to None: every torch optimizer then leaves the parameters and
their state alone) and counts a skipped step. An optimizer that never steps (a GradScaler that saw the overflow
itself skips the step) leaves the verdict unread: it is dropped. On the CPU the read is free. On a GPU, under
"raise", the verdict is copied to the host on the way and read at the next optimizer step (`late`), so the host
never waits for the device and the step that made it was applied; "skip" must read it before the step, and waits for
the backward.

What it misses: a sum that overflows float32 (gradients above ~1e34 in total) counts as non-finite; a comm
hook that makes a finite gradient non-finite (fp16 compression past 65504) is after the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...diagnose import progress, recorder, step_clock
from ...errors import NonFiniteGradientError, explain
from ...log import logger
from ...world import generation

MODES = ("raise", "skip", "off")


@dataclass
class _Verdict:
    """One backward's flags: their all-reduce in flight, what they are about, and (on a GPU) their copy to the host."""

    step: int
    micro_batch: int
    flags: torch.Tensor
    tag: int
    work: object
    entry: int
    guard: object
    group: object
    buckets: dict  # bucket index -> (bucket, finite: a 0-dim bool tensor or a bool)
    host: torch.Tensor | None = None  # on a GPU, read a step late: the flags copied to pinned memory ...
    copied: object = None  # ... and the event after that copy
    applied: bool = False  # an optimizer step of the model began after this backward
    seen: int | None = None  # once settled: how many ranks saw a NaN or Inf


class NonFiniteCheck:
    """The check of one DDP model's gradients (see the module docstring); its reducer and exchange call it.
    `late`: read each verdict at the next optimizer step instead (a GPU under on_nonfinite="raise": no wait)."""

    def __init__(self, mode: str, control_device: torch.device, late: bool = False):
        self.mode, self.late = mode, late
        self.step = 0  # the number of the step the coming gradients are for (the audit's count)
        self.micro_batch = 0  # of the synchronized backward: the forwards with gradients since the last one
        self._device = control_device
        self._flags = torch.zeros(2, dtype=torch.int64, device=control_device)  # [ranks that saw one, step tags]
        self._finite: dict[int, tuple] = {}  # bucket index -> (bucket, finite), this backward
        self._folded: dict[int, bool] = {}  # bucket index -> whether its summed tag said a rank saw one
        self._verdicts: list[_Verdict] = []  # not read yet, oldest first
        self._order = None  # the bucket indices of the last late exchange, and them on the device
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM

    @property
    def pending(self) -> bool:
        return bool(self._verdicts)

    # -- while the buckets leave (the exchange calls it) -----------------------------------------

    def local(self, bucket, flat: torch.Tensor | None) -> None:
        """`flat`: this rank's gradients of `bucket`, as they go out (None: read them from the parameters)."""
        if flat is None:
            grads = [_values(p.grad) for p in bucket.params if p.grad is not None]
            if not grads:
                return
            total = torch.stack([g.sum(dtype=_accumulator(g.dtype)) for g in grads]).sum()
        else:
            total = flat.sum(dtype=_accumulator(flat.dtype))
        self._finite[bucket.index] = (bucket, torch.isfinite(total))

    def seen(self, bucket, finite: bool) -> None:
        """The exchange checked (a part of) this rank's gradients of `bucket` itself, on the way (its copy-in)."""
        known = self._finite.get(bucket.index)
        self._finite[bucket.index] = (bucket, finite and (known is None or bool(known[1])))

    def folds(self, guard, device: torch.device) -> bool:
        """Whether the exchange carries every rank's verdict on a bucket (its summed tag, or the shared-memory
        stamps): read on the host at once (the CPU), and tagged (not inside join(), where a rank out of data sends
        zeros). The same answer on every rank."""
        return not self.late and guard.enabled and guard.reads_back(device)

    def finite_here(self, bucket) -> bool:
        known = self._finite.get(bucket.index)
        return known is None or bool(known[1])  # no gradient here: zeros

    def folded(self, bucket, nonfinite: bool) -> None:
        self._folded[bucket.index] = nonfinite

    # -- end of backward (the reducer calls it) ---------------------------------------------------

    def exchange(self, group, guard, shadow: bool = False, buckets: int = -1) -> None:
        """Collective: start the all-reduce of the flags (a rank out of data under join() adds zeros), unless
        every one of the backward's `buckets` told the verdict in its tag: then none."""
        if not self.late:
            for verdict in self._verdicts:  # a backward no optimizer step read (two in one step): its flags first
                self._settle(verdict)
            self._verdicts = []
        folded, self._folded = self._folded, {}
        if not shadow and len(folded) == buckets:  # each rank's count is the same: the exchange's choice
            verdict = _Verdict(self.step, self.micro_batch, self._flags, 0, None, -1, guard, group, self._finite,
                               seen=int(any(folded.values())))
            self._finite = {}
            self._verdicts.append(verdict)
            return
        if self.late and self._flags.is_cuda and not shadow:
            self._exchange_late(group, guard)
            return
        flags = torch.zeros_like(self._flags) if self.late else self._flags  # late: each in flight a while
        looked = [f for _, f in self._finite.values() if isinstance(f, torch.Tensor)]
        if shadow or not self._finite or not all(f for _, f in self._finite.values() if isinstance(f, bool)):
            flags[0] = 0 if shadow or not self._finite else 1
        elif looked:  # sums on the device: no read here
            flags[0].copy_(~torch.stack([f.to(flags.device) for f in looked]).all())
        else:
            flags[0] = 0
        tag = guard.tag(2 ** 40)
        flags[1] = tag
        entry = recorder.begin(recorder.FINITE_FLAGS, -1, flags.numel(), flags.dtype)
        # the group's own call: dist.all_reduce's Python wrappers cost more than this whole check (all_reduce.py)
        verdict = _Verdict(self.step, self.micro_batch, flags, tag, group.allreduce([flags], self._sum), entry, guard,
                           group, self._finite)
        self._finite = {}
        if shadow:  # nobody reads a joined rank's verdict
            self._settle(verdict)
            return
        self._verdicts.append(verdict)
        if generation.live_recovery() and not self.late:
            # Settled within the backward, before the step's commit (data/global_step.py): a rank lost during
            # this all-reduce is then a loss in the exchange, which the ranks left redo together; found later,
            # in an optimizer's pre-hook, some would have applied a step the others could not.
            self._settle(verdict)

    def _exchange_late(self, group, guard) -> None:
        """On a GPU under "raise": the flags say who saw one and where ([ranks, Σ rank + 1, Σ first bucket + 1,
        tags]: exact when one rank did), beside this rank's own, and go to the host behind the backward: a later
        optimizer step reads them once they are there, never waiting for the device, and raises on its own."""
        device = self._flags.device
        order = sorted(self._finite)
        flags, mine = torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(2, dtype=torch.int64, device=device)
        tag = guard.tag(2 ** 40)
        flags[3:].fill_(tag)  # a kernel's argument: `flags[3] = tag` copies from pageable memory, and waits
        if order:
            bad = ~torch.stack([torch.as_tensor(self._finite[k][1], device=device) for k in order])
            if self._order is None or self._order[0] != order:  # a copy to the GPU from a list waits for it: once
                self._order = (order, torch.tensor(order, dtype=torch.int64, device=device))
            first = self._order[1].gather(0, bad.int().argmax().reshape(1))[0]  # a tensor index would be read
            mine[0], mine[1] = bad.any(), first
            flags[0], flags[1], flags[2] = mine[0], mine[0] * (group.rank() + 1), mine[0] * (first + 1)
        entry = recorder.begin(recorder.FINITE_FLAGS, -1, flags.numel(), flags.dtype)
        verdict = _Verdict(self.step, self.micro_batch, flags, tag, group.allreduce([flags], self._sum), entry, guard,
                           group, self._finite)
        self._finite = {}
        verdict.work.wait()  # NCCL: the current stream waits for the all-reduce, the host does not
        verdict.host = torch.empty(6, dtype=torch.int64, pin_memory=True)
        verdict.host[:4].copy_(flags, non_blocking=True)
        verdict.host[4:].copy_(mine, non_blocking=True)
        verdict.copied = torch.cuda.Event()
        verdict.copied.record()
        self._verdicts.append(verdict)

    def forward(self) -> None:
        """A synchronized forward: a verdict whose step no optimizer began was not applied (GradScaler saw the
        overflow and skipped it, say): it is dropped."""
        kept = []
        for verdict in self._verdicts:
            if verdict.applied:
                kept.append(verdict)
            elif verdict.host is None:
                self._settle(verdict)
        self._verdicts = kept

    def _settle(self, verdict: _Verdict) -> int:
        """Wait for `verdict`'s flags and check their tag (once); returns how many ranks saw a NaN or Inf."""
        if verdict.seen is None:
            verdict.guard.wait_work(verdict.work, "the all-reduce of the non-finite gradient flags")
            seen, tags = verdict.flags.tolist()
            recorder.done(verdict.entry)
            verdict.guard.check_sum(tags, verdict.tag, "the non-finite gradient flags")
            verdict.seen = seen
        return verdict.seen

    # -- before an optimizer steps the model (optimizer_hooks.py) ---------------------------------

    def before_step(self, ddp) -> None:
        """Read the verdicts due (this backward's; late: the ones before it); on a non-finite gradient raise on
        every rank, or drop the step's gradients."""
        for verdict in self._verdicts:
            verdict.applied = True
        if self._verdicts and self._verdicts[0].host is not None:
            self._read_late(ddp)
            return
        due = [v for v in self._verdicts if not self.late or v.step < self.step]
        self._verdicts = [v for v in self._verdicts if v not in due]
        for verdict in due:
            if self._settle(verdict):
                self._act(ddp, verdict)

    def _read_late(self, ddp) -> None:
        """The GPU's verdicts already on the host, oldest first (none is waited for); on a NaN or Inf, raise here,
        on this rank (every rank raises when it reads the same flags: no collective)."""
        while self._verdicts and self._verdicts[0].copied.query():
            verdict = self._verdicts.pop(0)
            recorder.done(verdict.entry)
            seen, rank_sum, bucket_sum, tags, mine, first = verdict.host.tolist()
            verdict.guard.check_sum(tags, verdict.tag, "the non-finite gradient flags")
            if not seen:
                continue
            order = {id(p): (i, name) for i, (name, p) in enumerate(ddp._named_params)}
            bucket = verdict.buckets[first][0] if mine else None  # error path: the device may be read now
            found = sorted(order[id(p)] for p in (bucket.params if bucket is not None else ())
                           if p.grad is not None and not bool(torch.isfinite(_values(p.grad)).all()))
            parameter = found[0][1] if found else None
            who = f"rank {rank_sum - 1} (bucket {bucket_sum - 1})" if seen == 1 else f"{seen} ranks"
            here = f"this rank's first: parameter {parameter!r}" if parameter else "not this rank"
            raise NonFiniteGradientError(explain(
                f"step {verdict.step} had a non-finite gradient on {who}: {here}", rank=dist.get_rank(),
                seen="NaN or Inf in a rank's own gradients, before they were averaged",
                expected="finite gradients on every rank",
                fix=f"On a GPU the check reads its verdict once the device has it, without waiting: step "
                    f"{verdict.step} was applied (the parameters may hold NaN or Inf now): restore the last "
                    "checkpoint. on_nonfinite='skip' stops such a step before it is applied (it waits for the "
                    "backward); on_nonfinite='off' does not check."),
                ranks=[rank_sum - 1] if seen == 1 else [], step=verdict.step, micro_batch=verdict.micro_batch,
                parameter=parameter)

    def _act(self, ddp, verdict: _Verdict) -> None:
        step, micro_batch, group = verdict.step, verdict.micro_batch, verdict.group
        found = self._gather(ddp, verdict)
        culprits = [f for f in found if f is not None]
        rank, parameter, bucket = culprits[0] if culprits else (None, None, None)
        micro = (f"micro-batch {micro_batch} (the gradients summed over micro-batches 0-{micro_batch} of the step)"
                 if micro_batch else "micro-batch 0")
        ranks = [c[0] for c in culprits]
        where = f"parameter {parameter!r}" if parameter else f"bucket {bucket}"
        if self.mode == "skip":
            ddp.zero_grad(set_to_none=True)  # at the sharded levels: the owned chunks' averages too
            step_clock.add_skipped_step()
            progress.event("nonfinite_skipped", step=step, ranks=ranks, parameter=parameter, micro_batch=micro_batch)
            if dist.get_rank(group) == 0:
                logger.warning("step %d skipped on every rank: rank(s) %s had a non-finite gradient (first %s, %s)",
                               step, ranks, where, micro)
            return
        applied = (f"This rank read its verdict at the next optimizer step: step {step} was applied. "
                   if self.late else "No rank applied this step. ")
        raise NonFiniteGradientError(explain(
            f"step {step} has a non-finite gradient on rank(s) {ranks or '?'}: first {where}, {micro}",
            rank=dist.get_rank(), seen="NaN or Inf in that rank's own gradients, before they were averaged",
            expected="finite gradients on every rank", fix=applied + "Look at that rank's batch of that micro-batch "
            "(its loss, its inputs); pass on_nonfinite='skip' to DistributedDataParallel to skip such steps on every "
            "rank and go on, or on_nonfinite='off' to not check."),
            ranks=ranks, step=step, micro_batch=micro_batch, parameter=parameter)

    def _gather(self, ddp, verdict: _Verdict) -> list:
        """Error path: every rank's (rank, its first parameter in the model's order whose gradient holds a NaN or
        an Inf, the first bucket that did) or None, gathered."""
        mine = None
        bad = [bucket for _, (bucket, finite) in sorted(verdict.buckets.items()) if not bool(finite)]
        if bad:  # the averages hold this rank's NaN or Inf where its gradients did (a sum keeps them)
            order = {id(p): (i, name) for i, (name, p) in enumerate(ddp._named_params)}
            found = sorted(order[id(p)] for bucket in bad for p in bucket.params
                           if p.grad is not None and not bool(torch.isfinite(_values(p.grad)).all()))
            mine = (dist.get_rank(verdict.group), found[0][1] if found else None, bad[0].index)
        return generation.all_gather_objects(mine, verdict.group, "the non-finite gradients' first places")


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad._values() if grad.is_sparse else grad


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

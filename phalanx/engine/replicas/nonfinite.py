"""A NaN or Inf gradient, named on the rank that made it, before the exchange spreads it to every rank.

When a bucket leaves this rank (its exchange copied this rank's gradients in, the collective not started),
the exchange hands its flat gradients here: one sum per bucket (float32, float64 for float64 buckets), kept
on the device as a finite/not flag, nothing read back. At the end of backward one all-reduce of two numbers
(how many ranks saw one, and the step tag) tells every rank whether any rank did. The verdict is read when
an optimizer is about to step the model (so no rank applies a step another refuses): on the CPU the read is
free; on a GPU it waits for the backward to end (the one host read of a steady step; on_nonfinite="off"
has none). Then every rank raises NonFiniteGradientError naming the rank, step, micro-batch and first
parameter, or, with on_nonfinite="skip", drops the step's gradients (set to None: every torch optimizer then
leaves the parameters and their state alone) and counts a skipped step. An optimizer that never steps (a
GradScaler that saw the overflow itself skips the step) leaves the verdict unread: it is dropped.

What it misses: a sum that overflows float32 (gradients above ~1e34 in total) counts as non-finite; a comm
hook that makes a finite gradient non-finite (fp16 compression past 65504) is after the check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...diagnose import progress, recorder, step_clock
from ...errors import NonFiniteGradientError, explain
from ...log import logger

MODES = ("raise", "skip", "off")


class NonFiniteCheck:
    """The check of one DDP model's gradients (see the module docstring); its reducer and exchange call it."""

    def __init__(self, mode: str, control_device: torch.device):
        self.mode = mode
        self.step = 0  # the number of the step the coming gradients are for (the audit's count)
        self.flags = torch.zeros(2, dtype=torch.int64, device=control_device)  # [ranks that saw one, step tags]
        self._finite: dict[int, tuple] = {}  # bucket index -> (bucket, 0-dim bool: finite), this backward
        self._last: dict[int, tuple] = {}  # the same, of the backward whose verdict is pending
        self._work = None  # the flags' all-reduce in flight
        self._tag = 0
        self.pending: tuple | None = None  # (step, micro-batch) of a verdict not read yet
        self.micro_batch = 0  # of the synchronized backward: the forwards with gradients since the last one
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM

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

    # -- end of backward (the reducer calls it) ---------------------------------------------------

    def exchange(self, group, guard, shadow: bool = False) -> None:
        """Collective: start the all-reduce of the flags (a rank out of data under join() adds zeros)."""
        if self._work is not None:  # a verdict no optimizer step read (two backwards in one step): its flags first
            self._settle()
        flags = self.flags
        looked = [f for _, f in self._finite.values() if isinstance(f, torch.Tensor)]
        if shadow or not self._finite or not all(f for _, f in self._finite.values() if isinstance(f, bool)):
            flags[0] = 0 if shadow or not self._finite else 1
        elif looked:  # sums on the device: no read here
            flags[0].copy_(~torch.stack([f.to(flags.device) for f in looked]).all())
        else:
            flags[0] = 0
        self._last, self._finite = self._finite, {}
        self._tag = guard.tag(2 ** 40)
        flags[1] = self._tag
        entry = recorder.begin(recorder.FINITE_FLAGS, -1, flags.numel(), flags.dtype)
        # the group's own call: dist.all_reduce's Python wrappers cost more than this whole check (all_reduce.py)
        self._work = (group.allreduce([flags], self._sum), entry, guard, group)
        self.pending = None if shadow else (self.step, self.micro_batch)
        if shadow:  # nobody reads a joined rank's verdict
            self._settle()

    def forget(self) -> None:
        """A verdict nobody read (no optimizer stepped since): the step was not applied, so it is dropped."""
        if self._work is not None:
            self._settle()
        self.pending = None

    def _settle(self) -> list[int]:
        work, entry, guard, _ = self._work
        self._work = None
        guard.wait_work(work, "the all-reduce of the non-finite gradient flags")
        recorder.done(entry)
        seen, tags = self.flags.tolist()
        guard.check_sum(tags, self._tag, "the non-finite gradient flags")
        return [seen, tags]

    # -- before an optimizer steps the model (optimizer_hooks.py) ---------------------------------

    def before_step(self, ddp) -> None:
        """Read the verdict; on a non-finite gradient raise on every rank, or drop the step's gradients."""
        if self.pending is None or self._work is None:
            return
        group = self._work[3]
        seen, _ = self._settle()
        step, micro_batch = self.pending
        self.pending = None
        if not seen:
            return
        found = self._gather(ddp, group)
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
        raise NonFiniteGradientError(explain(
            f"step {step} has a non-finite gradient on rank(s) {ranks or '?'}: first {where}, {micro}",
            rank=dist.get_rank(), seen="NaN or Inf in that rank's own gradients, before they were averaged",
            expected="finite gradients on every rank", fix="No rank applied this step. Look at that rank's batch of "
            "that micro-batch (its loss, its inputs); pass on_nonfinite='skip' to DistributedDataParallel to skip "
            "such steps on every rank and go on, or on_nonfinite='off' to not check."),
            ranks=ranks, step=step, micro_batch=micro_batch, parameter=parameter)

    def _gather(self, ddp, group) -> list:
        """Error path: every rank's (rank, its first parameter in the model's order whose gradient holds a NaN or
        an Inf, the first bucket that did) or None, gathered."""
        mine = None
        bad = [bucket for _, (bucket, finite) in sorted(self._last.items()) if not bool(finite)]
        if bad:  # the averages hold this rank's NaN or Inf where its gradients did (a sum keeps them)
            order = {id(p): (i, name) for i, (name, p) in enumerate(ddp._named_params)}
            found = sorted(order[id(p)] for bucket in bad for p in bucket.params
                           if p.grad is not None and not bool(torch.isfinite(_values(p.grad)).all()))
            mine = (dist.get_rank(group), found[0][1] if found else None, bad[0].index)
        self._last = {}
        everyone = [None] * group.size()
        dist.all_gather_object(everyone, mine, group=group)
        return everyone


def _values(grad: torch.Tensor) -> torch.Tensor:
    return grad._values() if grad.is_sparse else grad


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

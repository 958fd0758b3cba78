"""Pickling and `copy.deepcopy` of a DDP model, with torch's semantics.

A copy takes everything but what belongs to this process (the process group, the step guard, the
reducer and its exchange): it is rebuilt on the copy's default group the first time the copy trains,
so copying on one rank alone (an EMA kept on rank 0) issues no collective.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import DDPPickleError, WorldConfigError, explain


class PicklingMixin:
    """`__getstate__`, `__setstate__` and the engine built on demand, mixed into DistributedDataParallel
    (which provides `process_group` and `_build_engine`)."""

    def __getstate__(self):
        """Everything but the process group and the engine, which belong to this process."""
        outer = getattr(self, "outer_step", None)
        if outer is not None and (outer.spans_hosts or getattr(outer, "live", None) is not None):
            raise DDPPickleError(explain(
                "a model with across_hosts=DiLoCo(...) on several hosts, or under live recovery, is not copied",
                rank=dist.get_rank(),
                seen="its outer step, on this run's host and cross-host groups", expected="across_hosts=None",
                fix="Copy or save the inner model (`model.module`) instead."))
        if self.process_group is not _default_group():
            raise DDPPickleError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process group. That "
                "is, when you have called init_process_group and have not passed process_group argument to DDP "
                "constructor. " + explain("this model was wrapped for another process group", rank=dist.get_rank(),
                                          seen=f"a group of ranks {dist.get_process_group_ranks(self.process_group)}",
                                          expected="the default group (process_group=None)",
                                          fix="Copy or save the inner model (`model.module`) instead."))
        state = dict(self.__dict__)
        for name in ("process_group", "_guard", "_reducer", "_hosts", "_comm_hook", "_audit"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        """A working DDP on the default process group of this process. The copy shares no state with the
        original; its engine is built at its first forward that synchronizes gradients, on every rank
        (as any DDP forward is), so copying on one rank alone (an EMA on rank 0) needs no collective.
        A comm hook is not copied (it belongs to the original's engine, as in torch): register it again."""
        super().__setstate__(state)
        self.process_group = _default_group()
        self._guard = self._reducer = self._hosts = None
        self._comm_hook = self._audit = None  # a copy audits its own replicas once it trains

    def _ensure_engine(self) -> None:
        if self.process_group is None:
            self.process_group = _default_group()
        if self.process_group is None:
            raise WorldConfigError(explain(
                "this DistributedDataParallel was unpickled in a process without a process group",
                seen="torch.distributed not initialized", expected="an initialized default group",
                fix="Call phalanx.init() before training the copy, or use its `.module` without DDP."))
        self._build_engine()


def _default_group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

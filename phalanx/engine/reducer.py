"""The gradient engine: count gradients ready, launch full buckets in order, finish after backward.

A post-accumulate-grad hook per parameter counts it ready; when the next bucket in index order is
complete it is launched through the exchange (which overlaps the rest of backward), so every rank
issues the same collectives in the same order. An autograd engine callback at the end of backward
has the exchange deliver every bucket's average into the gradients. After the first synchronized
iteration the buckets are rebuilt once, in the order rank 0 saw gradients arrive. How a bucket is
averaged is the exchange's business alone (exchange/). Under distributed autograd (RPC) the
gradients live in the context and other hooks count them (dist_autograd.py).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..bucket.buckets import Bucket, plan_buckets
from ..bucket.step_guard import StepGuard
from ..diagnose import recorder
from ..errors import UnusedParameterError, explain
from ..exchange.base import BucketExchange
from .dist_autograd import accumulator_hooks, context_gradients

_engine = torch.autograd.Variable._execution_engine


class Reducer:
    """Averages the gradients of `params` over `group` during backward (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], group, exchange: BucketExchange, *,
                 cap_bytes: int, first_cap_bytes: int, tolerate_unused: bool, as_view: bool, guard: StepGuard,
                 control_device: torch.device, sparse: frozenset = frozenset()):
        self.params, self.names, self.group = params, names, group
        self.exchange = exchange
        self.check = None  # the non-finite gradient check (replicas/nonfinite.py), when the model has one
        self.cap_bytes, self.first_cap_bytes = cap_bytes, first_cap_bytes
        self.tolerate_unused = tolerate_unused
        self.sparse = sparse  # indices of the parameters whose gradients are sparse tensors
        self.as_view = as_view
        self.guard = guard
        self.control_device = control_device
        self.armed = False  # a synchronized backward is expected (set by DDP's forward)
        self.rebuilt = exchange.keeps_plan  # no one-time rebuild for an exchange that keeps its plan
        self.unready_error: list[str] | None = None
        self._queued = False
        self._steady = False  # armed, finalize queued, buckets rebuilt: the hooks' fast path applies
        self._ready = bytearray(len(params))  # got a gradient since the last synchronized backward (reset in place)
        self._no_ready = bytes(len(params))
        self._order: list[int] = []  # the ready order of the first synchronized backward
        self._used = torch.zeros(len(params) + 1, dtype=torch.int32, device=control_device)
        self.buckets: list[Bucket] = []
        self._bucket_of: list[Bucket | None] = [None] * len(params)  # updated in place: the hooks hold it
        self._next = 0
        self._entries: dict[int, int] = {}  # bucket index -> its entry in the record (diagnose/)
        self._build(self._plan(list(reversed(range(len(params))))))
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        self._dist_context: int | None = None  # the distributed autograd context of the coming backward
        self._accumulators: list = []  # AccumulateGrad nodes hooked, once a backward was distributed

    # -- plan -------------------------------------------------------------------------------------

    @torch.no_grad()
    def _build(self, plan: list[list[int]]) -> None:
        """Buckets for `plan` in the exchange's storage. Allocation may be collective (shared memory):
        every rank builds the same plan in the same order."""
        sizes = [None if indices[0] in self.sparse else (Bucket.storage_numel(indices, self.params),
                                                          self.params[indices[0]].dtype, self.params[indices[0]].device)
                 for indices in plan]
        storages = self.exchange.allocate_plan(sizes)
        self.buckets = [Bucket(k, indices, self.params, storage, self.as_view)
                        for k, (indices, storage) in enumerate(zip(plan, storages))]
        for bucket in self.buckets:
            for i in bucket.indices:
                self._bucket_of[i] = bucket
        self.exchange.prepare(self.buckets)
        self._next = 0

    @torch.no_grad()
    def _replace(self, plan: list[list[int]], exchange: BucketExchange) -> None:
        """New buckets for `plan`, averaged by `exchange`; gradients that viewed the old ones move along."""
        self.exchange.settle(self.buckets)
        old, previous = self.buckets, self.exchange
        self.exchange = exchange
        exchange.check = self.check
        self._build(plan)
        if self.as_view:
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
        for bucket in old:
            if not bucket.sparse:
                previous.release(bucket.storage)

    def _plan(self, order: list[int]) -> list[list[int]]:
        return plan_buckets(self.params, order, self.cap_bytes, self.first_cap_bytes, self.sparse)

    def plan(self) -> list[list[int]]:
        return [list(b.indices) for b in self.buckets]

    def set_check(self, check) -> None:
        """Run `check` (a GradientCheck with `exchange()`; None: none) on every bucket as it leaves this rank."""
        self.check = self.exchange.check = check

    def set_exchange(self, exchange: BucketExchange) -> None:
        """Average with `exchange` from now on (register_comm_hook): the same plan, storage of its own."""
        self._replace(self.plan(), exchange)

    # -- during backward --------------------------------------------------------------------------

    def _make_hook(self, index: int):
        # Runs once per parameter per backward: the steady state touches a handful of names only.
        ready, bucket_of = self._ready, self._bucket_of

        def on_grad_accumulated(_param):
            ready[index] = 1
            if self._steady:
                bucket = bucket_of[index]
                bucket.pending -= 1
                if not bucket.pending and bucket.index == self._next:
                    self._launch_ready()
            elif self.armed:  # else: no_sync(), or a backward no DDP forward prepared: accumulate locally
                self._mark_ready_first(index)
        return on_grad_accumulated

    def _mark_ready_first(self, index: int) -> None:
        """The slow path: first gradient of a backward (queue finalize), or recording the first order."""
        if self._count_ready(index):
            self._steady = self.rebuilt
        bucket = self._bucket_of[index]
        if not bucket.pending and bucket.index == self._next:
            self._launch_ready()

    def _count_ready(self, index: int) -> bool:
        """Count gradient `index` in its bucket; at the backward's first, queue the finish (True then).
        Until the rebuild, record the order gradients arrive in."""
        first = not self._queued
        if first:
            self._queued = True
            self.guard.begin()
            recorder.phase(recorder.BACKWARD)
            _engine.queue_callback(self._finalize)
        if not self.rebuilt:
            self._order.append(index)
        self._bucket_of[index].pending -= 1
        return first

    @torch.no_grad()
    def _launch_ready(self) -> None:
        """Launch the next buckets in index order, as long as they are complete."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        """exchange.launch, recorded: arrival (enqueued), then the transport started."""
        entry = recorder.begin(recorder.BUCKET, bucket.index, bucket.numel, bucket.params[0].dtype, started=False)
        self.exchange.launch(bucket)
        recorder.started(entry)
        self._entries[bucket.index] = entry

    # -- after backward ---------------------------------------------------------------------------

    @torch.no_grad()
    def _finalize(self) -> None:
        self._queued = False
        self.armed = self._steady = False
        context, self._dist_context = self._dist_context, None
        if context is None:
            self._finish()
            return
        if self.as_view:  # the buckets are about to hold the context's gradients, not these
            for bucket in self.buckets:
                bucket.detach_gradient_views()
        # A parameter that got no gradient here but did elsewhere (find_unused_parameters) gets the
        # average in .grad only: the context has no entry for it, and Python cannot add one.
        with context_gradients(self.params, context):
            self._launch_ready()
            self._finish()

    def _finish(self) -> None:
        buckets = self.buckets
        if self._next < len(buckets):
            if not self.tolerate_unused:
                # The other ranks launched the same buckets (if their unused set is ours): finish them,
                # then report at the next forward, where the user can still act on it.
                for bucket in buckets[:self._next]:
                    self.exchange.discard(bucket)
                    recorder.done(self._entries.pop(bucket.index, -1))
                self.unready_error = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
                self._reset()
                self.guard.end()
                return
            for bucket in buckets[self._next:]:  # the missing gradients count as zeros
                self._launch(bucket)
            self._next = len(buckets)
        # With unused parameters, which got a gradient anywhere decides what is written back.
        used = self._used_anywhere() if self.tolerate_unused else None
        for bucket in buckets:  # bucket by bucket, while the later ones are still in flight
            self.exchange.deliver(bucket, used)
            recorder.done(self._entries.pop(bucket.index, -1))
        if self.check is not None:  # whether any rank saw a NaN or Inf: after the deliveries, as a comm hook
            # (PowerSGD) issues collectives until its future ends; none when every bucket's tag said it
            self.check.exchange(self.group, self.guard, buckets=len(buckets))
        if not self.rebuilt:
            self._rebuild()
        self._reset()
        self.guard.end()

    def _used_anywhere(self) -> list[int] | None:
        """Collective: per parameter, the number of ranks where it got a gradient this backward. None when
        every parameter got one here: each was then used somewhere, and the map is not read back, which on
        a GPU would wait for the whole backward (torch's reducer reads it at every step)."""
        # To a GPU: a blocking copy would wait for the stream; a non-blocking one from pageable memory is
        # staged at once (CUDA's cudaMemcpyAsync), so the flags may change right after, and nothing waits.
        self._used[:-1].copy_(torch.frombuffer(self._ready, dtype=torch.uint8), non_blocking=True)
        own_tag = self.guard.tag(2 ** 20)
        self._used[-1:].fill_(own_tag)  # a kernel argument: no copy from the host
        entry = recorder.begin(recorder.USED_MAP, -1, self._used.numel(), self._used.dtype)
        future = dist.all_reduce(self._used, group=self.group, async_op=True).get_future()
        self.guard.wait(future, "the all-reduce of the used-parameter map")
        recorder.done(entry)
        every_one_here = 0 not in self._ready
        if every_one_here and not self.guard.reads_back(self._used.device):
            return None
        counts = self._used.tolist()
        self.guard.check_sum(counts[-1], own_tag, "the used-parameter map")
        return None if every_one_here else counts[:-1]

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        self._ready[:] = self._no_ready

    def disarm(self) -> None:
        """The coming backward is not synchronized (no_sync, or no grad): hooks only note readiness."""
        self.armed = self._steady = False
        self._dist_context = None

    def prepare_for_backward(self, dist_context: int | None = None) -> None:
        """Called by DDP's forward when gradients will be synchronized in the coming backward (under
        distributed autograd: the backward of context `dist_context`)."""
        if self._queued and torch._C._current_autograd_node() is not None:
            self.armed = True  # a forward run inside backward (reentrant checkpointing): keep counting
            return
        # A backward that raised never reached _finalize: start this one from a clean count.
        self._queued = self._steady = False
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        self._dist_context = dist_context
        if dist_context is not None and not self._accumulators:
            self._accumulators, handles = accumulator_hooks(self.params, self._mark_ready_in_context)
            self._handles += handles
        # Under distributed autograd only the accumulators' hooks run: the tensors' stay disarmed.
        self.armed = dist_context is None

    def _mark_ready_in_context(self, index: int) -> None:
        """A gradient arrived in the distributed autograd context; the buckets go at the end of backward
        (the gradients are read from the context once, there)."""
        if self._dist_context is None:  # a local backward: the tensor hooks count it
            return
        self._ready[index] = 1
        self._count_ready(index)

    # -- the one-time rebuild ---------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Adopt rank 0's observed ready order for the buckets (once; every rank takes part)."""
        seen = set(self._order)
        order = self._order + [i for bucket in self.plan() for i in bucket if i not in seen]
        self.rebuilt = True
        self._order = []
        order_tag = self.guard.tag(2 ** 30)
        message = torch.tensor(order + [order_tag], dtype=torch.int64, device=self.control_device)
        sender = dist.get_global_rank(self.group, 0)
        entry = recorder.begin(recorder.BROADCAST, -1, message.numel(), message.dtype)
        work = dist.broadcast(message, sender, group=self.group, async_op=True)
        self.guard.wait_work(work, "the broadcast of the bucket order")
        recorder.done(entry)
        received = message.tolist()  # the one read of this step on the host: the rebuild happens once
        self.guard.check_equal(received[-1], order_tag, "the broadcast of the bucket order")
        self.rebuild_with_order(received[:-1])

    def rebuild_with_order(self, order: list[int]) -> None:
        plan = self._plan(order)
        if plan != self.plan():
            self._replace(plan, self.exchange)

    # -- join: a rank out of data mirrors the others' backward ------------------------------------

    @torch.no_grad()
    def shadow_backward(self) -> None:
        """Issue the collectives of one synchronized backward with zero gradients."""
        entries = [recorder.begin(recorder.SHADOW, b.index, b.numel, b.params[0].dtype) for b in self.buckets]
        self.exchange.shadow(self.buckets)
        for entry in entries:
            recorder.done(entry)
        if self.tolerate_unused:
            self._used.zero_()
            entry = recorder.begin(recorder.USED_MAP, -1, self._used.numel(), self._used.dtype)
            self.guard.wait(dist.all_reduce(self._used, group=self.group, async_op=True).get_future(),
                            "the shadow all-reduce of the used-parameter map")
            recorder.done(entry)
        if self.check is not None:
            self.check.exchange(self.group, self.guard, shadow=True)
        if not self.rebuilt:
            self._ready[:] = self._no_ready
            self._rebuild()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def remove_with(self, owner) -> None:
        """Remove the hooks when `owner` (the DDP wrapper) goes away. The finalizer holds this reducer weakly: one
        replaced (a regroup removed its hooks) is freed with its buckets and its process group."""
        weakref.finalize(owner, _remove_if_alive, weakref.ref(self))


def _remove_if_alive(reducer: weakref.ref) -> None:
    if (alive := reducer()) is not None:  # its hooks still hold it
        alive.remove()


def unused_parameters_error(names: list[str], step: int) -> UnusedParameterError:
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return UnusedParameterError(explain(
        f"parameters received no gradient in the backward of step {step}: {shown}", rank=dist.get_rank(),
        seen=f"{len(names)} parameter(s) without a gradient", expected="every trainable parameter to get one",
        fix="Pass find_unused_parameters=True to DistributedDataParallel if some parameters are legitimately "
            "unused in some steps, freeze them (requires_grad=False), or make them take part in the loss."),
        names=names)

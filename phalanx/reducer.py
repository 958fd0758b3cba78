"""The gradient engine: count gradients ready, launch full buckets in order, finalize after backward.

A post-accumulate-grad hook per parameter counts it ready; when the next bucket in index order is
complete it is launched through the comm hook (async, overlapping the rest of backward), so every
rank issues the same collectives in the same order. An autograd engine callback at the end of
backward waits for all buckets and writes the averaged gradients back. After the first
synchronized iteration the buckets are rebuilt once, in the order rank 0 saw gradients arrive.

With the shared-memory transport on two or three ranks the exchange is posted instead (shm.py):
a full bucket is only published, and at the end of backward each rank sums all ranks' copies
straight into its gradients, which saves a pass over the gradients and a copy back. A bucket of
few large gradients is split: each rank publishes only the others' chunks, sums its own chunk
into its gradients, then fetches the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import hooks
from .buckets import Bucket, GradBucket, plan_buckets
from .replicas import tag_modulus

_engine = torch.autograd.Variable._execution_engine


class Reducer:
    """Averages the gradients of `params` over `group` during backward (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], group, cap_bytes: int,
                 first_cap_bytes: int, *,
                 tolerate_unused: bool, as_view: bool, guard, control_device: torch.device, allocator=None):
        self.params, self.names, self.group = params, names, group
        self.allocator = allocator  # alloc(numel, dtype) / release(tensor) for bucket storage; None: torch.zeros
        self.world_size = group.size()
        self.cap_bytes, self.first_cap_bytes = cap_bytes, first_cap_bytes
        self.tolerate_unused = tolerate_unused
        self.as_view = as_view
        self.guard = guard
        self.control_device = control_device
        self._posted = False  # the exchange is posted (claim, post, gather_sum), not a comm hook call
        self._splits: dict = {}  # bucket index -> (own pieces, fetched pieces): posted buckets exchanged split
        self._tag_total = torch.zeros(1, dtype=torch.float64)  # the summed step tag of a posted bucket
        self.set_comm_hook(group, hooks.sum_prescaled_hook)
        self.divisor = self.world_size  # the default hook averages over this many ranks (join changes it)
        self.armed = False  # a synchronized backward is expected (set by DDP's forward)
        self.rebuilt = False
        self.unready_error: list[str] | None = None
        self._queued = False
        self._steady = False  # armed, finalize queued, buckets rebuilt: the hooks' fast path applies
        self._ready = bytearray(len(params))  # got a gradient since the last synchronized backward (reset in place)
        self._no_ready = bytes(len(params))
        self._order: list[int] = []  # the ready order of the first synchronized backward
        self._used = torch.zeros(len(params) + 1, dtype=torch.int32, device=control_device)
        self._build(list(reversed(range(len(params)))))
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    # -- plan ---------------------------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        plan = plan_buckets(self.params, order, self.cap_bytes, self.first_cap_bytes)
        previous = getattr(self, "buckets", [])
        # Allocation may be collective (shared memory): every rank builds the same plan in the same order.
        self.buckets = [Bucket(k, indices, self.params, self.allocator) for k, indices in enumerate(plan)]
        if self.allocator is not None:
            for bucket in previous:
                self.allocator.release(bucket.storage)
        bucket_of = [None] * len(self.params)
        for bucket in self.buckets:
            for i in bucket.indices:
                bucket_of[i] = bucket
        if hasattr(self, "_bucket_of"):
            self._bucket_of[:] = bucket_of  # in place: the hooks hold this list
        else:
            self._bucket_of = bucket_of
        last = len(self.buckets) - 1
        self._facades = [GradBucket(b, b.index == last) for b in self.buckets]
        self._tag_mod = [tag_modulus(b.storage.dtype, self.world_size) for b in self.buckets]
        if hasattr(self, "hook_state"):
            self._plan_splits()
        self._futures: list = [None] * len(self.buckets)  # or posted tickets
        self._totals: dict = {}  # bucket index -> (private sum buffer, its views): posted small gradients
        self._complete = [True] * len(self.buckets)
        self._next = 0

    def plan(self) -> list[list[int]]:
        return [list(b.indices) for b in self.buckets]

    def set_comm_hook(self, state, hook) -> None:
        if self._posted:  # our copies may still be read by a peer: wait before anything rewrites them
            for bucket in self.buckets:
                self.hook_state.claim(bucket.storage)
        self.hook_state, self.hook = state, hook
        # A prescaled hook only sums: the engine divides while copying in and fills the step tag.
        self._prescaled = getattr(hook, "_phalanx_prescaled", False)
        # A hook that offers a posted exchange on its state, used when the state allocated our buckets
        # and it moves fewer bytes; views (gradient_as_bucket_view) need the result in the bucket
        # itself, which calling the hook provides.
        self._posted = (getattr(hook, "_phalanx_posted", False) and state is self.allocator
                        and not self.as_view and state.posted_exchange_pays())
        self._plan_splits()

    def _plan_splits(self) -> None:
        """Which posted buckets are exchanged split (shm.py), and each one's pieces: the part of each
        gradient in this rank's chunk, and the parts it fetches from the chunks' owners. Few large
        gradients only: per-piece calls would cost more than they save on many small ones."""
        self._splits = {}
        if not self._posted:
            return
        comm, rank = self.hook_state, self.hook_state.rank
        for bucket in self.buckets:
            dtype = bucket.storage.dtype
            if not (bucket.fused_scale and comm.split_exchange_pays(dtype)
                    and all(p.is_contiguous() for p in bucket.params)):
                continue
            bounds = comm.chunk_bounds(bucket.numel, bucket.storage.element_size())
            own, fetched = [], []  # (k, lo, hi) and (owner, k, lo, hi), lo and hi inside gradient k
            for k, (start, p) in enumerate(zip(bucket.offsets, bucket.params)):
                for owner in range(len(bounds) - 1):
                    lo, hi = max(start, bounds[owner]), min(start + p.numel(), bounds[owner + 1])
                    if hi > lo:
                        if owner == rank:
                            own.append((k, lo - start, hi - start))
                        else:
                            fetched.append((owner, k, lo - start, hi - start))
            self._splits[bucket.index] = (own, fetched)

    # -- during backward ------------------------------------------------------------------------

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
        if not self._queued:
            self._queued = True
            self.guard.begin()
            _engine.queue_callback(self._finalize)
            self._steady = self.rebuilt
        if not self.rebuilt:
            self._order.append(index)
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if not bucket.pending and bucket.index == self._next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the next buckets in index order, as long as they are complete."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._launch(buckets[self._next], complete=True)
            self._next += 1

    @torch.no_grad()
    def _launch(self, bucket: Bucket, complete: bool) -> None:
        self._complete[bucket.index] = complete
        scale = 1.0 / self.divisor if self._prescaled and self.divisor != 1 else None
        if self._posted:
            self.hook_state.claim(bucket.storage)
        split = self._splits.get(bucket.index)
        if split is not None:
            self._fill_others_chunks(bucket, split[1], scale)
        elif self.as_view:
            self._fill_views(bucket, scale)
        else:
            self._fill_copies(bucket, scale, complete)
        if self._prescaled:
            bucket.tag_slot.fill_(self.guard.tag(self._tag_mod[bucket.index]))
        if self._posted:
            self._futures[bucket.index] = self.hook_state.post(bucket.storage)
            return
        facade = self._facades[bucket.index]
        facade._buffer = bucket.buffer  # undo a set_buffer() of the previous step
        self._futures[bucket.index] = self.hook(self.hook_state, facade)

    def _fill_others_chunks(self, bucket: Bucket, fetched: list, scale) -> None:
        """Split exchange: only the parts of the gradients that other ranks sum go into the bucket."""
        flat = bucket.buffer
        for _, k, lo, hi in fetched:
            start = bucket.offsets[k]
            grad = bucket.params[k].grad
            out = flat[start + lo:start + hi]
            if grad is None:
                out.zero_()
            else:
                piece = grad.reshape(-1)[lo:hi]
                out.copy_(piece) if scale is None else torch.mul(piece, scale, out=out)

    def _fill_views(self, bucket: Bucket, scale) -> None:
        """gradient_as_bucket_view: gradients accumulated in place stay; new ones move into the bucket."""
        new_grads, new_views, new_params, in_place = [], [], [], []
        for p, view in zip(bucket.params, bucket.views):
            grad = p.grad
            if grad is view:  # accumulated in place into the bucket: nothing to copy
                in_place.append(view)
            elif grad is None:
                view.zero_()
            else:
                new_grads.append(grad)
                new_views.append(view)
                new_params.append(p)
        if len(new_grads) == len(bucket.params):  # after zero_grad(set_to_none=True): the usual case
            self._copy_in(bucket, new_grads, scale)
        elif len(in_place) == len(bucket.params):  # after zero_grad(set_to_none=False)
            if scale is not None:
                bucket.buffer.mul_(scale)
        else:
            for grad, view in zip(new_grads, new_views):
                view.copy_(grad) if scale is None else torch.mul(grad, scale, out=view)
            if scale is not None:
                torch._foreach_mul_(in_place, scale)
        for p, view in zip(new_params, new_views):
            p.grad = view

    def _fill_copies(self, bucket: Bucket, scale, complete: bool) -> None:
        grads = [p.grad for p in bucket.params]
        if complete:
            self._copy_in(bucket, grads, scale)
            return
        for grad, view in zip(grads, bucket.views):  # finalize with unused parameters: they add zeros
            view.zero_() if grad is None else view.copy_(grad)
        if scale is not None:
            bucket.buffer.mul_(scale)

    def _copy_in(self, bucket: Bucket, grads: list, scale) -> None:
        """Every parameter's gradient into the bucket, times `scale`, in the cheapest way for its shape."""
        if scale is None:
            torch._foreach_copy_(bucket.views, grads)
        elif bucket.fused_scale:  # few large tensors: one pass each
            for grad, view in zip(grads, bucket.views):
                torch.mul(grad, scale, out=view)
        else:  # many small tensors: per-tensor calls cost more than a second pass over the flat buffer
            torch._foreach_copy_(bucket.views, grads)
            bucket.buffer.mul_(scale)

    # -- after backward -------------------------------------------------------------------------

    @torch.no_grad()
    def _finalize(self) -> None:
        self._queued = False
        self.armed = self._steady = False
        buckets = self.buckets
        if self._next < len(buckets):
            if not self.tolerate_unused:
                # The other ranks launched the same buckets (if their unused set is ours): drain them,
                # then report at the next forward, where the user can still act on it.
                self._drain(self._next)
                self.unready_error = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
                self._reset()
                self.guard.end()
                return
            for bucket in buckets[self._next:]:
                self._launch(bucket, complete=all(self._ready[i] for i in bucket.indices))
            self._next = len(buckets)
        # With unused parameters, which got a gradient anywhere decides what is written back.
        used = self._used_anywhere() if self.tolerate_unused else None
        for bucket in buckets:  # bucket by bucket, while the later ones are still in flight
            if bucket.index in self._splits:
                self._split_collect(bucket, used)
            elif self._posted:
                self._gather(bucket, used)
            else:
                self._wait_for(bucket)
                self._write_back(bucket, used)
        if not self.rebuilt:
            self._rebuild()
        self._reset()
        self.guard.end()

    def _used_anywhere(self) -> list[int]:
        """Collective: per parameter, the number of ranks where it got a gradient this backward."""
        self._used[:-1].copy_(torch.frombuffer(self._ready, dtype=torch.uint8))
        self._used[-1] = self.guard.tag(2 ** 20)
        future = dist.all_reduce(self._used, group=self.group, async_op=True).get_future()
        self.guard.wait(future, "the all-reduce of the used-parameter map")
        self.guard.check_sum(int(self._used[-1]), self.guard.tag(2 ** 20), "the used-parameter map")
        return self._used[:-1].tolist()

    def _drain(self, count: int) -> None:
        """Finish the exchanges of the first `count` buckets, results unused."""
        for bucket in self.buckets[:count]:
            if bucket.index in self._splits:
                self._split_collect(bucket, None)  # the peers need this rank's chunk of the sum
            elif self._posted:
                ticket, self._futures[bucket.index] = self._futures[bucket.index], None
                self._gather_posted(bucket, ticket, [], f"the gradient exchange of bucket {bucket.index}")
            else:
                self._wait_for(bucket)

    def _gather(self, bucket: Bucket, used) -> None:
        """Posted exchange: every rank's copy of the bucket summed straight into the gradients."""
        ticket, self._futures[bucket.index] = self._futures[bucket.index], None
        grads, chosen = [], []  # (offset in the bucket, where the sum goes), and which parameter
        for k, (i, p, start) in enumerate(zip(bucket.indices, bucket.params, bucket.offsets)):
            if used is not None and not used[i]:
                continue  # unused on every rank: its gradient stays as it is (None stays None)
            if p.grad is None:  # unused here only
                p.grad = torch.empty(p.shape, dtype=bucket.storage.dtype, device=bucket.storage.device)
            grads.append((start, p.grad))
            chosen.append(k)
        what = f"the gradient exchange of bucket {bucket.index}"
        if bucket.fused_scale:  # few large gradients: one pass each, straight into them
            tag = self._tag_total
            self._gather_posted(bucket, ticket, grads + [(bucket.numel, tag)], what)
        else:  # many small ones: a single sum into a private buffer, then one batched copy
            total, views = self._private_total(bucket)
            self._gather_posted(bucket, ticket, [(0, total)], what)
            tag = total[bucket.numel:]
            if len(grads) == len(bucket.params):
                torch._foreach_copy_([grad for _, grad in grads], views)
            else:
                for k, (_, grad) in zip(chosen, grads):
                    grad.copy_(views[k])
        if self._prescaled and self.guard.enabled:
            self.guard.check_sum(tag.item(), self.guard.tag(self._tag_mod[bucket.index]), what)

    def _split_collect(self, bucket: Bucket, used) -> None:
        """Split exchange: sum this rank's chunk straight into the gradients (and the bucket, for the
        peers), then fetch the other chunks from their owners."""
        ticket, self._futures[bucket.index] = self._futures[bucket.index], None
        own, fetched = self._splits[bucket.index]
        flats, copy_back = {}, []  # gradient k as one contiguous row, and strided ones to write back
        for k, (i, p) in enumerate(zip(bucket.indices, bucket.params)):
            if used is not None and not used[i]:
                continue  # unused on every rank: its gradient stays as it is (None stays None)
            if p.grad is None:  # unused here only (or the drain of a failed step): this rank adds zeros
                p.grad = torch.zeros(p.shape, dtype=bucket.storage.dtype, device=bucket.storage.device)
            grad = p.grad
            if grad.is_contiguous():
                flats[k] = grad.view(-1)
            else:
                flats[k] = grad.contiguous().view(-1)
                copy_back.append((grad, flats[k]))
        start = bucket.offsets
        what = f"the gradient exchange of bucket {bucket.index}"
        self._split_exchange(bucket, ticket, what, 1.0 / self.divisor,
                             [(start[k] + lo, flats[k][lo:hi]) for k, lo, hi in own if k in flats],
                             [(owner, start[k] + lo, flats[k][lo:hi]) for owner, k, lo, hi in fetched if k in flats],
                             sums=[(bucket.numel, self._tag_total)])
        for grad, flat in copy_back:
            grad.copy_(flat.view(grad.shape))
        if self.guard.enabled:
            self.guard.check_sum(self._tag_total.item(), self.guard.tag(self._tag_mod[bucket.index]), what)

    def _split_exchange(self, bucket: Bucket, ticket: int, what: str, scale: float, own: list, fetched: list,
                        sums=()) -> None:
        """reduce_own_chunk() then fetch_chunks(), each once every rank is ready, within the guard's bounds."""
        comm = self.hook_state
        self.guard.wait_until(lambda seconds: comm.posted_ready(ticket, seconds), what)
        results = comm.reduce_own_chunk(bucket.storage, ticket, own, scale, sums)
        self.guard.wait_until(lambda seconds: comm.posted_ready(results, seconds), what)
        comm.fetch_chunks(bucket.storage, results, fetched)

    def _gather_posted(self, bucket: Bucket, ticket: int, outputs: list, what: str) -> None:
        """gather_sum(), once every rank has posted: within the guard's bounds, like any other wait."""
        comm = self.hook_state
        self.guard.wait_until(lambda seconds: comm.posted_ready(ticket, seconds), what)
        comm.gather_sum(bucket.storage, ticket, outputs)

    def _private_total(self, bucket: Bucket):
        found = self._totals.get(bucket.index)
        if found is None:
            total = torch.empty_like(bucket.storage)
            views = [piece.view(p.shape) for piece, p in
                     zip(total[:bucket.numel].split([p.numel() for p in bucket.params]), bucket.params)]
            found = self._totals[bucket.index] = (total, views)
        return found

    def _wait_for(self, bucket: Bucket) -> None:
        """Wait for a bucket's comm hook; check its step tag; make sure its result is in the buffer."""
        what = f"the gradient all-reduce of bucket {bucket.index}"
        future, self._futures[bucket.index] = self._futures[bucket.index], None
        facade = self._facades[bucket.index]
        if facade._work is not None:  # reduced in place by a prescaled hook: wait on its Work
            work, facade._work = facade._work, None
            self.guard.wait_work(work, what)
            result = None
        else:
            value = self.guard.wait(future, what)
            result = value[0] if isinstance(value, (list, tuple)) else value
        if self._prescaled and self.guard.enabled and bucket.storage.device.type == "cpu":
            self.guard.check_sum(bucket.tag_slot.item(), self.guard.tag(self._tag_mod[bucket.index]), what)
        if result is not None and result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result[:bucket.numel] if result.numel() > bucket.numel else result)

    def _write_back(self, bucket: Bucket, used) -> None:
        """Averaged bucket contents -> param.grad; a parameter unused on every rank keeps its grad."""
        if self._complete[bucket.index] and not self.as_view:
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)
            return
        for i, p, view in zip(bucket.indices, bucket.params, bucket.views):
            if used is not None and not used[i]:
                continue
            if self.as_view:
                if p.grad is not view:
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        self._ready[:] = self._no_ready

    def disarm(self) -> None:
        """The coming backward is not synchronized (no_sync, or no grad): hooks only note readiness."""
        self.armed = self._steady = False

    def prepare_for_backward(self) -> None:
        """Called by DDP's forward when gradients will be synchronized in the coming backward."""
        if self._queued and torch._C._current_autograd_node() is not None:
            self.armed = True  # a forward run inside backward (reentrant checkpointing): keep counting
            return
        # A backward that raised never reached _finalize: start this one from a clean count.
        self._queued = self._steady = False
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        self.armed = True

    def _rebuild(self) -> None:
        """Adopt rank 0's observed ready order for the buckets (once; every rank takes part)."""
        seen = set(self._order)
        order = self._order + [i for bucket in self.plan() for i in bucket if i not in seen]
        self.rebuilt = True
        self._order = []
        message = torch.tensor(order + [self.guard.tag(2 ** 30)], dtype=torch.int64, device=self.control_device)
        sender = dist.get_global_rank(self.group, 0)
        own_tag = int(message[-1])
        work = dist.broadcast(message, sender, group=self.group, async_op=True)
        self.guard.wait_work(work, "the broadcast of the bucket order")
        self.guard.check_equal(int(message[-1]), own_tag, "the broadcast of the bucket order")
        self.rebuild_with_order(message[:-1].tolist())

    @torch.no_grad()
    def rebuild_with_order(self, order: list[int]) -> None:
        if plan_buckets(self.params, order, self.cap_bytes, self.first_cap_bytes) == self.plan():
            return
        self._build(order)
        if self.as_view:  # move existing gradients into the new buffers
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

    # -- join: a rank out of data mirrors the others' backward -----------------------------------

    @torch.no_grad()
    def shadow_backward(self, scratch: dict) -> None:
        """Issue the collectives of one synchronized backward with zero gradients."""
        if self._posted:
            self._shadow_posted()
        else:
            self._shadow_hooks(scratch)
        if self.tolerate_unused:
            self._used.zero_()
            self.guard.wait(dist.all_reduce(self._used, group=self.group, async_op=True).get_future(),
                            "the shadow all-reduce of the used-parameter map")
        if not self.rebuilt:
            self._ready[:] = self._no_ready
            self._rebuild()

    def _shadow_posted(self) -> None:
        comm = self.hook_state
        tickets = []
        for bucket in self.buckets:
            comm.claim(bucket.storage)
            bucket.storage.zero_()
            tickets.append(comm.post(bucket.storage))
        for bucket, ticket in zip(self.buckets, tickets):
            what = f"the shadow exchange of bucket {bucket.index}"
            if bucket.index not in self._splits:
                self._gather_posted(bucket, ticket, [], what)
                continue
            # This rank's chunk of the sum is still its job: its own terms are the zeros it posted.
            bounds = comm.chunk_bounds(bucket.numel, bucket.storage.element_size())
            lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
            self._split_exchange(bucket, ticket, what, 1.0, [(lo, bucket.storage[lo:hi])], [])

    def _shadow_hooks(self, scratch: dict) -> None:
        futures = []
        for bucket, facade in zip(self.buckets, self._facades):
            if self.allocator is not None:
                # Shared-memory buckets are reduced where they lie, so the peers read this rank's
                # zeros from the bucket itself; gradients that view it keep their values in a copy.
                if self.as_view:
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is view:
                            p.grad = view.clone()
                storage = bucket.storage
            else:
                storage = scratch.get(bucket.index)
                if storage is None or storage.numel() != bucket.storage.numel():
                    storage = scratch[bucket.index] = torch.zeros_like(bucket.storage)
            storage.zero_()
            shadow = GradBucket(bucket, facade.is_last(), storage=storage)
            futures.append(self.hook(self.hook_state, shadow))
        for index, future in enumerate(futures):
            self.guard.wait(future, f"the shadow all-reduce of bucket {index}")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

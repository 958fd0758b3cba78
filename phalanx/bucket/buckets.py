"""Gradient buckets: which parameter goes where, the flat buffers, the views into them, and the copies.

Parameters are packed in the order their gradients are expected (reverse registration order at
first, the observed order after one iteration), per (device, dtype), at most a size cap each, the
first bucket small so that communication starts early. Each bucket owns one flat tensor; every
parameter gets a view of it shaped like the parameter, plus one trailing slot for the step tag.
A bucket copies its gradients in (scaled) and the result back out; when it is launched is the
reducer's business (engine/reducer.py), how it is averaged the exchange's (exchange/).
"""

from __future__ import annotations

import itertools

import torch

FIRST_BUCKET_BYTES = 1024 * 1024  # as torch: a small first bucket starts the exchange early in backward


def plan_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                 first_cap_bytes: int = FIRST_BUCKET_BYTES, sparse: frozenset = frozenset()) -> list[list[int]]:
    """Group parameter indices into buckets, in launch order.

    Walks `order` (the order gradients are expected to become ready); each (device, dtype) keeps an
    open bucket that is closed when the next tensor would take it past its cap (a tensor bigger
    than the cap gets a bucket of its own). Each key's first bucket uses `first_cap_bytes`. A
    parameter in `sparse` (its gradient is a sparse tensor) gets a bucket of its own, as in torch:
    sparse tensors cannot share a flat buffer. Buckets are returned sorted by when their first
    gradient is expected.

    >>> ps = [torch.zeros(256 * 1024), torch.zeros(10), torch.zeros(10)]   # 1 MiB, 40 B, 40 B
    >>> plan_buckets(ps, order=[2, 1, 0], cap_bytes=25 * 2**20)
    [[2, 1], [0]]
    """
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict = {}  # (device, dtype) -> [indices, bytes, cap]
    closed: list[list[int]] = []
    for index in order:
        p = params[index]
        if index in sparse:
            closed.append([index])
            continue
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        current = open_buckets.get(key)
        if current is None:
            current = open_buckets[key] = [[], 0, first_cap_bytes]
        elif current[0] and current[1] + nbytes > current[2]:
            closed.append(current[0])
            current = open_buckets[key] = [[], 0, cap_bytes]
        current[0].append(index)
        current[1] += nbytes
    closed.extend(entry[0] for entry in open_buckets.values() if entry[0])
    closed.sort(key=lambda bucket: position[bucket[0]])
    return closed


def sparse_indices(module: torch.nn.Module, named: list) -> frozenset:
    """Which of the `named` parameters get sparse gradients (torch's embeddings with sparse=True)."""
    sparse = {id(sub.weight) for sub in module.modules()
              if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse}
    return frozenset(i for i, (_, p) in enumerate(named) if id(p) in sparse)


# A bucket whose tensors average this many elements (64 KB of fp32) or more holds "large tensors":
# a call per tensor is cheap against its bytes. Below, batched calls over the flat buffer win.
LARGE_TENSOR_NUMEL = 16384


class Bucket:
    """One flat gradient buffer and the parameters packed into it.

    `storage` is the whole flat tensor (from the exchange's allocator): the gradients (`buffer`,
    what comm hooks see) followed by one slot for the step tag. `views[k]` is parameter k's gradient
    inside `buffer`. With `as_view` (gradient_as_bucket_view) the views become the gradients.
    A `sparse` bucket holds one parameter whose gradient is a sparse tensor: it has no storage, and
    the exchange carries the gradient itself.
    """

    __slots__ = ("index", "indices", "params", "storage", "buffer", "tag_slot", "views", "offsets", "numel",
                 "pending", "large_tensors", "as_view", "sparse")

    def __init__(self, index: int, indices: list[int], params: list[torch.Tensor], storage: torch.Tensor | None,
                 as_view: bool = False):
        self.index = index
        self.indices = indices
        self.params = [params[i] for i in indices]
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        self.offsets = list(itertools.accumulate(sizes[:-1], initial=0))  # of each gradient in the buffer
        self.pending = len(self.params)
        self.sparse = storage is None
        if self.sparse:
            self.storage = self.buffer = self.tag_slot = None
            self.views, self.large_tensors, self.as_view = [], False, False
            return
        self.storage = storage
        self.buffer = storage[:self.numel]
        self.tag_slot = storage[self.numel:self.numel + 1]
        self.views = [piece.view(p.shape) for piece, p in zip(self.buffer.split(sizes), self.params)]
        self.large_tensors = self.numel >= LARGE_TENSOR_NUMEL * len(self.params)
        self.as_view = as_view

    @staticmethod
    def storage_numel(indices: list[int], params: list[torch.Tensor]) -> int:
        """How many elements a bucket of these parameters needs: their gradients and the step tag."""
        return sum(params[i].numel() for i in indices) + 1

    # -- copy in ----------------------------------------------------------------------------------

    @torch.no_grad()
    def fill_(self, scale: float | None) -> None:
        """This rank's gradients into the buffer, times `scale` (None: as they are); missing ones are zeros."""
        if self.as_view:
            self._fill_views(scale)
            return
        grads = [p.grad for p in self.params]
        if all(grad is not None for grad in grads):
            self._copy_in(grads, self.views, scale)
            return
        for grad, view in zip(grads, self.views):  # some parameters are unused here: they add zeros
            view.zero_() if grad is None else view.copy_(grad)
        if scale is not None:
            self.buffer.mul_(scale)

    def _fill_views(self, scale: float | None) -> None:
        """gradient_as_bucket_view: gradients accumulated in place stay; new ones move into the bucket."""
        new_grads, new_views, new_params, in_place = [], [], [], []
        for p, view in zip(self.params, self.views):
            grad = p.grad
            if grad is view:  # accumulated in place into the bucket: nothing to copy
                in_place.append(view)
            elif grad is None:
                view.zero_()
            else:
                new_grads.append(grad)
                new_views.append(view)
                new_params.append(p)
        if len(new_grads) == len(self.params):  # after zero_grad(set_to_none=True): the usual case
            self._copy_in(new_grads, new_views, scale)
        elif len(in_place) == len(self.params):  # after zero_grad(set_to_none=False)
            if scale is not None:
                self.buffer.mul_(scale)
        else:
            for grad, view in zip(new_grads, new_views):
                view.copy_(grad) if scale is None else torch.mul(grad, scale, out=view)
            if scale is not None and in_place:  # _foreach_ ops refuse an empty list
                torch._foreach_mul_(in_place, scale)
        for p, view in zip(new_params, new_views):
            p.grad = view

    def _copy_in(self, grads: list, views: list, scale: float | None) -> None:
        """Every gradient into its view, times `scale`, in the cheapest way for the bucket's shape."""
        if scale is None:
            torch._foreach_copy_(views, grads)
        elif self.large_tensors:  # one pass each
            for grad, view in zip(grads, views):
                torch.mul(grad, scale, out=view)
        else:  # many small tensors: per-tensor calls cost more than a second pass over the flat buffer
            torch._foreach_copy_(views, grads)
            self.buffer.mul_(scale)

    # -- copy out ---------------------------------------------------------------------------------

    @torch.no_grad()
    def write_back(self, used: list[int] | None) -> None:
        """The averaged buffer into each parameter's .grad; with `used` (per parameter index, how many
        ranks gave it a gradient) a parameter unused on every rank keeps its .grad (None stays None)."""
        if not self.as_view and used is None:
            torch._foreach_copy_([p.grad for p in self.params], self.views)
            return
        for i, p, view in zip(self.indices, self.params, self.views):
            if used is not None and not used[i]:
                continue
            if self.as_view:
                if p.grad is not view:
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def sparse_gradient(self, zeros: bool = False) -> torch.Tensor:
        """A sparse bucket's gradient on this rank: an empty sparse tensor where the parameter got none
        (or with `zeros`, as join's shadow sends)."""
        p = self.params[0]
        if p.grad is not None and not zeros:
            return p.grad
        return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                       torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device),
                                       p.shape, check_invariants=False)

    def detach_gradient_views(self) -> None:
        """Give gradients that view this bucket a storage of their own, before the bucket is rewritten
        with something else than them (join's shadow) or dropped (a rebuild)."""
        for p, view in zip(self.params, self.views):
            if p.grad is view:
                p.grad = view.clone()


class GradBucket:
    """What a comm hook receives: torch's `dist.GradBucket` interface over a phalanx bucket.

    >>> def my_hook(process_group, bucket):                      # doctest: +SKIP
    ...     tensor = bucket.buffer().div_(process_group.size())
    ...     return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
    """

    def __init__(self, bucket: Bucket, is_last: bool):
        self._bucket = bucket
        self._is_last = is_last
        self._buffer = bucket.sparse_gradient() if bucket.sparse else bucket.buffer

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (a hook may modify it in place)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """One tensor per parameter, shaped like it, viewing buffer()."""
        if self._bucket.sparse:
            return [self._buffer]
        sizes = [p.numel() for p in self._bucket.params]
        return [piece.view(p.shape) for piece, p in zip(self._buffer.split(sizes), self._bucket.params)]

    get_per_parameter_tensors = gradients

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last

"""Gradient buckets: which parameter goes where, the flat buffers, and the views into them.

Parameters are packed in the order their gradients are expected (reverse registration order at
first, the observed order after one iteration), per (device, dtype), at most a size cap each, the
first bucket small so that communication starts early. Each bucket owns one flat tensor; every
parameter gets a view of it shaped like the parameter, plus one trailing slot for the step tag.
The engine that fills and launches buckets is in reducer.py.
"""

from __future__ import annotations

import itertools

import torch

FIRST_BUCKET_BYTES = 1024 * 1024  # as torch: a small first bucket starts the exchange early in backward


def plan_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                 first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group parameter indices into buckets, in launch order.

    Walks `order` (the order gradients are expected to become ready); each (device, dtype) keeps an
    open bucket that is closed when the next tensor would take it past its cap (a tensor bigger
    than the cap gets a bucket of its own). Each key's first bucket uses `first_cap_bytes`.
    Buckets are returned sorted by when their first gradient is expected.

    >>> ps = [torch.zeros(256 * 1024), torch.zeros(10), torch.zeros(10)]   # 1 MiB, 40 B, 40 B
    >>> plan_buckets(ps, order=[2, 1, 0], cap_bytes=25 * 2**20)
    [[2, 1], [0]]
    """
    position = {index: pos for pos, index in enumerate(order)}
    open_buckets: dict = {}  # (device, dtype) -> [indices, bytes, cap]
    closed: list[list[int]] = []
    for index in order:
        p = params[index]
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


class Bucket:
    """One flat gradient buffer and the parameters packed into it.

    `storage` is the whole flat tensor: the gradients (`buffer`, what comm hooks see) followed by
    one slot for the step tag. `views[k]` is parameter k's gradient inside `buffer`.
    """

    __slots__ = ("index", "indices", "params", "storage", "buffer", "tag_slot", "views", "offsets", "numel",
                 "pending", "fused_scale")

    def __init__(self, index: int, indices: list[int], params: list[torch.Tensor], allocator=None):
        self.index = index
        self.indices = indices
        self.params = [params[i] for i in indices]
        first = self.params[0]
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        self.offsets = list(itertools.accumulate(sizes[:-1], initial=0))  # of each gradient in the buffer
        if allocator is not None:  # e.g. shared memory, so the transport reduces the bucket where it lies
            self.storage = allocator.alloc(self.numel + 1, first.dtype)
        else:
            self.storage = torch.zeros(self.numel + 1, dtype=first.dtype, device=first.device)
        self.buffer = self.storage[:self.numel]
        self.tag_slot = self.storage[self.numel:]
        self.views = [piece.view(p.shape) for piece, p in zip(self.buffer.split(sizes), self.params)]
        self.pending = len(self.params)
        # Few large tensors: scale while copying (one pass); many small ones: copy all, then scale.
        self.fused_scale = self.numel >= 16384 * len(self.params)


class GradBucket:
    """What a comm hook receives: torch's `dist.GradBucket` interface over a phalanx bucket.

    >>> def my_hook(process_group, bucket):                      # doctest: +SKIP
    ...     tensor = bucket.buffer().div_(process_group.size())
    ...     return dist.all_reduce(tensor, group=process_group, async_op=True).get_future()
    """

    def __init__(self, bucket: Bucket, is_last: bool, storage: torch.Tensor | None = None):
        self._bucket = bucket
        self._is_last = is_last
        self._storage = bucket.storage if storage is None else storage
        self._buffer = self._storage[:bucket.numel]
        self._work = None

    def set_work(self, work) -> None:
        """For prescaled hooks that reduce storage() in place: the engine may wait on this Work (a
        timed wait in C++) instead of the returned future."""
        self._work = work

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (a hook may modify it in place)."""
        return self._buffer

    def storage(self) -> torch.Tensor:
        """buffer() plus the trailing step-tag slot: what phalanx's own prescaled hooks sum."""
        return self._storage

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """One tensor per parameter, shaped like it, viewing buffer()."""
        sizes = [p.numel() for p in self._bucket.params]
        return [piece.view(p.shape) for piece, p in zip(self._buffer.split(sizes), self._bucket.params)]

    get_per_parameter_tensors = gradients

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last

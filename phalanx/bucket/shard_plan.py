"""Which part of every bucket each rank owns when optimizer state (and gradients) are sharded.

A bucket of n gradients is cut into world_size equal chunks of c elements (c a multiple of 16, so
every chunk starts on a cache line; the last chunks may hold only padding). Rank r owns elements
[r*c, (r+1)*c) of every bucket: it receives their average in backward, holds the optimizer state
for them, updates them in the step and sends them to the other ranks afterwards. Chunks cut
through parameters, not between them, so every rank owns the same number of elements.

A `Piece` is the part of one parameter inside the owned chunk: a view of the parameter that the
optimizer updates in place (shaped like it when whole, else flat), with the owned gradient as its
`.grad`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .buckets import Bucket

CHUNK_ALIGN = 16  # elements: 64 bytes of fp32, one cache line


@dataclass
class Piece:
    """Elements [start, stop) of the flattened parameter `index` (of the DDP's parameters), which lie at
    [offset, offset + stop - start) of the owned chunk. `tensor` views the parameter there."""

    index: int
    start: int
    stop: int
    offset: int
    tensor: torch.Tensor
    whole: bool  # the whole parameter: `tensor` has its shape (else a flat slice of it)

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class BucketShard:
    """One bucket's cut: its chunk size, which chunk is this rank's, and the pieces in it."""

    bucket: int
    numel: int  # the bucket's gradients (without the step tag)
    chunk: int  # elements per rank
    rank: int
    world_size: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def padded(self) -> int:
        """Elements of the storage the exchange needs: world_size chunks (it holds the step tag too)."""
        return self.chunk * self.world_size

    @property
    def start(self) -> int:
        return self.rank * self.chunk

    def owner_of(self, element: int) -> int:
        return element // self.chunk


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per rank for a bucket of `numel` gradients plus its step tag.

    >>> chunk_size(100, 2), chunk_size(100, 3), chunk_size(1, 4)
    (64, 48, 16)
    """
    per_rank = -(-(numel + 1) // world_size)
    return -(-per_rank // CHUNK_ALIGN) * CHUNK_ALIGN


def cut_bucket(bucket: Bucket, rank: int, world_size: int) -> BucketShard:
    """The pieces of `bucket`'s parameters that fall in rank `rank`'s chunk."""
    shard = BucketShard(bucket.index, bucket.numel, chunk_size(bucket.numel, world_size), rank, world_size)
    lo, hi = shard.start, shard.start + shard.chunk
    for index, param, offset in zip(bucket.indices, bucket.params, bucket.offsets):
        first, last = max(lo, offset), min(hi, offset + param.numel())
        if first < last:
            whole = first == offset and last == offset + param.numel()  # keeps the parameter's shape
            tensor = param.detach() if whole else param.detach().view(-1)[first - offset:last - offset]
            shard.pieces.append(Piece(index, first - offset, last - offset, first - lo, tensor, whole))
    return shard


def pieces_of(shards: list[BucketShard]) -> list[Piece]:
    return [piece for shard in shards for piece in shard.pieces]

"""This rank's gradients into one shared-memory bucket, in one kernel call at launch.

A posted bucket takes every gradient whole; a split one only the parts that other ranks sum (its
own chunk is read from the gradient itself). Either way each gradient is a few (bucket offset,
gradient offset, count) segments, fixed for the bucket plan, so a launch only looks up where the
gradients are this step and hands the kernel one list: a Python loop per gradient costs more than
the copy of a small one. Missing gradients become zeros, and what the kernel cannot read (a
non-contiguous gradient) goes through torch, with the same bits.

Measured and not kept (docs/benchmarks.md, "Choices of the exchange"): copying each large gradient
as it arrives, while it is still in the cache, instead of at launch.
"""

from __future__ import annotations

import torch

from ..bucket.buckets import Bucket
from ..shm.reduce import copy_pieces


def gradient_addresses(params: list[torch.nn.Parameter]) -> list[int] | None:
    """Where each parameter's gradient is, in the usual step: every one there and contiguous (else None)."""
    grads = [p.grad for p in params]
    if all(grad is not None and grad.is_contiguous() for grad in grads):
        return [grad.data_ptr() for grad in grads]
    return None


class BucketCopyIn:
    """`segments[k]`: gradient k's (bucket element offset, gradient element offset, count) pieces."""

    __slots__ = ("bucket", "segments", "stream", "whole", "template")

    def __init__(self, bucket: Bucket, segments: list[list[tuple[int, int, int]]], stream: bool):
        self.bucket = bucket
        self.segments = segments
        self.stream = stream  # streaming stores (shm/reduce.py)
        base, size = bucket.buffer.data_ptr(), bucket.storage.element_size()
        # Every gradient whole (a posted bucket): a template of (destination, source, count) triples
        # whose sources are this step's gradient addresses.
        self.whole = all(parts == [(start, 0, p.numel())] for parts, start, p in
                         zip(segments, bucket.offsets, bucket.params))
        self.template = [value for parts in segments for start, _, count in parts
                         for value in (base + start * size, 0, count)]

    @classmethod
    def whole_gradients(cls, bucket: Bucket, stream: bool) -> BucketCopyIn:
        """Every gradient whole, at its place in the bucket (a posted bucket, Gloo's all-reduce)."""
        return cls(bucket, [[(start, 0, p.numel())] for start, p in zip(bucket.offsets, bucket.params)], stream)

    def copy(self, scale: float | None, check: bool = False) -> bool | None:
        """The gradients' segments into the bucket, times `scale` (None: as they are). With `check`, returns
        whether every element copied was finite (the non-finite gradient check, on the way)."""
        bucket = self.bucket
        dtype = bucket.storage.dtype
        addresses = gradient_addresses(bucket.params) if self.whole else None
        if addresses is not None:
            self.template[1::3] = addresses
            return copy_pieces(self.template, dtype, scale, self.stream, check)
        finite = True
        grads = [p.grad for p in bucket.params]
        batch, base, size, buffer = [], bucket.buffer.data_ptr(), bucket.storage.element_size(), bucket.buffer
        for grad, segments in zip(grads, self.segments):
            if grad is not None and grad.is_contiguous():
                address = grad.data_ptr()
                for start, offset, count in segments:
                    batch += (base + start * size, address + offset * size, count)
                continue
            for start, offset, count in segments:  # missing here: zeros; strided: torch copies it
                out = buffer[start:start + count]
                if grad is None:
                    out.zero_()
                else:
                    piece = grad.reshape(-1)[offset:offset + count]
                    out.copy_(piece) if scale is None else torch.mul(piece, scale, out=out)
                    if check:
                        finite = finite and bool(torch.isfinite(out.sum()))
        if batch:
            said = copy_pieces(batch, dtype, scale, self.stream, check)
            finite = None if said is None else said and finite
        return finite if check else None

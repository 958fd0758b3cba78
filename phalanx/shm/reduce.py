"""The arithmetic of one shared-memory exchange: which rank reduces which chunk, and the reduction.

Chunks start on cache lines, so two ranks never write into one line. float32 and float64 chunks
are reduced by a small C kernel (_reduce_kernels.c, built at install) in one pass; other dtypes,
or an install without a C compiler, use torch ops in blocks small enough for L2, with the same
operations in the same order, so the same bits. The kernel also copies and sums many pieces in one
call (`copy_pieces`, `sum_pieces`): a gradient per piece costs no Python call of its own.
"""

from __future__ import annotations

import torch

try:
    from ._reduce_kernels import copy_segments as _copy_segments
    from ._reduce_kernels import reduce_into_all as _kernel
    from ._reduce_kernels import sum_own_chunk  # the split exchange (shm.py) needs it; None: not offered
    from ._reduce_kernels import sum_segments as _sum_segments
except ImportError:  # built without a C compiler: the torch ops below give the same result, slower
    _kernel = sum_own_chunk = _copy_segments = _sum_segments = None
# Whether the copies can say if what they read was finite (check=True); a kernel built before they could (a
# checkout not rebuilt) cannot, and its callers then check in another way.
KERNEL_CHECKS = _copy_segments is not None and "check" in (_copy_segments.__doc__ or "")

# The wire code of each dtype we reduce; it is also compared across ranks before every exchange.
DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int64: 5,
               torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9}
WIDENED = (torch.float16, torch.bfloat16)  # summed in fp32: n half-precision gradients can overflow
KERNEL_DTYPES = {torch.float32: 1, torch.float64: 2}
ALIGN_BYTES = 64
BLOCK_BYTES = 256 << 10  # measured: 256 KB beat 1 MB and 4 MB by ~10-20% on a 2 MB-L2 core
# An exchange of a bucket this large writes its results with streaming stores: its bytes (every
# rank's copy, and the gradients) outgrow the cache anyway, and skipping the read of each line
# before it is written saves a third of a copy's traffic. Below it, results stay in the cache for
# the next reader (measured in docs/benchmarks.md, "Choices of the exchange").
STREAM_MIN_BYTES = 8 << 20


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def chunk_bounds(numel: int, element_size: int, parts: int) -> list[int]:
    """Borders of `parts` near-equal chunks, on cache-line boundaries."""
    align = max(1, ALIGN_BYTES // element_size)
    return [min(numel, round_up(numel * j // parts, align)) for j in range(parts)] + [numel]


def reduce_chunk(parts: list[torch.Tensor], average: bool, scratch: torch.Tensor | None) -> None:
    """Sum `parts` (rank order), divide if averaging, and write the result into every part.

    `scratch` (float32) is where half-precision parts are summed; None sums in the parts' dtype.
    """
    dtype = parts[0].dtype
    if _kernel is not None and dtype in KERNEL_DTYPES and len(parts) > 1:
        _kernel(tuple(part.data_ptr() for part in parts), parts[0].numel(), KERNEL_DTYPES[dtype],
                1.0 / len(parts), average)
        return
    reduce_chunk_with_torch(parts, average, scratch)


def kernel_available() -> bool:
    """Whether the compiled reduction kernel was built (see setup.py)."""
    return _kernel is not None


def kernel_serves(dtype: torch.dtype) -> bool:
    """Whether copy_pieces() and sum_pieces() can work on tensors of `dtype` here."""
    return _kernel is not None and dtype in KERNEL_DTYPES


def streams(exchanged: torch.Tensor) -> bool:
    """Whether the exchange of `exchanged` (a bucket, or every rank's copy of it) writes with streaming
    stores (see STREAM_MIN_BYTES)."""
    return exchanged.numel() * exchanged.element_size() >= STREAM_MIN_BYTES


def copy_pieces(segments: list[int], dtype: torch.dtype, scale: float | None, stream: bool,
                check: bool = False) -> bool | None:
    """For each (destination address, source address, count) triple, flattened in `segments`: the
    source's `count` elements of `dtype` (times `scale`, unless None) into the destination, in one
    call. Needs kernel_serves(dtype); every address must be valid for its count. With `check`, returns
    whether every source element was finite (found on the way, at no extra pass over memory); None where the
    kernel cannot say (KERNEL_CHECKS)."""
    code, factor, multiply = KERNEL_DTYPES[dtype], 1.0 if scale is None else scale, scale is not None
    if check and KERNEL_CHECKS:
        return _copy_segments(segments, code, factor, multiply, stream, True)
    _copy_segments(segments, code, factor, multiply, stream)
    return None


def sum_pieces(parts: tuple[int, ...], segments: list[int], dtype: torch.dtype, stream: bool) -> None:
    """For each (destination address, element offset, count) triple in `segments`: the rank-order sum
    of parts[j][offset:offset + count] over the arrays at addresses `parts` into the destination."""
    _sum_segments(parts, segments, KERNEL_DTYPES[dtype], stream)


def reduce_chunk_with_torch(parts: list[torch.Tensor], average: bool, scratch: torch.Tensor | None) -> None:
    """reduce_chunk() with torch ops only."""
    block = max(1, BLOCK_BYTES // parts[0].element_size())
    if scratch is not None:
        block = min(block, scratch.numel())
    for start in range(0, parts[0].numel(), block):
        views = [part[start:start + block] for part in parts]
        if scratch is None:  # sum straight into the first part, then copy it to the others
            total = views[0]
            torch.add(views[0], views[1], out=total)
            for view in views[2:]:
                total.add_(view)
            targets = views[1:]
        else:
            total = scratch[:views[0].numel()]
            total.copy_(views[0])
            for view in views[1:]:  # added in fp32: the scratch's dtype wins the promotion
                total.add_(view)
            targets = views
        if average:
            # Multiply by 1/n: exact for n a power of two, within an ulp otherwise, and 2.5x faster
            # than a vector division (which would cost a quarter of the whole exchange).
            total.mul_(1.0 / len(parts))
        for target in targets:
            target.copy_(total)

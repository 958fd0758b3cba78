"""Communication hooks: how a bucket of gradients is averaged across ranks.

A hook is `hook(state, bucket) -> torch.futures.Future[Tensor]` with the bucket's averaged
gradients as the result, exactly torch's contract, so these work on phalanx DDP and torch DDP
alike. Register one with `model.register_comm_hook(process_group, hook)`; state None means the
model's process group.
"""

import torch
import torch.distributed as dist

# Annotations are evaluated (no `from __future__ import annotations`): torch DDP's register_comm_hook
# accepts a return annotation only if it is the object torch.futures.Future[torch.Tensor].

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "prescaled"]


def prescaled(hook):
    """Mark a hook that only sums `bucket.storage()`: phalanx scales gradients by 1/world size while
    copying them into the bucket and writes the step tag into the slot after them (see reducer.py).
    """
    hook._phalanx_prescaled = True
    return hook


@prescaled
def sum_prescaled_hook(process_group, bucket):
    """phalanx's default: one all-reduce (sum) of gradients already divided by the world size."""
    work = dist.all_reduce(bucket.storage(), group=process_group, async_op=True)
    bucket.set_work(work)
    return work.get_future()


def _group(process_group):
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket by all-reduce: the same result as running without a hook.

    >>> model.register_comm_hook(None, phalanx.hooks.allreduce_hook)   # doctest: +SKIP
    """
    group = _group(process_group)
    tensor = bucket.buffer()
    # Divide before summing: the sum of world_size gradients could overflow in half precision.
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compressed_allreduce(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut):
        # Write back into the bucket's own buffer: no second full-precision allocation.
        return buffer.copy_(fut.value()[0])

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Send gradients as float16 (half the bytes), averaged, and write them back in full precision.

    >>> model.register_comm_hook(None, phalanx.hooks.fp16_compress_hook)   # doctest: +SKIP
    """
    return _compressed_allreduce(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """Send gradients as bfloat16 (float32's range, half the bytes), averaged, written back in full.

    >>> model.register_comm_hook(None, phalanx.hooks.bf16_compress_hook)   # doctest: +SKIP
    """
    return _compressed_allreduce(torch.bfloat16, process_group, bucket)

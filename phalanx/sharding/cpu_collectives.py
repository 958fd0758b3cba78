"""FSDP2 on the CPU holding fewer whole blocks at once (`shard="parameters"` over Gloo).

On the CPU, Gloo's collectives block the one thread that also computes, so FSDP2's overlap has
nothing to overlap, and what it keeps for it is only memory held in backward:
- its backward prefetch gathers the next block while this one's gradient is computed: off here, each
  block is gathered when its backward starts (the same collectives, in the same order);
- its reduce-scatter input is kept until the next block's (a GPU stream may still read it), and
  Gloo's reduce-scatter all-reduces a copy of that input and keeps one chunk: here the all-reduce
  runs on the input itself, which FSDP2 reads no more, and the input is freed as it returns.
That is two whole blocks fewer alive at once in backward (the peak RSS moves only where the allocator
hands freed memory back soon: docs/benchmarks.md, issue 38). Both give the same bits as torch's
defaults (tests/ranks/test_sharding_cpu_collectives.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:  # torch >= 2.8: FSDP2's hooks for custom collectives
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - older torch keeps its defaults
    ReduceScatter = object


class InPlaceReduceScatter(ReduceScatter):
    """Gloo's reduce-scatter (an all-reduce, then this rank's chunk) done on FSDP2's input in place: no copy of
    the input, which is freed once reduced."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        world_size = group.size()
        average = op == dist.ReduceOp.AVG  # Gloo's all-reduce has no AVG; its reduce-scatter sums, then divides
        dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM if average else op, group=group)
        chunk = input_tensor.view(world_size, -1)[dist.get_rank(group)]
        if average:
            torch.div(chunk, world_size, out=output_tensor)
        else:
            output_tensor.copy_(chunk)
        input_tensor.untyped_storage().resize_(0)  # FSDP2 would keep it until the next block's reduce-scatter
        return None  # done: nothing for FSDP2 to wait for


def hold_less(modules: list, device: torch.device, group) -> None:
    """On modules passed to fully_shard on the CPU over Gloo: no backward prefetch, and the in-place
    reduce-scatter. Elsewhere (GPUs, other backends, a torch without the hooks) torch's defaults stay."""
    if device.type != "cpu" or "gloo" not in str(dist.get_backend(group)) or ReduceScatter is object:
        return
    for module in modules:
        if not hasattr(module, "set_custom_reduce_scatter"):
            return
    for module in modules:
        # A module that prefetches only itself (already gathered when its backward starts) prefetches nothing.
        module.set_modules_to_backward_prefetch([module])
        module.set_custom_reduce_scatter(InPlaceReduceScatter())

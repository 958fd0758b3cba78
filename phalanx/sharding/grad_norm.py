"""`clip_grad_norm_` for sharded gradients: each rank holds its chunks' average, the norm is the model's.

Each rank sums |g|^p over its pieces (or takes the max, for the inf-norm); one all-reduce of that
single number gives every rank the norm of the whole averaged gradient, the one torch's
clip_grad_norm_ computes on an unsharded model, and every rank scales its pieces by the same factor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..exchange.sharded import ShardedExchange
from ..world import generation


@torch.no_grad()
def clip_sharded_grad_norm_(exchange: ShardedExchange, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = False) -> torch.Tensor:
    """Collective: scale the sharded gradients so their global `norm_type`-norm is at most `max_norm`;
    returns the norm before clipping (a 0-dim float32 tensor, the same on every rank). A rank lost during its
    all-reduce under live recovery: the step is redone on the ranks left, and the norm returned is NaN."""
    exchange.wait_gathered()
    grads = [piece.tensor.grad for shard in exchange.shards for piece in shard.pieces
             if piece.tensor.grad is not None]
    norm_type = float(norm_type)
    device = exchange.buckets[0].storage.device if exchange.buckets else torch.device("cpu")
    infinite = math.isinf(norm_type)
    local = torch.zeros(1, dtype=torch.float64, device=device)
    if grads:
        norms = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(grads, norm_type)])
        local[0] = norms.max() if infinite else norms.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    work = dist.all_reduce(local, op=op, group=exchange.group, async_op=True)
    try:
        exchange.guard.wait_work(work, "the all-reduce of the gradient norm")
    except Exception as lost:
        if not (generation.is_loss(lost) and generation.recovers_in_process()):
            raise
        # Live recovery: nothing of the step is applied yet. The ranks left regroup and the loader hands the
        # step out again (step.undone on this one); the optimizer step that follows finds no gradient.
        generation.fail_step()
        generation.recover(lost, redoing=True, undone=True)
        return torch.tensor(float("nan"))
    total = (local[0] if infinite else local[0].pow(1.0 / norm_type)).to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))
    return total

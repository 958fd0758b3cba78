"""Metrics that are right across ranks: all-reduced sum / mean / max / min and a sample-weighted mean.

A mean over ranks whose shards or last batches differ in size must weight each rank by its sample
count: `Mean` keeps a local (sum, count) and reduces both in one collective, so it equals the mean
one process computes over the whole dataset. `gather_in_order` brings per-sample predictions back
into dataset order and drops the duplicates a padded sampler adds. Without a world, all are local. The
default group is the ranks that train: the world, or after a loss the ranks left (live recovery).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import DataConfigError, explain
from ..world import generation
from ..world.group import collective_device, group_size, live_group
from .sampler import DistributedSampler


def _all_reduce(value, op, group):
    """All-reduce a number or tensor; returns the same kind (a Python number for a number)."""
    is_number = not isinstance(value, torch.Tensor)
    tensor = torch.as_tensor(value, dtype=torch.float64 if isinstance(value, float) else None)
    if group_size(group) > 1:
        def reduce(ranks):
            result = tensor.detach().to(collective_device(ranks), copy=True)
            generation.wait_for(dist.all_reduce(result, op=op, group=ranks, async_op=True), "a metric's all-reduce")
            return result
        tensor = _on_the_ranks(reduce, group, tensor).to(tensor.device)
    return tensor.item() if is_number else tensor


def _on_the_ranks(collective, group, like: torch.Tensor):
    """`collective(group)`, by default on the ranks that train; `like`: a tensor shaped as its result. With live
    recovery, a peer lost before it ends regroups the ranks left (the model and loader too), which run it again: the
    value then covers them only. When it had ended on some of them, the others take that value (it covers the lost
    rank too): every rank goes on with the same one."""
    if group is not None:
        return collective(group)
    return generation.again_after_loss(lambda: collective(live_group()),
                                       "a rank was lost during a metric's collective: its value covers the {left} "
                                       "ranks left", "a metric's collective", like)


def all_reduce_sum(value, group=None):
    """The sum of `value` (number or tensor, elementwise) over all ranks; a collective.

    >>> all_reduce_sum(3)          # alone: the value itself
    3
    """
    return _all_reduce(value, dist.ReduceOp.SUM, group)


def all_reduce_max(value, group=None):
    """The largest `value` over all ranks (elementwise for tensors); a collective."""
    return _all_reduce(value, dist.ReduceOp.MAX, group)


def all_reduce_min(value, group=None):
    """The smallest `value` over all ranks (elementwise for tensors); a collective."""
    return _all_reduce(value, dist.ReduceOp.MIN, group)


def all_reduce_mean(value, group=None):
    """The mean of `value` over ranks, each rank weighing the same; for a per-sample mean use `Mean`.

    >>> all_reduce_mean(torch.tensor([1.0, 3.0]))
    tensor([1., 3.])
    """
    if not isinstance(value, torch.Tensor):
        value = float(value)
    elif not value.is_floating_point():
        value = value.double()
    return all_reduce_sum(value, group) / group_size(group)


def weighted_mean(total, count, group=None) -> float:
    """sum(total) / sum(count) over all ranks, both reduced in one collective; NaN when no rank counted any.

    >>> weighted_mean(total=6.0, count=3)
    2.0
    """
    pair = torch.stack([torch.as_tensor(total, dtype=torch.float64).detach().cpu().reshape(()),
                        torch.as_tensor(count, dtype=torch.float64).detach().cpu().reshape(())])
    pair = all_reduce_sum(pair, group)
    summed, counted = pair.tolist()
    return summed / counted if counted else float("nan")


class Mean:
    """Running mean over the samples of all ranks: `update()` per batch, `compute()` (a collective) at the end.

    `update(values)` with a tensor of per-sample values adds each; `update(batch_mean, weight=n)`
    adds a mean over n samples. The result weighs every sample once, however the samples were
    spread over ranks and batches.

    >>> loss = Mean()
    >>> loss.update(2.0, weight=3); loss.update(torch.tensor([4.0]))
    >>> loss.compute()
    2.5
    """

    def __init__(self, group=None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        """Forget every update (start a new epoch of accumulation)."""
        self.total = 0.0
        self.count = 0.0

    def update(self, value, weight=None) -> None:
        """Add per-sample values (tensor, weight=None), or a value that is the mean of `weight` samples."""
        # float64 from the start: a Python float must not pass through torch's float32 default
        value = torch.as_tensor(value, dtype=torch.float64).detach()
        if weight is None:
            weight = torch.ones_like(value)
        weight = torch.as_tensor(weight, dtype=torch.float64, device=value.device).detach().expand_as(value)
        # Sums stay on the value's device: no host sync per batch, one transfer in compute().
        self.total = self.total + (value * weight).sum()
        self.count = self.count + weight.sum()

    def compute(self) -> float:
        """The weighted mean over every rank's updates (NaN if there were none anywhere)."""
        return weighted_mean(self.total, self.count, self.group)


def gather_in_order(local, sampler: DistributedSampler, group=None):
    """Collect every rank's per-sample results into dataset order, each index once; a collective.

    `local` holds this rank's results for the whole current epoch of `sampler`, in the order it
    yielded the indices (a tensor with one row per sample, or a list). Row i of the result belongs to
    dataset index i; padding duplicates (pad=True) are dropped. With drop_last=True the dropped
    indices are absent and the rows follow the ascending order of the indices kept.

    >>> sampler = DistributedSampler(range(5), num_replicas=1, rank=0, seed=1)
    >>> preds = torch.tensor([10 * i for i in sampler])
    >>> gather_in_order(preds, sampler)
    tensor([ 0, 10, 20, 30, 40])
    """
    replicas = sampler.num_replicas
    if len(local) != len(sampler):
        raise DataConfigError(explain(
            "gather_in_order got a different number of results than the sampler's shard", rank=sampler.rank,
            seen=f"len(local)={len(local)}", expected=f"len(sampler)={len(sampler)} (one per index of the epoch)",
            fix="Pass this rank's results for the whole epoch, in the order the sampler yielded the indices."))
    if group_size(group) != replicas:
        raise DataConfigError(explain(
            "gather_in_order's sampler was made for another number of ranks", rank=sampler.rank,
            seen=f"sampler.num_replicas={replicas}", expected=f"the group's size {group_size(group)}",
            fix="Use the evaluation sampler built for this world (num_replicas=None takes it from the world)."))
    order = sampler.global_order()
    kept = min(len(sampler.dataset), len(order))  # entries past the dataset length are padding
    if isinstance(local, torch.Tensor):
        by_position = _gather_tensor_rows(local, replicas, len(order), group)[:kept]
        result = by_position.new_empty((len(sampler.dataset), *by_position.shape[1:]))
        result[order[:kept].to(result.device)] = by_position
        if kept < len(sampler.dataset):
            result = result[order[:kept].sort().values.to(result.device)]
        return result
    pieces = [list(local)] * replicas
    if replicas > 1:
        pieces = generation.all_gather_objects(list(local), group if group is not None else live_group(),
                                               "gather_in_order's lists")
    by_position = [pieces[p % replicas][p // replicas] for p in range(kept)]
    pairs = sorted(zip(order[:kept].tolist(), by_position), key=lambda pair: pair[0])
    return [value for _, value in pairs]


def _gather_tensor_rows(local: torch.Tensor, replicas: int, positions: int, group) -> torch.Tensor:
    """Rows of all ranks arranged by global position: position p is row p // replicas of rank p % replicas."""
    if replicas == 1:
        return local
    longest = -(-positions // replicas)  # rank 0's shard is never shorter than another's
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[:len(local)] = local
    device = collective_device(group)
    padded = padded.to(device)
    pieces = [torch.empty_like(padded) for _ in range(replicas)]
    dist.all_gather(pieces, padded, group=group if group is not None else live_group())
    # stack(dim=1)[j, r] is row j of rank r, i.e. global position j * replicas + r
    return torch.stack(pieces, dim=1).reshape(longest * replicas, *local.shape[1:])[:positions].to(local.device)

"""Batch normalization over the whole process group's batch, on CPU (Gloo) and GPU (NCCL) alike.

Forward gathers each rank's per-channel (count, mean, M2) in one collective and merges them in rank
order, so every rank normalizes with the same statistics whatever its batch size (an empty batch
counts 0). Backward all-reduces the two per-channel sums the input gradient needs. Eval mode, a
world of one and no initialized world run plain BatchNorm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import SyncBatchNormError, explain

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "replace_torch_sync_batchnorm"]


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def _per_channel(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View a (C,) vector so that it broadcasts against (N, C, *)."""
    return vector.view((1, -1) + (1,) * (like.dim() - 2))


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def merge_stats(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor):
    """Combine per-part (count, mean, M2) rows, shapes (P, 1), (P, C), (P, C), into the whole's.

    Chan et al.'s combination for P parts at once: M2 = sum M2_p + sum n_p (mean_p - mean)^2. It
    only adds squared deviations, never subtracts E[x]^2 from E[x^2], so a large offset common to
    all samples costs no precision. Parts with count 0 add nothing. Same rows in, same bits out.
    """
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode normalization with group statistics; returns (output, mean, unbiased variance)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, world):
        channels = x.size(1)
        # Half inputs are reduced in float32 (as torch's kernels do); the exchange and merge run in
        # float64: they are 2C+1 numbers per rank, and counts above 2^24 must stay exact.
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        count = x.numel() // channels
        local = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        if count:
            var, mean = torch.var_mean(xc, dim=_reduce_dims(x), correction=0)
            local[0] = count
            local[1:channels + 1] = mean
            local[channels + 1:] = var * count
        # An empty rank still takes part: the others wait for its row in this all_gather.
        rows = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(rows, local, group=group)
        table = torch.stack(rows)
        total, mean, m2 = merge_stats(table[:, :1], table[:, 1:channels + 1], table[:, channels + 1:])
        n = int(total.item())
        if n < 2:
            # Every rank saw the same table, so every rank raises here and none is left waiting.
            raise SyncBatchNormError(explain(
                "SyncBatchNorm needs more than 1 value per channel in training, summed over the process group",
                rank=_rank(), seen=f"{n} in total, this rank's input shape {tuple(x.shape)}",
                expected=">= 2", fix="Feed a larger batch, or call .eval() to normalize with the running statistics."))
        invstd = torch.rsqrt(m2 / total + eps)
        ctx.save_for_backward(x, weight, mean.to(compute), invstd.to(compute))
        ctx.group, ctx.count = group, n
        ctx.bias_dtype = None if bias is None else bias.dtype
        scale = invstd if weight is None else invstd * weight.to(torch.float64)
        out = (xc - _per_channel(mean.to(compute), x)) * _per_channel(scale.to(compute), x)
        if bias is not None:
            out = out + _per_channel(bias.to(compute), x)
        unbiased = m2 / (total - 1)
        ctx.mark_non_differentiable(mean, unbiased)
        return out.to(x.dtype), mean, unbiased

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_mean, _grad_var):
        x, weight, mean, invstd = ctx.saved_tensors
        channels, n = x.size(1), ctx.count
        dy = grad_out.to(mean.dtype)
        xmu = x.to(mean.dtype) - _per_channel(mean, x)
        dims = _reduce_dims(x)
        sums = torch.cat([dy.sum(dims), (dy * xmu).sum(dims)])  # zeros for an empty batch
        # This rank's share of the parameter gradients, taken before the all-reduce overwrites `sums`;
        # DDP (or the caller) combines the shares across ranks as for any other parameter.
        grad_weight = (sums[channels:] * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sums[:channels].to(ctx.bias_dtype, copy=True) if ctx.needs_input_grad[2] else None
        dist.all_reduce(sums, group=ctx.group)
        grad_input = None
        if ctx.needs_input_grad[0]:
            sum_dy, sum_dy_xmu = sums[:channels], sums[channels:]
            # dL/dx for y = w * (x - mean) * invstd + b, where mean and invstd depend on all n samples
            # of the group: w * invstd * (dy - sum_dy / n - (x - mean) * invstd^2 * sum_dy_xmu / n).
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = (dy - _per_channel(sum_dy / n, x) - xmu * _per_channel(sum_dy_xmu * invstd * invstd / n, x))
            grad_input = (grad_input * _per_channel(scale, x)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank of `process_group` (default: the world).

    Same arguments, parameters and state_dict as torch.nn.BatchNorm*d; accepts (N, C, *) input of any
    rank >= 2 and any memory format. Every rank of the group must call it in the same order (an
    empty batch included), in forward and in backward.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None, *,
                 bias: bool = True) -> None:
        # Only pass `bias` when it differs from the default: older torch lacks the argument.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2 or input.size(1) != self.num_features:
            raise SyncBatchNormError(explain(
                "SyncBatchNorm input has the wrong shape", rank=_rank(), seen=tuple(input.shape),
                expected=f"(N, {self.num_features}, *) with at least 2 dimensions",
                fix="Channels go in dimension 1; a single sample needs a batch dimension (x.unsqueeze(0))."))

    def _group(self):
        """(group, its size), or (None, 1) when there is nobody to synchronize with."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group, dist.get_world_size(group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # Running-statistics bookkeeping as torch.nn.BatchNorm does it (momentum None: cumulative mean).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Only training synchronizes; in eval each rank normalizes its own batch by itself.
        group, world = self._group() if self.training else (None, 1)
        if world <= 1:
            tracked = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if tracked else None, self.running_var if tracked else None,
                                self.weight, self.bias, use_batch_stats, factor, self.eps)
        if self.eps <= 0:
            raise SyncBatchNormError(explain("SyncBatchNorm eps must be positive in training", rank=_rank(),
                                             seen=self.eps, expected="> 0"))
        out, mean, var = _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.eps, group, world)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None) -> torch.nn.Module:
        """Replace every BatchNorm (torch.nn.SyncBatchNorm included) in `module` with this class.

        The new layers share the old ones' parameters and buffers (same objects: an optimizer built
        before the conversion keeps working) and their training mode. A torch.nn.SyncBatchNorm keeps
        its own process group unless `process_group` is given. Returns the module (or its replacement).
        """
        converted = module
        if isinstance(module, _BatchNorm):
            group = process_group if process_group is not None else getattr(module, "process_group", None)
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group, bias=module.bias is not None or not module.affine)
            for name in ("weight", "bias"):
                setattr(converted, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(converted, name, getattr(module, name))
            converted.train(module.training)
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted


def convert_sync_batchnorm(module: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """`SyncBatchNorm.convert_sync_batchnorm` as a function."""
    return SyncBatchNorm.convert_sync_batchnorm(module, process_group)


def replace_torch_sync_batchnorm(module: torch.nn.Module) -> list[str]:
    """Swap every torch.nn.SyncBatchNorm inside `module` (not `module` itself) for ours, in place; returns
    their names. torch's layer refuses CPU input, ours does not: phalanx DDP calls this for CPU models."""
    swapped = []
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.SyncBatchNorm:
                setattr(parent, name, SyncBatchNorm.convert_sync_batchnorm(child))
                swapped.append(f"{parent_name}.{name}" if parent_name else name)
    return swapped

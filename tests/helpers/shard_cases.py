"""Training runs for the sharding tests (tests/ranks/test_sharding.py): the same model, data and
optimizer in every shard mode, so the modes can be compared with each other and with torch DDP.

Every rank draws the global batch of a step from the same seed and takes its own rows, so a run on
N ranks sees the same data as one process on the whole batch.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import phalanx as px

GLOBAL_BATCH = 12
IN, OUT = 24, 6


class Net(torch.nn.Module):
    """Linear layers of awkward sizes (chunks cut through parameters), a LayerNorm (a no-decay group),
    and an optional branch no rank uses (find_unused_parameters)."""

    def __init__(self, unused_branch=False):
        super().__init__()
        self.inp = torch.nn.Linear(IN, 40)
        self.norm = torch.nn.LayerNorm(40)
        self.mid = torch.nn.Linear(40, 33)
        self.out = torch.nn.Linear(33, OUT)
        self.unused = torch.nn.Linear(5, 5) if unused_branch else None

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.norm(torch.relu(self.inp(x))))))


def make_net(dtype=torch.float32, unused_branch=False):
    torch.manual_seed(0)
    return Net(unused_branch).to(dtype)


def batch(step, rank, world, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g, dtype=dtype)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g, dtype=dtype)
    rows = GLOBAL_BATCH // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def make_optimizer(kind, model):
    """Two param groups, as in most real recipes: weight decay on matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=0.05)
    raise ValueError(kind)


def train(rank, world, mode, *, steps=20, optimizer="adamw", clip=None, bucket_cap_mb=0.002, torch_ddp=False,
          dtype=torch.float32, unused=False, accumulate=1, start=0, model=None, opt=None, scheduler=None,
          overlap=False):
    """Train `steps` steps; returns the parameters, the clip norms and the optimizer's state dict."""
    if model is None:
        net = make_net(dtype, unused)
        if torch_ddp:
            model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb,
                                                              find_unused_parameters=unused)
        else:
            model = px.DistributedDataParallel(net, shard=mode, bucket_cap_mb=bucket_cap_mb,
                                               find_unused_parameters=unused)
        opt = make_optimizer(optimizer, model)
        if not torch_ddp:
            opt = model.shard_optimizer(opt, overlap_forward=overlap) if overlap else model.shard_optimizer(opt)
    norms = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, rank, world, dtype)
            if micro < accumulate - 1:
                with model.no_sync():
                    torch.nn.functional.mse_loss(model(x), y).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            if torch_ddp:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            else:
                norms.append(float(model.clip_grad_norm_(clip)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
    if overlap:
        opt.wait_parameters()  # the forward waits for each layer's all-gather; reading them here needs this
    return {"params": whole_parameters(model), "norms": norms,
            "optimizer": opt.state_dict(), "model": model, "opt": opt}


def whole_parameters(model):
    """The model's parameters as whole tensors (collective for FSDP2's DTensor shards)."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def exchange_name(model):
    return type(model._reducer.exchange).__name__


def replicas_identical(params):
    """Whether every rank holds bitwise the same parameters (collective)."""
    flat = torch.cat([p.reshape(-1).double() for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])

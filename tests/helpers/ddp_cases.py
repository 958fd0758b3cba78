"""Models, data and training loops shared by the DDP tests (not a test module itself).

Every case defines a model and a per-rank loss; the reference trains one process on all ranks'
data with the mean of the per-rank losses, which is what DDP's averaged gradient optimizes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx

PER_RANK = 4  # samples per rank per step


class Branchy(nn.Module):
    """`odd` is used only on odd ranks; `never` is used nowhere. `odd` and `never` are large, so the
    bucket holds few large gradients (exchanged split on one host, shm.py)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.head = nn.Linear(8, 256), nn.Linear(256, 4)
        self.odd, self.never = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x, use_odd: bool):
        h = torch.tanh(self.trunk(x))
        return self.head(h) + self.odd(h)[:, :4] if use_odd else self.head(h)


class Tied(nn.Module):
    """Output projection shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = nn.Embedding(20, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.emb(tokens))).mean(1))


def cnn_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def build(case: str) -> nn.Module:
    torch.manual_seed(1234)  # same initial model on every rank (DDP broadcasts rank 0's anyway)
    # Large and small tensors in one bucket: the copy into the bucket takes one pass per large
    # gradient and one batched call for the small ones (Bucket.fused_scale).
    if case in ("mlp", "no_sync"):
        return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 4)).double()
    if case == "create_graph":
        return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 4)).double()
    if case == "cnn_bn_eval":
        return cnn_bn().double().eval()
    if case == "unused":
        return Branchy().double()
    if case == "tied":
        return Tied().double()
    raise ValueError(case)


def batch(case: str, step: int, rank: int, micro: int = 0):
    """This rank's inputs and targets for a step (a deterministic function of step, rank, micro)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    if case == "cnn_bn_eval":
        images = torch.randn(PER_RANK, 3, 8, 8, generator=g, dtype=torch.float64)
        return images, torch.randint(0, 3, (PER_RANK,), generator=g)
    if case == "tied":
        return torch.randint(0, 20, (PER_RANK, 5), generator=g), torch.randint(0, 20, (PER_RANK,), generator=g)
    x = torch.randn(PER_RANK, 8, generator=g, dtype=torch.float64)
    return x, torch.randn(PER_RANK, 4, generator=g, dtype=torch.float64)


def loss_of(case: str, model, x, y, rank: int):
    if case in ("cnn_bn_eval", "tied"):
        return F.cross_entropy(model(x), y)
    if case == "unused":
        return F.mse_loss(model(x, rank % 2 == 1), y)
    if case == "create_graph":
        x = x.clone().requires_grad_(True)
        out = model(x)
        (slope,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # per-sample input gradient
        return F.mse_loss(out, y) + 0.1 * slope.pow(2).sum(1).mean()
    return F.mse_loss(model(x), y)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


MICRO_STEPS = 3  # no_sync case: micro-batches per optimizer step


def ddp_step(case: str, model, rank: int, step: int) -> None:
    if case == "no_sync":
        with model.no_sync():
            for micro in range(MICRO_STEPS - 1):
                (loss_of(case, model, *batch(case, step, rank, micro), rank) / MICRO_STEPS).backward()
        (loss_of(case, model, *batch(case, step, rank, MICRO_STEPS - 1), rank) / MICRO_STEPS).backward()
    elif case == "create_graph":
        loss_of(case, model, *batch(case, step, rank), rank).backward(create_graph=True)
    else:
        loss_of(case, model, *batch(case, step, rank), rank).backward()


def reference_step(case: str, model, world: int, step: int) -> None:
    """One process, all ranks' data: the gradient DDP should produce."""
    micros = range(MICRO_STEPS) if case == "no_sync" else [0]
    for micro in micros:
        if case in ("unused", "create_graph", "tied", "cnn_bn_eval"):  # mean of the per-rank losses
            loss = sum(loss_of(case, model, *batch(case, step, r, micro), r) for r in range(world)) / world
        else:  # the same thing, computed on the concatenated batch
            xs, ys = zip(*(batch(case, step, r, micro) for r in range(world)))
            loss = loss_of(case, model, torch.cat(xs), torch.cat(ys), 0)
        (loss / len(micros)).backward(create_graph=case == "create_graph")


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def replicas_identical(module: nn.Module) -> bool:
    """True when this rank's parameters are bitwise equal to rank 0's.

    (Buffers such as BatchNorm statistics legitimately differ between steps: each rank updates
    them from its own batch, and DDP re-broadcasts rank 0's before the next forward.)
    """
    mine = [p.detach().clone() for p in module.parameters()]
    theirs = [t.clone() for t in mine]
    for t in theirs:
        dist.broadcast(t, 0)
    return all(torch.equal(a, b) for a, b in zip(mine, theirs))


def exchange_summary(model) -> dict:
    """Which exchange averages the model's buckets: "posted" (shared memory, posted or split buckets),
    "shm all-reduce" (shared memory, two-phase), or "process group"; and how many buckets are split."""
    modes = getattr(model._reducer.exchange, "modes", None)
    if modes is None:
        return {"exchange": "process group", "split_buckets": 0}
    kind = "shm all-reduce" if set(modes) == {"all-reduce"} else "posted"
    return {"exchange": kind, "split_buckets": modes.count("split")}


def equivalence_run(rank: int, world: int, case: str, opt_name: str, steps: int = 10) -> dict:
    """Train `case` with phalanx DDP and the one-process reference; report how far apart they end."""
    ref = build(case)
    model = phalanx.DistributedDataParallel(copy.deepcopy(ref), find_unused_parameters=case == "unused")
    opt, ref_opt = make_optimizer(opt_name, model.parameters()), make_optimizer(opt_name, ref.parameters())
    identical = True
    for step in range(steps):
        opt.zero_grad()
        ddp_step(case, model, rank, step)
        opt.step()
        ref_opt.zero_grad()
        reference_step(case, ref, world, step)
        ref_opt.step()
        identical &= replicas_identical(model.module)
    result = {"max_diff": (flat_params(model.module) - flat_params(ref)).abs().max().item(),
              "moved": (flat_params(ref) - flat_params(build(case))).abs().max().item(),
              "identical": identical,
              **exchange_summary(model)}
    if case == "unused":
        result["never_grad_is_none"] = all(p.grad is None for p in model.module.never.parameters())
        result["odd_grad_matches"] = torch.allclose(model.module.odd.weight.grad, ref.odd.weight.grad)
    return result

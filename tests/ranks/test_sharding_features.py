"""Sharded DDP with what training loops use around the optimizer: LR schedulers, GradScaler (an
overflow seen by one rank's chunk only must skip the step everywhere), and the typed errors for the
combinations sharding does not support."""

import math
import weakref

import pytest
import torch

import phalanx as px
from phalanx.errors import ShardingError
from phalanx.testing import run_ranks
from tests.helpers.shard_cases import batch, make_net, make_optimizer

STEPS = 6
OVERFLOW_STEP = 3


def _scaled_run(rank, world, mode, unscale_first):
    model = px.DistributedDataParallel(make_net(), shard=mode, bucket_cap_mb=0.002)
    opt = model.shard_optimizer(make_optimizer("adamw", model))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    step_box = [0]

    def poison(grad):  # one element of one rank's gradient: after averaging, one rank's chunk only
        if rank == 1 and step_box[0] == OVERFLOW_STEP:
            grad = grad.clone()
            grad[0] = math.inf
        return grad
    model.module.out.bias.register_hook(poison)
    scales, lrs = [], []
    for step in range(STEPS):
        step_box[0] = step
        x, y = batch(step, rank, world)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if unscale_first:
            scaler.unscale_(opt)
            model.clip_grad_norm_(10.0)
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        scales.append(scaler.get_scale())
        lrs.append([g["lr"] for g in opt.param_groups])
    return [p.detach().clone() for p in model.parameters()], scales, lrs


def _scaler_cases(rank, world):
    out = {}
    for unscale_first in (False, True):
        reference = _scaled_run(rank, world, "none", unscale_first)
        for mode in ("optimizer", "gradients"):
            out[(mode, unscale_first)] = (reference, _scaled_run(rank, world, mode, unscale_first))
    return out


def test_grad_scaler_and_scheduler_agree_with_the_unsharded_run():
    """World size 2: the overflow is in rank 0's chunk only; both ranks skip that step and halve the
    scale, as unsharded DDP does; StepLR's rates reach every param group; parameters bitwise equal."""
    for rank, per_rank in enumerate(run_ranks(_scaler_cases, 2, (2,), timeout=240)):
        for key, ((ref_params, ref_scales, ref_lrs), (params, scales, lrs)) in per_rank.items():
            assert ref_scales[OVERFLOW_STEP] == ref_scales[OVERFLOW_STEP - 1] / 2, "the overflow must be seen"
            assert scales == ref_scales, f"rank {rank} {key}: scales {scales} vs {ref_scales}"
            assert lrs == ref_lrs and lrs[-1][0] < lrs[0][0]
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"rank {rank} {key}"


def _errors(rank, world):
    seen = {}

    def expect(name, action):
        try:
            action()
        except ShardingError as exc:
            seen[name] = str(exc)
        else:
            seen[name] = None

    net = make_net()
    expect("bad mode", lambda: px.DistributedDataParallel(net, shard="params"))
    expect("as_view", lambda: px.DistributedDataParallel(net, shard="gradients", gradient_as_bucket_view=True))
    model = px.DistributedDataParallel(make_net(), shard="gradients")
    expect("lbfgs", lambda: model.shard_optimizer(torch.optim.LBFGS(model.parameters())))
    expect("foreign", lambda: model.shard_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=1)))
    expect("comm hook", lambda: model.register_comm_hook(None, lambda state, bucket: None))
    expect("join", lambda: model.join())
    opt = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    expect("add group", lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]}))
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    expect("sparse", lambda: px.DistributedDataParallel(sparse, shard="optimizer"))
    return seen


def test_unsupported_combinations_raise_typed_errors():
    """World size 2: each names the combination, what was seen and what to do."""
    seen = run_ranks(_errors, 2, (2,))[0]
    expectations = {"bad mode": "'none' | 'optimizer' | 'gradients' | 'parameters'",
                    "as_view": "gradient_as_bucket_view", "lbfgs": "LBFGS cannot be sharded",
                    "foreign": "does not train", "comm hook": "register_comm_hook", "join": "join()",
                    "add group": "add_param_group", "sparse": "sparse"}
    for name, needle in expectations.items():
        assert seen[name] is not None, f"{name}: no ShardingError"
        assert needle in seen[name], f"{name}: {seen[name]}"


def _unsharded_returns_itself(rank):
    model = px.DistributedDataParallel(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model.shard_optimizer(opt) is opt


def test_unsharded_shard_optimizer_returns_the_optimizer_itself():
    """World size 1: scripts can switch modes with one flag."""
    assert run_ranks(_unsharded_returns_itself, 1) == [True]


def _freed_on_del(rank: int, level: str) -> list[bool]:
    torch.manual_seed(0)
    model = px.DistributedDataParallel(make_net(), shard=level, bucket_cap_mb=0.001)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(2):
        x, y = batch(step, rank, 2)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    alive = [weakref.ref(model), weakref.ref(optimizer)]
    del model, optimizer
    return [ref() is None for ref in alive]


@pytest.mark.parametrize("level", ["none", "optimizer", "gradients"])
def test_a_dropped_model_and_optimizer_are_freed_at_once(level):
    """World size 2. No reference cycle keeps a sharded model or its optimizer (and their buffers and
    optimizer state) alive once the user drops them: the memory returns at `del`, not at the next
    garbage collection (the GPU test measures one level after another in one process)."""
    assert run_ranks(_freed_on_del, 2, (level,)) == [[True, True], [True, True]]

"""An optimizer built before wrapping, as torch DDP scripts build it, trains like torch DDP at every level;
an optimizer that would step tensors the model does not train fails loudly, never silently.

World size 2 over Gloo. The optimizer is AdamW with a weight-decay group and a no-decay group built
over the plain module's parameters before `DistributedDataParallel(...)`, then passed through
`model.shard_optimizer()`; 20 steps clipped at 0.5 are compared with torch DDP on the same data.
"""

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.errors import StrayOptimizerError
from phalanx.testing import run_ranks
from tests.helpers.shard_cases import batch, make_net, make_optimizer, train

LEVELS = ["none", "optimizer", "gradients", "parameters"]


def _built_before_wrapping(rank, world, level, compiled, kind="adamw"):
    reference = train(rank, world, None, torch_ddp=True, clip=0.5, optimizer=kind)["params"]
    net = make_net()
    if compiled:
        net = torch.compile(net, backend="eager")
    opt = make_optimizer(kind, net)  # torch DDP's order: the optimizer first, over the plain module
    model = px.DistributedDataParallel(net, shard=level, bucket_cap_mb=0.002)
    opt = model.shard_optimizer(opt)
    run = train(rank, world, level, clip=0.5, model=model, opt=opt)
    return max(float((a - b).abs().max()) for a, b in zip(reference, run["params"]))


@pytest.mark.parametrize("level", LEVELS)
def test_optimizer_built_before_wrapping_trains_like_torch_ddp(level):
    """World size 2: 20 AdamW steps with two param groups and clipping, allclose to torch DDP."""
    for rank, diff in enumerate(run_ranks(_built_before_wrapping, 2, (2, level, False))):
        assert diff < 1e-5, f"rank {rank}, shard={level!r}: {diff:.3g} from torch DDP"


@pytest.mark.parametrize("level", ["gradients", "parameters"])
def test_compiled_module_with_optimizer_built_before_wrapping(level):
    """World size 2: the same for a torch.compile'd module (its parameters are the module's)."""
    for rank, diff in enumerate(run_ranks(_built_before_wrapping, 2, (2, level, True), timeout=300)):
        assert diff < 1e-5, f"rank {rank}, shard={level!r}: {diff:.3g} from torch DDP"


def test_state_held_before_wrapping_is_carried_to_the_shards():
    """World size 2: Adagrad holds state from its construction; re-targeted at the FSDP2 shards, it still
    trains like torch DDP."""
    for rank, diff in enumerate(run_ranks(_built_before_wrapping, 2, (2, "parameters", False, "adagrad"))):
        assert diff < 1e-5, f"rank {rank}: {diff:.3g}"


def _stray(rank, world, case):
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    level = "gradients" if case in ("bare sharded", "inner step") else "parameters"
    model = px.DistributedDataParallel(net, shard=level)
    if case == "foreign tensor":
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        try:
            model.shard_optimizer(opt)
        except StrayOptimizerError as exc:
            return str(exc)
        return None
    if case == "inner step":
        model.shard_optimizer(opt)  # the returned optimizer is what must be stepped
    x, y = batch(0, rank, world)
    F.mse_loss(model(x), y).backward()
    try:
        opt.step()
    except StrayOptimizerError as exc:
        return str(exc), exc.parameter
    return None


@pytest.mark.parametrize("case,words", [
    ("replaced", ["'inp.weight'", "shard='parameters' replaced it", "model.shard_optimizer(optimizer)"]),
    ("bare sharded", ["'inp.weight'", "shard='gradients'", "model.shard_optimizer(optimizer)"]),
    ("inner step", ["AdamW.step()", "shard_optimizer() returned"]),
    ("foreign tensor", ["param group 1", "shape (3,)", "does not train"]),
])
def test_a_stray_optimizer_raises_a_typed_error(case, words):
    """World size 2: stepping tensors the model does not train is a StrayOptimizerError naming the parameter."""
    for outcome in run_ranks(_stray, 2, (2, case)):
        assert outcome is not None, f"{case}: no error"
        message = outcome if isinstance(outcome, str) else outcome[0]
        for word in words:
            assert word in message, (case, word, message)

"""shard="parameters" on a model built on the meta device: no rank ever holds it whole.

World size 2 over Gloo. Built under `torch.device("meta")` with the same seed, the sharded model
equals the model built normally on the CPU, bitwise (torch's layers: each module's
reset_parameters(), children first); `init=` fills what a model initializes its own way; a
safetensors export and a checkpoint each start a meta-built model; the misuses raise ShardingError.
"""

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.errors import ShardingError
from phalanx.testing import run_ranks
from phalanx.tools.bench_models import MODELS
from tests.helpers.shard_cases import Net, batch, make_net, whole_parameters


def _gpt():
    return MODELS["gpt"].build()  # embeddings, pre-norm blocks of attention and MLP, a head


def _tied():
    net = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 40, bias=False))
    net[2].weight = net[0].weight
    return net


BUILDERS = {"mlp": Net, "gpt": _gpt, "tied": _tied}


def _meta_equals_normal(rank, world, name):
    torch.manual_seed(0)
    expected = [p.detach().clone() for p in BUILDERS[name]().parameters()]
    torch.manual_seed(0)
    with torch.device("meta"):
        net = BUILDERS[name]()
    model = px.DistributedDataParallel(net, shard="parameters")
    got = whole_parameters(model)
    local = sum(p.to_local().numel() for p in model.parameters())
    after = torch.rand(1)  # the generator is where a normal build leaves it
    torch.manual_seed(0)
    BUILDERS[name]()
    return (len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)),
            local, sum(p.numel() for p in expected), torch.equal(after, torch.rand(1)))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_meta_build_equals_the_normal_build_bitwise(name):
    """World size 2: the shards of a meta-built model are the normally built model's, bitwise; each rank
    holds about half of it."""
    for equal, local, total, same_generator in run_ranks(_meta_equals_normal, 2, (2, name)):
        assert equal, name
        assert local <= total / 2 + 64, (local, total)
        assert same_generator


class Positional(torch.nn.Module):
    """A model with a parameter of its own, which no reset_parameters() initializes."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.empty(6, 24))
        self.body = Net()

    def forward(self, x):
        return self.body(x + self.pos.sum(0))


def _own_init(rank, world):
    seen = {}
    with torch.device("meta"):
        net = Positional()
    try:
        px.DistributedDataParallel(net, shard="parameters")
    except ShardingError as exc:
        seen["without"] = str(exc)
    called = []

    def init(module):
        called.append(type(module).__name__.removeprefix("FSDP"))  # fully_shard subclasses the blocks
        if isinstance(module, Positional):
            with torch.no_grad():
                module.pos.copy_(torch.arange(6 * 24, dtype=torch.float32).view(6, 24))

    with torch.device("meta"):
        net = Positional()
    model = px.DistributedDataParallel(net, shard="parameters", init=init)
    opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    pos = whole_parameters(model)[0]
    x, y = batch(0, rank, world)
    F.mse_loss(model(x), y).backward()
    opt.step()
    seen["pos"] = torch.equal(pos, torch.arange(6 * 24, dtype=torch.float32).view(6, 24))
    seen["called"] = called
    return seen


def test_init_fills_what_a_model_initializes_its_own_way():
    """World size 2: without init= the parameter no reset_parameters() covers is named in a ShardingError;
    with it, init(module) runs once per module that owns tensors, children first, after the module's reset."""
    for seen in run_ranks(_own_init, 2, (2,)):
        assert "Positional" in seen["without"] and "['pos']" in seen["without"] and "init=" in seen["without"]
        assert seen["pos"]
        assert seen["called"] == ["Linear", "LayerNorm", "Linear", "Linear", "Positional"]  # modules owning tensors


def _from_export(rank, world, path):
    trained = px.DistributedDataParallel(make_net(), shard="gradients")
    opt = trained.shard_optimizer(torch.optim.AdamW(trained.parameters(), lr=1e-2))
    x, y = batch(0, rank, world)
    F.mse_loss(trained(x), y).backward()
    opt.step()
    px.export_weights(trained, path)
    px.barrier()
    with torch.device("meta"):
        net = Net()
    model = px.DistributedDataParallel(net, shard="parameters", init=px.load_weights(path, mmap=True))
    return all(torch.equal(a, b) for a, b in zip(whole_parameters(model), trained.module.parameters()))


def test_a_meta_build_starts_from_exported_weights(tmp_path):
    """World size 2: init=px.load_weights(path, mmap=True) fills each rank's shards from the mapped file."""
    assert run_ranks(_from_export, 2, (2, str(tmp_path / "w.safetensors"))) == [True, True]


def _from_checkpoint(rank, world, directory):
    saved = px.DistributedDataParallel(make_net(), shard="none")
    with torch.no_grad():
        for p in saved.parameters():
            p.mul_(2)
    px.Checkpointer(directory).save({"model": saved})
    with torch.device("meta"):
        net = Net()
    model = px.DistributedDataParallel(net, shard="parameters")
    assert px.Checkpointer(directory).restore({"model": model})
    return all(torch.equal(a, b) for a, b in zip(whole_parameters(model), saved.module.parameters()))


def test_a_meta_build_restores_a_checkpoint(tmp_path):
    """World size 2: Checkpointer.restore into a meta-built model (the file memory-mapped)."""
    assert run_ranks(_from_checkpoint, 2, (2, str(tmp_path))) == [True, True]


def _misuse(rank, world):
    seen = {}
    with torch.device("meta"):
        net = Net()
    for name, action in {
        "meta at gradients": lambda: px.DistributedDataParallel(net, shard="gradients"),
        "init on a real model": lambda: px.DistributedDataParallel(make_net(), shard="parameters", init=print),
        "init of another kind": lambda: px.DistributedDataParallel(net, shard="parameters", init=3),
    }.items():
        try:
            action()
            seen[name] = None
        except ShardingError as exc:
            seen[name] = str(exc)
    half = Net()
    half.mid = half.mid.to("meta")
    try:
        px.DistributedDataParallel(half, shard="parameters")
    except ShardingError as exc:
        seen["half on meta"] = str(exc)
    return seen


def test_misuses_raise_sharding_errors():
    """World size 2."""
    seen = run_ranks(_misuse, 2, (2,))[0]
    assert "shard='parameters'" in seen["meta at gradients"] and "mid.weight" in seen["meta at gradients"]
    assert "init=" in seen["init on a real model"]
    assert "a int" in seen["init of another kind"] and "load_weights" in seen["init of another kind"]
    assert "inp.weight" in seen["half on meta"]

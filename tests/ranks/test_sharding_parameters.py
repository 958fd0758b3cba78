"""shard="parameters": torch's FSDP2 behind phalanx's DDP surface, against torch DDP.

World size 2 over Gloo on CPU tensors. After 20 AdamW steps the parameters are close to torch DDP's
(FSDP2 keeps no replicas: each rank holds shards, so "identical replicas" is the whole tensor each
rank rebuilds); clipping returns torch's norm; no_sync accumulates; the whole weights export to a
safetensors file without pickle; the unsupported combinations raise ShardingError.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import phalanx as px
from phalanx.engine.fully_sharded import ParameterShardedDDP, choose_blocks
from phalanx.errors import CheckpointError, ShardingError
from phalanx.testing import run_ranks
from tests.helpers.shard_cases import Net, batch, make_net, replicas_identical, train, whole_parameters


def _against_torch(rank, world):
    out = {}
    for name, options in {"plain": {}, "clip": {"clip": 0.5}, "no_sync": {"accumulate": 2}}.items():
        reference = train(rank, world, None, torch_ddp=True, **options)
        run = train(rank, world, "parameters", **options)
        out[name] = {"type": type(run["model"]).__name__,
                     "blocks": [type(b).__name__ for b in run["model"].blocks],
                     "max_diff": max(float((a - b).abs().max()) for a, b in zip(reference["params"], run["params"])),
                     "norms": (reference["norms"], run["norms"]), "identical": replicas_identical(run["params"])}
    return out


@pytest.mark.smoke
def test_fsdp2_level_matches_torch_ddp():
    """World size 2: 20 AdamW steps plain, clipped at 0.5, and with no_sync accumulation."""
    for rank, per_rank in enumerate(run_ranks(_against_torch, 2, (2,), timeout=240)):
        for name, outcome in per_rank.items():
            assert outcome["type"] == "ParameterShardedDDP"
            # the repeated submodules (fully_shard makes each an FSDP subclass of its own class), then the root
            assert outcome["blocks"] == ["FSDPLinear"] * 3
            assert outcome["max_diff"] < 1e-5, f"rank {rank} {name}: {outcome['max_diff']:.3g}"
            assert outcome["norms"][1] == pytest.approx(outcome["norms"][0], rel=1e-5)
            assert outcome["identical"]


def _export(rank, world, path):
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = batch(0, rank, world)
    F.mse_loss(model(x), y).backward()
    opt.step()
    written = px.export_weights(model, path)
    expected = dict(zip([n for n, _ in model.module.named_parameters()], whole_parameters(model)))
    return written is not None, expected


def test_export_writes_whole_weights_that_load_without_pickle(tmp_path):
    """World size 2: rank 0 writes one safetensors file; it loads into the plain model."""
    path = tmp_path / "weights.safetensors"
    (wrote0, expected), (wrote1, _) = run_ranks(_export, 2, (2, str(path)))
    assert wrote0 and not wrote1
    loaded = px.load_weights(path)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    plain = Net()
    plain.load_state_dict(loaded)
    raw = path.read_bytes()
    assert raw[8:9] == b"{" and b'"dtype":"F32"' in raw[:4096]  # the safetensors layout: length, then JSON


def _errors(rank, world):
    seen = {}
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    for name, action in {"join": model.join, "comm hook": lambda: model.register_comm_hook(None, None),
                         "as_view": lambda: px.DistributedDataParallel(make_net(), shard="parameters",
                                                                       gradient_as_bucket_view=True)}.items():
        try:
            action()
            seen[name] = None
        except ShardingError as exc:
            seen[name] = str(exc)
    seen["isinstance"] = isinstance(model, px.DistributedDataParallel) and isinstance(model, ParameterShardedDDP)
    return seen


def test_unsupported_combinations_raise_typed_errors():
    """World size 2."""
    seen = run_ranks(_errors, 2, (2,))[0]
    assert seen.pop("isinstance")
    for name, message in seen.items():
        assert message is not None and "shard='parameters'" in message, (name, message)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp, self.norm = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 50)


def test_default_blocks_are_the_repeated_transformer_blocks_not_their_layers():
    """No process: the choice of what fully_shard wraps."""
    model = TinyGPT()
    assert choose_blocks(model) == list(model.blocks)
    assert choose_blocks(model, torch.nn.Linear) == [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert choose_blocks(torch.nn.Linear(3, 3)) == []


def _scaled(rank, world, level):
    net = make_net()
    if level == "torch":
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        model = px.DistributedDataParallel(net, shard="parameters")
        opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for step in range(6):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        out = model(x)
        if step == 3 and rank == 1:  # an overflow in one rank's backward: every rank must skip the step
            out.register_hook(lambda grad: grad * float("inf"))
        scaler.scale(F.mse_loss(out, y)).backward()
        scaler.step(opt)
        scaler.update()
        scheduler.step()
        scales.append(scaler.get_scale())
    return whole_parameters(model), scales, [g["lr"] for g in opt.param_groups]


def _scaled_both(rank, world):
    return _scaled(rank, world, "torch"), _scaled(rank, world, "parameters")


def test_grad_scaler_and_scheduler_at_the_fsdp2_level():
    """World size 2: GradScaler skips the overflowing step on every rank and scales alike; StepLR acts."""
    for (ref_params, ref_scales, ref_lrs), (params, scales, lrs) in run_ranks(_scaled_both, 2, (2,)):
        assert ref_scales[3] == ref_scales[2] / 2 and scales == ref_scales
        assert lrs == ref_lrs
        assert max(float((a - b).abs().max()) for a, b in zip(ref_params, params)) < 1e-5


def _load_whole(rank, world):
    source = make_net()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    model.load_state_dict(source.state_dict())               # bare keys, whole tensors
    bare = all(torch.equal(a, b) for a, b in zip(whole_parameters(model), source.parameters()))
    model.load_state_dict({"module." + k: v + 1 for k, v in source.state_dict().items()})  # DDP's keys
    prefixed = all(torch.equal(a, b + 1) for a, b in zip(whole_parameters(model), source.parameters()))
    saved = model.state_dict()  # collective: whole tensors under DDP's keys
    whole = (list(saved) == ["module." + k for k in source.state_dict()]
             and all(type(v) is torch.Tensor and torch.equal(v, w + 1) for v, w in zip(saved.values(),
                                                                                      source.state_dict().values())))
    return bare, prefixed, whole


def test_state_dicts_are_whole_tensors_both_ways():
    """World size 2: model.load_state_dict with a plain model's (or DDP's) state dict keeps each rank's shards;
    model.state_dict() gives whole tensors under DDP's keys."""
    assert run_ranks(_load_whole, 2, (2,)) == [(True, True, True), (True, True, True)]


def _save_twice(rank, world, directory):
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ckpt = px.Checkpointer(directory, keep=1)
    for step in range(2):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        ckpt.save({"model": model, "optimizer": opt, "step": step + 1})
    return whole_parameters(model)


def _restore(rank, world, directory):
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    opt = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": opt, "step": 0}
    px.Checkpointer(directory, keep=1).restore(state)
    return state["step"], whole_parameters(model)


def _regions_read(rank, world, directory):
    """What a restore into this level reads of the parts: DTensors of this rank's region only."""
    from pathlib import Path

    from phalanx.checkpoint import shard_files
    model = px.DistributedDataParallel(make_net(), shard="parameters")
    payload = torch.load(Path(directory) / "ckpt-00000002.pt", weights_only=True)
    parts = shard_files.load_parts(Path(directory), payload["parts"])
    state = shard_files.restored(model, payload["entries"]["model"]["state"], [p["model"] for p in parts],
                                 px.checkpoint.unwrap)
    return all(isinstance(v, DTensor) and v.to_local().numel() < v.numel() for k, v in state.items()
               if k.endswith("weight") and "norm" not in k)


def test_each_rank_writes_its_own_part_and_only_kept_checkpoints_keep_parts(tmp_path):
    """World size 2: no rank gathers the model to save it. The checkpoint file holds placeholders, each rank
    its own part; pruning removes old parts; a damaged part makes restore refuse that checkpoint."""
    expected = run_ranks(_save_twice, 2, (2, str(tmp_path)))[0]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert names == ["ckpt-00000002.part-00000.pt", "ckpt-00000002.part-00001.pt", "ckpt-00000002.pt"]
    payload = torch.load(tmp_path / "ckpt-00000002.pt", weights_only=True)
    assert payload["entries"]["model"]["sharded"] and payload["entries"]["optimizer"]["sharded"]
    assert not any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in payload["entries"]["model"]["state"].values())
    part = torch.load(tmp_path / "ckpt-00000002.part-00001.pt", weights_only=True)
    total = sum(p.numel() for p in make_net().parameters())
    held = sum(piece["tensor"].numel() for piece in part["model"].values())
    assert 0 < held < total  # a shard, not the model
    assert run_ranks(_regions_read, 2, (2, str(tmp_path))) == [True, True]
    step, restored = run_ranks(_restore, 2, (2, str(tmp_path)))[0]
    assert step == 2 and all(torch.equal(a, b) for a, b in zip(restored, expected))
    damaged = tmp_path / "ckpt-00000002.part-00001.pt"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    rank0, rank1 = run_ranks(_restore_refused, 2, (2, str(tmp_path)))
    assert "ckpt-00000002.pt: its part ckpt-00000002.part-00001.pt is truncated" in rank0, rank0
    assert "rank 0 could not restore a checkpoint" in rank1, rank1


def _restore_refused(rank, world, directory):
    try:
        _restore(rank, world, directory)
    except CheckpointError as exc:
        return str(exc)
    return "restored"

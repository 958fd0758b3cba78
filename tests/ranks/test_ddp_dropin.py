"""What torch DDP scripts do that phalanx DDP does too, on 2 Gloo ranks (world size 2) unless said:
pickling and copy.deepcopy (EMA, AveragedModel), torch's errors for comm-hook misuse, and
torch.compile'd models whose checkpoints carry no `_orig_mod.`. Each rank function runs every case
once; the tests read its results."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import phalanx
from phalanx.errors import CommHookError, DDPPickleError
from phalanx.testing import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def _train(model, rank: int, steps: int, start: int = 0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _copies(rank: int) -> dict:
    out = {}
    model = phalanx.DistributedDataParallel(_net())
    _train(model, rank, 2)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # a whole pickled model: the user's own file
    out["types"] = {type(copied).__name__, type(loaded).__name__}
    out["copy_shares_no_parameter"] = not ({id(p) for p in copied.parameters()} & {id(p) for p in model.parameters()})
    # Every copy is a working DDP: trained on the same data, all end where the original ends.
    for name, m in (("original", model), ("deepcopy", copied), ("torch.load", loaded)):
        _train(m, rank, 3, start=2)
        out[name] = _flat(m.module)
        synced = out[name].clone()
        dist.broadcast(synced, 0)
        out[f"{name}_replicas_equal"] = torch.equal(synced, out[name])

    # EMA the two usual ways: torch's AveragedModel (which deep-copies the DDP model) and by hand.
    model = phalanx.DistributedDataParallel(_net())
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    by_hand = copy.deepcopy(model)
    expected, expected_averaged = _flat(model.module).clone(), None
    for step in range(3):
        _train(model, rank, 1, start=step)
        ema.update_parameters(model)
        with torch.no_grad():
            for mine, theirs in zip(by_hand.parameters(), model.parameters()):
                mine.lerp_(theirs, 0.1)
        current = _flat(model.module)
        expected = expected * 0.9 + current * 0.1
        # AveragedModel's first update copies the model, then averages.
        expected_averaged = current.clone() if expected_averaged is None else expected_averaged * 0.9 + current * 0.1
    out["ema_error"] = (_flat(ema.module.module) - expected_averaged).abs().max().item()
    out["by_hand_error"] = (_flat(by_hand.module) - expected).abs().max().item()
    with torch.no_grad():
        out["ema_forward_runs"] = tuple(ema(_batch(rank, 9)[0]).shape)

    # A hook belongs to the original's engine (as in torch): the copy runs without one and takes a new one.
    hooked = phalanx.DistributedDataParallel(_net())
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    copied = copy.deepcopy(hooked)
    copied.register_comm_hook(None, default_hooks.allreduce_hook)
    _train(copied, rank, 2)
    _train(hooked, rank, 2)
    out["hooked_copy_trains_like_the_original"] = torch.equal(_flat(copied.module), _flat(hooked.module))

    # Another group than the default one: torch refuses to pickle, with these words; so do we.
    pair = dist.new_group([0, 1])
    on_pair = phalanx.DistributedDataParallel(_net(), process_group=pair)
    try:
        copy.deepcopy(on_pair)
        out["pickle_other_group"] = "no error"
    except DDPPickleError as exc:
        out["pickle_other_group"] = (isinstance(exc, RuntimeError), str(exc))
    return out


@pytest.fixture(scope="module")
def copies():
    return run_ranks(_copies, 2)


def test_deepcopy_and_torch_save_give_working_ddp_models(copies):
    for outcome in copies:
        assert outcome["types"] == {"DistributedDataParallel"} and outcome["copy_shares_no_parameter"]
        assert outcome["hooked_copy_trains_like_the_original"]
        for name in ("deepcopy", "torch.load"):
            assert torch.equal(outcome[name], outcome["original"]), name
            assert outcome[f"{name}_replicas_equal"], name


def test_ema_through_averaged_model_and_by_hand(copies):
    for outcome in copies:
        assert outcome["ema_error"] < 1e-12 and outcome["by_hand_error"] < 1e-12
        assert outcome["ema_forward_runs"] == (5, 3)


def test_pickling_a_model_on_another_group_raises_torchs_error(copies):
    for outcome in copies:
        is_runtime_error, message = outcome["pickle_other_group"]
        assert is_runtime_error and message.startswith("DDP Pickling/Unpickling are only supported when using DDP "
                                                       "with the default process group")


# -- torch's error contract for register_comm_hook ------------------------------------------------

def _annotated_badly(state, bucket: dist.GradBucket) -> int:
    return default_hooks.allreduce_hook(state, bucket)


def _bucket_annotated_badly(state, bucket: int):
    return default_hooks.allreduce_hook(state, bucket)


MISUSES = {"not callable": lambda m: m.register_comm_hook(None, 3),
           "twice": lambda m: (m.register_comm_hook(None, default_hooks.allreduce_hook),
                               m.register_comm_hook(None, default_hooks.allreduce_hook)),
           "return annotation": lambda m: m.register_comm_hook(None, _annotated_badly),
           "bucket annotation": lambda m: m.register_comm_hook(None, _bucket_annotated_badly)}


def _hook_misuse(rank: int) -> dict:
    seen = {}
    for name, misuse in MISUSES.items():
        for cls in (phalanx.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
            try:
                misuse(cls(nn.Linear(2, 2)))
                seen[name, cls.__module__] = None
            except Exception as exc:
                seen[name, cls.__module__] = (type(exc), str(exc))
    return seen


def test_comm_hook_misuse_raises_torchs_type_and_words_then_ours():
    seen = run_ranks(_hook_misuse, 2)[0]
    for name in MISUSES:
        ours, theirs = seen[name, "phalanx.engine.ddp"], seen[name, "torch.nn.parallel.distributed"]
        assert theirs is not None and ours is not None, name
        assert issubclass(ours[0], theirs[0]) and issubclass(ours[0], CommHookError), (name, ours, theirs)
        torch_words = theirs[1].strip().splitlines()[0].strip()
        assert ours[1].startswith(torch_words), (name, ours[1], theirs[1])
        assert "[rank 0]" in ours[1] and len(ours[1]) > len(torch_words) + 20, name


# -- torch.compile: checkpoints without _orig_mod. --------------------------------------------------

def _compiled_keys(rank: int) -> dict:
    out = {}
    plain = phalanx.DistributedDataParallel(_net())
    compiled = phalanx.DistributedDataParallel(torch.compile(_net(), backend="eager"))
    out["plain_keys"] = list(plain.state_dict())
    out["compiled_keys"] = list(compiled.state_dict())
    _train(compiled, rank, 2)
    plain.load_state_dict(compiled.state_dict())  # compiled -> uncompiled
    out["compiled_to_plain"] = torch.equal(_flat(plain.module), _flat(compiled.module))
    fresh = phalanx.DistributedDataParallel(torch.compile(_net(), backend="eager"))
    fresh.load_state_dict(plain.module.state_dict())  # bare keys -> compiled
    out["plain_to_compiled"] = torch.equal(_flat(fresh.module), _flat(plain.module))
    outer = torch.compile(phalanx.DistributedDataParallel(_net()), backend="eager")
    out["outer_compiled_unwrapped_keys"] = list(phalanx.checkpoint.unwrap(outer).state_dict())
    return out


def test_compiled_models_save_and_load_plain_keys():
    outcome = run_ranks(_compiled_keys, 2)[0]
    assert outcome["compiled_keys"] == outcome["plain_keys"] == ["module.0.weight", "module.0.bias",
                                                                 "module.2.weight", "module.2.bias"]
    assert outcome["compiled_to_plain"] and outcome["plain_to_compiled"]
    assert outcome["outer_compiled_unwrapped_keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]

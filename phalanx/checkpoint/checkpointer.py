"""`Checkpointer`: save a training run's state and resume it exactly after a worker dies.

Every rank calls `save(state)`: every rank's random states are gathered (and a sharded optimizer's
state, to torch's unsharded format), rank 0 writes one file (atomically, see atomic_files.py) with
the unwrapped model, the other stateful objects and the plain values, and all ranks pass a barrier.
`restore(state)` lets rank 0 pick the newest complete file; every rank then loads that file with
weights_only=True onto its own device. Saved so, a run restores at any world size and shard mode.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from ..diagnose import recorder
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointValueError,
    CheckpointWriteError,
    UnsafeCheckpointError,
    explain,
)
from ..log import logger
from ..world import group as world
from . import atomic_files, random_state, shard_files

FORMAT = 1
_NOTHING, _LOAD, _FAILED = 0, 1, 2  # what rank 0 tells the others after choosing or writing
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple, set)
_SHOWN_KEYS = 10


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel (torch's or phalanx's) and torch.compile wrappers, so a
    checkpoint holds the plain model's keys and loads into a compiled or uncompiled model alike."""
    while isinstance(model, torch.nn.Module):
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif _is_wrapper(model):
            model = model.module
        else:
            break
    return model


def _is_wrapper(model: torch.nn.Module) -> bool:
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return True
    try:
        from ..engine.ddp import DistributedDataParallel
    except ImportError:  # the engine is optional for checkpointing
        return False
    return isinstance(model, DistributedDataParallel)


def _kind(name: str, value) -> str:
    if isinstance(value, torch.nn.Module):
        return "model"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "object"
    check_plain(value, f"state[{name!r}]")
    return "value"


def check_plain(value, where: str) -> None:
    """Raise CheckpointValueError unless `value` is made of tensors and plain Python values only."""
    kind = type(value)
    if kind in _PLAIN_LEAVES or kind in (torch.Tensor, torch.nn.Parameter):
        return
    if kind in _PLAIN_CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):
                check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    hint = " (convert NumPy values with .item() or torch.as_tensor())" if kind.__module__.startswith("numpy") else ""
    raise CheckpointValueError(explain(
        f"{where} cannot be saved in a checkpoint that loads safely", rank=world.group_rank(),
        seen=f"a {kind.__qualname__}",
        expected="tensors, numbers, strings, bytes, None, and lists/tuples/dicts/sets of them, "
                 "or an object with state_dict()/load_state_dict()",
        fix=f"Store the value as one of those{hint}."))


def _own_device() -> torch.device:
    return world.device() if world.is_initialized() else torch.device("cpu")


def _map_location(device: torch.device):
    """Tensors saved from any GPU go to this rank's device; tensors saved on the CPU stay there."""
    if device.type == "cpu":
        return "cpu"

    def onto_own_device(storage, location: str):
        if location == "cpu":
            return storage
        return torch.serialization.default_restore_location(storage, str(device))

    return onto_own_device


def _listed(keys: list) -> str:
    shown = ", ".join(str(k) for k in keys[:_SHOWN_KEYS])
    more = len(keys) - _SHOWN_KEYS
    return f"[{shown}{f', ... {more} more' if more > 0 else ''}]"


class Checkpointer:
    """Atomic, safely loadable checkpoints of a training run in `directory`, keeping the last `keep`.

    `state` maps names to objects with state_dict()/load_state_dict() (models, DDP-wrapped or not,
    optimizers, schedulers, GradScaler, phalanx.DataLoader / DistributedSampler) and to plain values
    (numbers, strings, small lists and dicts), which `restore` writes back into the dict. Every
    rank's random states are saved and restored too. Call `save` and `restore` on every rank.

    >>> import phalanx as px, torch                                  # doctest: +SKIP
    >>> px.init()
    >>> model = px.DistributedDataParallel(torch.nn.Linear(4, 2))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> state = {"model": model, "optimizer": opt, "step": 0}
    >>> ckpt = px.Checkpointer("runs/demo", keep=2)
    >>> ckpt.restore(state)                  # False on the first run, True after a restart
    False
    >>> state["step"] += 1; ckpt.save(state)
    PosixPath('runs/demo/ckpt-00000001.pt')
    """

    def __init__(self, directory, keep: int = 2, *, timeout: float | None = None):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(explain("Checkpointer keep must be a positive number of checkpoints",
                                     seen=f"keep={keep!r}", expected="an int >= 1", fix="Pass keep=2 (the default)."))
        self.directory = Path(directory)
        self.keep = keep
        self.timeout = timeout  # seconds the barrier after a save waits for all ranks (None: PHALANX_TIMEOUT)
        self.saved_world_size: int | None = None  # world size of the checkpoint last restored

    # -- saving -----------------------------------------------------------------------------------

    def save(self, state: dict) -> Path:
        """Write `state` and every rank's random state as a new checkpoint; returns its path on every rank."""
        previous = recorder.phase(recorder.SAVING)
        try:
            return self._save(state)
        finally:
            recorder.phase(previous)

    def _save(self, state: dict) -> Path:
        kinds = {name: _kind(name, value) for name, value in state.items()}  # same check, same error, on all ranks
        device = _own_device()
        states = random_state.gather(random_state.capture(device), world.collective_device())
        # FSDP2's shards (shard="parameters") are written by their ranks, each into a part file of its own;
        # a sharded optimizer's pieces (shard="optimizer"/"gradients") are gathered to rank 0, bucket by bucket.
        split = {name: shard_files.split(dtensors) for name, value in state.items()
                 if (dtensors := shard_files.dtensor_state(value, unwrap)) is not None}
        gathered = {name: value.state_dict(to=0) for name, value in state.items()
                    if shard_files.is_optimizer_view(value) and name not in split}
        path, failure, sequence, parts = None, None, -1, None
        if world.group_rank() == 0:
            try:
                sequence = self._next_sequence()
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        if split:  # every rank writes its part first, under the sequence rank 0 chose
            code, sequence = self._from_rank0(_FAILED if failure else _LOAD, None, sequence)
            if code != _FAILED:
                local = {name: shards for name, (_, shards) in split.items()}
                parts = shard_files.write_parts(self.directory, sequence, local)
                gathered.update({name: skeleton for name, (skeleton, _) in split.items()})
        if world.group_rank() == 0 and failure is None:
            try:
                path = self._write(state, kinds, states, gathered, sequence, parts, set(split))
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        self._barrier()
        code, sequence = self._from_rank0(_FAILED if failure else _LOAD, path)
        if failure is not None:
            if isinstance(failure, CheckpointError):
                raise failure
            raise CheckpointWriteError(explain(
                f"could not write a checkpoint in {self.directory}", rank=0,
                seen=f"{type(failure).__name__}: {failure}", expected="a writable directory with free space",
                fix="Free space or fix permissions; the previous checkpoint is intact.")) from failure
        if code == _FAILED:
            raise CheckpointWriteError(explain(
                f"rank 0 could not write a checkpoint in {self.directory}", rank=world.group_rank(),
                seen="a failure on rank 0", fix="See rank 0's error; the previous checkpoint is intact."))
        return self.directory / atomic_files.CHECKPOINT_NAME.format(sequence)

    def _next_sequence(self) -> int:
        """Rank 0: the sequence number of the next checkpoint."""
        listed = atomic_files.read_manifest(self.directory) or []
        present = atomic_files.checkpoint_files(self.directory)
        return 1 + max([e.sequence for e in listed] + list(present), default=0)

    def _write(self, state: dict, kinds: dict, states: list, gathered: dict, sequence: int, parts: list | None,
               split: set) -> Path:
        started = time.monotonic()
        entries = {}
        for name, value in state.items():
            if kinds[name] == "value":
                saved = value
            elif name in gathered:
                saved = gathered[name]
            else:
                saved = unwrap(value).state_dict() if kinds[name] == "model" else value.state_dict()
                check_plain(saved, f"state[{name!r}].state_dict()")
            entries[name] = {"kind": kinds[name], "state": saved, "sharded": name in split}
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_files.remove_stale_temps(self.directory)
        listed = atomic_files.read_manifest(self.directory) or []
        payload = {"format": FORMAT, "sequence": sequence, "world_size": world.group_size(),
                   "entries": entries, "random_states": states, "parts": parts or []}
        path = self.directory / atomic_files.CHECKPOINT_NAME.format(sequence)
        size, crc32 = atomic_files.write_atomic(path, lambda file: torch.save(payload, file))
        # The manifest is renamed into place after the file: a crash in between leaves the
        # previous manifest, whose checkpoints are all still on disk.
        kept = (listed + [atomic_files.ManifestEntry(path.name, sequence, size, crc32)])[-self.keep:]
        atomic_files.write_manifest(self.directory, kept)
        keep_names = {e.file for e in kept}
        for name in atomic_files.checkpoint_files(self.directory).values():
            if name not in keep_names:
                (self.directory / name).unlink(missing_ok=True)
        shard_files.remove_parts_except(self.directory, {e.sequence for e in kept})
        logger.info("saved checkpoint %s (%.1f MB in %.2fs)", path, size / 1e6, time.monotonic() - started)
        return path

    def _barrier(self) -> None:
        if world.group_size() == 1:
            return
        if world.is_initialized():
            world.barrier(self.timeout, name="checkpoint")
        else:
            dist.barrier()

    def _from_rank0(self, code: int, path: Path | None, sequence: int = -1) -> tuple[int, int]:
        """Broadcast (code, checkpoint sequence) from rank 0, so every rank acts on the same decision."""
        sequence = atomic_files.sequence_of(path.name) if path is not None else sequence
        if world.group_size() == 1:
            return code, sequence
        message = torch.tensor([code, sequence], dtype=torch.int64, device=world.collective_device())
        entry = recorder.begin(recorder.CHECKPOINT, -1, message.numel(), message.dtype)
        dist.broadcast(message, src=0)
        recorder.done(entry)
        return int(message[0]), int(message[1])

    # -- restoring --------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints listed in the manifest, oldest first."""
        return [self.directory / e.file for e in atomic_files.read_manifest(self.directory) or []]

    def restore(self, state: dict) -> bool:
        """Load the newest complete checkpoint into `state`; False (and `state` untouched) if there is none."""
        device = _own_device()
        location = _map_location(device)
        chosen, failure = None, None
        if world.group_rank() == 0:
            try:
                chosen = self._choose(location)
            except Exception as exc:  # told to the other ranks below, then raised here
                failure = exc
        code, sequence = self._from_rank0(_FAILED if failure else (_LOAD if chosen else _NOTHING),
                                          chosen[0] if chosen else None)
        if failure is not None:
            raise failure
        if code == _FAILED:
            raise CheckpointError(explain(f"rank 0 could not restore a checkpoint from {self.directory}",
                                          rank=world.group_rank(), fix="See rank 0's error."))
        if code == _NOTHING:
            return False
        path, payload = chosen if chosen else self._load_chosen(sequence, location)
        self._apply(payload, state, path)
        self._restore_random_states(payload["random_states"], device)
        self.saved_world_size = payload["world_size"]
        if world.group_rank() == 0:
            plain = {k: v for k, v in state.items() if type(v) in (int, float, str, bool)}
            logger.info("resumed from %s (saved by %d rank(s), now %d)%s", path, payload["world_size"],
                              world.group_size(), f": {plain}" if plain else "")
        return True

    def _choose(self, location) -> tuple[Path, dict] | None:
        """Rank 0: the newest checkpoint that is complete and loads, falling back past broken ones."""
        listed = atomic_files.read_manifest(self.directory)
        if listed is None:
            present = atomic_files.checkpoint_files(self.directory)
            if not present:
                return None
            logger.warning("no readable %s in %s: the checkpoints cannot be checked for truncation; "
                                 "trying the newest first", atomic_files.MANIFEST, self.directory)
            candidates = [(self.directory / present[s], None) for s in sorted(present, reverse=True)]
        else:
            candidates = [(self.directory / e.file, e) for e in reversed(listed)]
        broken = []
        for path, entry in candidates:
            reason = atomic_files.verify(self.directory, entry) if entry is not None else None
            if reason is None:
                try:
                    payload = atomic_files.load_safely(path, location)
                    if isinstance(payload, dict) and payload.get("format") == FORMAT:
                        reason = shard_files.verify_parts(self.directory, payload.get("parts", []))
                        if reason is None:
                            return path, payload
                    else:
                        reason = "not a phalanx checkpoint"
                except UnsafeCheckpointError:
                    raise  # a planted file is reported, not skipped
                except Exception as exc:  # truncated zip, I/O error, ...
                    reason = f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            broken.append(f"{path.name}: {reason}")
            logger.warning("checkpoint %s is %s; falling back to the previous one", path, reason)
        if broken:
            raise CheckpointCorruptError(explain(
                f"no complete checkpoint left in {self.directory}", rank=0, seen="; ".join(broken),
                expected="at least one complete checkpoint",
                fix="Restore the files from a backup, or start fresh in another directory (keep=2 or more "
                    "leaves a previous checkpoint to fall back on)."))
        return None

    def _load_chosen(self, sequence: int, location) -> tuple[Path, dict]:
        path = self.directory / atomic_files.CHECKPOINT_NAME.format(sequence)
        try:
            return path, atomic_files.load_safely(path, location)
        except FileNotFoundError:
            raise CheckpointError(explain(
                f"rank 0 resumes from {path}, which this rank cannot see", rank=world.group_rank(), seen="no such file",
                expected="the checkpoint directory visible to every rank",
                fix="Put the directory on a file system shared by all nodes.")) from None

    def _apply(self, payload: dict, state: dict, path: Path) -> None:
        saved = payload["entries"]
        missing = [name for name in state if name not in saved]
        unexpected = [name for name in saved if name not in state]
        changed = [f"{name} ({saved[name]['kind']} -> {_kind(name, value)})" for name, value in state.items()
                   if name in saved and saved[name]["kind"] != _kind(name, value)]
        if missing or unexpected or changed:
            raise CheckpointMismatchError(explain(
                f"checkpoint {path} holds other entries than the state it is restored into", rank=world.group_rank(),
                seen=f"missing entries {missing}, unexpected entries {unexpected}, changed kinds {changed}",
                expected=f"the entries {sorted(saved)}",
                fix="Restore into a state dict with the same names as the one saved, or start in another directory."),
                entry="", missing=missing, unexpected=unexpected)
        parts = shard_files.load_parts(self.directory, payload["parts"]) if payload.get("parts") else []
        for name, value in state.items():
            entry = saved[name]
            if entry.get("sharded"):  # written by every rank: put together again from every part
                state_of = shard_files.restored(value, entry["state"], [p[name] for p in parts], unwrap)
                entry = {**entry, "state": state_of}
            if entry["kind"] == "model":
                _load_model(name, value, entry["state"], path)
            elif entry["kind"] == "object":
                try:
                    value.load_state_dict(entry["state"])
                except (ValueError, KeyError, RuntimeError, TypeError) as exc:
                    raise CheckpointMismatchError(explain(
                        f"state[{name!r}] could not load its state from {path}", rank=world.group_rank(),
                        seen=f"{type(exc).__name__}: {exc}", expected=f"a {type(value).__name__} like the one saved",
                        fix="Build the object as it was when the checkpoint was written."), entry=name) from exc
            else:
                state[name] = entry["state"]

    def _restore_random_states(self, saved: list, device: torch.device) -> None:
        rank = world.group_rank()
        if rank < len(saved):
            random_state.restore(saved[rank], device)
        else:  # more ranks than were saved: a stream of its own, derived from a saved one
            random_state.reseed_derived(saved[rank % len(saved)], rank, device)
        if rank == 0 and len(saved) != world.group_size():
            logger.info("world size changed from %d to %d: ranks below %d got their saved random states, "
                              "the others streams derived from them", len(saved), world.group_size(), len(saved))


def _load_model(name: str, model: torch.nn.Module, saved: dict, path: Path) -> None:
    module = unwrap(model)
    expected = module.state_dict()
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    mismatched = [(k, tuple(saved[k].shape), tuple(expected[k].shape)) for k in expected
                  if k in saved and isinstance(saved[k], torch.Tensor) and isinstance(expected[k], torch.Tensor)
                  and saved[k].shape != expected[k].shape]
    if missing or unexpected or mismatched:
        shapes = [f"{k}: {s} in the checkpoint, {e} in the model" for k, s, e in mismatched]
        raise CheckpointMismatchError(explain(
            f"checkpoint {path} holds a different model than state[{name!r}]", rank=world.group_rank(),
            seen=f"missing keys {_listed(missing)}, unexpected keys {_listed(unexpected)}, "
                 f"shape mismatches {_listed(shapes)}",
            expected=f"the {len(expected)} keys and shapes of {type(module).__name__}.state_dict()",
            fix="Build the model as it was when the checkpoint was written, or start in another directory."),
            entry=name, missing=missing, unexpected=unexpected, mismatched=mismatched)
    shard_files.load_model_state(module, saved)

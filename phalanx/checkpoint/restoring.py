"""The restoring half of the Checkpointer: which file to trust, and loading it into the user's objects.

Rank 0 picks the newest checkpoint that is complete (size and CRC-32 as the manifest says, parts
included) and loads, falling back past damaged ones; every rank then loads that file with
weights_only=True onto its own device and fills `state`, each entry checked against what was saved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, UnsafeCheckpointError, explain
from ..log import logger
from ..world import group as world
from . import atomic_files, random_state, shard_files
from .entries import kind_of, listed, unwrap

FORMAT = 1


def map_location(device: torch.device):
    """Tensors saved from any GPU go to this rank's device; tensors saved on the CPU stay there."""
    if device.type == "cpu":
        return "cpu"

    def onto_own_device(storage, location: str):
        if location == "cpu":
            return storage
        return torch.serialization.default_restore_location(storage, str(device))

    return onto_own_device


def choose(directory: Path, location) -> tuple[Path, dict] | None:
    """Rank 0: the newest checkpoint that is complete and loads, falling back past broken ones."""
    listed = atomic_files.read_manifest(directory)
    if listed is None:
        present = atomic_files.checkpoint_files(directory)
        if not present:
            return None
        logger.warning("no readable %s in %s: the checkpoints cannot be checked for truncation; "
                             "trying the newest first", atomic_files.MANIFEST, directory)
        candidates = [(directory / present[s], None) for s in sorted(present, reverse=True)]
    else:
        candidates = [(directory / e.file, e) for e in reversed(listed)]
    broken = []
    for path, entry in candidates:
        reason = atomic_files.verify(directory, entry) if entry is not None else None
        if reason is None:
            try:
                payload = atomic_files.load_safely(path, location)
                if isinstance(payload, dict) and payload.get("format") == FORMAT:
                    reason = shard_files.verify_parts(directory, payload.get("parts", []))
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
            f"no complete checkpoint left in {directory}", rank=0, seen="; ".join(broken),
            expected="at least one complete checkpoint",
            fix="Restore the files from a backup, or start fresh in another directory (keep=2 or more "
                "leaves a previous checkpoint to fall back on)."))
    return None


def load_chosen(directory: Path, sequence: int, location) -> tuple[Path, dict]:
    path = directory / atomic_files.CHECKPOINT_NAME.format(sequence)
    try:
        return path, atomic_files.load_safely(path, location)
    except FileNotFoundError:
        raise CheckpointError(explain(
            f"rank 0 resumes from {path}, which this rank cannot see", rank=world.group_rank(), seen="no such file",
            expected="the checkpoint directory visible to every rank",
            fix="Put the directory on a file system shared by all nodes.")) from None


def apply(directory: Path, payload: dict, state: dict, path: Path) -> None:
    saved = payload["entries"]
    missing = [name for name in state if name not in saved]
    unexpected = [name for name in saved if name not in state]
    changed = [f"{name} ({saved[name]['kind']} -> {kind_of(name, value)})" for name, value in state.items()
               if name in saved and saved[name]["kind"] != kind_of(name, value)]
    if missing or unexpected or changed:
        raise CheckpointMismatchError(explain(
            f"checkpoint {path} holds other entries than the state it is restored into", rank=world.group_rank(),
            seen=f"missing entries {missing}, unexpected entries {unexpected}, changed kinds {changed}",
            expected=f"the entries {sorted(saved)}",
            fix="Restore into a state dict with the same names as the one saved, or start in another directory."),
            entry="", missing=missing, unexpected=unexpected)
    parts = shard_files.load_parts(directory, payload["parts"]) if payload.get("parts") else []
    for name, value in state.items():
        entry = saved[name]
        if entry.get("sharded"):  # written by every rank: put together again from every part
            state_of = shard_files.restored(value, entry["state"], [p[name] for p in parts], unwrap)
            entry = {**entry, "state": state_of}
        if entry["kind"] == "model":
            load_model(name, value, entry["state"], path)
        elif entry["kind"] == "object":
            try:
                value.load_state_dict(entry["state"])
            except (ValueError, KeyError, RuntimeError, TypeError) as exc:
                raise CheckpointMismatchError(explain(
                    f"state[{name!r}] could not load its state from {path}", rank=world.group_rank(),
                    seen=f"{type(exc).__name__}: {exc}", expected=f"a {type(value).__name__} like the one saved",
                    fix="Build the object as it was when the checkpoint was written."), entry=name) from exc
        else:
            # Staged through host memory in the background: the GPU tensors among the values go back to a GPU.
            state[name] = onto(entry["state"], _gpu()) if entry.get("on_gpu") else entry["state"]


def _gpu() -> torch.device:
    """This rank's GPU (the CPU where there is none: a GPU run restored on a CPU machine)."""
    if world.is_initialized():
        return world.device()
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def onto(value, device: torch.device):
    """`value` (tensors in lists, tuples and dicts) with every tensor moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, onto(v, device)) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return type(value)(onto(v, device) for v in value)
    return value


def restore_random_states(saved: list, device: torch.device, state: dict) -> None:
    """Each rank's generators (and its entries' own random states: random_state.capture) as that rank saved them; a
    rank the checkpoint did not have gets streams derived from a saved one, its entries rank 0's (in their state)."""
    rank = world.group_rank()
    if rank < len(saved):
        random_state.restore(saved[rank], device)
        random_state.restore_entries(saved[rank], state)
    else:  # more ranks than were saved: a stream of its own, derived from a saved one
        random_state.reseed_derived(saved[rank % len(saved)], rank, device)
    if rank == 0 and len(saved) != world.group_size():
        logger.info("world size changed from %d to %d: ranks below %d got their saved random states, "
                          "the others streams derived from them", len(saved), world.group_size(), len(saved))


def load_model(name: str, model: torch.nn.Module, saved: dict, path: Path) -> None:
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
            seen=f"missing keys {listed(missing)}, unexpected keys {listed(unexpected)}, "
                 f"shape mismatches {listed(shapes)}",
            expected=f"the {len(expected)} keys and shapes of {type(module).__name__}.state_dict()",
            fix="Build the model as it was when the checkpoint was written, or start in another directory."),
            entry=name, missing=missing, unexpected=unexpected, mismatched=mismatched)
    shard_files.load_model_state(module, saved)

"""Checkpoint entries held in shards: every rank writes its own part, the checkpoint file names them.

A model sharded with shard="parameters" (FSDP2's DTensors) and its optimizer are saved without
gathering anything. Each rank writes the shards it holds into a part file of its own (atomically);
the entry in rank 0's checkpoint file keeps the state dict with every DTensor replaced by a
placeholder (its global shape and dtype), and the checkpoint lists every part with its size and
CRC-32. The checkpoint exists once rank 0 has written it, after every part was written: a crash
before leaves the previous one, whose parts are still there.

Restoring, at any world size and level, puts each whole tensor back together from the parts
(memory-mapped, so a rank reads only what it copies), and the state dict loads as an unsharded one.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import CheckpointWriteError, explain
from ..log import logger
from ..sharding.dtensor import from_local_like, is_dtensor, local_region
from ..world import generation
from ..world import group as world
from . import atomic_files

PART_NAME = "ckpt-{:08d}.part-{:05d}.pt"
_PART_RE = re.compile(r"^ckpt-(\d{8,})\.part-\d{5}\.pt(\.json|\.failed|\.lost)?$")  # a part, or a writer's note
PLACEHOLDER = "__phalanx_shard__"


def split(state):
    """(`state` with each DTensor replaced by a placeholder, {placeholder key: (global offset, local tensor)}).
    Every rank walks the same structure in the same order, so the keys agree across ranks."""
    local: dict[str, dict] = {}

    def walk(value):
        if is_dtensor(value):
            _, offset = local_region(value)
            key = str(len(local))
            local[key] = {"offset": offset, "tensor": value.to_local().detach().cpu()}
            return {PLACEHOLDER: key, "shape": list(value.shape), "dtype": str(value.dtype).split(".")[-1]}
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(state), local


def assemble(skeleton, parts: list[dict], like=None):
    """The state dict `split` made the skeleton of, its tensors put back together from every part.

    `like` mirrors the structure with this rank's DTensors where it keeps shards (a FSDP2 model's state
    dict, or the optimizer's parameters): there only this rank's region is read, and a DTensor cut like
    the target comes back. Elsewhere the whole tensor does."""
    def fill(value, target):
        if isinstance(value, dict) and PLACEHOLDER in value:
            dtype, pieces = getattr(torch, value["dtype"]), [part[value[PLACEHOLDER]] for part in parts]
            if is_dtensor(target) and list(target.shape) == value["shape"]:
                shape, offset = local_region(target)
                local = _read_region(pieces, offset, torch.empty(shape, dtype=dtype))
                return from_local_like(local.to(target.device), target)
            return _read_region(pieces, [0] * len(value["shape"]), torch.empty(value["shape"], dtype=dtype))
        if isinstance(value, dict):
            return type(value)((k, fill(v, target.get(k) if isinstance(target, dict) else None))
                               for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v, None) for v in value)
        return value

    return fill(skeleton, like)


def _read_region(pieces: list[dict], offset: list[int], out: torch.Tensor) -> torch.Tensor:
    """Fill `out`, the region of a whole tensor starting at `offset`, from the parts that overlap it."""
    for piece in pieces:
        tensor, start = piece["tensor"], piece["offset"]
        if not tensor.numel():
            continue
        lows = [max(s, o) for s, o in zip(start, offset)]
        highs = [min(s + n, o + m) for s, n, o, m in zip(start, tensor.shape, offset, out.shape)]
        if any(high <= low for low, high in zip(lows, highs)):
            continue
        out[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, offset))].copy_(
            tensor[tuple(slice(lo - s, hi - s) for lo, hi, s in zip(lows, highs, start))])
    return out


def shard_targets(value, skeleton, unwrap):
    """What `assemble` should cut like, for restoring into `value`: its DTensors (FSDP2 at this rank's world
    size), so no rank reads more than its shards; None when `value` keeps whole tensors."""
    if dtensor_state(value, unwrap) is None:
        return None
    if isinstance(value, torch.nn.Module):
        return unwrap(value).state_dict()
    params = [p for group in value.optimizer.param_groups for p in group["params"]]
    return {"state": {index: {key: params[index] for key in entry}
                      for index, entry in skeleton.get("state", {}).items() if index < len(params)}}


def part_entries(sequence: int, sizes: list[tuple[int, int]]) -> list[dict]:
    """The checkpoint's list of its parts: file, size and CRC-32 of each rank's."""
    return [{"file": PART_NAME.format(sequence, rank), "size": size, "crc32": crc}
            for rank, (size, crc) in enumerate(sizes)]


def verify_parts(directory: Path, listed: list[dict]) -> str | None:
    """None if every part matches its listing, else what is wrong with the first that does not."""
    for part in listed:
        reason = atomic_files.verify(directory, atomic_files.ManifestEntry(part["file"], 0, part["size"],
                                                                           part["crc32"]))
        if reason is not None:
            return f"its part {part['file']} is {reason}"
    return None


def load_parts(directory: Path, listed: list[dict]) -> list[dict]:
    """Every rank's part, memory-mapped (weights_only: no code runs)."""
    return [torch.load(directory / part["file"], map_location="cpu", weights_only=True, mmap=True)
            for part in listed]


def remove_parts_except(directory: Path, keep: set[int]) -> None:
    """Delete the part files (and their writers' notes) of every checkpoint whose sequence is not in `keep`
    (pruned, or never completed)."""
    for path in directory.iterdir():
        match = _PART_RE.match(path.name)
        if match and int(match.group(1)) not in keep:
            path.unlink(missing_ok=True)


def part_sequences(directory: Path) -> list[int]:
    """The sequence numbers of the part files (and notes) present in `directory`."""
    if not directory.is_dir():
        return []
    return [int(match.group(1)) for path in directory.iterdir() if (match := _PART_RE.match(path.name))]


def write_parts(directory: Path, sequence: int, local: dict) -> list[dict]:
    """Every rank writes its shards (atomically); returns the list of parts, or raises on every rank if
    any rank could not write its own."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / PART_NAME.format(sequence, world.group_rank())
    try:
        size, crc = atomic_files.write_atomic(path, lambda file: torch.save(local, file))
        mine = [1, size, crc]
    except OSError as exc:
        logger.error("could not write checkpoint part %s: %s", path, exc)
        mine = [0, 0, 0]
    report = torch.tensor(mine, dtype=torch.int64, device=world.collective_device())
    everyone = [report]
    if world.group_size() > 1:
        everyone = [torch.empty_like(report) for _ in range(world.group_size())]
        generation.wait_for(dist.all_gather(everyone, report, group=world.live_group(), async_op=True),
                            "a checkpoint part's outcome")
    failed = [rank for rank, row in enumerate(everyone) if not int(row[0])]
    if failed:
        path.unlink(missing_ok=True)
        raise CheckpointWriteError(explain(
            f"ranks {failed} could not write their part of a checkpoint in {directory}",
            rank=world.group_rank(), seen="a failed write", expected="every rank's part written",
            fix="Free space or fix permissions; the previous checkpoint is intact."))
    return part_entries(sequence, [(int(row[1]), int(row[2])) for row in everyone])


def is_optimizer_view(value) -> bool:
    """A sharded model's optimizer: its state_dict(to=...) is collective."""
    try:
        from ..sharding.optimizer_view import OptimizerView
    except ImportError:  # the engine is optional for checkpointing
        return False
    return isinstance(value, OptimizerView)


def dtensor_state(value, unwrap) -> dict | None:
    """The state dict of a model whose parameters are FSDP2 shards, or of its optimizer (DTensors in it);
    None for anything else."""
    if is_optimizer_view(value) and any(is_dtensor(p) for g in value.param_groups for p in g["params"]):
        return value.optimizer.state_dict()
    if isinstance(value, torch.nn.Module) and any(is_dtensor(p) for p in unwrap(value).parameters()):
        return unwrap(value).state_dict()
    return None


def restored(value, skeleton, parts: list[dict], unwrap):
    """A sharded entry put back together for restoring into `value` (its shards only, where it keeps shards)."""
    return assemble(skeleton, parts, shard_targets(value, skeleton, unwrap))


def load_model_state(module: torch.nn.Module, saved: dict) -> None:
    """`module.load_state_dict(saved)`; into FSDP2 shards (shard="parameters") each rank keeps its part."""
    if any(is_dtensor(p) for p in module.parameters()):
        from ..sharding.full_state import load_full_model_state  # the engine is needed only here
        load_full_model_state(module, saved)
    else:
        module.load_state_dict(saved)

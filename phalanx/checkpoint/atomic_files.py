"""Files that are never seen half-written, and loads that never run code.

`write_atomic` writes to a hidden temporary name in the target directory, fsyncs it, renames it into
place and fsyncs the directory: after a crash at any instant the path holds the old file or the new
one, never a mix. The manifest records each checkpoint's size and CRC-32 (computed while writing),
so truncation and corruption are found before loading. `load_safely` is `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch

from ..errors import UnsafeCheckpointError, explain

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "phalanx.checkpoint.manifest/1"
# CRC-32 finds accidental damage (truncation, flipped bits) at ~1 GB/s, a third of SHA-256's time;
# a deliberate edit is not its job: whoever can write the file can write the manifest too.
CHECKPOINT_NAME = "ckpt-{:08d}.pt"
_CHECKPOINT_RE = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TEMP_RE = re.compile(r"^\..+\.tmp$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class ManifestEntry:
    """One complete checkpoint: its file name in the directory, sequence number, size and CRC-32."""

    file: str
    sequence: int
    size: int
    crc32: int


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.crc32 = 0
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as "unexpected pos": keep the cause

    def write(self, data) -> int:
        view = memoryview(data)
        try:
            self.file.write(view)
        except OSError as exc:
            self.error = exc
            raise
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.file.flush()


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (the new name survives a power cut)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> tuple[int, int]:
    """Write `path` through `write(file)` so that readers see the old file or the whole new one.

    Returns (size in bytes, CRC-32) of what was written.

    >>> write_atomic(Path("/tmp/x.pt"), lambda f: torch.save({"a": 1}, f))   # doctest: +SKIP
    (1012, 2714581431)
    """
    path = Path(path)
    temp = temp_name(path)
    writer = None
    try:
        with open(temp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())  # the bytes reach the disk before the name points at them
        os.replace(temp, path)
    except BaseException as exc:
        temp.unlink(missing_ok=True)
        if writer is not None and writer.error is not None and exc is not writer.error:
            raise writer.error from exc  # the disk's answer (no space left), not torch's "unexpected pos"
        raise
    fsync_directory(path.parent)
    return writer.size, writer.crc32


def checkpoint_files(directory: Path) -> dict[int, str]:
    """Sequence number -> file name of every checkpoint file present, listed or not."""
    found = {}
    if directory.is_dir():
        for name in os.listdir(directory):
            match = _CHECKPOINT_RE.match(name)
            if match:
                found[int(match.group(1))] = name
    return found


def sequence_of(name: str) -> int:
    """The sequence number in a checkpoint file name ('ckpt-00000007.pt' -> 7)."""
    return int(_CHECKPOINT_RE.match(name).group(1))


def remove_stale_temps(directory: Path) -> None:
    """Delete temporary files a crashed writer left behind (only one job writes a directory)."""
    for name in os.listdir(directory):
        if _TEMP_RE.match(name):
            (directory / name).unlink(missing_ok=True)


def read_manifest(directory: Path) -> list[ManifestEntry] | None:
    """The complete checkpoints, oldest first; None when there is no readable manifest."""
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_text())
        if data.get("format") != MANIFEST_FORMAT:
            return None
        return [ManifestEntry(str(e["file"]), int(e["sequence"]), int(e["size"]), int(e["crc32"]))
                for e in data["checkpoints"]]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError):  # unreadable JSON or another layout
        return None


def write_manifest(directory: Path, entries: list[ManifestEntry]) -> None:
    text = json.dumps({"format": MANIFEST_FORMAT, "checkpoints": [asdict(e) for e in entries]}, indent=1)
    write_atomic(directory / MANIFEST, lambda f: f.write(text.encode()))


def verify(directory: Path, entry: ManifestEntry) -> str | None:
    """None if the file matches its manifest entry, else why not (missing, truncated, corrupted)."""
    path = directory / entry.file
    try:
        size = path.stat().st_size
        if size != entry.size:
            return f"truncated or overwritten ({size} bytes, the manifest says {entry.size})"
        crc32 = 0
        with open(path, "rb") as file:
            while chunk := file.read(_CHUNK):
                crc32 = zlib.crc32(chunk, crc32)
    except FileNotFoundError:
        return "missing"
    if crc32 != entry.crc32:
        return f"corrupted (CRC-32 {crc32:08x}, the manifest says {entry.crc32:08x})"
    return None


def load_safely(path: Path, map_location):
    """`torch.load(path, weights_only=True)`; a file that needs code to load raises UnsafeCheckpointError."""
    try:
        try:  # memory-mapped: a rank that keeps a slice of a tensor (a shard) reads only that slice's pages
            return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location=map_location, weights_only=True)  # torch's legacy format
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise UnsafeCheckpointError(explain(
            f"refused to load {path}: it holds objects whose loading would run code", seen=reason,
            expected="tensors and plain Python values only (what phalanx.Checkpointer writes)",
            fix="Nothing from the file was executed. Do not load files from unknown sources; if you trust this one, "
                "load it yourself with torch.load(path, weights_only=False) and save its state_dict()s again."),
            path=str(path)) from None

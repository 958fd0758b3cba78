"""Where rank 0 puts StepLog records: `steps.jsonl` and TensorBoard event files, each flushed per write.

steps.jsonl gets one JSON object per line, appended and flushed. On resume it is trimmed to the
records before the steps about to be redone; a log that cannot know its step keeps the file and starts
another beside it (steps.2.jsonl, ...). TensorBoard events are written with tensorboardX's
protobuf classes (an extra: `pip install phalanx[log]`); a file opened after a resume purges the
steps it will write again (tensorboardX's `purge_step` event), so curves never overlap.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from pathlib import Path

from ..errors import TensorBoardUnavailableError, explain
from ..log import logger

JSONL_NAME = "steps.jsonl"
# The record's fields drawn as TensorBoard scalars, under these tags.
SCALARS = {"loss": "train/loss", "samples_per_s": "throughput/samples_per_s", "tokens_per_s": "throughput/tokens_per_s",
           "step_time": "step_time/wall", "step_time_min": "step_time/busy_min",
           "step_time_median": "step_time/busy_median", "step_time_max": "step_time/busy_max",
           "slowest_rank": "step_time/slowest_rank", "exchange_exposed": "step_time/exchange_exposed",
           "data_wait": "step_time/data_wait", "peak_memory": "memory/peak_bytes", "lr": "train/lr", "mfu": "train/mfu"}
INSTALL_HINT = "pip install 'phalanx[log]' (or pip install tensorboardX==2.6.5)"


def read_records(path) -> list[dict]:
    """The records of a steps.jsonl, skipping a last line a kill cut short."""
    records = []
    try:
        with open(path) as handle:
            for text in handle:
                try:
                    records.append(json.loads(text))
                except ValueError:
                    continue
    except FileNotFoundError:
        return []
    return records


def jsonl_files(directory) -> list[Path]:
    """steps.jsonl and the files started beside it (steps.2.jsonl, steps.3.jsonl, ...), oldest first."""
    directory = Path(directory)
    numbered = []
    for path in directory.glob("steps.*.jsonl"):
        middle = path.name[len("steps."):-len(".jsonl")]
        if middle.isdigit():
            numbered.append((int(middle), path))
    first = [directory / JSONL_NAME] if (directory / JSONL_NAME).exists() else []
    return first + [path for _, path in sorted(numbered)]


def file_beside(directory) -> Path:
    """The name of a new records file beside the ones in `directory` (which are kept)."""
    files = jsonl_files(directory)
    if not files:
        return Path(directory) / JSONL_NAME
    last = files[-1].name[len("steps."):-len(".jsonl")]
    return Path(directory) / f"steps.{int(last) + 1 if last.isdigit() else 2}.jsonl"


def last_step(path) -> int | None:
    """The step of the last record of a steps.jsonl, or None when it holds none."""
    steps = [r["step"] for r in read_records(path) if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def trim(path, keep_through: int) -> int:
    """Keep the records of steps <= keep_through (atomically: temporary file, rename); returns how many went."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_records(path)
    kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= keep_through]
    dropped = len(records) - len(kept)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in kept)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return dropped


class JsonlFile:
    """Appends records to steps.jsonl through one open handle; each append is flushed to the OS before it
    returns (a killed process loses nothing written; an fsync per record would cost milliseconds on a disk)."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = None

    def write(self, records: list[dict]) -> None:
        if self.handle is None:
            self.handle = open(self.path, "a")
        self.handle.writelines(json.dumps(r) + "\n" for r in records)
        self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def tensorboard_module(required: bool):
    """tensorboardX's protobuf modules (event_pb2, summary_pb2), or None: with `required`, its absence is a typed
    error."""
    try:
        from tensorboardX.proto import event_pb2, summary_pb2
    except ImportError:
        if required:
            raise TensorBoardUnavailableError(explain(
                "StepLog(tensorboard=True) needs tensorboardX to write TensorBoard event files",
                seen="no module named 'tensorboardX'", expected="tensorboardX installed",
                fix=f"Install it: {INSTALL_HINT}; or pass tensorboard=None to log to steps.jsonl and the "
                    f"terminal only.")) from None
        return None
    return event_pb2, summary_pb2


_warned = False


def warn_no_tensorboard() -> None:
    """Once per process: TensorBoard output is off because tensorboardX is missing."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("StepLog: tensorboardX is not installed, so no TensorBoard event files are written "
                       "(steps.jsonl and the terminal line are). To have them: %s", INSTALL_HINT)


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C. google-crc32c's C code when installed (the log extra), else tensorboardX's
    Python one (about 150 us a record on the bench machine, against 1 us)."""
    global _crc32c
    if _crc32c is None:
        try:
            from google_crc32c import value as _crc32c
        except ImportError:
            from tensorboardX.crc32c import crc32c as _crc32c
    crc = _crc32c(data) & 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


_crc32c = None
_files = 0  # event files this process opened


class TensorBoardFile:
    """An event file of its own per process, opened at the first write: one Event per record holding all its
    scalars, framed as TFRecords and flushed at each write. tensorboardX's SummaryWriter would cost 3-5 ms of
    CPU per record here (an add_scalar per field, a writer thread, a Python CRC); its protobuf classes and
    its purge_step's event are what this uses."""

    def __init__(self, directory: Path, protos):
        self.directory, (self.pb, self.summary_pb) = directory, protos
        self.handle = None

    def _open(self, purge_step: int | None) -> None:
        global _files
        _files += 1
        # tensorboardX's name (the second it was made, the host) and a suffix of its own: TensorBoard reads a
        # folder's files in name order, and two files of the same second must not be one.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{_files:04d}"
        self.handle = open(self.directory / name, "ab")
        pb = self.pb
        self._append(pb.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # what purge_step=s writes: TensorBoard drops the earlier events of steps >= s
            self._append(pb.Event(wall_time=time.time(), step=purge_step,
                                  session_log=pb.SessionLog(status=pb.SessionLog.START)))

    def _append(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self.handle.write(header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data)))

    def write(self, records: list[dict], purge_step: int | None) -> None:
        """Append `records`; the first write opens the file, purging the steps from `purge_step` on that earlier
        files hold (None: purge nothing, the step count is not known to follow theirs)."""
        if self.handle is None:
            self._open(purge_step)
        Summary = self.summary_pb.Summary
        for record in records:
            values = [Summary.Value(tag=tag, simple_value=record[field]) for field, tag in SCALARS.items()
                      if record.get(field) is not None]
            self._append(self.pb.Event(wall_time=record["time"], step=record["step"],
                                       summary=Summary(value=values)))
        self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None

"""Where rank 0 puts StepLog records: `steps.jsonl` and TensorBoard event files, each flushed per write.

steps.jsonl gets one JSON object per line, appended and flushed (fsync'd too: a node that loses power
keeps what was logged). On resume it is trimmed to the records before the steps about to be redone.
TensorBoard events go through tensorboardX (an extra: `pip install phalanx[log]`); a writer opened
after a resume purges the steps it will write again (`purge_step`), so curves never overlap.
"""

from __future__ import annotations

import json
import os
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
    """Appends records to steps.jsonl; each append is flushed and fsync'd before it returns."""

    def __init__(self, directory: Path):
        self.path = directory / JSONL_NAME

    def write(self, records: list[dict]) -> None:
        with open(self.path, "a") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
            handle.flush()
            os.fsync(handle.fileno())


def tensorboard_module(required: bool):
    """tensorboardX's SummaryWriter class, or None: with `required`, its absence is a typed error."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if required:
            raise TensorBoardUnavailableError(explain(
                "StepLog(tensorboard=True) needs tensorboardX to write TensorBoard event files",
                seen="no module named 'tensorboardX'", expected="tensorboardX installed",
                fix=f"Install it: {INSTALL_HINT}; or pass tensorboard=None to log to steps.jsonl and the "
                    f"terminal only.")) from None
        return None
    return SummaryWriter


_warned = False


def warn_no_tensorboard() -> None:
    """Once per process: TensorBoard output is off because tensorboardX is missing."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("StepLog: tensorboardX is not installed, so no TensorBoard event files are written "
                       "(steps.jsonl and the terminal line are). To have them: %s", INSTALL_HINT)


_writers = 0  # TensorBoard writers this process opened


class TensorBoardFile:
    """A tensorboardX writer opened at the first write, purging from the first step this process writes."""

    def __init__(self, directory: Path, writer_class):
        self.directory, self.writer_class = directory, writer_class
        self.writer = None

    def write(self, records: list[dict], first_step: int) -> None:
        if self.writer is None:
            # flush_secs is moot (flush() below after each write); purge_step hides the events of steps from
            # first_step on that an earlier attempt wrote: TensorBoard drops them when it reads this file.
            # The suffix: tensorboardX names a file by the second it was made, and opens it with "wb" (a second
            # writer of the same second would empty the first's file); TensorBoard reads files in name order.
            global _writers
            _writers += 1
            self.writer = self.writer_class(logdir=str(self.directory), purge_step=first_step, flush_secs=3600,
                                            filename_suffix=f".{os.getpid()}.{_writers:04d}")
        for record in records:
            for field, tag in SCALARS.items():
                value = record.get(field)
                if value is not None:
                    self.writer.add_scalar(tag, value, global_step=record["step"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

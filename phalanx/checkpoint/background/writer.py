"""The background writer: a process of its own that writes, fsyncs and commits what a save staged.

It is forked from the training process once the staging buffer exists (so it shares its pages) and
serves one job at a time: write this rank's part of the checkpoint (atomically) and a note of its size
and CRC-32 beside it; on rank 0, wait for every rank's note, then write the checkpoint file listing
the parts, the manifest, and prune, as the synchronous save does (`commit`). A process, not a thread:
serializing and hashing hold the GIL, which would slow the training loop's Python for as long.

It dies with the training process (PR_SET_PDEATHSIG): a SIGKILLed rank leaves no writer behind, only a
temporary file, and the previous checkpoint is the newest complete one. It ignores stop signals: the
agreed stop waits for the write in flight and commits it.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import select
import signal
import struct
import time
from pathlib import Path

import torch

from ...errors import CheckpointWriteError, explain
from ...log import logger
from .. import atomic_files, shard_files
from .staging import rebuild

_HEADER = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1
_POLL = 0.05  # seconds between checks that the writer is alive, while waiting for its answer
_NICENESS = 10


def commit(directory: Path, payload: dict, keep: int, protect: int | None = None) -> tuple[Path, int]:
    """Write `payload` as checkpoint number payload["sequence"] (atomically), list it in the manifest (after the
    file: a crash in between leaves the previous manifest, whose files are all there), prune beyond `keep`, but
    for checkpoint `protect` (the newest the replica audit vouches for: checkpoint/audit_trail.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_files.remove_stale_temps(directory)
    listed = atomic_files.read_manifest(directory) or []
    sequence = payload["sequence"]
    path = directory / atomic_files.CHECKPOINT_NAME.format(sequence)
    size, crc32 = atomic_files.write_atomic(path, lambda file: torch.save(payload, file))
    every = listed + [atomic_files.ManifestEntry(path.name, sequence, size, crc32)]
    kept = [e for e in every[:-keep] if e.sequence == protect] + every[-keep:]
    atomic_files.write_manifest(directory, kept)
    keep_names = {e.file for e in kept}
    for name in atomic_files.checkpoint_files(directory).values():
        if name not in keep_names:
            (directory / name).unlink(missing_ok=True)
    shard_files.remove_parts_except(directory, {e.sequence for e in kept})
    return path, size


# -- the writer process -----------------------------------------------------------------------------

def _send(fd: int, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _receive(fd: int):
    """The next message on `fd`, or None at its end (the other side is gone)."""
    def exactly(count: int) -> bytes | None:
        chunks = []
        while count:
            chunk = os.read(fd, min(count, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    header = exactly(_HEADER.size)
    if header is None:
        return None
    body = exactly(_HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _note(directory: Path, sequence: int, rank: int, suffix: str, content: dict) -> None:
    path = directory / (shard_files.PART_NAME.format(sequence, rank) + suffix)
    text = json.dumps(content).encode()
    atomic_files.write_atomic(path, lambda file: file.write(text))


def note_failed(directory, sequence: int, rank: int, cause: str, lost: bool = False) -> None:
    """Best effort: tell rank 0's writer that rank `rank`'s part of checkpoint `sequence` will not come. `lost`:
    that rank was lost (live recovery), said by a rank left: the checkpoint is given up, not failed."""
    try:
        _note(Path(directory), sequence, rank, ".lost" if lost else ".failed", {"cause": cause})
    except OSError:
        pass


class PartLost(Exception):
    """A part of the checkpoint being committed will never come: its rank was lost (live recovery)."""


def _wait_for_parts(directory: Path, sequence: int, world_size: int, timeout: float, parent: int) -> list[dict]:
    """Rank 0's writer: every rank's note of its part (size, CRC-32), once all are written."""
    sizes, deadline, pause = {}, time.monotonic() + timeout, 0.001
    while len(sizes) < world_size:
        for rank in range(world_size):
            if rank in sizes:
                continue
            base = directory / shard_files.PART_NAME.format(sequence, rank)
            failed = base.with_name(base.name + ".failed")
            if failed.exists():
                cause = json.loads(failed.read_text()).get("cause", "?")
                raise CheckpointWriteError(explain(f"rank {rank} could not write its part {base}", rank=0,
                                                   seen=cause, fix="See that rank's error."))
            lost = base.with_name(base.name + ".lost")
            try:
                note = json.loads(base.with_name(base.name + ".json").read_text())
                sizes[rank] = (int(note["size"]), int(note["crc32"]))
            except (FileNotFoundError, ValueError):  # not yet written
                if lost.exists():  # checked after the part's note: a part written before its rank was lost counts
                    raise PartLost(f"rank {rank} of the world that saved it was lost before its part was written: "
                                   f"{json.loads(lost.read_text()).get('cause', '?')}") from None
        if len(sizes) < world_size:
            if os.getppid() != parent:
                os._exit(1)  # the training process is gone: nobody will read the answer
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(sizes))
                raise CheckpointWriteError(explain(
                    f"the parts of checkpoint {sequence} from ranks {missing} did not arrive in {directory}",
                    rank=0, seen=f"nothing after {timeout:.0f} s", expected="every rank's part",
                    fix="Those ranks failed or stopped, or the directory is not shared by every rank."))
            time.sleep(pause)
            pause = min(pause * 2, 0.005)  # a few stat() calls: the commit need not lag the last part
    return shard_files.part_entries(sequence, [sizes[rank] for rank in range(world_size)])


def _run(job: dict, buffer) -> dict:
    directory, sequence, rank = Path(job["directory"]), job["sequence"], job["rank"]
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    written = 0
    if job["part"] is not None:
        path = directory / shard_files.PART_NAME.format(sequence, rank)
        try:
            size, crc = atomic_files.write_atomic(path, lambda file: torch.save(rebuild(job["part"], buffer), file))
            _note(directory, sequence, rank, ".json", {"size": size, "crc32": crc})
        except BaseException as exc:  # the temporary file is gone (space freed): say why to rank 0's writer
            note_failed(directory, sequence, rank, f"{type(exc).__name__}: {exc}")
            raise
        written += size
    path = None
    if job["main"] is not None:
        payload = rebuild(job["main"], buffer)
        if job["parts"]:
            try:
                payload["parts"] = _wait_for_parts(directory, sequence, job["world_size"], job["timeout"],
                                                   job["parent"])
            except PartLost as lost:  # the parts written are pruned with the next checkpoint committed
                return {"ok": False, "lost": True, "error": str(lost), "path": None, "sequence": sequence}
        path, size = commit(directory, payload, job["keep"], job.get("protect"))
        for note in directory.glob(f"ckpt-{sequence:08d}.part-*.pt.json"):
            note.unlink(missing_ok=True)
        written += size
    return {"ok": True, "seconds": time.monotonic() - started, "bytes": written, "path": str(path) if path else None}


def _serve(jobs: int, answers: int, buffer, parent: int) -> None:
    """The writer's loop: one job at a time, each answered; ends at None, or when the training process's end of
    the pipe is closed."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the pipe's end still ends the writer, between jobs
        pass
    if os.getppid() != parent:  # the parent died before the line above
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)  # a stop request is the training process's to act on
    torch.set_num_threads(1)
    try:  # where the cores are short, the training's steps go first; the write waits a little longer
        os.nice(_NICENESS)
    except OSError:
        pass
    while (job := _receive(jobs)) is not None:
        try:
            answer = _run(job, buffer)
        except BaseException as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "path": job["directory"]}
        _send(answers, answer)


def _max_fd() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


class BackgroundWriter:
    """The training process's handle on its writer: `submit` a job, `result` to wait for its answer."""

    def __init__(self, buffer):
        jobs_read, self._jobs = os.pipe()
        self._answers, answers_write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                # Only its two pipes: another writer's pipe held open here would never see its end, and the
                # training process's sockets are not the writer's to keep open.
                low, high = sorted((jobs_read, answers_write))
                os.closerange(3, low)
                os.closerange(low + 1, high)
                os.closerange(high + 1, _max_fd())
                _serve(jobs_read, answers_write, buffer, parent)
            except BaseException:
                code = 1
            finally:
                os._exit(code)  # never the parent's atexit handlers, nor its test runner's
        os.close(jobs_read)
        os.close(answers_write)
        self.pid, self._owner = pid, parent
        self.busy = False

    def submit(self, job: dict) -> None:
        _send(self._jobs, {**job, "parent": os.getpid()})
        self.busy = True

    def result(self, meanwhile=None, every: float = 0.5) -> dict:
        """Block until the job in hand is done: its answer, or why there is none (the writer died). `meanwhile()` is
        called every `every` seconds while it waits, first after one poll (a write done already costs nothing)."""
        next_call = time.monotonic() + _POLL
        while True:
            if meanwhile is not None and time.monotonic() >= next_call:
                meanwhile()
                next_call = time.monotonic() + every
            ready, _, _ = select.select([self._answers], [], [], _POLL)
            if ready:
                answer = _receive(self._answers)
                if answer is not None:
                    self.busy = False
                    return answer
            gone = self._exit_status(block=bool(ready))
            if gone is not None:
                self.busy = False
                return {"ok": False, "error": f"the background writer (pid {self.pid}) {gone}", "died": True}

    def _exit_status(self, block: bool) -> str | None:
        try:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return "ended"
        if pid == 0:
            return None
        if os.WIFSIGNALED(status):
            return f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
        return f"ended with exit code {os.WEXITSTATUS(status)}"

    def close(self) -> None:
        """End the writer (after its job in hand, if any: closing its pipe ends its loop). Idempotent."""
        if self.pid is None or os.getpid() != self._owner:
            return
        try:  # said, not only by closing the pipe: a process forked since (a DataLoader worker) holds it open too
            _send(self._jobs, None)
        except OSError:
            pass
        for fd in (self._jobs, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = None

    def __del__(self):  # its Checkpointer is gone: an idle writer ends, and is reaped
        self.close()


def report(answer: dict, rank: int, directory) -> CheckpointWriteError:
    """The typed error for a failed background write."""
    logger.error("background checkpoint write in %s failed: %s", directory, answer["error"])
    return CheckpointWriteError(explain(
        f"the background write of a checkpoint in {directory} failed", rank=rank, seen=answer["error"],
        expected="a writable directory with free space, and a writer that lives",
        fix="Free space or fix permissions, then save again (the next save starts a new writer if this one "
            "died); the previous checkpoint is intact and the newest complete one."))

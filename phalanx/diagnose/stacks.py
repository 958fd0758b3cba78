"""Every rank's Python stack on demand: faulthandler on a signal, with a fallback from /proc.

faulthandler's handler is C code that runs at signal delivery: it writes every thread's stack even
while the main thread is blocked in C or spins holding the GIL, where no Python thread could. A
signal is only sent to a process whose /proc status says it catches it (a real-time signal's
default action would kill it); one that does not, or does not answer in time, is described from
/proc (state, kernel wait channel) instead.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time

from .callsite import describe, is_library_file

STACK_SIGNAL = signal.SIGRTMIN + 6  # real-time: no library or user code of ours uses it
ANSWER_SECONDS = 2.5  # how long a rank has to write its stack
QUIET_SECONDS = 0.15
_file = None  # kept open: faulthandler writes to its descriptor at signal time


def stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.stack")


def register(path: str) -> int:
    """Dump every thread's stack to `path` whenever STACK_SIGNAL arrives; returns the signal number."""
    global _file
    if _file is not None:
        return int(STACK_SIGNAL)
    _file = open(path, "a")  # stays open for the life of the process: faulthandler writes to it
    faulthandler.register(STACK_SIGNAL, file=_file, all_threads=True, chain=False)
    return int(STACK_SIGNAL)


def unregister() -> None:
    """Stop answering the stack signal (at shutdown)."""
    global _file
    if _file is not None:
        faulthandler.unregister(STACK_SIGNAL)
        _file.close()
        _file = None


def catches(pid: int, signum: int = STACK_SIGNAL) -> bool:
    """True when process `pid` has a handler for `signum` (/proc/<pid>/status, SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def request(targets: dict[int, tuple[int, str]], timeout: float = ANSWER_SECONDS) -> dict[int, str]:
    """{rank: (pid, stack file)} -> {rank: the stack text, or a description from /proc}."""
    sizes, answers = {}, {}
    for rank, (pid, path) in targets.items():
        if not catches(pid):
            answers[rank] = fallback(pid, "the stack signal is not handled (before phalanx.init()?)")
            continue
        sizes[rank] = _size(path)
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            answers[rank] = "(the process has ended)"
            sizes.pop(rank)
    # A dump is complete once its file has grown and then stayed the same size for a moment.
    deadline, pending = time.monotonic() + timeout, dict(sizes)
    last = {rank: (size, time.monotonic()) for rank, size in sizes.items()}
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        for rank in list(pending):
            size = _size(targets[rank][1])
            if size != last[rank][0]:
                last[rank] = (size, now)
            elif size > pending[rank] and now - last[rank][1] >= QUIET_SECONDS:
                answers[rank] = _new_text(targets[rank][1], pending.pop(rank))
    for rank, offset in pending.items():
        text = _new_text(targets[rank][1], offset)
        answers[rank] = text or fallback(targets[rank][0], f"no answer to the stack signal within {timeout:g}s")
    return answers


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _new_text(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as handle:
            handle.seek(offset)
            return handle.read()
    except OSError:
        return ""


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first, as field 3 of proc(5)), or None
    when there is no such process. The name, in parentheses, may itself hold spaces or ')'."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, by /proc's parent links, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, index = [pid], 0
    while index < len(found):
        found += children.get(found[index], [])
        index += 1
    return found


def fallback(pid: int, why: str) -> str:
    """What /proc says about a process that gave no Python stack."""
    fields = stat_fields(pid)
    try:
        with open(f"/proc/{pid}/wchan") as handle:
            wchan = handle.read().strip() or "0"
    except OSError:
        wchan = None
    if not fields or wchan is None:
        return f"(no Python stack: {why}; the process has ended)"
    state = fields[0]
    meaning = {"R": "running (spinning?)", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped",
               "Z": "a zombie"}.get(state, state)
    return f"(no Python stack: {why}; /proc says: state {state} = {meaning}, kernel wait channel {wchan})"


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$', re.M)


def threads(text: str) -> dict[int, list[tuple[str, int, str]]]:
    """faulthandler's text -> {thread id: [(file, line, function), innermost first]}."""
    found = {}
    marks = list(_THREAD.finditer(text))
    for k, mark in enumerate(marks):
        block = text[mark.end():marks[k + 1].start() if k + 1 < len(marks) else len(text)]
        found[int(mark.group(2), 16)] = [(f, int(n), fn) for f, n, fn in _FRAME.findall(block)]
    return found


def main_frames(text: str, main_thread: int) -> list[tuple[str, int, str]]:
    """The main thread's frames (innermost first); without its id, the thread that runs `<module>`."""
    found = threads(text)
    if main_thread in found:
        return found[main_thread]
    for frames in found.values():
        if frames and frames[-1][2] == "<module>":
            return frames
    return next(iter(found.values()), [])


def user_location(frames: list[tuple[str, int, str]]) -> str | None:
    """'train.py:42 in __next__': the innermost frame in the user's code."""
    for filename, line, function in frames:
        if not is_library_file(filename):
            return describe(filename, line, function)
    return None

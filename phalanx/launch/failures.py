"""What `phalanx run` tells the user when workers fail: which rank failed first, and why.

When one rank dies the others fail too (their collectives lose a peer, then the agent stops them),
so the first failure has to be picked out: a crash by signal, then the earliest Python traceback,
then a plain non-zero exit, and last the ranks the agent itself stopped with SIGTERM.
"""

from __future__ import annotations

import os
import signal


def failure_traceback(failure) -> str | None:
    """The Python traceback the worker recorded in its error file, if it wrote one."""
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):
        return message.get("extraInfo", {}).get("py_callstack") or None
    return None


def _written_at(failure) -> float:
    try:
        return os.stat(failure.error_file).st_mtime
    except OSError:
        return float(failure.timestamp)


def _order(item) -> tuple:
    rank, failure = item
    if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM:
        return (0, failure.timestamp, rank)  # SIGKILL, SIGSEGV, ...: killed, not a victim of a peer
    if failure_traceback(failure):
        return (1, _written_at(failure), rank)
    if failure.exitcode > 0:
        return (2, failure.timestamp, rank)
    return (3, failure.timestamp, rank)  # stopped by the agent after another rank failed


def root_cause(failures: dict) -> tuple[int, object]:
    """(global rank, ProcessFailure) of the failure that most likely caused the others."""
    return min(failures.items(), key=_order)


def signal_name(exitcode: int) -> str:
    """The name of the signal that ended a process whose exit code is `exitcode` (negative): SIGKILL, ...; its
    number when it has no name."""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return str(-exitcode)


def describe_failure(rank: int, failure) -> str:
    """One line: 'rank 1 (pid 123) failed: ValueError: boom'."""
    who = f"rank {rank} (pid {failure.pid})"
    if failure.exitcode == -signal.SIGTERM:
        return f"{who} was stopped (SIGTERM)"
    if failure.exitcode < 0:
        name = signal_name(failure.exitcode)
        hint = " (SIGKILL usually means out of memory)" if -failure.exitcode == signal.SIGKILL else ""
        return f"{who} was killed by signal {name}{hint}"
    if failure_traceback(failure):
        return f"{who} failed: {failure.message['message']}"
    return f"{who} exited with code {failure.exitcode}"


def sweep_process_groups(leaders) -> None:
    """SIGKILL whatever is left in the process groups of these (finished) workers.

    Each worker is started as the leader of its own session, so its children share its process
    group; a worker that died leaves them behind unless someone signals the group.
    """
    for pid in leaders:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: nothing was left behind

"""Typed exceptions for everything phalanx reports to a user.

Every message names who saw the problem (the rank), what was seen, what was expected and what to
do, so a log line from one rank out of many is enough to act on.
"""

from __future__ import annotations


def explain(problem: str, *, rank: int | None = None, seen=None, expected=None, fix: str | None = None) -> str:
    """Build a message: '[rank R] problem: seen X, expected Y. fix'."""
    parts = []
    if rank is not None:
        parts.append(f"[rank {rank}] ")
    parts.append(problem)
    details = []
    if seen is not None:
        details.append(f"seen {seen}")
    if expected is not None:
        details.append(f"expected {expected}")
    if details:
        parts.append(": " + ", ".join(details))
    text = "".join(parts).rstrip(".") + "."
    if fix:
        text += " " + fix
    return text


class PhalanxError(RuntimeError):
    """Base of every error phalanx raises."""


class WorldConfigError(PhalanxError, ValueError):
    """The environment describing the world (RANK, WORLD_SIZE, MASTER_ADDR, SLURM_*, ...) is wrong."""


class MasterUnreachableError(PhalanxError, ConnectionError):
    """The rendezvous master could not be reached within the connect timeout."""


class PortInUseError(PhalanxError, OSError):
    """The master port is already taken by another process on this host."""


class RanksTimedOutError(PhalanxError, TimeoutError):
    """Some ranks did not arrive (at a barrier, or at the end of a run) within the time bound."""

    def __init__(self, message: str, missing_ranks=()):
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)


class RankFailedError(PhalanxError):
    """A rank raised or died; carries that rank's traceback."""

    def __init__(self, message: str, rank: int, traceback_text: str = "", exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text
        self.exitcode = exitcode


class PeerFailedError(PhalanxError, ConnectionError):
    """A peer rank abandoned a shared-memory exchange (it failed; its own log says why)."""

    def __init__(self, message: str, peer_rank: int | None = None):
        super().__init__(message)
        self.peer_rank = peer_rank


class PeerDiedError(PeerFailedError):
    """A peer rank's process ended (crash, SIGKILL, out of memory) while this rank waited for it."""


class CollectiveMismatchError(PhalanxError, ValueError):
    """Ranks issued different collectives (another size, dtype or order) at the same point."""

    def __init__(self, message: str, peer_rank: int | None = None):
        super().__init__(message)
        self.peer_rank = peer_rank


class ShmUnavailableError(PhalanxError):
    """The shared-memory transport cannot serve this process group (ranks on several hosts, disabled, ...)."""

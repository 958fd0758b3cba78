"""Which checkpoints the replica audit vouches for, and which it sets aside (engine/replicas/audit.py).

A checkpoint holds every rank's share of the replicated state, so one rank that drifted writes its drift into
it. A save counts as audited once an audit that agreed ran after it: the newest such save is *trusted*, and
pruning keeps it whatever `keep` says. When an audit finds the replicas apart, every save made since the last
agreement is *suspect*: rank 0 renames it `ckpt-N.pt.suspect` (kept for a look, never restored) and drops it
from the manifest, so the next `restore()` picks the trusted one, a state every rank agreed on.
"""

from __future__ import annotations

import os
import weakref

from ..engine.replicas.audit import listen
from ..log import logger
from ..world import group as world
from . import atomic_files

SUSPECT_SUFFIX = ".suspect"


class AuditTrail:
    """One Checkpointer's saves as the replica audit sees them; `trusted`: the sequence number pruning keeps."""

    def __init__(self, checkpointer):
        self._checkpointer = weakref.ref(checkpointer)
        self.trusted: int | None = None  # the newest save an agreeing audit came after (or the one restored)
        self.since: list[int] = []  # saves made after the last agreement
        listen(self)

    def saved(self, sequence: int) -> None:
        self.since.append(sequence)

    def restored(self, sequence: int) -> None:
        """Every rank loaded checkpoint `sequence`: the same state everywhere."""
        self.trusted, self.since = sequence, []

    def audit_agreed(self) -> None:
        if self.since:
            self.trusted, self.since = self.since[-1], []

    def audit_diverged(self, agreed_at: int) -> None:
        """Collective: the saves since the last agreement (step `agreed_at`) are set aside, once committed."""
        checkpointer = self._checkpointer()
        suspect, self.since = self.since, []
        if checkpointer is None or not suspect:
            return
        checkpointer.wait()  # a write in flight is committed (or failed) before it is set aside
        if world.group_rank() == 0:
            set_aside(checkpointer.directory, suspect)
            logger.warning("checkpoints %s were saved after step %d, the replicas' last agreement: set aside as "
                           "*%s; a restore picks the one before them", suspect, agreed_at, SUSPECT_SUFFIX)


def set_aside(directory, sequences: list[int]) -> None:
    """Drop checkpoints `sequences` from the manifest, then rename them to *.suspect (a crash in between leaves
    them unlisted: a restore does not pick them)."""
    listed = atomic_files.read_manifest(directory) or []
    drop = set(sequences)
    if listed:
        atomic_files.write_manifest(directory, [e for e in listed if e.sequence not in drop])
    names = atomic_files.checkpoint_files(directory)
    for sequence in drop:
        name = names.get(sequence)
        if name is not None:
            os.replace(directory / name, directory / (name + SUSPECT_SUFFIX))

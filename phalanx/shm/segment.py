"""Shared-memory segments in /dev/shm: unguessable names, owner-only files, nothing left behind.

A segment lives under a name only while the ranks of one job map it; then the name is unlinked
and the memory stays alive through the mappings alone, so even a SIGKILL leaves no file. A crash
in that short window leaves a file whose name embeds its creator's pid: the next start sweeps it.
A name also carries its host (the launcher's node): two hosts simulated on one machine (network
namespaces) share its /dev/shm, and a segment must be traceable to the one host whose ranks map it.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
import stat

SHM_DIR = "/dev/shm"
PREFIX = "phalanx-shm"
# phalanx-shm.[<host>.]<creator pid>.<creator start time>.<random token>; a host key starts with a letter
_NAME = re.compile(rf"^{re.escape(PREFIX)}\.(?:(?P<host>[a-z][a-z0-9-]*)\.)?(?P<pid>\d+)\.(?P<start>\d+)\."
                   r"(?P<token>[0-9a-f]+)$")
_HOST = re.compile(r"^[a-z][a-z0-9-]*$")
PAGE = mmap.PAGESIZE


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when there is no such live process.

    The (pid, start time) pair names a process for good: a recycled pid has a later start time.
    A zombie (dead, not yet reaped by its parent) counts as gone.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = text[text.rindex(b")") + 2:].split()
    state, start = fields[0], int(fields[19])
    return None if state in (b"Z", b"X", b"x") else start


def process_alive(pid: int, start_time: int) -> bool:
    """True while the process that had `start_time` under `pid` still runs."""
    return process_start_time(pid) == start_time


def host_identity() -> dict:
    """What must match for two processes to share /dev/shm, pids and memory ordering."""
    identity = {"hostname": socket.gethostname(), "uid": os.getuid(), "machine": os.uname().machine}
    for key, path in (("boot_id", "/proc/sys/kernel/random/boot_id"),):
        try:
            with open(path) as handle:
                identity[key] = handle.read().strip()
        except OSError:
            identity[key] = None
    for space in ("pid", "mnt", "ipc"):  # pids and /dev/shm are only comparable inside one namespace
        try:
            identity[f"{space}_ns"] = os.readlink(f"/proc/self/ns/{space}")
        except OSError:
            identity[f"{space}_ns"] = None
    return identity


def new_segment_name(host: str | None = None) -> str:
    """A fresh name: ours (prefix), of its host, traceable to its creator (pid, start time), unguessable
    (128 random bits)."""
    pid = os.getpid()
    if host is not None and not _HOST.match(host):
        raise ValueError(f"not a host key for a segment name: {host!r} (lower-case letters, digits, '-')")
    where = f"{host}." if host else ""
    return f"{PREFIX}.{where}{pid}.{process_start_time(pid)}.{secrets.token_hex(16)}"


def segment_host(name: str) -> str | None:
    """The host a segment name was made for (None: a name without one, or not a phalanx segment)."""
    match = _NAME.match(name)
    return match.group("host") if match else None


class Segment:
    """One mapped shared-memory file. `create` on one rank, `attach` on the others, then `unlink`."""

    def __init__(self, name: str, size: int, memory: mmap.mmap):
        self.name = name
        self.size = size
        self.memory = memory

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, size: int, host: str | None = None) -> Segment:
        """Create and map a new zero-filled segment of `size` bytes, readable and writable by this user only,
        named for `host` (see new_segment_name)."""
        name = new_segment_name(host)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask may only narrow the mode; make it exact
            # Reserve the pages now: a /dev/shm too small must fail here with ENOSPC, not later
            # with a SIGBUS in the middle of a gradient exchange.
            os.posix_fallocate(fd, 0, max(size, 1))
            memory = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return cls(name, size, memory)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        """Map the segment another rank created, after checking it is ours and private."""
        if not _NAME.match(name):
            raise ValueError(f"not a phalanx segment name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError(f"segment {name} is not a private file of uid {os.getuid()} "
                                      f"(uid {info.st_uid}, mode {oct(info.st_mode & 0o777)})")
            if info.st_size < max(size, 1):
                raise ValueError(f"segment {name} has {info.st_size} bytes, expected {size}")
            memory = mmap.mmap(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, memory)

    def unlink(self) -> None:
        """Remove the name; the memory lives on in the existing mappings."""
        _unlink_quietly(self.path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Remove phalanx segments of this user whose creator process is gone; return the names removed.

    Only names with phalanx's prefix and owned by this user are touched, and a segment whose creator
    still runs is kept (it may be setting up a job right now).
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if not match:
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        if not process_alive(int(match.group("pid")), int(match.group("start"))):
            _unlink_quietly(path)
            removed.append(name)
    return removed


def job_segments(token_or_name: str, directory: str = SHM_DIR) -> list[str]:
    """Names in `directory` that belong to the segment (or token) given: for tests and for checking cleanup."""
    token = token_or_name.rsplit(".", 1)[-1]
    try:
        return [name for name in os.listdir(directory) if name.startswith(PREFIX) and name.endswith(token)]
    except OSError:
        return []

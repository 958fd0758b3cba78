"""Each rank's record of its collectives and its heartbeat: a small file-backed ring others can map.

The launcher (or a peer's watchdog) reads it without the worker's help: a rank stuck in C code, or
holding the GIL, still has its last entries in the page cache. Everything is an int64 slot written
with a plain store (no lock, no syscall); a reader may catch one entry half-written, which a
diagnosis can bear. Times are CLOCK_MONOTONIC nanoseconds, comparable between processes of a host.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field

MAGIC = 0x50484C58_52494E47  # "PHLXRING"
VERSION = 1
HEADER_SLOTS = 32
ENTRY_SLOTS = 12
CAPACITY = 1024  # entries kept; a straggler summary looks at the last few hundred
SITE_BYTES = 192
SITE_CAPACITY = 256

# Header slots.
(H_MAGIC, H_VERSION, H_PID, H_RANK, H_WORLD, H_LOCAL_RANK, H_STEP, H_PHASE, H_PHASE_SINCE, H_PROGRESS,
 H_BEAT, H_NEXT_SEQ, H_SITES, H_STACK_SIGNAL, H_MAIN_THREAD, H_DATA_NS, H_CREATED, H_EXITED) = range(18)
# Entry slots.
(E_SEQ, E_KIND, E_BUCKET, E_NUMEL, E_DTYPE, E_STATE, E_ENTER, E_START, E_DONE, E_SITE, E_STEP) = range(11)

KINDS = ("?", "bucket", "broadcast", "barrier", "checkpoint", "join", "used-map", "all-gather", "rendezvous",
         "shadow", "host-phase", "network-phase", "replica-audit", "finite-flags")
KIND = {name: code for code, name in enumerate(KINDS)}
PHASES = ("startup", "init", "data", "forward", "backward", "optimizer", "checkpoint", "shutdown", "exited")
PHASE = {name: code for code, name in enumerate(PHASES)}
STATES = ("?", "enqueued", "started", "done")
ENQUEUED, STARTED, DONE = 1, 2, 3
DTYPES = ("?", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_DTYPE_CODE: dict = {}  # torch.dtype -> code, filled on first use


def dtype_code(dtype) -> int:
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        name = str(dtype).rsplit(".", 1)[-1]
        code = _DTYPE_CODE[dtype] = DTYPES.index(name) if name in DTYPES else 0
    return code


def ring_bytes() -> int:
    return 8 * (HEADER_SLOTS + CAPACITY * ENTRY_SLOTS) + SITE_BYTES * SITE_CAPACITY


def ring_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank}.ring")


class Ring:
    """The writer's side: one process, one file, plain stores into a memory map."""

    def __init__(self, path: str, rank: int, world_size: int, local_rank: int):
        self.path = path
        size = ring_bytes()
        fd = os.open(path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.slots = memoryview(self._map).cast("B").cast("q")
        self._site_base = 8 * (HEADER_SLOTS + CAPACITY * ENTRY_SLOTS)
        self.sites = 0
        self.seq = 0
        now = time.monotonic_ns()
        for slot, value in ((H_VERSION, VERSION), (H_PID, os.getpid()), (H_RANK, rank), (H_WORLD, world_size),
                            (H_LOCAL_RANK, local_rank), (H_PHASE, PHASE["init"]), (H_PHASE_SINCE, now),
                            (H_BEAT, now), (H_CREATED, now)):
            self.slots[slot] = value
        self.slots[H_MAGIC] = MAGIC  # last: a reader that sees it sees the rest
        os.replace(path + ".tmp", path)  # readers never map a file of the wrong size

    # -- entries ----------------------------------------------------------------------------------

    def begin(self, kind: int, bucket: int, numel: int, dtype: int, site: int, state: int) -> int:
        """A new entry (arrival at a collective); returns its base slot for started()/done()."""
        slots, seq, now = self.slots, self.seq, time.monotonic_ns()
        self.seq = seq + 1
        base = HEADER_SLOTS + (seq % CAPACITY) * ENTRY_SLOTS
        slots[base + E_STATE] = 0  # the entry is being rewritten: no reader trusts it until the state is set
        slots[base + E_SEQ] = seq
        slots[base + E_KIND] = kind
        slots[base + E_BUCKET] = bucket
        slots[base + E_NUMEL] = numel
        slots[base + E_DTYPE] = dtype
        slots[base + E_ENTER] = now
        slots[base + E_START] = now if state == STARTED else 0
        slots[base + E_DONE] = 0
        slots[base + E_SITE] = site
        slots[base + E_STEP] = slots[H_STEP]
        slots[base + E_STATE] = state
        slots[H_NEXT_SEQ] = seq + 1
        slots[H_PROGRESS] += 1
        return base

    def started(self, base: int) -> None:
        slots = self.slots
        slots[base + E_START] = time.monotonic_ns()
        slots[base + E_STATE] = STARTED
        slots[H_PROGRESS] += 1

    def done(self, base: int) -> None:
        slots = self.slots
        slots[base + E_DONE] = time.monotonic_ns()
        slots[base + E_STATE] = DONE
        slots[H_PROGRESS] += 1

    # -- heartbeat --------------------------------------------------------------------------------

    def phase(self, code: int) -> int:
        """Enter phase `code`; returns the previous one. Time spent in `data` is summed per step."""
        slots, now = self.slots, time.monotonic_ns()
        previous = slots[H_PHASE]
        if previous == code:
            return previous
        if previous == 2 and slots[H_STEP]:  # PHASE["data"], after the first step (not the startup)
            slots[H_DATA_NS] += now - slots[H_PHASE_SINCE]
        slots[H_PHASE] = code
        slots[H_PHASE_SINCE] = now
        slots[H_BEAT] = now
        slots[H_PROGRESS] += 1
        return previous

    def next_step(self) -> None:
        """A synchronized forward begins: the data wait before it counts, then the step number moves on."""
        self.phase(3)  # PHASE["forward"]
        slots = self.slots
        slots[H_STEP] += 1
        slots[H_PROGRESS] += 1

    def beat(self) -> None:
        """Alive and moving, in a long operation that has no collective (a checkpoint write)."""
        self.slots[H_BEAT] = time.monotonic_ns()
        self.slots[H_PROGRESS] += 1

    def set(self, slot: int, value: int) -> None:
        self.slots[slot] = value

    def add_site(self, text: str) -> int:
        """Store a call site's text once; its id (1-based) goes into entries. 0 when the table is full."""
        if self.sites >= SITE_CAPACITY:
            return 0
        raw = text.encode("utf-8", "replace")[:SITE_BYTES - 1]
        offset = self._site_base + self.sites * SITE_BYTES
        self._map[offset:offset + len(raw)] = raw
        self.sites += 1
        self.slots[H_SITES] = self.sites
        return self.sites

    def close(self, exited: bool = True) -> None:
        if exited:
            self.phase(PHASE["exited"])
            self.slots[H_EXITED] = 1


_WHAT = {"bucket": "gradient exchange", "shadow": "join() shadow exchange", "used-map": "used-parameter all-reduce",
         "join": "join() control all-reduce", "checkpoint": "checkpoint commit broadcast",
         "all-gather": "model signature all-gather", "rendezvous": "rendezvous (init_process_group)",
         "host-phase": "host phase (shared memory between this host's ranks) of the gradient exchange",
         "network-phase": "network phase (Gloo between hosts) of the gradient exchange",
         "replica-audit": "replica audit all-gather (fingerprints of the parameters and optimizer state)",
         "finite-flags": "all-reduce of the non-finite gradient flags"}


@dataclass
class Entry:
    seq: int
    kind: str
    bucket: int
    numel: int
    dtype: str
    state: str
    entered_ns: int
    started_ns: int
    done_ns: int
    site: str
    step: int

    def descriptor(self) -> tuple:
        """What every rank must agree on for the collective numbered `seq`."""
        return (self.kind, self.bucket, self.numel, self.dtype)

    def describe(self) -> str:
        """'#12 gradient exchange of bucket 0 (4,680 x float32)'."""
        what = f"#{self.seq} {_WHAT.get(self.kind, self.kind)}"
        if self.bucket >= 0:
            what += f" of bucket {self.bucket}"
        if self.numel:
            what += f" ({self.numel:,} x {self.dtype})"
        return what


@dataclass
class Snapshot:
    """One rank's ring as read at one moment."""

    rank: int
    pid: int
    world_size: int
    local_rank: int
    step: int
    phase: str
    phase_since_ns: int
    beat_ns: int
    progress: int
    stack_signal: int
    main_thread: int
    data_ns: int  # time in the data phase, summed over the steps after the first
    exited: bool
    entries: list[Entry] = field(default_factory=list)  # by sequence number

    @property
    def last(self) -> Entry | None:
        return self.entries[-1] if self.entries else None


def read_ring(path: str) -> Snapshot | None:
    """Parse a ring file (None when it is missing or not a ring). Never needs the writer's help."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(ring_bytes())
    except OSError:
        return None
    if len(raw) < ring_bytes():
        return None
    head = struct.unpack_from(f"{HEADER_SLOTS}q", raw, 0)
    if head[H_MAGIC] != MAGIC or head[H_VERSION] != VERSION:
        return None
    site_base = 8 * (HEADER_SLOTS + CAPACITY * ENTRY_SLOTS)
    sites = ["?"]
    for k in range(min(head[H_SITES], SITE_CAPACITY)):
        chunk = raw[site_base + k * SITE_BYTES:site_base + (k + 1) * SITE_BYTES]
        sites.append(chunk.split(b"\0", 1)[0].decode("utf-8", "replace"))
    next_seq = head[H_NEXT_SEQ]
    entries = []
    for seq in range(max(0, next_seq - CAPACITY), next_seq):
        e = struct.unpack_from(f"{ENTRY_SLOTS}q", raw, 8 * (HEADER_SLOTS + (seq % CAPACITY) * ENTRY_SLOTS))
        if e[E_SEQ] != seq or not 0 < e[E_STATE] < len(STATES):
            continue  # overwritten or being written while we read
        entries.append(Entry(seq, _name(KINDS, e[E_KIND]), e[E_BUCKET], e[E_NUMEL], _name(DTYPES, e[E_DTYPE]),
                             STATES[e[E_STATE]], e[E_ENTER], e[E_START], e[E_DONE],
                             sites[e[E_SITE]] if 0 <= e[E_SITE] < len(sites) else "?", e[E_STEP]))
    data_ns = head[H_DATA_NS]
    return Snapshot(head[H_RANK], head[H_PID], head[H_WORLD], head[H_LOCAL_RANK], head[H_STEP],
                    _name(PHASES, head[H_PHASE]), head[H_PHASE_SINCE], head[H_BEAT], head[H_PROGRESS],
                    head[H_STACK_SIGNAL], head[H_MAIN_THREAD], data_ns, bool(head[H_EXITED]),
                    entries)


def read_header(path: str) -> tuple | None:
    """Only the header slots (what a poll for progress needs), or None."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8 * HEADER_SLOTS)
    except OSError:
        return None
    if len(raw) < 8 * HEADER_SLOTS:
        return None
    head = struct.unpack_from(f"{HEADER_SLOTS}q", raw, 0)
    return head if head[H_MAGIC] == MAGIC else None


def read_rings(directory: str) -> dict[int, Snapshot]:
    """Every rank's ring in `directory`, by rank."""
    found = {}
    for path in rank_files(directory, ".ring"):
        snapshot = read_ring(path)
        if snapshot is not None:
            found[snapshot.rank] = snapshot
    return found


def rank_files(directory: str, suffix: str) -> list[str]:
    """The paths of the per-rank files (`rank-<r><suffix>`) in `directory`; none if it is gone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names if n.startswith("rank-") and n.endswith(suffix)]


def _name(table: tuple, code: int) -> str:
    return table[code] if 0 <= code < len(table) else "?"

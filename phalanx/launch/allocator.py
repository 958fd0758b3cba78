"""The C allocator phalanx's launchers give their workers: tcmalloc, where the system has it.

glibc's malloc fragments under the pattern sharded training makes: FSDP2 (`shard="parameters"`)
allocates and frees each block's gathered parameters and gradients on every step, in sizes that
glibc keeps mapped but places anew, so a rank's resident memory reached 3x its live bytes
(measured: 1.5 GB resident for 0.5 GB in use, 50M parameters on 2 ranks). tcmalloc reuses freed
blocks by size class: the same run peaks at 0.78 GB, and steps are as fast (docs/benchmarks.md).
Returning freed memory to the system instead (a low mmap threshold, or jemalloc's decay) saved as
much but slowed steps by 25-100 %: every step paid the page faults again. An allocator can only be
chosen when a process starts, so `phalanx run` and `phalanx.spawn` preload it into the workers;
under torchrun or srun, set LD_PRELOAD yourself (docs/sharding.md).

PHALANX_ALLOCATOR=system keeps the system's malloc; =tcmalloc requires tcmalloc; unset: tcmalloc
where found.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import WorldConfigError, explain
from ..log import logger

# Debian/Ubuntu (libtcmalloc-minimal4), Fedora/RHEL (gperftools-libs), and the usual other places.
_SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def find_tcmalloc() -> str | None:
    for folder in _SEARCH:
        for name in _NAMES:
            path = Path(folder) / name
            if path.exists():
                return str(path)
    return None


def worker_preload(environ=None) -> str | None:
    """The LD_PRELOAD the workers should start with (None: leave it as it is)."""
    environ = os.environ if environ is None else environ
    choice = environ.get("PHALANX_ALLOCATOR", "").strip().lower()
    if choice == "system":
        return None
    if choice not in ("", "tcmalloc"):
        raise WorldConfigError(explain("PHALANX_ALLOCATOR names the workers' C allocator",
                                       seen=f"PHALANX_ALLOCATOR={choice!r}", expected="'tcmalloc' or 'system'",
                                       fix="Unset it for tcmalloc where the system has it."))
    current = environ.get("LD_PRELOAD", "")
    if "tcmalloc" in current or "jemalloc" in current or "mimalloc" in current:
        return None  # the user chose an allocator already
    found = find_tcmalloc()
    if found is None:
        if choice == "tcmalloc":
            raise WorldConfigError(explain("PHALANX_ALLOCATOR=tcmalloc, but no tcmalloc library was found",
                                           seen=f"none in {', '.join(_SEARCH)}", expected=" or ".join(_NAMES),
                                           fix="Install it (Debian: apt-get install libtcmalloc-minimal4), or "
                                               "unset PHALANX_ALLOCATOR."))
        logger.debug("no tcmalloc found: the workers keep the system's malloc")
        return None
    return f"{found} {current}".strip()


def preload_for_workers(environ=None) -> str | None:
    """Set LD_PRELOAD in `environ` (default: this process's, which workers inherit); returns what was set."""
    environ = os.environ if environ is None else environ
    preload = worker_preload(environ)
    if preload is not None:
        environ["LD_PRELOAD"] = preload
    return preload

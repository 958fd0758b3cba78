"""The C allocator of phalanx's workers: the system's tcmalloc, else mimalloc, which comes with phalanx.

glibc's malloc keeps the blocks FSDP2 (`shard="parameters"`) gathers and frees on every step: the level
then peaked at 0.92 x shard="none"'s memory, against 0.54 on tcmalloc and 0.57 on mimalloc (the
cmeel-mimalloc wheel, a dependency on Linux). An allocator is chosen as a process starts: `phalanx run`
and `phalanx.spawn` preload it; under torchrun or srun, `python -m phalanx.allocator` prints the LD_PRELOAD.
PHALANX_ALLOCATOR: auto (unset), tcmalloc, mimalloc, system (keep glibc), or a library's path.

May import: errors, log.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from ..errors import WorldConfigError, explain

# phalanx's logger (log.py configures it) by name: this module stays free of torch, so that the `phalanx`
# command can choose the launcher's allocator before torch is loaded (cli.py).
logger = logging.getLogger("phalanx")

# Where the system's tcmalloc is looked for: Debian/Ubuntu (libtcmalloc-minimal4), Fedora/RHEL
# (gperftools-libs), and the usual other places. PHALANX_ALLOCATOR_SEARCH replaces the list (folders
# separated by ':'); set empty, it hides the system's libraries, as on a machine that has none.
SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
WHEEL = "cmeel-mimalloc"  # pinned in pyproject.toml; Linux x86_64 and aarch64 wheels
PREFERENCE = ("tcmalloc", "mimalloc")  # what `auto` tries, in order: tcmalloc kept less (docs/benchmarks.md)
KNOWN = ("mimalloc", "tcmalloc", "jemalloc")
# Set by `phalanx run` and `phalanx.spawn` for their workers: the allocator they chose ("system" included).
CHOSEN_BY_LAUNCHER = "PHALANX_WORKER_ALLOCATOR"

# Peak RSS per rank / shard="none"'s, 2 ranks, the 50M-parameter MLP with AdamW (`phalanx bench --memory`,
# 2026-11-26), on glibc's malloc and on the shipped mimalloc, for the levels that lose their saving on glibc:
# what the warning quotes. "optimizer" and "gradients" measured no worse on glibc (0.70 and 0.63, against 0.75
# and 0.66 on mimalloc, 0.71 and 0.61 on tcmalloc): their buckets are allocated once, and nothing is said.
MEASURED_PEAK_VS_NONE = {"parameters": (0.92, 0.57)}


class Allocator(NamedTuple):
    name: str  # "mimalloc", "tcmalloc", or a library's file name
    path: str  # the library to preload
    origin: str  # where it came from, for messages


def shipped_mimalloc() -> Allocator | None:
    """mimalloc from the cmeel-mimalloc wheel, where it is installed (Linux; None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None  # the wheel's macOS library would need DYLD_INSERT_LIBRARIES; macOS's malloc is kept
    try:
        files = metadata.distribution(WHEEL).files or []
    except metadata.PackageNotFoundError:
        return None
    # libmimalloc.so.3 (the soname) first: libmimalloc.so and .so.3.4 are copies of the same library
    libraries = sorted((f for f in files if f.name.startswith("libmimalloc.so")),
                       key=lambda f: (f.name.count(".") != 2, f.name))
    for entry in libraries:
        path = Path(entry.locate())
        if path.exists():
            return Allocator("mimalloc", str(path), f"the {WHEEL} wheel")
    return None


def search_path(environ=None) -> tuple[str, ...]:
    environ = os.environ if environ is None else environ
    if "PHALANX_ALLOCATOR_SEARCH" in environ:
        return tuple(folder for folder in environ["PHALANX_ALLOCATOR_SEARCH"].split(":") if folder)
    return SEARCH


def system_tcmalloc(search: tuple[str, ...] = SEARCH) -> Allocator | None:
    for folder in search:
        for name in TCMALLOC_NAMES:
            path = Path(folder) / name
            if path.exists():
                return Allocator("tcmalloc", str(path), "the system")
    return None


@cache
def preloadable(path: str) -> bool:
    """Whether a process starts with `path` preloaded (the dynamic loader ignores, with a message on every
    start, a library it cannot load: a missing libatomic, another architecture)."""
    probe = shutil.which("true") or sys.executable
    args = [probe] if probe != sys.executable else [probe, "-S", "-c", ""]
    try:
        done = subprocess.run(args, env={"LD_PRELOAD": path, "PATH": os.environ.get("PATH", "")},
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "cannot be preloaded" not in done.stderr


def choose(environ=None) -> Allocator | None:
    """The allocator the workers should start with, by PHALANX_ALLOCATOR; None: keep the system's malloc."""
    environ = os.environ if environ is None else environ
    setting = environ.get("PHALANX_ALLOCATOR", "").strip()
    choice = setting.lower()
    if choice == "system":
        return None
    if "/" in setting:  # a library named by path
        if not Path(setting).is_file() or not preloadable(setting):
            raise WorldConfigError(explain("PHALANX_ALLOCATOR names a library that cannot be preloaded",
                                           seen=setting, expected="an existing malloc library (.so) for this machine",
                                           fix="Fix the path, or unset PHALANX_ALLOCATOR."))
        return Allocator(Path(setting).name, setting, "PHALANX_ALLOCATOR")
    if choice not in ("", "auto") + PREFERENCE:
        raise WorldConfigError(explain("PHALANX_ALLOCATOR names the workers' C allocator",
                                       seen=f"PHALANX_ALLOCATOR={setting!r}",
                                       expected="auto, mimalloc, tcmalloc, system, or a library's path",
                                       fix="Unset it: the system's tcmalloc, else mimalloc (shipped with phalanx)."))
    finders = {"mimalloc": shipped_mimalloc, "tcmalloc": lambda: system_tcmalloc(search_path(environ))}
    for name in PREFERENCE if choice in ("", "auto") else (choice,):
        found = finders[name]()
        if found is not None and preloadable(found.path):
            return found
    if choice == "mimalloc":
        raise WorldConfigError(explain("PHALANX_ALLOCATOR=mimalloc, but the shipped mimalloc is not usable here",
                                       seen=_missing_mimalloc(), expected=f"the {WHEEL} wheel's libmimalloc.so",
                                       fix=f"pip install {WHEEL} (Linux x86_64 or aarch64), or unset "
                                           "PHALANX_ALLOCATOR."))
    if choice == "tcmalloc":
        raise WorldConfigError(explain("PHALANX_ALLOCATOR=tcmalloc, but no usable tcmalloc library was found",
                                       seen=f"none in {', '.join(search_path(environ)) or '(an empty search path)'}",
                                       expected=" or ".join(TCMALLOC_NAMES),
                                       fix="Install it (Debian: apt-get install libtcmalloc-minimal4), or unset "
                                           "PHALANX_ALLOCATOR."))
    logger.debug("no allocator to preload (%s): the workers keep the system's malloc", _missing_mimalloc())
    return None


def _missing_mimalloc() -> str:
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} (preloading is for Linux)"
    found = shipped_mimalloc()
    if found is None:
        return f"no {WHEEL} installed (it has wheels for Linux x86_64 and aarch64)"
    return f"{found.path} does not load on this machine"


def worker_preload(environ=None) -> str | None:
    """The LD_PRELOAD the workers should start with (None: leave it as it is)."""
    environ = os.environ if environ is None else environ
    chosen = choose(environ)
    current = environ.get("LD_PRELOAD", "")
    if chosen is None or any(name in current for name in KNOWN):
        return None  # the system's malloc asked for, or an allocator the user preloaded already
    return f"{chosen.path} {current}".strip()


def preload_for_workers(environ=None) -> str | None:
    """Set LD_PRELOAD in `environ` (default: this process's, which workers inherit); returns what was set."""
    environ = os.environ if environ is None else environ
    preload = worker_preload(environ)
    if preload is not None:
        environ["LD_PRELOAD"] = preload
    environ[CHOSEN_BY_LAUNCHER] = environ.get("LD_PRELOAD") or "system"
    return preload


# -- what this process has ------------------------------------------------------------------------

def library_name(path: str) -> str:
    """'mimalloc', 'tcmalloc', 'jemalloc' or 'glibc' for a malloc library's path; else its file name."""
    name = Path(path).name
    for known in KNOWN:
        if known in name:
            return known
    if name.startswith("libc.so") or name.startswith("libc-"):
        return "glibc"
    return name or "unknown"


def current() -> str:
    """The allocator whose malloc this process calls ('glibc', 'mimalloc', ...); '' where it can't be told
    (off Linux, where the platform's malloc is kept)."""
    if not sys.platform.startswith("linux"):
        return ""
    address = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value  # the malloc the process resolves
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return ""
    for line in maps:
        fields = line.split(maxsplit=5)
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end:
            return library_name(fields[5].strip() if len(fields) > 5 else "")
    return ""


def advice(environ=None) -> str:
    """One line: which allocator this process has and, on glibc's, the exact LD_PRELOAD to start with."""
    environ = os.environ if environ is None else environ
    have = current()
    if have != "glibc":
        return f"allocator: {have or 'the platform malloc'} ({'LD_PRELOAD' if have else 'nothing to preload'})"
    if environ.get("PHALANX_ALLOCATOR", "").strip().lower() == "system":
        return "allocator: glibc's malloc (PHALANX_ALLOCATOR=system)"
    try:
        chosen = choose(environ)
    except WorldConfigError:
        chosen = None
    if chosen is None:
        return f"allocator: glibc's malloc (sharded levels save less on it); no other is usable: {_missing_mimalloc()}"
    return (f"allocator: glibc's malloc, which keeps what sharded steps free; start the ranks with "
            f"LD_PRELOAD={chosen.path} ({chosen.name}, from {chosen.origin}; `python -m phalanx.allocator` prints it)")


def say_at_init(rank: int, world_size: int, environ=None) -> str | None:
    """Under a launcher other than phalanx's (torchrun, srun), rank 0 says `advice()` once: returns what it said."""
    environ = os.environ if environ is None else environ
    if rank != 0 or world_size < 2 or CHOSEN_BY_LAUNCHER in environ:
        return None
    line = advice(environ)
    logger.info(line)
    return line


_warned: set[str] = set()  # warn once per process, not once per model wrapped


def warn_if_glibc(level: str, rank: int, environ=None) -> str | None:
    """At wrap time, rank 0 warns once when a level that loses its saving on glibc's malloc (MEASURED_PEAK_VS_NONE)
    runs on it: returns the warning."""
    environ = os.environ if environ is None else environ
    if rank != 0 or level not in MEASURED_PEAK_VS_NONE or "glibc" in _warned or current() != "glibc":
        return None
    if environ.get("PHALANX_ALLOCATOR", "").strip().lower() == "system":
        return None  # chosen on purpose
    _warned.add("glibc")
    on_glibc, shipped = MEASURED_PEAK_VS_NONE[level]
    text = (f"shard={level!r} runs on glibc's malloc, which keeps the blocks each step frees (measured, 50M-parameter "
            f"MLP on 2 ranks: peak memory {on_glibc:.2f} x shard='none' on glibc, {shipped:.2f} x with mimalloc). Fix: "
            "start the ranks with `phalanx run` or `phalanx.spawn`, which preload a better one, or under torchrun/srun "
            "with the LD_PRELOAD that `python -m phalanx.allocator` prints (PHALANX_ALLOCATOR=system silences this)")
    logger.warning(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m phalanx.allocator` (or `phalanx allocator`): print LD_PRELOAD=... for torchrun or srun."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m phalanx.allocator (or: phalanx allocator)\n\n"
              "Prints LD_PRELOAD=<library>: the allocator `phalanx run` gives its workers (PHALANX_ALLOCATOR), for "
              "torchrun or srun:\n"
              "  export $(python -m phalanx.allocator); torchrun --nproc-per-node 2 train.py\n"
              "  srun --export=ALL,$(python -m phalanx.allocator) python train.py")
        return 0
    try:
        chosen = choose()
    except WorldConfigError as error:
        print(f"phalanx allocator: {error}", file=sys.stderr)
        return 2
    if chosen is None:
        reason = ("PHALANX_ALLOCATOR=system" if os.environ.get("PHALANX_ALLOCATOR", "").strip().lower() == "system"
                  else _missing_mimalloc())
        print(f"phalanx allocator: nothing to preload ({reason}); the ranks keep the system's malloc", file=sys.stderr)
        return 1
    others = [part for part in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if part != chosen.path]
    print(f"LD_PRELOAD={':'.join([chosen.path, *others])}")  # ':' keeps it one word for export $(...)
    print(f"# {chosen.name} from {chosen.origin}; this process has {current() or 'the platform malloc'}",
          file=sys.stderr)
    return 0

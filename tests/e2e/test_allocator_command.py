"""`python -m phalanx.allocator` prints the LD_PRELOAD for torchrun or srun, and a process started with it has
phalanx's allocator: on a machine without the system's tcmalloc (hidden here), the shipped mimalloc. No world."""

import sys

from phalanx import allocator
from tests.conftest import run_command

FRESH_MACHINE = {"PHALANX_ALLOCATOR_SEARCH": "", "PHALANX_ALLOCATOR": "auto", "LD_PRELOAD": ""}
WHICH = [sys.executable, "-c", "from phalanx.allocator import current; print('malloc:', current())"]


def test_the_printed_preload_starts_a_process_with_the_shipped_allocator(tmp_path):
    shipped = allocator.shipped_mimalloc()
    assert shipped is not None or not sys.platform.startswith("linux"), "cmeel-mimalloc is a dependency on Linux"
    if shipped is None:
        return  # off Linux: nothing is preloaded (tests/unit/test_allocator.py)
    # No `phalanx` command runs here: no warm launcher (one per LD_PRELOAD below) is started for nothing.
    printed = run_command([sys.executable, "-m", "phalanx.allocator"], tmp_path, env=FRESH_MACHINE, warm=False)
    assert f"LD_PRELOAD={shipped.path}\n" in printed, printed
    assert "# mimalloc from the cmeel-mimalloc wheel; this process has glibc" in printed, printed
    name, value = next(line for line in printed.splitlines() if line.startswith("LD_PRELOAD=")).split("=", 1)
    assert "malloc: mimalloc" in run_command(WHICH, tmp_path, env={**FRESH_MACHINE, name: value},
                                               warm=False).splitlines()
    assert "malloc: glibc" in run_command(WHICH, tmp_path, env=FRESH_MACHINE, warm=False).splitlines()
    # export $(python -m phalanx.allocator): an LD_PRELOAD already there is kept, after it, as one word
    kept = run_command([sys.executable, "-m", "phalanx.allocator"], tmp_path,
                       env={**FRESH_MACHINE, "LD_PRELOAD": "libm.so.6"}, warm=False)
    assert f"LD_PRELOAD={shipped.path}:libm.so.6\n" in kept, kept

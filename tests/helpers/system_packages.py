"""What some tests need of the machine beyond the venv: system packages, which the tests never install.

A test suite must not change the machine it runs on (and its pytest-xdist workers would race for dpkg's lock):
.ci/run installs these before `make test`, asking this file which are missing. A test that finds one missing
skips, with what to install:

    IPROUTE2.require()  # skips: "iproute2 is not installed (no `ip`): `apt-get install iproute2`, as .ci/run does"

    python3 -m tests.helpers.system_packages    # the Debian packages missing here, one package's set a line
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemPackage:
    """Something of the system's that tests need: its name, the Debian packages that bring it, and the commands
    (on PATH) and files that show it is installed."""

    name: str
    debian: tuple[str, ...]
    commands: tuple[str, ...] = ()
    files: tuple[str, ...] = ()

    @property
    def install(self) -> str:
        return f"apt-get install {' '.join(self.debian)}"

    def missing(self) -> str | None:
        """None when installed; else why a test that needs it skips, with the command that installs it."""
        absent = [f"`{command}`" for command in self.commands if shutil.which(command) is None]
        absent += [path for path in self.files if not os.path.exists(path)]
        if not absent:
            return None
        return f"{self.name} is not installed (no {', '.join(absent)}): `{self.install}`, as .ci/run does"

    def require(self) -> None:
        """Skip the calling test when this is missing."""
        reason = self.missing()
        if reason is not None:
            import pytest

            pytest.skip(reason)


# Network namespaces, veth pairs and bridges: the multi-node tests (tests/helpers/namespaces.py), the SLURM cluster.
IPROUTE2 = SystemPackage("iproute2", ("iproute2",), commands=("ip",))
# Shaped links: the cross-host bench's test (tests/e2e/test_xhost.py, benchmarks/hosts/xhost_net.py).
TC = SystemPackage("tc (iproute2)", ("iproute2",), commands=("tc",))
# The SLURM cluster (tests/helpers/slurm_cluster.py): Debian's daemons, its client commands, and munge.
SLURM = SystemPackage("SLURM", ("slurmctld", "slurmd", "slurm-client", "munge"),
                      files=("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch"))
# A host name of the namespace's own (tests/e2e/test_warm_launcher.py).
UNSHARE = SystemPackage("unshare (util-linux)", ("util-linux",), commands=("unshare",))
# A small tmpfs to fill up (tests/ranks/test_checkpoint_background.py).
MOUNT = SystemPackage("mount", ("mount",), commands=("mount", "umount"))
# `make -n` of the README's two commands (tests/e2e/test_readme.py).
MAKE = SystemPackage("make", ("make",), commands=("make",))

NEEDED = (IPROUTE2, TC, SLURM, UNSHARE, MOUNT, MAKE)


def missing_packages(needed=NEEDED) -> list[tuple[str, ...]]:
    """The Debian packages of each of `needed` that is missing here, each set once (for .ci/run)."""
    sets = [package.debian for package in needed if package.missing() is not None]
    return list(dict.fromkeys(sets))


if __name__ == "__main__":
    for debian in missing_packages():
        print(" ".join(debian))

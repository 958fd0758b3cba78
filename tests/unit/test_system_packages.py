"""tests/helpers/system_packages.py: what some tests need of the machine, the reason they skip without it (with
the command that installs it), and what .ci/run installs before `make test`."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import system_packages
from tests.helpers.system_packages import SystemPackage


def test_a_missing_package_names_what_is_absent_and_how_to_install_it():
    absent = SystemPackage("demo", ("demo-a", "demo-b"), commands=("phalanx-no-such-command",),
                           files=("/phalanx/no/such/file",))
    assert absent.missing() == ("demo is not installed (no `phalanx-no-such-command`, /phalanx/no/such/file): "
                                "`apt-get install demo-a demo-b`, as .ci/run does")
    with pytest.raises(pytest.skip.Exception, match="apt-get install demo-a demo-b"):
        absent.require()
    present = SystemPackage("python", ("python3",), files=(sys.executable,))
    assert present.missing() is None
    present.require()


def test_ci_is_told_each_missing_set_of_packages_once(monkeypatch):
    """.ci/run installs what `python3 -m tests.helpers.system_packages` prints: iproute2 (ip and tc) once."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    missing = system_packages.missing_packages()
    assert len(missing) == len(set(missing))
    assert ("iproute2",) in missing and ("slurmctld", "slurmd", "slurm-client", "munge") in missing
    assert "python3 -m tests.helpers.system_packages" in (ROOT / ".ci" / "run").read_text()

"""What the tests of phalanx inside Accelerate and Lightning share (marker `trainers`): the libraries, which
come from the `trainers` extra, and launching 2 CPU ranks: with torchrun, as their users do, or with
`phalanx run`, whose workers see the same torch elastic variables (tests/e2e/test_launch.py) and which forks
from warm processes (tests/conftest.py): ~10 s of CPU less a launch than torchrun's fresh interpreters.

Without the extra the tests skip, except under CI (CI=true), where `make test` installs it and a missing
library is a failure, not a silent skip.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from tests.conftest import ROOT, checkout_on_pythonpath, run_in_session, with_warm_launcher


def require(module: str):
    """Import `module` (from the `trainers` extra): skip without it locally, fail without it under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed under CI: `make test` installs the trainers extra ({error})")
        pytest.skip(f"{module} is not installed: pip install -e '.[trainers]' (the trainers extra)")


def _environment(env: dict | None) -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": checkout_on_pythonpath(), **(env or {})}


def torchrun(args: list, *, env: dict | None = None, timeout: float = 180) -> tuple[int, str]:
    """`torchrun --standalone --nproc-per-node 2 ARGS` on the CPU, one thread per rank: (exit code, output)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               *map(str, args)]
    return run_in_session(command, ROOT, _environment(env), timeout)


def phalanx_run(args: list, *, env: dict | None = None, timeout: float = 180) -> tuple[int, str]:
    """`phalanx run --nproc-per-node 2 ARGS` on the CPU, one thread per rank: (exit code, output)."""
    command = [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", *map(str, args)]
    return run_in_session(command, ROOT, with_warm_launcher(_environment(env)), timeout)

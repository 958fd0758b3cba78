"""Running a command from a test (not a test module): the output back, or a failure that shows it.

Shared by the tests that drive phalanx as a user does: `phalanx run`, `phalanx demo`, the examples
and the README's commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_command(command: list, cwd: Path, *, env: dict | None = None, timeout: float = 60) -> str:
    """Run `command`; return stdout+stderr; fail with the output on a non-zero exit or a timeout."""
    import pytest

    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   **(env or {})}
    # A session of its own, so that a timeout stops the launcher and every worker it started.
    process = subprocess.Popen([str(c) for c in command], cwd=cwd, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{command} did not finish within {timeout}s; output:\n{output}")
    assert process.returncode == 0, f"{command} exited with {process.returncode}; output:\n{output}"
    return output

"""A peer that died is noticed: phalanx.shutdown() returns within seconds, with a warning naming it.

World size 2, both ranks started by hand (no launcher, rank 0 hosts the store): rank 1 is SIGKILLed
after init(); rank 0's shutdown barrier reads rank 1's ring, sees its process gone, and leaves.
"""

import os
import re
import subprocess
import sys

import pytest

from phalanx.testing import free_port
from phalanx.world.group import SHUTDOWN_WAIT
from tests.conftest import ROOT, checkout_on_pythonpath

# tests/suite.py: a dead peer must be noticed within a bound
pytestmark = pytest.mark.waiting


@pytest.mark.waiting(seconds=10)
def test_shutdown_does_not_wait_for_a_dead_peer(tmp_path):
    """World size 2: rank 1 dies by SIGKILL; rank 0's shutdown() takes seconds, not SHUTDOWN_WAIT."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_", "SLURM_"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=checkout_on_pythonpath(), TMPDIR=str(tmp_path))
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.helpers.dead_peer"], cwd=ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        output, _ = ranks[0].communicate(timeout=SHUTDOWN_WAIT)
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert ranks[1].returncode == -9
    took = float(re.search(r"SHUTDOWN took ([\d.]+)s", output).group(1))
    assert took < 10.0, output
    assert re.search(r"shutdown\(\) did not wait for every rank: .*rank\(s\) \[1\] ended without arriving", output), \
        output

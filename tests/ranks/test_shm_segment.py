"""Shared-memory segments and processes: a dead creator's segments are swept, live ones kept, and
a recycled pid is told from the original (each test forks one child). The single-process tests of
segments are in tests/unit/test_shm_segment.py.
"""

import multiprocessing as mp
import os
import shutil
import tempfile

import pytest

from phalanx.shm.segment import (
    SHM_DIR,
    Segment,
    job_segments,
    process_alive,
    process_start_time,
    sweep_stale_segments,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def _create_and_abandon(queue, directory):
    # A creator that dies before unlinking: what a crash during setup leaves behind. Moved, while its creator still
    # runs (so that no sweep takes it), into a directory of the test's own: another test's shared-memory
    # communicator sweeps /dev/shm when it starts, and would remove it before this test looks.
    segment = Segment.create(4096)
    os.rename(segment.path, os.path.join(directory, segment.name))
    queue.put(segment.name)


def test_sweep_removes_a_dead_creators_segment_and_keeps_live_ones():
    """World size 1 and one forked child, which creates a segment and exits without unlinking it."""
    directory = tempfile.mkdtemp(prefix="phalanx-sweep-test-", dir=SHM_DIR)
    queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_create_and_abandon, args=(queue, directory))
    child.start()
    abandoned = queue.get(timeout=60)
    child.join(60)
    live = Segment.create(4096)
    live_path = os.path.join(directory, live.name)
    os.rename(live.path, live_path)
    foreign = os.path.join(directory, "not-phalanx-" + abandoned.rsplit(".", 1)[1])
    open(foreign, "w").close()
    try:
        assert job_segments(abandoned, directory) == [abandoned]
        removed = sweep_stale_segments(directory)
        assert removed == [abandoned]
        assert job_segments(abandoned, directory) == []
        assert os.path.exists(live_path) and os.path.exists(foreign)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_process_alive_tells_a_recycled_pid_from_the_original():
    """World size 1 and one forked child, whose pid is gone once it has been joined."""
    me = os.getpid()
    assert process_alive(me, process_start_time(me))
    assert not process_alive(me, process_start_time(me) - 1)
    child = mp.get_context("fork").Process(target=os.getpid)
    child.start()
    child.join(60)
    assert process_start_time(child.pid) is None

"""Single-process tests of shared-memory segments: permissions, names, sweeping, liveness, chunking."""

import multiprocessing as mp
import os
import stat

import pytest

from phalanx.shm import shm_enabled
from phalanx.shm.reduce import chunk_bounds
from phalanx.shm.segment import (
    PREFIX,
    SHM_DIR,
    Segment,
    job_segments,
    process_alive,
    process_start_time,
    sweep_stale_segments,
)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def _create_and_abandon(queue):
    # A creator that dies before unlinking: what a crash during setup leaves behind.
    queue.put(Segment.create(4096).name)


def test_segment_is_owner_only_even_with_open_umask():
    old = os.umask(0)
    try:
        segment = Segment.create(8192)
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(segment.path).st_mode)
        assert mode == 0o600
        assert segment.name.startswith(PREFIX + f".{os.getpid()}.")
    finally:
        segment.unlink()
    assert not os.path.exists(segment.path)


def test_names_are_unguessable_and_distinct():
    first, second = Segment.create(4096), Segment.create(4096)
    try:
        token_a, token_b = first.name.rsplit(".", 1)[1], second.name.rsplit(".", 1)[1]
        assert token_a != token_b and len(token_a) == 32
    finally:
        first.unlink()
        second.unlink()


def test_attach_refuses_a_segment_others_can_read():
    segment = Segment.create(4096)
    try:
        os.chmod(segment.path, 0o644)
        with pytest.raises(PermissionError, match="not a private file"):
            Segment.attach(segment.name, 4096)
    finally:
        segment.unlink()


def test_attach_shares_memory_with_the_creator():
    segment = Segment.create(4096)
    try:
        other = Segment.attach(segment.name, 4096)
        segment.memory[:5] = b"hello"
        assert other.memory[:5] == b"hello"
    finally:
        segment.unlink()


def test_sweep_removes_a_dead_creators_segment_and_keeps_live_ones():
    queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_create_and_abandon, args=(queue,))
    child.start()
    abandoned = queue.get(timeout=60)
    child.join(60)
    live = Segment.create(4096)
    foreign = os.path.join(SHM_DIR, "not-phalanx-" + abandoned.rsplit(".", 1)[1])
    open(foreign, "w").close()
    try:
        assert job_segments(abandoned) == [abandoned]
        removed = sweep_stale_segments()
        assert abandoned in removed
        assert job_segments(abandoned) == []
        assert os.path.exists(live.path) and os.path.exists(foreign)
    finally:
        live.unlink()
        os.unlink(foreign)


def test_process_alive_tells_a_recycled_pid_from_the_original():
    me = os.getpid()
    assert process_alive(me, process_start_time(me))
    assert not process_alive(me, process_start_time(me) - 1)
    child = mp.get_context("fork").Process(target=os.getpid)
    child.start()
    child.join(60)
    assert process_start_time(child.pid) is None


@pytest.mark.parametrize("numel,size,parts", [(0, 4, 2), (5, 4, 2), (17, 4, 3), (1000, 4, 3), (100_003, 2, 2)])
def test_chunks_cover_everything_once_on_cache_lines(numel, size, parts):
    bounds = chunk_bounds(numel, size, parts)
    assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == parts + 1
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert all(b * size % 64 == 0 for b in bounds[:-1] if b < numel)


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False), ("off", False), ("false", False)])
def test_phalanx_shm_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("PHALANX_SHM", raising=False)
    else:
        monkeypatch.setenv("PHALANX_SHM", value)
    assert shm_enabled() is enabled

"""Single-process tests of shared-memory segments: permissions, names, attaching, chunking, the switch.

Sweeping a dead creator's segments and telling a recycled pid apart need a child process: they are in
tests/ranks/test_shm_segment.py.
"""

import os
import stat

import pytest

from phalanx.shm import shm_enabled
from phalanx.shm.reduce import chunk_bounds
from phalanx.shm.segment import PREFIX, SHM_DIR, Segment

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


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

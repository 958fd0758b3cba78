"""The unit tier runs in one process: starting a child process fails the test (move it to tests/ranks/)."""

import multiprocessing.process
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_child_processes(monkeypatch):
    """subprocess and multiprocessing (DataLoader workers included) refuse to start a process."""

    def refuse(*args, **kwargs):
        raise AssertionError("a unit test started a child process: tests that start processes belong in "
                             "tests/ranks/ (library code) or tests/e2e/ (commands), see tests/conftest.py")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True)
def _no_restore_carried_over():
    """Each test is a process of its own as far as a restored step goes (world/step_count.py: px.shutdown() forgets it,
    and the tests of one worker share a process that never shuts down)."""
    yield
    from phalanx.world import step_count

    step_count.forget()


@pytest.fixture
def world_of_one():
    """A Gloo process group of one rank in this process (an in-process store), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()

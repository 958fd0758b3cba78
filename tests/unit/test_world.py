"""`phalanx.init()` and the rank helpers.

TestBadEnvironment runs init() in this process (it fails before creating a process group);
TestWorld is multi-process (world size 2, Gloo on CPU, spawned by phalanx.spawn / phalanx.testing).
"""

import socket
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import MasterUnreachableError, PortInUseError, RanksTimedOutError, WorldConfigError
from phalanx.testing import free_port, run_ranks

WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "TORCHELASTIC_USE_AGENT_STORE", "PHALANX_STORE_HOSTED", "SLURM_PROCID", "SLURM_NTASKS",
                   "SLURM_STEP_NUM_TASKS", "OMP_NUM_THREADS", "PHALANX_RANK_PREFIXED")


@pytest.fixture
def world_env(monkeypatch):
    """A clean environment to describe a world in; init() state is reset afterwards."""
    for name in WORLD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield lambda **values: [monkeypatch.setenv(k, str(v)) for k, v in values.items()]
    phalanx.shutdown()
    torch.set_num_threads(threads)


class TestBadEnvironment:
    @pytest.mark.parametrize("values, named", [
        (dict(RANK=2, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500), "RANK"),
        (dict(RANK=-1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500), "RANK"),
        (dict(RANK=0, WORLD_SIZE="two", MASTER_ADDR="127.0.0.1", MASTER_PORT=29500), "WORLD_SIZE"),
        (dict(RANK=0, WORLD_SIZE=2, MASTER_PORT=29500), "MASTER_ADDR"),
        (dict(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1"), "MASTER_PORT"),
    ])
    def test_init_raises_a_typed_error_naming_the_variable(self, world_env, values, named):
        world_env(**values)
        with pytest.raises(WorldConfigError, match=named):
            phalanx.init()
        assert not phalanx.is_initialized() and not dist.is_initialized()

    def test_unreachable_master_names_address_and_port_in_bounded_time(self, world_env):
        port = free_port()  # nothing listens there
        world_env(RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        started = time.monotonic()
        with pytest.raises(MasterUnreachableError) as error:
            phalanx.init(connect_timeout=1)
        assert f"127.0.0.1:{port}" in str(error.value) and "[rank 1]" in str(error.value)
        assert time.monotonic() - started < 60  # bounded: a hang would hit pytest's timeout instead

    def test_port_in_use_is_reported_by_rank_zero(self, world_env):
        with socket.socket() as other_program:
            other_program.bind(("127.0.0.1", 0))
            other_program.listen()
            port = other_program.getsockname()[1]
            world_env(RANK=0, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            with pytest.raises(PortInUseError) as error:
                phalanx.init(connect_timeout=5)
        assert f"port {port}" in str(error.value) and "MASTER_PORT" in str(error.value)

    def test_helpers_before_init_say_what_to_do(self, world_env):
        with pytest.raises(WorldConfigError, match=r"phalanx.init\(\)"):
            phalanx.local_rank()


def _describe(rank):
    again = phalanx.init()  # idempotent: spawn already called it
    phalanx.logger.info("info from %d", rank)
    phalanx.logger.warning("warning from %d", rank)
    phalanx.print0("print0 from", rank)
    return dict(rank=phalanx.rank(), world_size=phalanx.world_size(), local_rank=phalanx.local_rank(),
                is_main=phalanx.is_main(), device=str(again), backend=dist.get_backend(),
                threads=torch.get_num_threads())


def _skip_barrier_on_rank_1(rank):
    if rank == 1:
        return None  # never arrives at the barrier (the store, hosted by spawn's parent, stays up)
    try:
        phalanx.barrier(timeout=1)
    except RanksTimedOutError as error:
        return error.missing_ranks, str(error)
    return None


class TestWorld:
    """World size 2."""

    def test_rank_helpers_logging_and_shared_cores(self, capfd, monkeypatch):
        # No OMP_NUM_THREADS and no torch.set_num_threads: init() divides the cores among local ranks.
        for name in ("OMP_NUM_THREADS", "PHALANX_RANK_PREFIXED"):
            monkeypatch.delenv(name, raising=False)
        threads = max(1, phalanx.world.usable_cores() // 2)
        results = phalanx.spawn(_describe, 2, env={"PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
        assert results == [dict(rank=r, world_size=2, local_rank=r, is_main=r == 0, device="cpu", backend="gloo",
                                threads=threads) for r in range(2)]
        # Rank 0 logs INFO, every rank logs WARNING, each line carries the rank; print0 prints once.
        out, err = capfd.readouterr()
        assert "[rank 0] INFO info from 0" in err and "info from 1" not in err
        assert "[rank 0] WARNING warning from 0" in err and "[rank 1] WARNING warning from 1" in err
        assert "print0 from 0" in out and "print0 from 1" not in out

    def test_barrier_timeout_names_the_missing_rank(self):
        missing, message = run_ranks(_skip_barrier_on_rank_1, 2)[0]
        assert missing == [1] and "[1]" in message

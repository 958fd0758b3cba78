"""`phalanx.init()` in a bad environment, in this process: it fails before creating a process group,
with a typed error that names the variable. The rank helpers in a world of 2 spawned processes are
in tests/ranks/test_world.py.
"""

import socket
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import MasterUnreachableError, PortInUseError, WorldConfigError
from phalanx.testing import free_port

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

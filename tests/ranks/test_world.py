"""`phalanx.init()` and the rank helpers, multi-process (world size 2, Gloo on CPU, spawned by
phalanx.spawn / phalanx.testing). init() in a bad environment, in this process, is in
tests/unit/test_world.py.
"""

import torch
import torch.distributed as dist

import phalanx
from phalanx.errors import RanksTimedOutError
from phalanx.testing import run_ranks


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
        """World size 2 (phalanx.spawn, ranks forked from its server)."""
        for name in ("OMP_NUM_THREADS", "PHALANX_RANK_PREFIXED"):
            monkeypatch.delenv(name, raising=False)
        threads = max(1, phalanx.world.usable_cores() // 2)
        results = phalanx.spawn(_describe, 2, env={"PHALANX_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}, timeout=120,
                                start_method="forkserver")
        assert results == [dict(rank=r, world_size=2, local_rank=r, is_main=r == 0, device="cpu", backend="gloo",
                                threads=threads) for r in range(2)]
        # Rank 0 logs INFO, every rank logs WARNING, each line carries the rank; print0 prints once.
        out, err = capfd.readouterr()
        assert "[rank 0] INFO info from 0" in err and "info from 1" not in err
        assert "[rank 0] WARNING warning from 0" in err and "[rank 1] WARNING warning from 1" in err
        assert "print0 from 0" in out and "print0 from 1" not in out

    def test_barrier_timeout_names_the_missing_rank(self):
        """World size 2: rank 1 never arrives at the barrier."""
        missing, message = run_ranks(_skip_barrier_on_rank_1, 2)[0]
        assert missing == [1] and "[1]" in message

"""A Gloo loop left spinning by a loss is silenced (world/process/gloo_loops.py), in plain collectives on 4 CPU ranks.

After a rank is lost, an all-reduce left pending on a Gloo group can leave a survivor's pair holding a live peer's
message that the collective never takes: the group's loop thread is woken for it again and again and spins a core
(benchmarks/live_recovery/gloo_spin_after_loss.py). Here rank 0 starts that all-reduce before the others, which
makes it spin every time it was tried (12 of 12); quiet() must end the spin, and the process must still free the
group and exit cleanly (Gloo unregisters the silenced sockets itself then).
"""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.testing import run_ranks
from phalanx.world.process import gloo_loops

LOST = 3


def _loop_cpu_ms(threads) -> float:
    """CPU milliseconds the given threads have used so far."""
    total = 0
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except OSError:  # ended with its group
            pass
    return total / 1e6


def _cpu_over_a_second(threads) -> float:
    before = _loop_cpu_ms(threads)
    time.sleep(1.0)
    return _loop_cpu_ms(threads) - before


def _spin_then_quiet(rank: int):
    before = gloo_loops.loop_threads()
    group = dist.new_group(timeout=timedelta(seconds=4))
    dist.all_reduce(torch.ones(4), group=group)  # every pair connected; the loop now waits in its epoll
    gloo_loops.note(group, before)
    threads, epolls = gloo_loops.threads_of(group), gloo_loops.epolls_of(group)
    dist.barrier(group=group)
    if rank == LOST:
        os.kill(os.getpid(), signal.SIGKILL)  # lost (run_ranks goes on without a rank killed by a signal)
    time.sleep(0.2 if rank == 0 else 0.35)  # rank 0 first: its pairs then hold the others' messages
    pending = dist.all_reduce(torch.ones(16), group=group, async_op=True)  # waits on the lost rank for ever
    time.sleep(0.3)
    spinning = _cpu_over_a_second(threads)
    silenced = gloo_loops.quiet((group,), last=True)
    time.sleep(0.05)  # at most one hang-up left to report
    after = _cpu_over_a_second(threads)
    dist.destroy_process_group(group)
    del group, pending  # freed once the pending all-reduce's timeout ends it: Gloo unregisters every socket
    return {"threads": len(threads), "epolls": epolls, "spinning": spinning, "silenced": silenced, "after": after}


def test_quieting_a_group_left_by_a_loss_stops_its_spinning_loop_and_the_process_still_exits_cleanly():
    results = run_ranks(_spin_then_quiet, 4, min_world_size=3, timeout=60)
    first = results[0]
    assert first["threads"] == 1 and first["epolls"][0] is not None, first  # its loop, found waiting in its epoll
    # the case silence() is for: without it, rank 0's loop takes a whole core
    assert first["spinning"] > 500, f"the loop did not spin ({first['spinning']:.0f} ms in a second): not reproduced"
    assert first["silenced"] >= 1, first  # the pair its loop spun on
    assert first["after"] < 50, f"rank 0's loop still took {first['after']:.0f} ms of CPU a second once silenced"
    for rank in (1, 2):  # the run ended on every survivor, each silencing its own pairs
        assert results[rank] is not None and results[rank]["after"] < 50, results[rank]

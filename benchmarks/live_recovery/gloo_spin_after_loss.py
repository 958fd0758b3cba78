"""A survivor's Gloo event loop after a peer is lost in a collective, in plain torch: how much CPU its thread burns,
and whether freeing the group, or its backend's abort() or shutdown(), stops it (phalanx here only finds the loop's
threads and a free port).

    python benchmarks/live_recovery/gloo_spin_after_loss.py [--ranks 4] [--seconds 6] [--group world|new]
        [--then none|abort|shutdown|idle|free] [--compute] [--rounds 3]

`--ranks` processes on 127.0.0.1 make a Gloo group (torch's default one, or `dist.new_group` with a 3 s timeout);
the last rank exits, and the others start an all-reduce of 16 floats on the group, which waits on it. A survivor's
pair can then hold a message from a live peer for a buffer its all-reduce has not posted yet (it waits on the lost
rank first): Gloo leaves the message in the socket, its epoll loop is woken for it at once, again and again, and
the loop's thread (`gloo_tcp_loop`, one per group) spins. Rank 0 prints its loop threads' CPU, milliseconds a
second, for `--seconds` seconds; after 2 s it does `--then` to the group: nothing, its backend's abort() or
shutdown(), `idle` (its loop threads put at SCHED_IDLE, as phalanx does at a loss: world/process/gloo_loops.py),
or (`free`, only with `--group new`) destroy_process_group and dropping the last reference, which waits for the
pending all-reduce to end (its timeout) before the group's pairs close. `--compute`: rank 0's main thread, on the
same core as its loops, counts a pure-Python loop's rounds each second instead of sleeping, against a second of it
before the loss: what a spinning loop takes from the training on its core.

Why phalanx cares (docs/benchmarks.md, "Live recovery's control plane"): a loss under live recovery leaves the
generation's groups with such a pending collective, and a survivor whose loop spins loses a core until the group is
freed; generation 0 trains on torch's default group, which is never freed, so there it spins until the process
exits. Seen in the 16-host loss runs (benchmarks/control_plane/control_plane.py) as rank 0's loop taking 0.4-0.8 of
a core from its agreement to the run's end, in about half the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phalanx.testing import free_port
from phalanx.world.process.gloo_loops import loop_threads

LOST_AFTER = 0.2  # seconds from the barrier to the survivors' all-reduce (the lost rank is gone by then)


def loop_milliseconds() -> float:
    """CPU milliseconds used so far by this process's Gloo loop threads."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, open(f"/proc/self/task/{tid}/schedstat") as stat:
                if comm.read().strip() == "gloo_tcp_loop":
                    total += int(stat.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e6


def rounds_in_a_second() -> int:
    """A pure-Python loop's rounds in one second of this thread."""
    count, end = 0, time.perf_counter() + 1.0
    while time.perf_counter() < end:
        for _ in range(1000):
            count += 1
    return count // 1000


def rank_main(rank: int, ranks: int, port: int, group_kind: str, then: str, seconds: int, compute: bool,
              results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=30))
    group = dist.new_group(timeout=timedelta(seconds=3)) if group_kind == "new" else dist.group.WORLD
    dist.all_reduce(torch.ones(4), group=group)  # every pair of the group connected
    baseline = None
    if rank == 0 and compute:  # this thread and the loops on one core; a second of work before anyone is lost
        core = {min(os.sched_getaffinity(0))}
        for tid in [0, *loop_threads()]:
            os.sched_setaffinity(tid, core)
        baseline = rounds_in_a_second()
    dist.barrier()
    if rank == ranks - 1:
        os._exit(0)  # lost
    time.sleep(LOST_AFTER)
    pending = dist.all_reduce(torch.ones(16), group=group, async_op=True)  # waits on the lost rank
    if rank != 0:
        time.sleep(seconds + 5)
        os._exit(0)
    per_second = []
    for second in range(seconds):
        if second == 2 and then != "none":
            if then == "free":
                dist.destroy_process_group(group)
                del group, pending  # the last references: freeing waits for the all-reduce to end
            elif then == "idle":
                for tid in loop_threads():
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                getattr(group._get_backend(torch.device("cpu")), then)()
        before = loop_milliseconds()
        if compute:
            rate = rounds_in_a_second() / baseline
        else:
            time.sleep(1.0)
        per_second.append((round(loop_milliseconds() - before), round(rate, 2)) if compute
                          else round(loop_milliseconds() - before))
    results.put(per_second)
    results.close()
    results.join_thread()  # flushed before the exit, which skips the queue's own
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes, the last one lost (default 4)")
    parser.add_argument("--seconds", type=int, default=6, help="seconds rank 0's loop is watched (default 6)")
    parser.add_argument("--group", choices=("world", "new"), default="world", help="torch's default group or a new one")
    parser.add_argument("--then", choices=("none", "abort", "shutdown", "idle", "free"), default="none",
                        help="what rank 0 does to the group after 2 s (default none)")
    parser.add_argument("--compute", action="store_true",
                        help="rank 0 computes on its loops' core each second (its rate against before the loss)")
    parser.add_argument("--rounds", type=int, default=3, help="runs (default 3)")
    args = parser.parse_args()
    if args.then == "free" and args.group != "new":
        parser.error("--then free: only a group of --group new can be freed (torch's default one goes with the world)")
    if args.ranks < 3:
        parser.error("--ranks: at least 3 (two survivors, so that one can hear from the other)")
    context = mp.get_context("spawn")
    spun, rates = [], []
    for round_number in range(args.rounds):
        results = context.Queue()
        port = free_port()
        processes = [context.Process(target=rank_main, args=(rank, args.ranks, port, args.group, args.then,
                                                              args.seconds, args.compute, results))
                     for rank in range(args.ranks)]
        for process in processes:
            process.start()
        per_second = results.get(timeout=args.seconds + 60)
        for process in processes:
            process.join(timeout=args.seconds + 30)
            if process.is_alive():
                process.kill()
        later = per_second[3:] or per_second
        spun.append(statistics.mean(v[0] if args.compute else v for v in later))
        rates.extend(v[1] for v in later if args.compute)
        what = "(ms of its CPU, rank 0's compute rate)" if args.compute else "ms of CPU"
        print(f"round {round_number + 1}: rank 0's Gloo loop, each second, {what}: {per_second} ({args.then} after "
              f"2 s)", flush=True)
    print(f"\n{args.group} group, then {args.then}: the loop's CPU from the 4th second on, mean over rounds: "
          f"{statistics.mean(spun):.0f} ms a second (1000: a whole core)"
          + (f"; rank 0's compute on its core: {statistics.mean(rates):.2f} of its rate before the loss" if rates
             else ""))


if __name__ == "__main__":
    main()

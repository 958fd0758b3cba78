"""What live recovery's control plane sends, counted on namespace hosts: shared by tests/e2e/test_control_plane.py
and benchmarks/control_plane/control_plane.py.

`run_job` starts tests/e2e/jobs/control_plane_job.py under `phalanx run --nnodes N --node-rank i` on each host (live
recovery on: `--min-world-size` = the ranks of all hosts but one; off: `--min-world-size 0`) and waits for it; each
host's TCP counters are read by the job at the ends of two steps (the window), so `figures` turns them into what one
rank sends per step. What live recovery adds is the difference between a run with it on and one with it off.
`loss_run` starts the same job, then SIGKILLs the last host whole or sets its link down, and reads when the ranks left
named the loss, how long they took to regroup, and when their next step came.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.diagnose.stacks import descendants, stat_fields
from phalanx.testing import free_port
from tests.conftest import ROOT
from tests.e2e.test_elastic import job_env, kill_node

JOB = str(ROOT / "tests" / "e2e" / "jobs" / "control_plane_job.py")
WARMUP = 5  # steps before the window: the groups made, the first connections opened, the agreement's pace found
HANG_GUARD = 300  # seconds a run may take at most


@dataclass
class Figures:
    """One run's window, per rank and step: TCP connections opened (ActiveOpens), segments sent (OutSegs), segments the
    store's host received per step (InSegs of host 0, whose launcher holds the store), the mean step time
    (`durations`: each step's, launch rank 0's, in the window; none in a difference of two runs), and the segments
    both ways on one rank's own connections to the store (`rank_store`: its own and its watch's), on the kept watch it
    opened (`rank_watch`; the one its beacon accepted is its watcher's, counted there) and on the rest (`rank_other`:
    Gloo's pairs; `rank_other_data`: those of them that carried data, pure ACKs not), from local rank 0 of each host:
    `rank_store` + `rank_watch` is what the control plane itself sends and receives per rank, each connection counted
    once, whatever Gloo does; `commit`: the seconds a rank spends in the per-step commit per step (the mean over the
    ranks; 0 with live recovery off); `rank_tree`: the segments both ways on the commit tree's connections (its
    listener's and the one to its parent's: world/generations/commit_tree.py), part of the control plane's own."""

    connections: float
    segments: float
    store_host_in: float
    step_seconds: float
    rank_store: float = 0.0
    rank_other: float = 0.0
    rank_watch: float = 0.0
    rank_other_data: float = 0.0
    commit: float = 0.0
    durations: tuple = ()
    rank_tree: float = 0.0

    def minus(self, other: Figures) -> Figures:
        return Figures(self.connections - other.connections, self.segments - other.segments,
                       self.store_host_in - other.store_host_in, self.step_seconds - other.step_seconds,
                       self.rank_store - other.rank_store, self.rank_other - other.rank_other,
                       self.rank_watch - other.rank_watch, self.rank_other_data - other.rank_other_data,
                       self.commit - other.commit, (), self.rank_tree - other.rank_tree)


class Job:
    """One `phalanx run` per host, its output kept line by line with the time each line came."""

    def __init__(self, hosts: list[dict], run_dir: Path, per_host: int, live: bool, steps: int, window: tuple,
                 pause: float, debug: bool = False, job_args: tuple = ()):
        self.hosts, self.run_dir, self.per_host = hosts, run_dir, per_host
        self.ranks = len(hosts) * per_host
        minimum = self.ranks - per_host if live else 0  # on: any one host may be lost
        port = free_port()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[list[tuple[float, str]]] = [[] for _ in hosts]
        self.launchers = [subprocess.Popen(
            ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes", str(len(hosts)),
             "--node-rank", str(i), "--nproc-per-node", str(per_host), "--min-world-size", str(minimum),
             "--master-addr", hosts[0]["addr"], "--master-port", str(port), "--rdzv-timeout", "60", JOB, str(run_dir),
             "--host", str(i), "--steps", str(steps), "--window", f"{window[0]}:{window[1]}", "--pause", str(pause),
             *(["--debug"] if debug else []), *job_args],
            env=job_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, host in enumerate(hosts)]
        self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(len(hosts))]
        for reader in self.readers:
            reader.start()

    def _read(self, i: int) -> None:
        for line in self.launchers[i].stdout:
            self.lines[i].append((time.time(), line.rstrip("\n")))

    def output(self, i: int) -> str:
        return "\n".join(line for _, line in self.lines[i])

    def wait(self, which=None) -> None:
        """Wait for the launchers `which` (default all) to end; kill every launcher and fail on a hang or an error."""
        which = range(len(self.launchers)) if which is None else which
        deadline = time.monotonic() + HANG_GUARD
        try:
            for i in which:
                self.launchers[i].wait(timeout=max(1.0, deadline - time.monotonic()))
                self.readers[i].join(timeout=10)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job did not end within {HANG_GUARD} s:\n{self.outputs()}") from None
        failed = [i for i in which if self.launchers[i].returncode != 0]
        if failed:
            self.stop()
            raise AssertionError(f"host(s) {failed} ended with an error:\n{self.outputs()}")

    def ended(self) -> bool:
        """Whether a host's launcher has ended."""
        return any(launcher.poll() is not None for launcher in self.launchers)

    def await_steps(self, rank: int, steps: int, who: str | None = None) -> None:
        """Wait until launch rank `rank` applied `steps` steps; if a launcher ends first or HANG_GUARD passes, fail."""
        deadline = time.monotonic() + HANG_GUARD
        while len(self.step_times(rank)) < steps:
            if time.monotonic() > deadline or self.ended():
                self.stop()
                raise AssertionError(f"{who or f'rank {rank}'} did not make {steps} steps:\n{self.outputs()}")
            time.sleep(0.005)

    def stop(self) -> None:
        for launcher in self.launchers:
            if launcher.poll() is None:
                kill_node(launcher)

    def outputs(self, tail: int = 1500) -> str:
        """Each host's exit code and the last `tail` characters of its output."""
        return "\n".join(f"== host {i} (exit {launcher.returncode}):\n{self.output(i)[-tail:]}"
                         for i, launcher in enumerate(self.launchers))

    def step_times(self, rank: int) -> list[tuple[int, float, int, int]]:
        """(step, time, generation, world size) per step launch rank `rank` applied."""
        path = self.run_dir / f"steps-{rank}.txt"
        if not path.exists():
            return []
        rows = [line.split() for line in path.read_text().splitlines()]
        return [(int(s), float(t), int(g), int(w)) for s, t, g, w in (row for row in rows if len(row) == 4)]


def run_job(hosts: list[dict], run_dir: Path, *, per_host: int = 1, live: bool, window: int = 20,
            pause: float = 0.15) -> Figures:
    """One run on `hosts` (steps WARMUP+1 .. WARMUP+window counted) and its figures."""
    first, last = WARMUP, WARMUP + window
    job = Job(hosts, run_dir, per_host, live, last + 1, (first, last), pause)
    try:
        job.wait()
    finally:
        job.stop()
    return figures(job, first, last)


def figures(job: Job, first: int, last: int) -> Figures:
    """Per rank and step over steps first+1 .. last, from the counters each host read at their ends."""
    totals: dict[str, int] = {}
    store_host_in = 0
    for i in range(len(job.hosts)):
        read = json.loads((job.run_dir / f"tcp-{i}.json").read_text())
        for name in ("ActiveOpens", "OutSegs", "store", "other", "watch", "watched", "other_data", "tree"):
            totals[name] = totals.get(name, 0) + read[str(last)].get(name, 0) - read[str(first)].get(name, 0)
        if i == 0:
            store_host_in = read[str(last)]["InSegs"] - read[str(first)]["InSegs"]
    steps = last - first
    times = {step: when for step, when, _, _ in job.step_times(0)}
    hosts, window = len(job.hosts), range(first + 1, last + 1)
    commits = [json.loads((job.run_dir / f"commit-{rank}.json").read_text()) for rank in range(job.ranks)]
    commit = sum(spent.get(str(step), 0.0) for spent in commits for step in window) / (job.ranks * steps)
    return Figures(totals["ActiveOpens"] / (job.ranks * steps), totals["OutSegs"] / (job.ranks * steps),
                   store_host_in / steps, (times[last] - times[first]) / steps, totals["store"] / (hosts * steps),
                   totals["other"] / (hosts * steps), totals["watch"] / (hosts * steps),
                   totals["other_data"] / (hosts * steps), commit,
                   tuple(times[step] - times[step - 1] for step in window), totals["tree"] / (hosts * steps))


def added(hosts: list[dict], run_dir: Path, *, per_host: int = 1, window: int = 20,
          pause: float = 0.15) -> tuple[Figures, Figures]:
    """Live recovery on, then off, on the same hosts: (on, off)."""
    on = run_job(hosts, run_dir / "on", per_host=per_host, live=True, window=window, pause=pause)
    off = run_job(hosts, run_dir / "off", per_host=per_host, live=False, window=window, pause=pause)
    return on, off


# -- a host lost ------------------------------------------------------------------------------------------------------

LOST_LINE = re.compile(r"lost ranks \[([\d, ]+)\].*regrouped in ([\d.]+) s")
FOUND_LINE = re.compile(r"found rank \d+ gone")  # a watcher's verdict, at DEBUG (the job's --debug)
SUMMARY_REGROUP = re.compile(r"lost.*kept in-process: .*regrouped in ([\d.]+) s")


@dataclass
class Loss:
    """A host lost: seconds from the kill (or the cut) to the moment the ranks left named it (`detected`: the first
    worker line that says a rank was found gone, when there is one (`detected_by` "verdict"), else the line that names
    the lost ranks less the regroup it reports ("lost line")), the regroup (`regroup`: the agreement and the new
    groups, as that line says; `regroup_summary`: the launcher's run summary, the models and loaders too), and to the
    first step every rank left applied in the generation after it (`next_step`); for a kill, when the victim's workers
    had exited (`exited`, as the kernel told it: ExitTimes), what they held then (`victim`: resident kB
    and threads, as watch_end.py reports its own victim's: a process's teardown, which its sockets' close waits for,
    grows with both), and the regroup's parts on every survivor (`parts`, regroup_parts)."""

    how: str
    detected: float | None
    detected_by: str
    regroup: float | None
    regroup_summary: float | None
    next_step: float | None
    lost: list[int]
    exited: float | None = None  # a kill: seconds until the victim's workers had exited, as the kernel told it
    parts: dict | None = None  # regroup_parts()
    victim: dict | None = None  # a kill: {"rss_kb": [...], "threads": [...]}, a value per worker killed, and
    # "exited_each": the seconds to each one's exit, in order; a cut:
    # {"cut_host": "stopped" or "runs", "cpu_share": the cores its processes took from the cut to the others' end}


def loss_run(hosts: list[dict], run_dir: Path, how: str, *, per_host: int = 1, after: int = 8, steps: int = 30,
             pause: float = 0.15, cut_host: str = "stopped") -> Loss:
    """Live recovery on; once the last host applied `after` steps, SIGKILL its launcher and workers (`how` = "kill")
    or set its link down ("cut"; killed at the end). A cut host's processes are SIGSTOPped as its link goes down
    (`cut_host` = "stopped"): on real hosts they would run on cores of their own, while here they would take the
    survivors' (`cut_host` = "runs" lets them, and `victim` then says how much CPU they took). The others finish."""
    if cut_host not in ("stopped", "runs"):
        raise ValueError(f"cut_host={cut_host!r}: expected 'stopped' or 'runs'")
    if run_dir.exists():
        raise ValueError(f"{run_dir} exists: a loss run needs a folder of its own (it reads the steps logged there)")
    job = Job(hosts, run_dir, per_host, True, steps, (1, 2), pause, debug=True)
    victim = len(hosts) - 1
    watched = victim * per_host  # its first launch rank (a fixed --nnodes numbers the nodes' ranks in order)
    try:
        job.await_steps(watched, after, who=f"host {victim}")
        if how == "cut":
            cut_off = descendants(job.launchers[victim].pid)  # its launcher and everything under it
            cpu_before = cpu_seconds(cut_off)
            struck = time.time()
            subprocess.run(["ip", "-n", hosts[victim]["ns"], "link", "set", "dev", hosts[victim]["dev"], "down"],
                           check=True, timeout=30)
            if cut_host == "stopped":
                kill_at_once(cut_off, signal.SIGSTOP)
        else:
            # its launcher and workers by pid, together: kill_node's way goes through the warm launcher, which
            # finds and kills them only once it notices (tens to hundreds of ms on a loaded machine: the harness's
            # delay, not the control plane's)
            pids = [int((run_dir / f"pid-{rank}.txt").read_text()) for rank in range(watched, watched + per_host)]
            launchers = {int(stat_fields(pid)[1]) for pid in pids}
            held = [held_by(pid) for pid in pids]
            victim_held = {"rss_kb": [rss for rss, _ in held], "threads": [threads for _, threads in held]}
            exits = ExitTimes(pids)
            struck = time.time()
            kill_at_once([*launchers, *pids])
            exited = exits.last(struck)
            victim_held["exited_each"] = sorted(round(at - struck, 4) for at in exits.times.values())
            kill_node(job.launchers[victim])
        job.wait(range(victim))
        if how == "cut":
            victim_held = {"cut_host": cut_host, "cpu_share": round((cpu_seconds(cut_off) - cpu_before)
                                                                    / (time.time() - struck), 3)}
    finally:
        job.stop()
    survivors = [rank for rank in range(job.ranks) if rank // per_host != victim]
    return Loss(how, *_named(job, survivors, struck), _summary_regroup(job.output(0)),
                _next_step(job, survivors, struck), list(range(victim * per_host, job.ranks)),
                exited if how == "kill" else None,
                regroup_parts(job, survivors, struck), victim_held)


class ExitTimes:
    """When each of `pids` exited, as the kernel tells it: a thread per process blocks in poll() on its pidfd, which
    turns readable once its last thread has exited (its files, and so its sockets, closed just before). A thread
    asleep in poll() is woken as a kept watch's is, so on a loaded machine this is the victim's teardown as the
    control plane meets it, without a polling loop's own delay."""

    def __init__(self, pids: list[int]):
        self.times: dict[int, float] = {}
        self.threads = [threading.Thread(target=self._wait, args=(pid, os.pidfd_open(pid)), daemon=True)
                        for pid in pids]
        for thread in self.threads:
            thread.start()

    def _wait(self, pid: int, pidfd: int) -> None:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()
            self.times[pid] = time.time()
        finally:
            os.close(pidfd)

    def last(self, struck: float, limit: float = 5.0) -> float | None:
        """Seconds from `struck` to the last of them exiting (None: one outlived `limit`)."""
        for thread in self.threads:
            thread.join(timeout=max(0.0, struck + limit - time.time()))
        return None if len(self.times) < len(self.threads) else max(self.times.values()) - struck


def cpu_seconds(pids: list[int]) -> float:
    """The CPU `pids` have used so far, user and system (those gone count nothing)."""
    fields = [stat_fields(pid) for pid in pids]
    return sum(int(f[11]) + int(f[12]) for f in fields if f) / os.sysconf("SC_CLK_TCK")


def held_by(pid: int) -> tuple[int, int]:
    """(resident kB, threads) of process `pid`, from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmRSS"].split()[0]), int(fields["Threads"])


def kill_at_once(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """SIGKILL (or `sig`) `pids` as a host's death does, at one moment: the loop runs at a real-time priority, so
    that nothing takes this core between two kills. Preempted there for milliseconds (a loaded machine), it would let
    a victim not yet killed see its host's first victim gone and enter the survivors' agreement before its own death.
    A process already gone is passed over."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, OSError):  # no real-time scheduling here (not root, or not Linux): kill them in turn
        before = None
    try:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    finally:
        if before is not None:
            os.sched_setscheduler(0, *before)


def regroup_parts(job: Job, survivors: list[int], struck: float) -> dict:
    """When each part of the regroup began and ended, in seconds from `struck`, from the job's regroup-<rank>.txt:
    {part: [earliest start, latest start, earliest end, latest end]} over the survivors, and the same of rank 0 alone
    (the rank whose lines the run's regroup figures are) under "rank0", and under "cpu" each part's CPU seconds in a
    survivor's process, the mean over the survivors."""
    spans: dict[str, list[tuple[float, float]]] = {}
    first: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for rank in survivors:
        path = job.run_dir / f"regroup-{rank}.txt"
        seen = set()
        for line in path.read_text().splitlines() if path.exists() else ():
            part, start, end, *used = line.split()
            if part in seen or float(start) < struck:  # only the first loss's parts (not those of the start's watch)
                continue
            seen.add(part)
            span = (float(start) - struck, float(end) - struck)
            spans.setdefault(part, []).append(span)
            if used and float(used[0]) >= 0:
                cpu.setdefault(part, []).append(float(used[0]))
            if rank == survivors[0]:
                first[part] = [round(value, 4) for value in span]
    parts = {part: [round(value, 4) for value in (min(s for s, _ in got), max(s for s, _ in got),
                                                  min(e for _, e in got), max(e for _, e in got))]
             for part, got in spans.items()}
    return {**parts, "rank0": first, "cpu": {part: round(statistics.mean(got), 5) for part, got in cpu.items()}}


def _named(job: Job, survivors: list[int], struck: float) -> tuple[float | None, str, float | None]:
    """(seconds from `struck` to the loss named, how that was read, the regroup's seconds) from the survivors' logs."""
    verdicts, named, regroup = [], [], None
    for rank in survivors:
        path = job.run_dir / f"log-{rank}.txt"
        for line in path.read_text().splitlines() if path.exists() else ():
            when, _, message = (line.split(" ", 2) + ["", ""])[:3]
            try:
                if float(when) < struck:
                    continue
            except ValueError:  # a record's second line
                continue
            if FOUND_LINE.search(message):
                verdicts.append(float(when))
            lost = LOST_LINE.search(message)
            if lost:
                regroup = float(lost.group(2)) if regroup is None else regroup
                named.append(float(when) - float(lost.group(2)))
    if verdicts:
        return min(verdicts) - struck, "verdict", regroup
    return (min(named) - struck if named else None), "lost line", regroup


def _summary_regroup(output: str) -> float | None:
    found = SUMMARY_REGROUP.search(output)
    return float(found.group(1)) if found else None


def _next_step(job: Job, survivors: list[int], struck: float) -> float | None:
    """Seconds from `struck` to the first step every rank left applied in a later generation (a step applied just
    after the kill may be one the lost host had taken its part in)."""
    firsts = []
    for rank in survivors:
        later = [when for _, when, generation, _ in job.step_times(rank) if generation > 0]
        if not later:
            return None
        firsts.append(min(later))
    return max(firsts) - struck

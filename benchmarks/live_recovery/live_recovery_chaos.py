"""A chaos run: three hosts training for minutes while ranks die, hosts die, are cut off, come back, and stop.

    sudo PYTHONPATH=. python benchmarks/live_recovery/live_recovery_chaos.py [--minutes 20] [--seed 0] [--pause 0.1]
        [--every 15:40] [--only kill-rank,kill-host,cut-host,stop] [--shard optimizer|gradients]

Three hosts (network namespaces on a bridge, root needed), `phalanx run --nnodes 2:3 --nproc-per-node 2
--min-world-size 2` on each, benchmarks/live_recovery/live_recovery_chaos_job.py (the loop of docs/data.md,
resumable). Every 15-40 s (drawn; `--every`) one of (`--only` draws from some):
- kill-rank: SIGKILL one worker of a host drawn at random (live recovery: the others go on in-process; when too few
  would be left, the group restarts from its newest checkpoint);
- kill-host: SIGKILL host 1's or host 2's launcher and workers; it comes back 5-15 s later (it joins the workers in
  progress at a step boundary, handed their state, a sharded optimizer's cut again for the larger world; with
  workers not yet in their loop, the others save at an agreed step and the group restarts at the larger world
  instead);
- cut-host: set host 1's or host 2's link down for 5-10 s (its launcher loses the store and ends; it is started
  again once the link is back);
- stop: SIGTERM every launcher (the agreed stop: a save, exit 75), then the same commands again (a resume).
Host 0 owns the store: losing it ends the run by design, so it is never hit whole (its ranks are). A host whose
launcher ended is started again. After `--minutes`, the chaos stops, the run is told to end two epochs later, and
the checks are printed:
- every applied step (the last incarnation of each: a step redone after a restart replaces the first) averaged the
  samples the uninterrupted run's did, each sample once per epoch; a step may lack the part of a rank killed
  between applying it and logging it, never more;
- the final parameters against one process on whole global batches for as many epochs;
- RSS: each worker that lived over 3 minutes, from its 60th second to its last sample;
- nothing left behind: processes of the run, shared-memory segments, namespaces and links, the run's temporary files.
With `--shard`, the model is sharded at that level (its optimizer shards kept in copies on the next host's ranks:
a lost rank's shard comes back from its keeper, sharding/shard_copies/).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.live_recovery.live_recovery_chaos_job import hidden_width
from phalanx.shm.segment import PREFIX, SHM_DIR
from phalanx.testing import free_port
from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.e2e.test_elastic import kill_node
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.namespaces import bridged_hosts

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "benchmarks" / "live_recovery" / "live_recovery_chaos_job.py")
HOSTS, PER_HOST = 3, 2
LONG_LIVED, SETTLED = 90, 30  # seconds: a worker's RSS is checked from SETTLED seconds in, if it lived LONG_LIVED
# How often each event is drawn: kills of one rank most (the others go on in-process); a stop and a host lost
# restart every worker (the host comes back and joins), so they are rarer, and some workers live long.
EVENTS = ("kill-rank", "kill-rank", "kill-rank", "kill-host", "cut-host", "stop")


class Cluster:
    """The three hosts' launchers: started, killed, cut off, stopped, started again."""

    def __init__(self, hosts: list[dict], run_dir: Path, pause: float, shard: str = "none", rdzv_timeout: int = 120):
        self.hosts, self.run_dir, self.pause, self.shard = hosts, run_dir, pause, shard
        self.rdzv_timeout = rdzv_timeout
        self.port = free_port()
        self.launch = 0
        self.launchers: list[subprocess.Popen | None] = [None] * HOSTS
        self.starts = Counter()
        self.killed_at_end = 0
        self.temp = run_dir / "tmp"
        self.temp.mkdir()

    def start(self, i: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), TMPDIR=str(self.temp),
                   CHAOS_LAUNCH=str(self.launch))
        log = (self.run_dir / f"launcher-{i}.log").open("a")
        log.write(f"\n== start {self.starts[i]} (launch {self.launch}) at {time.time():.3f}\n")
        log.flush()
        self.launchers[i] = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[i]["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes",
             f"2:{HOSTS}", "--nproc-per-node", str(PER_HOST), "--min-world-size", "2", "--max-restarts", "100",
             "--master-addr",
             self.hosts[0]["addr"], "--master-port", str(self.port), "--rdzv-timeout", str(self.rdzv_timeout), JOB,
             str(self.run_dir), "--host", str(i), "--pause", str(self.pause), "--shard", self.shard],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.starts[i] += 1

    def running(self, i: int) -> bool:
        launcher = self.launchers[i]
        return launcher is not None and launcher.poll() is None

    def kill(self, i: int) -> None:
        if self.launchers[i] is not None and self.launchers[i].poll() is None:
            kill_node(self.launchers[i])

    def link(self, i: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.hosts[i]["ns"], "link", "set", "dev", self.hosts[i]["dev"], state],
                       check=True, timeout=30)

    def workers(self, host: int | None = None) -> list[int]:
        """Worker pids alive now (on `host`)."""
        found = []
        for note in (self.run_dir / "workers").glob("*"):
            pid = int(note.name)
            if (host is None or note.read_text() == str(host)) and _alive(pid):
                found.append(pid)
        return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def chaos(cluster: Cluster, minutes: float, rng: random.Random, rss: dict, every: tuple[float, float],
          kinds: tuple[str, ...]) -> Counter:
    events = Counter()
    end = time.monotonic() + minutes * 60
    next_event = time.monotonic() + rng.uniform(*every)
    down_until: dict[int, float] = {}
    while time.monotonic() < end:
        time.sleep(1.0)
        now = time.monotonic()
        for pid in cluster.workers():
            value = _rss_mb(pid)
            if value is not None:
                rss.setdefault(pid, []).append((now, value))
        for i in range(HOSTS):  # a host whose launcher ended (cut off, failed) comes back once allowed
            if not cluster.running(i) and now >= down_until.get(i, 0):
                if i in down_until:
                    cluster.link(i, "up")
                    del down_until[i]
                _say(f"host {i}: starting its launcher again")
                cluster.start(i)
                events["restarted"] += 1
        if now < next_event:
            continue
        next_event = now + rng.uniform(*every)
        kind = rng.choice(kinds)
        if kind == "kill-rank":
            pids = cluster.workers()
            if pids:
                pid = rng.choice(pids)
                _say(f"kill-rank: SIGKILL worker {pid} (host {(cluster.run_dir / 'workers' / str(pid)).read_text()})")
                os.kill(pid, signal.SIGKILL)
        elif kind == "kill-host":
            i = rng.choice((1, 2))
            _say(f"kill-host: SIGKILL host {i}'s launcher and workers")
            cluster.kill(i)
            down_until[i] = now + rng.uniform(5, 15)
        elif kind == "cut-host":
            i = rng.choice((1, 2))
            _say(f"cut-host: host {i}'s link down")
            cluster.link(i, "down")
            down_until[i] = now + rng.uniform(5, 10)
            time.sleep(down_until[i] - now)
            cluster.link(i, "up")
            del down_until[i]
            _say(f"cut-host: host {i}'s link up")
        else:
            _say("stop: SIGTERM every launcher")
            for i in range(HOSTS):
                if cluster.running(i):
                    cluster.launchers[i].send_signal(signal.SIGTERM)
            for i in range(HOSTS):
                if cluster.launchers[i] is not None:
                    try:
                        cluster.launchers[i].wait(timeout=180)
                    except subprocess.TimeoutExpired:
                        _say(f"stop: host {i}'s launcher did not end within 180 s: killed")
                        cluster.kill(i)
            cluster.launch += 1
            for i in range(HOSTS):
                cluster.start(i)
        events[kind] += 1
    return events


def finish(cluster: Cluster) -> int:
    """Tell the run to end two epochs from now; wait for every launcher. Returns the epochs it ran."""
    epochs = 0
    for log in cluster.run_dir.glob("ids-*.jsonl"):
        for line in log.read_text().splitlines():
            try:
                epochs = max(epochs, json.loads(line)[0])
            except (ValueError, IndexError):
                pass
    last = epochs + 3
    (cluster.run_dir / "last-epoch").write_text(str(last))
    _say(f"the chaos is over: the run ends after epoch {last - 1}")
    for i in range(HOSTS):
        if not cluster.running(i):
            cluster.start(i)
    for launcher in cluster.launchers:
        launcher.wait(timeout=600)
    # A host started again just before the end may find the run over before it could join: it gives up after
    # --rdzv-timeout (exit 1), which is not the run's failure.
    _say(f"the launchers' exit codes: {[launcher.returncode for launcher in cluster.launchers]}")
    return last


def check_steps(run_dir: Path, epochs: int) -> list[str]:
    applied: dict = {}
    for log in run_dir.glob("ids-*.jsonl"):
        for line in log.read_text().splitlines():
            try:
                epoch, step, ids, _, incarnation, _ = json.loads(line)
            except ValueError:
                continue  # a line cut by a SIGKILL
            applied.setdefault((epoch, step), []).append((tuple(incarnation), ids))
    _, expected = reference_run(epochs=epochs)
    problems, short = [], 0
    for key, ids in expected.items():
        lines = applied.get(key)
        if not lines:
            problems.append(f"step {key} was never applied")
            continue
        last = max(incarnation for incarnation, _ in lines)
        got = sorted(i for incarnation, part in lines if incarnation == last for i in part)
        if got == ids:
            continue
        if len(set(got)) == len(got) and set(got) < set(ids):
            short += 1  # a rank killed between applying the step and logging it
        else:
            problems.append(f"step {key}: averaged {got}, expected {ids}")
    extra = sorted(set(applied) - set(expected))
    if extra:
        problems.append(f"steps applied beyond the run's: {extra[:5]}")
    print(f"steps: {len(expected)} over {epochs} epochs; {short} lack a killed rank's log line; "
          f"{len(problems)} wrong")
    return problems


def check_params(run_dir: Path, epochs: int, shard: str) -> list[str]:
    final = torch.load(run_dir / "final.pt", weights_only=True)
    expected, _ = reference_run(epochs=epochs, hidden=hidden_width(shard))
    worst = max((ours - theirs).abs().max().item() for ours, theirs in zip(final["params"], expected))
    print(f"final parameters: max |difference| to one process on whole global batches: {worst:.3g}")
    return [] if worst < 1e-4 else [f"final parameters off by {worst:.3g}"]


def check_rss(rss: dict, run_dir: Path) -> list[str]:
    """Each worker that lived LONG_LIVED seconds: its RSS from SETTLED seconds in to its last sample, and the
    regroups it went through (a leak in the regroup would grow with them)."""
    growths = []
    for pid, samples in rss.items():
        if samples[-1][0] - samples[0][0] < LONG_LIVED:
            continue
        settled = next(value for when, value in samples if when - samples[0][0] >= SETTLED)
        growths.append((samples[-1][1] - settled, pid, samples[-1][0] - samples[0][0], _regroups(run_dir, pid)))
    if not growths:
        print(f"RSS: no worker lived {LONG_LIVED} s")
        return []
    growth, pid, lived, regroups = max(growths)
    print(f"RSS: {len(growths)} workers lived over {LONG_LIVED} s, through up to "
          f"{max(g[3] for g in growths)} regroups; the most grown: {growth:+.1f} MB from its {SETTLED}th second "
          f"(pid {pid}, {lived / 60:.1f} min, {regroups} regroups)")
    return [] if growth < 50 else [f"worker {pid} grew {growth:.0f} MB"]


def _regroups(run_dir: Path, pid: int) -> int:
    """How many times worker `pid` regrouped in-process: the generation of its last logged step."""
    path = run_dir / f"ids-{pid}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in reversed(lines):
        try:
            return json.loads(line)[5]
        except (ValueError, IndexError):
            continue
    return 0


def check_leftovers(run_dir: Path, segments_before: set[str], prefix: str, killed: int) -> list[str]:
    """`killed`: launchers SIGKILLed (each may leave its two temporary folders: it cannot remove them)."""
    problems = []
    mine = [entry for entry in os.listdir("/proc") if entry.isdigit() and _cmdline_has(entry, str(run_dir))]
    if mine:
        problems.append(f"processes of the run left: {mine}")
    segments = {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)} - segments_before
    if segments:
        problems.append(f"shared-memory segments left: {sorted(segments)}")
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    if prefix in namespaces or prefix in links:
        problems.append("namespaces or links left")
    # a failure's report (phalanx-report-*) is kept for the user on purpose: the launcher prints its path
    temp = [str(path) for path in (run_dir / "tmp").iterdir()
            if "torchinductor" not in path.name and not path.name.startswith("phalanx-report-")]
    if len(temp) > 2 * killed:  # each launcher makes two: its run folder and its workers' rings
        problems.append(f"temporary folders left by launchers that were not killed: {temp[:5]}")
    print(f"left behind: {len(mine)} processes, {len(segments)} segments, namespaces and links "
          f"{'left' if prefix in namespaces or prefix in links else 'none'}, {len(temp)} temporary folders "
          f"({killed} launchers were SIGKILLed)")
    return problems


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return text.encode() in handle.read()
    except OSError:
        return False


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.1, help="seconds of sleep per step (default 0.1)")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, step logs)")
    parser.add_argument("--shard", choices=("none", "optimizer", "gradients"), default="none",
                        help="the model's shard level (default none)")
    parser.add_argument("--every", default="15:40", metavar="MIN:MAX",
                        help="seconds between events, drawn (default 15:40)")
    parser.add_argument("--only", default=None, metavar="KINDS",
                        help="comma-separated events to draw from (default: all, rank kills weighted 3)")
    parser.add_argument("--rdzv-timeout", type=int, default=120, help="each launcher's --rdzv-timeout: how long a "
                        "host started again near the end waits for a run that is over (default 120)")
    add_json_flag(parser)
    args = parser.parse_args()
    every = tuple(float(part) for part in args.every.split(":"))
    kinds = tuple(args.only.split(",")) if args.only else EVENTS
    unknown = set(kinds) - set(EVENTS)
    if unknown:
        parser.error(f"--only: unknown events {sorted(unknown)}; choose from {sorted(set(EVENTS))}")
    rng, rss = random.Random(args.seed), {}
    run_dir = Path(tempfile.mkdtemp(prefix="phalanx-chaos-"))
    segments_before = {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    started = time.monotonic()
    problems: list[str] = []
    with bridged_hosts("phc", 218, HOSTS) as hosts:
        cluster = Cluster(hosts, run_dir, args.pause, args.shard, args.rdzv_timeout)
        try:
            for i in range(HOSTS):
                cluster.start(i)
            events = chaos(cluster, args.minutes, rng, rss, every, kinds)
            epochs = finish(cluster)
        finally:
            for i in range(HOSTS):
                if cluster.running(i):
                    cluster.killed_at_end += 1
                    cluster.kill(i)
    time.sleep(2)
    print(f"chaos: {args.minutes:g} min, {dict(events)}; launcher starts per host {dict(cluster.starts)}; "
          f"{(time.monotonic() - started) / 60:.1f} min in all")
    outcomes = Counter()
    for i in range(HOSTS):
        text = (run_dir / f"launcher-{i}.log").read_text()
        outcomes["kept in-process"] += text.count("go on in-process")
        outcomes["restarts from a checkpoint"] += text.count("regroup without it") + text.count("restarting the")
        outcomes["joins in-process"] += text.count("take them in at a step boundary, in-process")
        outcomes["joins by a save and restart"] += text.count("waiting to join") - text.count(
            "take them in at a step boundary, in-process")
    print(f"what the launchers said: {dict(outcomes)}")
    problems += check_steps(run_dir, epochs)
    problems += check_params(run_dir, epochs, args.shard)
    problems += check_rss(rss, run_dir)
    problems += check_leftovers(run_dir, segments_before, "phc", events["kill-host"] + cluster.killed_at_end)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("chaos run: " + ("passed" if not problems else f"{len(problems)} problem(s)") + f"; files in {run_dir}")
    write_figures(args.json_path, {"events": sum(events.values()), **{k: v for k, v in outcomes.items() if v},
                                   "problems": len(problems)}, events=dict(events), problems=problems)
    if not args.keep and not problems:
        shutil.rmtree(run_dir, ignore_errors=True)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()

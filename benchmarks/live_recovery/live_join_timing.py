"""How long a host that comes back takes to train again, taken in by the workers in progress (live join).

    sudo PYTHONPATH=. python benchmarks/live_recovery/live_join_timing.py [--rounds 3] [--rate 200mbit] [--state-mb 20]

Three hosts (network namespaces on a bridge, every port shaped to `--rate` both ways: benchmarks/hosts/xhost_net.py),
`phalanx run --nnodes 2:3`, one worker each, the loop with `checkpointer.restore(state)` first (tests/e2e/jobs/
join_job.py: its model, SGD's momentum, and a frozen parameter of `--state-mb` MB, so that the state has a size while
the training stays the tests' small regression). Each round
SIGKILLs host 2 whole after its first step, starts the same command there again `--gap` seconds later (5: a host
that comes back after the others' launchers counted it lost, 4 s of heartbeats; one started again sooner waits for
that, as torch's rendezvous keeps the dead node's place until then), and reads: the
seconds from that start to the end of the returned host's first step; the parts (its launcher and worker starting
up, until its restore() began; waiting there until the two ranks that train took it in and handed it the state;
its first step); the state's bytes and the link's measured rate; the issue's bar, 2 s + 1.5 x state bytes / link
bandwidth; whether anything was read from disk; and that the final parameters equal the run that never changed its
world (one process on whole global batches). Prints each round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.hosts.xhost_net import Hosts
from phalanx.testing import free_port
from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.e2e.test_elastic import job_env, kill_node
from tests.helpers.global_batch_cases import reference_run

JOB = str(Path(__file__).resolve().parents[2] / "tests" / "e2e" / "jobs" / "join_job.py")
EPOCHS = 60  # 240 steps of 0.1 s and more: the run goes on well past the returned host's start


def _launcher(hosts: Hosts, i: int, port: int, run_dir: Path, state_mb: float) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", hosts.names[i], sys.executable, "-m", "phalanx", "run", "--nnodes", "2:3",
         "--nproc-per-node", "1", "--master-addr", hosts.addrs[0], "--master-port", str(port), "--rdzv-timeout", "60",
         JOB, str(run_dir), "--pause", "0.1", "--epochs", str(EPOCHS), "--ballast-mb", str(state_mb), "--host", str(i)],
        env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(run_dir: Path, rank: int) -> list:
    path = run_dir / f"ids-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_round(hosts: Hosts, state_mb: float, mbit: float, expected, gap: float) -> dict:
    """One round's figures (_timed_round), its files removed once read; kept, and named, when it fails."""
    run_dir = Path(tempfile.mkdtemp(prefix="phalanx-join-"))
    try:
        figures = _timed_round(run_dir, hosts, state_mb, mbit, expected, gap)
    except BaseException:
        print(f"the round's files are kept in {run_dir}", file=sys.stderr)
        raise
    shutil.rmtree(run_dir, ignore_errors=True)
    return figures


def _timed_round(run_dir: Path, hosts: Hosts, state_mb: float, mbit: float, expected, gap: float) -> dict:
    port = free_port()
    launchers = [_launcher(hosts, i, port, run_dir, state_mb) for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not _steps(run_dir, 2):
            if time.monotonic() > deadline or any(p.poll() is not None for p in launchers):
                raise RuntimeError("host 2 made no step: " + "".join(p.communicate()[0] for p in launchers))
            time.sleep(0.05)
        kill_node(launchers[2])
        launchers[2].communicate()
        time.sleep(gap)
        started = time.time()
        launchers.append(_launcher(hosts, 2, port, run_dir, state_mb))
        lines: list = []  # (time, line) of the returned host's launcher: when its round was met
        reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in launchers[3].stdout))
        reader.start()
        outputs = [p.communicate(timeout=600)[0] for p in launchers[:2]]
        launchers[3].wait(timeout=600)
        reader.join(timeout=60)
        outputs.append("".join(line for _, line in lines))
    finally:
        for process in launchers:
            if process.poll() is None:
                kill_node(process)
    if any(p.returncode for p in launchers[:2] + launchers[3:]):
        raise RuntimeError("a launcher failed:\n" + "\n".join(outputs))
    result = torch.load(run_dir / "result-3.pt", weights_only=True)
    began, ended = result["restore"]
    first = min(step[3] for step in _steps(run_dir, 3))
    state = result["state_bytes"]
    results = [torch.load(run_dir / f"result-{rank}.pt", weights_only=True) for rank in (0, 1, 3)]
    same = all(all((ours - theirs).abs().max() < 1e-5 for ours, theirs in zip(r["params"], expected))
               for r in results) and len({r["ballast_sum"] for r in results}) == 1
    read = [path for rank in (0, 1, 3) for path in torch.load(run_dir / f"result-{rank}.pt",
                                                             weights_only=True)["files_read"]]
    met = next((when for when, line in lines if "joining the workers in progress" in line), began)
    if os.environ.get("JOIN_TIMING_TRACE"):
        for when, line in lines[:6]:
            print(f"  +{when - started:.2f} s {line.strip()[:110]}")
        print("\n".join(line for line in outputs[0].splitlines() if "join" in line))  # what host 0's launcher said
    return {"to_first_step": first - started, "round_met": met - started, "worker_up": began - met,
            "start_up": began - started, "taken_in": ended - began,
            "first_step": first - ended, "state_mb": state / 1e6, "bar": 2.0 + 1.5 * state * 8 / (mbit * 1e6),
            "same": same, "disk_reads": len(read)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default="200mbit", help="tc tbf rate of every host's link, both ways")
    parser.add_argument("--gap", type=float, default=5.0,
                        help="seconds between the kill and the start again (past 4 s, the host's heartbeats expired)")
    parser.add_argument("--state-mb", type=float, default=20.0, help="MB of frozen parameters besides the model")
    add_json_flag(parser)
    args = parser.parse_args()
    expected, _ = reference_run(epochs=EPOCHS)
    rounds = []
    with Hosts(3, args.rate) as hosts:
        mbit, rtt = hosts.measure(0, 2)
        print(f"link host 0 -> host 2: {mbit:.0f} Mbit/s, {rtt:.2f} ms round trip (tc tbf {args.rate})", flush=True)
        for number in range(args.rounds):
            r = one_round(hosts, args.state_mb, mbit, expected, args.gap)
            rounds.append(r)
            print(f"round {number + 1}: host 2 started again -> its first step {r['to_first_step']:.2f} s (bar "
                  f"{r['bar']:.2f} s: 2 s + 1.5 x {r['state_mb']:.1f} MB / link); start-up to restore() "
                  f"{r['start_up']:.2f} s (the launcher met the others' round {r['round_met']:.2f} s, its worker then "
                  f"reached restore() {r['worker_up']:.2f} s), taken in and handed the state {r['taken_in']:.2f} s, "
                  f"first step "
                  f"{r['first_step']:.2f} s; disk reads {r['disk_reads']}; same as uninterrupted: {r['same']}",
                  flush=True)
    for key in ("to_first_step", "start_up", "round_met", "worker_up", "taken_in", "first_step", "bar"):
        print(f"median {key}: {statistics.median(r[key] for r in rounds):.2f} s")
    median = {key: round(statistics.median(r[key] for r in rounds), 2) for key in ("to_first_step", "bar", "taken_in")}
    write_figures(args.json_path, {"start -> first step s": median["to_first_step"], "bar s": median["bar"],
                                   "taken in s": median["taken_in"], "disk reads": sum(r["disk_reads"] for r in rounds),
                                   "same as uninterrupted": all(r["same"] for r in rounds)}, rounds=rounds)
    if not all(r["same"] for r in rounds) or any(r["disk_reads"] for r in rounds):
        sys.exit("a round differed from the uninterrupted run, or read from disk")


if __name__ == "__main__":
    main()

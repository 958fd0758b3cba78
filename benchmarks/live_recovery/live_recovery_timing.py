"""How long a loss costs under live recovery: from the kill to the next step every rank left applied.

    sudo PYTHONPATH=. python benchmarks/live_recovery/live_recovery_timing.py [--rounds 10] [--where rank|host|cut]
        [--pause 0.1] [--shard optimizer|gradients]

`--where rank` (one host): `phalanx run --nproc-per-node 3 --min-world-size 2` on tests/e2e/jobs/live_recovery_job.py;
rank 2 kills itself (SIGKILL) in a step drawn at random, at a moment drawn at random (before its forward, in the
middle of its gradient exchange, or after it and before its optimizer step), and notes the time. `--where host`:
three hosts (network namespaces on a bridge, root needed), `--nnodes 2:3 --min-world-size 2`, 1 worker each; host 2's
launcher and worker are SIGKILLed together after a number of its steps drawn at random. `--where cut`: the same, but
host 2's link is set down instead (its processes run on, unreachable; the round tears them down after). Each round
then reads the survivors' step logs: the seconds from the kill to the first step that both applied after it (a step
takes `--pause` seconds of sleep plus its compute, so that is in the figure too). Prints each round, the median, the
p95 and the worst, and checks each round's final parameters against the uninterrupted run's. `--shard`: the model
sharded at that level (a hidden width of 64, so that every rank owns parameter elements; the lost rank's optimizer
shard comes back from its keeper's copy).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from phalanx.testing import free_port
from phalanx.tools.bench_compare import add_json_flag, write_figures
from tests.e2e.test_elastic import job_env, kill_node
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.live_recovery_cases import MOMENTS, next_step_after
from tests.helpers.namespaces import bridged_hosts

JOB = str(Path(__file__).resolve().parents[2] / "tests" / "e2e" / "jobs" / "live_recovery_job.py")
STEPS_PER_EPOCH = 4  # the job: 80 samples, a global batch of 26


def _job_model(shard: str) -> list[str]:
    return ["--shard", shard, "--hidden", str(_hidden(shard))]


def _hidden(shard: str) -> int:
    return 8 if shard == "none" else 64


def _same_as_uninterrupted(run_dir: Path, survivors, shard: str) -> bool:
    expected, _ = reference_run(hidden=_hidden(shard))
    for rank in survivors:
        params = torch.load(run_dir / f"result-{rank}.pt", weights_only=True)["params"]
        if any((ours - theirs).abs().max() >= 1e-5 for ours, theirs in zip(params, expected)):
            return False
    return True


def rank_round(run_dir: Path, pause: float, rng: random.Random, shard: str) -> tuple[float | None, bool, str]:
    step, moment = rng.randrange(1, 2 * STEPS_PER_EPOCH - 1), rng.choice(MOMENTS)
    at = f"{step // STEPS_PER_EPOCH}:{step % STEPS_PER_EPOCH}"
    subprocess.run([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "3", "--min-world-size", "2", JOB,
                    str(run_dir), "--doomed", "2", "--at", at, "--moment", moment, "--pause", str(pause),
                    *_job_model(shard)],
                   env=job_env(), check=True, capture_output=True, timeout=300)
    died = float((run_dir / "died-at").read_text())
    return (next_step_after(str(run_dir), (0, 1), died), _same_as_uninterrupted(run_dir, (0, 1), shard),
            f"{at} {moment}")


def host_round(run_dir: Path, pause: float, rng: random.Random, shard: str,
               cut: bool = False) -> tuple[float | None, bool, str]:
    after = rng.randrange(1, 2 * STEPS_PER_EPOCH - 1)  # host 2's applied steps before the kill
    with bridged_hosts("phb", 216, 3) as hosts:
        port = free_port()
        launchers = [subprocess.Popen(
            ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes", "2:3",
             "--nproc-per-node", "1", "--min-world-size", "2", "--master-addr", hosts[0]["addr"], "--master-port",
             str(port), "--rdzv-timeout", "60", JOB, str(run_dir), "--doomed", "-1", "--pause", str(pause),
             "--host", str(i), *_job_model(shard)], env=job_env(), stdout=(run_dir / f"launcher-{i}.log").open("w"),
            stderr=subprocess.STDOUT) for i, host in enumerate(hosts)]
        try:
            lost = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ranks = [r for r in range(3) if (run_dir / f"host-{r}").exists()
                         and (run_dir / f"host-{r}").read_text() == "2"]
                log = run_dir / f"ids-{ranks[0]}.jsonl" if ranks else None
                if log is not None and log.exists() and log.read_text().count("\n") >= after:
                    lost = ranks[0]
                    break
                time.sleep(0.005)
            killed = time.time()
            if cut:  # its link down: no connection is reset, its processes run on, unreachable
                subprocess.run(["ip", "-n", hosts[2]["ns"], "link", "set", "dev", hosts[2]["dev"], "down"], check=True)
            else:
                kill_node(launchers[2])
            for launcher in launchers[:2]:
                launcher.wait(timeout=300)
        finally:
            for launcher in launchers:
                if launcher.poll() is None:
                    kill_node(launcher)
    survivors = [r for r in range(3) if r != lost]
    return (next_step_after(str(run_dir), survivors, killed), _same_as_uninterrupted(run_dir, survivors, shard),
            f"after {after} steps")


def main() -> None:
    # A SIGTERM (a stopped benchmark) unwinds like Ctrl-C, so that the hosts' namespaces and bridge come down.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--where", choices=("rank", "host", "cut"), default="rank",
                        help="kill a rank, kill a host whole, or cut a host's link (default rank)")
    parser.add_argument("--pause", type=float, default=0.1, help="seconds of sleep per step (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", choices=("none", "optimizer", "gradients"), default="none",
                        help="the model's shard level (default none)")
    parser.add_argument("--keep-slow", type=float, default=None, metavar="S",
                        help="keep the files (logs, step logs) of a round whose next step took more than S seconds")
    add_json_flag(parser)
    args = parser.parse_args()
    rng, seconds, all_same = random.Random(args.seed), [], True
    for round_number in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            play = {"rank": rank_round, "host": host_round, "cut": lambda *a: host_round(*a, cut=True)}[args.where]
            took, same, what = play(Path(directory), args.pause, rng, args.shard)
            if args.keep_slow is not None and (took is None or took > args.keep_slow):
                kept = Path(tempfile.mkdtemp(prefix="live-recovery-slow-"))
                subprocess.run(["cp", "-r", f"{directory}/.", str(kept)], check=False)
                what += f" (its files: {kept})"
        print(f"round {round_number + 1}: {what}: next step {took if took is None else f'{took:.2f} s'} after the "
              f"kill; final parameters {'equal' if same else 'DIFFERENT from'} the uninterrupted run's", flush=True)
        all_same = all_same and same
        if took is not None:
            seconds.append(took)
    if seconds:
        ordered = sorted(seconds)
        p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
        print(f"{args.where}: {len(seconds)} rounds, kill -> next step: median {statistics.median(seconds):.2f} s, "
              f"p95 {p95:.2f} s, worst {ordered[-1]:.2f} s (a step: {args.pause} s of sleep + compute)")
        write_figures(args.json_path, {"median s": round(statistics.median(seconds), 2), "p95 s": round(p95, 2),
                                       "worst s": round(ordered[-1], 2), "rounds": len(seconds),
                                       "parameters as uninterrupted": all_same}, seconds=seconds)
    if len(seconds) < args.rounds or not all_same:
        sys.exit(f"{args.rounds - len(seconds)} round(s) without a next step; parameters as uninterrupted: {all_same}")


if __name__ == "__main__":
    main()

"""DiLoCo's quality: examples/gpt trained on the same samples with exact phalanx DDP and with DiLoCo, over seeds.

    PYTHONPATH=. python benchmarks/hosts/diloco_quality.py --hosts 2 --seeds 0,1,2 --steps 400 --every 50 \\
        [--compress int8] [--figure docs/img/diloco-quality.png] [--json out.json]

Each run is `phalanx run --nnodes N --node-rank i` started N times on this machine (127.0.0.1), one rank per
emulated host: the node rank tells the hosts apart, as on real hosts, and nothing crosses a real link (quality
does not depend on the link). The ranks run benchmarks/hosts/diloco_quality_worker.py. Prints each seed's final
validation loss for both modes, the means, DiLoCo's mean against exact DDP's (the bar: within 1.0 %) and the
seeds' spread, and draws validation loss against samples for both (the mean over seeds, the band min to max).

With `--kill-host K --kill-at-step S` it measures live recovery instead: per seed, DiLoCo uninterrupted and DiLoCo
with host K's launcher and worker SIGKILLed before step S (mid-period: S not a multiple of H), both under live
recovery (`--min-world-size`, default the ranks of all hosts but one) and the same loop; the bar is the killed run's
final validation loss within 1.5 % of the uninterrupted one's.

    PYTHONPATH=. python benchmarks/hosts/diloco_quality.py --hosts 3 --seeds 0 --steps 400 --every 50 \
        --kill-host 1 --kill-at-step 175
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from xhost_bench import run_launchers  # noqa: E402 - a sibling script, run from this folder

from phalanx.diagnose.stacks import descendants  # noqa: E402
from phalanx.tools.bench_compare import write_figures  # noqa: E402

WORKER = ROOT / "benchmarks" / "hosts" / "diloco_quality_worker.py"


def run(hosts: int, worker_args: list[str], timeout: float, min_world: int | None = None,
        kill: tuple[int, str] | None = None) -> None:
    """One job of `hosts` launchers on this machine, one rank each; `min_world`: live recovery on at that many
    ranks; `kill` (host, file): SIGKILL that host's launcher and worker once the worker wrote the file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = str(29000 + secrets.randbelow(500))
    live = ["--min-world-size", str(min_world)] if min_world else []
    commands = [[sys.executable, "-m", "phalanx", "run", "--nnodes", str(hosts), "--node-rank", str(i), *live,
                 "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                 "--rdzv-timeout", "120", str(WORKER), *worker_args] for i in range(hosts)]
    if kill is None:
        run_launchers(commands, env, timeout)
        return
    host, signal_file = kill
    launchers = [subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for command in commands]
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(signal_file):
            if time.monotonic() > deadline or any(launcher.poll() is not None for launcher in launchers):
                raise SystemExit(f"host {host} never reached the step to kill it at")
            time.sleep(0.05)
        for pid in descendants(launchers[host].pid):  # the host whole: its launcher, its worker, what they started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        outputs = [launcher.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    print(f"  host {host} SIGKILLed at step {Path(signal_file).read_text()}; host 0's launcher said:\n    " +
          "\n    ".join(line for line in outputs[0].splitlines() if "lost" in line or "node" in line), flush=True)
    failed = [i for i, launcher in enumerate(launchers) if launcher.returncode and i != host]
    if failed:
        raise SystemExit(f"host {failed[0]} failed:\n{outputs[failed[0]][-4000:]}")


def training(args, seed: str) -> list[str]:
    """The worker's arguments that both modes and every variant share."""
    return ["--seed", seed, "--steps", str(args.steps), "--every", str(args.every), "--compress", args.compress,
            "--val-every", str(args.val_every), "--outer-lr", str(args.outer_lr), "--momentum", str(args.momentum),
            "--lr", str(args.lr)]


def runs_over_seeds(args, variants: tuple[str, ...], start) -> dict[str, list[dict]]:
    """Every seed's run of every variant in turn, each a job `start(variant, seed, out)` whose rank 0 writes `out`;
    the runs' JSON by variant."""
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds.split(","):
            for variant in variants:
                out = os.path.join(scratch, f"{variant}-{seed}.json")
                start(variant, seed, out)
                runs[variant].append(json.loads(Path(out).read_text()))
                print(f"seed {seed} {variant}: validation loss {runs[variant][-1]['curve'][-1]['val_loss']:.4f}, "
                      f"world {runs[variant][-1]['world']} at the end ({time.monotonic() - started:.0f} s)", flush=True)
    return runs


def draw(runs: dict, path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for mode, color in (("exact", "tab:blue"), ("diloco", "tab:orange")):
        curves = [r["curve"] for r in runs[mode]]
        samples = [point["samples"] for point in curves[0]]
        columns = list(zip(*([point["val_loss"] for point in c] for c in curves)))
        ax.plot(samples, [statistics.mean(c) for c in columns], color=color,
                label="exact DDP" if mode == "exact" else label)
        ax.fill_between(samples, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2)
    ax.set_xlabel("samples (sequences of 64 characters)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title(f"examples/gpt, {len(runs['exact'])} seeds each (band: min to max)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50, help="DiLoCo's H")
    parser.add_argument("--compress", default="int8", help="int8, fp16 or none")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer_lr")
    parser.add_argument("--momentum", type=float, default=0.9, help="DiLoCo's outer momentum (Nesterov)")
    parser.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's peak lr, both modes alike")
    parser.add_argument("--val-every", type=int, default=50, help="a multiple of --every, or a divisor of it")
    parser.add_argument("--figure", default=None, help="write the curve here (PNG)")
    parser.add_argument("--json", default=None, help="write the figures and every curve here")
    parser.add_argument("--timeout", type=float, default=900, help="per run")
    parser.add_argument("--kill-host", type=int, default=None, help="live recovery: SIGKILL this host (node rank)")
    parser.add_argument("--kill-at-step", type=int, default=None, help="... before this step (not a multiple of H)")
    parser.add_argument("--min-world-size", type=int, default=None, help="live recovery's (default: hosts - 1)")
    args = parser.parse_args()
    if args.kill_host is not None:
        live_recovery(args)
        return
    runs = runs_over_seeds(args, ("exact", "diloco"), lambda mode, seed, out: run(
        args.hosts, ["--mode", mode, *training(args, seed), "--out", out], args.timeout))
    final = {mode: [r["curve"][-1]["val_loss"] for r in rs] for mode, rs in runs.items()}
    mean = {mode: statistics.mean(v) for mode, v in final.items()}
    spread = {mode: (max(v) - min(v)) for mode, v in final.items()}
    stdev = {mode: statistics.stdev(v) if len(v) > 1 else 0.0 for mode, v in final.items()}
    relative = mean["diloco"] / mean["exact"] - 1
    samples = runs["exact"][0]["curve"][-1]["samples"]
    print(f"\nexamples/gpt, {args.hosts} hosts x 1 rank, {args.steps} steps ({samples} samples), DiLoCo H={args.every} "
          f"compress={args.compress}, inner lr {args.lr}, outer lr {args.outer_lr} momentum {args.momentum}")
    print(f"  {'mode':8} {'seeds':>26} {'mean':>8} {'stdev':>7} {'max-min':>8}")
    for mode in runs:
        print(f"  {mode:8} {' '.join(f'{v:.4f}' for v in final[mode]):>26} {mean[mode]:8.4f} {stdev[mode]:7.4f} "
              f"{spread[mode]:8.4f}")
    print(f"  DiLoCo against exact: {relative * 100:+.2f} % (bar: within 1.0 %) -> "
          f"{'met' if abs(relative) <= 0.01 else 'missed'}")
    if args.figure:
        draw(runs, args.figure, f"DiLoCo H={args.every}, {args.compress}")
        print(f"  curve: {args.figure}")
    write_figures(args.json, {"diloco/exact val loss - 1 %": round(relative * 100, 2),
                              "exact val loss mean": round(mean["exact"], 4),
                              "diloco val loss mean": round(mean["diloco"], 4),
                              "exact seeds max-min": round(spread["exact"], 4),
                              "diloco seeds max-min": round(spread["diloco"], 4)},
                  args=vars(args), final=final, runs=runs)


def live_recovery(args) -> None:
    """Per seed: DiLoCo uninterrupted and with a host SIGKILLed in mid-period, both under live recovery."""
    if args.kill_at_step is None or args.kill_at_step % args.every == 0:
        raise SystemExit(f"--kill-at-step must be in mid-period: not a multiple of --every {args.every}")
    min_world = args.min_world_size or args.hosts - 1
    kill = ["--kill-host", str(args.kill_host), "--kill-at-step", str(args.kill_at_step)]
    runs = runs_over_seeds(args, ("uninterrupted", "killed"), lambda variant, seed, out: run(
        args.hosts, ["--mode", "diloco", *training(args, seed), "--out", out, *(kill if variant == "killed" else [])],
        args.timeout, min_world, (args.kill_host, out + ".kill") if variant == "killed" else None))
    final = {variant: [r["curve"][-1]["val_loss"] for r in rs] for variant, rs in runs.items()}
    relative = [k / u - 1 for k, u in zip(final["killed"], final["uninterrupted"])]
    worst = max(relative, key=abs)
    print(f"\nexamples/gpt, {args.hosts} hosts x 1 rank, {args.steps} steps, DiLoCo H={args.every} compress="
          f"{args.compress}, live recovery (--min-world-size {min_world}); host {args.kill_host} SIGKILLed before "
          f"step {args.kill_at_step}")
    for seed, u, k, r in zip(args.seeds.split(","), final["uninterrupted"], final["killed"], relative):
        print(f"  seed {seed}: uninterrupted {u:.4f}, killed {k:.4f}: {r * 100:+.2f} %")
    print(f"  killed against uninterrupted, worst seed: {worst * 100:+.2f} % (bar: within 1.5 %) -> "
          f"{'met' if abs(worst) <= 0.015 else 'missed'}")
    write_figures(args.json, {"killed/uninterrupted val loss - 1 %, worst seed": round(worst * 100, 2)},
                  args=vars(args), final=final, runs=runs)


if __name__ == "__main__":
    main()

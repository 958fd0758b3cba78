"""How long a stop takes: from SIGTERM to `phalanx run` until it has exited, on a 50M-parameter model.

    PYTHONPATH=. python benchmarks/checkpoints/stop_latency.py [none optimizer gradients parameters] [--repeats N]

For each shard level: `phalanx run --nproc-per-node 2` trains 12 x Linear(2048, 2048) (50.3M parameters,
AdamW: a 600 MB checkpoint) on the CPU, one thread per rank, calling `checkpointer.step(state)` after
each step (no periodic saves). Once a few steps are done, SIGTERM goes to the launcher, as a scheduler
sends it. Prints, per level: the step time, the steps the ranks trained after the request before the
agreed step, the save, the launcher's own request-to-exit time and what this script measured around it.
The same file is the job (`--worker`), so the figures need nothing else.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from phalanx.tools.bench_compare import add_json_flag, write_figures

LEVELS = ("none", "optimizer", "gradients", "parameters")


def worker(shard: str, directory: str) -> None:
    import torch

    import phalanx as px

    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])
    model = px.DistributedDataParallel(net, shard=shard)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    checkpointer = px.Checkpointer(directory, keep=1)
    started = time.monotonic()
    while True:
        x = torch.randn(8, 2048)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        now = time.monotonic()
        px.print0(f"step {state['step']} {now - started:.4f}")
        started = now
        checkpointer.step(state)


def one_stop(shard: str, after_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        launcher = subprocess.Popen(
            [sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", __file__, "--worker", "--shard", shard,
             "--dir", os.path.join(directory, "ckpt")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        lines, step_times, asked_at_step = [], [], None
        try:
            for line in launcher.stdout:
                lines.append(line)
                found = re.search(r"\] step (\d+) ([\d.]+)", line)
                if found:
                    step_times.append(float(found.group(2)))
                    if int(found.group(1)) == after_steps:
                        asked_at_step, asked = after_steps, time.monotonic()
                        launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        ended = time.monotonic()
    output = "".join(lines)
    found = re.search(r"phalanx run: stopped at step (\d+) on request \(SIGTERM\), ([\d.]+) s after it; "
                      r"checkpoint \S+ saved in ([\d.]+) s", output)
    if launcher.returncode != 75 or not found or asked_at_step is None:
        raise SystemExit(f"{shard}: exit code {launcher.returncode}\n{output}")
    return {"step_s": statistics.median(step_times[1:]), "steps_after": int(found.group(1)) - asked_at_step,
            "save_s": float(found.group(3)), "launcher_s": float(found.group(2)), "measured_s": ended - asked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("levels", nargs="*", default=list(LEVELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--after-steps", type=int, default=4, help="steps done before the SIGTERM (default 4)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    add_json_flag(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args.shard, args.dir)
        return
    print(f"{'level':<11} {'step':>8} {'steps after':>12} {'save':>7} {'request -> exit':>16} {'measured':>9}")
    runs: dict[str, list[dict]] = {}
    for shard in args.levels:
        for _ in range(args.repeats):
            r = one_stop(shard, args.after_steps)
            runs.setdefault(shard, []).append(r)
            print(f"{shard:<11} {r['step_s']:7.2f}s {r['steps_after']:12d} {r['save_s']:6.2f}s "
                  f"{r['launcher_s']:15.2f}s {r['measured_s']:8.2f}s", flush=True)
    write_figures(args.json_path, {f"{shard} request->exit s": round(statistics.median(r["launcher_s"] for r in rs), 2)
                                   for shard, rs in runs.items()}, runs=runs)


if __name__ == "__main__":
    main()

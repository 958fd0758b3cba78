"""tests/helpers/live_recovery_cases.py's loop under `phalanx run --min-world-size`: a rank dies, the others go on.

    phalanx run --nproc-per-node 3 --min-world-size 2 tests/e2e/jobs/live_recovery_job.py RUN_DIR \\
        --doomed R --at EPOCH:STEP --moment forward|exchange|optimizer [--pause S] [--host NAME] [--shard LEVEL]
        [--hidden N]

Each rank that finishes writes RUN_DIR/result-<rank>.pt (weights_only): its process ids at the start and the end,
its generation (number, members), whether it was the main rank at the end, and its final parameters.
"""

import argparse
from pathlib import Path

import torch

import phalanx as px
from tests.helpers.live_recovery_cases import MOMENTS, train


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--doomed", type=int, required=True, help="the rank that dies")
    parser.add_argument("--at", default="0:1", help="EPOCH:STEP of the step it dies in")
    parser.add_argument("--moment", choices=MOMENTS, default="exchange")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--host", default="", help="written to RUN_DIR/host-<rank>: which host a rank ran on")
    parser.add_argument("--shard", default="none", help="the model's shard level")
    parser.add_argument("--hidden", type=int, default=8, help="the model's hidden width")
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    px.init()
    at = tuple(int(part) for part in args.at.split(":"))
    rank = px.world.launch_rank()  # the files are named by it: px.rank() is renumbered after a loss
    (args.run_dir / f"host-{rank}").write_text(args.host)
    result = train(rank, str(args.run_dir), args.doomed, at, args.moment, args.pause, args.shard,
                   hidden=args.hidden)
    number, members = result["generation"]
    torch.save({"pid": list(result["pid"]), "generation": [number, list(members)], "main": result["main"],
                "params": result["params"]}, args.run_dir / f"result-{rank}.pt")
    px.shutdown()


if __name__ == "__main__":
    main()

"""The loop of docs/data.md with `across_hosts=px.DiLoCo(every=4)` under live recovery, one rank per emulated host
(GROUP_RANK, the launcher's node rank, set by the test; or several): a host or rank that dies in mid-period, or a
host that joins.

    python tests/e2e/jobs/diloco_live_job.py RUN_DIR [--die-at STEP] [--no-checkpointer]
        [--wait-for-joiner-at STEP] [--steps N] [--outer-not-in-state] [--fragments F] [--stop-at STEP]

A global batch of 12 in micro-batches of 2 over an indexed dataset (x, y drawn from the sample's index), inner SGD
with momentum, 12 steps. `--die-at`: this rank SIGKILLs itself before its first forward of that step (0-based).
`--no-checkpointer`: no checkpointer.step() in the loop, so that the ranks left first meet the loss in the outer
step's collective (else in the checkpointer's agreement, in mid-period). `--wait-for-joiner-at`: at that step the
ranks that train wait (up to 120 s) until a joiner is ready. `--outer-not-in-state`: the Checkpointer's state
lacks model.outer_step (a joiner then refuses). `--stop-at`: rank 0 asks for a stop in that step (every rank
saves at the step they agree on and ends with code 75). Every rank appends `[step, ids]` per applied step to
RUN_DIR/ids-<rank>.jsonl; each rank that finishes writes RUN_DIR/result-<rank>.pt: its final parameters, synced
parameters, outer steps, generation, the step it was taken in at and, for a joiner, its parameters and synced
parameters right after it was taken in.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.world import generation, joining, stop
from phalanx.world import group as world

GLOBAL_BATCH, MICRO_BATCH, EVERY, LR, MOMENTUM = 12, 2, 4, 0.1, 0.9


class Indexed(torch.utils.data.Dataset):
    """Sample i: (i, x, y), x and y drawn from a generator seeded by i."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return index, *sample(index)


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    return torch.randn(4, generator=g, dtype=torch.float64), torch.randn(1, generator=g, dtype=torch.float64)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)).double()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--no-checkpointer", action="store_true")
    parser.add_argument("--wait-for-joiner-at", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--outer-not-in-state", action="store_true", help="leave model.outer_step out of the state")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--stop-at", type=int, default=-1, help="rank 0 asks for a stop in this step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    px.init()
    rank = px.world.launch_rank()
    dataset = Indexed(GLOBAL_BATCH * args.steps)
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, shuffle=False))
    model = px.DistributedDataParallel(make_model(), across_hosts=px.DiLoCo(every=EVERY, fragments=args.fragments))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", every=1000)  # never saves: a join reads no file
    state = {"model": model, "optimizer": optimizer, "loader": loader, "outer": model.outer_step}
    if args.outer_not_in_state:
        del state["outer"]
    checkpointer.restore(state)
    joined = None
    if joining.requested():
        joined = {"at": checkpointer.steps, "params": [p.detach().clone() for p in model.parameters()],
                  "synced": [s.detach().clone() for s in model.outer_step.synced]}
    with open(args.run_dir / f"ids-{rank}.jsonl", "a") as log:
        for step in loader:
            if step.index == args.wait_for_joiner_at and not joining.requested():
                deadline = time.monotonic() + 120
                while joining.waiting(world.store()) < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
            if step.index == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            ids, attempt = [], 0
            for index, x, y in step.micro_batches(model):
                if step.attempt != attempt:  # the loop started over after a loss: so do the ids
                    ids, attempt = [], step.attempt
                step.backward(F.mse_loss(model(x), y))
                ids += index.tolist()
            optimizer.step()
            log.write(json.dumps([step.index, ids]) + "\n")
            log.flush()
            if step.index == args.stop_at and rank == 0:
                stop.request("requested")  # as a signal does: every rank saves at the step they agree on, and ends
            if not args.no_checkpointer:
                checkpointer.step(state)
    current = generation.current()
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "synced": [s.detach().clone() for s in model.outer_step.synced],
                "outer_steps": model.outer_step.outer_steps, "generation": [current.number, list(current.members)],
                "joined": joined}, args.run_dir / f"result-{rank}.pt")
    px.shutdown()


if __name__ == "__main__":
    main()

"""The training loop of the exact-resume test, killed with SIGKILL and restarted by `phalanx run`.

    phalanx run --nproc-per-node 2 --max-restarts 2 tests/e2e/jobs/resume_job.py RUN_DIR --kill 0:1:4:start

`--kill ATTEMPT:RANK:STEP:WHEN` kills that rank during that restart attempt (TORCHELASTIC_RESTART_COUNT)
at that step, WHEN "start" (before its forward), "saved" (right after its checkpoint is committed) or
"writing" (right after save() returned, while the background writer writes it). Rank 0
writes the final parameters to RUN_DIR/final.pt; the test compares them with an uninterrupted run.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx as px

EPOCHS = 4  # 100 samples, 2 ranks, batches of 10: 5 steps per epoch, checkpoints at steps 7 and 14


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kill", action="append", default=[], metavar="ATTEMPT:RANK:STEP:WHEN")
    args = parser.parse_args()
    args.kill = {(int(a), int(r), int(s), when) for a, r, s, when in (k.split(":") for k in args.kill)}
    return args


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die_if_chosen(kills, step: int, when: str) -> None:
    if (attempt(), px.rank(), step, when) in kills:
        os.kill(os.getpid(), signal.SIGKILL)


def note_attempt(run_dir: Path) -> None:
    """Rank 0 appends the attempt number to RUN_DIR/attempts.log: the test checks the restarts happened."""
    if px.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "attempts.log", "a") as log:
            log.write(f"{attempt()}\n")


def main():
    args = parse_args()
    run_dir, epochs = args.run_dir, EPOCHS
    px.init()
    note_attempt(run_dir)
    torch.manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(100, 8), torch.randn(100, 1))
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    # The loop of issue 5, verbatim but for the two die_if_chosen() kill points.
    model = px.DistributedDataParallel(net)
    loader = px.DataLoader(ds, batch_size=10, sampler=px.DistributedSampler(ds, shuffle=True, seed=3))
    state = {"model": model, "optimizer": opt, "loader": loader, "epoch": 0, "step": 0}
    ckpt = px.Checkpointer(run_dir, keep=2)
    ckpt.restore(state)
    for epoch in range(state["epoch"], epochs):
        state["epoch"] = epoch
        loader.set_epoch(epoch)
        for xb, yb in loader:
            die_if_chosen(args.kill, state["step"] + 1, "start")
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state["step"] += 1
            if state["step"] % 7 == 0:
                ckpt.save(state)
                die_if_chosen(args.kill, state["step"], "writing")
                # A kill a few steps later must find this checkpoint committed (steps take milliseconds here,
                # a background write as long): but for the run that tests a kill while a write is in flight.
                if not any(when == "writing" for *_, when in args.kill):
                    ckpt.wait()
                die_if_chosen(args.kill, state["step"], "saved")
        state["epoch"] = epoch + 1

    if px.is_main():
        torch.save({"step": state["step"], "params": [p.detach() for p in net.parameters()]}, run_dir / "final.pt")
    px.shutdown()


if __name__ == "__main__":
    main()

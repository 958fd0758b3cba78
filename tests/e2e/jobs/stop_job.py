"""The training loop of the stop tests: a small model that a SIGTERM stops at a chosen moment.

    phalanx run --nproc-per-node 2 tests/e2e/jobs/stop_job.py RUN_DIR [--moment WHERE:K] [--shard LEVEL]

WHERE:K picks the moment within this invocation: `step` (before the K-th forward it runs), `exchange`
(inside the K-th backward, from a gradient hook, while buckets are being exchanged), `save` (inside its
K-th checkpoint write, from a state entry's state_dict()), `restore` (inside the restore, from that
entry's load_state_dict()), `eval` (inside the K-th evaluation, at its second batch), `rendezvous`
(rank 0 inside phalanx.init() waiting for rank 1, which asks before its own init()). The rank that
asks (1, or 0 for save: only rank 0 writes) sends SIGTERM to its launcher, its parent, or with
`--to-workers` to every worker, as SLURM does; then, but for `rendezvous`, it waits until its own
flag is up, so the request lands inside that moment. It appends the time it asked to RUN_DIR/asked.log.

Rank 0 appends every step it trains, with a CRC-32 of the parameters after it, to RUN_DIR/steps.log (the test checks
each step is trained once, and where a run parts from the uninterrupted one; with --diloco, whose hosts part between
outer steps, every other rank writes RUN_DIR/steps-RANK.log too) and writes the final parameters to
RUN_DIR/final.pt. A StepLog (a record every 2 steps, part of the checkpoint's state) writes RUN_DIR/log/steps.jsonl
and TensorBoard files: the test checks that across the stops they hold one record per logged step.
"""

import argparse
import os
import signal
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx as px

STEPS = 80  # 96 samples, 2 ranks, batches of 4: 12 steps per epoch
EVERY = 3  # a checkpoint every 3 steps
EVAL_EVERY = 4
LOG_EVERY = 2  # a StepLog record every 2 steps
DILOCO_EVERY = 4  # with --diloco: an outer step every 4, its 2 fragments sent at steps 0 and 2 (mod 4), merged 1 later


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--moment", default=None, metavar="WHERE:K")
    parser.add_argument("--to-workers", action="store_true", help="signal every worker instead of the launcher")
    parser.add_argument("--shard", default="none")
    parser.add_argument("--step-seconds", type=float, default=0.01, help="a pause per step: steps take time")
    parser.add_argument("--diloco", action="store_true",
                        help=f"across_hosts=DiLoCo(every={DILOCO_EVERY}, fragments=2, delay=1, int8): run on 2 nodes")
    args = parser.parse_args()
    where, k = (args.moment.split(":") if args.moment else (None, 0))
    args.where, args.k = where, int(k)
    return args


class Moment:
    """Asks for a stop once, at the chosen moment, on the chosen rank."""

    def __init__(self, args):
        self.where, self.k, self.run_dir, self.to_workers = args.where, args.k, args.run_dir, args.to_workers
        self.seen: dict[str, int] = {}
        self.done = False

    def asking_rank(self) -> int:
        return 0 if self.where == "save" else 1

    def here(self, where: str, rank: int) -> None:
        if self.done or where != self.where or rank != self.asking_rank():
            return
        self.seen[where] = self.seen.get(where, 0) + 1
        if self.seen[where] != self.k:
            return
        self.done = True
        with open(self.run_dir / "asked.log", "a") as log:
            log.write(f"{where} {time.time()}\n")
        pids = [os.getppid()]
        if self.to_workers:
            pids = [int(p.read_text()) for p in self.run_dir.glob("pid-*")]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        if where == "rendezvous":
            return
        deadline = time.monotonic() + 20
        while not px.stop_requested() and time.monotonic() < deadline:
            time.sleep(0.005)  # Python runs the signal handler between these sleeps


class Probe:
    """A state entry whose save and restore are where the moments `save` and `restore` happen."""

    def __init__(self, moment: Moment):
        self.moment = moment

    def state_dict(self):
        self.moment.here("save", px.rank())
        return {"probe": 1}

    def load_state_dict(self, state):
        self.moment.here("restore", px.rank())


def evaluate(model, dataset, moment: Moment, sharded: bool) -> float:
    sampler = px.DistributedSampler(dataset, shuffle=False, pad=sharded)  # FSDP2: as many batches on every rank
    mean = px.metrics.Mean()
    model.eval()  # no dropout: an evaluation left early draws no fewer random numbers than a whole one
    with torch.no_grad():
        for i, (x, y) in enumerate(px.DataLoader(dataset, batch_size=4, sampler=sampler)):
            if i == 1:
                moment.here("eval", px.rank())
            if px.stop_requested(agree=sharded):  # leave early: the save waits for the next step
                break
            mean.update(F.mse_loss(model(x), y), weight=len(y))
    model.train()
    return mean.compute()


def main():
    args = parse_args()
    moment = Moment(args)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    (args.run_dir / f"pid-{rank}").write_text(str(os.getpid()))
    if args.where == "rendezvous" and rank == 1:
        time.sleep(2.0)  # rank 0 waits in phalanx.init() meanwhile
        moment.here("rendezvous", 1)
        time.sleep(30)  # the launcher's SIGTERM ends this process first
    px.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
    held_out = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 16),
                              torch.nn.ReLU(), torch.nn.Linear(16, 1))
    across = px.DiLoCo(every=DILOCO_EVERY, fragments=2, delay=1, compress="int8") if args.diloco else None
    model = px.DistributedDataParallel(net, shard=args.shard, across_hosts=across)
    optimizer = model.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    loader = px.DataLoader(data, batch_size=4, sampler=px.DistributedSampler(data, shuffle=True, seed=5))
    hook_rank = px.rank()

    def in_backward(module, inputs, out):  # the gradient reaches the first block's output mid-backward,
        if out.requires_grad:  # after the later layers' gradients went to the exchange
            out.register_hook(lambda grad: moment.here("exchange", hook_rank))

    net[1].register_forward_hook(in_backward)

    step_log = px.StepLog(args.run_dir / "log", every=LOG_EVERY, optimizer=optimizer, total_steps=STEPS, print_every=10)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0, "probe": Probe(moment),
             "log": step_log}
    if args.diloco:
        state["outer"] = model.outer_step
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints", keep=2, every=EVERY)
    checkpointer.restore(state)
    sharded = args.shard == "parameters"
    while state["step"] < STEPS:
        loader.set_epoch(state["epoch"])
        for x, y in loader:
            moment.here("step", px.rank())
            time.sleep(args.step_seconds)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state["step"] += 1
            if (px.is_main() or args.diloco) and not sharded:  # the step and a checksum of the parameters after it
                crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters()))
                with open(args.run_dir / ("steps.log" if px.is_main() else f"steps-{px.rank()}.log"), "a") as log:
                    log.write(f"{state['step']} {crc}\n")
            elif px.is_main():
                with open(args.run_dir / "steps.log", "a") as log:
                    log.write(f"{state['step']} -\n")
            step_log.step(loss=loss, samples=len(x))
            if state["step"] % EVAL_EVERY == 0:
                evaluate(model.module if not sharded else model, held_out, moment, sharded)
            # Last in the iteration: a stop saves the state after everything this step did (the evaluation's
            # loader draws its workers' seed from the global generator: a resumed run must have drawn it too).
            checkpointer.step(state, last=state["step"] == STEPS)
            if state["step"] == STEPS:
                break
        else:
            state["epoch"] += 1
    params = [p.detach().clone() for p in (_whole(model) if sharded else model.module.parameters())]  # collective
    if px.is_main():
        torch.save({"step": state["step"], "params": params}, args.run_dir / "final.pt")
    px.shutdown()


def _whole(model):
    from torch.distributed.tensor import DTensor

    return [p.full_tensor() if isinstance(p, DTensor) else p for p in model.module.parameters()]


if __name__ == "__main__":
    main()

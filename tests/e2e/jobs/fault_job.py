"""A training loop with one fault injected on one rank, for tests/e2e/test_stall_report.py.

`--fault F --rank R --step S`: at step S, rank R
  data-sleep     sleeps in its dataset's __getitem__ (a slow or stuck data pipeline)
  skip-backward  skips loss.backward() and optimizer.step() once (a conditional backward)
  bucket-size    (from the start) wraps the model with another bucket_cap_mb: its buckets differ in size
  sigkill        kills itself with SIGKILL in a gradient hook, after its first bucket was launched
  gil-spin       spins in C holding the GIL (a regular expression that backtracks for hours)
  no-init        (from the start) sleeps before phalanx.init()
  slow-backward  every step, sleeps 20 ms at the start of backward (a straggler); prints the timings
"""

import argparse
import json
import os
import re
import signal
import sys
import time

import torch

import phalanx

HANG = 600  # seconds a stuck rank stays stuck: far past any stall timeout of the tests


class Samples(torch.utils.data.Dataset):
    def __init__(self, stuck: bool, batch: int, step: int):
        self.stuck, self.first_of_step = stuck, batch * (step - 1)

    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        if self.stuck and index == self.first_of_step:
            fault_now("data-sleep")
            time.sleep(HANG)
        return torch.full((32,), float(index % 7))


class SlowBackward(torch.autograd.Function):
    """Identity forward; its backward (the first to run) sleeps, delaying every gradient after it."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def fault_now(name: str) -> None:
    """Note when the fault starts: the test measures the time to the report from here."""
    print(f"FAULT {name} at {time.time():.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", required=True)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    me = int(os.environ["RANK"])
    faulty = me == args.rank
    if faulty and args.fault == "no-init":
        fault_now(args.fault)
        time.sleep(HANG)
    phalanx.init()
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 4))
    cap = 0.001 if faulty and args.fault == "bucket-size" else 0.02  # MiB: two buckets, or five
    if faulty and args.fault == "bucket-size":
        fault_now(args.fault)
    model = phalanx.DistributedDataParallel(net, bucket_cap_mb=cap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if faulty and args.fault == "sigkill":
        def die(grad):
            if step == args.step:
                fault_now("sigkill")
                os.kill(os.getpid(), signal.SIGKILL)
            return grad
        net[0].weight.register_hook(die)  # the last gradient of backward: the output's bucket is in flight
    loader = torch.utils.data.DataLoader(Samples(faulty and args.fault == "data-sleep", 8, args.step), batch_size=8)
    backward_ms = []
    for step, batch in enumerate(loader, start=1):
        if step > args.steps:
            break
        out = model(batch)
        if args.fault == "slow-backward" and faulty:
            out = SlowBackward.apply(out, 0.02)
        loss = out.square().mean()
        if faulty and step == args.step and args.fault == "skip-backward":
            fault_now(args.fault)
            continue
        if faulty and step == args.step and args.fault == "gil-spin":
            fault_now(args.fault)
            re.match(r"(a+)+$", "a" * 64 + "b")  # C code, GIL held, exponential time
        started = time.perf_counter()
        loss.backward()
        backward_ms.append((time.perf_counter() - started) * 1e3)
        optimizer.step()
        optimizer.zero_grad()
    if args.fault == "slow-backward":
        phalanx.barrier()
        if me == 0:
            report = {rank: s.as_dict() for rank, s in phalanx.straggler_report().items()}
            print("STRAGGLER " + json.dumps(report), flush=True)
        backward = sorted(backward_ms[5:])
        print(f"BACKWARD rank={me} median_ms={backward[len(backward) // 2]:.2f}", flush=True)
    phalanx.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()

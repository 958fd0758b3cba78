"""What a background save costs the training: blocking time, time to commit, and the step time around it.

    PYTHONPATH=. python benchmarks/checkpoints/async_checkpoint.py [--ranks 2] [--blocks 2] [--dir /tmp]

Each rank (phalanx.spawn, Gloo, one thread per rank) trains 12 x Linear(2048, 2048) (50.3M parameters)
with AdamW under phalanx DDP: 600 MB of state per rank. Measured on every rank, reported for each:
- `copy`: a plain memory copy of the state's tensors (the model's state dict and the optimizer's state)
  into buffers allocated beforehand, the floor of any snapshot;
- `sync`: `Checkpointer(async_save=False).save()`, today's synchronous save (rank 0 writes, a barrier);
- `blocking`: `Checkpointer().save()` in the background, until it returns (the first save apart: it
  allocates the staging buffer and forks the writer); `commit`: from that call until `wait()` returns;
- step time with `checkpointer.step(state)` saving every 20 steps, against none, in blocks of 20 steps
  (`--blocks` of each, interleaved: on, off, off, on, ...), as wall time and as the training process's CPU time
  (which other processes on a shared machine do not inflate). The writer runs beside the training on the
  same cores; its CPU time per save is reported apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

EVERY = 20


def _state_tensors(model, optimizer):
    tensors = list(model.module.state_dict().values())
    tensors += [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "copy_")]
    return tensors


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank: int, directory: str, blocks: int, repeats: int) -> dict:
    import torch

    import phalanx as px
    from phalanx.tools.bench_compare import interleave

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])
    model = px.DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optimizer": optimizer, "step": 0}

    def train():
        model(torch.randn(8, 2048)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1

    train()
    tensors = _state_tensors(model, optimizer)
    out = {"state_mb": sum(t.numel() * t.element_size() for t in tensors) / 1e6}
    buffers = [torch.empty_like(t) for t in tensors]
    copies = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for target, tensor in zip(buffers, tensors):
            target.copy_(tensor)
        copies.append(time.perf_counter() - started)
    del buffers
    out["copy"] = min(copies[1:])  # the first touches fresh pages

    sync = px.Checkpointer(os.path.join(directory, "sync"), keep=1, async_save=False)
    times = []
    for _ in range(repeats):
        px.barrier()
        started = time.perf_counter()
        sync.save(state)
        times.append(time.perf_counter() - started)
    out["sync"] = statistics.median(times)

    background = px.Checkpointer(os.path.join(directory, "background"), keep=1)
    blocking, commits = [], []
    for _ in range(repeats + 1):  # the first allocates the staging buffer and forks the writer
        px.barrier()
        started = time.perf_counter()
        background.save(state)
        returned = time.perf_counter()
        background.wait()
        blocking.append(returned - started)
        commits.append(time.perf_counter() - started)
    out["first_save"] = blocking.pop(0)
    commits.pop(0)
    out["blocking"], out["commit"] = statistics.median(blocking), statistics.median(commits)
    out["staging_mb"] = background._background.staging.size / 1e6
    out["writer_cpu"] = _cpu_seconds(background._background.writer.pid) / (repeats + 1)

    # Step time: blocks of EVERY steps, saving once per block (step() every EVERY) or not at all.
    # The save comes at a block's first step, so its write runs beside that block's steps.
    periodic = px.Checkpointer(os.path.join(directory, "periodic"), keep=1, every=EVERY)
    periodic.save(state)  # warm up: the staging buffer, the writer
    periodic.wait()
    # Interleaved blocks, on off, off on, ...: a load that drifts over the run (a shared machine's) cancels.
    def block(mode):
        periodic.steps = EVERY - 1
        px.barrier()
        started, used = time.perf_counter(), time.process_time()
        for _ in range(EVERY):
            train()
            if mode == "on":
                periodic.step(state)
        wall, spent = (time.perf_counter() - started) / EVERY, (time.process_time() - used) / EVERY
        periodic.wait()
        return wall, spent

    timed = interleave(["on", "off"], blocks, block)
    per_step = {mode: [wall for wall, _ in values] for mode, values in timed.items()}
    cpu = {mode: [spent for _, spent in values] for mode, values in timed.items()}
    out["blocks"] = per_step
    out["cpu_on"], out["cpu_off"] = (statistics.mean(cpu["on"]), statistics.mean(cpu["off"])) if blocks else (0, 0)
    out["step_on"] = statistics.mean(per_step["on"]) if blocks else float("nan")
    out["step_off"] = statistics.mean(per_step["off"]) if blocks else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2,
                        help="blocks of 20 steps with saves, and as many without (0: no step-time test)")
    parser.add_argument("--repeats", type=int, default=2, help="timed saves of each kind")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    from phalanx.tools.bench_compare import add_json_flag, write_figures

    add_json_flag(parser)
    args = parser.parse_args()
    import phalanx as px

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        results = px.spawn(_rank, args.ranks, (directory, args.blocks, args.repeats),
                           env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    print(f"{args.ranks} rank(s), 12 x Linear(2048, 2048) + AdamW, saves every {EVERY} steps in the step test")
    print("rank | state MB | staging MB | copy s | sync save s | first save s | blocking s | commit s | "
          "writer CPU s per save | blocking/copy | blocking/sync | step on ms | step off ms | on/off | "
          "CPU per step on/off ms")
    for rank, r in enumerate(results):
        print(f"{rank} | {r['state_mb']:.0f} | {r['staging_mb']:.0f} | {r['copy']:.3f} | {r['sync']:.3f} | "
              f"{r['first_save']:.3f} | {r['blocking']:.3f} | {r['commit']:.3f} | {r['writer_cpu']:.2f} | "
              f"{r['blocking'] / r['copy']:.2f} | "
              f"{r['blocking'] / r['sync']:.3f} | {1e3 * r['step_on']:.1f} | {1e3 * r['step_off']:.1f} | "
              f"{r['step_on'] / r['step_off']:.3f} | {1e3 * r['cpu_on']:.1f} / {1e3 * r['cpu_off']:.1f}")
        if os.environ.get("BENCH_BLOCKS"):
            print(rank, {mode: [round(1e3 * t) for t in times] for mode, times in r["blocks"].items()})
    r = results[0]
    figures = {"blocking s": round(r["blocking"], 3), "blocking/copy": round(r["blocking"] / r["copy"], 2),
               "blocking/sync": round(r["blocking"] / r["sync"], 3), "commit s": round(r["commit"], 2)}
    if args.blocks:
        figures["step on/off"] = round(r["step_on"] / r["step_off"], 3)
    write_figures(args.json_path, figures, per_rank=results)


if __name__ == "__main__":
    main()

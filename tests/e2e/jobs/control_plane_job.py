"""The loop of docs/data.md with a tiny model, for counting what live recovery's control plane sends.

    phalanx run --nnodes N --node-rank I --nproc-per-node L --min-world-size M ... \\
        tests/e2e/jobs/control_plane_job.py RUN_DIR --host I --steps T --window A:B [--pause 0.15]

A global batch of 4 samples per launched rank (one micro-batch each), SGD, a Checkpointer that saves only when asked
to stop (its stop agreement runs as in any loop, every STOP_INTERVAL seconds: its steps between two agreements are a
whole number, 0.5 s over steps of 0.164 s against 0.169 s would be every 3 steps with live recovery off and every 2
with it on at 6 hosts, half as many Gloo all-reduces again, counted as live recovery's), T optimizer steps in one
epoch. Launch rank 0 sleeps `--pause`
seconds at the start of every step, so that the others wait on it in their collectives, as behind a slow peer. Every
rank appends `step time generation world_size` (time.time(), after checkpointer.step) to RUN_DIR/steps-<launch
rank>.txt per applied step, and writes the seconds it spent in the per-step commit (generation.commit_step, live
recovery on) of each step to RUN_DIR/commit-<launch rank>.json at its end. Local rank 0 of each host reads its
network namespace's TCP counters (/proc/self/net/snmp: the whole host's, launcher and store included) at the end of
steps A and B and writes them to RUN_DIR/tcp-<host>.json, with the segments on its own connections to the store and
on its others (`store`, `other`: ss's per-socket counters): the window is the same steps on every host, whatever the
harness's timing; `tree` counts the segments on the connections of the per-step commit's tree (from a generation's
second step: world/generations/commit_tree.py). Every rank writes phalanx's log records (INFO and above) to
RUN_DIR/log-<launch rank>.txt, each line `time level message`: when a loss was named, and how long the regroup took,
on the worker's own clock (`--debug`: DEBUG records too, in that file only). `--debug` also times the regroup's parts
(time_regroup) into RUN_DIR/regroup-<launch rank>.txt, and every rank writes its pid to RUN_DIR/pid-<launch
rank>.txt, so that a loss run can SIGKILL the victim's workers themselves. `--group-rounds R`: after the loop, every
rank makes a regroup's two groups R times on the healthy world (time_groups) into RUN_DIR/groups-<launch rank>.txt.
"""

import argparse
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.world.generations.current import current
from phalanx.world.group import live_generation
from phalanx.world.liveness import identity

MICRO_BATCH = 4
STOP_INTERVAL = "30"  # seconds between the stop agreements: none in the window, on or off (see the docstring)


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP counters: {"ActiveOpens": ..., "OutSegs": ..., ...}."""
    with open("/proc/self/net/snmp") as snmp:
        names, values = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
    return {name: int(value) for name, value in zip(names, values)}


def socket_segments() -> dict[str, int]:
    """Segments both ways on this process's TCP connections (ss's per-socket counters): {"store": on its connections to
    the store (MASTER_ADDR:MASTER_PORT: its own and its watch's), "watch": on the kept watch it opened (to the beacon of
    the peer it watches), "watched": on the one its own beacon accepted (its watcher's), "tree": on the commit tree's
    (those its listener accepted, and the one to its parent's), "other": on the rest (Gloo's pairs), "other_data": of
    those, the segments that carried data (pure ACKs not)}. Connections opened and closed in between are not seen."""
    shown = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    watch = current()._watching.get("watch")  # live recovery on: this rank's watch (world/watch.py)
    beacon = identity().split()[3] if watch is not None else None
    watched = watch.who.get(watch.watched) if watch is not None and watch.watched is not None else None
    watched = watched.split()[3] if watched else None
    links = current()._watching.get("links")  # the commit tree's (world/generations/commit_tree.py)
    tree_ends = {links.address, *links.addresses.values()} if links is not None else set()
    found = {"store": 0, "watch": 0, "watched": 0, "tree": 0, "other": 0, "other_data": 0}
    for entry in re.split(r"\n(?=\S)", shown):  # a socket: its line, then its counters' indented line
        fields = entry.split()
        if f"pid={os.getpid()}," not in entry or len(fields) < 5:
            continue
        segments = sum(int(value) for value in re.findall(r"\bsegs_(?:in|out):(\d+)", entry))
        local, peer = (re.sub(r"^\[(?:::ffff:)?(.*)\]:", r"\1:", field) for field in fields[3:5])  # [::ffff:a.b.c.d]
        kind = {store: "store", watched: "watch"}.get(peer) or ("watched" if local == beacon else "other")
        if kind == "other" and (local in tree_ends or peer in tree_ends):
            kind = "tree"
        found[kind] += segments
        if kind == "other":
            found["other_data"] += sum(int(value) for value in re.findall(r"\bdata_segs_(?:in|out):(\d+)", entry))
    return found


def time_regroup(path: Path) -> None:
    """Append `part start end cpu` to `path` for each part of a regroup (time.time(), and the process's CPU seconds in
    it, all its threads), by wrapping the functions that make it where their callers look them up: the survivors'
    agreement, each group made and connected (`main`, `control`), the meeting on them and its parts after the groups
    (`formed`, `set_aside`, `set_live`, `watch`), the DDP model's regroup, and all followers (`recover` starts where
    recover() started; its CPU is not counted: -1)."""
    from phalanx.engine.regroup import RegroupMixin
    from phalanx.world import group as world
    from phalanx.world.generations import agreement, recovery, release
    from phalanx.world.generations import current as generations

    def timed(owner, name, part):
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started, cpu = time.time(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                label = part(args) if callable(part) else part
                with open(path, "a") as out:
                    out.write(f"{label} {started:.6f} {time.time():.6f} {time.process_time() - cpu:.6f}\n")
                    if label == "followers":  # regroup_followers(number, members, lost, started, ...)
                        now = time.time()
                        out.write(f"recover {now - (time.monotonic() - args[3]):.6f} {now:.6f} -1\n")
        setattr(owner, name, wrapper)

    timed(agreement, "agree_on_survivors", "agree")
    timed(agreement, "meet", "meet")
    timed(generations, "generation_group", lambda args: args[1].rsplit("/", 1)[-1])  # made and connected
    timed(agreement, "groups_formed", "formed")  # meet's parts after the groups: their formation,
    timed(release, "set_aside", "set_aside")  # the groups before set aside,
    timed(world, "set_live", "set_live")  # the new ones made the world's,
    timed(generations, "GenerationWatch", "watch")  # and the new generation's watch set up
    timed(RegroupMixin, "regroup", "ddp")
    timed(recovery, "regroup_followers", "followers")


REHEARSED = 1_000_000  # time_groups' generations: numbers no regroup reaches


def time_groups(path: Path, rounds: int) -> None:
    """`rounds` times, on the healthy world at the loop's end, what a regroup's meeting does once its survivors agreed
    (generations/current.py meet), done by the workers the way a regroup does it: rank 0 sets a decision key, the
    others see it at their looks (agreement.DECISION_LOOK), then each makes the main group and the control group
    (generation_group: lazy, connected, on one store client of their own), waits for every member to have made
    them (agreement.groups_formed, under keys of the round's own), says who it is and sets up the new generation's
    watch (for a generation numbered from REHEARSED, which no regroup reaches: closed once every rank set it up).
    Appends a line per round to `path`: `decided main_made control_made formed watched` and the CPU of each of the
    4 parts (time.time(); the process's CPU seconds, all its threads), for benchmarks/control_plane/group_units.py."""
    import torch.distributed as dist

    from phalanx.world import generation, joining
    from phalanx.world.generations.agreement import DECISION_LOOK, FORM_ATTEMPTS, groups_formed
    from phalanx.world.generations.current import Generation, generation_group
    from phalanx.world.liveness import identity
    from phalanx.world.watch import side_store

    store, members = px.world.store(), tuple(generation.current().members)
    with open(path, "w") as out:
        for number in range(rounds):
            px.world.barrier(name=f"control_plane_job/groups{number}")
            decision = f"control_plane_job/groups{number}/decision"
            if px.world.launch_rank() == 0:
                time.sleep(2 * DECISION_LOOK)  # the others look by then
                store.set(decision, repr(time.time()))
            while not store.check([decision]):
                time.sleep(DECISION_LOOK)
            made, cpu, own = [float(store.get(decision))], [], side_store(joining.default_store())
            # the new generation's watch, as meet sets it up, for a generation no regroup makes (closed right after)
            rehearsal = Generation(REHEARSED + number, members, None)
            for part in ("main", "control", "formed", "watch"):
                before = time.process_time()
                if part == "formed":  # under an attempt number no regroup takes (it tries FORM_ATTEMPTS at most)
                    groups_formed(generation.current(), store, members, FORM_ATTEMPTS + number, True)
                elif part == "watch":  # meet's last part: this rank says who it is, then its watch is set up
                    store.set(rehearsal._key("who", dist.get_rank()), identity())
                    rehearsal.watch(store)
                else:
                    generation_group(members, f"control_plane_job/groups{number}/{part}",
                                     backend="gloo" if part == "control" else None, store=own)
                made.append(time.time())
                cpu.append(time.process_time() - before)
            px.world.barrier(name=f"control_plane_job/groups{number}/watched")
            rehearsal.close_watch()
            out.write(" ".join(f"{value:.6f}" for value in made + cpu) + "\n")


def build():
    """(the job's model in phalanx DDP, its SGD): what every worker trains (benchmarks/control_plane/watch_end.py's
    victim too)."""
    model = px.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                           torch.nn.Linear(8, 1)))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def time_commits(spent: dict, done: list) -> None:
    """Add the seconds of each call of the per-step commit to `spent[done[0]]` (the step in progress), by wrapping
    generation.commit_step where the global-batch loop looks it up."""
    from phalanx.world import generation

    inner = generation.commit_step

    def timed():
        started = time.perf_counter()
        try:
            return inner()
        finally:
            spent[done[0]] = spent.get(done[0], 0.0) + time.perf_counter() - started
    generation.commit_step = timed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--host", type=int, required=True, help="this host's index (its node rank)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    parser.add_argument("--window", default="5:25", help="A:B, the steps at whose ends the TCP counters are read")
    parser.add_argument("--pause", type=float, default=0.15, help="seconds launch rank 0 sleeps in each step")
    parser.add_argument("--debug", action="store_true", help="phalanx's DEBUG records too, in RUN_DIR/log-<rank>.txt")
    parser.add_argument("--group-rounds", type=int, default=0,
                        help="after the loop, make a regroup's two groups this many times (time_groups)")
    args = parser.parse_args()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if args.debug:
        time_regroup(args.run_dir / f"regroup-{os.environ['RANK']}.txt")
    first, last = (int(part) for part in args.window.split(":"))
    px.init()
    rank, counts = px.world.launch_rank(), px.world.local_rank() == 0
    (args.run_dir / f"pid-{rank}.txt").write_text(str(os.getpid()))
    record = logging.FileHandler(args.run_dir / f"log-{rank}.txt")
    record.setFormatter(logging.Formatter("%(created).6f %(levelname)s %(message)s"))
    phalanx_logger = logging.getLogger("phalanx")
    if args.debug:  # its own lines stay at INFO
        for handler in phalanx_logger.handlers:
            handler.setLevel(logging.INFO)
        phalanx_logger.setLevel(logging.DEBUG)
    phalanx_logger.addHandler(record)
    global_batch = MICRO_BATCH * px.world.launch_world_size()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * global_batch, 4, generator=generator),
                                          torch.randn(args.steps * global_batch, 1, generator=generator))
    torch.manual_seed(0)
    model, optimizer = build()
    loader = px.DataLoader(data, batch_size=MICRO_BATCH, global_batch_size=global_batch,
                           sampler=px.DistributedSampler(data, seed=0))
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    os.environ.setdefault("PHALANX_STOP_INTERVAL", STOP_INTERVAL)
    checkpointer = px.Checkpointer(args.run_dir / "checkpoints")  # saves only when asked to stop
    counters, commits, current_step = {}, {}, [1]
    time_commits(commits, current_step)
    with open(args.run_dir / f"steps-{rank}.txt", "w") as log:
        loader.set_epoch(0)
        for done, step in enumerate(loader, start=1):
            current_step[0] = done
            if rank == 0:
                time.sleep(args.pause)
            optimizer.zero_grad()
            for x, y in step.micro_batches(model):
                step.backward(F.mse_loss(model(x), y))
            optimizer.step()
            checkpointer.step(state)
            if counts and done in (first, last):
                counters[done] = {**tcp_counters(), **socket_segments()}
            log.write(f"{done} {time.time():.6f} {live_generation()} {px.world_size()}\n")
            log.flush()
    if args.group_rounds:
        time_groups(args.run_dir / f"groups-{rank}.txt", args.group_rounds)
    (args.run_dir / f"commit-{rank}.json").write_text(json.dumps(commits))
    if counts:
        (args.run_dir / f"tcp-{args.host}.json").write_text(json.dumps(counters))
    px.shutdown()


if __name__ == "__main__":
    main()

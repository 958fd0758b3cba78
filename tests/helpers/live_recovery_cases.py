"""The loop of docs/data.md with a rank that dies in the middle of a step, shared by tests/ranks/test_live_recovery.py
(phalanx.spawn) and tests/e2e/jobs/live_recovery_job.py (`phalanx run --min-world-size`).

The run of tests/helpers/global_batch_cases.py (a global batch of 26 in micro-batches of 4, two epochs, SGD with
momentum) with a Checkpointer saving every 2 steps, the step's loss summed over the ranks that train after each step,
and a StepLog of every step (`directory/steplog/steps.jsonl`: steplog_records()). The doomed rank SIGKILLs itself in
step `at` = (epoch, step) at `moment`: "forward" (before its first forward of the step), "exchange" (from a gradient
hook in its last backward: with a bucket per parameter, some buckets are in flight), or "optimizer" (after its backward,
before its optimizer step; the step was committed, so its samples are logged as applied), "metric" (in the step's
metric, once its value reached rank 0 and no other rank: rank 0 finishes the metric and goes on, the others do not:
_MetricReachingOneRank) or "metric-to-1" (the same, its value reaching rank 1 only: the main rank is behind),
"commit" or "committed" (in
the step's commit as its host's leader, rank 0 over Gloo on one host, world/generations/host_board.py: once it decided,
before it tells the others or right after it: its samples logged as applied then); with a sharded model also "clip"
(before `model.clip_grad_norm_`, whose all-reduce the others are then in), or "save" (in a background save, once the
others handed their parts to their writers: its own never reaches its writer). Every rank appends `[epoch, step, ids]`
per applied step to `ids-<rank>.jsonl` in `directory`: the ids its part of the step averaged, and the time
(`time.time()`); a doomed rank writes the time it dies in `died-at`. `then`: a second rank lost later, (rank, (epoch,
step)), at the same moment. The survivors report the process groups of the generations before their last that are still
alive in them (none: each is freed once its collectives ended).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import os
import signal
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import phalanx as px
from phalanx.checkpoint.atomic_files import checkpoint_files, load_safely
from phalanx.world import generation, joining
from phalanx.world import group as world
from phalanx.world.process import gloo_loops
from tests.helpers.emulated_hosts import emulate_host
from tests.helpers.global_batch_cases import (
    EPOCHS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    SEED,
    Indexed,
    make_model,
    make_optimizer,
    parameters,
)

MOMENTS = ("forward", "exchange", "optimizer", "metric", "metric-to-1")


def _die(directory: str) -> None:
    # when, for benchmarks/live_recovery/live_recovery_timing.py
    with open(os.path.join(directory, "died-at"), "w") as note:
        note.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def train(rank: int, directory: str, doomed_rank: int, at: tuple[int, int], moment: str, pause: float = 0.0,
          shard: str = "none", adam: bool = False, hidden: int = 8, then: tuple | None = None,
          per_host: int | None = None) -> dict:
    """The loop; returns what the survivors' checks read (the doomed rank never returns). `pause`: seconds of
    sleep per step, so that a test can kill a host in the middle of the run. `shard`: the model's shard level
    (its optimizer then from model.shard_optimizer); a step rolled back after a loss (`step.undone`) is not
    logged, and comes again. `adam`: AdamW instead of SGD with momentum; `hidden`: the model's hidden width.
    `per_host`: ranks per emulated host (tests/helpers/emulated_hosts.py), so that the commit goes along the tree."""
    if per_host is not None:
        emulate_host(rank, per_host)
    dataset = Indexed()
    loader = px.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                           sampler=px.DistributedSampler(dataset, seed=SEED))
    model = px.DistributedDataParallel(make_model(hidden), bucket_cap_mb=1e-6, shard=shard)  # a bucket per parameter
    optimizer = model.shard_optimizer(make_optimizer(model, adam))
    checkpointer = px.Checkpointer(os.path.join(directory, "checkpoints"), every=2)  # saves before and after
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    steplog = px.StepLog(os.path.join(directory, "steplog"), every=1, print_every=0, tensorboard=False)
    dies_at = at if rank == doomed_rank else then[1] if then is not None and rank == then[0] else None
    if dies_at == "groups":
        _die_making_groups()
    losses, started_as, doomed, armed = [], os.getpid(), dies_at is not None, [False]
    views = set()  # (generation, px.rank(), px.world_size(), px.is_main(), launch rank) seen at each step
    groups = _GroupsKept()
    generation.on_regroup(groups.regrouped)
    # generation 0's Gloo loop threads (torch's default group's, the control group's): idle once a loss left them
    first_loops = gloo_loops.threads_of(dist.group.WORLD) + gloo_loops.threads_of(world.control_group())
    first_layer = model.module[0].weight  # its gradient comes last in backward: later buckets are in flight
    first_layer.register_hook(lambda grad: _die(directory) if armed[0] else None)
    in_commit: list = [None]  # the doomed step's ids, during its last backward (and so its commit)
    with open(os.path.join(directory, f"ids-{rank}.jsonl"), "a") as log, _groups_made() as groups_made:
        if doomed and moment in ("commit", "committed", "decided", "undecided"):
            _die_in_commit(directory, log, in_commit, moment)
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for step in loader:
                time.sleep(pause)
                optimizer.zero_grad()
                ids, attempt = [], 0
                for j, (index, x, y) in enumerate(step.micro_batches(model)):
                    if step.attempt != attempt:  # the loop started over on the ranks left: so do the ids
                        ids, attempt = [], step.attempt
                    here = doomed and (epoch, step.index) == dies_at
                    if here and moment == "forward":
                        _die(directory)
                    armed[0] = here and moment == "exchange" and j == step.num_micro_batches - 1
                    last = here and j == step.num_micro_batches - 1
                    in_commit[0] = [epoch, step.index, ids + index.tolist()] if last else None
                    step.backward(F.mse_loss(model(x), y))
                    if step.weight:
                        ids += index.tolist()
                if shard != "none":  # a collective between the micro-batches and the optimizer step
                    if doomed and (epoch, step.index) == dies_at and moment == "clip":
                        _die(directory)
                    model.clip_grad_norm_(1e9)  # the norm's all-reduce; no gradient is scaled (by 1.0 exactly)
                if doomed and (epoch, step.index) == dies_at and moment == "optimizer":
                    if shard == "none":  # applied by the others; a sharded step is rolled back and redone instead
                        log.write(json.dumps([epoch, step.index, ids, time.time()]) + "\n")
                        log.flush()
                    _die(directory)
                optimizer.step()
                views.add((generation.current().number, px.rank(), px.world_size(), px.is_main(),
                           px.world.launch_rank()))
                if not step.undone:
                    log.write(json.dumps([epoch, step.index, ids, time.time()]) + "\n")
                    log.flush()
                straddled = moment.startswith("metric") and (epoch, step.index) == at  # every rank: one all-reduce
                reaches = 1 if moment == "metric-to-1" else 0
                with _MetricReachingOneRank(directory, doomed, reaches) if straddled else contextlib.nullcontext():
                    loss = px.metrics.all_reduce_sum(step.loss).item()  # over the ranks that train
                if not step.undone:
                    losses.append(loss)
                    steplog.step(loss, samples=len(ids))
                if doomed and (epoch, step.index) == dies_at and moment == "save":
                    checkpointer._background.submit = lambda *args: _die(directory)
                checkpointer.step(state)
    steplog.close()
    current = generation.current()
    loops_now = gloo_loops.threads_of(current.group) + gloo_loops.threads_of(world.control_group())
    return {"pid": (started_as, os.getpid()), "generation": (current.number, current.members),
            "params": parameters(model), "losses": losses, "main": px.is_main(), "groups_made": groups_made,
            "older_groups_alive": groups.older_alive(current.number), "views": sorted(views),
            "first_loops": [gloo_loops.policy(tid) for tid in first_loops],
            "loops_now": [gloo_loops.policy(tid) for tid in loops_now]}


class _MetricReachingOneRank:
    """Inside the block, the metric's all-reduce is made of point-to-point messages (each rank sends its value to
    every other and sums what it receives), and the doomed rank, once it received the others' values, sends its own to
    rank `reaches` only and dies: that rank finishes the metric with every rank's value and goes on to its next
    collective, while the others meet the loss in the metric (as Gloo's own all-reduce can end, on a peer lost at the
    wrong moment)."""

    def __init__(self, directory: str, doomed: bool, reaches: int):
        self.directory, self.doomed, self.reaches = directory, doomed, reaches
        self._metrics = px.metrics

    def __enter__(self):
        self._metrics.dist = self
        return self

    def __exit__(self, *exc) -> None:
        self._metrics.dist = dist

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        me = dist.get_rank()
        others = [rank for rank in ranks if rank != me]
        received = {rank: torch.empty_like(tensor) for rank in others}
        receives = [dist.irecv(received[rank], src=rank, group=group) for rank in others]
        if self.doomed:
            for work in receives:
                work.wait()
            dist.isend(tensor, dst=ranks[self.reaches], group=group).wait()
            time.sleep(0.5)  # its value is taken in before the connection closes
            _die(self.directory)
        sends = [dist.isend(tensor, dst=rank, group=group) for rank in others]
        return _Summed(tensor, received, receives + sends)


class _Summed:
    """The point-to-point all-reduce's Work: its waits run in a thread (a Gloo receive's own timed wait unbinds its
    buffer), and the values received are added once every message went through."""

    def __init__(self, tensor, received: dict, works: list):
        self.tensor, self.received = tensor, received
        self.done = concurrent.futures.ThreadPoolExecutor(1).submit(lambda: [work.wait() for work in works])

    def is_completed(self) -> bool:
        return self.done.done() and self.done.exception() is None

    def wait(self, timeout=None) -> bool:
        try:
            self.done.result(timeout=None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise RuntimeError("timed out waiting for the metric's messages") from None
        for value in self.received.values():
            self.tensor += value
        self.received = {}
        return True


def _die_making_groups() -> None:
    """Die as this rank starts making the next generation's groups, after the survivors' agreement counted it in (a
    host's ranks dying one after another): the others' groups fail on it."""
    from phalanx.world.generations import current as generations

    generations.generation_group = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)


def _die_in_commit(directory: str, log, in_commit: list, moment: str) -> None:
    """Die in the doomed step's commit as its host's leader, once it decided: before it tells the others ("commit")
    or right after ("committed": its samples logged as applied, as the others apply the step); "decided": the tree's
    root, once its word went to the other hosts and before its own host's followers heard it (its samples logged as
    applied: the other hosts apply the step, and its followers, in doubt, hear it from them); "undecided": the tree's
    root, before its word goes to anyone (nobody applies the step)."""
    from phalanx.world.generations import commit_tree
    from phalanx.world.generations.host_board import HostBoard

    say, send = HostBoard.say, commit_tree.SocketLinks.send
    if moment == "undecided":
        def dying_unheard(self, peer, tag, number, value):
            if in_commit[0] is not None and tag == "down":
                _die(directory)
            return send(self, peer, tag, number, value)

        commit_tree.SocketLinks.send = dying_unheard
        return

    def dying(self, number, yes):
        if in_commit[0] is None or not self.leads:
            return say(self, number, yes)
        if moment in ("committed", "decided"):
            if moment == "committed":
                say(self, number, yes)
            log.write(json.dumps([*in_commit[0], time.time()]) + "\n")
            log.flush()
        _die(directory)

    HostBoard.say = dying


def check_world_views(results: list) -> None:
    """In every generation the ranks that train saw themselves as ranks 0..n-1 of a world of n (numbered in their
    launch order, as a restart would number them), with exactly one main rank, rank 0."""
    by_generation: dict[int, list] = {}
    for result in results:
        if result is not None:
            for number, rank, size, main, launched in result["views"]:
                by_generation.setdefault(number, []).append((launched, rank, size, main))
    for number, views in sorted(by_generation.items()):
        views.sort()
        sizes = {size for _, _, size, _ in views}
        assert len(sizes) == 1, f"generation {number}: the ranks disagree on the world size: {views}"
        ranks = [rank for _, rank, _, _ in views]
        assert ranks == sorted(set(ranks)) and set(ranks) <= set(range(sizes.pop())), \
            f"generation {number}: ranks not dense, or out of launch order: {views}"
        assert [rank for _, rank, _, main in views if main] in ([0], []), f"generation {number}: mains {views}"


class _GroupsKept:
    """Weak references to each generation's process groups (the main one and the control one), by generation."""

    def __init__(self):
        self.groups = {0: self._refs(world.control_group())}  # generation 0's main group is torch's default

    def regrouped(self, new) -> None:
        self.groups[new.number] = self._refs(new.group, world.control_group())

    @staticmethod
    def _refs(*groups) -> list:
        return [weakref.ref(group) for group in groups if group is not None]

    def older_alive(self, number: int, within: float = 10.0) -> list[int]:
        """The generations before `number` whose groups are still alive after `within` seconds."""
        deadline = time.monotonic() + within
        while True:
            gc.collect()
            alive = [n for n, refs in sorted(self.groups.items()) if n < number and any(ref() for ref in refs)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


@contextlib.contextmanager
def _groups_made():
    """The files whose code made a process group (dist.new_group, or joining.make_group: a generation's groups, made
    by name) inside the block: only a regroup should."""
    made, new_group, make_group = [], dist.new_group, joining.make_group

    def recording(make):
        def recorded(*args, **kwargs):
            made.append(os.path.basename(traceback.extract_stack(limit=2)[0].filename))
            return make(*args, **kwargs)
        return recorded

    dist.new_group, joining.make_group = recording(new_group), recording(make_group)
    try:
        yield made
    finally:
        dist.new_group, joining.make_group = new_group, make_group


def applied_ids(directory: str, world_size: int) -> dict:
    """{(epoch, step): sorted ids} over every rank's log: what each applied step averaged."""
    applied: dict = {}
    for rank in range(world_size):
        with open(os.path.join(directory, f"ids-{rank}.jsonl")) as log:
            for line in log:
                epoch, step, ids, _ = json.loads(line)
                applied.setdefault((epoch, step), []).extend(ids)
    return {key: sorted(ids) for key, ids in applied.items()}


def steplog_records(directory: str) -> list[dict]:
    """The StepLog's records, in the order written."""
    with open(os.path.join(directory, "steplog", "steps.jsonl")) as records:
        return [json.loads(line) for line in records]


def newest_checkpoint(directory: str) -> dict:
    """The newest checkpoint's payload (loaded with weights_only=True)."""
    path = Path(directory) / "checkpoints"
    files = checkpoint_files(path)
    return load_safely(path / files[max(files)], "cpu")


def next_step_after(directory: str, ranks, when: float) -> float | None:
    """Seconds from `when` to the first step the ranks `ranks` all applied after it (None: none came)."""
    firsts = []
    for rank in ranks:
        with open(os.path.join(directory, f"ids-{rank}.jsonl")) as log:
            times = [json.loads(line)[3] for line in log]
        later = [t for t in times if t > when]
        if not later:
            return None
        firsts.append(min(later))
    return max(firsts) - when


def shm_mapped_after_training(rank: int, directory: str, doomed_rank: int) -> int:
    """train() with `doomed_rank` lost in step 1's exchange; then, the model gone, the bytes of /dev/shm this
    process still maps (/proc/self/maps)."""
    train(rank, directory, doomed_rank, (0, 1), "exchange")
    gc.collect()
    with open("/proc/self/maps") as maps:
        rows = [line.split() for line in maps if "/dev/shm/" in line]
    return sum(int(row[0].split("-")[1], 16) - int(row[0].split("-")[0], 16) for row in rows)

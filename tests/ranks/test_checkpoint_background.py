"""Background saves across ranks (run_ranks, Gloo CPU): exact snapshots, the write spread over the ranks,
staging allocated once, and failures that are typed errors with the previous checkpoint intact.

The reference for "exact" is a synchronous save (async_save=False) of the same state at the same moment:
restored in this process (one rank, no process group), the background checkpoint must equal it
bitwise, however the ranks changed their state after save() returned. The background writer is made
slow (a pause before it reads the staging buffer, patched in before it is forked), so the changes land
before it writes. Single-process behaviour is in tests/unit/test_checkpoint.py, a SIGKILL during a
background write in tests/ranks/test_checkpoint.py.
"""

import os
import signal
import subprocess
import time

import pytest
import torch

import phalanx as px
from phalanx.checkpoint.background import writer
from phalanx.testing import run_ranks
from tests.helpers.system_packages import MOUNT


def make_net():
    torch.manual_seed(0)
    # 512 x 512 fp32 is 1 MiB: its rows are split over the ranks; BatchNorm's buffers move on each rank.
    return torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))


def slow_writer(seconds=0.3):
    """The writer pauses before it reads what was staged (a forked writer inherits the patch)."""
    rebuild = writer.rebuild

    def paused(*args):
        time.sleep(seconds)
        return rebuild(*args)

    writer.rebuild = paused


def build(rank, shard="none"):
    model = px.DistributedDataParallel(make_net(), shard=shard)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch.manual_seed(10 + rank)  # each rank its own data, dropout-free: the averaged gradients agree

    def train():
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, train


def _save_then_change_everything(rank, directory, shard):
    slow_writer()
    model, optimizer, train = build(rank, shard)
    train(), train()
    state = {"model": model, "optimizer": optimizer, "step": 2, "history": [0.5, {"best": 1}],
             "values": torch.arange(4.0)}
    px.Checkpointer(f"{directory}/sync", async_save=False).save(state)  # the reference, written before it returns
    background = px.Checkpointer(f"{directory}/background")
    background.save(state)
    with torch.no_grad():  # every tensor of the state changes before the slowed writer reads any
        for tensor in model.module.state_dict().values():
            tensor.add_(1)
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor):
                    value.add_(1)
    state["values"].add_(1)
    state["history"][1]["best"] = 2
    state["history"].append("later")
    state["step"] = 3
    train()
    torch.rand(3)
    background.wait()
    return [p.name for p in background.directory.iterdir()]


def restored(directory):
    """The checkpoint in `directory` restored in this process: one rank, a plain model and optimizer."""
    net = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    state = {"model": net, "optimizer": optimizer, "step": 0, "history": [], "values": None}
    torch.manual_seed(999)
    assert px.Checkpointer(directory).restore(state)
    return state, torch.get_rng_state()


def assert_same(ours, theirs):
    (state, rng), (expected, expected_rng) = ours, theirs
    assert torch.equal(rng, expected_rng), "rank 0's random state"
    model, reference = state["model"].state_dict(), expected["model"].state_dict()
    assert all(torch.equal(model[k], reference[k]) for k in reference), \
        [k for k in reference if not torch.equal(model[k], reference[k])]
    optimizer, reference = state["optimizer"].state_dict(), expected["optimizer"].state_dict()
    assert optimizer["param_groups"] == reference["param_groups"]
    for index, values in reference["state"].items():
        assert all(torch.equal(values[k], optimizer["state"][index][k]) for k in values), index
    assert state["step"] == 2 and state["history"] == [0.5, {"best": 1}]
    assert torch.equal(state["values"], torch.arange(4.0))


@pytest.mark.smoke
def test_a_background_checkpoint_is_the_state_at_save_spread_over_the_ranks(tmp_path):
    """World size 2 (phalanx DDP, AdamW) saves and changes every tensor at once; 1 rank (this process) restores:
    bitwise the synchronous save of the same moment. Each rank wrote a part."""
    files = run_ranks(_save_then_change_everything, 2, (str(tmp_path), "none"))
    assert_same(restored(tmp_path / "background"), restored(tmp_path / "sync"))
    assert sorted(n for n in files[0] if ".part-" in n) == ["ckpt-00000001.part-00000.pt",
                                                            "ckpt-00000001.part-00001.pt"], files[0]
    sizes = [(tmp_path / "background" / f"ckpt-00000001.part-0000{r}.pt").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.4 * sum(sizes), f"the parts are uneven: {sizes}"
    assert not [n for n in files[0] if n.endswith((".pt.json", ".failed", ".tmp"))], files[0]


def test_a_sharded_level_saves_in_the_background_too(tmp_path):
    """World size 2 at shard="gradients" (the optimizer gathered to rank 0, the parameters spread); 1 rank
    restores: bitwise the synchronous save of the same moment."""
    run_ranks(_save_then_change_everything, 2, (str(tmp_path), "gradients"))
    assert_same(restored(tmp_path / "background"), restored(tmp_path / "sync"))


def _many_saves(rank, directory):
    model, optimizer, train = build(rank)
    train()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    checkpointer = px.Checkpointer(directory, keep=2)
    state_bytes = sum(t.numel() * t.element_size() for t in model.module.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    seen = []
    for step in range(1, 31):
        train()
        state["step"] = step
        checkpointer.save(state)
        saves = checkpointer._background
        fds = len(os.listdir("/proc/self/fd"))
        seen.append((saves.staging.allocations, saves.staging.size, saves.writer.pid, fds))
    checkpointer.wait()
    files = sorted(os.listdir(directory))
    # A process forked since (as a DataLoader worker is) holds the writer's pipe open too: ending the writer
    # must not wait for it.
    holder = os.fork()
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    started = time.monotonic()
    checkpointer._background.close()
    closed_in = time.monotonic() - started
    os.kill(holder, signal.SIGKILL)
    os.waitpid(holder, 0)
    return {"seen": seen, "state_bytes": state_bytes, "files": files, "closed_in": closed_in}


def test_staging_is_allocated_once_and_nothing_grows_over_many_saves(tmp_path):
    """World size 2, 30 saves: one staging buffer of at most 1.1 x the state, one writer, no new descriptors,
    no files beyond keep; the writer ends when asked though a forked child holds its pipe."""
    results = run_ranks(_many_saves, 2, (str(tmp_path),))
    for rank, result in enumerate(results):
        seen = result["seen"]
        assert {s[:3] for s in seen} == {seen[0][:3]}, f"rank {rank}: staging or writer changed: {seen}"
        assert seen[0][0] == 1
        assert seen[0][1] <= 1.1 * result["state_bytes"], (rank, seen[0][1], result["state_bytes"])
        assert seen[-1][3] <= seen[0][3], f"rank {rank}: file descriptors grew {seen[0][3]} -> {seen[-1][3]}"
        assert result["closed_in"] < 30, f"rank {rank}: ending the writer waited for the child holding its pipe"
    # The write is spread: the rank that is not 0 stages about half the state.
    assert results[1]["seen"][0][1] < 0.7 * results[1]["state_bytes"]
    assert results[0]["files"] == ["ckpt-00000029.part-00000.pt", "ckpt-00000029.part-00001.pt", "ckpt-00000029.pt",
                                   "ckpt-00000030.part-00000.pt", "ckpt-00000030.part-00001.pt", "ckpt-00000030.pt",
                                   "manifest.json"]


# -- failures ---------------------------------------------------------------------------------------

def _fails_and_recovers(rank, directory):
    slow_writer()  # the kill below lands while rank 1's writer is at its job
    model, optimizer, train = build(rank)
    train()
    state = {"model": model, "optimizer": optimizer, "step": 1}
    checkpointer = px.Checkpointer(directory, timeout=60)
    checkpointer.save(state)
    checkpointer.wait()
    outcomes = []

    # The disk fills up: rank 0's file (a large plain value) does not fit in the tmpfs.
    state["step"], state["blob"] = 2, torch.zeros(4 << 20)
    checkpointer.save(state)
    try:
        checkpointer.wait()
        outcomes.append(None)
    except px.CheckpointWriteError as exc:
        outcomes.append(str(exc))
    del state["blob"]

    # A writer dies mid-write (rank 1's, SIGKILL): every rank's next wait() says so, none hangs.
    state["step"] = 3
    checkpointer.save(state)
    if rank == 1:
        os.kill(checkpointer._background.writer.pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        checkpointer.wait()
        outcomes.append(None)
    except px.CheckpointWriteError as exc:
        outcomes.append(str(exc))
    took = time.monotonic() - started

    fresh = {"model": model, "optimizer": optimizer, "step": 0}
    checkpointer.restore(fresh)
    restored_step = fresh["step"]
    fresh["step"] = 4  # and the next save works again, with a new writer
    checkpointer.save(fresh)
    checkpointer.wait()
    return outcomes, took, restored_step, [p.name for p in checkpointer.checkpoints()]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs mounted for this test (root only): room for a few checkpoints of 3.3 MB, not for 16 MB more."""
    MOUNT.require()
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.waiting(seconds=7)  # a bound on how long a rank waits for a dead writer's part
def test_a_full_disk_and_a_dead_writer_are_typed_errors_and_the_previous_checkpoint_stays(small_disk):
    """World size 2 on a 16 MB tmpfs: rank 0's write runs out of space, then rank 1's writer is SIGKILLed
    mid-write; every rank raises CheckpointWriteError at wait() (naming the path and the cause), the newest
    checkpoint stays the complete one before, and the next save works."""
    results = run_ranks(_fails_and_recovers, 2, (str(small_disk / "run"),), timeout=180)
    for rank, (outcomes, took, restored_step, kept) in enumerate(results):
        full, killed = outcomes
        assert full is not None and ("could not write" in full or "background write" in full), (rank, full)
        assert killed is not None, rank
        assert took < 30, f"rank {rank} waited {took:.1f} s for a dead writer's part"
        assert restored_step == 1, rank
        assert kept == ["ckpt-00000001.pt", "ckpt-00000004.pt"], kept
    full, killed = results[0][0]
    assert "No space left on device" in full and str(small_disk / "run") in full, full
    assert "killed by signal SIGKILL" in results[1][0][1], results[1][0][1]
    assert "rank 1 could not write" in results[0][0][1], results[0][0][1]

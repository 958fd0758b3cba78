"""Checkpointer across processes: ranks (Gloo CPU processes via phalanx.testing.run_ranks), and a
process killed in the middle of a save.

Per-rank random states, the agreement on which file to resume from, DDP-wrapped vs plain models,
a failed write on rank 0, a world size that changes between save and restore, and a SIGKILL
during a save. The single-process tests are in tests/unit/test_checkpoint.py.
"""

import random
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.errors import RankFailedError
from phalanx.testing import run_ranks
from tests.conftest import warnings_of
from tests.helpers.checkpoint_state import make_state, save_and_die


def make_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))


def draws():
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


class Position:
    """A stand-in for a resumable loader: its state says how far it got and for how many ranks."""

    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"epoch": 1, "consumed": 3, "num_replicas": dist.get_world_size()}

    def load_state_dict(self, state):
        self.loaded = state


def save_with_distinct_streams(rank, directory):
    torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
    state = {"loader": Position(), "step": 5}
    px.Checkpointer(directory).save(state)
    return draws()


def restore_and_draw(rank, directory):
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    state = {"loader": Position(), "step": 0}
    ckpt = px.Checkpointer(directory)
    assert ckpt.restore(state)
    return {"draws": draws(), "step": state["step"], "loader": state["loader"].loaded,
            "saved_world_size": ckpt.saved_world_size}


@pytest.mark.smoke
def test_each_rank_resumes_its_own_random_streams_and_world_size_may_change(tmp_path):
    """World size 2 saves; 1 rank (this process, no process group), then 3 ranks restore."""
    after_save = run_ranks(save_with_distinct_streams, 2, args=(str(tmp_path),))
    assert after_save[0] != after_save[1]

    fewer = [restore_and_draw(0, str(tmp_path))]
    assert fewer[0]["draws"] == after_save[0]
    assert fewer[0]["loader"] == {"epoch": 1, "consumed": 3, "num_replicas": 2}

    more = run_ranks(restore_and_draw, 3, args=(str(tmp_path),))
    assert [r["draws"] for r in more[:2]] == after_save
    assert more[2]["draws"] not in after_save  # a stream of its own, not a copy of rank 0's
    assert all(r["step"] == 5 and r["saved_world_size"] == 2 for r in more)


def ddp_saves_and_restores(rank, directory):
    """Save from torch's DDP into ddp/, then restore the plain model saved in plain/ into a DDP model."""
    model = torch.nn.parallel.DistributedDataParallel(make_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    px.Checkpointer(f"{directory}/ddp").save({"model": model, "optimizer": opt})
    saved = [p.detach().clone() for p in model.module.parameters()]

    model = torch.nn.parallel.DistributedDataParallel(make_net(seed=9))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert px.Checkpointer(f"{directory}/plain").restore({"model": model, "optimizer": opt})
    return saved, [p.detach() for p in model.module.parameters()]


def test_ddp_wrapped_and_plain_models_load_each_others_checkpoints(tmp_path):
    """World size 2 with torch's DDP, and a single process with the plain model."""
    plain_state = {"model": make_net(seed=3), "optimizer": torch.optim.SGD(make_net().parameters(), lr=0.1)}
    plain_saver = px.Checkpointer(tmp_path / "plain")
    plain_saver.save(plain_state)
    plain_saver.wait()  # written in the background: the ranks, other processes, read it next

    results = run_ranks(ddp_saves_and_restores, 2, args=(str(tmp_path),))
    for _, restored in results:
        assert all(torch.equal(a, b) for a, b in zip(restored, plain_state["model"].parameters()))

    plain = make_net(seed=5)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert px.Checkpointer(tmp_path / "ddp").restore({"model": plain, "optimizer": opt})
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), results[0][0]))
    saved_keys = torch.load(px.Checkpointer(tmp_path / "ddp").checkpoints()[-1], weights_only=True)["entries"]["model"]
    assert list(saved_keys["state"]) == list(plain.state_dict())  # no "module." prefix


def ranks_agree_on_fallback_and_survive_a_failed_write(rank, directory):
    state = {"model": make_net(), "step": 0}
    ckpt = px.Checkpointer(directory)
    for _ in range(2):
        state["step"] += 1
        ckpt.save(state)
    if rank == 0:  # only rank 0 looks at the files: the others must follow its choice
        latest = ckpt.checkpoints()[-1]
        latest.write_bytes(latest.read_bytes()[:300])
    px.barrier(60)
    state["step"] = 0
    assert ckpt.restore(state)
    restored_step = state["step"]

    blocked = px.Checkpointer(f"{directory}/manifest.json/cannot-be-a-directory")
    try:
        blocked.save(state)
        failure = None
    except px.CheckpointWriteError as exc:
        failure = str(exc)
    return restored_step, failure


def test_ranks_follow_rank0_fallback_and_all_raise_when_rank0_cannot_write(tmp_path):
    """World size 2: a truncated latest file seen by rank 0 only; then a directory rank 0 cannot create."""
    results = run_ranks(ranks_agree_on_fallback_and_survive_a_failed_write, 2, args=(str(tmp_path),))
    assert [step for step, _ in results] == [1, 1]
    assert "NotADirectoryError" in results[0][1] or "FileExistsError" in results[0][1]
    assert "rank 0 could not write" in results[1][1]


# -- a process killed during a save --------------------------------------------------------------------

class TestCrashDuringSave:
    # The process that saves forks from the fork server of this test's process (phalanx.spawn), which has
    # imported torch: a fresh interpreter per case cost ~6 s of CPU. The synchronous save is killed at one point.
    @pytest.mark.parametrize("where, mode", [("mid_write", "background"), ("before_rename", "background"),
                                             ("before_manifest_rename", "background"), ("mid_write", "sync")])
    def test_sigkill_during_save_leaves_the_previous_checkpoint(self, tmp_path, where, mode, log_records):
        """World size 1, no process group: a child process saves, and is SIGKILLed in the middle of its second
        save (in the background: while its writer writes); this process then restores the first checkpoint and
        saves over the debris."""
        directory = tmp_path / "run"
        with pytest.raises(RankFailedError) as crashed:
            px.spawn(save_and_die, 1, (where, str(directory), mode == "background"), init=False, timeout=120,
                     env={"OMP_NUM_THREADS": "1"}, start_method="forkserver")
        assert crashed.value.exitcode == -signal.SIGKILL, str(crashed.value)
        if where != "before_manifest_rename":
            assert list(directory.glob(".ckpt-00000002.pt.*.tmp")), "the crash left no partial file behind"

        state = make_state(hidden=256)
        assert px.Checkpointer(directory).restore(state) is True
        assert state["step"] == 1
        assert not warnings_of(log_records)
        # The next save replaces the debris of the crashed one.
        ckpt = px.Checkpointer(directory)
        ckpt.save(state)
        ckpt.wait()
        assert not list(directory.glob(".*.tmp"))
        kept = [p.name for p in px.Checkpointer(directory).checkpoints()]
        assert kept[0] == "ckpt-00000001.pt" and len(kept) == 2
        assert sorted(p.name for p in directory.glob("ckpt-*.pt")) == kept

"""User errors raise typed exceptions that name the rank, the parameter or step, and the fix.

World size 2: different models on two ranks, an unused parameter without find_unused_parameters,
a module without trainable parameters, and uneven inputs without join() (one rank leaves, or stays
alive elsewhere) -- the last must fail within a bounded time, never hang or mix up collectives.
"""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx import world
from phalanx.errors import NoTrainableParametersError, ParameterMismatchError, UnevenInputsError, UnusedParameterError
from phalanx.testing import run_ranks


def _caught(fn):
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "is_runtime": isinstance(exc, RuntimeError),
                **{k: getattr(exc, k) for k in ("name", "ranks", "names", "step", "missing_ranks") if hasattr(exc, k)}}
    return None


class WithIdle(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.idle = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _user_errors(rank: int) -> dict:
    out = {}
    out["mismatch"] = _caught(lambda: phalanx.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 5 if rank == 1 else 4))))
    out["frozen"] = _caught(lambda: phalanx.DistributedDataParallel(nn.Linear(3, 3).requires_grad_(False)))

    model = phalanx.DistributedDataParallel(WithIdle())
    model(torch.randn(2, 4)).sum().backward()
    out["unused_next_forward"] = _caught(lambda: model(torch.randn(2, 4)))

    # The errors above leave the process group usable: a correct model trains afterwards.
    ok = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2), nn.Linear(2, 1)))
    # An uneven number of evaluation forwards (grad enabled, no backward) issues no collective and
    # must not put the ranks out of step for the training that follows.
    ok.eval()
    for _ in range(2 + rank):
        ok(torch.randn(2, 4))
    ok.train()
    for _ in range(2):
        ok.zero_grad()
        ok(torch.randn(3, 4)).square().mean().backward()
    out["after_errors_grad"] = ok.module[0].weight.grad.tolist()
    return out


@pytest.fixture(scope="module")
def errors():
    return run_ranks(_user_errors, 2, timeout=120)


def test_different_models_name_the_parameter_and_ranks(errors):
    """World size 2: rank 1's last layer has another shape."""
    for rank, per_rank in enumerate(errors):
        caught = per_rank["mismatch"]
        assert caught["type"] == ParameterMismatchError.__name__
        assert caught["name"] == "2.weight" and caught["ranks"] == [1]
        assert "'2.weight'" in caught["message"] and "(5, 4)" in caught["message"] and "(4, 4)" in caught["message"]
        assert f"[rank {rank}]" in caught["message"]


def test_module_without_trainable_parameters_is_a_runtime_error(errors):
    """World size 2."""
    caught = errors[0]["frozen"]
    assert caught["type"] == NoTrainableParametersError.__name__ and caught["is_runtime"]
    assert "requires_grad" in caught["message"]


def test_unused_parameter_without_flag_fails_at_next_forward_naming_it(errors):
    """World size 2."""
    for per_rank in errors:
        caught = per_rank["unused_next_forward"]
        assert caught["type"] == UnusedParameterError.__name__
        assert caught["names"] == ["idle.weight", "idle.bias"]
        assert "find_unused_parameters=True" in caught["message"] and "idle.weight" in caught["message"]


def test_process_group_still_works_after_errors_and_uneven_evaluation(errors):
    # Both ranks got through the same synchronized steps and hold the same averaged gradient.
    """World size 2."""
    assert errors[0]["after_errors_grad"] == errors[1]["after_errors_grad"]
    assert any(value != 0.0 for row in errors[0]["after_errors_grad"] for value in row)


# -- uneven inputs without join() ------------------------------------------------------------------

def _train_uneven(rank: int, model, batches: int) -> dict | None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.monotonic()
    for step in range(batches):
        try:
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 2)).backward()
            opt.step()
        except UnevenInputsError as exc:
            return {"message": str(exc), "step": exc.step, "missing": exc.missing_ranks, "at_batch": step,
                    "seconds": time.monotonic() - start}
    return None


def _uneven_rank0_leaves(rank: int):
    # BatchNorm: the first collective of the step rank 0 skips is the buffer broadcast in forward.
    model = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)))
    return _train_uneven(rank, model, 3 if rank == 0 else 5)  # rank 0 returns: its process exits


def _uneven_rank0_waits(rank: int):
    # Rank 0 stays alive but away from DDP (here: waiting on the store), so rank 1's gradient
    # all-reduce of step 4 stalls until PHALANX_DDP_STALL_TIMEOUT.
    model = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    outcome = _train_uneven(rank, model, 3 if rank == 0 else 5)
    store = world.store()
    if rank == 0:
        store.wait(["rank1-done"])
    else:
        store.set("rank1-done", b"1")
    return outcome


@pytest.mark.parametrize("scenario", [_uneven_rank0_leaves, _uneven_rank0_waits], ids=["leaves", "stays"])
def test_uneven_inputs_without_join_fail_with_rank_and_step(scenario):
    """World size 2: rank 0 has 3 batches, rank 1 has 5 (PHALANX_DDP_STALL_TIMEOUT=4)."""
    rank0, rank1 = run_ranks(scenario, 2, timeout=90, env={"PHALANX_DDP_STALL_TIMEOUT": "4"})
    assert rank0 is None, "rank 0 finished its 3 batches normally"
    assert rank1 is not None, "rank 1 must get an error instead of hanging"
    assert rank1["at_batch"] == 3 and rank1["step"] == 4
    assert rank1["missing"] == [0]
    assert "ranks [0] did not take part" in rank1["message"] and "step 4" in rank1["message"]
    assert "join()" in rank1["message"]

"""The replica audit and the non-finite gradient check (engine/replicas/), the scenarios of issue 54.

A corrupted element: at step 50 the loop changes one element on rank 1 by 1e-3 (a stand-in for a flipped bit);
with audit_every=10 the audit after step 60 names rank 1, the entry, and the window (all agreed at step 50).
On 3 ranks it heals from the majority and every rank ends bitwise equal; on 2 it stops with
ReplicaMismatchError naming both ranks, and the next restore picks the checkpoint saved before the last
agreement. The same in an optimizer state shard (shard="optimizer", live recovery's copies). A NaN: one rank's
loss is made NaN at step 8 of 12; every rank raises NonFiniteGradientError naming it before any applies the
step, or (on_nonfinite="skip") every rank skips it and the StepLog counts it. Healthy runs with the audit at
every step (a comm hook, join() with uneven batches, the sharded levels) report nothing.

Each world size is one launch, its scenarios run one after another in the same ranks.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.checkpoint import atomic_files
from phalanx.testing import run_ranks
from phalanx.world import generation

CORRUPT_AT, AUDIT_EVERY, STEPS = 50, 10, 70
NAN_AT, NAN_STEPS = 8, 12


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(2, generator=g)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank, world, directory=None, *, shard="none", corrupt=None, steps=STEPS, micro=1, nan_at=None,
           log_dir=None, **options):
    """The documented loop on a global batch; `corrupt`: "param" or "state" changes one element on rank 1 after
    step CORRUPT_AT; `nan_at`: rank 2's loss (of its first micro-batch) is NaN at that step."""
    net = _net()
    model = px.DistributedDataParallel(net, shard=shard, **options)
    optimizer = model.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = _Data()
    loader = px.DataLoader(data, batch_size=4, global_batch_size=4 * micro * world,
                           sampler=px.DistributedSampler(data, seed=0))
    checkpointer = px.Checkpointer(directory, keep=2, every=5) if directory else None
    steplog = px.StepLog(log_dir, every=4, print_every=0, tensorboard=False) if log_dir else None
    warnings = _Warnings()
    logging.getLogger("phalanx").addHandler(warnings)
    out = {"error": None, "before_nan": None, "after_nan": None}
    try:
        for number, step in enumerate(loader, start=1):
            optimizer.zero_grad()
            for j, (x, y) in enumerate(step.micro_batches(model)):
                loss = F.mse_loss(model(x), y)
                if number == nan_at and rank == 2 and j == 0:
                    loss = loss * float("nan")
                step.backward(loss)
            if number == nan_at:
                out["before_nan"] = [p.detach().clone() for p in net.parameters()]
            optimizer.step()
            if number == nan_at:
                out["after_nan"] = [p.detach().clone() for p in net.parameters()]
            if number == CORRUPT_AT and rank == 1 and corrupt:
                with torch.no_grad():
                    if corrupt == "param":
                        net[0].weight[0, 0] += 1e-3
                    else:
                        next(s for s in optimizer.state.values() if s)["exp_avg"].view(-1)[0] += 1e-3
            if steplog is not None:
                steplog.step(loss.detach(), samples=len(x))
            if checkpointer is not None:
                checkpointer.step({"model": model, "optimizer": optimizer})
            if number == steps:
                break
    except (px.ReplicaMismatchError, px.NonFiniteGradientError) as error:
        out["error"] = {"type": type(error).__name__, "text": str(error), **{k: v for k, v in vars(error).items()}}
        out["after_nan"] = out["after_nan"] or [p.detach().clone() for p in net.parameters()]
    finally:
        logging.getLogger("phalanx").removeHandler(warnings)
    if checkpointer is not None:
        checkpointer.wait()
    if steplog is not None:
        steplog.close()
    out["warnings"] = warnings.lines
    out["params"] = [p.detach().clone() for p in net.parameters()]
    return out


def _three_ranks(rank, tmp):
    generation.say_mode(True, "the test's loop is a global batch's")
    return {
        "param": _train(rank, 3, os.path.join(tmp, "param"), corrupt="param", audit_every=AUDIT_EVERY),
        "state": _train(rank, 3, shard="optimizer", corrupt="state", audit_every=AUDIT_EVERY),
        "reference": _train(rank, 3, shard="optimizer", audit_every=AUDIT_EVERY),
        "raise": _train(rank, 3, corrupt="param", audit_every=AUDIT_EVERY, audit="raise"),
        "nan_raise": _train(rank, 3, steps=NAN_STEPS, micro=2, nan_at=NAN_AT),
        "nan_skip": _train(rank, 3, steps=NAN_STEPS, micro=2, nan_at=NAN_AT, on_nonfinite="skip",
                           log_dir=os.path.join(tmp, "steplog")),
        "healthy_gradients": _train(rank, 3, shard="gradients", steps=12, audit_every=1),
    }


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("audit3"))
    return run_ranks(_three_ranks, 3, (tmp,), min_world_size=2, timeout=300), tmp


def _equal_everywhere(results, scenario) -> bool:
    first = results[0][scenario]["params"]
    return all(all(torch.equal(a, b) for a, b in zip(first, r[scenario]["params"])) for r in results)


def test_a_corrupted_parameter_is_named_and_healed_from_the_majority(three):
    """World size 3: rank 1's '0.weight'[0, 0] off by 1e-3 after step 50; found at the audit after step 60, healed
    from rank 0; every rank's parameters bitwise equal at the end; no error."""
    results, tmp = three
    assert all(r["param"]["error"] is None for r in results)
    [warning] = [line for line in results[0]["param"]["warnings"] if "replica audit" in line]
    assert "rank 1 differs from ranks [0, 2] at parameter '0.weight' element (0, 0)" in warning, warning
    assert "after step 60" in warning and "all agreed at step 50" in warning and "healed from rank 0" in warning
    assert _equal_everywhere(results, "param")


def test_the_checkpoints_saved_since_the_last_agreement_are_set_aside(three):
    """World size 3: saves every 5 steps; those of steps 50 and 55 came after the audit of step 50 and before the
    one that found rank 1 apart: renamed *.suspect and out of the manifest (the run then went on, healed, and
    saved again)."""
    _, tmp = three
    names = set(os.listdir(os.path.join(tmp, "param")))
    assert {"ckpt-00000010.pt.suspect", "ckpt-00000011.pt.suspect"} <= names, names  # steps 50, 55
    listed = [e.sequence for e in atomic_files.read_manifest(Path(tmp) / "param")]
    assert 10 not in listed and 11 not in listed and listed[-1] == 14, listed  # step 70's save is the newest


def test_a_changed_optimizer_state_shard_is_named_and_put_back(three):
    """World size 3, shard="optimizer" with live recovery's copies: rank 1's 'exp_avg' of one element changed
    after step 50 is found before step 51 reads it, put back from the copy its keeper holds, and reported at the
    audit after step 60; the run ends bitwise where the run without the change ends, on every rank."""
    results, _ = three
    [warning] = [line for line in results[0]["state"]["warnings"] if "replica audit" in line]
    assert "rank 1's optimizer state 'exp_avg' of '0.weight'" in warning, warning
    assert "changed between steps 50 and 51" in warning and "put back from the copy its keeper holds" in warning
    assert "after step 60" in warning and "all agreed at step 50" in warning
    assert _equal_everywhere(results, "state")
    assert all(torch.equal(a, b) for a, b in zip(results[0]["state"]["params"], results[0]["reference"]["params"]))
    assert not [line for r in results for line in r["reference"]["warnings"] if "replica audit" in line]


def test_audit_raise_stops_instead_of_healing(three):
    """World size 3, audit="raise": every rank raises ReplicaMismatchError naming rank 1, the sides, the
    step found (60) and the last agreement (50)."""
    results, _ = three
    for r in results:
        error = r["raise"]["error"]
        assert error["type"] == "ReplicaMismatchError"
        assert error["ranks"] == [1] and error["sides"] == [[0, 2], [1]]
        assert error["step"] == 60 and error["agreed_at"] == 50
        assert "parameter '0.weight'" in error["text"] and "audit='raise'" in error["text"]


def test_a_nan_is_named_before_any_rank_applies_the_step(three):
    """World size 3: rank 2's loss is NaN at step 8 (its first of 2 micro-batches); every rank raises
    NonFiniteGradientError naming rank 2, step 8, the micro-batches and the first parameter, from the optimizer's
    step, before it changed anything."""
    results, _ = three
    for r in results:
        error = r["nan_raise"]["error"]
        assert error["type"] == "NonFiniteGradientError", error
        assert error["ranks"] == [2] and error["step"] == NAN_AT and error["parameter"] == "0.weight"
        assert "micro-batches 0-1" in error["text"]
        assert all(torch.equal(a, b) for a, b in zip(r["nan_raise"]["before_nan"], r["nan_raise"]["after_nan"]))


def test_on_nonfinite_skip_skips_the_step_on_every_rank_and_counts_it(three):
    """World size 3, on_nonfinite="skip": the run finishes; step 8 left every rank's parameters as they were;
    replicas equal and finite at the end; the StepLog's record of steps 5-8 counts one skipped step."""
    results, tmp = three
    for r in results:
        skip = r["nan_skip"]
        assert skip["error"] is None
        assert all(torch.equal(a, b) for a, b in zip(skip["before_nan"], skip["after_nan"]))
        assert all(torch.isfinite(p).all() for p in skip["params"])
    assert _equal_everywhere(results, "nan_skip")
    with open(os.path.join(tmp, "steplog", "steps.jsonl")) as records:
        skipped = {record["step"]: record["skipped_steps"] for record in map(json.loads, records)}
    assert skipped == {4: 0, 8: 1, 12: 0}, skipped
    assert any("step 8 skipped on every rank: rank(s) [2]" in line for line in results[0]["nan_skip"]["warnings"])


def test_healthy_runs_report_nothing(three):
    """World size 3: shard="gradients" audited at every step reports nothing."""
    results, _ = three
    assert all(r["healthy_gradients"]["error"] is None and not r["healthy_gradients"]["warnings"] for r in results)
    assert _equal_everywhere(results, "healthy_gradients")


def _joined_then_more(rank, bf16_hook):
    """join() with uneven batches and momentum, audited at every step; then 3 more steps together."""
    torch.manual_seed(0)
    model = px.DistributedDataParallel(_net(), audit_every=1)
    if bf16_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    with model.join():
        for _ in range(3 + 2 * rank):
            optimizer.zero_grad()
            F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
            optimizer.step()
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 2)).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _one_nan_element(rank, transport, element):
    """One step; rank 1's gradient of '2.weight' (512 x 256) gets a NaN at `element`; the error each rank raises,
    and how the bucket was exchanged."""
    if transport == "gloo":
        os.environ["PHALANX_SHM"] = "0"
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                  torch.nn.Linear(512, 2))
        model = px.DistributedDataParallel(net)
    finally:
        os.environ.pop("PHALANX_SHM", None)
    exchange = model._reducer.exchange
    how = sorted(set(exchange.modes)) if hasattr(exchange, "modes") else [type(exchange).__name__]

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[element] = float("nan")
        return grad
    if rank == 1:
        net[2].weight.register_hook(poison)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    try:
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        optimizer.step()
        error = None
    except px.NonFiniteGradientError as caught:
        error = {"ranks": caught.ranks, "parameter": caught.parameter, "step": caught.step}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    return {"how": how, "error": error, "unchanged": unchanged}


def _verdict_by_collective(rank, transport) -> bool:
    """One healthy backward: whether the check's verdict needed an all-reduce of its own, or came with the
    exchange (Gloo's all-reduce: the buckets' summed tags; the split shared-memory exchange: its stamps)."""
    if transport == "gloo":
        os.environ["PHALANX_SHM"] = "0"
    try:
        torch.manual_seed(0)
        model = px.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(),
                                                               torch.nn.Linear(256, 512), torch.nn.Linear(512, 2)))
    finally:
        os.environ.pop("PHALANX_SHM", None)
    F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
    verdict = model._audit.check._verdicts[-1]
    return verdict.work is not None


def _two_ranks(rank, tmp):
    out = {"param": _train(rank, 2, os.path.join(tmp, "param"), corrupt="param", audit_every=AUDIT_EVERY)}
    checkpointer = px.Checkpointer(os.path.join(tmp, "param"))
    out["restored"] = checkpointer.restore({"model": _net(), "optimizer": torch.optim.AdamW(_net().parameters())})
    out["restored_step"] = checkpointer.steps
    del checkpointer  # the runs below start at step 0 again (a restored step holds while its Checkpointer lives)
    out["join"] = _joined_then_more(rank, False)
    out["join_bf16"] = _joined_then_more(rank, True)
    last = 512 * 256 - 1
    out["nan"] = {(transport, element): _one_nan_element(rank, transport, element)
                  for transport in ("shm", "gloo") for element in (0, last)}
    out["by_collective"] = {transport: _verdict_by_collective(rank, transport) for transport in ("shm", "gloo")}
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("audit2"))
    return run_ranks(_two_ranks, 2, (tmp,), timeout=300)


def test_two_ranks_stop_with_an_error_naming_both(two):
    """World size 2: the same corruption has no majority: every rank raises ReplicaMismatchError naming rank 0
    and rank 1, found after step 60, all agreed at step 50."""
    for r in two:
        error = r["param"]["error"]
        assert error["type"] == "ReplicaMismatchError"
        assert error["ranks"] == [0, 1] and error["sides"] == [[0], [1]]
        assert error["step"] == 60 and error["agreed_at"] == 50
        assert "rank 0 and rank 1 hold different values of parameter '0.weight' element (0, 0)" in error["text"]
        assert "no majority" in error["text"]


def test_after_a_stop_the_restore_picks_the_checkpoint_of_the_last_agreement(two):
    """World size 2: the saves of steps 50 and 55 are set aside; restore() picks step 45's, the newest saved
    before the audit that last agreed (step 50)."""
    for r in two:
        assert r["restored"] and r["restored_step"] == 45


def test_join_with_uneven_batches_and_a_comm_hook_leave_the_replicas_agreeing(two):
    """World size 2: audited at every step through join() (rank 1 has more batches; the last to finish hands
    its optimizer state over with its model) and after it, with and without a bf16 comm hook: no report, and
    the replicas end bitwise equal."""
    for scenario in ("join", "join_bf16"):
        assert all(torch.equal(a, b) for a, b in zip(two[0][scenario], two[1][scenario]))


def test_one_nan_element_is_found_on_every_path_of_the_exchange(two):
    """World size 2: a NaN in one element of rank 1's gradient, in the chunk rank 0 sums and in the one rank 1
    sums of the split shared-memory exchange (the check rides along its copies), and over Gloo (a sum per
    bucket): every rank raises naming rank 1 and '2.weight', and no parameter changed."""
    for r in two:
        for (transport, element), seen in r["nan"].items():
            assert seen["how"] == (["split"] if transport == "shm" else ["AllReduceExchange"]), seen
            assert seen["error"] == {"ranks": [1], "parameter": "2.weight", "step": 1}, (transport, element, seen)
            assert seen["unchanged"], (transport, element)


def test_the_verdict_rides_with_the_exchange(two):
    """Over Gloo's all-reduce every rank reads each bucket's summed step tag, where a rank that saw a NaN wrote
    NaN; over the split shared-memory exchange every rank reads every rank's stamp: the check issues no
    collective of its own on either."""
    for r in two:
        assert r["by_collective"] == {"shm": False, "gloo": False}, r["by_collective"]


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                               reason="needs a CUDA GPU and NCCL")


def _on_the_gpu(rank):
    device = px.device()
    out = {}
    for mode in ("raise", "skip"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(device)
        model = px.DistributedDataParallel(net, device_ids=[device.index], on_nonfinite=mode, audit_every=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator(device=device).manual_seed(0)
        seen = None
        for step in range(1, 7):
            optimizer.zero_grad()
            loss = F.mse_loss(model(torch.randn(4, 8, device=device, generator=g)), torch.zeros(4, 2, device=device))
            (loss * float("nan") if step == 3 else loss).backward()
            torch.cuda.synchronize(device)  # so that a verdict read late is there at the next step, deterministically
            try:
                optimizer.step()
            except px.NonFiniteGradientError as error:
                seen = (error.ranks, error.step, error.parameter, step)
                break
        out[mode] = {"seen": seen, "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()),
                     "fingerprints": model._audit._row(model).device.type}
    return out


@needs_gpu
def test_on_a_gpu_a_nan_is_named_or_skipped_and_the_audit_fingerprints_there():
    """World size 1 (NCCL); skipped without a GPU. on_nonfinite="raise" reads the verdict once it is on the host,
    never waiting for the device; the loop here waits for the backward itself, so the verdict of step 3 is there
    before its optimizer step, which raises; "skip" reads it before the step, waiting: step 3 skipped. The
    parameters stay finite either way."""
    [out] = px.spawn(_on_the_gpu, 1, timeout=300, env={"PHALANX_BACKEND": "nccl"})
    assert out["raise"]["seen"] == ([0], 3, "0.weight", 3) and out["raise"]["finite"]
    assert out["skip"]["seen"] is None and out["skip"]["finite"]
    assert out["raise"]["fingerprints"] == "cuda"

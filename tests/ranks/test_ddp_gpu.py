"""NCCL on CUDA tensors: phalanx DDP equals torch DDP and keeps replicas identical.

Runs one rank per visible GPU (at most 2); skipped where there is no GPU or no NCCL.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs a CUDA GPU and NCCL")


def _cuda_versus_torch(rank: int) -> dict:
    device = phalanx.device()
    results = {}
    for wrapper in (phalanx.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8)).to(device)
        model = wrapper(net, device_ids=[device.index], bucket_cap_mb=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        identical = True
        for step in range(8):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)  # inputs move to device_ids[0]
            F.mse_loss(out.float(), y.to(device)).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            reference = flat.clone()
            dist.broadcast(reference, 0)
            identical &= bool(torch.equal(flat, reference))
        results[wrapper.__module__] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu(), identical)
    ours, theirs = results["phalanx.engine.ddp"], results["torch.nn.parallel.distributed"]
    return {"diff": (ours[0] - theirs[0]).abs().max().item(), "identical": ours[1]}


def test_nccl_phalanx_matches_torch_ddp():
    """World size: one rank per visible GPU, at most 2 (NCCL); skipped without a GPU."""
    world = min(2, torch.cuda.device_count())
    results = phalanx.spawn(_cuda_versus_torch, world, timeout=300, env={"PHALANX_BACKEND": "nccl"})
    for outcome in results:
        assert outcome["identical"]
        assert outcome["diff"] < 1e-5


def _train_on_cuda(rank: int, directory: str, until: int, stop: bool) -> dict:
    """The documented loop on CUDA with a StepLog not in the checkpoint's state and background saves every 3 steps:
    resume from the newest checkpoint, train until step `until`; `stop`: save and close there, else end as a kill
    would (nothing flushed). Returns the state's bytes right after the restore and at each step (as saved)."""
    from pathlib import Path

    from tests.helpers.global_batch_cases import GLOBAL_BATCH, MICRO_BATCH, SEED, Indexed, make_model

    device = phalanx.device()
    dataset = Indexed()
    loader = phalanx.DataLoader(dataset, batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                                sampler=phalanx.DistributedSampler(dataset, seed=SEED))
    model = phalanx.DistributedDataParallel(make_model(16).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    checkpointer = phalanx.Checkpointer(Path(directory) / "ckpt", every=3)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    log = phalanx.StepLog(Path(directory) / "log", every=2, print_every=0, tensorboard=False)

    def snapshot():
        optimizer_state = optimizer.state_dict()["state"]
        return {"model": {k: v.cpu().clone() for k, v in model.state_dict().items()},
                "optimizer": {k: {n: t.cpu().clone() for n, t in s.items()} for k, s in optimizer_state.items()},
                "loader": loader.state_dict(), "cpu_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}

    checkpointer.restore(state)
    restored, at_step = (checkpointer.steps, snapshot()), {}
    assert (rank, phalanx.world_size(), phalanx.is_main(), log.steps) == (0, 1, True, checkpointer.steps)
    for epoch in range(loader.state_dict()["epoch"], 10):
        loader.set_epoch(epoch)
        for step in loader:
            optimizer.zero_grad()
            for _, x, y in step.micro_batches(model):
                step.backward(F.mse_loss(model(x.to(device)), y.to(device)))
            optimizer.step()
            log.step(step.loss, samples=step.samples)
            at_step[checkpointer.steps + 1] = snapshot()
            checkpointer.step(state)
            if checkpointer.steps == until:
                break
        if checkpointer.steps == until:
            break
    if stop:
        checkpointer.save(state)
        log.close()
    checkpointer.wait()
    log._closed = True  # a kill writes nothing more
    return {"restored": restored, "at_step": at_step}


def test_a_resumed_cuda_run_restores_its_state_bitwise_and_logs_every_step_once(tmp_path):
    """World size 1 on NCCL: killed at step 7 (saved at 6), resumed to 12: the restored state (model, AdamW state,
    loader position, CPU and CUDA random streams) is bitwise the state at step 6, and the StepLog, not in the state,
    has every step in one record."""
    import json

    first = phalanx.spawn(_train_on_cuda, 1, (str(tmp_path), 7, False), timeout=300,
                          env={"PHALANX_BACKEND": "nccl"})[0]
    second = phalanx.spawn(_train_on_cuda, 1, (str(tmp_path), 12, True), timeout=300,
                           env={"PHALANX_BACKEND": "nccl"})[0]
    step, restored = second["restored"]
    assert step == 6

    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    assert same(restored, first["at_step"][6])
    records = [json.loads(line) for line in (tmp_path / "log" / "steps.jsonl").read_text().splitlines()]
    covered = [s for record in records for s in range(record["step"] - record["steps"] + 1, record["step"] + 1)]
    assert covered == list(range(1, 13)), [(record["step"], record["steps"]) for record in records]

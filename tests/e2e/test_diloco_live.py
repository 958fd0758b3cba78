"""across_hosts=px.DiLoCo(every=4) under live recovery: a host lost in mid-period, a host that joins.

Each rank is an emulated host (GROUP_RANK, the launcher's node rank), run in a fork of this process's fork server
(tests/helpers/forked_python.py) with the run's store at 127.0.0.1, as a launcher's workers are
(tests/e2e/jobs/diloco_live_job.py). The final parameters equal a one-process reference that replays each host's
inner steps on the samples it logged and, every 4 steps, the Nesterov outer step over the hosts that made that step:
a host lost in mid-period takes its progress since the last outer step with it, and the next outer step averages
over the hosts left; a host taken in starts from the synced parameters (with the first host's inner optimizer
state, handed over whole), and after the next outer step every replica is the same.
"""

from __future__ import annotations

import copy
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.engine.diloco.fragments import due, split
from phalanx.testing import free_port
from phalanx.world import joining
from tests.conftest import ROOT
from tests.e2e.jobs.diloco_live_job import EVERY, LR, MOMENTUM, make_model, sample
from tests.helpers.forked_python import start_python

JOB = str(Path(__file__).resolve().parent / "jobs" / "diloco_live_job.py")
ATTEMPT = "diloco-live-test"


def _start(env: dict, rank: int, world_size: int, directory: Path, extra: list, local: int = 1, **more):
    env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local),
           "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(rank // local), **more}  # `local` ranks per host
    return start_python([JOB, str(directory), *extra], cwd=ROOT, env=env, log=directory / f"log-{rank}.txt")


def _run(tmp_path: Path, ranks: int, extra: dict, joiner: bool = False, joiner_after: int = 1, local: int = 1) -> list:
    """`ranks` ranks train, `local` a host (rank r with extra.get(r, [])); with `joiner`, one more starts as a joiner
    (a host of its own) once rank 0 made `joiner_after` steps. Returns every process's exit code."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PHALANX_MIN_WORLD_SIZE": "1",
           "PHALANX_STORE_ATTEMPT": ATTEMPT, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PHALANX_DDP_STALL_TIMEOUT": "20", "PHALANX_MEMBERSHIP_TIMEOUT": "30",
           "PHALANX_STOP_INTERVAL": "0"}  # an agreement at every step: a loss or a joiner met at once
    processes = [_start(env, rank, ranks, tmp_path, extra.get(rank, []), local) for rank in range(ranks)]
    try:
        if joiner:
            deadline = time.monotonic() + 120
            while len(_applied(tmp_path, 0)) < joiner_after:
                assert time.monotonic() < deadline and processes[0].poll() is None, _logs(tmp_path)
                time.sleep(0.1)
            store = dist.PrefixStore(f"phalanx/{ATTEMPT}", dist.TCPStore("127.0.0.1", port, is_master=False,
                                                                          timeout=timedelta(seconds=30)))
            [drawn] = joining.draw_ranks(store, 1)
            processes.append(_start(env, drawn, drawn + 1, tmp_path, extra.get(drawn, []), PHALANX_JOIN="1"))
        return [p.wait(timeout=180) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


def _logs(directory: Path) -> str:
    return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}" for path in sorted(directory.glob("log-*.txt")))


def _applied(directory: Path, rank: int) -> dict[int, list[int]]:
    path = directory / f"ids-{rank}.jsonl"
    return {step: ids for step, ids in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def _by_host(directory: Path, ranks: int, local: int) -> dict[int, dict[int, list[int]]]:
    """{host: {step: the ids its ranks applied}}: a host's inner step averages over all of them."""
    hosts: dict[int, dict[int, list[int]]] = {}
    for rank in range(ranks):
        for step, ids in _applied(directory, rank).items():
            hosts.setdefault(rank // local, {}).setdefault(step, []).extend(ids)
    return hosts


def reference(logs: dict[int, dict[int, list[int]]], joins: dict[int, int], steps: int,
              fragments: int = 1) -> dict[int, list]:
    """One process: each host's inner SGD (momentum) on the mean loss of the samples its ranks logged at each step
    (`logs` by host), and after each step a fragment is due at (every EVERY-th step when `fragments` is 1) the mean
    pseudo-gradient of that fragment over the hosts that made the step into a Nesterov SGD (0.7, 0.9) on the synced
    parameters, which those hosts then take. A host in `joins` (host: steps done when it was taken in) starts then
    from the synced parameters with host 0's inner optimizer state. A step made by one host only ends no period
    (exact DDP); a host that joins one host starts a new period from that host's parameters. Each host's final
    parameters."""
    models, inner = {}, {}
    parts = split([p.numel() for p in make_model().parameters()], fragments)
    synced_model = make_model()
    synced = list(synced_model.parameters())
    outer = torch.optim.SGD(synced, lr=0.7, momentum=0.9, nesterov=True)
    for rank in logs:
        if rank not in joins:
            models[rank] = make_model()
            inner[rank] = torch.optim.SGD(models[rank].parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        for rank, at in joins.items():
            if at == step:
                alone = [r for r in models if step - 1 in logs[r]]
                if len(alone) == 1:  # a world of one host: a new period from its parameters
                    with torch.no_grad():
                        for s, p in zip(synced, models[alone[0]].parameters()):
                            s.copy_(p)
                models[rank] = copy.deepcopy(synced_model)
                inner[rank] = torch.optim.SGD(models[rank].parameters(), lr=LR, momentum=MOMENTUM)
                inner[rank].load_state_dict(copy.deepcopy(inner[0].state_dict()))
        made = [rank for rank in models if step in logs[rank]]
        for rank in made:
            ids = logs[rank][step]
            x = torch.stack([sample(i)[0] for i in ids])
            y = torch.stack([sample(i)[1] for i in ids])
            inner[rank].zero_grad()
            F.mse_loss(models[rank](x), y).backward()
            inner[rank].step()
        for k in due(step + 1, EVERY, fragments) if len(made) > 1 else ():
            with torch.no_grad():
                for i in parts[k]:
                    synced[i].grad = sum(synced[i] - list(models[rank].parameters())[i] for rank in made) / len(made)
                outer.step()  # the other fragments' parameters have no gradient: skipped
                for rank in made:
                    for i in parts[k]:
                        list(models[rank].parameters())[i].copy_(synced[i])
                        synced[i].grad = None
    return {rank: [p.detach().clone() for p in model.parameters()] for rank, model in models.items()}


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("noticed, fragments", [("checkpointer", 1), ("outer-step", 1), ("outer-step", 2)])
def test_a_host_lost_in_mid_period_leaves_the_others_to_average_without_it(tmp_path, noticed, fragments):
    """World size 3, one rank per host: host 2 is SIGKILLed before step 5 (mid-period: H=4). Hosts 0 and 1 meet the
    loss in the checkpointer's agreement after step 5, or in the outer step after step 7 (with 2 fragments, the one
    after step 5), which they redo without host 2; they finish equal to the reference in which the outer steps
    after the loss average over them only."""
    extra = {2: ["--die-at", "5"]}
    if noticed == "outer-step":
        extra = {rank: [*extra.get(rank, []), "--no-checkpointer"] for rank in range(3)}
    extra = {rank: [*extra.get(rank, []), "--fragments", str(fragments)] for rank in range(3)}
    codes = _run(tmp_path, 3, extra)
    assert codes == [0, 0, -9], _logs(tmp_path)
    logs = {rank: _applied(tmp_path, rank) for rank in range(3)}
    assert sorted(logs[2]) == [0, 1, 2, 3, 4]
    expected = reference(logs, {}, 12, fragments)
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in (0, 1)}
    for rank, result in results.items():
        assert result["generation"] == [1, [0, 1]], result["generation"]
        assert result["outer_steps"] == 3 * fragments
        assert _max_diff(result["params"], expected[rank]) < 1e-10, _max_diff(result["params"], expected[rank])
    # Step 11 ended an outer step of fragment 0 (the whole model when F=1): both hosts hold it synced, bitwise.
    synced_last = split([p.numel() for p in results[0]["params"]], fragments)[0]
    assert all(torch.equal(results[0]["params"][i], results[1]["params"][i]) for i in synced_last)
    # After the loss the global batch is dealt over the two ranks left (6 samples each).
    assert len(logs[0][8]) == len(logs[1][8]) == 6
    assert "the next outer step averages over them" in (tmp_path / "log-0.txt").read_text(), _logs(tmp_path)


def test_a_host_that_joins_takes_the_synced_parameters(tmp_path):
    """World size 2 -> 3, one rank per host: a third host is taken in after step 5 (mid-period: H=4). It starts
    from the synced parameters (not a host's progress since the last outer step), and the run equals the
    reference; after the outer step of step 11 every replica is the same, bitwise."""
    codes = _run(tmp_path, 2, {0: ["--wait-for-joiner-at", "5"], 1: ["--wait-for-joiner-at", "5"]}, joiner=True)
    assert codes == [0, 0, 0], _logs(tmp_path)
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in range(3)}
    joined = results[2]["joined"]
    assert joined is not None and 5 <= joined["at"] < 8, joined  # mid-period
    assert all(torch.equal(p, s) for p, s in zip(joined["params"], joined["synced"]))
    logs = {rank: _applied(tmp_path, rank) for rank in range(3)}
    assert min(logs[2]) == joined["at"]
    expected = reference(logs, {2: joined["at"]}, 12)
    for rank, result in results.items():
        assert result["generation"][1] == [0, 1, 2], result["generation"]
        assert _max_diff(result["params"], expected[rank]) < 1e-10, (rank, _max_diff(result["params"], expected[rank]))
        assert all(torch.equal(a, b) for a, b in zip(result["params"], results[0]["params"])), rank


def test_one_host_left_is_exact_ddp_until_a_host_returns(tmp_path):
    """World size 2 -> 1 -> 2, one rank per host: host 1 is SIGKILLed before step 2; host 0 goes on alone as exact
    DDP (no outer step after step 3), and a host taken in after step 5 or 6 starts a new period from host 0's
    parameters: the reference, and every replica the same after the outer step of step 11."""
    codes = _run(tmp_path, 2, {0: ["--wait-for-joiner-at", "6"], 1: ["--die-at", "2"]}, joiner=True, joiner_after=6)
    assert codes == [0, -9, 0], _logs(tmp_path)
    joiner = 2
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in (0, joiner)}
    joined = results[joiner]["joined"]
    assert joined is not None and 6 <= joined["at"] < 8, joined
    logs = {rank: _applied(tmp_path, rank) for rank in (0, 1, joiner)}
    expected = reference(logs, {joiner: joined["at"]}, 12)
    for rank, result in results.items():
        assert result["generation"][1] == [0, joiner], result["generation"]
        assert _max_diff(result["params"], expected[rank]) < 1e-10, (rank, _max_diff(result["params"], expected[rank]))
        assert all(torch.equal(a, b) for a, b in zip(result["params"], results[0]["params"])), rank
    assert results[0]["outer_steps"] == 2  # after steps 7 and 11; none after step 3, alone
    log = (tmp_path / "log-0.txt").read_text()
    assert "one host left after step" in log and "an outer step across hosts again" in log, _logs(tmp_path)


def test_a_joiner_handed_no_outer_state_is_refused_and_the_others_go_on(tmp_path):
    """World size 2, one rank per host, model.outer_step left out of the Checkpointer's state: the joiner, handed
    no synced parameters, outer momentum or step count, raises AcrossHostsError; the two hosts go on without it."""
    extra = {rank: ["--wait-for-joiner-at", "5", "--outer-not-in-state"] for rank in range(3)}
    codes = _run(tmp_path, 2, extra, joiner=True)
    assert codes[:2] == [0, 0] and codes[2] != 0, _logs(tmp_path)
    log = (tmp_path / "log-2.txt").read_text()
    assert "AcrossHostsError" in log and "state['outer'] = model.outer_step" in log, _logs(tmp_path)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"result-{rank}.pt", weights_only=True)["outer_steps"] == 3


def test_a_rank_lost_on_a_host_that_stays_leaves_hosts_unequal(tmp_path):
    """World size 4, 2 hosts x 2 ranks: rank 3 is SIGKILLed before step 5; host 1 goes on with rank 2 alone (its
    exact step redone), the pseudo-gradient cut into one chunk (host 0's rank 1 only gathers it), and the run
    equals the reference of two hosts each stepping on its ranks' samples."""
    codes = _run(tmp_path, 4, {3: ["--die-at", "5"]}, local=2)
    assert codes == [0, 0, 0, -9], _logs(tmp_path)
    expected = reference(_by_host(tmp_path, 4, 2), {}, 12)
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in range(3)}
    for rank, result in results.items():
        assert result["generation"] == [1, [0, 1, 2]], result["generation"]
        assert result["outer_steps"] == 3
        diff = _max_diff(result["params"], expected[rank // 2])
        assert diff < 1e-10, (rank, diff)
        assert all(torch.equal(a, b) for a, b in zip(result["params"], results[0]["params"])), rank
    assert "2 host(s) x [2, 1] rank(s)" in (tmp_path / "log-0.txt").read_text(), _logs(tmp_path)


def test_a_stop_after_a_rank_lost_on_a_host_that_stays_saves_every_host_at_one_step(tmp_path):
    """World size 4, 2 hosts x 2 ranks: rank 3 is SIGKILLed before step 5 (rank 2 meets the loss in step 5's own
    exchange and redoes it, the others at step 5's agreement), then rank 0 asks for a stop in step 8: the three
    ranks left agree on one step, save there and end (code 75), not a step apart."""
    codes = _run(tmp_path, 4, {0: ["--stop-at", "8"], 3: ["--die-at", "5"]}, local=2)
    assert codes == [75, 75, 75, -9], _logs(tmp_path)
    last = {rank: max(_applied(tmp_path, rank)) for rank in range(3)}
    assert len(set(last.values())) == 1 and last[0] >= 8, last

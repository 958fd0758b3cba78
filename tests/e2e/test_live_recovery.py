"""`phalanx run --min-world-size`: a worker SIGKILLed in the middle of a step costs the step in flight, not a restart.

Three workers on one node, the loop of docs/data.md (tests/e2e/jobs/live_recovery_job.py): a rank kills itself in
step 1 of epoch 0. The launcher keeps the other workers (the same processes to the end), says the rank was lost and
when the ranks left made their next step, and the run summary keeps the change; the run exits 0. The final
parameters equal one process's on whole global batches (tests/helpers/global_batch_cases.py), and every sample
weighs in once per epoch. Losing rank 0 works the same: the store is the launcher's, and the first rank left
becomes the main one. Across hosts (three network namespaces on a bridge, `--nnodes 2:3`): a host whose launcher and
worker are SIGKILLed whole is lost the same way, and the launchers of the hosts left meet at the end without it; a
host cut off from the network (its link down) costs at most the heartbeat window and a second.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from phalanx.testing import free_port
from phalanx.world.liveness import SILENT_WINDOW
from tests.conftest import ROOT, run_command
from tests.e2e.test_elastic import HANG_GUARD, job_env, kill_node, wait_until
from tests.helpers.global_batch_cases import reference_run
from tests.helpers.live_recovery_cases import applied_ids, next_step_after
from tests.helpers.namespaces import bridged_hosts_or_skip

JOB = str(Path(__file__).resolve().parent / "jobs" / "live_recovery_job.py")


@pytest.mark.parametrize("doomed, moment", [(2, "exchange"), (0, "forward")], ids=["rank2-mid-exchange",
                                                                                 "rank0-mid-forward"])
def test_a_lost_worker_costs_the_step_in_flight_and_the_run_ends_as_if_it_had_not_been_lost(tmp_path, doomed,
                                                                                             moment):
    output = run_command([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "3", "--min-world-size", "2",
                          "--log-dir", str(tmp_path / "logs"), JOB, str(tmp_path), "--doomed", str(doomed),
                          "--at", "0:1", "--moment", moment], ROOT, timeout=180)
    assert f"rank {doomed} was lost (SIGKILL): the 2 ranks left go on in-process" in output, output
    timed = re.search(r"the 2 ranks left made step \d+ ([\d.]+) s after the loss", output)
    assert timed, output
    assert re.search(rf"rank {doomed} lost \(SIGKILL\), kept in-process: world size 3 -> 2, resumed from step 1, "
                     rf"[\d.]+ s to the first step there, regrouped in [\d.]+ s, step 2 redone", output), output
    assert re.search(r"steps \d+ -> \d+, 1 to redo", output), output
    survivors = [rank for rank in range(3) if rank != doomed]
    results = {rank: torch.load(tmp_path / f"result-{rank}.pt", weights_only=True) for rank in survivors}
    assert not (tmp_path / f"result-{doomed}.pt").exists()
    expected_params, expected_steps = reference_run()
    for rank, result in results.items():
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == [1, survivors], f"rank {rank}: {result['generation']}"
        assert result["main"] == (rank == survivors[0]), f"rank {rank}: main={result['main']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    assert applied_ids(str(tmp_path), 3) == expected_steps, "a sample was lost or used twice"


# -- a host lost: three hosts in network namespaces ---------------------------------------------------------------


@pytest.fixture
def three_hosts():
    """Three network namespaces on a bridge: [{"ns", "addr", ...}] for hosts 0, 1, 2."""
    with bridged_hosts_or_skip("phl", 215, 3) as hosts:
        yield hosts


def _three_launchers(run_dir: Path, hosts: list[dict], pause: float, fixed: bool = False,
                     job: tuple = ()) -> list[subprocess.Popen]:
    """One worker on each host, the job's `--host` its index: `--nnodes 2:3` (live recovery on by default: at least
    2 nodes' ranks), or with `fixed` `--nnodes 3 --node-rank i --min-world-size 2` (no heartbeats). `job`: more of
    the job's arguments."""
    port = free_port()

    def nodes(i: int) -> list[str]:
        # --rdzv-last-call 30: the three start together, and a host slow to start under a loaded machine is not
        # left to join the run in progress (the round closes at once when all three are in).
        return (["--nnodes", "3", "--node-rank", str(i), "--min-world-size", "2"] if fixed
                else ["--nnodes", "2:3", "--rdzv-last-call", "30"])

    return [subprocess.Popen(
        ["ip", "netns", "exec", host["ns"], sys.executable, "-m", "phalanx", "run", *nodes(i), "--nproc-per-node", "1",
         "--master-addr", hosts[0]["addr"], "--master-port", str(port), "--rdzv-timeout", "60", JOB, str(run_dir),
         "--doomed", "-1", "--pause", str(pause), "--host", str(i), *job], env=job_env(), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i, host in enumerate(hosts)]


def _outputs_of_the_hosts_left(launchers: list[subprocess.Popen]) -> list[str]:
    """Hosts 0 and 1's launchers' outputs once they end; when one hangs, every launcher's output in the failure."""
    try:
        return [launcher.communicate(timeout=HANG_GUARD)[0] for launcher in launchers[:2]]
    except subprocess.TimeoutExpired:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_node(launcher)
        texts = [f"== host {i} (exit {launcher.returncode}):\n{launcher.communicate()[0]}"
                 for i, launcher in enumerate(launchers)]
        pytest.fail(f"a launcher of the hosts left did not end within {HANG_GUARD} s:\n" + "\n".join(texts))


def _host_two_stepped(run_dir: Path) -> bool:
    ranks = [r for r in range(3) if (run_dir / f"host-{r}").exists() and (run_dir / f"host-{r}").read_text() == "2"]
    log = run_dir / f"ids-{ranks[0]}.jsonl" if ranks else None
    return log is not None and log.exists() and log.read_text().count("\n") >= 1


@pytest.mark.waiting(seconds=30)
@pytest.mark.parametrize("fixed, shard", [(False, "none"), (True, "none"), (False, "gradients")],
                         ids=["nnodes-2:3", "nnodes-3-min-world-size-2", "nnodes-2:3-shard-gradients"])
def test_a_host_killed_whole_costs_the_step_in_flight_and_the_others_finish(tmp_path, three_hosts, fixed, shard):
    """3 hosts x 1 worker under `--nnodes 2:3` (live recovery is its default), or a fixed `--nnodes 3` with
    `--min-world-size 2`: host 2's launcher and worker are SIGKILLed after its first step. Hosts 0 and 1 keep their
    workers (no restart, no checkpoint read), their launchers say the node was lost and meet at the end without
    it (under a fixed node count, which has no heartbeats, from the workers' regroup: not after torch's 300 s
    wait for every node); the run equals the one that never lost a host. At shard="gradients" (a model wide enough
    that every rank owns parameter elements) the lost host's optimizer shard comes back from its keeper's copy."""
    hidden = 64 if shard != "none" else 8
    launchers = _three_launchers(tmp_path, three_hosts, 0.3, fixed, ("--shard", shard, "--hidden", str(hidden)))
    started = time.monotonic()
    try:
        wait_until(lambda: _host_two_stepped(tmp_path), "host 2's first step", launchers)
        kill_node(launchers[2])
        outputs = _outputs_of_the_hosts_left(launchers)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_node(launcher)
    lost = ("node 2 is not waited for at the end: its ranks [2] were lost" if fixed else
            "lost (no heartbeat for 4 s): its ranks are lost, the 2 ranks left go on in-process")
    _check_the_hosts_left(tmp_path, launchers, outputs, lost, hidden)
    assert time.monotonic() - started < 90, "the launchers left waited for the lost node at the end"
    if not fixed:
        for output in outputs:
            assert "(the default under --nnodes MIN:MAX; --min-world-size 0: off)" in output, output
            assert re.search(r"lost, kept in-process: world size 3 -> 2, resumed from step \d+, regrouped in "
                             r"[\d.]+ s, (step \d+ redone|no step redone)", output), output


@pytest.mark.waiting(seconds=30)
def test_a_host_cut_off_costs_at_most_the_heartbeat_window(tmp_path, three_hosts):
    """The same, but host 2's link is set down after its first step (no connection is reset: its processes run on,
    unreachable). The ranks left make their next step within the heartbeat window + 1 s of the cut."""
    launchers = _three_launchers(tmp_path, three_hosts, 0.1)
    try:
        wait_until(lambda: _host_two_stepped(tmp_path), "host 2's first step", launchers)
        cut = time.time()
        host = three_hosts[2]
        subprocess.run(["ip", "-n", host["ns"], "link", "set", "dev", host["dev"], "down"], check=True, timeout=30)
        outputs = _outputs_of_the_hosts_left(launchers)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                kill_node(launcher)
    node_lost = "lost (no heartbeat for 4 s): its ranks are lost, the 2 ranks left go on in-process"
    survivors = _check_the_hosts_left(tmp_path, launchers, outputs, node_lost)
    took = next_step_after(str(tmp_path), survivors, cut)  # a step's own 0.1 s of sleep is not the cut's cost
    assert took is not None and took <= SILENT_WINDOW + 1.0 + 0.1, f"the next step came {took} s after the cut"


def _check_the_hosts_left(tmp_path: Path, launchers, outputs, lost: str, hidden: int = 8) -> list[int]:
    for launcher, output in zip(launchers[:2], outputs):
        assert launcher.returncode == 0, output
        assert lost in output, output
        assert "restart" not in output.lower(), output
    hosts = {rank: (tmp_path / f"host-{rank}").read_text() for rank in range(3)}
    lost = next(rank for rank, host in hosts.items() if host == "2")
    survivors = sorted(rank for rank in hosts if rank != lost)
    expected_params, expected_steps = reference_run(hidden=hidden)
    for rank in survivors:
        result = torch.load(tmp_path / f"result-{rank}.pt", weights_only=True)
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == [1, survivors], f"rank {rank}: {result['generation']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    # The lost rank may have applied its last step and died before logging it: that step may lack its part.
    applied = applied_ids(str(tmp_path), 3)
    assert set(applied) == set(expected_steps)
    short = [key for key, ids in applied.items() if ids != expected_steps[key]]
    assert len(short) <= 1 and all(set(applied[key]) < set(expected_steps[key]) for key in short), short
    return survivors


JOIN_JOB = str(Path(__file__).resolve().parent / "jobs" / "join_job.py")


@pytest.mark.waiting(seconds=30)
def test_a_host_that_comes_back_joins_the_workers_in_progress_without_a_restart(tmp_path, three_hosts):
    """3 hosts x 1 worker under `--nnodes 2:3`, the loop with `checkpointer.restore(state)` first (tests/e2e/jobs/
    join_job.py): host 2 is SIGKILLed whole after its first step, the two hosts left go on in-process, and the same
    command started again on host 2 joins them: the launchers meet in a new round without stopping their workers,
    host 2's worker gets a rank the run never used, waits in restore() and is handed the state by the two ranks that
    train at their next agreed step (no checkpoint read anywhere, no process restarted on hosts 0 and 1). The run
    equals the one that never changed its world, every sample once per epoch (the step host 2 died in aside)."""
    port = free_port()
    job = [JOIN_JOB, str(tmp_path), "--pause", "0.2", "--epochs", "3", "--wait-for-joiners-at", "1:0"]

    def launcher(i: int) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", three_hosts[i]["ns"], sys.executable, "-m", "phalanx", "run", "--nnodes", "2:3",
             "--nproc-per-node", "1", "--master-addr", three_hosts[0]["addr"], "--master-port", str(port),
             "--rdzv-timeout", "60", "--rdzv-last-call", "30", *job, "--host", str(i)], env=job_env(), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    launchers = [launcher(i) for i in range(3)]
    try:
        wait_until(lambda: _host_two_stepped(tmp_path), "host 2's first step", launchers)
        kill_node(launchers[2])
        launchers[2].communicate()
        restarted = time.time()
        launchers.append(launcher(2))
        outputs = _outputs_of_the_hosts_left(launchers[:2] + launchers[3:])
        joiner_output = launchers[3].communicate(timeout=HANG_GUARD)[0]
    finally:
        for process in launchers:
            if process.poll() is None:
                kill_node(process)
    for process, output in zip(launchers[:2], outputs):
        assert process.returncode == 0, output
        assert "joined in-process: 3 node(s) now" in output, f"{output}\n== the joiner's launcher:\n{joiner_output}"
        assert "restart" not in output.lower(), output
        assert re.search(r"rank\(s\) \[3\] joined in-process: world size 2 -> 3, taken in after step \d+, regrouped "
                         r"in [\d.]+ s, [\d.]+ MB of state healed in [\d.]+ s, no step redone", output), output
    assert launchers[3].returncode == 0, joiner_output
    assert "joining the workers in progress" in joiner_output and "ranks [3] are taken in" in joiner_output
    hosts = {rank: (tmp_path / f"host-{rank}").read_text() for rank in range(4)}
    assert [hosts[rank] for rank in range(4)] == ["0", "1", "2", "2"]
    expected_params, expected_steps = reference_run(epochs=3)
    for rank in (0, 1, 3):
        result = torch.load(tmp_path / f"result-{rank}.pt", weights_only=True)
        assert result["pid"][0] == result["pid"][1], f"rank {rank} changed process"
        assert result["generation"] == [2, [0, 1, 3]], f"rank {rank}: {result['generation']}"
        assert result["files_read"] == [], f"rank {rank} read {result['files_read']}"
        for ours, theirs in zip(result["params"], expected_params):
            assert (ours - theirs).abs().max() < 1e-5, f"rank {rank}: {(ours - theirs).abs().max():.3g} off"
    joined = torch.load(tmp_path / "result-3.pt", weights_only=True)
    first_step_at = min(json.loads(line)[3] for line in (tmp_path / "ids-3.jsonl").read_text().splitlines())
    assert first_step_at - restarted < 30, f"host 2 trained {first_step_at - restarted:.1f} s after its restart"
    assert joined["first_step"][0] >= 1
    applied = applied_ids(str(tmp_path), 4)
    assert set(applied) == set(expected_steps)
    short = [key for key, ids in applied.items() if ids != expected_steps[key]]
    assert len(short) <= 1 and all(set(applied[key]) < set(expected_steps[key]) for key in short), short

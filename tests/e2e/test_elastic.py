"""`phalanx run --nnodes MIN:MAX` across two hosts (network namespaces): nodes lost, nodes back, errors named.

tests/e2e/jobs/elastic_job.py trains at a global batch of 8 and logs the sample ids of every applied
optimizer step. 2 hosts x 1 worker (world size 2, then 1, then 2 again): host B's launcher and workers are
SIGKILLed mid-epoch; host A goes on alone from the newest checkpoint; the same command on host B brings it
back, and the group grows at a step boundary (the agreed save). The final parameters match an
uninterrupted run's at the same global batch (one process: the run at 1, 2 and 4 ranks, below, holds 2 hosts
to it), and every epoch uses each sample exactly once over the steps that count (a step
lost with the crash and redone counts once: the later line is the lineage's). The same global batch at 1,
2 and 4 ranks (1 process; 2 hosts x 1; 2 hosts x 2) averages the same samples in every step and ends at
the same parameters.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from phalanx.diagnose.stacks import descendants
from phalanx.errors import RunEndedError, StoreLostError
from phalanx.testing import free_port
from phalanx.world.meeting.membership import ElasticRendezvous
from tests.conftest import ROOT, run_temp_dir, with_warm_launcher
from tests.e2e.test_launch import fresh_env, two_hosts  # noqa: F401 - two_hosts is a fixture

# tests/suite.py: the time goes to heartbeats, and to noticing a lost node
pytestmark = pytest.mark.waiting

JOB = Path(__file__).resolve().parent / "jobs" / "elastic_job.py"
HANG_GUARD = 180
SAMPLES = 96
STEPS_PER_EPOCH = 12  # a global batch of 8, at any world size


def job_env() -> dict:
    # The launchers' temporary folders in the run's (a SIGKILLed launcher cannot remove its own), the same for
    # every test, so that one warm launcher serves them all (it forks each command into its host's namespaces).
    return with_warm_launcher(fresh_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TMPDIR=run_temp_dir()))


def start(host: dict | None, master: str, port: int, run_dir: Path, *job_args, nnodes="1:2", node_rank=None,
          nproc=1, flags=(), env=None) -> subprocess.Popen:
    """`phalanx run` on one host (its network namespace; None: this machine), the same command on every host."""
    rank = ("--node-rank", str(node_rank)) if node_rank is not None else ()
    where = ["ip", "netns", "exec", host["ns"]] if host is not None else []
    command = [*where, sys.executable, "-m", "phalanx", "run", "--nnodes", nnodes, *rank, "--nproc-per-node",
               str(nproc), "--master-addr", master, "--master-port", str(port), *flags, str(JOB), str(run_dir),
               *job_args]
    return subprocess.Popen(command, env={**job_env(), **(env or {})}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fixed_run(hosts, run_dir: Path, port: int, *job_args, nproc: int = 1, flags=(), env=None) -> list[str]:
    """A run on a fixed set of nodes (`--nnodes 2` on two hosts, or one process here) that must succeed."""
    if hosts is None:
        nodes = [start(None, "127.0.0.1", port, run_dir, *job_args, nnodes="1", nproc=nproc, flags=flags)]
    else:
        nodes = [start(host, hosts[0]["addr"], port, run_dir, *job_args, nnodes=str(len(hosts)), node_rank=i,
                       nproc=nproc, flags=("--rdzv-timeout", "60", *flags), env=env) for i, host in enumerate(hosts)]
    try:
        outputs = finish(nodes)
    finally:
        stop_all(nodes)
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
    return outputs


def final_params(run_dir: Path) -> list:
    return torch.load(run_dir / "final.pt", weights_only=True)["params"]


def assert_same_params(run_dir: Path, reference: Path) -> None:
    for got, expected in zip(final_params(run_dir), final_params(reference), strict=True):
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher, its workers and whatever they started, all at once."""
    for pid in descendants(launcher.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=30)


def steps(run_dir: Path) -> list[tuple[int, int, int, float, list[int]]]:
    """(epoch, step, world size, time, sample ids) per line of samples.log, in the order written."""
    path = run_dir / "samples.log"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4:
            epoch, step, world, when = int(fields[0]), int(fields[1]), int(fields[2]), float(fields[3])
            rows.append((epoch, step, world, when, [int(i) for i in fields[4:]]))
    return rows


def wait_until(condition, what: str, processes) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not condition():
        assert time.monotonic() < deadline, f"waited {HANG_GUARD} s for {what}"
        for process in processes:
            assert process.poll() is None, f"a launcher ended while waiting for {what}: {process.stdout.read()}"
        time.sleep(0.1)


def lineage(rows) -> dict[int, tuple]:
    """The applied steps: for each step number the last line written (a redone step replaces the lost one)."""
    return {row[1]: row for row in rows}


def check_every_sample_once(rows) -> None:
    by_epoch: dict[int, list[int]] = {}
    for step in sorted(lineage(rows)):
        epoch, _, _, _, ids = lineage(rows)[step]
        by_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch, ids in by_epoch.items():
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}: samples missing or twice"
    assert sorted(lineage(rows)) == list(range(1, 3 * STEPS_PER_EPOCH + 1))


def finish(processes) -> list[str]:
    return [process.communicate(timeout=HANG_GUARD)[0] for process in processes]


def stop_all(processes) -> None:
    for process in processes:
        if process.poll() is None:
            kill_node(process)


@pytest.mark.waiting(seconds=10)
def test_unreachable_master_is_named_within_the_rendezvous_timeout(tmp_path, two_hosts):  # noqa: F811
    """1 host of 2: --master-addr is an address of the hosts' network that nobody serves."""
    host = two_hosts[1]
    nobody = host["addr"].rsplit(".", 1)[0] + ".9"
    job_env()  # starts the run's warm launcher for this environment if none runs yet: its start is not the command's
    started = time.monotonic()
    node = start(host, nobody, 29571, tmp_path, flags=("--rdzv-timeout", "5"))
    try:
        output = finish([node])[0]
    finally:
        stop_all([node])
    took = time.monotonic() - started
    assert node.returncode == 1, output
    assert f"MasterUnreachableError: could not reach the rendezvous master at {nobody}:29571" in output
    assert "--rdzv-timeout" in output
    assert took < 5 + 20, (took, output)  # the timeout, plus the interpreter's start on a busy machine
    for cpp in ("Exception raised from", "frame #", "c10::", "socket.cpp", "Traceback"):
        assert cpp not in output, output


@pytest.mark.waiting(seconds=20)
def test_node_lost_then_back(tmp_path, two_hosts):  # noqa: F811
    """World size 2 -> 1 -> 2: 2 hosts x 1 worker, --nnodes 1:2 --min-world-size 0 (live recovery off: the
    workers restart from the newest checkpoint), host B SIGKILLed mid-epoch, then started again;
    against an uninterrupted run at the same global batch (one process, as test_same_global_batch_at_1_2_and_4_ranks
    holds 2 hosts x 1 worker to it)."""
    reference = tmp_path / "uninterrupted"
    fixed_run(None, reference, 0)
    run_dir = tmp_path / "run"
    master = two_hosts[0]["addr"]
    job = ("--wait-alone", "4")
    # No --max-restarts: a node lost or joining is no failure. Live recovery off: the restart from the newest
    # checkpoint is the path under test (and the job gathers sample ids over torch's default group).
    flags = ("--rdzv-timeout", "60", "--min-world-size", "0")
    a = start(two_hosts[0], master, 29572, run_dir, *job, flags=flags)
    b = start(two_hosts[1], master, 29572, run_dir, *job, flags=flags)
    processes = [a, b]
    try:
        wait_until(lambda: sum(row[2] == 2 for row in steps(run_dir)) >= 5, "5 steps at world size 2", [a, b])
        kill_node(b)
        killed_at = time.time()
        wait_until(lambda: sum(row[2] == 1 for row in steps(run_dir)) >= 4, "4 steps at world size 1", [a])
        b_again = start(two_hosts[1], master, 29572, run_dir, *job, flags=flags)
        processes.append(b_again)
        out_a, out_b = finish([a, b_again])
    finally:
        stop_all(processes)
    assert a.returncode == 0, out_a
    assert b_again.returncode == 0, out_b
    rows = steps(run_dir)
    worlds = [row[2] for row in rows]
    runs = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]
    assert runs == [2, 1, 2], runs
    assert all(row[3] > killed_at for row in rows if row[2] == 1)
    check_every_sample_once(rows)
    b_addr = two_hosts[1]["addr"]
    assert f"node 1 ({b_addr}) lost" in out_a
    assert "world size 2 -> 1" in out_a and "world size 1 -> 2" in out_a
    assert f"node 1 ({b_addr}) joined" in out_a
    resumed = [line for line in out_a.splitlines() if line.startswith("phalanx run: resumed from step")]
    assert len(resumed) == 2, out_a
    # Growth redoes no step: the larger world resumes right after the last step of the smaller one.
    last_alone = max(row[1] for row in rows if row[2] == 1)
    assert f"resumed from step {last_alone} at world size 2" in resumed[1]
    assert "attempt 2 of" not in out_a  # not counted as a failure
    assert "live recovery" not in out_a
    assert "global batch 8 = 1 rank x 4 micro-batches x 2" in resumed[0]  # the micro-batches per rank, said
    assert_same_params(run_dir, reference)


@pytest.mark.waiting(seconds=9)
def test_a_failing_worker_restarts_every_node(tmp_path, two_hosts):  # noqa: F811
    """World size 2 (2 hosts x 1) on a fixed set of nodes, `--nnodes 2 --max-restarts 1`: host B's worker raises
    once, mid-epoch. Every node's workers restart together (a node's restarted workers must not wait for peers
    that never restart), from the newest checkpoint, and the run ends at the uninterrupted run's parameters (one
    process at the same global batch, as in test_node_lost_then_back)."""
    reference = tmp_path / "uninterrupted"
    fixed_run(None, reference, 0)
    run_dir = tmp_path / "run"
    outputs = fixed_run(two_hosts, run_dir, 29577, "--fail-once-at", "5", flags=("--max-restarts", "1"))
    assert (run_dir / "failed-once").exists()
    assert "a planned failure before step 6" in outputs[1]
    assert "restarting the worker group (attempt 2 of 2)" in outputs[1], outputs[1]
    check_every_sample_once(steps(run_dir))
    assert {row[2] for row in steps(run_dir)} == {2}
    assert_same_params(run_dir, reference)


@pytest.mark.waiting(seconds=15)
def test_same_global_batch_at_1_2_and_4_ranks(tmp_path, two_hosts):  # noqa: F811
    """World sizes 1 (one process), 2 (2 hosts x 1) and 4 (2 hosts x 2), a global batch of 8."""
    one = tmp_path / "one"
    fixed_run(None, one, 0)
    for name, nproc, port in (("two", 1, 29574), ("four", 2, 29575)):
        # At 2 hosts x 2 the exchange chosen is the hierarchical one (shared memory inside each host).
        fixed_run(two_hosts, tmp_path / name, port, nproc=nproc)
        # Every optimizer step averaged the same samples, and the parameters end the same.
        assert [sorted(row[4]) for row in steps(tmp_path / name)] == [sorted(row[4]) for row in steps(one)]
        assert {row[2] for row in steps(tmp_path / name)} == {2 * nproc}
        assert_same_params(tmp_path / name, one)
    check_every_sample_once(steps(one))


@contextlib.contextmanager
def _store_node(code: str, ready: str):
    """A process running `code` (the node that hosts a store), once it printed `ready`; killed at the end if alive."""
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=job_env())
    try:
        assert host.stdout.readline().strip() == ready
        yield host
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_the_stores_host_lost_is_named_within_seconds():
    """One elastic node (this process, no namespaces) whose store another process hosts, which is SIGKILLed."""
    port = free_port()
    serve = (f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, 1, True, "
             f"wait_for_workers=False); print('up', flush=True); time.sleep(120)")
    rendezvous = None
    with _store_node(serve, "up") as host:
        try:
            rendezvous = ElasticRendezvous("127.0.0.1", port, "test", 1, 2, timedelta(seconds=20))
            assert not rendezvous.hosting  # the port is another process's: this node dials it
            info = rendezvous.next_rendezvous()
            assert (info.rank, info.world_size) == (0, 1)
            assert rendezvous.lost() == [] and rendezvous.waiting() == []
            host.kill()
            host.wait()
            began = time.monotonic()
            with pytest.raises(StoreLostError, match=f"the rendezvous store at 127.0.0.1:{port}"):
                rendezvous.lost()
            assert time.monotonic() - began < 10
        finally:
            if rendezvous is not None:
                rendezvous.shutdown()


@pytest.mark.parametrize("last_call", [0.5, 3.0])
def test_a_round_with_min_nodes_waits_the_last_call_for_more(last_call):
    """--nnodes 1:2 with one node (this process, hosting the store): its first round closes --rdzv-last-call
    seconds after it came in, not before (torch would wait 30 s)."""
    rendezvous = ElasticRendezvous("127.0.0.1", free_port(), "last-call", 1, 2, timedelta(seconds=20), last_call)
    try:
        began = time.monotonic()
        info = rendezvous.next_rendezvous()
        took = time.monotonic() - began
        assert (info.rank, info.world_size) == (0, 1)
        # within 10 s more (the rounds' polls, a loaded machine), far below torch's 30 s
        assert last_call <= took < last_call + 10, f"the round closed {took:.2f} s in, --rdzv-last-call {last_call}"
    finally:
        rendezvous.shutdown()


def test_a_node_waiting_to_join_when_the_run_ends_learns_it_ended():
    """The store's node (another process, elastic 1:2) ends its run while this node waits to join the next round:
    it keeps the store up until this node has looked at the rendezvous again, so this node reads the run ended
    (RunEndedError: its launcher exits 0), not a store gone (StoreLostError: exit code 1, seen in the chaos runs)."""
    port = free_port()
    host_node = (f"import sys, time; from datetime import timedelta; "
                 f"from phalanx.world.meeting.membership import ElasticRendezvous; "
                 f"r = ElasticRendezvous('127.0.0.1', {port}, 'ended', 1, 2, timedelta(seconds=20)); "
                 f"assert r.hosting; r.next_rendezvous(); print('in', flush=True); "
                 f"deadline = time.monotonic() + 60\n"
                 f"while not r.waiting() and time.monotonic() < deadline: time.sleep(0.05)\n"
                 f"print('waiting:', r.waiting(), flush=True); r.shutdown()")
    with _store_node(host_node, "in") as host:
        rendezvous = ElasticRendezvous("127.0.0.1", port, "ended", 1, 2, timedelta(seconds=20))
        assert not rendezvous.hosting
        with pytest.raises(RunEndedError, match="ended before this node met the others"):
            rendezvous.next_rendezvous()
        assert "keeping the store up" in host.stdout.read()
        assert host.wait(timeout=30) == 0

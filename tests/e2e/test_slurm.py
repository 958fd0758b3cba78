"""SLURM end to end: examples/slurm/ submitted with `sbatch` to a real cluster of 2 nodes.

The cluster (tests/helpers/slurm_cluster.py) is slurmctld and munge here and one slurmd per network
namespace on a bridge; inside the nodes the host name resolves to 127.0.1.1 and each node has a second
interface that leads nowhere, so a job only works if Gloo's interface is found (no GLOO_SOCKET_IFNAME is
set anywhere). Both forms run as documented: one task per rank started by srun (train_cpu.sbatch, world
size 4) and one `phalanx run` per node (phalanx_run_cpu.sbatch, world size 4). The failure and requeue
tests submit the same scripts with another training script in place of examples/wine.py: a rank that
fails (world size 2), and tests/e2e/jobs/stop_job.py preempted by SLURM and requeued (world size 2), whose
parameters after each step and at the end must equal an uninterrupted job's, bitwise.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.e2e.test_launch import fresh_env, is_gone
from tests.e2e.test_stop import final, phalanx_run, resumed_step, steps_log
from tests.helpers.slurm_cluster import ClusterUnavailable, SlurmCluster

# tests/suite.py: the time goes to SLURM's daemons (registering nodes, scheduling, requeues), and no test
# checks a bound on time (only guards against a stuck job), so they run beside the compute stage.
# A cluster per test process: the examples' tests share one; each requeue test (two minutes of SLURM's own
# waiting) is a group of its own, so that it gets a cluster of its own beside the others.
pytestmark = [pytest.mark.latency, pytest.mark.xdist_group("slurm-cluster")]

SLURM_EXAMPLES = ROOT / "examples" / "slurm"
JOBS = ROOT / "tests" / "e2e" / "jobs"
WINE = 'examples/wine.py --out "runs/wine-${SLURM_JOB_ID}"'  # what the tests swap for another script
JOB_GUARD = 240  # seconds; a job that needs this long is stuck


@pytest.fixture(scope="module")
def cluster():
    try:
        built = SlurmCluster(nodes=2, cpus=2).start()
    except ClusterUnavailable as exc:
        pytest.skip(f"SLURM tests skipped: {exc}")
    try:
        yield built
    finally:
        built.stop()


def job_env() -> dict:
    """The submitter's environment: this checkout importable, this Python's `python` and `phalanx` first on
    PATH, one thread per rank; no world variables and no interface named."""
    env = fresh_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")  # a job: its node's cgroup
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    return env


def submit(cluster: SlurmCluster, script: Path, tmp_path: Path, *args: str, flags=()) -> tuple[int, Path]:
    """sbatch from the repository root, as the examples say; (job id, its output file)."""
    output = tmp_path / "job.out"
    job = cluster.submit(script, *args, flags=(f"--output={output}", *flags), cwd=ROOT, env=job_env())
    return job, output


def finished(cluster: SlurmCluster, job: int, output: Path, timeout: float = JOB_GUARD) -> tuple[dict, str]:
    """Wait for the job to end; (its scontrol fields, its output). A job still running fails with its output."""
    try:
        fields = cluster.wait(job, timeout)
    except TimeoutError as exc:
        cluster.run("scancel", "--signal=KILL", "--full", str(job), check=False)  # the next test gets the nodes
        pytest.fail(f"{exc}\n--- job output:\n{output.read_text() if output.exists() else ''}")
    return fields, output.read_text() if output.exists() else ""


def with_script(example: str, tmp_path: Path, replacement: str) -> Path:
    """The example with `replacement` in place of examples/wine.py and its arguments, written to tmp_path."""
    text = (SLURM_EXAMPLES / example).read_text()
    assert text.count(WINE) == 1, f"{example} no longer runs {WINE}"
    path = tmp_path / example
    path.write_text(text.replace(WINE, replacement))
    return path


def accuracy(output: str) -> float:
    found = re.findall(r"held-out accuracy: (\d\.\d\d)", output)
    assert len(found) == 1, output
    return float(found[0])


def interface_sentence(cluster: SlurmCluster, node: int) -> str:
    address = cluster.addresses[node]
    return (f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME=eth0 ({address}), the interface of the route to the "
            f"master node1 ({cluster.addresses[0]})")


class TestExamples:
    """The examples as documented: `sbatch examples/slurm/<script> [training arguments]`, on CPU nodes."""

    def test_srun_starts_one_task_per_rank(self, cluster, tmp_path):
        """World size 4: 2 nodes x 2 tasks started by srun, each task's phalanx.init() reading SLURM."""
        job, output = submit(cluster, SLURM_EXAMPLES / "train_cpu.sbatch", tmp_path, "--out", str(tmp_path / "wine"))
        fields, text = finished(cluster, job, output)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
        assert "on 4 process(es)" in text
        assert accuracy(text) >= 0.90, text
        assert interface_sentence(cluster, 0) in text  # rank 0, on node1, says which interface

    def test_one_phalanx_run_per_node(self, cluster, tmp_path):
        """World size 4: 2 nodes x 1 `phalanx run` x 2 workers; node count, node rank and master from SLURM."""
        job, output = submit(cluster, SLURM_EXAMPLES / "phalanx_run_cpu.sbatch", tmp_path,
                             "--out", str(tmp_path / "wine"))
        fields, text = finished(cluster, job, output)
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
        assert "on 4 process(es)" in text and "[rank 0] " in text
        assert accuracy(text) >= 0.90, text
        for node in (0, 1):
            assert f"phalanx run: from SLURM: node {node} of 2, master node1:" in text, text
            assert f"phalanx run: {interface_sentence(cluster, node)}" in text, text


class TestFailure:
    """World size 2 (2 nodes x 1 rank): rank 1, on node2, raises; rank 0 would sleep for 600 s."""

    @pytest.mark.parametrize("example, flags", [("train_cpu.sbatch", ("--ntasks-per-node=1",)),
                                                ("phalanx_run_cpu.sbatch", ("--cpus-per-task=1",))])
    def test_a_failing_rank_stops_the_job_and_its_traceback_is_in_the_output(self, cluster, tmp_path, example,
                                                                             flags):
        pids = tmp_path / "pids"
        pids.mkdir()
        script = with_script(example, tmp_path, f"tests/e2e/jobs/launch_worker.py --fail-rank 1 --pid-dir {pids}")
        job, output = submit(cluster, script, tmp_path, flags=flags)
        fields, text = finished(cluster, job, output, timeout=120)  # rank 0 was stopped, not left to sleep 600 s
        assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", text
        assert "srun: error: node2: task 1: Exited with exit code 1" in text, text
        if example.startswith("train"):  # the task's own traceback, each line prefixed with its rank by torch
            traceback = text[text.index("[rank1]: Traceback (most recent call last):"):]
            assert "[rank1]: ValueError: rank 1 fails on purpose" in traceback, text
        else:  # node2's launcher names the rank and prints its traceback last
            traceback = text[text.index("phalanx run: traceback of rank 1, the first to fail:\n"):]
            assert "launch_worker.py" in traceback and "\nValueError: rank 1 fails on purpose\n" in traceback, text
        assert "Exception ignored" not in text, text  # the forked DataLoader workers start cleanly
        ran = [int(path.read_text()) for path in pids.glob("*.pid")]
        assert len(ran) == 4, text  # both ranks and their DataLoader workers had started
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(map(is_gone, ran)):
            time.sleep(0.1)
        assert [pid for pid in ran if not is_gone(pid)] == []


STOP_JOB = "tests/e2e/jobs/stop_job.py {run_dir} --step-seconds 0.1"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """stop_job.py's 80 steps that nothing stops, at world size 2 under `phalanx run` on this machine: the
    bits a job of 2 nodes x 1 task gives (test_stop.py holds torchrun's runs to the same reference). Outside
    SLURM it costs one launch instead of a job's two fresh ranks and SLURM's scheduling."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    code, output, _ = phalanx_run(run_dir, env=job_env())
    assert code == 0, output
    return run_dir


def preempted(cluster: SlurmCluster, job: int, run_dir: Path, how: list[str]) -> None:
    """Once the job trained a few steps, preempt it with the SLURM command `how`."""
    deadline = time.monotonic() + JOB_GUARD
    while time.monotonic() < deadline:
        if (run_dir / "steps.log").exists() and len(steps_log(run_dir)) >= 5:
            break
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), cluster.job(job)
        time.sleep(0.1)
    cluster.run(*how, str(job))


def check_resumed_bitwise(run_dir: Path, reference: Path, fields: dict, text: str) -> None:
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    stops = [int(step) for step in re.findall(r"stopped at step (\d+) on request", text)]
    assert len(stops) >= 1, text
    assert resumed_step(text) == stops[-1], text  # the requeued job went on from the agreed step
    steps = steps_log(run_dir)
    assert sorted(int(step) for step, _ in steps) == list(range(1, 81)), "a step trained twice or never"
    assert dict(steps) == dict(steps_log(reference)), "the parameters parted from the uninterrupted job's"
    assert all(torch.equal(a, b) for a, b in zip(final(run_dir)["params"], final(reference)["params"]))


class TestRequeue:
    """World size 2 (2 nodes x 1 rank): stop_job.py preempted mid-run, requeued, finished."""

    @pytest.mark.xdist_group("slurm-requeue-signal")
    def test_time_limit_signal_to_the_batch_script(self, cluster, tmp_path, uninterrupted):
        """srun, one task per rank: SIGUSR1 to the batch script (what --signal=B:USR1@60 sends); it passes
        it on, the ranks save at an agreed step and exit 75, and the script requeues the job."""
        run_dir = tmp_path / "run"
        script = with_script("train_cpu.sbatch", tmp_path, STOP_JOB.format(run_dir=run_dir))
        job, output = submit(cluster, script, tmp_path, flags=("--ntasks-per-node=1",))
        preempted(cluster, job, run_dir, ["scancel", "--batch", "--signal=USR1"])
        fields, text = finished(cluster, job, output)
        assert "on request (SIGUSR1)" in text, text
        check_resumed_bitwise(run_dir, uninterrupted, fields, text)

    @pytest.mark.xdist_group("slurm-requeue-scontrol")
    def test_scontrol_requeue(self, cluster, tmp_path, uninterrupted):
        """One `phalanx run` per node: `scontrol requeue` (SIGTERM to every process of the job, SIGKILL after
        KillWait); the ranks save at an agreed step within it, and SLURM starts the job again."""
        run_dir = tmp_path / "run"
        script = with_script("phalanx_run_cpu.sbatch", tmp_path, STOP_JOB.format(run_dir=run_dir))
        job, output = submit(cluster, script, tmp_path, flags=("--cpus-per-task=1",))
        preempted(cluster, job, run_dir, ["scontrol", "requeue"])
        fields, text = finished(cluster, job, output)
        assert "on request (SIGTERM" in text, text
        check_resumed_bitwise(run_dir, uninterrupted, fields, text)

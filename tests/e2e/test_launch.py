"""`phalanx run` end to end: real worker processes started by the launcher, as a user starts them.

Multi-process tests (world size 2 on one node, and 2 nodes x 1 worker in two network namespaces).
Each test starts tests/e2e/jobs/launch_worker.py; the subprocess timeouts only guard against hangs.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.diagnose.recorder import pid_alive
from tests.conftest import ROOT, checkout_on_pythonpath, with_warm_launcher
from tests.helpers.namespaces import NamespaceUnavailable, veth_hosts

WORKER = str(Path(__file__).resolve().parent / "jobs" / "launch_worker.py")
HANG_GUARD = 240  # seconds; a run that needs this long is stuck


def clean_env(**extra) -> dict:
    """The test runner's environment without any world variables, with this checkout importable."""
    return with_warm_launcher(fresh_env(**extra))  # `phalanx` commands fork from a server that imported torch


def fresh_env(**extra) -> dict:
    """clean_env() for commands that start fresh wherever they run (a SLURM job's): no warm launcher named,
    and none started for it (~6 s of CPU, tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PHALANX_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "OMP_NUM_THREADS", "GROUP_RANK")}
    env["PYTHONPATH"] = checkout_on_pythonpath()
    env.update(extra)
    return env


def phalanx_run(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args], env=env or clean_env(), cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD)


def sums_by_rank(stdout: str) -> dict:
    """{rank: (world_size, sum, attempt)} from the worker's result lines."""
    found = {}
    for match in re.finditer(r"rank=(\d+) world_size=(\d+) sum=(\d+) attempt=(\d+)", stdout):
        rank, world_size, total, attempt = map(int, match.groups())
        found[rank] = (world_size, total, attempt)
    return found


def is_gone(pid: int) -> bool:
    """True when no process `pid` runs (a zombie awaiting its reaper counts as gone)."""
    return not pid_alive(pid)


class TestAllReduceUnderEachLauncher:
    """World size 2 (and 1): the same script gets the right sum under every way of starting it."""

    @pytest.mark.smoke
    def test_phalanx_run_two_workers(self):
        """World size 2 under `phalanx run`."""
        result = phalanx_run("--nproc-per-node", "2", WORKER)
        assert result.returncode == 0, result.stderr
        assert sums_by_rank(result.stdout) == {0: (2, 1, 0), 1: (2, 1, 0)}
        # Every line a worker prints carries its rank.
        for rank in (0, 1):
            assert f"[rank {rank}] rank={rank} world_size=2" in result.stdout
        # phalanx run leaves OMP_NUM_THREADS alone (torchrun would set it to 1): init() shares the cores.
        assert result.stdout.count("omp=unset") == 2

    def test_torchrun_two_workers(self):
        """World size 2 under torchrun."""
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", WORKER],
                                env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD)
        assert result.returncode == 0, result.stderr
        assert sums_by_rank(result.stdout) == {0: (2, 1, 0), 1: (2, 1, 0)}

    def test_plain_python_is_a_world_of_one(self):
        """World size 1: the script under plain python."""
        result = subprocess.run([sys.executable, WORKER], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                                timeout=HANG_GUARD)
        assert result.returncode == 0, result.stderr
        assert sums_by_rank(result.stdout) == {0: (1, 0, 0)}


class TestFailures:
    """World size 2: a failing rank stops the group, is named, and its traceback comes last."""

    def test_restart_after_a_failure_finishes_the_run(self):
        """World size 2, --max-restarts 1: rank 1 fails on the first attempt."""
        result = phalanx_run("--nproc-per-node", "2", "--max-restarts", "1", WORKER, "--fail-rank", "1")
        assert result.returncode == 0, result.stderr
        assert "rank 1" in result.stderr and "ValueError: rank 1 fails on purpose" in result.stderr
        assert "attempt 2 of 2" in result.stderr
        assert {rank: attempt for rank, (_, _, attempt) in sums_by_rank(result.stdout).items()} == {0: 1, 1: 1}

    def test_failure_stops_every_process_and_prints_the_traceback_last(self, tmp_path):
        """World size 2: rank 1 fails; rank 0 and both DataLoader workers are stopped."""
        started = time.monotonic()
        result = phalanx_run("--nproc-per-node", "2", WORKER, "--fail-rank", "1", "--pid-dir", str(tmp_path))
        # Rank 0 sleeps for 600 s after its loader starts: returning at all means it was stopped.
        assert time.monotonic() - started < HANG_GUARD
        assert result.returncode != 0
        lines = result.stderr.rstrip().splitlines()
        header = max(i for i, line in enumerate(lines) if line.startswith("phalanx run: traceback of rank 1"))
        traceback_lines = lines[header + 1:]
        assert traceback_lines[0] == "Traceback (most recent call last):"
        assert any("launch_worker.py" in line for line in traceback_lines)
        assert traceback_lines[-1] == "ValueError: rank 1 fails on purpose"
        assert "<N/A>" not in result.stderr and "error_file" not in result.stderr

        pids = {path.name: int(path.read_text()) for path in tmp_path.glob("*.pid")}
        assert set(pids) == {"rank0-main.pid", "rank0-loader.pid", "rank1-main.pid", "rank1-loader.pid"}
        deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
        while time.monotonic() < deadline and not all(map(is_gone, pids.values())):
            time.sleep(0.1)
        assert [name for name, pid in pids.items() if not is_gone(pid)] == []

    def test_sigterm_to_the_launcher_stops_every_process(self, tmp_path):
        # What a scheduler does at the end of a job's time: nothing of the run may outlive it.
        """World size 2: SIGTERM to the launcher."""
        launcher = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", WORKER,
                                     "--pid-dir", str(tmp_path)], env=clean_env(), cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + HANG_GUARD
            while len(list(tmp_path.glob("*.pid"))) < 4 and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            launcher.send_signal(signal.SIGTERM)
            _, stderr = launcher.communicate(timeout=HANG_GUARD)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
        assert launcher.returncode == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM" in stderr
        pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
        assert len(pids) == 4
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(map(is_gone, pids)):
            time.sleep(0.1)
        assert [pid for pid in pids if not is_gone(pid)] == []

    def test_busy_master_port_is_reported(self):
        """World size 2: the master port is taken."""
        import socket

        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            result = phalanx_run("--nproc-per-node", "2", "--master-port", str(port), WORKER)
        assert result.returncode != 0
        assert f"port {port} is already in use" in result.stderr


def _on_each_host(hosts, python_args, env=None) -> tuple[list, list]:
    """Python with `python_args(node_rank)` in each host's namespace, at once (`env`: more variables);
    their processes and (stdout, stderr). Whatever still runs when this returns or fails (a hang, an
    error) is killed."""
    nodes = []
    try:
        for node_rank, host in enumerate(hosts):
            command = ["ip", "netns", "exec", host["ns"], sys.executable, *python_args(node_rank)]
            nodes.append(subprocess.Popen(command, env=clean_env(**(env or {})), cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        return nodes, [node.communicate(timeout=HANG_GUARD) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: ({"ns", "addr", "dev"} for host 0, for host 1)."""
    try:  # NamespaceUnavailable without iproute2 too, saying how to install it
        with veth_hosts("phx", 213) as hosts:
            yield hosts
    except NamespaceUnavailable as exc:
        pytest.skip(f"multi-node test skipped: {exc}")


class TestTwoNodes:
    """2 nodes x 1 worker, each node its own network namespace: a real rendezvous over a network link."""

    @pytest.mark.smoke
    def test_all_reduce_across_two_nodes(self, two_hosts):
        """World size 2: 2 nodes x 1 worker, each node a network namespace."""
        master = two_hosts[0]["addr"]
        # Inside a namespace the host name leads nowhere: phalanx finds Gloo's interface (no
        # GLOO_SOCKET_IFNAME), by the route to the master.
        nodes, outputs = _on_each_host(two_hosts, lambda node_rank: [
            "-m", "phalanx", "run", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--master-addr", master, "--master-port", "29555", "--rdzv-timeout", "120", WORKER])
        for node, (_, stderr), host in zip(nodes, outputs, two_hosts):
            assert node.returncode == 0, stderr
            assert f"phalanx run: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME={host['dev']} ({host['addr']}), the " \
                   f"interface of the route to the master {master}" in stderr
        assert sums_by_rank(outputs[0][0]) == {0: (2, 1, 0)}
        assert sums_by_rank(outputs[1][0]) == {1: (2, 1, 0)}

    def test_torchrun_across_two_nodes_finds_the_interface_in_init(self, two_hosts):
        """World size 2: 2 nodes x 1 worker under torchrun; phalanx.init() names Gloo's interface."""
        master = two_hosts[0]["addr"]
        nodes, outputs = _on_each_host(two_hosts, lambda node_rank: [
            "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1",
            "--master-addr", master, "--master-port", "29556", WORKER])
        for node, (_, stderr) in zip(nodes, outputs):
            assert node.returncode == 0, stderr
        assert sums_by_rank(outputs[0][0]) == {0: (2, 1, 0)}
        assert sums_by_rank(outputs[1][0]) == {1: (2, 1, 0)}
        host = two_hosts[0]  # rank 0 logs it
        assert f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME={host['dev']} ({host['addr']}), the interface of the " \
               f"route to the master {master}" in outputs[0][1]


def test_a_script_written_for_torch_ddp_runs_unmodified_with_phalanx_ddp_in_its_place():
    """World size 2: `phalanx run -m phalanx.integrations.with_phalanx_ddp script.py ARGS` builds phalanx's class where
    the script names torch's; the ranks end with the same parameters and the script sees its own arguments."""
    job = Path(__file__).resolve().parent / "jobs" / "torch_ddp_by_name.py"
    result = phalanx_run("--nproc-per-node", "2", "-m", "phalanx.integrations.with_phalanx_ddp", str(job), "--lr", "1")
    assert result.returncode == 0, result.stderr
    lines = re.findall(r"rank=(\d) class=(\S+) torch_name_is_it=(\w+) checksum=(\S+) argv=(.*)", result.stdout)
    assert sorted(line[0] for line in lines) == ["0", "1"], result.stdout
    assert {line[1:3] for line in lines} == {("phalanx.engine.ddp.DistributedDataParallel", "True")}
    assert len({line[3] for line in lines}) == 1  # replicas agree
    assert {line[4] for line in lines} == {"['--lr', '1']"}

"""PHALANX_WARM_LAUNCHER: `phalanx` commands forked from a server that imported torch once, end to end.

A command forked from the server must be the command a fresh process would have been: its arguments,
environment, working directory, standard streams and exit status; the signals sent to it reach it, and
killing it kills its process. A command whose import-time environment differs runs fresh and says why;
so does one whose server cannot be reached. This file starts a server of its own (its log is read), apart
from the one tests/conftest.py gives the other e2e tests.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.diagnose.recorder import pid_alive
from tests.conftest import ROOT, checkout_on_pythonpath
from tests.helpers.namespaces import NamespaceUnavailable, etc_files, veth_hosts
from tests.helpers.system_packages import UNSHARE

HANG_GUARD = 120

SCRIPT = """
import json, os, socket, sys, time
rank = int(os.environ["RANK"])
here = {"rank": rank, "argv": sys.argv[1:], "cwd": os.getcwd(), "value": os.environ.get("PHALANX_TEST_VALUE"),
        "host": socket.gethostname(), "links": sorted(os.listdir("/sys/class/net")), "hosts": open("/etc/hosts").read(),
        "launcher": int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1])}
here["launcher_name"] = open(f"/proc/{here['launcher']}/comm").read().strip()
print("REPORT " + json.dumps(here), flush=True)
if "--sleep" in sys.argv:
    open(os.path.join(os.environ["PHALANX_TEST_OUT"], f"ready-{rank}"), "w").write(f"{here['launcher']} {os.getpid()}")
    time.sleep(600)
sys.exit(3 if "--fail" in sys.argv and rank == 0 else 0)
"""


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "PHALANX_", "PYTEST_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"PYTHONPATH": checkout_on_pythonpath(), "OMP_NUM_THREADS": "1", **extra})
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm")
    socket_path, log_path = folder / "launcher.sock", folder / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "phalanx", "warm", "--socket", str(socket_path)],
                                   env=base_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + HANG_GUARD
    while not socket_path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert socket_path.exists(), log_path.read_text()
    yield {"socket": str(socket_path), "log": log_path}
    process.terminate()
    assert process.wait(timeout=60) == 0, log_path.read_text()
    assert not socket_path.exists()  # it removed its socket


def log_lines(server) -> list[dict]:
    return [json.loads(line) for line in server["log"].read_text().splitlines() if line.startswith("{")]


def launch(tmp_path: Path, env: dict, *script_args, wait=True, where=()):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    command = [*where, sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "2", str(script), *script_args]
    if not wait:
        return subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD)


def reports(output: str) -> list[dict]:
    return sorted((json.loads(line.split("REPORT ", 1)[1]) for line in output.splitlines() if "] REPORT {" in line),
                  key=lambda report: report["rank"])


def test_a_warm_command_is_the_command_a_fresh_process_would_have_been(server, tmp_path):
    """World size 2: the same script, fresh and warm: the same arguments, environment, working directory and
    exit status in every worker; the warm launcher was forked by the server (its log names it)."""
    fresh = launch(tmp_path, base_env(PHALANX_TEST_VALUE="v1"), "a b", "--fail")
    before = len(log_lines(server))
    warm = launch(tmp_path, base_env(PHALANX_TEST_VALUE="v1", PHALANX_WARM_LAUNCHER=server["socket"]),
                  "a b", "--fail")
    assert fresh.returncode == warm.returncode != 0, (fresh.stderr, warm.stderr)
    launchers = ("launcher", "launcher_name")
    strip = [{k: v for k, v in report.items() if k not in launchers} for report in reports(warm.stdout)]
    assert strip == [{k: v for k, v in report.items() if k not in launchers} for report in reports(fresh.stdout)]
    assert [{k: report[k] for k in ("rank", "argv", "cwd", "value")} for report in strip] == [
        {"rank": r, "argv": ["a b", "--fail"], "cwd": str(tmp_path), "value": "v1"} for r in (0, 1)]
    assert "starting fresh" not in warm.stderr and "exited with code 3" in warm.stderr, warm.stderr
    entries = log_lines(server)[before:]
    started = [e for e in entries if "started" in e]
    assert len(started) == 1 and started[0]["argv"][:1] == ["run"], entries
    assert {r["launcher"] for r in reports(warm.stdout)} == {started[0]["started"]}
    assert {r["launcher_name"] for r in reports(warm.stdout)} == {"phalanx run"}  # in top and `ps -o comm`
    assert any(e.get("ended") == started[0]["started"] and e["exit"] == warm.returncode for e in entries), entries


def test_a_command_in_other_namespaces_is_forked_into_them(server, tmp_path):
    """World size 2, the command in a network namespace with a host name and an /etc/hosts of its own (`ip netns
    exec NS unshare --uts`, as a multi-node test makes a host): fresh and warm, the workers see the same host
    name, network links and /etc/hosts, the namespace's; the warm one was forked (the server enters them)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a server enters a command's namespaces as root only")
    UNSHARE.require()
    try:  # NamespaceUnavailable without iproute2 too, saying how to install it
        with veth_hosts("pxw", 219) as hosts:
            host = hosts[1]
            with etc_files(host["ns"], {"hosts": f"{host['addr']} node-b\n"}):
                where = ["ip", "netns", "exec", host["ns"], "unshare", "--uts", "sh", "-c",
                         'hostname node-b && exec "$@"', "sh"]
                fresh = launch(tmp_path, base_env(), where=where)
                before = len(log_lines(server))
                warm = launch(tmp_path, base_env(PHALANX_WARM_LAUNCHER=server["socket"]), where=where)
    except NamespaceUnavailable as error:
        pytest.skip(str(error))
    assert fresh.returncode == warm.returncode == 0, (fresh.stderr, warm.stderr)
    assert "starting fresh" not in warm.stderr, warm.stderr
    assert [e["argv"][:1] for e in log_lines(server)[before:] if "started" in e] == [["run"]]
    launchers = ("launcher", "launcher_name")
    seen = [{k: v for k, v in report.items() if k not in launchers} for report in reports(warm.stdout)]
    assert seen == [{k: v for k, v in report.items() if k not in launchers} for report in reports(fresh.stdout)]
    assert [(r["host"], r["links"], r["hosts"]) for r in seen] == [
        ("node-b", sorted(["lo", host["dev"]]), f"{host['addr']} node-b\n")] * 2


def test_a_command_whose_import_time_environment_differs_runs_fresh_and_says_why(server, tmp_path):
    """World size 2: OMP_NUM_THREADS, read while torch is imported, differs from the server's."""
    done = launch(tmp_path, base_env(OMP_NUM_THREADS="2", PHALANX_WARM_LAUNCHER=server["socket"]))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("starting fresh, not from the warm launcher") == 1, done.stderr
    assert "OMP_NUM_THREADS" in done.stderr and len(reports(done.stdout)) == 2


def test_an_unreachable_server_is_skipped_in_one_line(tmp_path):
    """World size 2: PHALANX_WARM_LAUNCHER names no socket: the command runs fresh."""
    done = launch(tmp_path, base_env(PHALANX_WARM_LAUNCHER=str(tmp_path / "none.sock")))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("cannot be reached") == 1 and len(reports(done.stdout)) == 2, done.stderr


def wait_ready(out: Path, ranks: int = 2) -> tuple[int, list[int]]:
    """The launcher's pid and the workers' pids, once every worker wrote them; the files are then removed."""
    deadline = time.monotonic() + HANG_GUARD
    while len([path for path in out.glob("ready-*") if path.read_text().count(" ") == 1]) < ranks:
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    found = [tuple(map(int, path.read_text().split())) for path in sorted(out.glob("ready-*"))]
    for path in out.glob("ready-*"):
        path.unlink()
    return found[0][0], [worker for _, worker in found]


def test_a_signal_to_the_command_reaches_its_process_and_a_killed_command_takes_it_along(server, tmp_path):
    """World size 2, twice: SIGTERM to the command stops the run as it stops a fresh one (the workers are
    stopped, the exit is not 0); SIGKILL to the command (nothing can be passed on) kills its process and the
    workers it started, as `kill -9` of a fresh command's process tree would."""
    env = base_env(PHALANX_WARM_LAUNCHER=server["socket"], PHALANX_TEST_OUT=str(tmp_path))
    command = launch(tmp_path, env, "--sleep", wait=False)
    launcher, workers = wait_ready(tmp_path)
    assert launcher != command.pid
    command.send_signal(signal.SIGTERM)
    _, err = command.communicate(timeout=HANG_GUARD)
    assert command.returncode not in (0, -signal.SIGTERM), err
    assert not pid_alive(launcher) and not any(map(pid_alive, workers)), err
    command = launch(tmp_path, env, "--sleep", wait=False)
    launcher, workers = wait_ready(tmp_path)
    command.kill()
    command.wait(timeout=HANG_GUARD)
    try:
        deadline = time.monotonic() + 10
        while (pid_alive(launcher) or any(map(pid_alive, workers))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(launcher), "the killed command's launcher runs on"
        assert not any(map(pid_alive, workers)), "the killed command's workers run on"
    finally:
        end_orphans(workers)


def end_orphans(workers: list[int]) -> None:
    """A launcher killed with SIGKILL leaves its workers running, fresh or warm: this test's own, ended by pid."""
    for pid in workers:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_command_whose_process_dies_of_a_signal_dies_of_it_too(server, tmp_path):
    """World size 2: the forked launcher is killed with SIGKILL; the command ends as if it had been."""
    env = base_env(PHALANX_WARM_LAUNCHER=server["socket"], PHALANX_TEST_OUT=str(tmp_path))
    command = launch(tmp_path, env, "--sleep", wait=False)
    launcher, workers = wait_ready(tmp_path)
    try:
        os.kill(launcher, signal.SIGKILL)
        command.communicate(timeout=HANG_GUARD)
        assert command.returncode == -signal.SIGKILL
    finally:
        end_orphans(workers)

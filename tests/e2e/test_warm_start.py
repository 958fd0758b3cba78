"""Workers forked from the fork server of `phalanx run` (launch/forkserver/): the process each one gets is
the one a fresh interpreter would have been, and `--start-method spawn` still gives fresh ones.

World size 1 and 2 on one node; the server is driven directly, as the launcher drives it, and through
`phalanx run`.
"""

import json
import os
import signal
import sys
import textwrap

import pytest

from phalanx.launch.forkserver.elastic_handler import _forked_handler
from phalanx.launch.forkserver.server import WORKER_ENTRY, ForkedWorker, WorkerServer
from tests.e2e.test_launch import clean_env, phalanx_run

REPORT = textwrap.dedent("""
    import json, os, random, sys
    import numpy, torch
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "cwd": os.getcwd(),
                      "argv": sys.argv, "env": os.environ.get("PHALANX_TEST_WORKER"), "main": __name__,
                      "threads": torch.get_num_threads(), "numpy": int(numpy.random.randint(1 << 30)),
                      "random": random.random(), "path0": sys.path[0],
                      "parent": open(f"/proc/{os.getppid()}/cmdline").read().split(chr(0))[:4],
                      "cmdline": open("/proc/self/cmdline").read().split(chr(0))[:4]}))
    sys.stderr.write("to stderr\\n")
    code = int(os.environ.get("PHALANX_TEST_EXIT", "0"))
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)
""")


@pytest.fixture
def server():
    started = WorkerServer.spawn()
    yield started
    started.close()


def _start(server, tmp_path, name, env_extra=None, args=()):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    env = {**server.environment, "PHALANX_TEST_WORKER": name, **(env_extra or {})}
    worker = server.start([str(script), *args], env, str(tmp_path), {1: out, 2: err})
    out.close()
    err.close()
    assert worker is not None, "the fork server refused a plain request"
    return worker


def _report(tmp_path, name) -> dict:
    return _forked(json.loads((tmp_path / f"{name}.out").read_text()))


def _forked(report: dict) -> dict:
    """report["forked"]: the process was forked from a server, not started as `python -u worker_entry.py`."""
    command = report["cmdline"]
    report["forked"] = not (command[1:3] == ["-u", WORKER_ENTRY] and command[3] != "--serve")
    return report


def test_a_forked_worker_gets_its_own_environment_streams_session_and_exit_code(server, tmp_path):
    """World size 1, two workers from one server: each sees its own variables, arguments, output files,
    a session of its own (the launcher signals the group), and its exit code reaches the launcher."""
    first = _start(server, tmp_path, "first", {"PHALANX_TEST_EXIT": "3"}, args=("--lr", "0.1"))
    second = _start(server, tmp_path, "second")
    assert first.wait(60) == 3 and second.wait(60) == 0
    one, two = _report(tmp_path, "first"), _report(tmp_path, "second")
    assert one["env"] == "first" and two["env"] == "second"
    assert one["argv"] == [str(tmp_path / "report.py"), "--lr", "0.1"]
    assert one["main"] == "__main__" and one["cwd"] == str(tmp_path) and one["path0"] == str(tmp_path)
    assert one["pid"] == first.pid and one["sid"] == first.pid, "a worker leads a session of its own"
    assert one["ppid"] == server.pid and one["forked"], "the worker is a fork of the server"
    assert (tmp_path / "first.err").read_text() == "to stderr\n"
    assert one["numpy"] != two["numpy"] and one["random"] != two["random"], \
        "forked workers must not share the server's random streams"


def test_a_worker_killed_by_a_signal_reports_it_as_popen_does(server, tmp_path):
    """World size 1: the exit code of a worker that dies of SIGKILL is -9, as Popen.returncode says."""
    worker = _start(server, tmp_path, "killed", {"PHALANX_TEST_EXIT": str(-int(signal.SIGKILL))})
    assert worker.wait(60) == -signal.SIGKILL
    assert worker.poll() == -signal.SIGKILL


def test_a_variable_read_while_torch_imports_gets_a_fresh_interpreter(server, tmp_path):
    """World size 1: a worker whose OMP_NUM_THREADS differs from the server's cannot inherit the server's
    thread pool settings, so it executes a fresh interpreter (which reads the variable), same pid."""
    threads = 1 if os.environ.get("OMP_NUM_THREADS") != "1" else 2
    worker = _start(server, tmp_path, "fresh", {"OMP_NUM_THREADS": str(threads)})
    assert worker.wait(120) == 0
    report = _report(tmp_path, "fresh")
    assert report["threads"] == threads and report["pid"] == worker.pid and not report["forked"]


def test_a_wait_that_runs_out_raises_timeout_expired(server, tmp_path):
    """World size 1: torch elastic's close() relies on Popen.wait(timeout) raising TimeoutExpired."""
    import subprocess

    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    worker = server.start([str(script)], server.environment, str(tmp_path), {})
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.2)
    worker.kill()
    assert worker.wait(30) == -signal.SIGKILL


def test_closing_a_worker_the_server_reaped_before_its_exit_message_came(server, tmp_path):
    """World size 1: torch elastic closes every worker that poll() calls running when another fails. A forked
    worker's exit reaches the launcher as a message after the server reaped it: closed in between, its process
    group is gone. The close must still succeed (it raised ProcessLookupError and failed the launcher)."""
    script = tmp_path / "quick.py"
    script.write_text("")
    handler = _forked_handler(server)(sys.executable, ("-u", WORKER_ENTRY, str(script)), server.environment,
                                      str(tmp_path / "out"), str(tmp_path / "err"), 0, None)
    worker = handler.proc
    assert isinstance(worker, ForkedWorker), "the worker was not forked from the server"
    assert worker.wait(60) == 0
    with server._changed:  # back to the moment before its exit message arrived
        server._exits.pop(worker.pid)
    worker.returncode = None
    assert worker.poll() is None
    handler.close(signal.SIGTERM)
    assert handler._stdout.closed and handler._stderr.closed


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_phalanx_run_starts_workers_by_either_method(tmp_path, method):
    """World size 2 under `phalanx run --start-method`: forked workers are forks of the server that the launcher
    forked from itself, spawned ones fresh interpreters; both run the script the same way."""
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = clean_env(PHALANX_TEST_WORKER="any")
    env.pop("PHALANX_WARM_LAUNCHER", None)  # the launcher as a fresh `python -m phalanx run` (its command line)
    result = phalanx_run("--nproc-per-node", "2", "--start-method", method, str(script), "x", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    reports = [_forked(json.loads(line.split("] ", 1)[1])) for line in result.stdout.splitlines() if '"pid"' in line]
    assert len(reports) == 2 and all(r["argv"] == [str(script), "x"] for r in reports)
    assert len({r["ppid"] for r in reports}) == 1
    assert all(r["sid"] == r["pid"] for r in reports)
    # The launcher is `python -m phalanx run`; the fork server is a fork of it (the same command line).
    assert reports[0]["parent"][:4] == [sys.executable, "-m", "phalanx", "run"], reports[0]["parent"]
    if method == "forkserver":
        assert all(r["forked"] for r in reports), "a worker of `phalanx run` executed a fresh interpreter"
    else:
        assert not any(r["forked"] for r in reports)


ENDING = textwrap.dedent("""
    import atexit, os, sys, threading, time
    out = sys.argv[1]
    left_open = open(os.path.join(out, "unclosed.txt"), "w")  # never closed: the interpreter's end flushes it
    left_open.write("written, never closed")
    binary = open(os.path.join(out, "unclosed.bin"), "wb")
    binary.write(b"bytes, never closed")
    atexit.register(lambda: open(os.path.join(out, "atexit.txt"), "w").write("atexit ran"))

    def late():
        time.sleep(0.5)
        open(os.path.join(out, "thread.txt"), "w").write("the non-daemon thread finished")
    threading.Thread(target=late).start()
    print("stdout without a flush", end="")
    sys.exit(sys.argv[2] if not sys.argv[2].isdigit() else int(sys.argv[2]))
""")


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("exit_with", ["7", "a message"])
def test_a_worker_ends_as_python_ends_its_script(tmp_path, method, exit_with):
    """World size 1 under `phalanx run`: a forked worker skips the interpreter's teardown of the heap it shares with
    the server (seconds of CPU), and nothing a script relies on at its end is lost: files left open are
    flushed (also when a thread's function keeps the script's globals alive), atexit handlers run, non-daemon
    threads finish, buffered stdout arrives, and the exit code is the one `python script.py` gives (sys.exit(7):
    7; sys.exit("a message"): the message on stderr and 1). Spawned workers, fresh interpreters, end the same way."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    out = tmp_path / "out"
    out.mkdir()
    result = phalanx_run("--nproc-per-node", "1", "--max-restarts", "0", "--start-method", method, str(script),
                         str(out), exit_with, env=clean_env(), cwd=tmp_path)
    assert (out / "unclosed.txt").read_text() == "written, never closed"
    assert (out / "unclosed.bin").read_bytes() == b"bytes, never closed"
    assert (out / "atexit.txt").read_text() == "atexit ran"
    assert (out / "thread.txt").read_text() == "the non-daemon thread finished"
    assert "stdout without a flush" in result.stdout
    code = 7 if exit_with == "7" else 1
    assert f"rank 0 (pid {result.stderr.split('rank 0 (pid ')[-1].split(')')[0]}) exited with code {code}." \
        in result.stderr, result.stderr
    if exit_with != "7":
        assert "[rank 0] a message" in result.stderr, result.stderr
    assert result.returncode == code
